package route

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/xds/policy"
)

// TestPresetsAreProfiles: every built-in name builds, through its preset, the composition
// it names: the same filters, scorers with the policy's weights, picker and spread.
func TestPresetsAreProfiles(t *testing.T) {
	names := func(p *Policy) string {
		var b strings.Builder
		for _, f := range p.Filters {
			b.WriteString(f.Name() + " ")
		}
		b.WriteString("|")
		for _, s := range p.Scorers {
			b.WriteString(" " + s.Name())
		}
		b.WriteString(" | " + p.Picker.Name())
		if p.Spread != nil {
			b.WriteString(" / " + p.Spread.Name())
		}
		return b.String()
	}
	for name, want := range map[string]string{
		PolicyKV:          "model role | prefill decode | min-cost / least-prefill",
		PolicyLatency:     "model role | predicted-ttft | latency",
		PolicyRoundRobin:  "model role | | round-robin",
		PolicyLeastLoaded: "model role | | least-loaded",
		PolicySession:     "model role | | least-loaded",
		PolicyRandom:      "model role | | random",
		PolicyPowerOfTwo:  "model role | | power-of-two",
	} {
		p, err := NewPolicy(Config{Policy: name, Explicit: true, OverlapWeight: 32, QueueWeight: 4, Temperature: 0.5, CacheThreshold: 0.2})
		if err != nil {
			t.Fatal(name, err)
		}
		if got := names(p); got != want || p.Name != name || p.CacheThreshold != 0.2 {
			t.Errorf("%s: %q (%s, threshold %v), want %q", name, got, p.Name, p.CacheThreshold, want)
		}
		switch name {
		case PolicyKV:
			if pc := p.Scorers[0].(PrefillCost); pc.Weight != 32 || pc.QueueWeight != 4 || p.Picker.(MinCost).Temperature != 0.5 || !p.UsesIndex {
				t.Errorf("kv: %+v, %+v", pc, p.Picker)
			}
		case PolicyLatency:
			if s := p.Scorers[0].(PredictedTTFT); s.CacheCredit != 0.5 || !p.Predicts || !p.UsesIndex {
				t.Errorf("latency: %+v", s)
			}
		}
	}
}

// TestProfileRoutes: a profile of one load scorer under min-cost sends the request to the
// worker with the fewest requests, whatever it caches; a weight scales its cost.
func TestProfileRoutes(t *testing.T) {
	prof := policy.Profile{Filters: []policy.Plugin{{Name: "model"}, {Name: "health"}},
		Scorers: []policy.Plugin{{Name: "load", Weight: 2}}, Picker: policy.Plugin{Name: "min-cost"}}
	r, idx := newRouter(t, Config{Profile: &prof}, 3)
	ws := r.Pool().Workers
	hashes, n := promptChain(1, 1, 64, 4)
	idx.Record(ws[0].Index, hashes, 0)
	for _, u := range busy(ws[0], 1) {
		defer u.End()
	}
	for _, u := range busy(ws[2], 2) {
		defer u.End()
	}
	var req Request
	req.Model, req.Hashes, req.PromptTokens = "m", hashes, n
	var d Decision
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if d.Worker != ws[1] || r.Policy().Name != policy.Custom || r.Policy().UsesIndex {
		t.Fatalf("went to %s under %s (uses index %v), want the idle w1", d.Worker.ID, r.Policy().Name, r.Policy().UsesIndex)
	}
	if !d.HasCost || d.CostGap != 0 {
		t.Fatalf("decision %+v", d)
	}
}

// TestProfileErrors: what a registry cannot build is refused with what is wrong.
func TestProfileErrors(t *testing.T) {
	reg := Builtins()
	for _, tc := range []struct {
		prof policy.Profile
		want string
	}{
		{policy.Profile{Picker: policy.Plugin{Name: "fastest"}}, `no picker "fastest"`},
		{policy.Profile{Scorers: []policy.Plugin{{Name: "gpu-temp", Weight: 1}}, Picker: policy.Plugin{Name: "min-cost"}}, `no scorer "gpu-temp"`},
		{policy.Profile{Filters: []policy.Plugin{{Name: "zone"}}, Picker: policy.Plugin{Name: "random"}}, `no filter "zone"`},
		{policy.Profile{Scorers: []policy.Plugin{{Name: "prefill", Weight: 1, Params: map[string]float64{"overlap": 1}}}, Picker: policy.Plugin{Name: "min-cost"}}, `no parameter "overlap"`},
		{policy.Profile{Scorers: []policy.Plugin{{Name: "predicted-ttft", Weight: 2}}, Picker: policy.Plugin{Name: "latency"}}, "takes weight 1"},
		{policy.Profile{Scorers: []policy.Plugin{{Name: "predicted-ttft", Weight: 1}}, Picker: policy.Plugin{Name: "latency"}, Spread: &policy.Plugin{Name: "random"}}, "spread picker beside a predicting"},
		{policy.Profile{Picker: policy.Plugin{Name: "min-cost", Params: map[string]float64{"temperature": 1e4}}}, "temperature"},
		{policy.Profile{Scorers: []policy.Plugin{{Name: "load", Weight: -1}}, Picker: policy.Plugin{Name: "min-cost"}}, "weight -1"},
		{policy.Profile{}, `picker ""`},
	} {
		if err := reg.Validate(tc.prof); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.prof, err, tc.want)
		}
	}
	if err := (Config{Policy: PolicyKV, Profile: &policy.Profile{Picker: policy.Plugin{Name: "random"}}}).Validate(); err == nil {
		t.Error("a profile under the name kv was taken")
	}
}

