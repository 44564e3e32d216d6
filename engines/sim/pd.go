package sim

// The scheduler's side of the KV connector (kvconn.go): a prefill-leg request's blocks held
// for its remote decode, and a decode-leg request's blocks pulled before it runs. Everything
// here runs on the engine's Run goroutine unless it says otherwise.

import (
	"sort"
	"time"
)

type heldEntry struct {
	r      *Request
	expiry time.Time
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

// hold keeps a finished prefill-leg request's blocks for its remote decode, as vLLM's
// NixlConnector delays freeing them: the prompt blocks' slots are pinned for their content,
// and the blocks stay referenced until the decoder's notification or the timeout: they pass
// from r to the hold (blockManager.detach). It reports false, leaving the caller to free
// r's blocks, when the request cannot be held.
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
	if !e.kv.pin(r.blocks[:nPrompt], keys) {
		e.metrics.kvConflict()
		return false
	}
	blocks := e.kvm.detach(r)
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
	e.kvm.release(h.blocks)
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
// back. It reports false when the blocks are not there yet. A peer fetch (r.peerHolder) is
// admitted alike, and asks its holder for the blocks it lacks only then, so the holder
// holds them for the transfer alone, not while this request queues. A fetch takes the
// blocks it pulls before any of the prompt runs: without room for all of them it pulls the
// leading blocks that fit beside the next chunk of at most budget tokens and computes the
// rest; without room for even one it drops the fetch, reporting true with the request left
// at the head of the queue for the caller to admit as a plain one; and without room for
// that chunk either it waits, as a plain request would (false).
func (e *Engine) admitPull(r *Request, budget int) bool {
	bs := e.cfg.BlockSize
	nPrompt := (r.promptLen + bs - 1) / bs
	full := len(r.hashes)
	if full*bs == len(r.tokens) {
		full--
	}
	hit := 0
	if full > 0 {
		hit = e.kvm.gpuHits(r.hashes[:full])
	}
	alloc := nPrompt - hit // blocks allocated now, after the cached prefix
	if !e.kvm.canAdmit(r.hashes, hit, alloc) {
		if r.peerHolder == "" {
			return false
		}
		k := e.fetchFitting(r, hit, full, budget)
		switch k {
		case -1: // no room for its next chunk either: it waits, as a plain request would
			return false
		case 0:
			// No room for a block more than computing the prompt takes: the request computes
			// it as any other does, chunk by chunk, rather than wait at the head of the
			// queue (the caller admits it next).
			r.peerHolder = ""
			e.kvm.stats.peerFetches[PeerNoRoom].Add(1)
			e.metrics.peerFetch("no_room")
			return true
		}
		alloc, full, r.peerPartial = k, hit+k, true
	}
	e.waiting.pop()
	e.kvm.takeCached(r, hit)
	e.kvm.allocateSlots(r, hit+alloc) // canAdmit counted them
	r.numComputed, r.numStored = hit*bs, hit
	r.admitted = true
	r.scheduledAt = e.planAt
	if r.peerHolder == "" {
		e.countAdmitted(r, hit*bs, 0)
		e.kvm.countHits([3]int{hit})
	} // a peer fetch counts when its pull ends: what it found and pulled, or (falling back) as a plain request
	r.state = stateLoading
	e.loading[r] = true
	if r.peerHolder != "" {
		e.askHolder(r, hit, full)
		return true
	}
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
	e.kv.startPull(job)
	r.pullCancel = job.cancel
	return true
}

// countAdmitted counts an admitted prompt, once: cached of its tokens found in this engine's
// tiers (counted by tier with blockManager.countHits), and peer pulled from a peer.
func (e *Engine) countAdmitted(r *Request, cached, peer int) {
	e.metrics.admitted(r.promptLen, cached+peer)
	st := &e.kvm.stats
	st.promptTokens.Add(int64(r.promptLen))
	st.cachedTokens.Add(int64(cached))
	st.peerTokens.Add(int64(peer))
}

// fetchFitting returns how many of the blocks [hit, full) that r's prompt lacks (hit: its
// cached prefix) a fetch can take now with room left for the next chunk of at most budget
// tokens after them: the most, 0 when not one, -1 when not even the chunk after hit has room
// (a plain request would wait for blocks there).
func (e *Engine) fetchFitting(r *Request, hit, full, budget int) int {
	bs := e.cfg.BlockSize
	fits := func(k int) bool {
		n := min(r.promptLen-(hit+k)*bs, budget)
		return e.kvm.canAdmit(r.hashes, hit, k+(n+bs-1)/bs)
	}
	return sort.Search(full-hit+1, func(k int) bool { return !fits(k) }) - 1 // fits is monotone
}

// pulled finishes a pull on the scheduler goroutine: the pulled blocks become computed (and
// enter the prefix cache) and the request waits to compute the rest, or the request fails.
func (e *Engine) pulled(j *pullJob, now time.Time) {
	r := j.r
	delete(e.loading, r)
	if r.pullCancel != nil {
		r.pullCancel() // a peer fetch's: its ask and pull are over
		r.pullCancel = nil
	}
	if r.state != stateLoading { // aborted (or shut down) while the pull ran
		e.kvm.free(r)
		e.publishLoad()
		return
	}
	if r.peerHolder != "" && j.err == nil && j.params == nil {
		e.kvm.stats.peerFetches[PeerFallback].Add(1)
		e.peerFallback(r, false) // the holder did not answer, or held nothing
		return
	}
	if j.err != nil && r.peerFetch {
		e.kvm.stats.peerFetches[PeerFallback].Add(1)
		e.peerFallback(r, true)
		return
	}
	if j.err != nil {
		e.kvm.free(r)
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
	if r.peerFetch {
		if r.peerPartial {
			e.metrics.peerFetch("partial")
			e.kvm.stats.peerFetches[PeerPartial].Add(1)
		} else {
			e.metrics.peerFetch("pulled")
			e.kvm.stats.peerFetches[PeerPulled].Add(1)
		}
		e.countAdmitted(r, r.numComputed, computed-r.numComputed)
		e.kvm.countHits([3]int{r.numStored})
	}
	r.numComputed = computed
	e.kvm.cacheBlocks(r)
	e.emit(now)
	r.mu.Lock()
	r.cached = computed
	r.mu.Unlock()
	if r.peerPartial {
		// The rest of the prompt is computed as any prompt is, chunk by chunk: the request
		// goes back to the head of the queue, where what it pulled is a cached prefix.
		e.requeue(r)
		return
	}
	r.pulled = true
	r.state = stateReady
	e.ready = append(e.ready, r)
	e.publishLoad()
}
