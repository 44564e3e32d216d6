package planner_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/controlplane/planner"
	"github.com/kvrelay/kvrelay/controlplane/planner/plannertest"
)

// knownProfile: at ISL 1000 one replica prefills 15000 tokens/s with TTFT 200 ms (halfway
// between 1 request at 100 ms / 10000 tok/s and 4 at 300 ms / 20000 tok/s); at context 1000
// it decodes 500 tokens/s with ITL 40 ms (halfway between 8 at 20 ms / 400 and 32 at 60 ms /
// 600).
func knownProfile() *planner.Profile {
	return &planner.Profile{
		Version: planner.ProfileVersion,
		Prefill: []planner.PrefillPoint{
			{ISL: 1000, Concurrency: 1, TTFTMs: 100, Throughput: 10000},
			{ISL: 1000, Concurrency: 4, TTFTMs: 300, Throughput: 20000},
			{ISL: 1000, Concurrency: 8, TTFTMs: 700, Throughput: 24000},
			{ISL: 2000, Concurrency: 1, TTFTMs: 250, Throughput: 8000},
			{ISL: 2000, Concurrency: 4, TTFTMs: 650, Throughput: 12000},
		},
		Decode: []planner.DecodePoint{
			{Context: 1000, Concurrency: 1, ITLMs: 10, Throughput: 100},
			{Context: 1000, Concurrency: 8, ITLMs: 20, Throughput: 400},
			{Context: 1000, Concurrency: 32, ITLMs: 60, Throughput: 600},
		},
	}
}

func TestProfileInterpolation(t *testing.T) {
	p := knownProfile()
	tests := []struct {
		name string
		got  func() (float64, bool)
		want float64
		met  bool
	}{
		{"prefill between concurrencies", func() (float64, bool) { return p.PrefillThroughput(200*time.Millisecond, 1000) }, 15000, true},
		{"prefill at the most measured", func() (float64, bool) { return p.PrefillThroughput(time.Second, 1000) }, 24000, true},
		{"prefill target unreachable", func() (float64, bool) { return p.PrefillThroughput(50*time.Millisecond, 1000) }, 10000, false},
		{"prefill between input lengths", func() (float64, bool) { return p.PrefillThroughput(250*time.Millisecond, 1500) }, (17500 + 8000) / 2, true},
		{"prefill beyond the longest input clamps", func() (float64, bool) { return p.PrefillThroughput(250*time.Millisecond, 9000) }, 8000, true},
		{"decode between concurrencies", func() (float64, bool) { return p.DecodeThroughput(40*time.Millisecond, 1000) }, 500, true},
		{"decode at one stream", func() (float64, bool) { return p.DecodeThroughput(10*time.Millisecond, 1000) }, 100, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, met := tc.got()
			if math.Abs(got-tc.want) > 1e-6 || met != tc.met {
				t.Errorf("got %v (met %v), want %v (met %v)", got, met, tc.want, tc.met)
			}
		})
	}
	if got := p.TTFT(1000, 2.5); got != 200*time.Millisecond {
		t.Errorf("TTFT(1000, 2.5) = %v, want 200ms", got)
	}
	if got := p.ITL(1000, 20); got != 40*time.Millisecond {
		t.Errorf("ITL(1000, 20) = %v, want 40ms", got)
	}
}

func TestProfileSaveLoad(t *testing.T) {
	path := t.TempDir() + "/p.json"
	if err := knownProfile().Save(path); err != nil {
		t.Fatal(err)
	}
	p, err := planner.LoadProfile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Prefill) != 5 || len(p.Decode) != 3 {
		t.Errorf("loaded %d prefill, %d decode points", len(p.Prefill), len(p.Decode))
	}
	bad := &planner.Profile{Prefill: []planner.PrefillPoint{{ISL: 1, Concurrency: 1, TTFTMs: -1, Throughput: 1}}}
	if err := bad.Validate(); !errors.Is(err, planner.ErrProfile) {
		t.Errorf("negative TTFT: %v", err)
	}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func disaggConfig() planner.Config {
	cfg := planner.DefaultConfig()
	prof := knownProfile()
	cfg.Pools = map[planner.Pool]planner.PoolLimits{planner.PoolPrefill: {Min: 1, Max: 10}, planner.PoolDecode: {Min: 1, Max: 10}}
	cfg.Profiles = map[planner.Pool]*planner.Profile{planner.PoolPrefill: prof, planner.PoolDecode: prof}
	cfg.TTFT, cfg.ITL = 200*time.Millisecond, 40*time.Millisecond
	cfg.Interval, cfg.LoadInterval = time.Minute, time.Minute
	cfg.ScaleBackoff = time.Millisecond
	cfg.Logger = quiet()
	return cfg
}

