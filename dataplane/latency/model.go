package latency

import (
	"math"
	"sync"
	"sync/atomic"
)

// Curve is an engine's step time for T new prefill tokens in one step, A·T² + B·T + C
// milliseconds. Its shape is the prior of a worker's prefill model; Model learns how far the
// workers' real times sit from it.
type Curve struct{ A, B, C float64 }

// DefaultCurve is the simulated engine's default prefill step time at speedup 1
// (sim.DefaultTiming). Its coefficients are an assumption, not a fit kvrelay measured on
// any GPU (docs/timing-model.md says where they come from); Model learns each worker's
// departure from it.
func DefaultCurve() Curve { return Curve{A: 4.209989e-7, B: 1.518344e-2, C: 16.50142} }

// StepSeconds is the time of a step computing t new prefill tokens (0 for none).
func (c Curve) StepSeconds(t float64) float64 {
	if t <= 0 {
		return 0
	}
	return (c.A*t*t + c.B*t + c.C) / 1000
}

// TokenSeconds is the part of the curve that grows with the tokens, A·T² + B·T, for t
// tokens computed alone: their cost apart from the per-step constant.
func (c Curve) TokenSeconds(t float64) float64 {
	if t <= 0 {
		return 0
	}
	return (c.A*t*t + c.B*t) / 1000
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
	// KVBytesPerToken, HostBandwidth, DiskBandwidth and SharedBandwidth (bytes per second,
	// host, disk or storage several workers mount to GPU) price bringing back the cached
	// blocks a worker keeps in host memory, on disk or in shared storage; zero is unknown,
	// and the index's tier weights stand in for the price.
	KVBytesPerToken                               float64
	HostBandwidth, DiskBandwidth, SharedBandwidth float64
	// PeerBandwidth is how fast the worker pulls a prefix another worker caches (peer
	// fetch), bytes per second; 0: it cannot.
	PeerBandwidth float64
}

// Onboards reports whether the engine's onboarding from host memory or disk can be priced.
func (e *Engine) Onboards() bool {
	return e.KVBytesPerToken > 0 && (e.HostBandwidth > 0 || e.DiskBandwidth > 0 || e.SharedBandwidth > 0)
}

// Fetches reports whether the engine pulls prefixes from peers at a known price.
func (e *Engine) Fetches() bool {
	return e.PeerBandwidth > 0 && e.KVBytesPerToken > 0
}

// OnboardSeconds is the time of bringing host, disk and shared storage tokens' KV into GPU
// memory (a tier of unknown bandwidth costs nothing here: its blocks are not counted as
// cached).
func (e *Engine) OnboardSeconds(host, disk, shared float64) float64 {
	var s float64
	if host > 0 && e.HostBandwidth > 0 {
		s += host * e.KVBytesPerToken / e.HostBandwidth
	}
	if disk > 0 && e.DiskBandwidth > 0 {
		s += disk * e.KVBytesPerToken / e.DiskBandwidth
	}
	if shared > 0 && e.SharedBandwidth > 0 {
		s += shared * e.KVBytesPerToken / e.SharedBandwidth
	}
	return s
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
	// OSL is the output tokens expected of the request (and, for Slowdown, of those running),
	// 0 when unknown.
	OSL float64
	// SlotWait, when HasSlotWait, is the wait for a sequence slot as the caller worked it
	// out from the requests it knows running there (func SlotWait), in place of the
	// mean-residual estimate FeatSlotWait otherwise takes.
	SlotWait    float64
	HasSlotWait bool
	// Onboard is the time the request's cached blocks in host memory or on disk take to
	// come back to GPU memory (Engine.OnboardSeconds). Engines overlap it with the prefill,
	// layer by layer: the slower of the two sets the request's own time.
	Onboard float64
	// Cached is the prompt tokens cached ahead of the uncached ones: the context its new
	// tokens attend to (FeatAttention).
	Cached float64
}

