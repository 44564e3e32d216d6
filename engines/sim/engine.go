package sim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// CacheEventKind names a change to the prefix cache.
type CacheEventKind uint8

// The changes an engine reports, mirroring vLLM's BlockStored, BlockRemoved and
// AllBlocksCleared events.
const (
	BlocksStored CacheEventKind = iota + 1
	BlocksRemoved
	AllBlocksCleared
)

// CacheEvent is one change to a worker's prefix cache, in kvrelay's own block hashes (the
// sequence hashes of package blockhash). The adapter that publishes them turns these into the
// engine's opaque hashes.
type CacheEvent struct {
	Kind CacheEventKind
	// Hashes are the blocks stored (a chain, in order) or removed.
	Hashes []uint64
	// Parent is the hash of the block before the first stored one, when there is one.
	Parent    uint64
	HasParent bool
	// Tokens are the tokens of the stored blocks, len(Hashes)·block size of them.
	Tokens []uint32
	// Keys are the stored blocks' extra keys (nil: none), First the index in their request
	// of the first stored block (the cache salt keys block 0 only).
	Keys  *blockhash.Keys
	First int
}

// EventSink receives the cache changes of every engine step, in the order they happened. It is
// called from the engine's scheduler goroutine, so it must not block for long; events and the
// slices they reference are reused after the call returns.
type EventSink interface {
	CacheEvents(at time.Time, events []CacheEvent)
}

// Engine is one simulated worker: a paged KV cache with prefix caching and a continuous-
// batching scheduler whose steps take the modelled time. One goroutine, the one that calls
// Run, owns all scheduling state; Submit, Abort and ResetPrefixCache hand work to it and are
// safe to call from any goroutine.
type Engine struct {
	cfg     Config
	sink    EventSink
	metrics *Metrics
	filler  []uint32

	mu       sync.Mutex // guards inbox, aborts, resets, releases and pulls
	inbox    []*Request
	aborts   []*Request
	resets   []chan bool
	releases []string   // request ids whose held blocks a decoder has read
	pulls    []*pullJob // finished pulls
	wake     chan struct{}
	nextSeq  uint64

	// kv is the KV connector of a prefill or decode worker, nil in role both.
	kv *kvConnector

	// Owned by the Run goroutine.
	planAt  time.Time // when the step being planned starts
	pool    *blockPool
	waiting waitQueue
	running []*Request
	sched   []scheduled
	events  []CacheEvent
	hasher  blockhash.Hasher
	ends    []pendingEnd
	held    map[string]*Request // finished requests keeping their blocks for a remote decode
	holdQ   []heldEntry         // the same, in order of expiry (the timeout is fixed)
	loading map[*Request]bool   // requests waiting for a pull
	ready   []*Request          // requests whose pull finished, waiting to be scheduled

	numRunning, numWaiting atomic.Int64
	usageBits              atomic.Uint64
	heldRequests           atomic.Int64
	heldBlocks             atomic.Int64
	// stalls and stalledNS count the times a busy engine fell more than maxLag behind its
	// modelled clock, and the time it lost (see Stalled).
	stalls, stalledNS atomic.Int64
}

type heldEntry struct {
	r      *Request
	expiry time.Time
}

type scheduled struct {
	r       *Request
	n       int
	prefill bool
}

// ErrInvalidRequest wraps every reason NewRequest refuses a prompt; the message is meant for
// the client.
var ErrInvalidRequest = errors.New("invalid request")

// NewEngine builds an engine from a validated-able config. filler are the token ids output is
// made of, cycled deterministically; sink and metrics may be nil.
func NewEngine(cfg Config, filler []uint32, sink EventSink, metrics *Metrics) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(filler) == 0 {
		return nil, fmt.Errorf("%w: no filler tokens to generate output from", ErrInvalidConfig)
	}
	e := &Engine{
		cfg:     cfg,
		sink:    sink,
		metrics: metrics,
		filler:  filler,
		wake:    make(chan struct{}, 1),
		pool:    newBlockPool(cfg.NumGPUBlocks, cfg.BlockSize, cfg.EnablePrefixCaching),
		waiting: waitQueue{byPriority: cfg.SchedulingPolicy == Priority},
		held:    make(map[string]*Request),
		loading: make(map[*Request]bool),
	}
	return e, nil
}

// HeldKV returns how many finished requests keep their blocks for a remote decode, and how
// many blocks that is. It is safe to call from any goroutine.
func (e *Engine) HeldKV() (requests, blocks int) {
	return int(e.heldRequests.Load()), int(e.heldBlocks.Load())
}