// obs is an interval of traffic at rate req/s of isl in and osl out tokens.
func obs(at time.Time, rate, isl, osl float64) planner.Observation {
	n := rate * 60
	return planner.Observation{At: at, Window: time.Minute, Requests: n, PromptTokens: n * isl, OutputTokens: n * osl}
}

func TestThroughputModeReplicaMath(t *testing.T) {
	tests := []struct {
		name         string
		rate         float64
		prefill, dec int
	}{
		// 30 req/s × 1000 tokens = 30000 tokens/s ÷ 15000 = 2 prefill; 30 × 100 = 3000 ÷ 500 = 6 decode.
		{"exact multiples", 30, 2, 6},
		// 10 req/s: 10000 ÷ 15000 = 0.67 → 1; 1000 ÷ 500 = 2.
		{"rounded up", 10, 1, 2},
		// 100 req/s: 6.67 → 7 prefill; 20 decode capped at the maximum 10.
		{"limited by the maximum", 100, 7, 10},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolPrefill: 1, planner.PoolDecode: 1}}
			p, err := planner.New(disaggConfig(), nil, act)
			if err != nil {
				t.Fatal(err)
			}
			ds := p.Step(context.Background(), obs(time.Unix(1000, 0), tc.rate, 1000, 100))
			if len(ds) != 2 {
				t.Fatalf("decisions %+v", ds)
			}
			if act.Sizes[planner.PoolPrefill] != tc.prefill || act.Sizes[planner.PoolDecode] != tc.dec {
				t.Errorf("sizes %v, want prefill %d decode %d; decisions %+v", act.Sizes, tc.prefill, tc.dec, ds)
			}
			for _, d := range ds {
				if d.Mode != planner.ModeThroughput || d.Reason == "" || d.Inputs.PredictedRate != tc.rate {
					t.Errorf("decision %+v", d)
				}
			}
		})
	}
}

func TestGPUBudget(t *testing.T) {
	cfg := disaggConfig()
	cfg.GPUBudget = 6
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolPrefill: 1, planner.PoolDecode: 1}}
	p, err := planner.New(cfg, nil, act)
	if err != nil {
		t.Fatal(err)
	}
	p.Step(context.Background(), obs(time.Unix(1000, 0), 30, 1000, 100)) // wants 2 + 6
	if got := act.Sizes[planner.PoolPrefill] + act.Sizes[planner.PoolDecode]; got > 6 || act.Sizes[planner.PoolPrefill] < 1 {
		t.Errorf("sizes %v over the budget of 6", act.Sizes)
	}
}

// A noisy flat load whose need hovers around a whole number of replicas must not make the
// pool flap; without hysteresis it does (the control).
func TestHysteresisNoOscillation(t *testing.T) {
	run := func(hysteresis float64) int {
		cfg := planner.DefaultConfig()
		prof := knownProfile()
		cfg.Pools = map[planner.Pool]planner.PoolLimits{planner.PoolBoth: {Min: 1, Max: 20}}
		cfg.Profiles = map[planner.Pool]*planner.Profile{planner.PoolBoth: prof}
		cfg.TTFT, cfg.ITL = 200*time.Millisecond, 40*time.Millisecond
		cfg.Interval, cfg.LoadInterval = time.Minute, time.Minute
		cfg.ScaleDownCooldown = 0 // hysteresis alone
		cfg.Hysteresis = hysteresis
		cfg.Logger = quiet()
		act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
		p, err := planner.New(cfg, nil, act)
		if err != nil {
			t.Fatal(err)
		}
		r := rand.New(rand.NewPCG(7, 8))
		at := time.Unix(0, 0)
		for range 100 {
			at = at.Add(time.Minute)
			// need = rate × (1000/15000 + 100/500) = rate × 0.2667: 3 replicas at 11.25 req/s, ± 5%.
			p.Step(context.Background(), obs(at, 11.25*(1+0.05*(2*r.Float64()-1)), 1000, 100))
		}
		// Reversals: a scale-down after a scale-up or the other way round.
		rev, last := 0, 0
		for i := 1; i < len(act.Calls); i++ {
			dir := 1
			if act.Calls[i] < act.Calls[i-1] {
				dir = -1
			}
			if last != 0 && dir != last {
				rev++
			}
			last = dir
		}
		return rev
	}
	if n := run(0.2); n > 0 {
		t.Errorf("with 20%% hysteresis: %d reversals on a flat load, want none", n)
	}
	if n := run(0); n < 5 {
		t.Errorf("control without hysteresis: only %d reversals; the load is not noisy enough to test anything", n)
	}
}

