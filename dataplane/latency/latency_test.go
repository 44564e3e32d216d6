package latency

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"testing"

	"github.com/kvrelay/kvrelay/engines/sim"
)

func TestDefaultCurveIsTheSimulatorsTiming(t *testing.T) {
	st := sim.DefaultTiming()
	if c := DefaultCurve(); c != (Curve{A: st.PrefillA, B: st.PrefillB, C: st.PrefillC}) {
		t.Fatalf("DefaultCurve %+v differs from sim.DefaultTiming %+v", c, st)
	}
	for _, n := range []int{1, 100, 2000, 8192} {
		if got, want := DefaultCurve().StepSeconds(float64(n)), st.PrefillMS(n)/1000; math.Abs(got-want) > 1e-12 {
			t.Fatalf("StepSeconds(%d) = %v, want %v", n, got, want)
		}
	}
}

// TestRLSConverges fits a known linear relation under noise, then stays on it when one
// observation in ten is an outlier ten times too large.
func TestRLSConverges(t *testing.T) {
	truth := Vec{0.02, 0.8, 2.5, 0.05}
	for _, tc := range []struct {
		name     string
		outliers float64
		tol      float64
	}{
		{"clean", 0, 0.03},
		{"10% outliers", 0.1, 0.08},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, 2))
			r := RLS{Lambda: 0.995, Lo: Vec{0, 0, 0, 0}, Hi: Vec{10, 10, 10, 10}}
			r.Init(4, Vec{0, 1, 1, 1}, Vec{10, 10, 10, 10})
			for range 3000 {
				x := Vec{1, rng.Float64(), rng.Float64() * 0.5, rng.Float64() * 3}
				y := truth[0] + truth[1]*x[1] + truth[2]*x[2] + truth[3]*x[3]
				y *= 1 + 0.02*rng.NormFloat64()
				if rng.Float64() < tc.outliers {
					y *= 10
				}
				r.Update(&x, y)
			}
			for i := range 4 {
				if d := math.Abs(r.Theta[i] - truth[i]); d > tc.tol*max(1, truth[i]) {
					t.Errorf("θ[%d] = %.4f, want %.4f (±%.3f)", i, r.Theta[i], truth[i], tc.tol)
				}
			}
			// An outlier on a small observation can stay within the clipping bound; most
			// of the 300 or so do not.
			if tc.outliers > 0 && r.Outliers() < 150 {
				t.Errorf("%d observations clipped, want most of about 300", r.Outliers())
			}
		})
	}
}

// TestRLSWindup: a feature that stays zero for thousands of observations (a slot wait on a
// worker that never fills) does not swing its coefficient when it first appears.
func TestRLSWindup(t *testing.T) {
	r := RLS{Lambda: 0.98, Lo: Vec{0, 0.01, 0.01}, Hi: Vec{10, 100, 100}}
	r.Init(3, Vec{0, 1, 1}, Vec{10, 10, 10})
	for i := range 5000 {
		x := Vec{1, 0, float64(i%7) * 0.1}
		r.Update(&x, 0.01+0.5*x[2])
	}
	x := Vec{1, 2, 0.3}
	r.Update(&x, 0.01+0.15+1*2) // the slot term really is 1.0
	if r.Theta[1] < 0.3 || r.Theta[1] > 3 {
		t.Fatalf("after the first slot wait θ₁ = %v, want a step toward 1 within [0.3, 3]", r.Theta[1])
	}
	for range 50 {
		r.Update(&x, 0.01+0.15+1*2)
	}
	if math.Abs(r.Theta[1]-1) > 0.1 {
		t.Fatalf("θ₁ = %v after 50 slot waits, want 1", r.Theta[1])
	}
}

// TestRLSIgnoresNonFinite: NaN and Inf observations change nothing.
func TestRLSIgnoresNonFinite(t *testing.T) {
	r := RLS{}
	r.Init(2, Vec{1, 1}, Vec{1, 1})
	before := r.Theta
	for _, y := range []float64{math.NaN(), math.Inf(1)} {
		x := Vec{1, 1}
		r.Update(&x, y)
	}
	x := Vec{math.NaN(), 1}
	r.Update(&x, 1)
	if r.Theta != before || r.Count() != 0 {
		t.Fatalf("θ %v count %d after non-finite input", r.Theta, r.Count())
	}
}

