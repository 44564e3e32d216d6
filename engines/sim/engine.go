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
	// Medium is the tier: MediumGPU, MediumCPU or MediumDISK ("" reads as GPU).
	Medium string
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
	exports  []*exportJob
	wake     chan struct{}
	nextSeq  uint64

	// kv is the KV connector of a prefill or decode worker (or of one with PeerFetch), nil
	// otherwise.
	kv *kvConnector

	// Owned by the Run goroutine.
	planAt    time.Time     // when the step being planned starts
	exportSeq uint64        // exports so far, for their leases
	kvm       *blockManager // the KV block memory: the one owner of every block
	waiting   waitQueue
	running   []*Request
	sched     []scheduled
	batch     Batch // the planned step's composition
	events    []CacheEvent
	hasher    blockhash.Hasher
	ends      []pendingEnd
	held      map[string]*Request // finished requests keeping their blocks for a remote decode
	holdQ     []heldEntry         // the same, in order of expiry (the timeout is fixed)
	loading   map[*Request]bool   // requests waiting for a pull
	ready     []*Request          // requests whose pull finished, waiting to be scheduled

	numRunning, numWaiting atomic.Int64
	usageBits              atomic.Uint64
	heldRequests           atomic.Int64
	heldBlocks             atomic.Int64
	// stalls and stalledNS count the times a busy engine fell more than maxLag behind its
	// modelled clock, and the time it lost (see Stalled).
	stalls, stalledNS atomic.Int64
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
		waiting: waitQueue{byPriority: cfg.SchedulingPolicy == Priority},
		held:    make(map[string]*Request),
		loading: make(map[*Request]bool),
	}
	kvm, err := newBlockManager(&e.cfg, metrics, &e.events)
	if err != nil {
		return nil, err
	}
	e.kvm = kvm
	return e, nil
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
	e.plan()
	e.publishLoad()
	if len(e.sched) == 0 {
		return now, false
	}
	end = now.Add(e.stepTime())
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
	stop := ctx.Done()
	for {
		// A busy engine behind its clock never waits below, so it looks here.
		select {
		case <-stop:
			return nil
		default:
		}
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
		e.plan()
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
		d := e.stepTime()
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
	e.mu.Lock()
	exports := e.exports
	e.exports = nil
	e.mu.Unlock()
	for _, j := range exports {
		j.reply <- exported{}
	}
	e.publishLoad()
}

// drain moves submitted requests into the waiting queue and carries out aborts and resets.
func (e *Engine) drain(now time.Time) {
	e.mu.Lock()
	inbox, aborts, resets := e.inbox, e.aborts, e.resets
	releases, pulls, exports := e.releases, e.pulls, e.exports
	e.inbox, e.aborts, e.resets = e.inbox[len(inbox):], e.aborts[len(aborts):], e.resets[len(resets):]
	e.releases, e.pulls, e.exports = e.releases[len(releases):], e.pulls[len(pulls):], e.exports[len(exports):]
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
	for _, j := range exports {
		e.export(j, now)
	}
	clear(exports)
	for _, c := range resets {
		ok := e.kvm.reset()
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
		e.kvm.free(r)
	case stateRunning:
		e.kvm.free(r)
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

// stepTime is the modelled wall time of the planned step (e.batch).
func (e *Engine) stepTime() time.Duration {
	if e.cfg.StepModel != nil {
		return e.cfg.StepModel.Step(&e.batch)
	}
	return e.cfg.Timing.Step(&e.batch)
}

func (e *Engine) publishLoad() {
	waiting := e.waiting.len() + len(e.loading) + len(e.ready) // vLLM counts WAITING_FOR_REMOTE_KVS as waiting
	e.numRunning.Store(int64(len(e.running)))
	e.numWaiting.Store(int64(waiting))
	u := e.kvm.usage()
	e.usageBits.Store(math.Float64bits(u))
	e.metrics.load(len(e.running), waiting, u)
}
