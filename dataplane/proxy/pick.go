package proxy

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// PickRequest is one request an endpoint picker (package epp) asks the proxy to route
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
}

// PickError is a request the proxy will not route: the status, OpenAI-shaped error body and
// Retry-After (seconds, 0: none) the gateway should answer it with.
type PickError struct {
	Status     int
	Message    string
	Param      string
	Code       string
	RetryAfter int
}

func (e *PickError) Error() string {
	return "pick refused (" + strconv.Itoa(e.Status) + "): " + e.Message
}

// Body is the error as an OpenAI client expects it: {"error": {"message", "type", "param",
// "code"}}.
func (e *PickError) Body() []byte {
	return appendErrorJSON(nil, e.Status, e.Message, e.Param, e.Code)
}

// Pick is one routed request, from its decision to the end of its answer: it holds the
// request's load on the worker it names (so that later decisions see it) until Finish, and
// learns from the answer it is fed what the proxy learns from the answers it carries.
//
// A Pick is used from one goroutine at a time: the picker's stream. Finish must be called
// once the answer has passed, or the stream ended; it is safe to call more than once.
type Pick struct {
	in   input
	t    tally
	dec  route.Decision
	arm  *armSeries
	obs  oai.Observer
	itl  armITL
	mm   *modelMetrics
	body []byte // the request as it goes to the worker
	// pre is the prefill worker's share of a disaggregated request, held until its first
	// token (the decode worker has pulled the prompt's KV by then).
	pre       route.Usage
	prefiller *route.Worker
	alt       route.Request // scratch of fallback and shadow picks
	subset    bool          // the gateway's subset hint restricts the pick (rreq.Exclude)
	fwd       []byte        // scratch of body mutations
	mutated   bool          // body is not the one Pick was given

	queued   *queueItem
	woken    chan bool // the admission queue's word: true to route again, false when late
	status   int
	begun    bool // the tally holds the request on its worker
	finished bool
}

var picks = sync.Pool{New: func() any { return &Pick{woken: make(chan bool, 1)} }}

// pickSeq samples the picks whose decision stages are timed and decisions recorded, as the
// proxy samples its requests.
var pickSeq atomic.Uint64

// Pick routes r: it parses and tokenizes the request as the proxy would, matches it against
// the index, and picks the worker, waiting in the admission queue while every eligible
// worker is busy (until ctx ends, the queue timeout passes or its latency target does). A
// request that cannot be routed gets a *PickError with the answer the gateway should give.
func (s *Server) Pick(ctx context.Context, r *PickRequest) (*Pick, error) {
	p := picks.Get().(*Pick)
	p.reset(s)
	if err := p.route(ctx, r); err != nil {
		p.release()
		return nil, err
	}
	return p, nil
}

func (p *Pick) reset(s *Server) {
	in := &p.in
	in.srv, in.inline = s, true
	in.kind, in.model, in.session, in.hasPrio, in.hdrPrio, in.hdrOSL, in.sloTTFT, in.sloTPOT = 0, "", in.session[:0], false, 0, 0, 0, 0
	in.timed, in.decID = pickSeq.Add(1)%timedEvery == 1, 0
	p.t = tally{}
	p.dec, p.arm, p.mm, p.prefiller, p.queued = route.Decision{}, nil, nil, nil, nil
	p.status, p.begun, p.finished, p.subset, p.mutated = 0, false, false, false, false
	select {
	case <-p.woken:
	default:
	}
}

// release returns a finished pick to the pool.
func (p *Pick) release() {
	p.body = nil
	p.in.oreq = oai.Request{}
	picks.Put(p)
}

func pickErr(status int, msg, param, code string) *PickError {
	return &PickError{Status: status, Message: msg, Param: param, Code: code}
}