// syntheticEngine is a worker whose true times are known: its prefill runs speedup times
// faster than the prior curve, a slot frees every hold/(seqs+1), and each step carries a
// decode step that grows with the batch and the KV usage.
type syntheticEngine struct {
	speedup, itl0, itl1, itlKV, hold float64
	seqs                             int
	// loadFactor slows prefill by up to this share as the slots fill (llm-d's simulator's
	// time factor under load, less one).
	loadFactor float64
	// attnMS is what attention costs: milliseconds per new token per 1000 tokens of context
	// it attends to (the cached prefix and the new tokens before it).
	attnMS float64
}

func (e syntheticEngine) itl(batch int, kv float64) float64 {
	return e.itl0 + e.itl1*float64(batch) + e.itlKV*kv
}

func (e syntheticEngine) ttft(st State, uncached float64) float64 {
	c := DefaultCurve()
	budget := float64(DefaultBatchedTokens)
	batch := min(st.Requests, e.seqs)
	decode := 0.0
	if batch > 0 {
		decode = e.itl(batch, st.KVUsage)
	}
	prefill := func(t float64) float64 { return chunked(t, budget, c)/e.speedup + math.Ceil(t/budget)*decode }
	q := prefill(st.Backlog)
	own := (prefill(st.Backlog+uncached) - q) * (1 + e.loadFactor*float64(batch)/float64(e.seqs))
	slot := 0.0
	if st.Requests >= e.seqs {
		slot = float64(st.Requests-e.seqs+1) * e.hold / float64(e.seqs+1)
	}
	attn := e.attnMS / 1000 * uncached * (st.Cached + uncached/2) / 1000
	return 0.004 + slot + q + own + attn
}

func newWorkers(n int) (*Model, []*Worker) {
	m := new(Model)
	m.Init()
	ws := make([]*Worker, n)
	for i := range ws {
		ws[i] = new(Worker)
		ws[i].Init(m)
	}
	return m, ws
}

// teach runs n requests in random states through w against eng, one in twenty an outlier
// eight times too slow, and reports the engine's state to it.
func teach(w *Worker, eng syntheticEngine, rng *rand.Rand, n int) {
	e := &Engine{}
	for i := range n {
		st, u := stateFor(eng, rng)
		for range 3 { // a control plane reports every 100 ms, a few times over a request
			w.ObserveReport(min(st.Requests, eng.seqs), max(0, st.Requests-eng.seqs))
		}
		var p Prediction
		w.Predict(e, st, u, &p)
		y := eng.ttft(st, u)
		if i%20 == 7 {
			y *= 8 // now and then a request stuck behind something the model cannot see
		}
		w.ObserveTTFT(&p, y)
		b := max(1, min(st.Requests+1, eng.seqs))
		w.ObserveDecode(b, st.KVUsage, eng.itl(b, st.KVUsage), eng.hold)
	}
}

func randomState(rng *rand.Rand) (State, float64) {
	st := State{Requests: rng.IntN(8), Backlog: float64(rng.IntN(3)) * rng.Float64() * 6000, KVUsage: rng.Float64()}
	return st, float64(rng.IntN(7000))
}

// stateFor draws a state for eng: with an attention cost, a third of the requests carry a
// long conversation's cached context.
func stateFor(eng syntheticEngine, rng *rand.Rand) (State, float64) {
	st, u := randomState(rng)
	if eng.attnMS > 0 && rng.IntN(3) == 0 {
		st.Cached = float64(rng.IntN(100_000))
	}
	return st, u
}

func medianRelErr(w *Worker, eng syntheticEngine, rng *rand.Rand, n int) float64 {
	e := &Engine{}
	var errs []float64
	for range n {
		st, u := stateFor(eng, rng)
		var p Prediction
		w.Predict(e, st, u, &p)
		y := eng.ttft(st, u)
		errs = append(errs, math.Abs(p.TTFT-y)/y)
	}
	sort.Float64s(errs)
	return errs[len(errs)/2]
}

