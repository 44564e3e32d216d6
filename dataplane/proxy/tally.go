package proxy

import (
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// tally is what one request adds to its worker and learns from it, from its dispatch to its
// response's end: its load (route.Usage, which also teaches the worker's latency model), its
// record in the proxy's own index once its prefill is done, and its metrics. The proxy's
// exchange with an engine and the endpoint picker's pick (whose response a gateway carries)
// each hold one and feed it the response as it passes.
type tally struct {
	ws        *workerState
	usage     route.Usage
	receipt   prefix.Receipt
	predicted int  // the prompt blocks the worker was taken to cache
	recorded  bool // the prompt's blocks went into the proxy's index (receipt is valid)
	tokens    int  // content chunks so far
	start     int64
}

// feed reads metrics off the next piece of the response and keeps the worker's load
// current: the first content chunk ends the prefill (the worker's latency model learns its
// TTFT, the index records the prompt), later ones grow its blocks.
func (t *tally) feed(in *input, obs *oai.Observer, data []byte, now int64) {
	before := obs.Result().Chunks
	obs.Feed(data, now)
	n := obs.Result().Chunks
	if n == before {
		return
	}
	if before == 0 {
		t.usage.FirstTokenAt(now)
		if pred, actual, ok := t.usage.TTFTPrediction(); ok {
			t.ws.m.prediction(pred, actual)
		}
		t.recordCached(in, now)
		// The worker's prefill is done: a request waiting for a worker under its busy
		// prefill threshold may fit now.
		in.srv.queue.release(in.srv)
	}
	t.tokens = n
	t.usage.Generated(n)
}

// recordCached records in the proxy's own index, once per request, that its worker now
// caches the prompt's blocks: when its prefill is done (the first token), not when it was
// routed. Until then the blocks are being computed, and an engine does not share blocks
// still being computed: a second request with the same prompt sent there meanwhile computes
// them again, so counting them as cached would send a burst of a new prefix (an agent's
// preamble on a cold worker) to one worker, all of it computed once per request, instead of
// spreading it.
func (t *tally) recordCached(in *input, now int64) {
	w := t.usage.Worker()
	if t.recorded || w == nil || (in.kind != oai.ChatCompletions && in.kind != oai.Completions) {
		return
	}
	t.receipt = in.recordPlacement(w, t.predicted, now)
	t.recorded = len(in.rreq.Hashes) > 0
}

// settle records the request's metrics at its end (status 0: it got no answer) and
// releases what it held on its worker: its arm's and model's figures, how well the cached
// blocks were predicted (correcting the index from what the engine reports cached), and
// for a complete answer what the worker's latency model learns of its decode.
func (t *tally) settle(in *input, arm *armSeries, mm *modelMetrics, res *oai.Observation, status int, now int64) {
	s := in.srv
	ttft, hasTTFT := res.TTFT()
	if hasTTFT {
		mm.ttft.Observe(seconds(ttft))
	}
	if status == 0 {
		status = 502
	}
	completion := in.kind == oai.ChatCompletions || in.kind == oai.Completions
	if arm != nil && completion {
		cached, prompt := 0, 0
		if res.Usage.HasCached {
			cached, prompt = int(res.Usage.CachedTokens)/s.cfg.BlockSize, len(in.rreq.Hashes)
		}
		arm.observe(status, seconds(ttft), hasTTFT, cached, prompt)
	}
	s.metrics.requestOf(mm, in.model, in.kind, status)
	mm.e2e[in.kind].Observe(seconds(now - t.start))
	if t.ws != nil && completion && res.Usage.HasCached {
		bs := s.cfg.BlockSize
		cached := int(res.Usage.CachedTokens) / bs
		t.ws.m.predicted.Add(float64(t.predicted))
		t.ws.m.reported.Add(float64(cached))
		t.ws.m.promptBlocks.Add(float64(len(in.rreq.Hashes)))
		diff := cached - t.predicted
		if diff < 0 {
			diff = -diff
		}
		s.metrics.predictionErr.Observe(float64(diff))
		if t.recorded {
			s.index.CorrectAt(now, in.rreq.Hashes, t.receipt, cached)
		}
	}
	if t.usage.Worker() != nil {
		t.ws.m.inflight.Dec()
	}
	if in.decID != 0 {
		s.decisions.complete(in.decID, status, res)
		in.decID = 0
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
}

// recordPlacement records in the proxy's own index that w holds the prompt's blocks, of
// which it cached overlap already, and returns the receipt that corrects the record from the
// cached_tokens the engine reports. The index is shared by every loop behind one lock; a
// prompt without a full block (and every prompt under a policy without an index) changes
// nothing in it.
func (in *input) recordPlacement(w *route.Worker, overlap int, now int64) prefix.Receipt {
	if len(in.rreq.Hashes) == 0 {
		return prefix.Receipt{}
	}
	s := in.srv
	r := s.index.RecordAt(now, w.Index, in.rreq.Hashes, overlap)
	if ttl := in.oreq.Hints.PinTTL; ttl > 0 {
		// The engine keeps a pinned prompt: so does the index (sticky pinned prefixes).
		s.index.PinAt(now, w.Index, in.rreq.Hashes, ttl)
	}
	w.SetCachedBlocks(s.index.Blocks(w.Index))
	return r
}
