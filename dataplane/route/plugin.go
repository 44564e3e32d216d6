package route

import (
	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// Filter removes the workers that must not serve a request. It appends the workers of in
// that pass to out (a caller-owned slice, reset by the caller) and returns it. Filters run on
// event loops: no allocation, no blocking.
type Filter interface {
	Name() string
	Filter(req *Request, in, out []*Worker) []*Worker
}

// Scorer adds each worker's cost for req, times the scorer's weight, to costs[i] for
// ws[i]. Lower costs win. costs is caller-owned and as long as ws.
type Scorer interface {
	Name() string
	Score(req *Request, ws []*Worker, costs []float64)
}

// Picker chooses one of ws given their costs and returns its position in ws. ws is never
// empty.
type Picker interface {
	Name() string
	Pick(req *Request, ws []*Worker, costs []float64) int
}

// Request is what the router knows of one request, plus scratch space the router reuses. It
// belongs to one connection and is reused for each of its requests; it is not safe for
// concurrent use.
type Request struct {
	// Model is the requested model.
	Model string
	// Hashes is the chain of the prompt's full blocks (package engines/blockhash).
	Hashes []uint64
	// PromptTokens is the prompt's length in tokens.
	PromptTokens int
	// Priority orders admission; higher is more urgent.
	Priority int
	// OSL is the expected output length in tokens, 0 when unknown.
	OSL int
	// SessionID asks for the worker that served the session before. It may alias a buffer
	// the caller reuses once Route returns; the router copies what it keeps.
	SessionID string
	// Pin names the worker (by ID) that must serve the request, if it is eligible (healthy,
	// not excluded, past the policy's filters), whatever its load: it holds state the request
	// refers to (a stored response, under previous_response_id). Route sets Pinned when it
	// honoured it.
	Pin    string
	Pinned bool
	// PinOnly makes Route fail with ErrNoWorker rather than route a pinned request elsewhere.
	PinOnly bool
	// Exclude lists workers (by Index) the request must not go to: those already tried for
	// it, and those outside a gateway's endpoint subset. The router drops them before any
	// policy's filters, whatever the policy.
	Exclude []int
	// Role is the pool the request is routed in: RoleBoth (workers serving whole requests,
	// the zero value), or RolePrefill / RoleDecode for one leg of a disaggregated request.
	Role Role
	// Now is the caller's current time in unix nanoseconds from Now (0: the router reads the
	// clock). Event loops read the clock once per event and set it before each Route, so a
	// request routed again later (a retry, a release from the admission queue) is routed at
	// that later event's time.
	Now int64
	// Timed asks Route to time its match and score stages into the Decision.
	Timed bool
	// SLOTTFT and SLOTPOT are the request's latency targets in seconds (x-slo-ttft-ms,
	// x-slo-tpot-ms), 0 when it has none. Under the latency policy a request with a target
	// goes to the worker predicted to meet it with the most headroom, and gets ErrSLO when
	// none is.
	SLOTTFT, SLOTPOT float64
	// DryRun routes without leaving a trace in the router (no session bound): a shadow
	// decision that serves nothing.
	DryRun bool
	// Headroom is the slots of each worker this request may not take (busy filter's
	// MaxRequests): a tenant past its share keeps them free for the others.
	Headroom int64

	// Filled by Match: overlap[w] is the blocks of Hashes worker w caches.
	overlap []float64
	// lower is what each worker's matched run holds below GPU memory, when the policy
	// predicts latency and the index can tell (prefix.TierIndex); nil otherwise.
	lower []blockset.Lower
	// fetch is, per candidate of the last latency scoring, the peer it would pull the
	// prompt's prefix from (nil: it computes it).
	fetch []*Worker
	// recompute is, per candidate of the last latency scoring, whether it is predicted to
	// answer sooner computing what it caches below GPU memory than loading it back.
	recompute []bool
	// holders are the workers a peer fetch may pull from: the candidates and those the busy
	// filter took out (their blocks can still be read); nil: the candidates alone.
	holders []*Worker
	// held counts what each worker holds in GPU memory, when the router's index can tell
	// (prefix.HeldIndex): the room a peer fetch has without evicting.
	held prefix.HeldIndex
	best float64
	// creditsCache, set by a latency scoring that counts cached blocks (CacheCredit above
	// 0), lets LatencyPick break near-ties by the cache; a cache-blind policy leaves ties
	// to load alone.
	creditsCache bool
	// flat, set by the router when no worker caches CacheThreshold of the prompt more than
	// another, has PredictedTTFT count flatOverlap (the least any candidate caches) for every
	// worker: what separates them then is load, not cache.
	flat        bool
	flatOverlap float64

	// eligible and scratch are the router's two candidate buffers: the router copies the
	// pool's admissible workers into one, and each filter reads one and writes the other.
	// Neither is ever the pool's own slice, which the router never hands to a plugin.
	eligible []*Worker
	scratch  []*Worker
	costs    []float64
	// preds[i] is the latency prediction for candidates[i], filled by PredictedTTFT.
	preds      []latency.Prediction
	candidates []*Worker
}

// CopyInputs makes dst the same request as r for another router: every input field (the
// slices shared, read-only to the router) and none of r's scratch, which stays r's. A
// shadow decision routes dst without disturbing what r's decision left for its caller.
func (r *Request) CopyInputs(dst *Request) {
	keep := Request{overlap: dst.overlap, eligible: dst.eligible, scratch: dst.scratch, costs: dst.costs, preds: dst.preds}
	*dst = Request{
		Model: r.Model, Hashes: r.Hashes, PromptTokens: r.PromptTokens, Priority: r.Priority, OSL: r.OSL,
		SessionID: r.SessionID, Pin: r.Pin, PinOnly: r.PinOnly, Exclude: r.Exclude, Role: r.Role, Now: r.Now,
		SLOTTFT: r.SLOTTFT, SLOTPOT: r.SLOTPOT, Headroom: r.Headroom,
		overlap: keep.overlap, eligible: keep.eligible, scratch: keep.scratch, costs: keep.costs, preds: keep.preds,
	}
}

// Reset prepares r for a new request, keeping its scratch space.
func (r *Request) Reset() {
	*r = Request{
		Hashes:    r.Hashes[:0],
		Exclude:   r.Exclude[:0],
		overlap:   r.overlap[:0],
		lower:     r.lower[:0],
		fetch:     r.fetch[:0],
		recompute: r.recompute[:0],
		holders:   r.holders[:0],
		eligible:  r.eligible[:0],
		scratch:   r.scratch[:0],
		costs:     r.costs[:0],
		preds:     r.preds[:0],
	}
}

// Candidates returns the workers the last Route scored with latency predictions and those
// predictions (empty under a policy that predicts nothing). Both slices belong to r and are
// valid until its next Route or Reset.
func (r *Request) Candidates() ([]*Worker, []latency.Prediction) {
	if len(r.preds) == 0 {
		return nil, nil
	}
	return r.candidates, r.preds
}

// Costs returns the cost each candidate of the last scoring had (Candidates' order), lower
// being better, in the policy's units; nil before any scoring. The slice belongs to the
// request and changes at its next Route.
func (r *Request) Costs() []float64 {
	if len(r.preds) == 0 || len(r.costs) < len(r.preds) {
		return nil
	}
	return r.costs[:len(r.preds)]
}

// clock is the router's Clock at the request: at Now when the caller gave it.
func (r *Request) clock() int64 {
	if r == nil {
		return Clock()
	}
	return ClockAt(r.Now)
}

// Overlap is the number of prompt blocks worker w caches, as the last match found.
func (r *Request) Overlap(w *Worker) float64 {
	if r == nil || w == nil || w.Index >= len(r.overlap) {
		return 0
	}
	return r.overlap[w.Index]
}

// Lower is what worker w's matched run holds below GPU memory, ok false when the match did
// not tell.
func (r *Request) Lower(w *Worker) (l blockset.Lower, ok bool) {
	if w == nil || r.lower == nil || w.Index >= len(r.lower) {
		return blockset.Lower{}, false
	}
	return r.lower[w.Index], true
}

// BestOverlap is the largest overlap any worker had.
func (r *Request) BestOverlap() float64 { return r.best }

// PromptBlocks is the number of blocks the prompt spans, the last one possibly partial.
func (r *Request) PromptBlocks(blockSize int) int {
	bs := max(blockSize, 1)
	return (r.PromptTokens + bs - 1) / bs
}

func growFloat(s []float64, n int) []float64 {
	if cap(s) < n {
		return make([]float64, n)
	}
	s = s[:n]
	clear(s)
	return s
}