// releaseHeld frees the blocks held for the named requests: their decoders have read them.
// It is safe to call from any goroutine.
func (e *Engine) releaseHeld(ids []string) {
	e.mu.Lock()
	e.releases = append(e.releases, ids...)
	e.mu.Unlock()
	e.poke()
}

// pullDone hands a finished pull back to the scheduler goroutine.
func (e *Engine) pullDone(j *pullJob) {
	e.mu.Lock()
	e.pulls = append(e.pulls, j)
	e.mu.Unlock()
	e.poke()
}

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

// NewRequest validates a prompt against the engine's limits and prepares a request for
// Submit. keys are its blocks' extra keys (adapter, cache salt), hashed into them and
// published with them as vLLM does. It may be called from any goroutine; the prompt slice
// is retained, keys are copied.
func (e *Engine) NewRequest(id string, prompt []uint32, keys blockhash.Keys, p Params) (*Request, error) {
	maxLen := e.cfg.MaxModelLen
	if len(prompt) == 0 {
		return nil, fmt.Errorf("%w: the prompt is empty", ErrInvalidRequest)
	}
	if p.MaxTokens < 0 || p.MinTokens < 0 {
		return nil, fmt.Errorf("%w: max_tokens and min_tokens must not be negative", ErrInvalidRequest)
	}
	maxTokens := p.MaxTokens
	if maxTokens == 0 {
		maxTokens = maxLen - len(prompt)
	}
	if len(prompt)+maxTokens > maxLen || maxTokens <= 0 {
		return nil, fmt.Errorf("%w: this model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion",
			ErrInvalidRequest, maxLen, len(prompt)+maxTokens, len(prompt), maxTokens)
	}
	if p.MinTokens > maxTokens {
		return nil, fmt.Errorf("%w: min_tokens (%d) must be less than or equal to max_tokens (%d)", ErrInvalidRequest, p.MinTokens, maxTokens)
	}
	bs := e.cfg.BlockSize
	if need := (len(prompt) + maxTokens + bs - 1) / bs; need > e.cfg.NumGPUBlocks {
		return nil, fmt.Errorf("%w: the request needs %d KV cache blocks but the engine has %d", ErrInvalidRequest, need, e.cfg.NumGPUBlocks)
	}
	r := &Request{
		ID:        id,
		Params:    p,
		tokens:    make([]uint32, len(prompt), len(prompt)+min(maxTokens, 4096)),
		promptLen: len(prompt),
		notify:    make(chan struct{}, 1),
		heapIndex: -1,
	}
	copy(r.tokens, prompt)
	r.keys = blockhash.Keys{LoRA: keys.LoRA, Salt: slices.Clone(keys.Salt)}
	for _, m := range keys.MM {
		r.keys.MM = append(r.keys.MM, slices.Clone(m))
	}
	var h blockhash.Hasher
	r.hashes = h.AppendSeqKeys(make([]uint64, 0, (len(prompt)+maxTokens)/bs+1), 0, false, prompt, bs, &r.keys, 0)
	r.maxTokens, r.maxOut = maxTokens, maxTokens
	if !p.IgnoreEOS {
		r.maxOut = min(maxTokens, max(p.MinTokens, naturalLength(r.hashes, prompt)))
	}
	return r, nil
}

// naturalLength is where a request that does not ignore EOS stops: deterministic in the
// prompt, between 16 and 512 tokens.
func naturalLength(hashes []uint64, prompt []uint32) int {
	var h uint64 = 0x9e3779b97f4a7c15
	if len(hashes) > 0 {
		h ^= hashes[len(hashes)-1]
	}
	for _, t := range prompt[len(prompt)-min(len(prompt), 64):] {
		h = (h ^ uint64(t)) * 0x100000001b3
	}
	return 16 + int(h%497)
}

// Submit queues r; the next step may schedule it. It is safe to call from any goroutine.
func (e *Engine) Submit(r *Request) {
	r.arrival = time.Now()
	e.mu.Lock()
	r.seqNo = e.nextSeq
	e.nextSeq++
	e.inbox = append(e.inbox, r)
	e.mu.Unlock()
	e.poke()
}

// Abort stops r and frees its blocks at the next opportunity of the scheduler goroutine,
// which is at once when it is between steps. It is safe to call from any goroutine and more
// than once.
func (e *Engine) Abort(r *Request) {
	e.mu.Lock()
	e.aborts = append(e.aborts, r)
	e.mu.Unlock()
	e.poke()
}

