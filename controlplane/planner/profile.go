package planner

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"time"
)

// ProfileVersion is the version of the profile format Profile reads and writes.
const ProfileVersion = 1

// Profile is a worker's measured performance, as `kvrelay profile` writes it. Latencies are
// in milliseconds and throughputs in tokens per second, as measured (a simulated engine
// sped up by a ratio is measured at its speed).
type Profile struct {
	Version int `json:"version"`
	// Target is the endpoint measured; Model and Role what it serves.
	Target string `json:"target,omitempty"`
	Model  string `json:"model,omitempty"`
	Role   string `json:"role,omitempty"`
	// MeasuredAt is when the measurement ended.
	MeasuredAt time.Time `json:"measured_at,omitzero"`
	// Prefill points: TTFT and prompt tokens/s at each input length and concurrency.
	Prefill []PrefillPoint `json:"prefill,omitempty"`
	// Decode points: ITL and output tokens/s at each context length and concurrency.
	Decode []DecodePoint `json:"decode,omitempty"`
}

// PrefillPoint is one prefill measurement: Concurrency requests of ISL prompt tokens kept in
// flight with max_tokens 1.
type PrefillPoint struct {
	ISL         float64 `json:"isl"`
	Concurrency float64 `json:"concurrency"`
	// TTFTMs is the mean time to first token.
	TTFTMs float64 `json:"ttft_ms"`
	// Throughput is prompt tokens per second over the measurement.
	Throughput float64 `json:"throughput"`
}

// DecodePoint is one decode measurement: Concurrency streams at Context tokens of context.
type DecodePoint struct {
	Context     float64 `json:"context"`
	Concurrency float64 `json:"concurrency"`
	// ITLMs is the mean inter-token latency.
	ITLMs float64 `json:"itl_ms"`
	// Throughput is output tokens per second over the decode phase.
	Throughput float64 `json:"throughput"`
	// KVUsage is the worker's KV cache usage (0 to 1) during the measurement, when read.
	KVUsage float64 `json:"kv_usage,omitempty"`
}

// ErrProfile is wrapped by every error about a malformed profile.
var ErrProfile = errors.New("invalid profile")

// LoadProfile reads and validates a profile file.
func LoadProfile(path string) (*Profile, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("loading profile: %w", err)
	}
	p, err := ParseProfile(data)
	if err != nil {
		return nil, fmt.Errorf("loading profile %s: %w", path, err)
	}
	return p, nil
}

// ParseProfile decodes and validates a profile's JSON.
func ParseProfile(data []byte) (*Profile, error) {
	p := new(Profile)
	if err := json.Unmarshal(data, p); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrProfile, err)
	}
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return p, nil
}

// Save writes the profile as indented JSON.
func (p *Profile) Save(path string) error {
	data, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return fmt.Errorf("saving profile: %w", err)
	}
	if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("saving profile: %w", err)
	}
	return nil
}

// Validate checks that every point is finite and positive.
func (p *Profile) Validate() error {
	if p.Version != 0 && p.Version != ProfileVersion {
		return fmt.Errorf("%w: version %d, this kvrelay reads %d", ErrProfile, p.Version, ProfileVersion)
	}
	if len(p.Prefill) == 0 && len(p.Decode) == 0 {
		return fmt.Errorf("%w: no prefill and no decode points", ErrProfile)
	}
	ok := func(vs ...float64) bool {
		for _, v := range vs {
			if math.IsNaN(v) || math.IsInf(v, 0) || v <= 0 {
				return false
			}
		}
		return true
	}
	for i, q := range p.Prefill {
		if !ok(q.ISL, q.Concurrency, q.TTFTMs, q.Throughput) {
			return fmt.Errorf("%w: prefill point %d %+v: every field must be positive", ErrProfile, i, q)
		}
	}
	for i, q := range p.Decode {
		if !ok(q.Context, q.Concurrency, q.ITLMs, q.Throughput) {
			return fmt.Errorf("%w: decode point %d %+v: every field must be positive", ErrProfile, i, q)
		}
	}
	return nil
}

// HasPrefill and HasDecode report whether the profile has points of each phase.
func (p *Profile) HasPrefill() bool { return p != nil && len(p.Prefill) > 0 }
func (p *Profile) HasDecode() bool  { return p != nil && len(p.Decode) > 0 }

// PrefillThroughput is one replica's prompt tokens/s at input length isl with the TTFT at
// most target: the throughput at the highest concurrency whose TTFT meets the target
// (interpolated between measured concurrencies, then between input lengths). met is false
// when even one request at a time misses the target; the throughput is then that of one at a
// time, and adding replicas cannot meet the target.
func (p *Profile) PrefillThroughput(target time.Duration, isl float64) (tps float64, met bool) {
	return atTarget(p.prefillCurves(), ms(target), isl)
}

// DecodeThroughput is one replica's output tokens/s at context length ctx with the ITL at
// most target, as PrefillThroughput.
func (p *Profile) DecodeThroughput(target time.Duration, ctx float64) (tps float64, met bool) {
	return atTarget(p.decodeCurves(), ms(target), ctx)
}