// Features of a candidate request on a worker, in seconds, as the prior computes them: the
// TTFT model is θ₀·Step + θ₆·LoadedStep + θ₁·SlotWait + θ₂·Queue + θ₃·Prefill +
// θ₄·LoadedPrefill + θ₅·Decode.
const (
	// FeatBias is the per-step constant of the prior curve (C), once: the step the
	// request's first token comes out of, whatever its prompt. Engines learn θ₀ as their
	// per-request overhead in multiples of it, apart from what each token costs.
	FeatBias = iota
	// FeatSlotWait is the wait for a free sequence slot when the worker runs MaxNumSeqs
	// requests already: the requests ahead of this one for a slot, each freeing one after
	// the mean time a request holds its slot there over the slots plus one (the expected
	// first of S uniform residual times).
	FeatSlotWait
	// FeatQueue is the compute of the prefill backlog ahead, in chunks of the step budget,
	// on the prior curve scaled by the worker's learned speed. An engine that computes
	// prefills one after another (vLLM, SGLang) learns θ₂ near θ₃; one that runs them side
	// by side learns it near 0.
	FeatQueue
	// FeatPrefill is what the request's own uncached tokens add to that compute, less the
	// first step's constant that FeatBias carries.
	FeatPrefill
	// FeatLoadedPrefill is FeatPrefill times the share of the worker's sequence slots in
	// use (0 when its limit is unknown): engines whose prefill slows as their batch fills
	// learn θ₄ above 0.
	FeatLoadedPrefill
	// FeatDecode is the decode step of the running batch that each of those prefill steps
	// also takes, at the model's learned step time (θ₅ near 1).
	FeatDecode
	// FeatLoadedBias is FeatBias times the share of the slots in use: the per-request
	// overhead's growth with the batch (θ₆), as FeatLoadedPrefill is the tokens'.
	FeatLoadedBias
	// FeatAttention is attention over the context: each new token attends to the cached
	// prefix and to the new tokens before it, u·(cached + u/2) token pairs, priced so that at
	// attentionContext tokens of context a token costs its linear price again (the shape of
	// FlashAttention's cost for an 8B-class model). Its coefficient starts at 0 (the prior
	// curve prices a step by its new tokens alone) and grows where long cached contexts
	// prefill slower than short ones: the shape is fit from what the engines do.
	FeatAttention
	numFeat
)

// attentionContext is the context, in tokens, at which FeatAttention prices a token's
// attention at its linear cost (the curve's B): for a model of d_model 4096 and 32 layers,
// attention's 4·d·L FLOPs per token pair against 2·8·10⁹ per token cross at about 30,000
// tokens. It scales the feature; the learned coefficient sets what it is worth.
const attentionContext = 32768

// Prediction is what the model says of a candidate.
type Prediction struct {
	X Vec // the features, kept to learn from the outcome
	// TTFT is the predicted time to first token in seconds: Queue (slot wait and the
	// backlog's prefill) plus Prefill (the request's own step overhead and what its
	// uncached tokens add, the steps they start included).
	TTFT, Queue, Prefill float64
	// Compute is the engine time the request's uncached tokens take, apart from the per-step
	// costs it shares with the requests in the same steps: what placing it there costs
	// everyone after it on the worker.
	Compute float64
	// ITL is the predicted time between tokens once this request runs.
	ITL float64
	// Wait is the part of Queue that is the wait for a sequence slot (0 when the worker has
	// one free).
	Wait float64
	// Fetch is the time pulling the prompt's prefix from a peer takes, when the router chose
	// that over computing it (then in Queue and TTFT; 0 otherwise).
	Fetch float64
	// Slowdown is the decode time (seconds, summed over requests) that running this request
	// here adds beyond what it would take alone: its own OSL tokens at the batch's step
	// time instead of a lone request's, the running requests' remaining tokens one request
	// slower each (State.OSL of them, half of OSL left on average), and the running
	// requests' wait behind its prefill (each of them decodes in the steps that compute it:
	// Compute once per running request). Engines whose step grows with the batch pay the
	// first two; every engine that batches prefills with decodes pays the third. It is what
	// an even spread saves.
	Slowdown float64
	// Spread is the prediction's uncertainty in seconds, one standard deviation of TTFT:
	// the queue's and the prefill's parts each times the relative error the worker's recent
	// predictions of that kind showed (its own record, pooled with a prior that weighs as
	// much as priorResidualN observations, so a worker with little data counts as unsure).
	Spread float64
	// Hold is how long the request is expected to hold a sequence slot on the worker: its
	// TTFT and its expected output at the batch's step time.
	Hold float64
	// Busy is the share of the worker's sequence slots in use before the request (the
	// requests on it over its limit, at most 1; without a known limit, n/(n+1) for n
	// requests): the share of its compute that delays someone else.
	Busy float64
	// Scarcity is how scarce the worker's slots become with the request: 1/((free+1)·seqs)
	// for free slots left after it of seqs, 0 without a known limit. Taking a worker's last
	// slots leaves the next requests that want it a wait (about a hold over seqs, until the
	// first of its running requests ends), or a cache miss elsewhere.
	Scarcity float64
	// Ahead is the requests on the worker at the prediction (State.Requests), and KV its KV
	// usage then, kept to learn the worker's concurrency limit from the outcome.
	Ahead int
	KV    float64
}

