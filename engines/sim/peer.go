package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"
)

// Peer fetch: blocks are immutable once stored, so any worker that caches a prefix can give
// it to another. A worker with Config.PeerFetch exports its cached prefixes over its KV
// connector — the exporter pins the blocks for KVTransferTimeout, fills their slots and
// answers with NixlConnector's kv_transfer_params naming them, exactly as a prefill worker
// answers a prefill leg; blocks its host or disk tier holds go through staging slots of the
// region, taking none of its GPU blocks — and, told by kv_transfer_params
// {"remote_kv_source": {"remote_host", "remote_port"}} (vLLM's p2p offloading parameter),
// asks the worker at that address for its prompt's prefix, pulls it as a decode leg pulls a prefill
// worker's blocks, checks it, stores it (announcing it in its KV events) and computes only
// the rest. Any failure (the holder gone, slow, holding less by now, a checksum) costs
// only time: the request computes what it could not fetch.

// exportJob asks the scheduler goroutine for the cached prefix of hashes, held for a peer;
// release, when set, names the held prefill leg (its kv_request_id) whose blocks the export
// takes over: its hold ends once the export holds them.
type exportJob struct {
	hashes  []uint64
	release string
	reply   chan exported
}

// exported is a prefix held for a peer: its lease (the held request's id, which the peer's
// READ notification names), block ids and content keys. Empty when nothing is cached.
type exported struct {
	lease  string
	blocks []int32
	keys   []uint64
}

// Export holds the longest prefix of hashes (kvrelay sequence hashes) that this worker caches
// for a peer to read, as a prefill worker holds a finished prefill leg's blocks: GPU blocks
// referenced, host and disk blocks through staging slots (blockManager.exportPrefix). It
// waits for the scheduler goroutine, so Run must be running.
func (e *Engine) Export(ctx context.Context, hashes []uint64, release string) (exported, error) {
	j := &exportJob{hashes: hashes, release: release, reply: make(chan exported, 1)}
	e.mu.Lock()
	e.exports = append(e.exports, j)
	e.mu.Unlock()
	e.poke()
	select {
	case x := <-j.reply:
		return x, nil
	case <-ctx.Done():
		return exported{}, fmt.Errorf("exporting KV blocks: %w", ctx.Err())
	}
}

// export runs an exportJob on the scheduler goroutine.
func (e *Engine) export(j *exportJob, now time.Time) {
	if e.kv == nil {
		j.reply <- exported{}
		return
	}
	e.events = e.events[:0]
	e.kvm.setClock(now)
	r := &Request{notify: make(chan struct{}, 1), heapIndex: -1}
	n := e.kvm.exportPrefix(r, j.hashes)
	e.emit(now) // a disk block that failed its read is gone
	if n == 0 {
		j.reply <- exported{}
		return
	}
	bs := e.cfg.BlockSize
	e.exportSeq++
	r.ID = "kvrelay-export-" + strconv.FormatUint(e.exportSeq, 16)
	r.promptLen = n * bs
	r.tokens = make([]uint32, n*bs) // only full blocks: their keys are their hashes
	r.hashes = append([]uint64(nil), j.hashes[:n]...)
	if !e.hold(r, now) {
		e.kvm.free(r)
		j.reply <- exported{}
		return
	}
	e.metrics.peerExported(n)
	if j.release != "" {
		// The prefill leg whose decoder this is: the export holds its blocks now.
		for _, h := range e.held {
			if h.kvRequestID == j.release && h != r {
				e.unhold(h, "notification")
				break
			}
		}
	}
	j.reply <- exported{lease: r.ID, blocks: r.kvHeld.blocks, keys: r.kvHeld.keys}
}

// peerFallback returns a peer-fetch request whose pull failed, or whose holder had nothing
// to give, to the head of the waiting queue, to compute its prompt from its own cache: the
// client sees only a slower answer. A failed pull counts as a fallback (a holder that did
// not answer or held nothing was counted when it was asked).
func (e *Engine) peerFallback(r *Request, pullFailed bool) {
	r.admitted = false // not counted yet: it is, as the plain request it now is
	if pullFailed {
		e.metrics.peerFetch("fallback")
	}
	e.requeue(r)
}

// requeue returns an admitted peer-fetch request to the head of the waiting queue as a
// plain request, its blocks freed (what it pulled stays cached there).
func (e *Engine) requeue(r *Request) {
	e.kvm.free(r)
	r.numComputed, r.numStored = 0, 0
	r.kvPull, r.pulled, r.peerHolder, r.peerFetch, r.peerPartial, r.prefillOf = nil, false, "", false, false, ""
	r.state = stateWaiting
	e.waiting.pushFront(r)
	e.publishLoad()
}

