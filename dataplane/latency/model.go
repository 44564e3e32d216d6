package latency

import (
	"math"
	"sync"
	"sync/atomic"
)

// Curve is an engine's step time for T new prefill tokens in one step, A·T² + B·T + C
// milliseconds. Its shape is the prior of a worker's prefill model; Model learns how far a
// worker's real times sit from it.
type Curve struct{ A, B, C float64 }

// DefaultCurve is ARCHITECTURE.md's fit for a vLLM server (gpt-oss-120b on one H200), the
// simulated engine's default step time at speedup 1.
func DefaultCurve() Curve { return Curve{A: 4.209989e-7, B: 1.518344e-2, C: 16.50142} }

// StepSeconds is the time of a step computing t new prefill tokens (0 for none).
func (c Curve) StepSeconds(t float64) float64 {
	if t <= 0 {
		return 0
	}
	return (c.A*t*t + c.B*t + c.C) / 1000
}

// Engine is what the model knows of a worker's scheduler; zero fields are unknown.
type Engine struct {
	// MaxNumSeqs is how many requests run at once (vLLM's --max-num-seqs); requests past
	// it wait for one to finish.
	MaxNumSeqs int
	// MaxBatchedTokens is the token budget of one step (--max-num-batched-tokens): a
	// prefill longer than that takes several steps. Default DefaultBatchedTokens.
	MaxBatchedTokens int
	// Curve is the prior of the worker's prefill time; the zero value is DefaultCurve.
	Curve Curve
}

// DefaultBatchedTokens is the step budget assumed when a worker's is not known (vLLM's
// default for online serving).
const DefaultBatchedTokens = 8192

// State is a worker's load at a decision, as the router sees it.
type State struct {
	// Requests on the worker: running plus waiting.
	Requests int
	// Backlog is the uncached prompt tokens queued ahead of a new request and not yet
	// computed.
	Backlog float64
	// KVUsage is the fraction of the worker's KV cache in use.
	KVUsage float64
}

// Features of a candidate request on a worker, in seconds, as the prior (the worker's
// curve, its step budget, its decode step and how long a request holds a slot) computes
// them. The TTFT model is θ₀ + θ₁·SlotWait + θ₂·QueueWait + θ₃·Prefill.
const (
	FeatBias = iota
	// FeatSlotWait is the wait for a free sequence slot when the worker runs MaxNumSeqs
	// requests already: the requests ahead of this one for a slot, each freeing one after
	// the mean time a request holds its slot over the slots plus one (the expected
	// first of S uniform residual times).
	FeatSlotWait
	// FeatQueueWait is the time to compute the prefill backlog ahead, in chunks of the step
	// budget, each step also decoding the running batch.
	FeatQueueWait
	// FeatPrefill is the request's own uncached tokens, computed after the backlog.
	FeatPrefill
	numFeat
)

// Prediction is what the model says of a candidate.
type Prediction struct {
	X Vec // the features, kept to learn from the outcome
	// TTFT is the predicted time to first token in seconds; Queue and Prefill its parts
	// (bias and slot and queue waits, own prefill) after correction.
	TTFT, Queue, Prefill float64
	// ITL is the predicted time between tokens once this request runs.
	ITL float64
}

// Model predicts one worker's TTFT and inter-token latency and learns both from what the
// worker does. Predict reads only atomics and is safe to call from every event loop at
// once; the Observe methods serialise on a mutex. The zero value is not ready: call Init.
type Model struct {
	mu   sync.Mutex
	ttft RLS // features above
	itl  RLS // [1, batch size]
	occ  float64
	nOcc int

	// Published for Predict: the coefficients and the slot occupancy, as float64 bits.
	theta  [numFeat]atomic.Uint64
	itlCo  [2]atomic.Uint64
	occBit atomic.Uint64
	// seqs is MaxNumSeqs learned from reports (running while requests wait), 0 unknown.
	seqs        atomic.Int64
	ttftN, itlN atomic.Int64
}

// Priors, in seconds.
const (
	priorITL = 0.015
	// priorOutput is the output tokens assumed per request for the slot occupancy until a
	// request on the worker has finished.
	priorOutput = 128
)

// Init resets the model to its prior: the worker's prefill takes its curve's time, a decode
// step priorITL, a request holds its slot priorOutput decode steps.
func (m *Model) Init() {
	m.mu.Lock()
	defer m.mu.Unlock()
	// Both fits are on relative error (Observe divides by the prediction), so the prior
	// variances are over a relative noise variance of about 0.1²: a multiplier of the prior
	// curve is known to a factor of ten or so, the bias to ~10 ms, the decode step to ~20 ms
	// and its growth per sequence to ~5 ms.
	m.ttft = RLS{Lambda: 0.98, OutlierK: 4,
		Lo: Vec{0, 0.001, 0.001, 0.001}, Hi: Vec{10, 100, 100, 100}}
	m.ttft.Init(numFeat, Vec{0, 1, 1, 1}, Vec{0.01, 100, 100, 100})
	m.itl = RLS{Lambda: 0.99, OutlierK: 4, Lo: Vec{1e-4, 0}, Hi: Vec{5, 1}}
	m.itl.Init(2, Vec{priorITL, 0}, Vec{0.04, 0.0025})
	m.occ, m.nOcc = priorITL*priorOutput, 0
	m.publishLocked()
	m.seqs.Store(0)
}