// Model is the latency model of the workers that serve one model, learned from all of them:
// the TTFT coefficients over the prior's features and the decode step time against batch
// size and KV usage. Worker adds each worker's own speed, slot occupancy and limits. Its
// predictions read only atomics, one published fit at a time; learning takes its mutex.
// Call Init before use.
type Model struct {
	mu   sync.Mutex
	ttft RLS // features above
	dec  decodeTable
	// resid is the decayed mean log of observed over predicted prefill time across the
	// model's workers: a worker's speed moves by how far its own stray from it, so the
	// speeds say how the workers differ and the coefficients how fast they are together.
	resid float64
	// cur is the fit last published, the learners' own copy (guarded by mu); pub is what
	// predictions read.
	cur fit
	pub pubFit

	ttftN atomic.Int64
	itlN  atomic.Int64
	// seqs is the concurrency limit last learned of one of the model's workers, which its
	// others are taken to share until their own reports say otherwise (0: none learned);
	// seqsLow the most requests any of them was seen to run.
	seqs    atomic.Int64
	seqsLow atomic.Int64
}

// fit is one published state of a Model: the TTFT coefficients and the decode table
// together. A prediction reads one fit whole, never the coefficients of one beside the
// decode steps (or half the coefficients) of another.
type fit struct {
	theta [numFeat]float64
	step  [numDecode]float64 // decode step time per batch bucket at an empty cache, seconds
	kv    [numKV]float64     // decode step multiplier per KV knot
}

// pubFit publishes a fit to readers on every event loop without locks or allocation: a
// sequence lock over atomics. The writer (holding Model.mu) makes seq odd, stores the fit,
// and makes seq even again; a reader keeps what it read only when seq was the same even
// number before and after, and tries again otherwise. A reader that keeps losing to writers
// takes Model.mu, under which no writer publishes, and reads once more: it never spins for
// long behind a writer descheduled mid-store.
type pubFit struct {
	seq   atomic.Uint64
	theta [numFeat]atomic.Uint64 // float64 bits, as the fields of fit
	step  [numDecode]atomic.Uint64
	kv    [numKV]atomic.Uint64
}

// readTries is how often a reader tries the sequence lock before it takes the mutex.
const readTries = 4

// store publishes f. The caller holds Model.mu (the only writer).
func (p *pubFit) store(f *fit) {
	p.seq.Add(1)
	for i := range f.theta {
		p.theta[i].Store(math.Float64bits(f.theta[i]))
	}
	for i := range f.step {
		p.step[i].Store(math.Float64bits(f.step[i]))
	}
	for i := range f.kv {
		p.kv[i].Store(math.Float64bits(f.kv[i]))
	}
	p.seq.Add(1)
}

// load copies p into f and reports whether no writer published meanwhile.
func (p *pubFit) load(f *fit) bool {
	s := p.seq.Load()
	if s&1 != 0 {
		return false
	}
	for i := range f.theta {
		f.theta[i] = load(&p.theta[i])
	}
	for i := range f.step {
		f.step[i] = load(&p.step[i])
	}
	for i := range f.kv {
		f.kv[i] = load(&p.kv[i])
	}
	return p.seq.Load() == s
}

// view is what one prediction reads of a fit: the coefficients, the decode step at an
// empty cache at the batch sizes it prices, and the KV multipliers.
type view struct {
	theta [numFeat]float64
	step  [3]float64
	kv    [numKV]float64
}

// bucket is a batch size's place in the decode table (bucketOf).
type bucket struct {
	lo, hi int
	w      float64
}

// loadView reads into v the part of p a prediction at the batch sizes of bs needs and
// reports whether no writer published meanwhile.
func (p *pubFit) loadView(bs *[3]bucket, v *view) bool {
	s := p.seq.Load()
	if s&1 != 0 {
		return false
	}
	for i := range v.theta {
		v.theta[i] = load(&p.theta[i])
	}
	for j, b := range bs {
		t := load(&p.step[b.lo])
		if b.hi != b.lo {
			t += b.w * (load(&p.step[b.hi]) - t)
		}
		v.step[j] = t
	}
	for i := range v.kv {
		v.kv[i] = load(&p.kv[i])
	}
	return p.seq.Load() == s
}

// fit copies the published fit into f.
func (m *Model) fit(f *fit) {
	for range readTries {
		if m.pub.load(f) {
			return
		}
	}
	m.mu.Lock()
	m.pub.load(f) // no writer publishes while m.mu is held
	m.mu.Unlock()
}

// view reads the published fit's part a prediction at the batch sizes of bs needs into v.
func (m *Model) view(bs *[3]bucket, v *view) {
	for range readTries {
		if m.pub.loadView(bs, v) {
			return
		}
	}
	m.mu.Lock()
	m.pub.loadView(bs, v)
	m.mu.Unlock()
}

// kvMul is the view's decode step multiplier at KV usage kv (as fit.decodeStep has it).
func (v *view) kvMul(kv float64) float64 {
	k, x := kvKnots(kv)
	return v.kv[k] + x*(v.kv[k+1]-v.kv[k])
}

// Priors, in seconds.
const (
	priorITL = 0.015
	// priorOutput is the output tokens assumed per request for the slot occupancy until a
	// request on the worker has finished.
	priorOutput = 128
)