func TestScaleDownCooldown(t *testing.T) {
	cfg := disaggConfig()
	cfg.ScaleDownCooldown = 5 * time.Minute
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolPrefill: 1, planner.PoolDecode: 1}}
	p, _ := planner.New(cfg, nil, act)
	at := time.Unix(1000, 0)
	p.Step(context.Background(), obs(at, 30, 1000, 100)) // up to 2 + 6
	at = at.Add(time.Minute)
	ds := p.Step(context.Background(), obs(at, 5, 1000, 100)) // would go down: cooling
	if act.Sizes[planner.PoolDecode] != 6 || !strings.Contains(ds[1].Reason, "cool-down") {
		t.Errorf("scaled down during the cool-down: %v, %+v", act.Sizes, ds)
	}
	at = at.Add(5 * time.Minute)
	p.Step(context.Background(), obs(at, 3, 1000, 100)) // needs 0.6 decode replicas
	if act.Sizes[planner.PoolDecode] != 1 {
		t.Errorf("after the cool-down: %v, want decode 1", act.Sizes)
	}
}

func TestLoadModeReactsBetweenIntervals(t *testing.T) {
	cfg := disaggConfig()
	cfg.LoadInterval = 5 * time.Second
	cfg.ScaleDownCooldown = 0
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolPrefill: 1, planner.PoolDecode: 1}}
	p, _ := planner.New(cfg, nil, act)
	at := time.Unix(1000, 0)
	p.Step(context.Background(), obs(at, 10, 1000, 100)) // throughput: 1 + 2
	at = at.Add(5 * time.Second)
	hot := planner.Observation{At: at, Window: 5 * time.Second, Workers: []planner.WorkerLoad{
		{ID: "p0", Pool: planner.PoolPrefill, TTFT: 900 * time.Millisecond},
		{ID: "d0", Pool: planner.PoolDecode, ITL: 30 * time.Millisecond},
		{ID: "d1", Pool: planner.PoolDecode, ITL: 90 * time.Millisecond},
	}}
	ds := p.Step(context.Background(), hot)
	if act.Sizes[planner.PoolPrefill] != 2 || act.Sizes[planner.PoolDecode] != 2 || len(ds) != 1 || ds[0].Mode != planner.ModeLoad {
		t.Errorf("load mode: sizes %v decisions %+v; want prefill up one (its only worker is over), decode held (one is under)", act.Sizes, ds)
	}
	at = at.Add(5 * time.Second)
	cold := planner.Observation{At: at, Window: 5 * time.Second, Workers: []planner.WorkerLoad{
		{ID: "p0", Pool: planner.PoolPrefill, TTFT: 10 * time.Millisecond},
		{ID: "p1", Pool: planner.PoolPrefill, TTFT: 10 * time.Millisecond},
	}}
	p.Step(context.Background(), cold)
	if act.Sizes[planner.PoolPrefill] != 1 {
		t.Errorf("load mode down: %v, want prefill back to its floor 1", act.Sizes)
	}
	p.Step(context.Background(), planner.Observation{At: at.Add(5 * time.Second), Window: 5 * time.Second, Workers: cold.Workers[:1]})
	if act.Sizes[planner.PoolPrefill] != 1 {
		t.Errorf("load mode went under the throughput floor: %v", act.Sizes)
	}
}