// TestModelLearnsEngine: on an engine 20 times faster than the prior with four slots, the
// model's median relative TTFT error falls from the prior's (far off) to under 10% once
// it has seen a few hundred requests, despite outliers; the concurrency limit is learned
// from reports and the decode step against batch size and KV usage.
func TestModelLearnsEngine(t *testing.T) {
	eng := syntheticEngine{speedup: 20, itl0: 0.01, itl1: 0.002, itlKV: 0.02, hold: 2, seqs: 4}
	learnEngine(t, eng)
}

// TestModelLearnsSlowdownUnderLoad: an engine whose prefill slows to twice its time as its
// slots fill (llm-d's simulator with --time-factor-under-load 2) is learned as well, through
// the loaded-prefill term.
func TestModelLearnsSlowdownUnderLoad(t *testing.T) {
	eng := syntheticEngine{speedup: 5, itl0: 0.015, hold: 3, seqs: 4, loadFactor: 1}
	w := learnEngine(t, eng)
	if th := w.Stats().Theta; th[FeatLoadedPrefill] < 0.3*th[FeatPrefill] {
		t.Fatalf("prefill %v, under load %v: the slowdown was not learned", th[FeatPrefill], th[FeatLoadedPrefill])
	}
}

func learnEngine(t *testing.T, eng syntheticEngine) *Worker {
	t.Helper()
	_, ws := newWorkers(1)
	w := ws[0]
	rng := rand.New(rand.NewPCG(3, 4))
	cold := medianRelErr(w, eng, rng, 200)
	teach(w, eng, rng, 600)
	warm := medianRelErr(w, eng, rng, 400)
	t.Logf("median relative TTFT error: prior %.1f%%, learned %.1f%%; %+v", 100*cold, 100*warm, w.Stats())
	if cold < 0.5 {
		t.Fatalf("the prior should be far off on an engine 20x faster (%.2f)", cold)
	}
	if warm > 0.10 {
		t.Fatalf("median relative error %.1f%% after learning, want under 10%%", 100*warm)
	}
	if got := w.MaxNumSeqs(&Engine{}); got != eng.seqs {
		t.Fatalf("learned max_num_seqs %d, want %d", got, eng.seqs)
	}
	if itl, want := w.Model().ITL(3, 0.5), eng.itl(3, 0.5); math.Abs(itl-want) > 0.001 {
		t.Fatalf("ITL(3, 0.5) = %v, want %v", itl, want)
	}
	return w
}

// TestLimitFromReports: the concurrency limit is the most requests a worker runs, once
// requests are seen waiting beside that many confirmLimit times; waits beside fewer (the
// step's token budget, a full cache) teach nothing; running more unlearns it.
func TestLimitFromReports(t *testing.T) {
	for _, tc := range []struct {
		name    string
		reports [][2]int // running, waiting
		want    int
	}{
		{"confirmed", [][2]int{{2, 0}, {4, 0}, {4, 2}, {4, 1}, {4, 3}}, 4},
		{"not yet confirmed", [][2]int{{4, 0}, {4, 2}, {4, 1}}, 0},
		{"waits beside fewer", [][2]int{{9, 0}, {4, 2}, {5, 1}, {7, 3}, {6, 1}, {8, 2}}, 0},
		{"unlearned by more running", [][2]int{{4, 2}, {4, 1}, {4, 3}, {6, 0}}, 0},
		{"relearned higher", [][2]int{{4, 2}, {4, 1}, {4, 3}, {8, 1}, {8, 2}, {8, 1}}, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ws := newWorkers(1)
			w := ws[0]
			for _, r := range tc.reports {
				w.ObserveReport(r[0], r[1])
			}
			if got := w.MaxNumSeqs(&Engine{}); got != tc.want {
				t.Fatalf("limit %d, want %d (most running %d)", got, tc.want, w.SeqsLow())
			}
		})
	}
}