// askHolder, on the scheduler goroutine, asks r's holder for prompt blocks [hit, full) —
// r is admitted, its blocks allocated, and loading — then pulls what the holder gives into
// the blocks after hit; the rest of the prompt is computed. The answer comes back through
// pullDone: a pull's outcome, or no params when there is nothing to pull.
func (e *Engine) askHolder(r *Request, hit, full int) {
	bs := e.cfg.BlockSize
	hashes := append([]uint64(nil), r.hashes[hit:full]...)
	local := append([]int32(nil), r.blocks[hit:full]...)
	keys := blockKeys(make([]uint64, 0, full-hit), r.tokens[:r.promptLen], r.hashes, bs, &r.keys, hit, full)
	ctx, cancel := context.WithCancel(e.kv.ctx)
	r.pullCancel = cancel
	holder, prefillOf := r.peerHolder, r.prefillOf
	e.kv.wg.Add(1)
	go func() {
		defer e.kv.wg.Done()
		job := &pullJob{r: r, start: time.Now(), done: e.pullDone}
		p := e.kv.fetchFrom(ctx, holder, hashes, prefillOf)
		if p == nil || ctx.Err() != nil {
			e.pullDone(job)
			return
		}
		// The holder gave the leading blocks of what was asked, remote block i holding
		// asked block i.
		n := min(len(p.RemoteBlockIDs), len(hashes))
		r.peerFetch = true
		job.params, job.local, job.remote, job.keys = p, local[:n], p.RemoteBlockIDs[:n], keys[:n]
		job.modelled = e.cfg.ModelledTransfer(n)
		job.parent = ctx // an abort cancels the pull too
		e.kv.startPull(job)
	}()
}

// exportRequest is the body of POST /kvrelay/kv/export; KVRequestID, when set, names the
// prefill leg (remote_decoder's kv_request_id) whose decoder asks.
type exportRequest struct {
	BlockHashes []uint64 `json:"block_hashes"`
	KVRequestID string   `json:"kv_request_id,omitempty"`
}

// exportKV serves POST /kvrelay/kv/export on a worker with a KV connector: the cached prefix
// of the given block hashes (kvrelay's sequence hashes), held for the caller to READ, as
// {"kv_transfer_params": {...}} in NixlConnector's decode-leg form, or null when the worker
// caches none of it.
func (s *Server) exportKV(w http.ResponseWriter, hr *http.Request) {
	body, aerr := s.readBody(w, hr)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	var req exportRequest
	if err := json.Unmarshal(body, &req); err != nil {
		writeError(w, badRequest("the request body is not {\"block_hashes\": [integers]}: %v", err))
		return
	}
	if n := len(req.BlockHashes); n > s.eng.cfg.NumGPUBlocks {
		writeError(w, badRequest("%d block hashes: more than the %d blocks this engine has", n, s.eng.cfg.NumGPUBlocks))
		return
	}
	ctx, cancel := context.WithTimeout(hr.Context(), s.eng.cfg.KVTransferTimeout)
	defer cancel()
	if len(req.KVRequestID) > 1024 {
		writeError(w, badRequest("kv_request_id is longer than 1024 bytes"))
		return
	}
	x, err := s.eng.Export(ctx, req.BlockHashes, req.KVRequestID)
	if err != nil {
		writeError(w, &apiError{status: http.StatusServiceUnavailable, typ: "ServiceUnavailableError", message: err.Error()})
		return
	}
	b := []byte(`{"kv_transfer_params":`)
	switch {
	case x.lease == "":
		b = append(b, "null"...)
	case !s.kv.publish(x.blocks[:len(x.keys)], x.keys):
		s.eng.releaseHeld([]string{x.lease})
		b = append(b, "null"...)
	default:
		b = s.kv.appendParams(b, x.blocks, x.lease)
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(b, '}'))
}

// maxExportResponse bounds an export's answer.
const maxExportResponse = 8 << 20

// peerFetchTimeout bounds asking a holder for its prefix (the pull itself has
// KVTransferTimeout).
const peerFetchTimeout = 2 * time.Second

// fetchFrom asks the worker at holder for the blocks of hashes (a suffix of a prompt's
// sequence hashes: what this worker does not cache) and returns the decode-leg parameters
// that pull them, nil when there is nothing to pull (counted by outcome).
func (c *kvConnector) fetchFrom(ctx context.Context, holder string, hashes []uint64, kvRequestID string) *kvTransferParams {
	if len(hashes) == 0 {
		c.metrics.peerFetch("none")
		return nil
	}
	body, _ := json.Marshal(exportRequest{BlockHashes: hashes, KVRequestID: kvRequestID})
	ctx, cancel := context.WithTimeout(ctx, min(peerFetchTimeout, c.cfg.KVTransferTimeout))
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, holder+"/kvrelay/kv/export", bytes.NewReader(body))
	if err != nil {
		c.metrics.peerFetch("export_failed")
		return nil
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.peers.Do(req)
	if err != nil {
		c.metrics.peerFetch("export_failed")
		return nil
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxExportResponse))
	if err != nil || resp.StatusCode != http.StatusOK {
		c.metrics.peerFetch("export_failed")
		return nil
	}
	var out struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if json.Unmarshal(data, &out) != nil {
		c.metrics.peerFetch("export_failed")
		return nil
	}
	bs := c.cfg.BlockSize
	p, aerr := parseKVTransferParams(out.Params, (c.cfg.MaxModelLen+bs-1)/bs)
	if aerr != nil || p == nil || !p.DoRemotePrefill || len(p.RemoteBlockIDs) == 0 {
		c.metrics.peerFetch("none")
		return nil
	}
	return p
}
