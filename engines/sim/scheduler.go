package sim

// The scheduler: each step, plan chooses the work (vLLM v1's running-first, chunked-prefill
// policy) within the token budget and the blocks the block manager can give, and apply
// completes it once the step's modelled time has passed. Both run on the engine's Run
// goroutine.

import (
	"time"
)

type scheduled struct {
	r       *Request
	n       int
	prefill bool
}

// plan chooses this step's work, vLLM v1 style: running requests first, each with as many
// tokens as it still has to compute within the step's token budget (chunked prefill),
// preempting the least urgent running request when blocks run out; then waiting requests,
// starting from their longest cached prefix, while sequences, budget and blocks allow. It
// returns the new prefill tokens and the decoding sequences of the step, and leaves the
// step's composition in e.batch for the step model.
func (e *Engine) plan() (prefill, decodes int) {
	e.sched = e.sched[:0]
	e.batch.Onboard = 0
	e.events = e.events[:0]
	e.kvm.beginStep(e.planAt)
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
		for !e.kvm.allocateSlots(r, (r.numComputed+n+bs-1)/bs) {
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
		if !e.kvm.allocateSlots(r, (r.numComputed+n+bs-1)/bs) {
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
		if (r.kvPull != nil || r.peerHolder != "") && e.kv != nil && !r.admitted {
			if !e.admitPull(r, budget) {
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
			hit = e.kvm.capLoad(r, e.kvm.lookup(r.hashes[:full]))
		}
		computed := hit * bs
		n := min(len(r.tokens)-computed, budget)
		need := (computed+n+bs-1)/bs - hit
		if !e.kvm.canAdmit(r.hashes, hit, need) {
			// Blocks below the GPU come back all at once, before any of the prompt runs:
			// without room for all of them, bring back the longest prefix that fits and
			// compute the rest, chunk by chunk (SGLang's HiCache likewise recomputes what it
			// has no room to load back), rather than wait at the head of the queue.
			if hit = e.kvm.fitting(r, hit, budget); hit < 0 {
				break
			}
			computed = hit * bs
			n = min(len(r.tokens)-computed, budget)
			need = (computed+n+bs-1)/bs - hit
		}
		e.waiting.pop()
		if got := e.kvm.admit(r, hit, &e.batch.Onboard); got < hit {
			// A block below the GPU could not be read back: compute from there.
			hit, computed = got, got*bs
			n = min(len(r.tokens)-computed, budget)
			need = (computed+n+bs-1)/bs - hit
		}
		e.kvm.allocateSlots(r, hit+need) // canAdmit counted them
		r.numComputed, r.numStored = computed, hit
		if !r.admitted {
			r.admitted = true
			r.scheduledAt = e.planAt
			r.mu.Lock()
			r.cached = computed
			r.mu.Unlock()
			e.countAdmitted(r, computed, 0) // by tier in kvm.admit
		}
		r.state = stateRunning
		e.running = append(e.running, r)
		e.sched = append(e.sched, scheduled{r: r, n: n})
		r.scheduled = true
		budget -= n
	}
	e.kvm.endStep()
	b := &e.batch
	*b = Batch{Prefill: b.Prefill[:0], Onboard: b.Onboard}
	for i := range e.sched {
		s := &e.sched[i]
		r := s.r
		// A one-token step of a request whose prompt KV was pulled computes as a decode: it
		// only produces the first token (vLLM recomputes the last prompt token the same way).
		if s.n == 1 && r.numComputed == len(r.tokens)-1 && (len(r.tokens) > r.promptLen || r.pulled) {
			decodes++
			b.DecodeContext += r.numComputed
		} else {
			s.prefill = true
			prefill += s.n
			b.Prefill = append(b.Prefill, Chunk{Tokens: s.n, Context: r.numComputed})
		}
	}
	b.PrefillTokens, b.Decodes, b.KVUsage = prefill, decodes, e.kvm.usage()
	return prefill, decodes
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
	e.kvm.free(r)
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
		e.kvm.cacheBlocks(r)
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
				e.kvm.free(r)
			}
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