// TestModelLimitUnlearned: a limit learned of one worker stands in for its peers that have
// not shown their own; once any worker of the model runs more than it, it was no limit
// (long prompts held back by the step budget, taken for one) and its peers drop it too:
// an idle peer must not look as if its one slot were its last.
func TestModelLimitUnlearned(t *testing.T) {
	_, ws := newWorkers(3)
	for range confirmLimit {
		ws[0].ObserveReport(1, 1)
	}
	if got := ws[1].MaxNumSeqs(&Engine{}); got != 1 {
		t.Fatalf("a peer's limit %d, want the model's 1", got)
	}
	ws[2].ObserveReport(4, 0)
	for i, w := range ws[1:] {
		if got := w.MaxNumSeqs(&Engine{}); got != 0 {
			t.Fatalf("worker %d: limit %d after a peer ran 4, want none", i+1, got)
		}
	}
	if got := ws[0].MaxNumSeqs(&Engine{}); got != 1 {
		t.Fatalf("the worker seen waiting at 1: limit %d, want its own 1 until it runs more", got)
	}
	var p Prediction
	ws[1].Predict(&Engine{}, State{}, 1000, &p)
	if p.Scarcity != 0 {
		t.Fatalf("an idle worker's scarcity %v, want 0 without a limit", p.Scarcity)
	}
}

// TestSpreadPastPeersLimit: while no limit is known, a worker running as many requests as
// the most it was seen to run is unsure of a slot for the next (its spread grows), unless a
// peer of its model (deployed alike) was seen running more: a worker little used so far is
// not taken for one of fewer slots.
func TestSpreadPastPeersLimit(t *testing.T) {
	_, ws := newWorkers(2)
	ws[1].ObserveReport(1, 0)
	var alone, withPeer Prediction
	ws[1].Predict(&Engine{}, State{Requests: 1}, 1000, &alone)
	ws[0].ObserveReport(4, 0)
	ws[1].Predict(&Engine{}, State{Requests: 1}, 1000, &withPeer)
	if want := alone.Spread - 0.5*ws[1].Occupancy()/2; alone.Spread <= withPeer.Spread || math.Abs(withPeer.Spread-want) > 1e-9 {
		t.Fatalf("spread %v alone, %v once a peer ran 4: want the unknown slot's %v less", alone.Spread, withPeer.Spread, 0.5*ws[1].Occupancy()/2)
	}
	var past Prediction
	ws[1].Predict(&Engine{}, State{Requests: 4}, 1000, &past)
	if past.Spread <= withPeer.Spread {
		t.Fatalf("spread %v at 4 requests, the most any peer ran, not above %v at 1", past.Spread, withPeer.Spread)
	}
}

// TestModelLearnsAttention: on an engine whose prefill also pays attention over the context
// (a third of the requests carry up to 100K tokens of cached context), the model learns the
// attention term from what the requests took: its coefficient grows from 0, and long-context
// requests are predicted within 10% at the median, where a context-blind model is off by
// far more.
func TestModelLearnsAttention(t *testing.T) {
	eng := syntheticEngine{speedup: 5, itl0: 0.015, hold: 3, seqs: 4, attnMS: 0.0003}
	w := learnEngine(t, eng)
	if th := w.Stats().Theta; th[FeatAttention] < 0.2 {
		t.Fatalf("attention coefficient %v: not learned", th[FeatAttention])
	}
	rng := rand.New(rand.NewPCG(9, 9))
	var errs []float64
	for range 300 {
		st, u := randomState(rng)
		st.Cached = 50_000 + float64(rng.IntN(50_000))
		var p Prediction
		w.Predict(&Engine{}, st, u, &p)
		y := eng.ttft(st, u)
		errs = append(errs, math.Abs(p.TTFT-y)/y)
	}
	sort.Float64s(errs)
	if med := errs[len(errs)/2]; med > 0.10 {
		t.Fatalf("long-context median relative error %.1f%%, want under 10%%", 100*med)
	}
}

// TestComputeIsThePrefillsTokenPart: Compute, the engine time the request's tokens take, is
// the own prefill's part that grows with the tokens, chunk by chunk as the prefill is
// computed, so that a prompt of many chunks costs what its chunks cost.
func TestComputeIsThePrefillsTokenPart(t *testing.T) {
	_, ws := newWorkers(1)
	w := ws[0]
	for _, u := range []float64{100, 8192, 32768, 100_000} {
		var p Prediction
		w.Predict(&Engine{}, State{}, u, &p)
		c := DefaultCurve()
		want := chunkedTokens(u, DefaultBatchedTokens, c)
		if math.Abs(p.Compute-want) > 1e-9*want {
			t.Errorf("u=%v: Compute %v, want the chunks' token time %v", u, p.Compute, want)
		}
		// The prefill is that plus a step constant per chunk (the first one in FeatBias).
		steps := math.Ceil(u / DefaultBatchedTokens)
		if got, want := p.Prefill, want+steps*c.C/1000; math.Abs(got-want) > 1e-6 {
			t.Errorf("u=%v: Prefill %v, want %v", u, got, want)
		}
	}
}