// Init resets the model to its prior: prefill takes the curve's time, a decode step priorITL
// at every batch size.
func (m *Model) Init() {
	m.mu.Lock()
	defer m.mu.Unlock()
	// The fit is on relative error (observations are divided by their prediction), so the
	// prior variances are over a relative noise variance of about 0.1²: the prefill
	// multiplier is known to a factor of ten or so, the slot wait's to a factor of three.
	// The loaded prefill's is as loose as the prefill's: an engine that slows every step as
	// its batch fills (llm-d's simulator: ×2 at a full batch) needs it about 4/3 of the
	// prefill multiplier, and a tight prior at 0 made the collinear per-step and decode
	// terms take that growth instead, over-predicting a lightly loaded worker by a third.
	m.ttft = RLS{Lambda: 0.995, OutlierK: 4, Lo: Vec{0, 0.01, 0, 0.001, 0, 0, 0, 0}, Hi: Vec{100, 100, 100, 100, 100, 10, 100, 100}}
	m.ttft.Init(numFeat, Vec{1, 1, 1, 1, 0, 1, 0, 0}, Vec{10, 10, 10, 100, 100, 1, 10, 10})
	m.dec = decodeTable{}
	m.cur.initDecode()
	m.publishLocked()
	m.seqs.Store(0)
	m.seqsLow.Store(0)
}

// publishLocked publishes the current coefficients with the decode table in m.cur, as one
// fit. The caller holds m.mu.
func (m *Model) publishLocked() {
	copy(m.cur.theta[:], m.ttft.Theta[:numFeat])
	m.pub.store(&m.cur)
	m.ttftN.Store(int64(m.ttft.Count()))
	m.itlN.Store(int64(m.dec.count))
}

func load(a *atomic.Uint64) float64 { return math.Float64frombits(a.Load()) }