func TestFailedScaleIsRetriedAndReported(t *testing.T) {
	cfg := disaggConfig()
	cfg.ScaleAttempts = 2
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolPrefill: 1, planner.PoolDecode: 1}, Fail: 3}
	p, _ := planner.New(cfg, nil, act)
	reg := prometheus.NewRegistry()
	reg.MustRegister(p.Collector())
	at := time.Unix(1000, 0)
	ds := p.Step(context.Background(), obs(at, 30, 1000, 100))
	// prefill: 2 failed attempts, reported; decode: 1 failure then success.
	if ds[0].Error == "" || ds[0].Applied || ds[0].Attempts != 2 {
		t.Errorf("prefill decision %+v: want the failure reported after 2 attempts", ds[0])
	}
	if !ds[1].Applied || ds[1].Attempts != 2 {
		t.Errorf("decode decision %+v: want applied on the second attempt", ds[1])
	}
	if got := counter(t, reg, "kvrelay_planner_actuation_errors_total", "prefill"); got != 2 {
		t.Errorf("prefill actuation errors %v, want 2", got)
	}
	// The next step (load mode, nothing to change) retries the pending size.
	ds = p.Step(context.Background(), planner.Observation{At: at.Add(5 * time.Second), Window: 5 * time.Second})
	if act.Sizes[planner.PoolPrefill] != 2 || len(ds) != 1 || ds[0].Mode != "retry" || !ds[0].Applied {
		t.Errorf("after a retry: sizes %v decisions %+v", act.Sizes, ds)
	}
}

