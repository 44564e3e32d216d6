package route

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/xds/policy"
)

// TestRouteLeavesThePoolAlone: under a profile without filters, a request with a TTFT
// target that one worker misses is routed by the SLO rule, which drops that worker from the
// candidates; the pool's slice, which every event loop shares, keeps its workers in order.
func TestRouteLeavesThePoolAlone(t *testing.T) {
	prof := policy.Profile{Scorers: []policy.Plugin{{Name: "predicted-ttft", Weight: 1}}, Picker: policy.Plugin{Name: "latency"}}
	r, _ := newRouter(t, Config{Profile: &prof}, 4)
	ws := r.Pool().Workers
	for _, w := range ws {
		w.Engine.MaxNumSeqs = 2
	}
	before := slices.Clone(ws)
	for _, u := range busy(ws[0], 2) { // full: a new request waits for a slot
		defer u.End()
	}
	hashes, n := promptChain(3, 3, 64, 4)
	req := &Request{Model: "m", Hashes: hashes, PromptTokens: n}
	var d Decision
	if err := r.Route(req, &d); err != nil {
		t.Fatal(err)
	}
	req.SLOTTFT = d.Prediction.TTFT * 1.5
	for range 3 {
		err := r.Route(req, &d)
		if got := r.Pool().Workers; !slices.Equal(got, before) {
			t.Fatalf("the pool's workers became %v, want %v", ids(got), ids(before))
		}
		if err != nil || d.Mode != "slo" || d.Worker == before[0] {
			t.Fatalf("with a target the full w0 misses: %v, %s mode %s", err, d.Worker.ID, d.Mode)
		}
		if cands, _ := req.Candidates(); len(cands) != 3 {
			t.Fatalf("%d candidates meet the target, want 3", len(cands))
		}
	}
}

func ids(ws []*Worker) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.ID
	}
	return out
}

// passThrough is a filter that keeps every worker by returning its input, as a filter that
// has nothing to drop may.
type passThrough struct{}

func (passThrough) Name() string                                 { return "pass" }
func (passThrough) Filter(_ *Request, in, _ []*Worker) []*Worker { return in }
func (dropFirst) Name() string                                   { return "drop-first" }
func (dropFirst) Filter(_ *Request, in, out []*Worker) []*Worker { return append(out, in[1:]...) }
func (keepNone) Name() string                                    { return "none" }
func (keepNone) Filter(_ *Request, _, _ []*Worker) []*Worker     { return nil }
func (rotate) Name() string                                      { return "rotate" }
func (rotate) Filter(_ *Request, in, out []*Worker) []*Worker {
	if len(in) == 0 {
		return out
	}
	return append(append(out, in[len(in)-1]), in[:len(in)-1]...)
}
func (keepEveryOther) Name() string                                   { return "every-other" }
func (keepEveryOther) Filter(_ *Request, in, out []*Worker) []*Worker { return everyOther(in, out) }

type (
	dropFirst      struct{}
	keepNone       struct{}
	keepEveryOther struct{}
	rotate         struct{}
)

func everyOther(in, out []*Worker) []*Worker {
	for i := 0; i < len(in); i += 2 {
		out = append(out, in[i])
	}
	return out
}