// ResetPrefixCache forgets every cached block, as vLLM's /reset_prefix_cache does, and reports
// whether it did: like vLLM it refuses while requests hold blocks. It waits for the scheduler
// goroutine, so Run must be running.
func (e *Engine) ResetPrefixCache(ctx context.Context) (bool, error) {
	reply := make(chan bool, 1)
	e.mu.Lock()
	e.resets = append(e.resets, reply)
	e.mu.Unlock()
	e.poke()
	select {
	case ok := <-reply:
		return ok, nil
	case <-ctx.Done():
		return false, fmt.Errorf("resetting prefix cache: %w", ctx.Err())
	}
}

func (e *Engine) poke() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Load is a snapshot of the engine's occupancy.
type Load struct {
	Running, Waiting int
	KVUsage          float64
}

// Load returns the occupancy after the last step. It is safe to call from any goroutine.
func (e *Engine) Load() Load {
	return Load{
		Running: int(e.numRunning.Load()),
		Waiting: int(e.numWaiting.Load()),
		KVUsage: math.Float64frombits(e.usageBits.Load()),
	}
}

// StepAt runs one scheduler step on a virtual clock instead of Run: it takes what was
// submitted, schedules a step at now, and applies it at now plus the step's modelled time,
// which it returns as end. An idle engine does nothing and returns now and false. It is for
// callers that drive the engine without sleeping (tests, offline replays) and must not be
// called while Run runs.
func (e *Engine) StepAt(now time.Time) (end time.Time, busy bool) {
	e.drain(now)
	if len(e.running) == 0 && e.waiting.len() == 0 && len(e.ready) == 0 {
		e.publishLoad()
		return now, false
	}
	e.planAt = now
	prefill, decodes := e.plan()
	e.publishLoad()
	if len(e.sched) == 0 {
		return now, false
	}
	end = now.Add(e.cfg.Timing.Step(prefill, decodes, e.pool.usage()))
	e.apply(end)
	e.publishLoad()
	return end, true
}

// maxLag bounds how far the step clock of a busy engine may fall behind wall time before the
// engine stops trying to catch up (when the host is too slow for the speedup asked).
const maxLag = 20 * time.Millisecond

// Run is the scheduler loop: it admits and schedules requests, sleeps for each step's modelled
// time and then applies it, until ctx is done. Requests still queued or running when it
// returns are finished with FinishAborted. Run must be called once.
func (e *Engine) Run(ctx context.Context) error {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	expiry := time.NewTimer(time.Hour) // the next held request's timeout, while idle
	expiry.Stop()
	defer expiry.Stop()
	defer e.shutdown()
	var clock time.Time // when the current step ends
	busy := false       // the last iteration ran a step: clock is the end of that step
	for {
		e.drain(time.Now())
		if len(e.running) == 0 && e.waiting.len() == 0 && len(e.ready) == 0 {
			busy = false
			e.publishLoad()
			next := e.nextExpiry()
			if !next.IsZero() {
				expiry.Reset(time.Until(next))
			}
			select {
			case <-ctx.Done():
				return nil
			case <-e.wake:
			case <-expiry.C:
			}
			expiry.Stop()
			continue
		}
		e.planAt = time.Now()
		prefill, decodes := e.plan()
		e.publishLoad()
		if len(e.sched) == 0 {
			// Nothing fits (every running request was preempted for lack of blocks, which
			// cannot last); wait for a change rather than spin.
			busy = false
			select {
			case <-ctx.Done():
				return nil
			case <-e.wake:
				continue
			}
		}
		d := e.cfg.Timing.Step(prefill, decodes, e.pool.usage())
		clock = e.catchUp(clock, time.Now(), busy).Add(d)
		busy = true
		for wait := time.Until(clock); wait > 0; wait = time.Until(clock) {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				timer.Stop()
				return nil
			case <-e.wake:
				timer.Stop()
				e.drain(time.Now())
			case <-timer.C:
			}
		}
		e.apply(time.Now())
	}
}

// catchUp returns when the next step starts. After an idle wait (not busy) a new busy period
// starts now, when its first request is there: never at the end of the last step, or a
// request arriving shortly after it would finish its prefill sooner than modelled. After a
// step (busy) the next one starts at the end of the last (clock), or now when that is more
// than maxLag ago: the host did not run the engine when its modelled time said, and the gap
// is time the engine lost, counted in Stalled.
func (e *Engine) catchUp(clock, now time.Time, busy bool) time.Time {
	if !busy {
		if now.Before(clock) {
			return clock
		}
		return now
	}
	lag := now.Sub(clock)
	if lag <= maxLag {
		return clock
	}
	if busy {
		e.stalls.Add(1)
		e.stalledNS.Add(int64(lag))
	}
	return now
}

