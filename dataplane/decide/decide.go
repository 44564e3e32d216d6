package decide

import (
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"net"
	"strconv"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// Paths of a disaggregated request (kvrelay_proxy_disagg_requests_total{path}).
const (
	pathLocal    = "local"    // prefilled on the decode worker: short uncached part, or prefill pool busy
	pathRemote   = "remote"   // prefilled on a prefill worker, KV pulled by the decode worker
	pathFallback = "fallback" // the prefill leg failed; prefilled on the decode worker
)

// Decide decides where the prepared request goes now: the router of its route (by prompt
// for chat and text completions, by load for the rest), with a rollout's candidate policy
// for its share of the requests, within what is left of its TTFT target, across prefill
// and decode pools when its model's pool is disaggregated, and with the candidate's pick
// recorded beside the stable one in shadow. retry is true when an earlier attempt failed
// before its answer began (the failed workers are left out, see Withdraw).
//
// It returns nil (Decision names the worker; PrefillWorker a disaggregated request's
// prefill worker, if any), route.ErrBusy (every eligible worker is busy: Enqueue),
// route.ErrSLO (none is predicted to meet its latency targets: Enqueue with slo),
// route.ErrNoWorker (no healthy worker serves it), or a *Refusal (its TTFT target has
// passed).
func (r *Request) Decide(now int64, retry bool) error {
	c := r.c
	rr := &r.rreq
	completion := r.kind == oai.ChatCompletions || r.kind == oai.Completions
	router := c.kv
	r.arm = nil
	if completion {
		r.arm = c.stableArm.Load()
	} else {
		router = c.load
	}
	disagg := completion && (r.pd.on || r.disaggFor(router.Pool()))
	// During a rollout the candidate policy routes its share of the requests.
	var cand *candidate
	if completion && !disagg {
		if router, cand = r.armFor(c.kv); cand != nil {
			r.arm = cand.arm
		}
	}
	// Decide at this attempt's time: a request may be decided again well after it was
	// parsed (released from the admission queue, retried after a failure, tokenized
	// remotely, prefilled).
	rr.Now = now
	if r.sloTTFT > 0 && !r.pd.prefilled {
		// What is left of the TTFT target after the time already spent.
		rr.SLOTTFT = r.sloTTFT/1e3 - seconds(now-r.arrived)
		if rr.SLOTTFT <= 0 {
			return r.sloUnmet(now)
		}
	}
	if disagg {
		return r.decideDisagg(now, retry)
	}
	rr.Headroom = r.headroom(router.Pool())
	if !retry && r.qitem == nil && r.flow != "" && !r.charged && c.queue.n.Load() > 0 {
		// Requests of flows wait in the admission queue: one new to it takes a slot ahead of
		// them only when it would go first anyway (its tenant, then its flow, served least),
		// and that counts as their service; else the queue's fair order would hold only for
		// the slots arrivals leave. A tenant below its share goes anyway: the headroom the
		// others leave free is its.
		under := c.keepsHeadroom() && r.tenant != "" && rr.Headroom == 0
		if !c.queue.admitDirect(r.queueFlow(), under) {
			r.countRunning(-1)
			return route.ErrBusy
		}
		r.charged = true
	}
	err := router.Route(rr, &r.dec)
	if errors.Is(err, route.ErrNoWorker) && router == c.load && !retry && router.Pool().Disaggregated(unsafeString(r.oreq.Model)) {
		// Embeddings and responses in a disaggregated pool go to the decode workers.
		rr.Role = route.RoleDecode
		err = router.Route(rr, &r.dec)
	}
	if err != nil {
		r.countRunning(-1) // not running after all
	}
	r.observeRoute(!retry)
	if r.timed && !retry && r.decideAt != 0 {
		r.stage(stageTotal, r.decideAt)
		r.decideAt = 0
	}
	if err != nil {
		return err
	}
	if r.timed {
		r.decID = c.decisions.record(r, now, &r.dec, r.arm)
	}
	if cand == nil && router == c.kv && !retry {
		r.shadowPick()
	}
	return nil
}

// disaggFor reports whether r goes through the disaggregated path.
func (r *Request) disaggFor(pool *route.Pool) bool {
	return r.c.pdSet.Load().mode != DisaggOff && pool.Disaggregated(unsafeString(r.oreq.Model))
}

// decideDisagg decides a request of a disaggregated pool: a decode worker by load, a
// prefill worker KV-aware, and the choice between prefilling there and on the decode
// worker, which prefills itself when the prompt's part it does not cache is short, when no
// prefill worker can take it, or when the one that could is saturated. A retry (the decode
// leg failed before its answer began), and a request whose prefill leg failed, prefill on
// the decode worker; one whose prefill leg succeeded goes to a decode worker, which pulls
// the prompt's KV.
func (r *Request) decideDisagg(now int64, retry bool) error {
	c := r.c
	pd := &r.pd
	rr := &r.rreq
	pd.on = true
	if retry {
		pd.prefilled = false // the decode leg failed: the next decode worker prefills itself
	}
	pd.prefill, pd.source = nil, nil
	rr.Role = route.RoleDecode
	if err := c.load.Route(rr, &r.dec); err != nil {
		return err
	}
	d := r.dec.Worker
	switch {
	case retry || pd.fallback:
		c.m.disagg.WithLabelValues(pathFallback).Inc()
		return nil
	case pd.prefilled:
		// The decode worker holds the prompt's blocks once it has pulled them.
		r.dec.Overlap = float64(len(rr.Hashes))
		c.m.disagg.WithLabelValues(pathRemote).Inc()
		return nil
	}
	// The prefill pool, KV-aware; its match also tells what the decode worker caches.
	rr.Role = route.RolePrefill
	var pdec route.Decision
	perr := c.kv.Route(rr, &pdec)
	rr.Role = route.RoleDecode
	r.dec.Overlap = rr.Overlap(d)
	r.dec.BestOverlap = rr.BestOverlap()
	uncached := rr.PromptTokens - int(r.dec.Overlap)*max(d.BlockSize, 1)
	th := c.pdSet.Load().threshold
	// Conditional: with a threshold, a saturated prefill pool (its least costly worker
	// already has more than DisaggMaxQueue tokens to prefill) leaves the decode worker to
	// prefill itself.
	if perr != nil || (th >= 0 && uncached <= th) ||
		(th >= 0 && c.cfg.DisaggMaxQueue > 0 && pdec.Worker.PrefillTokens() > c.cfg.DisaggMaxQueue) {
		c.m.disagg.WithLabelValues(pathLocal).Inc()
		return nil
	}
	pd.prefill, pd.overlap = pdec.Worker, int(pdec.Overlap)
	if h := pdec.PeerFetch; h != nil && h != pdec.Worker {
		pd.source = h
	}
	if !r.legs {
		// The decode worker's side runs the prefill leg now.
		c.m.disagg.WithLabelValues(pathRemote).Inc()
		r.HoldPrefill(now)
	}
	return nil
}

// HoldPrefill books the prefill leg on the prefill worker Decide chose, at now: its load
// there until the leg ends (PrefillDone) or the answer's first token, and the prompt's
// blocks in the core's index, which the prefill worker caches from now.
func (r *Request) HoldPrefill(now int64) {
	pd := &r.pd
	p := pd.prefill
	r.recordPlacement(p, pd.overlap, now)
	pd.pre.BeginAt(now, p, r.rreq.PromptTokens, pd.overlap*r.c.cfg.BlockSize, 0)
}

// PrefillDone ends a prefill leg the carrier sent: ok, the decode worker Decide picks next
// pulls the prompt's KV; not ok, it prefills the prompt itself.
func (r *Request) PrefillDone(ok bool) {
	r.pd.pre.End()
	r.pd.prefilled, r.pd.fallback = ok, !ok
	r.pd.prefill, r.pd.source = nil, nil
}

// ReleasePrefill ends a prefill leg's hold without an outcome (its client left).
func (r *Request) ReleasePrefill() { r.pd.pre.End() }

// observeRoute records a routing attempt's match and (timed) score stages and, for a first
// attempt (first), whether a pinned request got its worker.
func (r *Request) observeRoute(first bool) {
	m := r.c.m
	d := &r.dec
	if d.Match > 0 {
		m.stages[stageMatch].Observe(d.Match.Seconds())
	}
	if r.timed {
		m.stages[stageScore].Observe(d.Score.Seconds())
	}
	if r.rreq.Pin != "" && first {
		if r.rreq.Pinned {
			m.affinity.WithLabelValues("pinned").Inc()
		} else {
			m.affinity.WithLabelValues("fallback").Inc()
		}
	}
}

// NoWorker is the refusal of a request no healthy worker (named by what: "worker", "decode
// worker", a pick's "worker of the gateway's endpoint subset") serves.
func (r *Request) NoWorker(what string, now int64) *Refusal {
	return &Refusal{Status: 503, Message: "no healthy " + what + " serves model " + r.model, Code: "no_worker",
		RetryAfter: r.c.retryAfterNoWorker(unsafeString(r.oreq.Model), now)}
}

// RecomputeParams is the kv_transfer_params telling a worker to compute the prompt blocks it
// caches below GPU memory rather than load them back (the decision's Recompute): vLLM's
// max_load_tokens 0.
var RecomputeParams = []byte(`{"max_load_tokens":0}`)

// PeerFetchParams is the kv_transfer_params telling a worker to pull the prompt's prefix
// from the worker at addr (host:port; the decision's PeerFetch), in vLLM's p2p offloading
// form, {"remote_kv_source": {"kv_request_id", "remote_host", "remote_port"}}, with a new
// request id: what a carrier puts in the body it sends that worker.
func PeerFetchParams(addr string) []byte {
	return PeerSourceParams("remote_kv_source", NewKVRequestID(), addr)
}

// PeerSourceParams is kv_transfer_params naming the worker at addr (host:port; port 80 when
// it has none that parses) as the one to pull KV blocks from, in the form of vLLM's p2p
// offloading tier: {key: {"kv_request_id": id, "remote_host", "remote_port"}}, key
// remote_kv_source (a peer's cached prefix) or remote_prefiller (a decode leg's prefill
// worker, id naming its prefill leg). id must need no JSON escaping (NewKVRequestID's).
func PeerSourceParams(key, id, addr string) []byte {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		host, port = addr, "80"
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		port = "80"
	}
	h, _ := json.Marshal(host)
	b := append(append(append([]byte(`{"`), key...), `":{"kv_request_id":"`...), id...)
	b = append(append(append(b, `","remote_host":`...), h...), `,"remote_port":`...)
	return append(append(b, port...), "}}"...)
}

// NewKVRequestID names a KV transfer the carrier asks for: "kvrelay-" and 16 random hex
// digits.
func NewKVRequestID() string {
	var id [8]byte
	binary.LittleEndian.PutUint64(id[:], rand.Uint64())
	return "kvrelay-" + hex.EncodeToString(id[:])
}
