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