// Stalled reports how often a busy engine fell more than maxLag behind its modelled step
// clock, and the time it lost doing so: the engine ran slower than its timing model says,
// because the host (CPU, or a speedup the host cannot keep up with) did not run it in time.
// Near zero on a host with CPU to spare. It is safe to call from any goroutine.
func (e *Engine) Stalled() (stalls int64, lost time.Duration) {
	return e.stalls.Load(), time.Duration(e.stalledNS.Load())
}

func (e *Engine) shutdown() {
	e.drain(time.Now())
	for _, r := range e.running {
		e.finish(r, FinishAborted, time.Now())
	}
	e.running = e.running[:0]
	for e.waiting.len() > 0 {
		r := e.waiting.pop()
		e.finish(r, FinishAborted, time.Now())
	}
	for r := range e.loading {
		e.finish(r, FinishAborted, time.Now()) // its pull ends with the worker's context
	}
	clear(e.loading)
	for _, r := range e.ready {
		e.finish(r, FinishAborted, time.Now())
	}
	e.ready = nil
	e.mu.Lock()
	inbox, resets := e.inbox, e.resets
	e.inbox, e.resets = nil, nil
	e.mu.Unlock()
	for _, r := range inbox {
		e.finish(r, FinishAborted, time.Now())
	}
	for _, c := range resets {
		c <- false
	}
	e.publishLoad()
}

// drain moves submitted requests into the waiting queue and carries out aborts and resets.
func (e *Engine) drain(now time.Time) {
	e.mu.Lock()
	inbox, aborts, resets := e.inbox, e.aborts, e.resets
	releases, pulls := e.releases, e.pulls
	e.inbox, e.aborts, e.resets = e.inbox[len(inbox):], e.aborts[len(aborts):], e.resets[len(resets):]
	e.releases, e.pulls = e.releases[len(releases):], e.pulls[len(pulls):]
	e.mu.Unlock()
	for _, r := range inbox {
		r.state = stateWaiting
		e.waiting.push(r)
	}
	for _, r := range aborts {
		e.abort(r, now)
	}
	for _, id := range releases {
		if r := e.held[id]; r != nil {
			e.unhold(r, "notification")
		} else {
			e.metrics.kvUnknownNotif()
		}
	}
	clear(releases)
	for _, j := range pulls {
		e.pulled(j, now)
	}
	clear(pulls)
	e.expireHolds(now)
	for _, c := range resets {
		ok := e.pool.reset()
		if ok {
			e.events = append(e.events[:0], CacheEvent{Kind: AllBlocksCleared})
			e.emit(now)
		}
		c <- ok
	}
}

func (e *Engine) abort(r *Request, now time.Time) {
	switch r.state {
	case stateWaiting:
		e.waiting.remove(r)
	case stateLoading:
		// The pull is still writing into r's blocks: they are freed when it reports back.
		r.pullCancel()
	case stateReady:
		e.ready = slices.DeleteFunc(e.ready, func(x *Request) bool { return x == r })
		e.pool.free(r.blocks)
		r.blocks = r.blocks[:0]
	case stateRunning:
		e.pool.free(r.blocks)
		r.blocks = r.blocks[:0]
		for i, x := range e.running {
			if x == r {
				e.running = append(e.running[:i], e.running[i+1:]...)
				break
			}
		}
	default: // finished, or aborted before it was submitted
		return
	}
	e.finish(r, FinishAborted, now)
	e.publishLoad()
}