// TestWorkersShareModel: identical workers learning together predict alike (so that none
// looks cheaper by the noise of its own fit and draws every request), while a worker twice
// as slow as its peers learns its speed.
func TestWorkersShareModel(t *testing.T) {
	fast := syntheticEngine{speedup: 10, itl0: 0.01, hold: 1, seqs: 8}
	slow := fast
	slow.speedup = 5
	_, ws := newWorkers(4)
	rng := rand.New(rand.NewPCG(5, 6))
	for range 200 {
		for i, w := range ws {
			eng := fast
			if i == 3 {
				eng = slow
			}
			teach(w, eng, rng, 1)
		}
	}
	var speeds []float64
	for _, w := range ws {
		speeds = append(speeds, w.Stats().Speed)
	}
	t.Logf("speeds %.3f", speeds)
	for i := 1; i < 3; i++ {
		if math.Abs(speeds[i]/speeds[0]-1) > 0.1 {
			t.Fatalf("identical workers learned speeds %.3f", speeds[:3])
		}
	}
	// The slow worker's prefill takes twice as long, its decode steps do not: its speed
	// against the model lies between 1.5 and 2 times the others'.
	if r := speeds[3] / speeds[0]; r < 1.5 || r > 2.5 {
		t.Fatalf("the worker twice as slow learned %.2f times the others' speed, want about 2", r)
	}
	st, u := State{Requests: 2, Backlog: 3000}, 4000.0
	for i, w := range ws {
		eng := fast
		if i == 3 {
			eng = slow
		}
		var p Prediction
		w.Predict(&Engine{}, st, u, &p)
		if want := eng.ttft(st, u); math.Abs(p.TTFT/want-1) > 0.1 {
			t.Fatalf("worker %d predicts %.1f ms, its engine takes %.1f", i, 1e3*p.TTFT, 1e3*want)
		}
	}
}

func newWorker() *Worker {
	_, ws := newWorkers(1)
	return ws[0]
}

// TestPredictSlotWait: a worker at its limit predicts a wait that grows with the requests
// ahead; one below it predicts none.
func TestPredictSlotWait(t *testing.T) {
	w := newWorker()
	e := &Engine{MaxNumSeqs: 4}
	var below, at, over Prediction
	w.Predict(e, State{Requests: 3}, 1000, &below)
	w.Predict(e, State{Requests: 4}, 1000, &at)
	w.Predict(e, State{Requests: 6}, 1000, &over)
	if below.X[FeatSlotWait] != 0 || at.X[FeatSlotWait] <= 0 || math.Abs(over.X[FeatSlotWait]-3*at.X[FeatSlotWait]) > 1e-9 {
		t.Fatalf("slot waits %v %v %v", below.X[FeatSlotWait], at.X[FeatSlotWait], over.X[FeatSlotWait])
	}
	if !(below.TTFT < at.TTFT && at.TTFT < over.TTFT) {
		t.Fatalf("TTFTs %v %v %v not increasing", below.TTFT, at.TTFT, over.TTFT)
	}
}

// TestDecodeStepPerWorker: two workers of one model, one decoding twice as slowly as the
// other at every batch size: the model's step is between them, and each worker's DecodeStep
// is its own.
func TestDecodeStepPerWorker(t *testing.T) {
	var m Model
	m.Init()
	var fast, slow Worker
	fast.Init(&m)
	slow.Init(&m)
	for range 300 {
		for b := 1; b <= 4; b++ {
			fast.ObserveDecode(b, 0.2, 0.010+0.002*float64(b), 1)
			slow.ObserveDecode(b, 0.2, 2*(0.010+0.002*float64(b)), 2)
		}
	}
	for b := 1; b <= 4; b++ {
		want := 0.010 + 0.002*float64(b)
		f, s := fast.DecodeStep(b, 0.2), slow.DecodeStep(b, 0.2)
		if math.Abs(f/want-1) > 0.15 || math.Abs(s/(2*want)-1) > 0.15 {
			t.Errorf("batch %d: steps %.4f and %.4f, want %.4f and %.4f (the model's %.4f)", b, f, s, want, 2*want, m.ITL(b, 0.2))
		}
	}
}