// ITL predicts the time between tokens at batch size b and KV usage kv.
func (m *Model) ITL(b int, kv float64) float64 {
	var f fit
	m.fit(&f)
	return f.decodeStep(b, kv)
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

func (m *Model) observeTTFT(x *Vec, ttft float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	xs, ys := relative(&m.ttft, x, ttft)
	m.ttft.Update(&xs, ys)
	m.publishLocked()
}

func (m *Model) observeITL(batch int, kv, itl float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.dec.observe(&m.cur, batch, kv, itl)
	m.dec.publish(&m.cur)
	m.publishLocked()
}

// Worker is one worker's part of the latency model: its speed against the Model it shares
// with the workers of its model (learned slowly from what its requests took), how long a
// request holds a sequence slot there, and its concurrency limit when reports teach it.
// Predict reads only atomics and is safe from every event loop at once; the Observe methods
// serialise on a mutex. Call Init before use.
type Worker struct {
	m *Model // set by Init, never changed

	mu       sync.Mutex
	logSpeed float64 // log of the worker's prefill time against its model's prediction
	occ      float64
	nOcc     int

	// res are the worker's recent prediction errors, queued and fresh (guarded by mu), and
	// sigma their published relative errors, float64 bits.
	res   [2]residuals
	sigma [2]atomic.Uint64

	speed atomic.Uint64 // exp(logSpeed), float64 bits
	// logDecode is the log of the worker's time between tokens against its model's
	// (decayed mean, guarded by mu), decodeSpeed its exp, float64 bits.
	logDecode   float64
	decodeSpeed atomic.Uint64
	occBit      atomic.Uint64
	// seqs is MaxNumSeqs learned from reports and waits (observeRunning), 0 unknown; seqsLow
	// the most requests the worker was seen to run (a lower bound while seqs is unknown).
	seqs    atomic.Int64
	seqsLow atomic.Int64
	obs     atomic.Int64
	// lastObs is when the worker last taught its model a first token (the router's clock,
	// 0: never).
	lastObs atomic.Int64
	// limitMu serialises learning the limit; confirms counts the waits seen at seqsLow.
	limitMu  sync.Mutex
	confirms int
}

// Kinds of prediction whose errors a worker keeps apart: mostly queue (a slot wait or a
// backlog ahead), or mostly the request's own prefill.
const (
	resQueued = iota
	resFresh
)

// residuals is a decayed record of a worker's prediction errors of one kind: the mean of
// log(observed/predicted) and of its square over about 1/(1−residualDecay) observations.
type residuals struct {
	n, mean, sq float64
}

// Residual priors: the relative error a prediction of each kind is taken to have until the
// worker's own record says otherwise, and how many observations the prior weighs as. A slot
// wait depends on when running requests end, which the router sees only in part; a prefill
// on an engine's free slot is nearly deterministic.
const (
	residualDecay  = 0.98
	priorResidualN = 8
	priorSigmaQ    = 0.5
	priorSigmaF    = 0.25
	// maxSigma bounds the relative error a record may claim.
	maxSigma = 2.0
)

// add records the log error l and returns the record's relative error pooled with prior.
func (r *residuals) add(l, prior float64) float64 {
	r.n = residualDecay*r.n + 1
	a := 1 / r.n
	r.mean += a * (l - r.mean)
	r.sq += a * (l*l - r.sq)
	return r.sigma(prior)
}

// sigma is the record's root mean square error pooled with the prior's.
func (r *residuals) sigma(prior float64) float64 {
	v := (priorResidualN*prior*prior + r.n*r.sq) / (priorResidualN + r.n)
	return min(math.Sqrt(max(v, 0)), maxSigma)
}

// Init ties the worker to the model of its workers and resets its own state.
func (w *Worker) Init(m *Model) {
	w.m = m
	w.mu.Lock()
	w.logSpeed, w.logDecode, w.occ, w.nOcc = 0, 0, priorITL*priorOutput, 0
	w.res = [2]residuals{}
	w.mu.Unlock()
	w.speed.Store(math.Float64bits(1))
	w.decodeSpeed.Store(math.Float64bits(1))
	w.occBit.Store(math.Float64bits(w.occ))
	w.sigma[resQueued].Store(math.Float64bits(priorSigmaQ))
	w.sigma[resFresh].Store(math.Float64bits(priorSigmaF))
	w.seqs.Store(0)
	w.seqsLow.Store(0)
	w.obs.Store(0)
	w.lastObs.Store(0)
	w.limitMu.Lock()
	w.confirms = 0
	w.limitMu.Unlock()
}

// DecodeStep is the worker's predicted time between tokens at batch size b and KV usage kv:
// its model's, times how much slower or faster the worker's own requests decoded.
func (w *Worker) DecodeStep(b int, kv float64) float64 {
	return w.m.ITL(b, kv) * load(&w.decodeSpeed)
}

// Model returns the shared model.
func (w *Worker) Model() *Model { return w.m }

// Retie ties the worker to m in place of its model, keeping what it learned of itself. Only
// for a worker no other goroutine uses yet (one joining a pool).
func (w *Worker) Retie(m *Model) { w.m = m }

// Occupancy is how long a request holds its slot on the worker once its first token has
// come, seconds (learned from its requests; the prior's until then).
func (w *Worker) Occupancy() float64 { return load(&w.occBit) }

// MaxSlotSim bounds the slots SlotWait follows one by one (and the ages it needs); a
// larger engine takes the mean-residual estimate.
const MaxSlotSim = 64

// SlotWait is the wait for a sequence slot of a request arriving at a worker running seqs
// requests with queued more waiting ahead of it: the slots free as their requests end —
// those past their first token after the seconds left to each (left), the others
// (prefilling) after the whole occupancy occ, or half of it for ones nobody here knows
// (unknown of them) — and each freed slot goes to the next request in line, which holds it
// the occupancy. ok is false when seqs is beyond what it follows.
func SlotWait(seqs, queued int, left []float64, prefilling, unknown int, occ float64) (wait float64, ok bool) {
	if seqs <= 0 || seqs > MaxSlotSim || queued < 0 {
		return 0, false
	}
	var free [MaxSlotSim]float64 // a slot nobody holds is free now
	n := 0
	for _, l := range left {
		if n == seqs {
			break
		}
		free[n] = max(l, 0)
		n++
	}
	for ; n < seqs && prefilling > 0; prefilling-- {
		free[n] = occ
		n++
	}
	for ; n < seqs && unknown > 0; unknown-- {
		free[n] = occ / 2
		n++
	}
	slots := free[:seqs]
	for range queued {
		i := argmin(slots)
		slots[i] += occ
	}
	return slots[argmin(slots)], true
}

func argmin(s []float64) int {
	best := 0
	for i, v := range s {
		if v < s[best] {
			best = i
		}
	}
	return best
}

// MaxNumSeqs is the concurrency limit: e's when known, else what reports taught
// (ObserveReport), else the limit learned of another worker of its model, unless this one
// was seen to run more; 0 while unknown. The workers of one model in one role are deployed
// alike, so one that has not been saturated yet is taken to have its peers' limit, rather
// than none (which would make it look free, and fill it past its slots).
func (w *Worker) MaxNumSeqs(e *Engine) int {
	if e.MaxNumSeqs > 0 {
		return e.MaxNumSeqs
	}
	if n := w.seqs.Load(); n > 0 {
		return int(n)
	}
	if n := w.m.seqs.Load(); n > 0 && n >= w.seqsLow.Load() {
		return int(n)
	}
	return 0
}

// LastObserved is when the worker last taught its model a first token, on the clock its
// observations were stamped with (ObserveTTFTAt); 0 when it never has.
func (w *Worker) LastObserved() int64 { return w.lastObs.Load() }

// SeqsLow is the most requests the worker was seen to run: a lower bound of its concurrency
// limit.
func (w *Worker) SeqsLow() int { return int(w.seqsLow.Load()) }

// Predict fills p for a request with uncached prompt tokens on the worker in state st.
func (w *Worker) Predict(e *Engine, st State, uncached float64, p *Prediction) {
	m := w.m
	curve := e.Curve
	if curve == (Curve{}) {
		curve = DefaultCurve()
	}
	budget := float64(e.MaxBatchedTokens)
	if budget <= 0 {
		budget = DefaultBatchedTokens
	}
	seqs := w.MaxNumSeqs(e)
	batch := st.Requests
	if seqs > 0 {
		batch = min(batch, seqs)
	}
	// One fit for the whole prediction: the decode step at this batch, with this request
	// and alone.
	var bs [3]bucket
	for j, b := range [3]int{batch, batch + 1, 1} {
		bs[j].lo, bs[j].hi, bs[j].w = bucketOf(float64(b))
	}
	var f view
	m.view(&bs, &f)
	kvMul := f.kvMul(st.KVUsage)
	decode := 0.0
	if batch > 0 {
		decode = f.step[0] * kvMul
	}
	speed := load(&w.speed)
	u := max(uncached, 0)
	step := curve.C / 1000
	queue := speed * chunked(st.Backlog, budget, curve)
	own := speed*chunked(st.Backlog+u, budget, curve) - queue
	if st.Backlog <= 0 && u > 0 {
		// The first step's constant is FeatBias's.
		own = max(own-speed*step, 0)
	}
	own = max(own, st.Onboard)
	// The tokens' part of the own prefill, without the steps' constants: what Compute is.
	tokens := speed * (chunkedTokens(st.Backlog+u, budget, curve) - chunkedTokens(st.Backlog, budget, curve))
	attn := speed * curve.B / 1000 * u * (max(st.Cached, 0) + u/2) / attentionContext
	dq := decode * steps(st.Backlog, budget)
	do := decode*steps(st.Backlog+u, budget) - dq
	slot, busy := 0.0, 0.0
	if seqs > 0 {
		switch {
		case st.Requests >= seqs && st.HasSlotWait:
			slot = max(st.SlotWait, 0)
		case st.Requests >= seqs:
			slot = float64(st.Requests-seqs+1) * load(&w.occBit) / float64(seqs+1)
		}
		busy = float64(min(st.Requests, seqs)) / float64(seqs)
	}
	p.X = Vec{step, slot, queue, own, own * busy, dq + do, step * busy, attn}
	th := &f.theta
	p.Wait = th[1] * slot
	p.Queue = p.Wait + th[2]*queue + th[5]*dq
	p.Prefill = (th[0]+th[6]*busy)*step + (th[3]+th[4]*busy)*own + th[5]*do + th[7]*attn
	p.TTFT = p.Queue + p.Prefill
	p.Compute = (th[3]+th[4]*busy)*tokens + th[7]*attn
	p.ITL = f.step[1] * kvMul
	p.Slowdown = 0
	if st.OSL > 0 && (seqs <= 0 || st.Requests < seqs) {
		// Only a request that joins the running batch slows it; one that waits for a slot
		// pays the slot wait instead. Its own tokens at this batch's step rather than a lone
		// request's (the step's level: on a concave curve far more than its slope times the
		// batch), and the running requests' remaining tokens, half an OSL each, one request
		// slower.
		own := st.OSL * max(p.ITL-f.step[2]*kvMul, 0)
		others := float64(batch) * 0.5 * st.OSL * max(p.ITL-decode, 0) // decode: ITL(batch), 0 for none
		p.Slowdown = own + others
	}
	if st.OSL > 0 {
		// The requests running while it prefills each wait out its compute, joined or
		// queued for a slot alike (a long prompt on a worker full of decodes stalls every
		// one of their streams).
		p.Slowdown += float64(batch) * p.Compute
	}
	p.Ahead = st.Requests
	// How busy the worker is: its compute delays others in that share; a worker with free
	// slots and nothing queued delays nobody now.
	n := float64(st.Requests)
	switch {
	case seqs > 0:
		p.Busy = min(n/float64(seqs), 1)
	default:
		p.Busy = n / (n + 1)
	}
	p.Scarcity = 0
	if seqs > 0 {
		free := max(seqs-st.Requests-1, 0)
		p.Scarcity = 1 / float64((free+1)*seqs)
	}
	p.KV = st.KVUsage
	osl := st.OSL
	if osl <= 0 {
		osl = priorOutput
	}
	p.Hold = p.TTFT + osl*p.ITL
	// Uncertainty: the queue's part and the prefill's each at the relative error the
	// worker's predictions of that kind have shown. Past its known limit's certainty (a
	// limit only guessed from what it ran), a slot wait may come that nobody predicted.
	sq, sf := load(&w.sigma[resQueued]), load(&w.sigma[resFresh])
	p.Spread = p.Queue*sq + p.Prefill*sf
	if low := max(w.SeqsLow(), int(m.seqsLow.Load())); seqs <= 0 && low > 0 && st.Requests >= low {
		// Past the most it or a peer (deployed alike) was seen to run, and its limit
		// unknown: a slot wait may come that nobody predicted, as long as the first of its
		// running requests takes to end. A worker little used so far is not taken for one
		// of fewer slots than its peers showed.
		p.Spread += 0.5 * load(&w.occBit) / float64(low+1)
	}
}

// steps is the prefill steps t tokens take at budget tokens a step.
func steps(t, budget float64) float64 {
	if t <= 0 {
		return 0
	}
	return math.Ceil(t / budget)
}

// chunkedTokens is chunked without the steps' constants: the part of computing t prefill
// tokens that grows with the tokens.
func chunkedTokens(t, budget float64, c Curve) float64 {
	if t <= 0 {
		return 0
	}
	full := math.Floor(t / budget)
	rem := t - full*budget
	return full*c.TokenSeconds(budget) + c.TokenSeconds(rem)
}

// chunked is the prior's time to compute t prefill tokens in steps of at most budget tokens.
func chunked(t, budget float64, c Curve) float64 {
	if t <= 0 {
		return 0
	}
	full := math.Floor(t / budget)
	rem := t - full*budget
	return full*c.StepSeconds(budget) + c.StepSeconds(rem)
}

// Learning rate of a worker's speed (the share of one observation's log error it moves by)
// and the most one observation may say of it (a factor of two either way, so that an
// outlier moves it by 2% at most).
const (
	speedRate  = 0.03
	speedClamp = 0.6931471805599453 // ln 2
	// maxSpeed bounds a worker's learned speed against its model (either way).
	maxLogSpeed = 1.0986122886681098 // ln 3
)

// ObserveTTFT learns from a request predicted as p whose first token came ttft seconds after
// it was sent: the shared model's coefficients, where the prediction was mostly prefill the
// worker's speed, and the worker's record of its prediction errors.
func (w *Worker) ObserveTTFT(p *Prediction, ttft float64) { w.ObserveTTFTAt(0, p, ttft) }

// ObserveTTFTAt is ObserveTTFT at now, the caller's clock in nanoseconds (LastObserved).
func (w *Worker) ObserveTTFTAt(now int64, p *Prediction, ttft float64) {
	if math.IsNaN(ttft) || math.IsInf(ttft, 0) || ttft <= 0 {
		return
	}
	if now != 0 {
		w.lastObs.Store(now)
	}
	x := &p.X
	m := w.m
	w.obs.Add(1)
	var f fit
	m.fit(&f)
	th := &f.theta
	var pred float64
	for i := range numFeat {
		pred += th[i] * x[i]
	}
	if p.TTFT > minScale {
		kind, prior := resFresh, priorSigmaF
		if p.Queue > p.Prefill {
			kind, prior = resQueued, priorSigmaQ
		}
		l := min(max(math.Log(ttft/p.TTFT), -3), 3)
		w.mu.Lock()
		sigma := w.res[kind].add(l, prior)
		w.mu.Unlock()
		w.sigma[kind].Store(math.Float64bits(sigma))
	}
	// The speed scales the compute features only, not the decode steps beside them.
	prefill := th[FeatQueue]*x[FeatQueue] + th[FeatPrefill]*x[FeatPrefill] + th[FeatLoadedPrefill]*x[FeatLoadedPrefill] +
		th[FeatAttention]*x[FeatAttention]
	if prefill > 0.5*pred && prefill > minScale {
		// The prefill's share of what was observed, as far as the other terms predicted
		// theirs, against its prediction (which the current speed already scaled).
		if rest := ttft - (pred - prefill); rest > 0 {
			r := min(max(math.Log(rest/prefill), -speedClamp), speedClamp)
			m.mu.Lock()
			m.resid = (1-speedRate)*m.resid + speedRate*r
			r -= m.resid
			m.mu.Unlock()
			w.mu.Lock()
			w.logSpeed = min(max(w.logSpeed+speedRate*r, -maxLogSpeed), maxLogSpeed)
			w.speed.Store(math.Float64bits(math.Exp(w.logSpeed)))
			w.mu.Unlock()
		}
	}
	m.observeTTFT(x, ttft)
}

// ObserveDecode learns from a finished request: its mean time between tokens at the batch
// size and KV usage it ran at, and how long it held its slot (first token to last).
func (w *Worker) ObserveDecode(batch int, kv, itl, held float64) {
	if batch < 1 || itl <= 0 || math.IsNaN(itl) || math.IsInf(itl, 0) || math.IsNaN(kv) {
		return
	}
	kv = min(max(kv, 0), 1)
	// The worker's own decode speed is against its model's step before the model learns
	// from this request.
	want := w.m.ITL(batch, kv)
	w.m.observeITL(batch, kv, itl)
	w.mu.Lock()
	defer w.mu.Unlock()
	if want > 0 {
		w.logDecode = min(max(0.9*w.logDecode+0.1*math.Log(itl/want), -maxLogSpeed), maxLogSpeed)
		w.decodeSpeed.Store(math.Float64bits(math.Exp(w.logDecode)))
	}
	if held > 0 && !math.IsInf(held, 0) {
		if w.nOcc == 0 {
			w.occ = held
		} else {
			w.occ = 0.9*w.occ + 0.1*held
		}
		w.nOcc++
		w.occBit.Store(math.Float64bits(w.occ))
	}
}

// ObserveReport learns the concurrency limit from an engine's report of its running and
// waiting requests. The most requests it was seen to run is a lower
// bound of its limit; requests waiting while it runs exactly that many confirm it as the
// limit once seen confirmLimit times. A wait beside fewer running is the step's token
// budget or a full cache holding requests back, not the slots, and says nothing of where
// they end (a cache that holds requests back at one count again and again acts as a limit
// there, and is learned as one); more running than a learned limit unlearns it.
func (w *Worker) ObserveReport(running, waiting int) {
	if running <= 0 {
		return
	}
	w.observeRunning(int64(running), waiting > 0)
}

// observeRunning learns from a report that the worker ran n requests, full saying another
// was held back for want of a slot.
func (w *Worker) observeRunning(n int64, full bool) {
	w.limitMu.Lock()
	defer w.limitMu.Unlock()
	switch low := w.seqsLow.Load(); {
	case n > low:
		w.seqsLow.Store(n)
		for ml := w.m.seqsLow.Load(); n > ml && !w.m.seqsLow.CompareAndSwap(ml, n); ml = w.m.seqsLow.Load() {
		}
		w.confirms = 0
		if s := w.seqs.Load(); s > 0 && n > s {
			w.seqs.Store(0) // it runs more than we took for its limit
		}
		if s := w.m.seqs.Load(); s > 0 && n > s {
			// And more than its model's: the limit its peers stand in with was no limit
			// either (a step budget that held long prompts back, taken for one).
			w.m.seqs.CompareAndSwap(s, 0)
		}
		if full {
			w.confirms = 1
		}
	case n == low && full:
		w.confirms++
	}
	if w.confirms >= confirmLimit && w.seqs.Load() <= 0 {
		w.seqs.Store(w.seqsLow.Load())
		w.m.seqs.Store(w.seqsLow.Load())
	}
}

// confirmLimit is how often requests must be seen waiting at the most a worker runs for
// that to be its limit.
const confirmLimit = 3

// Stats is a snapshot of a worker's model for operators.
type Stats struct {
	// Theta are the shared TTFT coefficients, multiples of their features (indexed by the
	// Feat constants); Decode the shared decode step at the batch sizes requests taught
	// (with an empty cache), DecodeKV its multipliers with the cache half full and full.
	Theta    Vec
	Decode   []DecodePoint
	DecodeKV [numKV - 1]float64
	// Speed is the worker's prefill time against its model's (1: as the model says),
	// DecodeSpeed its time between tokens against its model's, Occupancy how long a
	// request holds its slot there, seconds.
	Speed, DecodeSpeed, Occupancy float64
	// Observations counts the TTFTs this worker taught; ModelObservations and Decodes
	// those its model learned from across its workers.
	Observations, ModelObservations, Decodes int64
	// MaxNumSeqs is the concurrency limit learned (0: unknown), SeqsLow the most requests
	// seen running with none waiting.
	MaxNumSeqs, SeqsLow int64
	// SigmaQueued and SigmaFresh are the relative errors of the worker's recent predictions
	// that were mostly queue and mostly its own prefill.
	SigmaQueued, SigmaFresh float64
}

// Stats returns the worker's current model.
func (w *Worker) Stats() Stats {
	m := w.m
	var s Stats
	m.mu.Lock()
	f := m.cur
	for i, n := range m.dec.n {
		if n > 0 {
			s.Decode = append(s.Decode, DecodePoint{Batch: int(decodeSizes[i]), Seconds: f.step[i], Observations: n})
		}
	}
	m.mu.Unlock()
	copy(s.Theta[:], f.theta[:])
	copy(s.DecodeKV[:], f.kv[1:])
	s.Speed, s.DecodeSpeed, s.Occupancy = load(&w.speed), load(&w.decodeSpeed), load(&w.occBit)
	s.Observations, s.ModelObservations, s.Decodes = w.obs.Load(), m.ttftN.Load(), m.itlN.Load()
	s.MaxNumSeqs = w.seqs.Load()
	s.SeqsLow = w.seqsLow.Load()
	s.SigmaQueued, s.SigmaFresh = load(&w.sigma[resQueued]), load(&w.sigma[resFresh])
	return s
}