// plan chooses this step's work, vLLM v1 style: running requests first, each with as many
// tokens as it still has to compute within the step's token budget (chunked prefill),
// preempting the least urgent running request when blocks run out; then waiting requests,
// starting from their longest cached prefix, while sequences, budget and blocks allow. It
// returns the new prefill tokens and the decoding sequences of the step.
func (e *Engine) plan() (prefill, decodes int) {
	e.sched = e.sched[:0]
	e.events = e.events[:0]
	e.pool.removed = e.pool.removed[:0]
	budget := e.cfg.MaxNumBatchedTokens
	bs := e.cfg.BlockSize
	preempted := false
	for i := 0; i < len(e.running) && budget > 0; {
		r := e.running[i]
		n := min(len(r.tokens)-r.numComputed, budget)
		if n <= 0 {
			i++
			continue
		}
		ok := true
		for !e.grow(r, (r.numComputed+n+bs-1)/bs) {
			victim := e.victim()
			preempted = true
			budget += e.unschedule(victim)
			if e.preempt(victim) < i {
				i-- // an earlier request left e.running: r moved down one place
			}
			if victim == r {
				ok = false
				break
			}
		}
		if !ok {
			continue // r left e.running; index i now holds the next request
		}
		e.sched = append(e.sched, scheduled{r: r, n: n})
		r.scheduled = true
		budget -= n
		i++
	}
	// Requests whose prompt KV was pulled go first: they hold every block they need (the
	// prompt's, allocated when the pull started), so they never wait behind a request that
	// does not fit.
	for !preempted && budget > 0 && len(e.running) < e.cfg.MaxNumSeqs && len(e.ready) > 0 {
		r := e.ready[0]
		e.ready = e.ready[1:]
		n := min(len(r.tokens)-r.numComputed, budget)
		if !e.grow(r, (r.numComputed+n+bs-1)/bs) {
			e.ready = append([]*Request{r}, e.ready...) // cannot happen: n ends within the prompt
			break
		}
		r.state = stateRunning
		e.running = append(e.running, r)
		e.sched = append(e.sched, scheduled{r: r, n: n})
		r.scheduled = true
		budget -= n
	}
	for !preempted && budget > 0 && len(e.running) < e.cfg.MaxNumSeqs && e.waiting.len() > 0 {
		r := e.waiting.peek()
		if r.kvPull != nil && e.kv != nil && !r.admitted {
			if !e.admitPull(r) {
				break
			}
			continue
		}
		hit := 0
		full := len(r.hashes)
		if full*bs == len(r.tokens) {
			full-- // the last token is always computed, to produce the next one
		}
		if full > 0 {
			hit = e.pool.hits(r.hashes[:full])
		}
		computed := hit * bs
		n := min(len(r.tokens)-computed, budget)
		need := (computed+n+bs-1)/bs - hit
		if !e.pool.canTake(r.hashes, hit, need) {
			break
		}
		e.waiting.pop()
		for _, h := range r.hashes[:hit] {
			r.blocks = e.pool.take(r.blocks, h)
		}
		for range need {
			r.blocks, _ = e.pool.allocate(r.blocks)
		}
		r.numComputed, r.numStored = computed, hit
		if !r.admitted {
			r.admitted = true
			r.scheduledAt = e.planAt
			r.mu.Lock()
			r.cached = computed
			r.mu.Unlock()
			e.metrics.admitted(r.promptLen, computed)
		}
		r.state = stateRunning
		e.running = append(e.running, r)
		e.sched = append(e.sched, scheduled{r: r, n: n})
		r.scheduled = true
		budget -= n
	}
	if len(e.pool.removed) > 0 {
		e.events = append(e.events, CacheEvent{Kind: BlocksRemoved, Hashes: e.pool.removed})
	}
	for i := range e.sched {
		s := &e.sched[i]
		r := s.r
		// A one-token step of a request whose prompt KV was pulled computes as a decode: it
		// only produces the first token (vLLM recomputes the last prompt token the same way).
		if s.n == 1 && r.numComputed == len(r.tokens)-1 && (len(r.tokens) > r.promptLen || r.pulled) {
			decodes++
		} else {
			s.prefill = true
			prefill += s.n
		}
	}
	return prefill, decodes
}

// grow makes r hold at least want blocks, allocating from the free queue.
func (e *Engine) grow(r *Request, want int) bool {
	for len(r.blocks) < want {
		var ok bool
		if r.blocks, ok = e.pool.allocate(r.blocks); !ok {
			return false
		}
	}
	return true
}

// victim picks the running request to preempt: the last admitted under FCFS, the least urgent
// (highest priority value, latest arrival) under the priority policy.
func (e *Engine) victim() *Request {
	v := e.running[len(e.running)-1]
	if e.waiting.byPriority {
		for _, r := range e.running {
			if e.waiting.less(v, r) {
				v = r
			}
		}
	}
	return v
}

// unschedule removes r from this step's plan if it was already in it and returns the tokens it
// had been given.
func (e *Engine) unschedule(r *Request) int {
	if !r.scheduled {
		return 0
	}
	for i, s := range e.sched {
		if s.r == r {
			e.sched = append(e.sched[:i], e.sched[i+1:]...)
			r.scheduled = false
			return s.n
		}
	}
	return 0
}