func counter(t *testing.T, reg *prometheus.Registry, name, pool string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "pool" && l.GetValue() == pool {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

func TestDryRunDecidesOnly(t *testing.T) {
	cfg := disaggConfig()
	cfg.DryRun = true
	p, err := planner.New(cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ds := p.Step(context.Background(), obs(time.Unix(1000, 0), 30, 1000, 100))
	if ds[1].To != 6 || ds[1].Applied || !ds[1].DryRun || !strings.Contains(ds[1].Reason, "dry run") {
		t.Errorf("dry-run decision %+v", ds[1])
	}
	srv := httptest.NewServer(p.Handler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL + "/v1/planner/decisions?changes=1")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"dry_run": true`) || !strings.Contains(string(body), `"predicted_rate": 30`) {
		t.Errorf("GET /v1/planner/decisions: %d %s", resp.StatusCode, body)
	}
}

// A planner on a control plane replica that follows decides, records why it did not act,
// and leaves the pools alone until its replica leads.
func TestFollowerDecidesOnly(t *testing.T) {
	cfg := disaggConfig()
	follower := errors.New("not the leader: control plane replica cp-1 follows cp-0")
	var lead error = follower
	cfg.Leader = func() error { return lead }
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolPrefill: 1, planner.PoolDecode: 1}}
	p, err := planner.New(cfg, nil, act)
	if err != nil {
		t.Fatal(err)
	}
	ds := p.Step(context.Background(), obs(time.Unix(1000, 0), 30, 1000, 100))
	if ds[1].To != 6 || ds[1].Applied || !strings.Contains(ds[1].Reason, "cp-0") || act.Sizes[planner.PoolDecode] != 1 {
		t.Fatalf("follower's decision %+v, sizes %v", ds[1], act.Sizes)
	}
	lead = nil
	ds = p.Step(context.Background(), obs(time.Unix(1060, 0), 30, 1000, 100))
	if !ds[1].Applied || act.Sizes[planner.PoolDecode] != 6 {
		t.Fatalf("leader's decision %+v, sizes %v", ds[1], act.Sizes)
	}
}

// bothConfig is an aggregated pool of 1 to 20 on knownProfile: at 1000 in and 100 out
// tokens a request needs 1000/15000 + 100/500 = 0.2667 replica-seconds, so 3.75 req/s is
// one replica.
func bothConfig() planner.Config {
	cfg := planner.DefaultConfig()
	cfg.Pools = map[planner.Pool]planner.PoolLimits{planner.PoolBoth: {Min: 1, Max: 20}}
	cfg.Profiles = map[planner.Pool]*planner.Profile{planner.PoolBoth: knownProfile()}
	cfg.TTFT, cfg.ITL = 200*time.Millisecond, 40*time.Millisecond
	cfg.Interval, cfg.LoadInterval = time.Minute, 5*time.Second
	cfg.ScaleBackoff = time.Millisecond
	cfg.Logger = quiet()
	return cfg
}

// window is a load-mode observation: n requests arrived and finished in 5 s.
func window(at time.Time, n, isl, osl float64) planner.Observation {
	return planner.Observation{At: at, Window: 5 * time.Second, Requests: n, Arrivals: n,
		PromptLenSum: n * isl, OutputLenSum: n * osl, LenCount: n, PromptTokens: n * isl, OutputTokens: n * osl}
}

func TestHeadroom(t *testing.T) {
	for _, tc := range []struct {
		headroom float64
		want     int
	}{{0, 2}, {0.2, 3}, {0.5, 3}, {1, 4}} {
		cfg := bothConfig()
		cfg.Headroom = tc.headroom
		act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
		p, _ := planner.New(cfg, nil, act)
		p.Step(context.Background(), obs(time.Unix(1000, 0), 7.5, 1000, 100)) // needs 2.0
		if got := act.Sizes[planner.PoolBoth]; got != tc.want {
			t.Errorf("headroom %v: %d replicas for a need of 2.0, want %d", tc.headroom, got, tc.want)
		}
	}
}

// A step in the load is met at the next load check, several replicas at once, from the
// window's arrivals (taken at their one-sigma lower bound); latency alone would add one.
func TestFastScaleUpOnDemandStep(t *testing.T) {
	cfg := bothConfig()
	cfg.Headroom = 0.2
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
	p, _ := planner.New(cfg, nil, act)
	at := time.Unix(1000, 0)
	p.Step(context.Background(), obs(at, 7.5, 1000, 100)) // 2.0 × 1.2: 3
	if act.Sizes[planner.PoolBoth] != 3 {
		t.Fatalf("throughput mode: %v", act.Sizes)
	}
	// 150 requests in 5 s: at least (150 − √150)/5 = 27.55 req/s, 7.35 replicas, 8.8 with
	// headroom: 9.
	at = at.Add(5 * time.Second)
	ds := p.Step(context.Background(), window(at, 150, 1000, 100))
	if act.Sizes[planner.PoolBoth] != 9 || len(ds) != 1 || ds[0].Mode != planner.ModeLoad || !strings.Contains(ds[0].Reason, "demand") {
		t.Errorf("after a 4× step: sizes %v, decisions %+v; want 9 at once", act.Sizes, ds)
	}
	// Arrivals count, not only completions: an overloaded fleet finishes what it can (30
	// in 5 s) while 150 arrive.
	act2 := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
	p2, _ := planner.New(cfg, nil, act2)
	p2.Step(context.Background(), obs(at, 3, 1000, 100))
	o := window(at.Add(5*time.Second), 30, 1000, 100)
	o.Arrivals = 150
	p2.Step(context.Background(), o)
	if act2.Sizes[planner.PoolBoth] != 9 {
		t.Errorf("overloaded fleet finishing 30 of 150 arrivals: sized %v, want 9", act2.Sizes)
	}
	// Off, only latency reacts (and here nothing measured it): no change.
	cfg.DisableFastScaleUp = true
	act3 := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
	p3, _ := planner.New(cfg, nil, act3)
	p3.Step(context.Background(), obs(at, 7.5, 1000, 100))
	p3.Step(context.Background(), window(at.Add(5*time.Second), 150, 1000, 100))
	if act3.Sizes[planner.PoolBoth] != 3 {
		t.Errorf("with DisableFastScaleUp: sized %v, want throughput mode's 3", act3.Sizes)
	}
}

// Throughput mode sizes for the window's arrivals when they exceed completions, and for the
// per-request lengths when the engines report them.
func TestThroughputModeUsesArrivalsAndLengths(t *testing.T) {
	cfg := bothConfig()
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
	p, _ := planner.New(cfg, nil, act)
	// 7.5 req/s finished, 15 arrived; the token counters say 3000 in per request (a queue's
	// prefills counted before its requests finish) but the requests had 1000.
	o := obs(time.Unix(1000, 0), 7.5, 3000, 100)
	o.Arrivals = 15 * 60
	o.PromptLenSum, o.OutputLenSum, o.LenCount = o.Requests*1000, o.Requests*100, o.Requests
	ds := p.Step(context.Background(), o)
	if act.Sizes[planner.PoolBoth] != 4 || ds[0].Inputs.RequestRate != 15 || ds[0].Inputs.ISL != 1000 {
		t.Errorf("sizes %v, inputs %+v; want 4 replicas for 15 req/s of 1000 in", act.Sizes, ds[0].Inputs)
	}
}

// A pool keeps, through a lull shorter than the scale-down window, the size a burst wanted
// within it, and gives it up once the window has passed.
func TestScaleDownWindow(t *testing.T) {
	cfg := bothConfig()
	cfg.Interval, cfg.LoadInterval = 10*time.Second, 5*time.Second
	cfg.ScaleDownCooldown, cfg.ScaleDownWindow = 0, 30*time.Second
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
	p, _ := planner.New(cfg, nil, act)
	at := time.Unix(1000, 0)
	ctx := context.Background()
	p.Step(ctx, planner.Observation{At: at, Window: 10 * time.Second})
	at = at.Add(5 * time.Second)
	p.Step(ctx, window(at, 150, 1000, 100)) // burst: 8 (no headroom)
	if act.Sizes[planner.PoolBoth] != 8 {
		t.Fatalf("burst: %v", act.Sizes)
	}
	// Silence for 25 s: throughput mode sees nothing, but 8 was wanted within 30 s.
	for range 5 {
		at = at.Add(5 * time.Second)
		p.Step(ctx, planner.Observation{At: at, Window: 5 * time.Second})
	}
	if act.Sizes[planner.PoolBoth] != 8 {
		t.Errorf("in a 25 s lull: %v, want the burst's 8 kept", act.Sizes)
	}
	// The interval that held the burst wanted 4 (15 req/s over 10 s): 30 s after it, 1.
	for range 5 {
		at = at.Add(5 * time.Second)
		p.Step(ctx, planner.Observation{At: at, Window: 5 * time.Second})
	}
	if act.Sizes[planner.PoolBoth] != 1 {
		for _, d := range p.Decisions() {
			t.Logf("%s %d→%d %s", d.Mode, d.From, d.To, d.Reason)
		}
		t.Errorf("50 s after the burst: %v, want back to 1", act.Sizes)
	}
}

// A noisy flat load checked every 5 s by load mode (demand) and every minute by throughput
// mode, with headroom, moves the pool once and then holds it: the fast scale-up's lower
// bound and the scale-down's hysteresis and window leave noise no room.
func TestNoisyLoadWithFastScaleUpDoesNotFlap(t *testing.T) {
	cfg := bothConfig()
	cfg.Headroom = 0.2
	cfg.ScaleDownCooldown = time.Minute
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 1}}
	p, _ := planner.New(cfg, nil, act)
	r := rand.New(rand.NewPCG(3, 4))
	at := time.Unix(1000, 0)
	ctx := context.Background()
	calls := 0
	for i := range 12 * 30 { // 30 minutes
		if i == 12 {
			calls = len(act.Calls) // the first minute finds the size
		}
		at = at.Add(5 * time.Second)
		// 11.25 req/s (3 replicas, 3.6 with headroom) with Poisson-like noise of ± 2σ.
		mean := 11.25 * 5
		n := math.Round(mean + 2*math.Sqrt(mean)*(2*r.Float64()-1))
		p.Step(ctx, window(at, n, 1000, 100))
	}
	if len(act.Calls) > calls {
		for _, d := range p.Decisions() {
			if d.From != d.To {
				t.Logf("%s %d→%d %s", d.Mode, d.From, d.To, d.Reason)
			}
		}
		t.Errorf("scale calls %v on a flat load, want none after the first minute", act.Calls)
	}
	if got := act.Sizes[planner.PoolBoth]; got != 4 {
		t.Errorf("size %d, want 4 (3.6 replicas with headroom)", got)
	}
}

// A backlog is demand: a pool whose arrivals it can serve but whose workers hold more
// waiting requests than they can start within the TTFT target grows to clear them within
// it. knownProfile prefills one 1000-token prompt in 100 ms: 2 fit in the 200 ms target.
func TestFastScaleUpClearsBacklog(t *testing.T) {
	cfg := bothConfig()
	act := &plannertest.Actuator{Sizes: map[planner.Pool]int{planner.PoolBoth: 2}}
	p, _ := planner.New(cfg, nil, act)
	at := time.Unix(1000, 0)
	p.Step(context.Background(), obs(at, 7.5, 1000, 100)) // 2.0: hold at 2
	// 40 requests in 5 s: at least 6.7 req/s, 1.79 replicas: 2 serve them.
	o := window(at.Add(5*time.Second), 40, 1000, 100)
	o.Workers = []planner.WorkerLoad{{ID: "a", Pool: planner.PoolBoth, Waiting: 1}, {ID: "b", Pool: planner.PoolBoth, Waiting: 1}}
	if ds := p.Step(context.Background(), o); len(ds) != 0 || act.Sizes[planner.PoolBoth] != 2 {
		t.Fatalf("no backlog: decisions %+v, sizes %v", ds, act.Sizes)
	}
	// a holds 3 waiting (2 past the target's 2, counting the one it would start), b 2 (1
	// past); a draining worker's queue is its own: 3 past, cleared in 0.2 s: +15 req/s,
	// (6.74 + 15) × 0.2667 = 5.8 replicas.
	o = window(at.Add(10*time.Second), 40, 1000, 100)
	o.Workers = []planner.WorkerLoad{{ID: "a", Pool: planner.PoolBoth, Waiting: 3}, {ID: "b", Pool: planner.PoolBoth, Waiting: 2},
		{ID: "c", Pool: planner.PoolBoth, Waiting: 50, Draining: true}}
	ds := p.Step(context.Background(), o)
	if act.Sizes[planner.PoolBoth] != 6 || len(ds) != 1 || !strings.Contains(ds[0].Reason, "3 queued") {
		t.Errorf("backlog: decisions %+v, sizes %v; want 6", ds, act.Sizes)
	}
}

// A profile records measured lengths: one grid length's points come out a few tokens apart
// (here as `kvrelay profile` wrote them for a 4000-token context) and must make one curve,
// not one curve per point with the lowest concurrency's throughput in front.
func TestProfileCurvesToleratesMeasuredLengths(t *testing.T) {
	p := &planner.Profile{Version: planner.ProfileVersion,
		Prefill: []planner.PrefillPoint{
			{ISL: 4248, Concurrency: 1, TTFTMs: 44, Throughput: 95730},
			{ISL: 4253, Concurrency: 2, TTFTMs: 77, Throughput: 95916},
			{ISL: 4260, Concurrency: 4, TTFTMs: 154, Throughput: 94931},
			{ISL: 4255, Concurrency: 8, TTFTMs: 294, Throughput: 96764},
		},
		Decode: []planner.DecodePoint{
			{Context: 2084, Concurrency: 1, ITLMs: 3.02, Throughput: 331},
			{Context: 2068.5, Concurrency: 8, ITLMs: 4.49, Throughput: 1783},
			{Context: 2071, Concurrency: 32, ITLMs: 8.57, Throughput: 3735},
			{Context: 2073.1, Concurrency: 64, ITLMs: 12.38, Throughput: 5171},
			{Context: 4181, Concurrency: 1, ITLMs: 3.27, Throughput: 306},
			{Context: 4191.1, Concurrency: 8, ITLMs: 6.02, Throughput: 1329},
			{Context: 4187.2, Concurrency: 32, ITLMs: 12.43, Throughput: 2574},
			{Context: 4186, Concurrency: 64, ITLMs: 15.01, Throughput: 4263},
		},
	}
	// Every point meets 25 ms: the best measured at each context.
	for _, tc := range []struct{ ctx, want float64 }{{4156, 4263}, {4200, 4263}, {2000, 5171}, {3130, (5171 + 4263) / 2}} {
		if got, ok := p.DecodeThroughput(25*time.Millisecond, tc.ctx); !ok || math.Abs(got-tc.want) > tc.want*0.02 {
			t.Errorf("DecodeThroughput(25ms, %v) = %v, %v; want about %v", tc.ctx, got, ok, tc.want)
		}
	}
	// 200 ms: between concurrency 2 (77 ms) and 4 (154 ms)... and 8 (294 ms): 4 meets it.
	if got, ok := p.PrefillThroughput(200*time.Millisecond, 4100); !ok || got < 94931 || got > 96764 {
		t.Errorf("PrefillThroughput(200ms, 4100) = %v, %v", got, ok)
	}
	if got := p.TTFT(4250, 4); math.Abs(float64(got-154*time.Millisecond)) > float64(time.Millisecond) {
		t.Errorf("TTFT(4250, 4) = %v, want 154ms", got)
	}
}