// Slowdown is what joining the running batch costs in decode time: none on an idle worker,
// growing with the batch, for a request that waits for a slot only the running requests'
// wait behind its prefill, and none without an OSL.
func TestPredictSlowdown(t *testing.T) {
	w := newWorker()
	for range 200 { // an engine whose step grows 5 ms per running request
		for b := 1; b <= 4; b++ {
			w.ObserveDecode(b, 0.2, 0.010+0.005*float64(b), 1)
		}
	}
	e := &Engine{MaxNumSeqs: 4}
	var idle, two, three, full, unknown Prediction
	w.Predict(e, State{Requests: 0, OSL: 64, KVUsage: 0.2}, 100, &idle)
	w.Predict(e, State{Requests: 2, OSL: 64, KVUsage: 0.2}, 100, &two)
	w.Predict(e, State{Requests: 3, OSL: 64, KVUsage: 0.2}, 100, &three)
	w.Predict(e, State{Requests: 4, OSL: 64, KVUsage: 0.2}, 100, &full)
	w.Predict(e, State{Requests: 3, KVUsage: 0.2}, 100, &unknown)
	if idle.Slowdown != 0 || unknown.Slowdown != 0 {
		t.Fatalf("slowdown idle %v, no OSL %v: want 0", idle.Slowdown, unknown.Slowdown)
	}
	// Waiting for a slot, it only holds up the 4 running requests while it prefills.
	if want := 4 * full.Compute; full.Compute <= 0 || math.Abs(full.Slowdown-want) > 1e-12 {
		t.Fatalf("slowdown of a request waiting for a slot %v, want 4 × its compute %v", full.Slowdown, full.Compute)
	}
	// 5 ms a token more for 3 running requests' 32 tokens left and this one's 64: 1.44 s,
	// and the 3 running requests' wait behind its 100 tokens' prefill.
	if want := 0.005*3*1.5*64 + 3*three.Compute; math.Abs(three.Slowdown-want) > 0.1*want || !(two.Slowdown < three.Slowdown) {
		t.Fatalf("slowdown with 2 and 3 running: %v, %v; want about %v for 3", two.Slowdown, three.Slowdown, want)
	}
}

func TestPredictAllocs(t *testing.T) {
	w := newWorker()
	e := &Engine{MaxNumSeqs: 8}
	var p Prediction
	if n := testing.AllocsPerRun(100, func() { w.Predict(e, State{Requests: 9, Backlog: 4000}, 3000, &p) }); n != 0 {
		t.Fatalf("Predict allocates %v times", n)
	}
}

func BenchmarkPredict(b *testing.B) {
	w := newWorker()
	e := &Engine{MaxNumSeqs: 8}
	var p Prediction
	b.ReportAllocs()
	for b.Loop() {
		w.Predict(e, State{Requests: 9, Backlog: 4000}, 3000, &p)
	}
}

// TestSlotWait: the slot frees when the oldest running request's occupancy runs out; each
// request queued ahead takes the next free slot for a whole occupancy; slots of requests
// nobody here knows count half of it, prefilling ones all of it.
func TestSlotWait(t *testing.T) {
	for _, tc := range []struct {
		name                string
		seqs, queued        int
		ages                []float64
		prefilling, unknown int
		want                float64
	}{
		{"the oldest ends first", 2, 0, []float64{1.0, 0.2}, 0, 0, 0.2},
		{"one queued ahead takes it", 2, 1, []float64{1.0, 0.2}, 0, 0, 1.0},
		{"two ahead", 2, 2, []float64{1.0, 0.2}, 0, 0, 1.4},
		{"a prefilling request holds its slot the whole occupancy", 2, 0, []float64{0.2}, 1, 0, 1.0},
		{"another proxy's request, half", 2, 0, nil, 0, 2, 0.6},
		{"an occupancy past its mean ends now", 1, 0, []float64{3}, 0, 0, 0},
	} {
		var left []float64
		for _, a := range tc.ages {
			left = append(left, max(1.2-a, 0))
		}
		got, ok := SlotWait(tc.seqs, tc.queued, left, tc.prefilling, tc.unknown, 1.2)
		if !ok || math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("%s: %v (%v), want %v", tc.name, got, ok, tc.want)
		}
	}
	if _, ok := SlotWait(256, 0, nil, 0, 0, 1); ok {
		t.Error("256 slots followed one by one")
	}
}