// TestRegistryTakesNewPlugins: a program's own scorer, registered beside the built-ins, is
// usable in a profile; a name registered twice panics.
func TestRegistryTakesNewPlugins(t *testing.T) {
	reg := NewRegistry()
	RegisterBuiltins(reg)
	reg.Scorer("kv-usage", ScorerPlugin{New: func(w float64, _ Params) (Scorer, error) { return kvUsage{w}, nil }})
	prof := policy.Profile{Scorers: []policy.Plugin{{Name: "kv-usage", Weight: 1}}, Picker: policy.Plugin{Name: "min-cost"}}
	if err := reg.Validate(prof); err != nil {
		t.Fatal(err)
	}
	if err := Builtins().Validate(prof); err == nil {
		t.Fatal("the built-in registry knows a scorer it was never given")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a second registration of one name did not panic")
		}
	}()
	reg.Scorer("kv-usage", ScorerPlugin{})
}

type kvUsage struct{ w float64 }

func (kvUsage) Name() string { return "kv-usage" }
func (s kvUsage) Score(_ *Request, ws []*Worker, costs []float64) {
	for i, w := range ws {
		costs[i] += s.w * w.KVInUse()
	}
}

// TestPredictingScorerMustPredict: a scorer registered as predicting latency whose scorer
// fills no predictions is refused when its profile is built (validated by a control plane,
// pushed to a proxy), so that no request with latency targets meets a policy that cannot
// judge them.
func TestPredictingScorerMustPredict(t *testing.T) {
	reg := NewRegistry()
	RegisterBuiltins(reg)
	reg.Scorer("guessed-ttft", ScorerPlugin{Predicts: true, New: func(w float64, _ Params) (Scorer, error) { return LoadCost{Weight: w}, nil }})
	prof := policy.Profile{Scorers: []policy.Plugin{{Name: "guessed-ttft", Weight: 1}}, Picker: policy.Plugin{Name: "latency"}}
	const want = "scorer guessed-ttft is registered as predicting latency, but its route.LoadCost fills no latency predictions"
	if err := reg.Validate(prof); err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("validate: %v, want %q", err, want)
	}
	r, err := NewRouter(Config{Profile: &prof, Plugins: reg}, NewPool(workers(3)), nil)
	if err == nil {
		// What a proxy that took the profile would do with the first request that has a
		// target.
		req := &Request{Model: "m", PromptTokens: 100, SLOTTFT: 1}
		var d Decision
		err := r.Route(req, &d)
		t.Fatalf("a router was built on the profile (a request with a TTFT target got %v)", err)
	}
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("new router: %v, want %q", err, want)
	}
}

// fakePredictor passes for a predicting scorer (it embeds PredictedTTFT) but scores like
// LoadCost and predicts nothing.
type fakePredictor struct{ PredictedTTFT }

func (fakePredictor) Score(req *Request, ws []*Worker, costs []float64) {
	LoadCost{Weight: 1}.Score(req, ws, costs)
}

// TestSLOWithoutPredictionsIsAnError: a predicting policy whose scorer left no predictions
// (one that only looks like PredictedTTFT) makes a request with latency targets an error,
// not a panic; one without targets routes by its costs.
func TestSLOWithoutPredictionsIsAnError(t *testing.T) {
	reg := NewRegistry()
	RegisterBuiltins(reg)
	reg.Scorer("fake-ttft", ScorerPlugin{Predicts: true, New: func(float64, Params) (Scorer, error) { return fakePredictor{}, nil }})
	prof := policy.Profile{Scorers: []policy.Plugin{{Name: "fake-ttft", Weight: 1}}, Picker: policy.Plugin{Name: "min-cost"}}
	r, err := NewRouter(Config{Profile: &prof, Plugins: reg}, NewPool(workers(3)), nil)
	if err != nil {
		t.Fatal(err)
	}
	req := &Request{Model: "m", PromptTokens: 100}
	var d Decision
	if err := r.Route(req, &d); err != nil || d.HasPrediction {
		t.Fatalf("without a target: %v, prediction %v", err, d.HasPrediction)
	}
	req.SLOTTFT = 1
	if err := r.Route(req, &d); !errors.Is(err, errNoPredictions) {
		t.Fatalf("with a target: %v, want errNoPredictions", err)
	}
}