// preempt frees all of r's blocks and returns it to the waiting queue; it recomputes from its
// longest cached prefix when scheduled again (vLLM's recompute preemption). It returns the
// index r had in e.running.
func (e *Engine) preempt(r *Request) int {
	at := -1
	for i, x := range e.running {
		if x == r {
			e.running = append(e.running[:i], e.running[i+1:]...)
			at = i
			break
		}
	}
	e.pool.free(r.blocks)
	r.blocks = r.blocks[:0]
	r.numComputed, r.numStored = 0, 0
	r.pulled = false
	r.state = stateWaiting
	e.waiting.pushFront(r)
	e.metrics.preempted()
	return at
}

// apply completes the planned step at time now: computed tokens advance, newly full blocks
// enter the prefix cache, every sequence whose tokens are all computed samples one more, and
// requests that reached their end finish.
func (e *Engine) apply(now time.Time) {
	bs := e.cfg.BlockSize
	// Count the step's tokens before any client is woken, so a client that scrapes the
	// metrics after its response sees them.
	generated := 0
	for _, s := range e.sched {
		if s.r.scheduled && s.r.numComputed+s.n >= len(s.r.tokens) {
			generated++
		}
	}
	e.metrics.step(generated)
	for _, s := range e.sched {
		r := s.r
		if !r.scheduled {
			continue // aborted during the step
		}
		r.scheduled = false
		r.numComputed += s.n
		e.storeBlocks(r)
		if r.numComputed < len(r.tokens) {
			continue // a chunk of a longer prefill
		}
		out := len(r.tokens) - r.promptLen
		tok := e.filler[(int(r.seqNo)+out)%len(e.filler)]
		r.tokens = append(r.tokens, tok)
		if len(r.tokens)%bs == 0 {
			e.extendHashes(r)
		}
		if out == 0 {
			e.metrics.firstToken(now.Sub(r.arrival))
			if !r.scheduledAt.IsZero() {
				e.metrics.queueAndPrefill(r.scheduledAt.Sub(r.arrival), now.Sub(r.scheduledAt))
			}
		} else {
			e.metrics.interToken(now.Sub(r.lastTokenAt))
		}
		r.lastTokenAt = now
		if out+1 >= r.maxOut {
			reason := FinishStop
			if out+1 >= r.maxTokens {
				reason = FinishLength
			}
			if !(r.kvDecode && reason == FinishLength && e.hold(r, now)) {
				e.pool.free(r.blocks)
			}
			r.blocks = r.blocks[:0]
			// The last token and the end reach the client in one update, after the step's
			// metrics: a streaming client always sees the finish reason on the last token's
			// chunk, and one that scrapes after its response finds the gauges updated.
			e.finishWith(r, reason, now)
			e.ends = append(e.ends, pendingEnd{r: r, tok: tok, reason: reason})
			continue
		}
		r.mu.Lock()
		r.out = append(r.out, tok)
		if len(r.out) == 1 {
			r.firstTok = now
		}
		r.mu.Unlock()
		r.signal()
	}
	if len(e.ends) > 0 {
		live := e.running[:0]
		for _, r := range e.running {
			if r.state == stateRunning {
				live = append(live, r)
			}
		}
		clear(e.running[len(live):])
		e.running = live
	}
	e.emit(now)
	e.publishLoad()
	for i, p := range e.ends {
		p.r.mu.Lock()
		p.r.out = append(p.r.out, p.tok)
		if len(p.r.out) == 1 {
			p.r.firstTok = now
		}
		p.r.done, p.r.reason = true, p.reason
		p.r.mu.Unlock()
		p.r.signal()
		e.ends[i] = pendingEnd{}
	}
	e.ends = e.ends[:0]
}

// pendingEnd is a request that finished in the step being applied, with its last token, to
// hand to its client once the step's bookkeeping is done.
type pendingEnd struct {
	r      *Request
	tok    uint32
	reason FinishReason
}

// storeBlocks registers r's newly computed full blocks in the prefix cache and records the
// BlockStored events for those that became the cached copy.
func (e *Engine) storeBlocks(r *Request) {
	bs := e.cfg.BlockSize
	full := min(r.numComputed/bs, len(r.hashes))
	start := -1
	for b := r.numStored; b < full; b++ {
		if e.pool.store(r.blocks[b], r.hashes[b]) {
			if start < 0 {
				start = b
			}
			continue
		}
		if start >= 0 {
			e.storedRun(r, start, b)
			start = -1
		}
	}
	if start >= 0 {
		e.storedRun(r, start, full)
	}
	r.numStored = max(r.numStored, full)
}

