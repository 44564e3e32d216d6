package decide

import (
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// tally is what one request adds to its worker and learns from it, from its dispatch to its
// answer's end: its load (route.Usage, which also teaches the worker's latency model), its
// record in the core's own index once its prefill is done, and its metrics. The carrier
// feeds it the answer as it passes (Feed) and ends it (Settle).
type tally struct {
	ws        *WorkerState
	usage     route.Usage
	receipt   prefix.Receipt
	predicted int  // the prompt blocks the worker was taken to cache
	recorded  bool // the prompt's blocks went into the core's index (receipt is valid)
	tokens    int  // content chunks so far
	start     int64
	at        int64 // when it was dispatched
}

// Dispatch books the decided request on its worker (Decision().Worker) at now: its load,
// which later decisions see; the prediction it was routed on, which its first token and
// its end teach the worker's latency model when teach (a streamed answer's first chunk is
// its first token; not a migrated stream's continuation); its decision in the worker's and
// its policy's series.
func (r *Request) Dispatch(now int64, teach bool) {
	c := r.c
	w := r.dec.Worker
	ws := c.workerState(w)
	ws.m.routedBy(r.dec.Mode).Inc()
	c.observeRegret(r.arm, &r.dec)
	t := &r.t
	t.ws, t.at = ws, now
	t.receipt, t.recorded = prefix.Receipt{}, false // recorded at the first token (RecordCached)
	if r.kind == oai.ChatCompletions || r.kind == oai.Completions {
		overlap := int(r.dec.Overlap)
		t.predicted = overlap
		t.usage.BeginAt(now, w, r.rreq.PromptTokens, overlap*c.cfg.BlockSize, r.rreq.OSL)
		// A request that fetches its prefix from a peer teaches nothing: its TTFT holds a
		// transfer the model's features do not. Nor does an answer whose chunks' times are
		// not its tokens' (buffered by the gateway that carries it: Untimed).
		t.usage.Predicted(&r.dec, r.prio, teach && !r.untimed && r.oreq.Stream && r.dec.PeerFetch == nil)
	} else {
		t.usage.BeginAt(now, w, r.rreq.PromptTokens, 0, 0)
	}
	ws.m.inflight.Inc()
	r.countRunning(1)
}

// Waited is how long the request took from its arrival to its (last) dispatch: parsing,
// routing and its time in the admission queue, in nanoseconds.
func (r *Request) Waited() int64 { return max(r.t.at-r.arrived, 0) }

// Untimed says that the request's answer reaches the core whole or in pieces whose times
// are not its tokens' (a gateway that buffers the response before the picker sees it):
// call it before Dispatch. Such an answer still ends the request's load and tells what the
// engine cached, but teaches no latency model and records no TTFT or inter-token gap.
func (r *Request) Untimed() { r.untimed = true }

// ClientGone tells the core, before Settle, that the request's client went away before its
// answer ended: its arm counts it apart from the routing's failures.
func (r *Request) ClientGone() { r.end = endGone }

// Broken tells the core, before Settle, that the request's answer broke after its head
// reached the client (the engine's stream ended or failed midway): a failure of the
// routing whatever its status says.
func (r *Request) Broken() {
	if r.end == endAnswered {
		r.end = endBroken
	}
}

// armGroup is the request's conversation group, computed once.
func (r *Request) armGroup() int {
	if r.group < 0 {
		r.group = r.armGroupOf()
	}
	return r.group
}

// Answer begins reading the request's answer, whose time counts from start (the carrier's
// exchange began then): its model's series, its arm's inter-token gaps.
func (r *Request) Answer(start int64) {
	r.t.start, r.t.tokens = start, 0
	r.mm = r.c.m.forModel(r.model)
	r.obs.ITL = r.mm.itl
	if r.arm != nil {
		r.itl = armITL{model: r.mm.itl, arm: r.arm, group: r.armGroup()}
		r.obs.ITL = &r.itl
	}
	if r.untimed {
		r.obs.ITL = nil // its gaps are the gateway's, not the engine's
	}
	r.obs.Reset(oai.ModeAuto, start)
}

// Feed reads metrics off the next piece of the answer and keeps the worker's load current:
// the first content chunk ends the prefill (the worker's latency model learns its TTFT, the
// index records the prompt, a prefill leg's hold ends), later ones grow its blocks.
func (r *Request) Feed(data []byte, now int64) {
	t := &r.t
	before := r.obs.Result().Chunks
	r.obs.Feed(data, now)
	n := r.obs.Result().Chunks
	if n == before {
		return
	}
	if before == 0 {
		if !r.untimed {
			t.usage.FirstTokenAt(now)
			if pred, actual, ok := t.usage.TTFTPrediction(); ok {
				t.ws.m.prediction(pred, actual)
			}
		}
		r.RecordCached(now)
		// The worker's prefill is done: a request waiting for a worker under its busy
		// prefill threshold may fit now.
		r.c.queue.release()
		// The decode worker has pulled the prompt's KV by its first token.
		r.pd.pre.End()
	}
	t.tokens = n
	t.usage.Generated(n)
}

// RecordCached records in the core's own index, once per request, that its worker now
// caches the prompt's blocks: when its prefill is done (the first token, or an answer
// without content chunks at its end), not when it was routed. Until then the blocks are
// being computed, and an engine does not share blocks still being computed: a second
// request with the same prompt sent there meanwhile computes them again, so counting them
// as cached would send a burst of a new prefix (an agent's preamble on a cold worker) to
// one worker, all of it computed once per request, instead of spreading it.
func (r *Request) RecordCached(now int64) {
	t := &r.t
	w := t.usage.Worker()
	if t.recorded || w == nil || (r.kind != oai.ChatCompletions && r.kind != oai.Completions) {
		return
	}
	t.receipt = r.recordPlacement(w, t.predicted, now)
	t.recorded = len(r.rreq.Hashes) > 0
}

// Withdraw takes the request's load off the worker of its attempt that failed before an
// answer the carrier can use, and leaves that worker out of its next decision (a retry, or
// a migrating stream's continuation).
func (r *Request) Withdraw() {
	t := &r.t
	t.ws.m.inflight.Dec()
	t.usage.End()
	r.rreq.Exclude = append(r.rreq.Exclude, t.ws.W.Index)
}

// Settle ends the dispatched request at now with status (0: it got no answer): it records
// its metrics, its arm's and model's figures, how well the cached blocks were predicted
// (correcting the index from what the engine reports cached), for a complete answer what
// the worker's latency model learns of its decode, and releases what it held on its
// worker, which may let a queued request go.
func (r *Request) Settle(status int, now int64) {
	c := r.c
	r.countRunning(-1)
	t := &r.t
	res := r.obs.Result()
	mm := r.mm
	ttft, hasTTFT := res.TTFT()
	hasTTFT = hasTTFT && !r.untimed
	if hasTTFT {
		mm.ttft.Observe(seconds(ttft))
	}
	if status == 0 {
		status = 502
	}
	completion := r.kind == oai.ChatCompletions || r.kind == oai.Completions
	if arm := r.arm; arm != nil && completion {
		cached, prompt := 0, 0
		if res.Usage.HasCached {
			cached, prompt = int(res.Usage.CachedTokens)/c.cfg.BlockSize, len(r.rreq.Hashes)
		}
		arm.observe(r.armGroup(), status, r.end, seconds(ttft), hasTTFT, cached, prompt)
	}
	r.arm = nil // counted once
	c.m.requestOf(mm, r.model, r.kind, status)
	mm.e2e[r.kind].Observe(seconds(now - t.start))
	if t.ws != nil && completion && res.Usage.HasCached {
		bs := c.cfg.BlockSize
		cached := int(res.Usage.CachedTokens) / bs
		t.ws.m.predicted.Add(float64(t.predicted))
		t.ws.m.reported.Add(float64(cached))
		t.ws.m.promptBlocks.Add(float64(len(r.rreq.Hashes)))
		diff := cached - t.predicted
		if diff < 0 {
			diff = -diff
		}
		c.m.predictionErr.Observe(float64(diff))
		if t.recorded {
			c.index.CorrectAt(now, r.rreq.Hashes, t.receipt, cached)
		}
	}
	if t.usage.Worker() != nil {
		t.ws.m.inflight.Dec()
	}
	if r.decID != 0 {
		c.decisions.complete(r.decID, status, res)
		r.decID = 0
	}
	if status == 200 {
		// The tokens the engine reports generating, where it reports usage: an engine that
		// sends several tokens in one event under load (so fewer events than tokens) would
		// otherwise read as a slow decode.
		out := t.tokens
		if u := res.Usage; u.Has && u.CompletionTokens > int64(out) {
			out = int(min(u.CompletionTokens, 1<<30))
		}
		t.usage.CompletedAt(now, out)
	}
	t.usage.End()
	r.pd.pre.End()
	c.queue.release()
}

// Refused counts a request answered with status before any worker took it (refused, timed
// out in the queue, no worker): its model's count and its routing policy's arm.
func (r *Request) Refused(status int) {
	r.pd.pre.End()
	if r.kind == 0 {
		return
	}
	model := r.model
	if model == "" {
		model = "unknown"
	}
	r.c.m.request(model, r.kind, status)
	if a := r.arm; a != nil {
		a.observe(r.armGroup(), status, endAnswered, 0, false, 0, 0)
		r.arm = nil
	}
}

// recordPlacement records in the core's own index that w holds the prompt's blocks, of
// which it cached overlap already, and returns the receipt that corrects the record from the
// cached_tokens the engine reports. The index is shared by every carrier behind one lock; a
// prompt without a full block (and every prompt under a policy without an index) changes
// nothing in it.
func (r *Request) recordPlacement(w *route.Worker, overlap int, now int64) prefix.Receipt {
	if len(r.rreq.Hashes) == 0 {
		return prefix.Receipt{}
	}
	c := r.c
	rc := c.index.RecordAt(now, w.Index, r.rreq.Hashes, overlap)
	if ttl := r.oreq.Hints.PinTTL; ttl > 0 && w.Pins {
		// The engine keeps a pinned prompt: so does the index (sticky pinned prefixes).
		// An engine that does not pin evicts it in its own order, and the index must not
		// credit it past that.
		c.index.PinAt(now, w.Index, r.rreq.Hashes, ttl)
	}
	w.SetCachedBlocks(c.index.Blocks(w.Index))
	return rc
}
