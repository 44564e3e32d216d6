package decide

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// PickRequest is one request an endpoint picker (package epp) asks the core to route
// without carrying it: a gateway (Envoy's ext_proc filter, say) sends it to the endpoint the
// pick names and lets the answer pass through the picker, which feeds it to the pick.
type PickRequest struct {
	// Path is the request's path (:path): /v1/chat/completions, /v1/completions,
	// /v1/embeddings, /v1/responses, possibly with a query.
	Path string
	// Header holds the request's headers by lower-case name: x-session-id,
	// x-kvrelay-priority, x-kvrelay-osl, x-slo-ttft-ms and x-slo-tpot-ms are read as the
	// proxy reads them.
	Header map[string]string
	// Body is the whole request body; the pick keeps it until Finish.
	Body []byte
	// Subset, when HasSubset, lists the only endpoints (ip:port) the pick may name: the
	// gateway's subset hint. An empty one allows none.
	Subset    []string
	HasSubset bool
	// Priority, when HasPriority, is the request's priority (higher is more urgent; an
	// inference objective's), over what its body and headers say.
	Priority    int
	HasPriority bool
	// StreamedResponse says the gateway passes the answer to the pick piece by piece as
	// the engine sends it (Envoy's FULL_DUPLEX_STREAMED response body mode): only then do
	// the pieces' times say when its tokens came. An answer the gateway buffers (BUFFERED,
	// or a gateway that does not say) arrives whole, and the pick learns nothing of the
	// engine's latency from it and records no TTFT or inter-token gap (Request.Untimed).
	StreamedResponse bool
}

// Pick is one request decided without being carried, from its decision to the end of its
// answer: a Request the gateway carries. It holds the request's load on the worker it names
// (so that later decisions see it) until Finish, and learns from the answer it is fed what
// the proxy learns from the answers it carries.
//
// A Pick is used from one goroutine at a time: the picker's stream, which Pick blocks while
// the request waits for a worker. Finish must be called exactly once, when the answer has
// passed or the stream ended: it returns the Pick to a pool, and the Pick must not be used
// after it (a second Finish could end another request's pick).
type Pick struct {
	r    Request
	body []byte        // the request as it goes to the worker
	alt  route.Request // scratch of fallback and shadow picks
	// subset: the gateway's subset hint restricts the pick (the route.Request's Exclude).
	subset  bool
	fwd     []byte // scratch of body mutations
	mutated bool   // body is not the one Pick was given

	woken    chan bool // the admission queue's word: true to decide again, false when late
	status   int
	begun    bool // the request is dispatched on its worker
	finished bool
}

var picks = sync.Pool{New: func() any { return &Pick{woken: make(chan bool, 1)} }}

// Pick routes r: it parses and tokenizes the request as the proxy would, matches it against
// the index, and picks the worker, waiting in the admission queue while every eligible
// worker is busy (until ctx ends, the queue timeout passes or its latency target does). A
// request that cannot be routed gets a *Refusal with the answer the gateway should give.
func (c *Core) Pick(ctx context.Context, r *PickRequest) (*Pick, error) {
	p := picks.Get().(*Pick)
	p.reset(c)
	if err := p.route(ctx, r); err != nil {
		p.release()
		return nil, err
	}
	return p, nil
}

func (p *Pick) reset(c *Core) {
	p.r.Init(c, &p.alt, false)
	p.status, p.begun, p.finished, p.subset, p.mutated = 0, false, false, false, false
	select {
	case <-p.woken:
	default:
	}
}

// release returns a finished pick to the pool.
func (p *Pick) release() {
	p.body = nil
	p.r.Release()
	picks.Put(p)
}

// route parses, prepares and decides r.
func (p *Pick) route(ctx context.Context, pr *PickRequest) error {
	r := &p.r
	c := r.c
	if c.Draining() {
		return &Refusal{Status: 503, Message: "the endpoint picker is shutting down", Code: "no_worker", RetryAfter: 1}
	}
	path := pr.Path
	if i := indexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	kind := oai.KindForPath(unsafeBytes(path))
	if kind == 0 {
		return refusal(404, "no route for "+path, "", "")
	}
	r.Start(kind, nanotime(), c.picks.Add(1)%SampleEvery == 1)
	if !pr.StreamedResponse {
		r.Untimed()
	}
	h := pr.Header
	r.SetHints(unsafeBytes(h["x-session-id"]), unsafeBytes(h["x-kvrelay-priority"]), unsafeBytes(h["x-kvrelay-osl"]),
		unsafeBytes(h["x-slo-ttft-ms"]), unsafeBytes(h["x-slo-tpot-ms"]))
	if pr.HasPriority {
		r.SetPriority(pr.Priority)
	}
	p.body = pr.Body
	err := r.Parse(pr.Body)
	if err == nil {
		err = r.Validate()
	}
	if err == nil {
		err = r.Prepare()
	}
	for errors.Is(err, ErrRemote) || errors.Is(err, ErrLarge) || errors.Is(err, ErrIndex) {
		// A pick has its stream's goroutine to itself: the work is done in place.
		r.Work()
		err = r.Resume()
	}
	if err != nil {
		return p.refuse(err)
	}
	if pr.HasSubset {
		p.allow(pr.Subset)
	}
	for {
		err := r.Decide(nanotime(), false)
		if err == nil {
			break
		}
		slo := errors.Is(err, route.ErrSLO)
		switch {
		case errors.Is(err, route.ErrBusy) || slo:
			err = p.wait(ctx, slo)
		case errors.Is(err, route.ErrNoWorker):
			err = p.noWorker()
		}
		if err != nil {
			return p.refuse(err)
		}
	}
	p.begin()
	return nil
}