// TestRLSRecoversAtBounds: features that move together (the first step's constant, the
// decode step beside the prefill, the step's share that grows as the batch fills), a
// coefficient the fit drives onto its bound, and a stretch of observations five times too
// slow (an engine stalled for a while). Clamping a coefficient without moving the others
// with it leaves the fit believing it moved and makes it run away; projected in the fit's
// own metric it comes back to the truth once the stall is over.
func TestRLSRecoversAtBounds(t *testing.T) {
	for _, stall := range []float64{5, 0.5} {
		t.Run(fmt.Sprintf("×%g", stall), func(t *testing.T) {
			var m Model
			m.Init()
			rng := rand.New(rand.NewPCG(3, 4))
			truth := Vec{2.7, 0, 1.4, 1.9, 0.4, 1, 1.5}
			batch := 30.0
			var errs, dec []float64
			const n = 6000
			for i := range n {
				batch = min(max(batch+rng.NormFloat64(), 4), 60)
				step := 0.0165
				x := Vec{step, 0, 0.01 * rng.ExpFloat64(), 0.012 * rng.ExpFloat64(), 0, 0.0165 + 0.00025*batch + 0.001*rng.NormFloat64(), step * batch / 256}
				x[FeatLoadedPrefill] = x[FeatPrefill] * batch / 256
				var y float64
				for j := range numFeat {
					y += truth[j] * x[j]
				}
				y *= math.Exp(0.15 * rng.NormFloat64())
				if i >= 2000 && i < 2300 {
					y *= stall
				}
				var f fit
				m.fit(&f)
				var p float64
				for j := range numFeat {
					p += f.theta[j] * x[j]
				}
				if i >= n-1000 {
					errs = append(errs, math.Abs(p-y)/y)
				}
				dec = append(dec, (p-y)/y)
				if i%600 == 599 {
					slices.Sort(dec)
					t.Logf("observations %d–%d: median relative error %+.2f, θ %.3f", i-599, i, dec[len(dec)/2], m.ttft.Theta[:numFeat])
					dec = dec[:0]
				}
				m.observeTTFT(&x, y)
			}
			slices.Sort(errs)
			if e := errs[len(errs)/2]; e > 0.15 {
				t.Errorf("median relative error over the last 1000 observations %.2f, want ≤ 0.15 (θ %.3f)", e, m.ttft.Theta[:numFeat])
			}
		})
	}
}

// TestRLSBoundedSolution: where the data want a coefficient past its bound, the fit is the
// least-squares solution with it at the bound (the others refitted without it), not the free
// solution with that coefficient clamped.
func TestRLSBoundedSolution(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	r := RLS{Lambda: 1, Lo: Vec{0, 0}, Hi: Vec{10, 10}}
	r.Init(2, Vec{1, 1}, Vec{1e6, 1e6})
	var sxx, sxy float64
	for range 2000 {
		// x₁ moves with x₀, and y falls with x₁: the free fit wants θ₁ < 0.
		a := rng.Float64()
		x := Vec{a, a + 0.3*rng.Float64()}
		y := 2*x[0] - 0.5*x[1]
		r.Update(&x, y)
		sxx += x[0] * x[0]
		sxy += x[0] * y
	}
	want := sxy / sxx // θ₀ alone, θ₁ held at 0
	if r.Theta[1] != 0 || math.Abs(r.Theta[0]-want) > 1e-3 {
		t.Fatalf("θ = %.4f, want [%.4f 0]", r.Theta[:2], want)
	}
}
