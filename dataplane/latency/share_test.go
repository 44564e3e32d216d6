package latency

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestShareStartsCalibrated: a model that shares the fit of one taught by an engine predicts
// that engine well before it saw a single request of its own (a new proxy starts from what
// the fleet learned), where its own prior is far off; a worker takes the fleet's figures of
// it (speed, limit) only when the fleet saw more of it.
func TestShareStartsCalibrated(t *testing.T) {
	eng := syntheticEngine{speedup: 20, itl0: 0.01, itl1: 0.002, itlKV: 0.02, hold: 2, seqs: 4}
	_, taught := newWorkers(1)
	teach(taught[0], eng, rand.New(rand.NewPCG(1, 2)), 600)

	m, fresh := newWorkers(1)
	before := medianRelErr(fresh[0], eng, rand.New(rand.NewPCG(7, 8)), 300)
	if !m.Share(taught[0].Model().Fit()) {
		t.Fatal("Share of a taught fit changed nothing")
	}
	if !fresh[0].Share(taught[0].Fit()) {
		t.Fatal("Share of a taught worker's fit changed nothing")
	}
	after := medianRelErr(fresh[0], eng, rand.New(rand.NewPCG(7, 8)), 300)
	t.Logf("median relative error: own prior %.1f%%, shared fit %.1f%%", 100*before, 100*after)
	if before < 0.5 || after > 0.15 {
		t.Fatalf("median relative error %.1f%% before sharing, %.1f%% after: want the shared fit under 15%% where the prior is far off", 100*before, 100*after)
	}
	if got, want := fresh[0].Fit().DecodeSpeed, taught[0].Fit().DecodeSpeed; got != want || want == 1 {
		t.Fatalf("decode speed %v after sharing, want the taught worker's %v", got, want)
	}
	if got := fresh[0].MaxNumSeqs(&Engine{}); got != eng.seqs {
		t.Fatalf("limit %d after sharing, want %d", got, eng.seqs)
	}
	// A worker that saw more than the fleet keeps its own figures.
	own := taught[0].Fit()
	if taught[0].Share(WorkerFit{Speed: 2, Occupancy: 9, MaxNumSeqs: 64, SigmaQueued: 1, SigmaFresh: 1, Obs: 10}) {
		t.Fatal("a worker that saw 600 first tokens took a fit of 10")
	}
	if got := taught[0].Fit(); got != own {
		t.Fatalf("fit changed: %+v, want %+v", got, own)
	}
}

// TestShareRefusesNonsense: a fit with no observations, coefficients or figures out of
// bounds, or non-finite values changes nothing.
func TestShareRefusesNonsense(t *testing.T) {
	m, ws := newWorkers(1)
	base := m.Fit()
	good := base
	good.TTFTObs = 100
	for _, tc := range []struct {
		name string
		f    func() Fit
	}{
		{"no observations", func() Fit { return base }},
		{"NaN coefficient", func() Fit { f := good; f.Theta[FeatPrefill] = math.NaN(); return f }},
		{"coefficient above its bound", func() Fit { f := good; f.Theta[FeatDecode] = 1e9; return f }},
		{"negative coefficient", func() Fit { f := good; f.Theta[FeatPrefill] = -1; return f }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if m.Share(tc.f()) {
				t.Fatalf("Share took %+v", tc.f())
			}
			if got := m.Fit(); got != base {
				t.Fatalf("fit changed to %+v", got)
			}
		})
	}
	bad := decodeOnly(base)
	bad.DecodeStep[0] = math.Inf(1)
	if m.Share(bad) {
		t.Fatal("Share took an infinite decode step")
	}
	w := ws[0]
	own := w.Fit()
	for _, f := range []WorkerFit{
		{Speed: math.NaN(), Occupancy: 1, SigmaQueued: 0.5, SigmaFresh: 0.5, Obs: 1000},
		{Speed: 1e9, Occupancy: 1, SigmaQueued: 0.5, SigmaFresh: 0.5, Obs: 1000},
		{Speed: 1, Occupancy: -1, SigmaQueued: 0.5, SigmaFresh: 0.5, Obs: 1000},
		{Speed: 1, Occupancy: 1, SigmaQueued: math.Inf(1), SigmaFresh: 0.5, Obs: 1000},
	} {
		if w.Share(f) {
			t.Fatalf("worker took %+v", f)
		}
	}
	if got := w.Fit(); got != own {
		t.Fatalf("worker fit changed to %+v", got)
	}
	// A decode speed out of bounds, or none (a proxy that does not report it), is not
	// taken beside figures that are.
	for _, ds := range []float64{0, 1e9, math.NaN()} {
		if !w.Share(WorkerFit{Speed: 1.5, DecodeSpeed: ds, Occupancy: 1, SigmaQueued: 0.5, SigmaFresh: 0.5, Obs: 1000}) {
			t.Fatal("worker refused a fit whose other figures are good")
		}
		if got := w.Fit().DecodeSpeed; got != own.DecodeSpeed {
			t.Fatalf("decode speed %v taken: %v", ds, got)
		}
	}
}

// decodeOnly is f with decode observations only.
func decodeOnly(f Fit) Fit {
	f.TTFTObs, f.DecodeObs = 0, 100
	return f
}