// TestFilterChainKeepsItsBuffersApart: filters that return their input, or nothing, beside
// ones that append to their output, leave the candidates each rule says, and the pool as it
// was.
func TestFilterChainKeepsItsBuffersApart(t *testing.T) {
	reg := NewRegistry()
	RegisterBuiltins(reg)
	for _, f := range []Filter{passThrough{}, dropFirst{}, keepNone{}, keepEveryOther{}, rotate{}} {
		reg.Filter(f.Name(), FilterPlugin{New: func(Params) (Filter, error) { return f, nil }})
	}
	for _, tc := range []struct {
		filters []string
		want    []string // the candidates left, which round-robin picks in turn; nil for ErrNoWorker
	}{
		{[]string{"pass", "drop-first", "pass", "every-other"}, []string{"w1", "w3", "w5"}},
		{[]string{"every-other", "pass", "drop-first"}, []string{"w2", "w4"}},
		{[]string{"pass", "every-other", "drop-first"}, []string{"w2", "w4"}},
		{[]string{"pass", "rotate", "drop-first"}, []string{"w0", "w1", "w2", "w3", "w4"}},
		{[]string{"drop-first", "pass", "rotate"}, []string{"w5", "w1", "w2", "w3", "w4"}},
		{[]string{"pass", "none", "pass"}, nil},
		{[]string{"none"}, nil},
	} {
		t.Run(strings.Join(tc.filters, ","), func(t *testing.T) {
			prof := policy.Profile{Picker: policy.Plugin{Name: "round-robin"}}
			for _, f := range tc.filters {
				prof.Filters = append(prof.Filters, policy.Plugin{Name: f})
			}
			r, _ := newRouter(t, Config{Profile: &prof, Plugins: reg}, 6)
			before := slices.Clone(r.Pool().Workers)
			var req Request
			req.Model = "m"
			var d Decision
			for i := range 7 { // and again with the buffers as the requests before left them
				err := r.Route(&req, &d)
				if tc.want == nil {
					if !errors.Is(err, ErrNoWorker) {
						t.Fatalf("err %v, want ErrNoWorker", err)
					}
					continue
				}
				if want := tc.want[i%len(tc.want)]; err != nil || d.Worker.ID != want {
					t.Fatalf("pick %d: %v, %s, want %s", i, err, d.Worker.ID, want)
				}
			}
			if got := r.Pool().Workers; !slices.Equal(got, before) {
				t.Fatalf("the pool's workers became %v", ids(got))
			}
		})
	}
}

// TestNoProfileRoutesAroundHealthOrExclusions: whatever a profile's filters (none, or no
// health filter), a request never goes to a draining or ejected worker, nor to one its
// Exclude names (tried already, or outside a gateway's endpoint subset, which the proxy
// turns into exclusions); a pin to such a worker is not honoured.
func TestNoProfileRoutesAroundHealthOrExclusions(t *testing.T) {
	profiles := map[string]policy.Profile{
		"round-robin, no filters":   {Picker: policy.Plugin{Name: "round-robin"}},
		"load scorer, model filter": {Filters: []policy.Plugin{{Name: "model"}}, Scorers: []policy.Plugin{{Name: "load", Weight: 1}}, Picker: policy.Plugin{Name: "min-cost"}},
		"kv, model and role filters": {Filters: []policy.Plugin{{Name: "model"}, {Name: "role"}},
			Scorers: []policy.Plugin{{Name: "prefill", Weight: 1}}, Picker: policy.Plugin{Name: "min-cost"}, Spread: &policy.Plugin{Name: "random"}},
		"predicted-ttft, no filters": {Scorers: []policy.Plugin{{Name: "predicted-ttft", Weight: 1}}, Picker: policy.Plugin{Name: "latency"}},
	}
	for name, prof := range profiles {
		t.Run(name, func(t *testing.T) {
			r, idx := newRouter(t, Config{Profile: &prof}, 5)
			ws := r.Pool().Workers
			hashes, n := promptChain(4, 4, 64, 4)
			for _, w := range ws[:4] { // the unhealthy and excluded cache the prompt
				idx.Record(w.Index, hashes, 0)
			}
			for _, u := range busy(ws[4], 3) { // and the one left is loaded
				defer u.End()
			}
			now := time.Now().UnixNano()
			ws[0].SetDraining(true)
			ws[1].Failed(now, 1, time.Hour)
			req := &Request{Model: "m", Hashes: hashes, PromptTokens: n, Exclude: []int{ws[2].Index, ws[3].Index}, Now: now}
			var d Decision
			for range 20 {
				if err := r.Route(req, &d); err != nil || d.Worker != ws[4] {
					t.Fatalf("routed to %s (%v), want w4, the only healthy worker not excluded", d.Worker.ID, err)
				}
			}
			req.Pin = ws[2].ID
			if err := r.Route(req, &d); err != nil || d.Worker != ws[4] || req.Pinned {
				t.Fatalf("pinned to the excluded w2: %v, %s, pinned %v", err, d.Worker.ID, req.Pinned)
			}
			req.Pin, req.PinOnly = ws[1].ID, true
			if err := r.Route(req, &d); !errors.Is(err, ErrNoWorker) {
				t.Fatalf("pin-only to the ejected w1: %v, want ErrNoWorker", err)
			}
			req.Pin, req.PinOnly = "", false
			req.Exclude = append(req.Exclude, ws[4].Index)
			if err := r.Route(req, &d); !errors.Is(err, ErrNoWorker) {
				t.Fatalf("every worker unhealthy or excluded: %v, want ErrNoWorker", err)
			}
		})
	}
}