func (e *Engine) storedRun(r *Request, from, to int) {
	bs := e.cfg.BlockSize
	ev := CacheEvent{Kind: BlocksStored, Hashes: r.hashes[from:to], Tokens: r.tokens[from*bs : to*bs], First: from}
	if !r.keys.Empty() {
		ev.Keys = &r.keys
	}
	if from > 0 {
		ev.Parent, ev.HasParent = r.hashes[from-1], true
	}
	e.events = append(e.events, ev)
}

// extendHashes appends the sequence hash of r's last block, which the token just sampled
// completed.
func (e *Engine) extendHashes(r *Request) {
	bs := e.cfg.BlockSize
	b := len(r.tokens)/bs - 1
	if b != len(r.hashes) {
		return
	}
	var parent uint64
	if b > 0 {
		parent = r.hashes[b-1]
	}
	r.hashes = e.hasher.AppendSeqKeys(r.hashes, parent, b > 0, r.tokens[b*bs:(b+1)*bs], bs, &r.keys, b)
}

func (e *Engine) finish(r *Request, reason FinishReason, now time.Time) {
	if e.finishWith(r, reason, now) {
		r.mu.Lock()
		r.done, r.reason = true, reason
		r.mu.Unlock()
		r.signal()
	}
}

// finishWith does the engine's part of finishing r and reports whether it did (r had not
// finished yet); the caller tells the client.
func (e *Engine) finishWith(r *Request, reason FinishReason, now time.Time) bool {
	if r.state == stateFinished {
		return false
	}
	r.state = stateFinished
	r.scheduled = false
	// Metrics first: a client that scrapes them after its response must find the request.
	switch reason {
	case FinishAborted:
		e.metrics.aborted()
	case FinishError:
	default:
		e.metrics.finished(r, reason, now)
	}
	return true
}

func (e *Engine) emit(now time.Time) {
	if len(e.events) > 0 && e.sink != nil {
		e.sink.CacheEvents(now, e.events)
	}
	e.events = e.events[:0]
}

func (e *Engine) publishLoad() {
	waiting := e.waiting.len() + len(e.loading) + len(e.ready) // vLLM counts WAITING_FOR_REMOTE_KVS as waiting
	e.numRunning.Store(int64(len(e.running)))
	e.numWaiting.Store(int64(waiting))
	u := e.pool.usage()
	e.usageBits.Store(math.Float64bits(u))
	e.metrics.load(len(e.running), waiting, u)
}

// hold keeps a finished prefill-leg request's blocks for its remote decode, as vLLM's
// NixlConnector delays freeing them: the prompt blocks' slots are pinned for their content,
// and the blocks stay referenced until the decoder's notification or the timeout. It
// reports false, leaving the caller to free the blocks, when the request cannot be held.
func (e *Engine) hold(r *Request, now time.Time) bool {
	if e.kv == nil || len(r.blocks) == 0 {
		return false
	}
	if _, dup := e.held[r.ID]; dup {
		return false
	}
	bs := e.cfg.BlockSize
	nPrompt := min(len(r.blocks), (r.promptLen+bs-1)/bs)
	keys := blockKeys(make([]uint64, 0, nPrompt), r.tokens[:r.promptLen], r.hashes, bs, &r.keys, 0, nPrompt)
	blocks := append([]int32(nil), r.blocks...)
	if !e.kv.pin(blocks[:nPrompt], keys) {
		e.metrics.kvConflict()
		return false
	}
	r.mu.Lock()
	r.kvHeld = &heldKV{blocks: blocks, keys: keys}
	r.mu.Unlock()
	e.held[r.ID] = r
	e.holdQ = append(e.holdQ, heldEntry{r: r, expiry: now.Add(e.cfg.KVTransferTimeout)})
	e.heldRequests.Add(1)
	e.heldBlocks.Add(int64(len(blocks)))
	e.metrics.kvHeld(len(blocks), "")
	return true
}

// unhold frees the blocks r kept for its remote decode; by is what freed them.
func (e *Engine) unhold(r *Request, by string) {
	delete(e.held, r.ID)
	h := r.kvHeld // written by hold on this goroutine
	e.kv.unpin(h.blocks[:len(h.keys)])
	e.pool.free(h.blocks)
	e.heldRequests.Add(-1)
	e.heldBlocks.Add(-int64(len(h.blocks)))
	e.metrics.kvHeld(-len(h.blocks), by)
	e.publishLoad()
}