// route parses, prepares and routes r.
func (p *Pick) route(ctx context.Context, r *PickRequest) error {
	in := &p.in
	s := in.srv
	if s.draining.Load() {
		return &PickError{Status: 503, Message: "the endpoint picker is shutting down", Code: "no_worker", RetryAfter: 1}
	}
	path := r.Path
	if i := indexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	in.kind = oai.KindForPath([]byte(path))
	if in.kind == 0 {
		return pickErr(404, "no route for "+path, "", "")
	}
	h := r.Header
	in.session = append(in.session, h["x-session-id"]...)
	in.hdrPrio, in.hasPrio = atoi([]byte(h["x-kvrelay-priority"]))
	if r.HasPriority {
		in.hdrPrio, in.hasPrio = r.Priority, true
	}
	in.hdrOSL, _ = atoi([]byte(h["x-kvrelay-osl"]))
	in.sloTTFT, in.sloTPOT = millis([]byte(h["x-slo-ttft-ms"])), millis([]byte(h["x-slo-tpot-ms"]))
	arrived := nanotime()
	t0 := in.clock()
	if err := in.parser.Parse(r.Body, in.kind, &in.oreq); err != nil {
		var pe *oai.Error
		if errors.As(err, &pe) {
			return p.refuse(pickErr(pe.Status(), pe.Message, pe.Param, pe.Code))
		}
		return p.refuse(pickErr(400, err.Error(), "", ""))
	}
	in.stage(stageParse, t0)
	if len(in.oreq.Model) == 0 {
		return p.refuse(pickErr(400, "you must provide a model parameter", "model", ""))
	}
	if !s.kv.Pool().Serves(unsafeString(in.oreq.Model)) {
		return p.refuse(pickErr(404, "The model `"+string(in.oreq.Model)+"` does not exist.", "model", "model_not_found"))
	}
	if kp := in.oreq.KVTransferParams; len(kp) > 0 && string(kp) != "null" {
		s.metrics.refused.WithLabelValues("kv_transfer_params").Inc()
		return p.refuse(pickErr(400, "kv_transfer_params is set by kvrelay for its prefill and decode legs; requests may not carry it", "kv_transfer_params", ""))
	}
	in.model = s.modelLabel(in.oreq.Model)
	p.body = r.Body
	if err := in.prepare(); err != nil {
		switch {
		case errors.Is(err, errNoTokenizer):
			return p.refuse(&PickError{Status: 503, Message: err.Error(), Code: "no_worker", RetryAfter: 1})
		case errors.As(err, new(contextLengthError)):
			s.metrics.tooLong.Inc()
			param := "messages"
			if in.kind == oai.Completions {
				param = "prompt"
			}
			return p.refuse(pickErr(400, err.Error(), param, "context_length_exceeded"))
		}
		return p.refuse(pickErr(400, err.Error(), "messages", ""))
	}
	if r.HasSubset {
		p.allow(r.Subset)
	}
	for {
		err := p.decide(arrived)
		if err == nil {
			break
		}
		if !errors.Is(err, route.ErrBusy) && !errors.Is(err, route.ErrSLO) {
			return p.refuse(err)
		}
		if err := p.wait(ctx, arrived, errors.Is(err, route.ErrSLO)); err != nil {
			return p.refuse(err)
		}
	}
	p.begin(arrived, t0)
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
	in := &p.in
	in.rreq.Exclude = in.rreq.Exclude[:0]
	p.subset = true
	for _, w := range in.srv.kv.Pool().Workers {
		if !inSubset(subset, w.Addr) {
			in.rreq.Exclude = append(in.rreq.Exclude, w.Index)
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

// decide routes the prepared request once: the worker (and, in a disaggregated pool, the
// prefill worker), or why none.
func (p *Pick) decide(arrived int64) error {
	in := &p.in
	s := in.srv
	now := nanotime()
	router := s.kv
	completion := in.kind == oai.ChatCompletions || in.kind == oai.Completions
	if !completion {
		router = s.load
	}
	p.arm = nil
	if completion {
		p.arm = s.stableArm.Load()
	}
	in.rreq.Now = now
	if in.sloTTFT > 0 {
		in.rreq.SLOTTFT = in.sloTTFT/1e3 - seconds(now-arrived)
		if in.rreq.SLOTTFT <= 0 {
			return p.sloRefused()
		}
	}
	if router == s.kv && in.disaggFor(router.Pool()) {
		return p.decideDisagg()
	}
	var cand *candidate
	if router == s.kv {
		if router, cand = in.armFor(s.kv, p.body); cand != nil {
			p.arm = cand.arm
		}
	}
	err := router.Route(&in.rreq, &p.dec)
	if errors.Is(err, route.ErrNoWorker) && router == s.load && router.Pool().Disaggregated(unsafeString(in.oreq.Model)) {
		in.rreq.Role = route.RoleDecode
		err = router.Route(&in.rreq, &p.dec)
	}
	in.observeRoute(&p.dec, true)
	if err != nil {
		if errors.Is(err, route.ErrBusy) || errors.Is(err, route.ErrSLO) {
			return err
		}
		return p.noWorker()
	}
	if in.timed {
		in.decID = s.decisions.record(in, now, &p.dec, p.arm)
	}
	if cand == nil && router == s.kv {
		in.shadowPick(&p.alt, &p.dec)
	}
	return nil
}

// decideDisagg picks a decode worker by load and, KV-aware, the prefill worker whose
// address the gateway passes on (x-prefiller-host-port: the decode worker's sidecar runs
// the prefill leg there), unless the prompt is short or mostly cached on the decode worker,
// which then prefills it itself.
func (p *Pick) decideDisagg() error {
	in := &p.in
	s := in.srv
	r := &in.rreq
	r.Role = route.RoleDecode
	if err := s.load.Route(r, &p.dec); err != nil {
		if errors.Is(err, route.ErrBusy) {
			return err
		}
		return p.noWorker()
	}
	d := p.dec.Worker
	r.Role = route.RolePrefill
	var pdec route.Decision
	perr := s.kv.Route(r, &pdec)
	r.Role = route.RoleDecode
	p.dec.Overlap = r.Overlap(d)
	p.dec.BestOverlap = r.BestOverlap()
	uncached := r.PromptTokens - int(p.dec.Overlap)*max(d.BlockSize, 1)
	th := s.pdSet.Load().threshold
	if perr != nil || (th >= 0 && uncached <= th) ||
		(th >= 0 && s.cfg.DisaggMaxQueue > 0 && pdec.Worker.PrefillTokens() > s.cfg.DisaggMaxQueue) {
		s.metrics.disagg.WithLabelValues(pathLocal).Inc()
		return nil
	}
	s.metrics.disagg.WithLabelValues(pathRemote).Inc()
	p.prefiller = pdec.Worker
	p.pre.BeginAt(nanotime(), pdec.Worker, r.PromptTokens, int(pdec.Overlap)*s.cfg.BlockSize, 0)
	in.recordPlacement(pdec.Worker, int(pdec.Overlap), nanotime()) // the prefill worker caches the prompt now
	return nil
}

// noWorker is the refusal of a request no healthy worker (of the subset) serves.
func (p *Pick) noWorker() *PickError {
	in := &p.in
	msg := "no healthy worker serves model " + in.model
	if p.subset {
		msg = "no healthy worker of the gateway's endpoint subset serves model " + in.model
	}
	return &PickError{Status: 503, Message: msg, Code: "no_worker", RetryAfter: 1}
}

func (p *Pick) sloRefused() *PickError {
	s := p.in.srv
	s.metrics.queued.WithLabelValues("slo_unmet").Inc()
	return &PickError{Status: 429, Message: "no worker is predicted to meet the request's latency targets (x-slo-ttft-ms, x-slo-tpot-ms)", Code: "slo_unmet", RetryAfter: 1}
}

// wait holds the pick in the admission queue, by its priority, until capacity frees (nil:
// route again) or its deadline passes.
func (p *Pick) wait(ctx context.Context, arrived int64, slo bool) error {
	in := &p.in
	s := in.srv
	if in.prio < 0 && !slo {
		// A sheddable request (below the default priority) is not queued: the gateway
		// answers 429 and the client retries later.
		s.metrics.queued.WithLabelValues("rejected").Inc()
		return &PickError{Status: 429, Message: "every worker is busy; sheddable requests are not queued", Code: "shed", RetryAfter: retryAfterSecs(s.queue.retryAfter(nanotime()))}
	}
	if slo && (in.sloTTFT == 0 || s.cfg.QueueSize == 0) {
		return p.sloRefused()
	}
	deadline := arrived + int64(s.cfg.QueueTimeout)
	if slo {
		deadline = min(deadline, arrived+int64(in.sloTTFT*1e6))
	}
	if !s.queue.push(p, &p.queued, in.prio, deadline, slo) {
		if slo {
			return p.sloRefused()
		}
		s.metrics.queued.WithLabelValues("rejected").Inc()
		return &PickError{Status: 429, Message: "every worker is busy and the admission queue is full", Code: "queue_full", RetryAfter: retryAfterSecs(s.queue.retryAfter(nanotime()))}
	}
	select {
	case again := <-p.woken:
		if again {
			s.metrics.queued.WithLabelValues("dispatched").Inc()
			return nil
		}
		if slo {
			return p.sloRefused()
		}
		s.metrics.queued.WithLabelValues("timeout").Inc()
		return &PickError{Status: 503, Message: "no worker had capacity within the queue timeout", Code: "queue_timeout", RetryAfter: retryAfterSecs(s.queue.retryAfter(nanotime()))}
	case <-ctx.Done():
		s.queue.remove(&p.queued)
		s.metrics.queued.WithLabelValues("abandoned").Inc()
		return &PickError{Status: 499, Message: "the request went away while it waited for a worker", Code: "abandoned"}
	}
}

// wake implements waiter.
func (p *Pick) wake(*queueItem) {
	select {
	case p.woken <- true:
	default:
	}
}

// late implements waiter.
func (p *Pick) late(*queueItem) {
	select {
	case p.woken <- false:
	default:
	}
}

// retryAfterSecs reads the seconds back out of a Retry-After header line.
func retryAfterSecs(line string) int {
	v := line[len("Retry-After: "):]
	n, _ := strconv.Atoi(v[:len(v)-2])
	return n
}

// refuse counts a request refused before any worker took it and returns err.
func (p *Pick) refuse(err error) error {
	in := &p.in
	s := in.srv
	pe, ok := err.(*PickError)
	if !ok {
		pe = pickErr(500, err.Error(), "", "")
	}
	if in.kind != 0 {
		model := in.model
		if model == "" {
			model = "unknown"
		}
		s.metrics.request(model, in.kind, pe.Status)
		if a := p.arm; a != nil {
			a.observe(pe.Status, 0, false, 0, 0)
			p.arm = nil
		}
	}
	p.pre.End()
	return pe
}

// begin books the request on its worker, as the proxy does when it sends one.
func (p *Pick) begin(arrived, decideAt int64) {
	in := &p.in
	s := in.srv
	w := p.dec.Worker
	ws := s.workerState(w)
	ws.m.routedBy(p.dec.Mode).Inc()
	s.observeRegret(p.arm, &p.dec)
	if in.timed && decideAt != 0 {
		in.stage(stageTotal, decideAt)
	}
	now := nanotime()
	t := &p.t
	t.ws, t.start = ws, arrived
	p.mm = s.metrics.forModel(in.model)
	p.obs.ITL = p.mm.itl
	if p.arm != nil {
		p.itl = armITL{model: p.mm.itl, arm: p.arm}
		p.obs.ITL = &p.itl
	}
	p.obs.Reset(oai.ModeAuto, arrived)
	if in.kind == oai.ChatCompletions || in.kind == oai.Completions {
		overlap := int(p.dec.Overlap)
		t.predicted = overlap
		t.usage.BeginAt(now, w, in.rreq.PromptTokens, overlap*s.cfg.BlockSize, in.rreq.OSL)
		t.usage.Predicted(&p.dec, in.prio, in.oreq.Stream && p.dec.PeerFetch == nil)
	} else {
		t.usage.BeginAt(now, w, in.rreq.PromptTokens, 0, 0)
	}
	ws.m.inflight.Inc()
	s.inflight.Add(1)
	p.begun = true
	p.body = p.forwardBody(p.body)
}

// forwardBody is the request's body as its worker should get it: with kvrelay's peer-fetch
// parameters when the worker is to pull the prompt's prefix from another, and with the
// priority in the engine's own field when ForwardPriority asks.
func (p *Pick) forwardBody(body []byte) []byte {
	in := &p.in
	s := in.srv
	if h := p.dec.PeerFetch; h != nil && h != p.dec.Worker && p.prefiller == nil {
		p.fwd = oai.AppendWithRawField(p.fwd[:0], body, "kv_transfer_params", peerFetchParams(h.URL))
		body, p.mutated = p.fwd, true
		s.metrics.peerFetches.Inc()
	}
	if s.cfg.ForwardPriority && in.prio != 0 && (in.kind == oai.ChatCompletions || in.kind == oai.Completions) {
		// vLLM runs lower priority values first; kvrelay's hints say higher is more urgent.
		body, p.mutated = oai.AppendWithField(nil, body, "priority", -in.prio), true
	}
	return body
}

// Endpoint is the picked worker's address (ip:port).
func (p *Pick) Endpoint() string { return p.dec.Worker.Addr }

// WorkerID is the picked worker's id.
func (p *Pick) WorkerID() string { return p.dec.Worker.ID }

// Prefiller is the address of the worker that prefills a disaggregated request, "" when the
// picked worker does.
func (p *Pick) Prefiller() string {
	if p.prefiller == nil {
		return ""
	}
	return p.prefiller.Addr
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
	in := &p.in
	s := in.srv
	if n <= 0 || in.rreq.Role != route.RoleBoth {
		return dst
	}
	router := s.kv
	if in.kind != oai.ChatCompletions && in.kind != oai.Completions {
		router = s.load
	}
	in.rreq.CopyInputs(&p.alt)
	p.alt.DryRun = true
	p.alt.Exclude = append(slices.Clone(in.rreq.Exclude), p.dec.Worker.Index)
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
func (p *Pick) Explain(dst []byte) []byte {
	if ws, _ := p.in.rreq.Candidates(); len(ws) == 0 {
		return dst
	}
	return appendDecision(dst, &p.in.rreq, p.dec.Worker)
}

// Scores calls f with each candidate's address and predicted TTFT in milliseconds (lower is
// better), under a policy that predicts; nothing otherwise.
func (p *Pick) Scores(f func(endpoint string, ttftMs float64)) {
	ws, preds := p.in.rreq.Candidates()
	for i, w := range ws {
		f(w.Addr, preds[i].TTFT*1e3)
	}
}

// Served is the gateway's word on which endpoint served the request: when it is not the
// picked one (the gateway fell back down the list), the request's load moves there.
func (p *Pick) Served(endpoint string) {
	if !p.begun || p.finished || endpoint == "" || endpoint == p.dec.Worker.Addr {
		return
	}
	in := &p.in
	s := in.srv
	var w *route.Worker
	for _, c := range s.kv.Pool().Workers {
		if c.Addr == endpoint {
			w = c
			break
		}
	}
	if w == nil {
		return
	}
	s.metrics.pickFallbacks.Inc()
	t := &p.t
	t.ws.m.inflight.Dec()
	t.usage.End()
	p.dec.Worker, p.dec.HasPrediction = w, false
	p.dec.Overlap = in.rreq.Overlap(w)
	t.ws, t.predicted = s.workerState(w), int(p.dec.Overlap)
	t.usage.BeginAt(nanotime(), w, in.rreq.PromptTokens, int(p.dec.Overlap)*s.cfg.BlockSize, in.rreq.OSL)
	t.usage.Predicted(&p.dec, in.prio, false)
	t.ws.m.inflight.Inc()
}

// Response notes the answer's status, as its headers came. A 5xx counts against the worker
// as the proxy counts one (EjectAfter in a row eject it for EjectFor).
func (p *Pick) Response(status int) {
	p.status = status
	if status >= 500 && p.begun {
		s := p.in.srv
		ws := p.t.ws
		if ws.w.Failed(nanotime(), s.cfg.EjectAfter, s.cfg.EjectFor) {
			ws.m.ejections.Inc()
			s.log.Warn("worker ejected after consecutive failures", "worker", ws.w.ID, "for", s.cfg.EjectFor)
		}
	}
}

// ResponseBody feeds the next piece of the answer: its first content chunk ends the
// request's prefill (the worker's model learns its TTFT), usage tells what the engine
// cached.
func (p *Pick) ResponseBody(data []byte) {
	if !p.begun || p.finished {
		return
	}
	now := nanotime()
	first := p.obs.Result().Chunks == 0
	p.t.feed(&p.in, &p.obs, data, now)
	if first && p.obs.Result().Chunks > 0 {
		p.pre.End()
	}
}

// Finish ends the request: its load leaves its worker and its figures are recorded. A pick
// whose answer never came (the stream ended first) counts as status 499.
func (p *Pick) Finish() {
	if p.finished {
		return
	}
	p.finished = true
	in := &p.in
	s := in.srv
	if p.begun {
		status := p.status
		if status == 0 {
			status = 499
		} else if status == 200 {
			p.t.ws.w.Succeeded()
			p.t.recordCached(in, nanotime()) // an answer without content chunks ends its prefill here
		}
		p.t.settle(in, p.arm, p.mm, p.obs.Result(), status, nanotime())
		p.arm = nil
		s.inflight.Add(-1)
	}
	p.pre.End()
	s.queue.release(s)
	p.release()
}

// Draining reports whether the picker is shutting down (Drain): new picks are refused.
func (s *Server) Draining() bool { return s.draining.Load() }

var _ waiter = (*Pick)(nil)

// PickAny picks the least loaded healthy worker for a request without a body (nothing to
// route on), among subset when hasSubset (entries as Pick's subset hint takes them).
func (s *Server) PickAny(subset []string, hasSubset bool) (string, error) {
	now := nanotime()
	var best *route.Worker
	for _, w := range s.kv.Pool().Workers {
		if !w.Healthy(now) || w.Role == route.RolePrefill || (hasSubset && !inSubset(subset, w.Addr)) {
			continue
		}
		if best == nil || w.Load() < best.Load() {
			best = w
		}
	}
	if best == nil {
		msg := "no healthy worker"
		if hasSubset {
			msg = "no healthy worker in the gateway's endpoint subset"
		}
		return "", &PickError{Status: 503, Message: msg, Code: "no_worker", RetryAfter: 1}
	}
	return best.Addr, nil
}

// Ready reports whether the proxy can pick: it has workers and, under a control plane, the
// control plane's state has arrived.
func (s *Server) Ready() bool {
	if s.kv == nil || s.draining.Load() {
		return false
	}
	if x := s.xds; x != nil {
		select {
		case <-x.ads.Synced():
		default:
			return false
		}
	}
	return len(s.kv.Pool().Workers) > 0
}