func indexByte(s string, c byte) int {
	for i := 0; i < len(s); i++ {
		if s[i] == c {
			return i
		}
	}
	return -1
}

// allow restricts the pick to the subset's endpoints: an entry ip:port names the worker at
// that address, an entry without a port every worker on that host.
func (p *Pick) allow(subset []string) {
	rr := &p.r.rreq
	rr.Exclude = rr.Exclude[:0]
	p.subset = true
	for _, w := range p.r.c.kv.Pool().Workers {
		if !inSubset(subset, w.Addr) {
			rr.Exclude = append(rr.Exclude, w.Index)
		}
	}
}

func inSubset(subset []string, addr string) bool {
	host := addr
	if i := lastIndexByte(addr, ':'); i >= 0 {
		host = addr[:i]
	}
	for _, e := range subset {
		if e == addr || e == host {
			return true
		}
	}
	return false
}

func lastIndexByte(s string, c byte) int {
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == c {
			return i
		}
	}
	return -1
}

// noWorker is the refusal of a request no healthy worker (of the subset) serves.
func (p *Pick) noWorker() *Refusal {
	what := "worker"
	if p.subset {
		what = "worker of the gateway's endpoint subset"
	}
	return p.r.NoWorker(what, nanotime())
}

// wait holds the pick in the admission queue, by its priority, until capacity frees (nil:
// decide again) or its deadline passes. A sheddable request (below the default priority)
// is not queued: the gateway answers 429 and the client retries later.
func (p *Pick) wait(ctx context.Context, slo bool) error {
	r := &p.r
	if r.prio < 0 && !slo {
		return r.Shed(nanotime())
	}
	if err := r.Enqueue(p, nanotime(), slo); err != nil {
		return err
	}
	select {
	case again := <-p.woken:
		if again {
			r.Woken()
			return nil
		}
		return r.Late(nanotime())
	case <-ctx.Done():
		r.Abandon()
		return &Refusal{Status: 499, Message: "the request went away while it waited for a worker", Code: "abandoned"}
	}
}

// Wake implements Waiter.
func (p *Pick) Wake(*QueueItem) {
	select {
	case p.woken <- true:
	default:
	}
}

// Late implements Waiter.
func (p *Pick) Late(*QueueItem) {
	select {
	case p.woken <- false:
	default:
	}
}

// refuse counts a request refused before any worker took it and returns err.
func (p *Pick) refuse(err error) error {
	pe, ok := err.(*Refusal)
	if !ok {
		pe = refusal(500, err.Error(), "", "")
	}
	p.r.Refused(pe.Status)
	return pe
}

// begin books the request on its worker, as the proxy does when it sends one.
func (p *Pick) begin() {
	r := &p.r
	r.Dispatch(nanotime(), true)
	r.Answer(r.arrived)
	r.c.Enter()
	p.begun = true
	p.body = p.forwardBody(p.body)
}

// forwardBody is the request's body as its worker should get it: with kvrelay's peer-fetch
// parameters when the worker is to pull the prompt's prefix from another, and with the
// priority in the engine's own field when ForwardPriority asks.
func (p *Pick) forwardBody(body []byte) []byte {
	r := &p.r
	c := r.c
	if h := r.dec.PeerFetch; h != nil && h != r.dec.Worker && r.pd.prefill == nil {
		p.fwd = oai.AppendWithRawField(p.fwd[:0], body, "kv_transfer_params", PeerFetchParams(h.P2PAddr()))
		body, p.mutated = p.fwd, true
		c.PeerFetch()
	} else if r.dec.Recompute && r.pd.prefill == nil {
		p.fwd = oai.AppendWithRawField(p.fwd[:0], body, "kv_transfer_params", RecomputeParams)
		body, p.mutated = p.fwd, true
		c.Recompute()
	}
	if c.cfg.ForwardPriority && r.prio != 0 && (r.kind == oai.ChatCompletions || r.kind == oai.Completions) {
		// vLLM runs lower priority values first; kvrelay's hints say higher is more urgent.
		body, p.mutated = oai.AppendWithField(nil, body, "priority", -r.prio), true
	}
	return body
}

// Endpoint is the picked worker's address (ip:port).
func (p *Pick) Endpoint() string { return p.r.dec.Worker.Addr }

