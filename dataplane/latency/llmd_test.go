package latency

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// llmdEngine is an event-driven copy of llm-d-inference-sim's latency model, the engine of
// the side-by-side benchmark: up to seqs requests run, the rest wait in arrival order; a
// request that starts with r requests running (itself included) takes
// (overhead + perToken·uncached)·f(r) to its first token and out tokens of itl·f(r) each
// after it, with f(r) = 1 + (factor−1)·(r−1)/(seqs−1). Its prefill has a per-request
// overhead (25 ms) beside a per-token slope (60 µs) in another ratio than the prior curve's.
type llmdEngine struct {
	seqs                    int
	overhead, perToken, itl float64
	factor                  float64
	out                     int
	running                 []*llmdReq
	waiting                 []*llmdReq
}

type llmdReq struct {
	arrive, start, first, end float64
	uncached                  float64
	pred                      Prediction
	taught                    bool
}

func (e *llmdEngine) f(r int) float64 {
	return 1 + (e.factor-1)*float64(r-1)/float64(e.seqs-1)
}

// advance runs the engine up to time t: requests end, and waiting ones start in their place.
func (e *llmdEngine) advance(t float64, done func(*llmdReq)) {
	for {
		// The next end before t, if any.
		next := -1
		for i, r := range e.running {
			if r.end <= t && (next < 0 || r.end < e.running[next].end) {
				next = i
			}
		}
		if next < 0 {
			return
		}
		r := e.running[next]
		e.running = append(e.running[:next], e.running[next+1:]...)
		done(r)
		if len(e.waiting) > 0 {
			w := e.waiting[0]
			e.waiting = e.waiting[1:]
			e.begin(w, r.end)
		}
	}
}

func (e *llmdEngine) begin(r *llmdReq, at float64) {
	e.running = append(e.running, r)
	f := e.f(len(e.running))
	r.start = at
	r.first = at + (e.overhead+e.perToken*r.uncached)*f
	r.end = r.first + float64(e.out-1)*e.itl*f
}

func (e *llmdEngine) submit(r *llmdReq) {
	if len(e.running) < e.seqs {
		e.begin(r, r.arrive)
		return
	}
	e.waiting = append(e.waiting, r)
}

// TestLearnsLLMDSimulator routes a stream of agentic-shaped requests (mostly short uncached
// suffixes after a cached preamble, some whole prompts) to one llm-d-shaped engine,
// predicting each as the router does (slot wait from the requests it has running there),
// and learns from each first token and each end. After warm-up the median relative error
// is under 20% for short and long prompts alike, and under 8% for long ones: the engine's
// prefill slows in proportion to its batch, which the loaded-prefill coefficient has to
// learn far from its prior (about 4 against 0).
func TestLearnsLLMDSimulator(t *testing.T) {
	e := &llmdEngine{seqs: 4, overhead: 0.025, perToken: 60e-6, itl: 0.015, factor: 2, out: 64}
	w := newWorker()
	eng := &Engine{MaxNumSeqs: e.seqs}
	rng := rand.New(rand.NewPCG(3, 4))
	var reqs []*llmdReq
	now := 0.0
	observe := func(r *llmdReq) {
		held := r.end - r.first
		w.ObserveDecode(min(len(e.running)+1, e.seqs), 0.3, held/float64(e.out-1), held)
	}
	for range 1500 {
		now += rng.ExpFloat64() * 0.6
		// First tokens that came before now teach the model, in the order they came.
		var firsts []*llmdReq
		for _, r := range reqs {
			if !r.taught && r.first > 0 && r.first <= now {
				firsts = append(firsts, r)
			}
		}
		sort.Slice(firsts, func(a, b int) bool { return firsts[a].first < firsts[b].first })
		for _, r := range firsts {
			w.ObserveTTFT(&r.pred, r.first-r.arrive)
			r.taught = true
		}
		e.advance(now, observe)
		u := 50 + rng.Float64()*400
		if rng.Float64() < 0.15 {
			u = 2000 + rng.Float64()*5000
		}
		r := &llmdReq{arrive: now, uncached: u}
		// What the router knows: the requests it has there, the ages of those decoding.
		var ages []float64
		prefilling := 0
		for _, o := range e.running {
			if o.first <= now {
				ages = append(ages, max(w.Occupancy()-(now-o.first), 0))
			} else {
				prefilling++
			}
		}
		st := State{Requests: len(e.running) + len(e.waiting), KVUsage: 0.3}
		st.SlotWait, st.HasSlotWait = SlotWait(e.seqs, len(e.waiting), ages, prefilling, 0, w.Occupancy())
		w.Predict(eng, st, u, &r.pred)
		e.submit(r)
		reqs = append(reqs, r)
	}
	e.advance(math.Inf(1), observe)
	var short, long, all []float64
	for i, r := range reqs {
		if i < 300 {
			continue
		}
		y := r.first - r.arrive
		rel := math.Abs(r.pred.TTFT-y) / y
		all = append(all, rel)
		if r.uncached < 1000 {
			short = append(short, rel)
		} else {
			long = append(long, rel)
		}
	}
	med := func(v []float64) float64 { sort.Float64s(v); return v[len(v)/2] }
	t.Logf("median relative error: all %.1f%%, short prompts %.1f%% (%d), long %.1f%% (%d); model %+v",
		100*med(all), 100*med(short), len(short), 100*med(long), len(long), w.Stats())
	if med(all) > 0.2 || med(short) > 0.2 || med(long) > 0.08 {
		t.Fatalf("median relative error all %.1f%%, short %.1f%%, long %.1f%%: want under 20%%, 20%% and 8%%", 100*med(all), 100*med(short), 100*med(long))
	}
}