// TTFT is the profiled time to first token at input length isl and concurrency conc
// (interpolated; extrapolated linearly past the highest measured concurrency).
func (p *Profile) TTFT(isl, conc float64) time.Duration {
	return fromMs(latencyAt(p.prefillCurves(), isl, conc))
}

// ITL is the profiled inter-token latency at context ctx and concurrency conc.
func (p *Profile) ITL(ctx, conc float64) time.Duration {
	return fromMs(latencyAt(p.decodeCurves(), ctx, conc))
}

func ms(d time.Duration) float64     { return float64(d) / float64(time.Millisecond) }
func fromMs(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

// curve is the points measured at one input (or context) length, by rising concurrency.
type curve struct {
	x         float64
	conc, lat []float64
	tps       []float64
}

func (p *Profile) prefillCurves() []curve {
	if p == nil {
		return nil
	}
	pts := make([][4]float64, len(p.Prefill))
	for i, q := range p.Prefill {
		pts[i] = [4]float64{q.ISL, q.Concurrency, q.TTFTMs, q.Throughput}
	}
	return curves(pts)
}

func (p *Profile) decodeCurves() []curve {
	if p == nil {
		return nil
	}
	pts := make([][4]float64, len(p.Decode))
	for i, q := range p.Decode {
		pts[i] = [4]float64{q.Context, q.Concurrency, q.ITLMs, q.Throughput}
	}
	return curves(pts)
}

// curveTolerance is how far apart (relative to the smallest) the lengths of one curve's
// points may be. A profile records the lengths it measured, not the ones it asked for: the
// points of one input length come out a few tokens apart (the prompts are random words, and a
// decode point's context adds the outputs), and must still make one curve.
const curveTolerance = 0.1

// curves groups (x, concurrency, latency, throughput) points by x: points whose x lie within
// curveTolerance of the group's smallest make one curve at their mean x, ordered by
// concurrency.
func curves(pts [][4]float64) []curve {
	slices.SortFunc(pts, func(a, b [4]float64) int {
		if a[0] != b[0] {
			return cmpf(a[0], b[0])
		}
		return cmpf(a[1], b[1])
	})
	var out []curve
	for i := 0; i < len(pts); {
		j := i + 1
		for j < len(pts) && pts[j][0] <= pts[i][0]*(1+curveTolerance) {
			j++
		}
		group := slices.Clone(pts[i:j])
		slices.SortStableFunc(group, func(a, b [4]float64) int { return cmpf(a[1], b[1]) })
		var c curve
		for _, q := range group {
			c.x += q[0] / float64(len(group))
			c.conc = append(c.conc, q[1])
			c.lat = append(c.lat, q[2])
			c.tps = append(c.tps, q[3])
		}
		out = append(out, c)
		i = j
	}
	return out
}

func cmpf(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// throughputAt is the curve's throughput at the highest load whose latency is at most target.
func (c curve) throughputAt(target float64) (float64, bool) {
	if c.lat[0] > target {
		return c.tps[0], false
	}
	for i := 1; i < len(c.lat); i++ {
		if c.lat[i] <= target {
			continue
		}
		f := (target - c.lat[i-1]) / (c.lat[i] - c.lat[i-1])
		return c.tps[i-1] + f*(c.tps[i]-c.tps[i-1]), true
	}
	// Every measured load meets the target: the best measured, no extrapolation.
	return slices.Max(c.tps), true
}

// latencyAt interpolates the curve's latency at concurrency conc.
func (c curve) latencyAt(conc float64) float64 {
	n := len(c.conc)
	if n == 1 || conc <= c.conc[0] {
		return c.lat[0]
	}
	i := 1
	for i < n-1 && c.conc[i] < conc {
		i++
	}
	f := (conc - c.conc[i-1]) / (c.conc[i] - c.conc[i-1])
	return max(c.lat[0], c.lat[i-1]+f*(c.lat[i]-c.lat[i-1]))
}

// between finds the curves around x and the weight of the upper one (clamped at the ends).
func between(cs []curve, x float64) (lo, hi int, f float64) {
	if x <= cs[0].x {
		return 0, 0, 0
	}
	for i := 1; i < len(cs); i++ {
		if x <= cs[i].x {
			return i - 1, i, (x - cs[i-1].x) / (cs[i].x - cs[i-1].x)
		}
	}
	return len(cs) - 1, len(cs) - 1, 0
}

func atTarget(cs []curve, target, x float64) (float64, bool) {
	if len(cs) == 0 {
		return 0, false
	}
	lo, hi, f := between(cs, x)
	a, okA := cs[lo].throughputAt(target)
	b, okB := cs[hi].throughputAt(target)
	return a + f*(b-a), okA && okB
}

func latencyAt(cs []curve, x, conc float64) float64 {
	if len(cs) == 0 {
		return 0
	}
	lo, hi, f := between(cs, x)
	a, b := cs[lo].latencyAt(conc), cs[hi].latencyAt(conc)
	return a + f*(b-a)
}