// expireHolds frees the blocks of held requests whose decoder did not read them in time.
func (e *Engine) expireHolds(now time.Time) {
	n := 0
	for n < len(e.holdQ) && !e.holdQ[n].expiry.After(now) {
		if r := e.holdQ[n].r; e.held[r.ID] == r {
			e.unhold(r, "timeout")
		}
		n++
	}
	if n > 0 {
		rest := copy(e.holdQ, e.holdQ[n:])
		clear(e.holdQ[rest:])
		e.holdQ = e.holdQ[:rest]
	}
	// Entries released by notification linger until they expire; drop them when they are
	// most of the queue.
	if len(e.holdQ) > 64 && len(e.holdQ) > 2*len(e.held) {
		live := e.holdQ[:0]
		for _, h := range e.holdQ {
			if e.held[h.r.ID] == h.r {
				live = append(live, h)
			}
		}
		clear(e.holdQ[len(live):])
		e.holdQ = live
	}
}

// nextExpiry is when the oldest held request times out, zero when none is held.
func (e *Engine) nextExpiry() time.Time {
	for _, h := range e.holdQ {
		if e.held[h.r.ID] == h.r {
			return h.expiry
		}
	}
	return time.Time{}
}

// admitPull admits a decode-leg request as vLLM's NixlConnector does: it takes the prompt's
// cached prefix, allocates blocks for the rest of the prompt and starts pulling the remote
// blocks the prefix cache lacks; the request waits (stateLoading) until the pull reports
// back. It reports false when the blocks are not there yet.
func (e *Engine) admitPull(r *Request) bool {
	bs := e.cfg.BlockSize
	nPrompt := (r.promptLen + bs - 1) / bs
	full := len(r.hashes)
	if full*bs == len(r.tokens) {
		full--
	}
	hit := 0
	if full > 0 {
		hit = e.pool.hits(r.hashes[:full])
	}
	if !e.pool.canTake(r.hashes, hit, nPrompt-hit) {
		return false
	}
	e.waiting.pop()
	for _, h := range r.hashes[:hit] {
		r.blocks = e.pool.take(r.blocks, h)
	}
	for range nPrompt - hit {
		r.blocks, _ = e.pool.allocate(r.blocks)
	}
	r.numComputed, r.numStored = hit*bs, hit
	r.admitted = true
	r.scheduledAt = e.planAt
	e.metrics.admitted(r.promptLen, hit*bs)
	// Remote block i holds prompt block i; pull those the prefix cache lacks (none when the
	// remote list is no longer than the cached prefix).
	end := max(hit, min(len(r.kvPull.RemoteBlockIDs), nPrompt))
	var remote []int
	if end > hit {
		remote = r.kvPull.RemoteBlockIDs[hit:end]
	}
	job := &pullJob{
		r:        r,
		params:   r.kvPull,
		local:    append([]int32(nil), r.blocks[hit:end]...),
		remote:   remote,
		keys:     blockKeys(make([]uint64, 0, end-hit), r.tokens[:r.promptLen], r.hashes, bs, &r.keys, hit, end),
		modelled: e.cfg.ModelledTransfer(end - hit),
		start:    time.Now(),
		done:     e.pullDone,
	}
	r.state = stateLoading
	e.loading[r] = true
	e.kv.startPull(job)
	r.pullCancel = job.cancel
	return true
}

// pulled finishes a pull on the scheduler goroutine: the pulled blocks become computed (and
// enter the prefix cache) and the request waits to compute the rest, or the request fails.
func (e *Engine) pulled(j *pullJob, now time.Time) {
	r := j.r
	delete(e.loading, r)
	if r.state != stateLoading { // aborted (or shut down) while the pull ran
		e.pool.free(r.blocks)
		r.blocks = r.blocks[:0]
		e.publishLoad()
		return
	}
	if j.err != nil {
		e.pool.free(r.blocks)
		r.blocks = r.blocks[:0]
		r.mu.Lock()
		r.failure = j.err
		r.mu.Unlock()
		e.finish(r, FinishError, now)
		e.publishLoad()
		return
	}
	bs := e.cfg.BlockSize
	// As vLLM does once remote KV arrived: everything pulled counts as computed except the
	// prompt's last token, which is recomputed to produce the first output token.
	computed := min(max(r.numComputed, (r.numStored+len(j.local))*bs), r.promptLen-1)
	r.numComputed = computed
	e.storeBlocks(r)
	e.emit(now)
	r.pulled = true
	r.mu.Lock()
	r.cached = computed
	r.mu.Unlock()
	r.state = stateReady
	e.ready = append(e.ready, r)
	e.publishLoad()
}
