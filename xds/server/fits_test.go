package server

import (
	"math"
	"testing"
	"time"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// TestPooledFits: the live proxies' fits of a model are pooled weighed by the observations
// that taught them, a worker's figures by the first tokens each proxy saw of it with the
// largest limit any learned; fits that are not whole are dropped; the pool is recomputed
// at most every minInterval; FitFor rounds what a worker's resource carries.
func TestPooledFits(t *testing.T) {
	s := New(Options{})
	now := time.Unix(1000, 0)
	s.load.now = func() time.Time { return now }
	fit := func(n uint64, theta float64, speed float64, obs uint64, seqs uint32) *xdsv1.LatencyFit {
		return &xdsv1.LatencyFit{Model: "m", Role: xdsv1.Role_ROLE_BOTH, Theta: []float64{theta, 2 * theta}, DecodeStep: []float64{0.01, 0.02}, DecodeKv: []float64{1, 1.5},
			TtftObservations: n, DecodeObservations: n,
			Workers: []*xdsv1.WorkerFit{{WorkerId: "w0", Speed: speed, Occupancy: 2, MaxNumSeqs: seqs, SigmaQueued: 0.5, SigmaFresh: 0.2, Observations: obs}}}
	}
	// b's proxy reports the worker's decode speed, a's none (0): the pool's is b's alone.
	fb := fit(100, 3, 2, 10, 4)
	fb.Workers[0].DecodeSpeed = 1.7
	s.load.put("a", 1, &xdsv1.LoadReport{NodeId: "a", Seq: 1, Fits: []*xdsv1.LatencyFit{fit(300, 1, 1, 30, 0)}})
	s.load.put("b", 2, &xdsv1.LoadReport{NodeId: "b", Seq: 1, Fits: []*xdsv1.LatencyFit{fb,
		{Model: "bad", Theta: []float64{math.NaN()}}}})
	// A later report without fits keeps the node's last ones.
	s.load.put("b", 2, &xdsv1.LoadReport{NodeId: "b", Seq: 2})
	pooled := s.PooledFits(time.Second)
	if len(pooled) != 1 {
		t.Fatalf("pooled %d fits, want the one whole model", len(pooled))
	}
	p := pooled[FitKey{"m", xdsv1.Role_ROLE_BOTH}]
	if got, want := p.GetTheta()[0], (300*1+100*3)/400.0; math.Abs(got-want) > 1e-12 || p.GetTtftObservations() != 400 {
		t.Fatalf("θ₀ %v from %d observations, want %v from 400", got, p.GetTtftObservations(), want)
	}
	w := p.GetWorkers()[0]
	if got, want := w.GetSpeed(), (30*1+10*2)/40.0; math.Abs(got-want) > 1e-12 || w.GetMaxNumSeqs() != 4 || w.GetObservations() != 40 {
		t.Fatalf("worker %+v, want speed %v, limit 4, 40 observations", w, want)
	}
	if w.GetDecodeSpeed() != 1.7 {
		t.Fatalf("worker's decode speed %v, want 1.7: the one proxy that reported it", w.GetDecodeSpeed())
	}
	// Within the interval the pool stands, whatever comes.
	s.load.put("a", 1, &xdsv1.LoadReport{NodeId: "a", Seq: 2, Fits: []*xdsv1.LatencyFit{fit(1000, 10, 1, 30, 0)}})
	if again := s.PooledFits(time.Second); again[FitKey{"m", xdsv1.Role_ROLE_BOTH}] != p {
		t.Fatal("pooled again within the interval")
	}
	now = now.Add(2 * time.Second)
	if again := s.PooledFits(time.Second); again[FitKey{"m", xdsv1.Role_ROLE_BOTH}].GetTtftObservations() != 1100 {
		t.Fatal("not pooled again after the interval")
	}
	f := FitFor(s.PooledFits(time.Second), "m", xdsv1.Role_ROLE_BOTH, "w0")
	if f.GetTtftObservations() != 1024 || f.GetTheta()[0] != 9.4 || len(f.GetWorkers()) != 1 {
		t.Fatalf("FitFor: %v observations, θ₀ %v, %d workers; want 1024, 9.4 ((1000·10 + 100·3)/1100 to two digits), 1", f.GetTtftObservations(), f.GetTheta()[0], len(f.GetWorkers()))
	}
	if FitFor(s.PooledFits(time.Second), "other", xdsv1.Role_ROLE_BOTH, "w0") != nil {
		t.Fatal("a fit for a model nobody reported")
	}
}