// WorkerID is the picked worker's id.
func (p *Pick) WorkerID() string { return p.r.dec.Worker.ID }

// Prefiller is the address of the worker that prefills a disaggregated request, "" when the
// picked worker does.
func (p *Pick) Prefiller() string {
	if w := p.r.pd.prefill; w != nil {
		return w.Addr
	}
	return ""
}

// Body is the request's body as the picked worker should get it: the one Pick was given,
// unless kvrelay set fields for the worker (Mutated reports that).
func (p *Pick) Body() []byte { return p.body }

// Mutated reports whether Body differs from the body Pick was given.
func (p *Pick) Mutated() bool { return p.mutated }

// Fallbacks appends to dst the addresses of up to n other workers the gateway may try, in
// order, should the picked one fail to connect: each the best pick with the ones before it
// excluded (routed without leaving a trace in the router).
func (p *Pick) Fallbacks(dst []string, n int) []string {
	r := &p.r
	c := r.c
	if n <= 0 || r.rreq.Role != route.RoleBoth {
		return dst
	}
	router := c.kv
	if r.kind != oai.ChatCompletions && r.kind != oai.Completions {
		router = c.load
	}
	r.rreq.CopyInputs(&p.alt)
	p.alt.DryRun = true
	p.alt.Exclude = append(slices.Clone(r.rreq.Exclude), r.dec.Worker.Index)
	var d route.Decision
	for range n {
		if router.Route(&p.alt, &d) != nil {
			break
		}
		dst = append(dst, d.Worker.Addr)
		p.alt.Exclude = append(p.alt.Exclude, d.Worker.Index)
	}
	return dst
}

// Explain appends the decision's candidates with their predicted TTFT, queue and prefill in
// milliseconds and cached blocks, chosen first, as the proxy's x-kvrelay-decision header
// carries them; nothing under a policy that predicts nothing.
func (p *Pick) Explain(dst []byte) []byte { return p.r.AppendExplain(dst) }

// Scores calls f with each candidate's address and predicted TTFT in milliseconds (lower is
// better), under a policy that predicts; nothing otherwise.
func (p *Pick) Scores(f func(endpoint string, ttftMs float64)) {
	ws, preds := p.r.rreq.Candidates()
	for i, w := range ws {
		f(w.Addr, preds[i].TTFT*1e3)
	}
}

// Served is the gateway's word on which endpoint served the request: when it is not the
// picked one (the gateway fell back down the list), the request's load moves there.
func (p *Pick) Served(endpoint string) {
	r := &p.r
	if !p.begun || p.finished || endpoint == "" || endpoint == r.dec.Worker.Addr {
		return
	}
	c := r.c
	var w *route.Worker
	for _, cw := range c.kv.Pool().Workers {
		if cw.Addr == endpoint {
			w = cw
			break
		}
	}
	if w == nil {
		return
	}
	c.m.pickFallbacks.Inc()
	t := &r.t
	t.ws.m.inflight.Dec()
	t.usage.End()
	r.dec.Worker, r.dec.HasPrediction = w, false
	r.dec.Overlap = r.rreq.Overlap(w)
	t.ws, t.predicted = c.workerState(w), int(r.dec.Overlap)
	t.usage.BeginAt(nanotime(), w, r.rreq.PromptTokens, int(r.dec.Overlap)*c.cfg.BlockSize, r.rreq.OSL)
	t.usage.Predicted(&r.dec, r.prio, false)
	t.ws.m.inflight.Inc()
}

// Response notes the answer's status, as its headers came. A 5xx counts against the worker
// as the proxy counts one (EjectAfter in a row eject it for EjectFor).
func (p *Pick) Response(status int) {
	p.status = status
	if status >= 500 && p.begun {
		c := p.r.c
		c.Blame(p.r.t.ws.W, nanotime(), c.cfg.EjectAfter, "worker ejected after consecutive failures")
	}
}

// ResponseBody feeds the next piece of the answer: its first content chunk ends the
// request's prefill (the worker's model learns its TTFT), usage tells what the engine
// cached.
func (p *Pick) ResponseBody(data []byte) {
	if !p.begun || p.finished {
		return
	}
	p.r.Feed(data, nanotime())
}

// Finish ends the request: its load leaves its worker and its figures are recorded. A pick
// whose answer never came (the stream ended first) counts as status 499.
func (p *Pick) Finish() {
	if p.finished {
		return
	}
	p.finished = true
	r := &p.r
	c := r.c
	if p.begun {
		status := p.status
		if status == 0 {
			status = 499
		} else if status == 200 {
			r.t.ws.W.Succeeded()
			r.RecordCached(nanotime()) // an answer without content chunks ends its prefill here
		}
		r.Settle(status, nanotime())
		c.Leave()
	} else {
		r.ReleasePrefill()
		c.queue.release()
	}
	p.release()
}

var _ Waiter = (*Pick)(nil)