func (m *Model) publishLocked() {
	for i := range numFeat {
		m.theta[i].Store(math.Float64bits(m.ttft.Theta[i]))
	}
	m.itlCo[0].Store(math.Float64bits(m.itl.Theta[0]))
	m.itlCo[1].Store(math.Float64bits(m.itl.Theta[1]))
	m.occBit.Store(math.Float64bits(m.occ))
	m.ttftN.Store(int64(m.ttft.Count()))
	m.itlN.Store(int64(m.itl.Count()))
}

func (m *Model) load(a *atomic.Uint64) float64 { return math.Float64frombits(a.Load()) }

// ITL predicts the time between tokens at batch size b.
func (m *Model) ITL(b int) float64 {
	return m.load(&m.itlCo[0]) + m.load(&m.itlCo[1])*float64(b)
}

// MaxNumSeqs is the concurrency limit: e's when known, else what reports taught.
func (m *Model) MaxNumSeqs(e *Engine) int {
	if e.MaxNumSeqs > 0 {
		return e.MaxNumSeqs
	}
	return int(m.seqs.Load())
}

// Predict fills p for a request with uncached prompt tokens on a worker in state st.
func (m *Model) Predict(e *Engine, st State, uncached float64, p *Prediction) {
	curve := e.Curve
	if curve == (Curve{}) {
		curve = DefaultCurve()
	}
	budget := float64(e.MaxBatchedTokens)
	if budget <= 0 {
		budget = DefaultBatchedTokens
	}
	seqs := m.MaxNumSeqs(e)
	batch := st.Requests
	if seqs > 0 {
		batch = min(batch, seqs)
	}
	decode := 0.0
	if batch > 0 {
		decode = m.ITL(batch)
	}
	queue := chunked(st.Backlog, budget, curve, decode)
	own := chunked(st.Backlog+max(uncached, 0), budget, curve, decode) - queue
	slot := 0.0
	if seqs > 0 && st.Requests >= seqs {
		slot = float64(st.Requests-seqs+1) * m.load(&m.occBit) / float64(seqs+1)
	}
	p.X = Vec{1, slot, queue, own}
	t0, t1, t2, t3 := m.load(&m.theta[0]), m.load(&m.theta[1]), m.load(&m.theta[2]), m.load(&m.theta[3])
	p.Queue = t0 + t1*slot + t2*queue
	p.Prefill = t3 * own
	p.TTFT = p.Queue + p.Prefill
	p.ITL = m.ITL(batch + 1)
}

// chunked is the time to compute t prefill tokens in steps of at most budget tokens, each
// step also decoding the running batch (decode seconds, 0 when nothing decodes).
func chunked(t, budget float64, c Curve, decode float64) float64 {
	if t <= 0 {
		return 0
	}
	full := math.Floor(t / budget)
	rem := t - full*budget
	s := full * (c.StepSeconds(budget) + decode)
	if rem > 0 {
		s += c.StepSeconds(rem) + decode
	}
	return s
}

// minScale floors the scale observations are divided by, so a near-zero prediction does
// not make one observation weigh without bound.
const minScale = 1e-3

// relative divides x and y by the current prediction θ·x (at least minScale).
func relative(r *RLS, x *Vec, y float64) (Vec, float64) {
	s := max(r.Predict(x), minScale)
	var xs Vec
	for i := range r.N {
		xs[i] = x[i] / s
	}
	return xs, y / s
}

// ObserveTTFT learns from a request predicted with features x whose first token came ttft
// seconds after it was sent. It reports whether the observation was clipped as an outlier.
func (m *Model) ObserveTTFT(x *Vec, ttft float64) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	xs, ys := relative(&m.ttft, x, ttft)
	clipped := m.ttft.Update(&xs, ys)
	m.publishLocked()
	return clipped
}

// ObserveDecode learns from a finished request: its mean time between tokens at the batch
// size it ran in, and how long it held its slot (first token to last).
func (m *Model) ObserveDecode(batch int, itl, held float64) {
	if batch < 1 || itl <= 0 || math.IsNaN(itl) || math.IsInf(itl, 0) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	x := Vec{1, float64(batch)}
	xs, ys := relative(&m.itl, &x, itl)
	m.itl.Update(&xs, ys)
	if held > 0 && !math.IsInf(held, 0) {
		if m.nOcc == 0 {
			m.occ = held
		} else {
			m.occ = 0.9*m.occ + 0.1*held
		}
		m.nOcc++
	}
	m.publishLocked()
}

// ObserveReport learns the concurrency limit from an engine's report: while requests wait,
// the running ones fill every slot (or the KV cache, which makes this a lower bound).
func (m *Model) ObserveReport(running, waiting int) {
	if waiting <= 0 || running <= 0 {
		return
	}
	for {
		cur := m.seqs.Load()
		if int64(running) <= cur || m.seqs.CompareAndSwap(cur, int64(running)) {
			return
		}
	}
}

// Stats is a snapshot of the model for operators.
type Stats struct {
	Theta        Vec
	ITL          [2]float64
	Occupancy    float64
	Observations int64
	Decodes      int64
	MaxNumSeqs   int64
}

// Stats returns the model's current coefficients.
func (m *Model) Stats() Stats {
	var s Stats
	for i := range numFeat {
		s.Theta[i] = m.load(&m.theta[i])
	}
	s.ITL = [2]float64{m.load(&m.itlCo[0]), m.load(&m.itlCo[1])}
	s.Occupancy = m.load(&m.occBit)
	s.Observations, s.Decodes, s.MaxNumSeqs = m.ttftN.Load(), m.itlN.Load(), m.seqs.Load()
	return s
}
