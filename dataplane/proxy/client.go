package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/url"
	"slices"
	"strconv"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/panjf2000/gnet/v2"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/http1"
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/dataplane/tenant"
)

// Client connection states.
const (
	stIdle     uint8 = iota // waiting for (the rest of) a request head
	stBody                  // head parsed, waiting for the body
	stQueued                // waiting in the admission queue
	stForward               // an exchange with an engine is in progress
	stTokenize              // waiting for a remote tokenizer or a large prompt's tokenization
	stPrefill               // waiting for the prefill leg of a disaggregated request
	stClosing               // answered with an error; closing
)

// clientConn is one client connection and, reused across its requests, everything one
// request needs: parsing state, the parsed request, routing scratch space and the exchange
// with the engine. It lives on its loop's goroutine; nothing in it is shared.
type clientConn struct {
	// in is the request the connection carries, as the routing core decides it (package
	// decide): its routing input, decision, wait for a worker and tally on its worker.
	in         decide.Request
	srv        *Server
	c          gnet.Conn
	lp         *loop
	next, prev *clientConn

	state      uint8
	lastActive int64
	readStart  int64

	// fetchBody is the body of a request whose worker pulls its prefix from a peer.
	fetchBody []byte

	// Parsing.
	req     http1.Request
	headLen int
	bodyOff int
	// streamed is set for a request whose head was copied to headBuf (req aliases it) and
	// taken out of the inbound buffer, so that its body moves into body as it arrives: the
	// inbound buffer then never holds more than one read, where keeping a large body there
	// until it was whole made every read copy all of it again.
	streamed bool
	headBuf  []byte
	sent100  bool
	chunked  http1.ChunkedDecoder
	body     []byte

	// What the request head said, copied before the head's bytes are discarded (the
	// routing hints among it are in's).
	method    []byte
	target    []byte
	path      []byte
	keepAlive bool
	proto10   bool
	fwd       []byte // forwarded header lines
	// auth is the request's Authorization value, when the proxy checks API keys; tenant the
	// tenant its key names, tm the tenant's series once it is admitted, and resv what the
	// request took of the tenant's budgets.
	auth   []byte
	tenant *tenant.Tenant
	tm     *tenantMetrics
	// fairness is the request's x-llm-d-inference-fairness-id: its flow in the admission
	// queue (one of its tenant's, with API keys).
	fairness []byte
	resv     tenant.Reservation
	// headScanned is how much of a head still arriving was searched for its end.
	headScanned int
	noMigrate   bool // x-kvrelay-migrate: off
	// queuedAt is when the request last went into the admission queue; waited the time it
	// has spent there so far (its tenant's queue time, at its dispatch).
	queuedAt, waited int64

	gone atomic.Bool // the client closed: its off-loop work is dropped

	ex   exchange
	pd   pdState
	spec specState

	// A connection answered with an error while the client is still sending (a body over the
	// limit) reads and drops what comes until lingerLeft bytes or lingerUntil, so the client
	// reads the answer instead of a reset.
	lingerLeft  int64
	lingerUntil int64
}

// streamBodyBytes is the Content-Length from which a body moves out of the inbound buffer
// as it arrives (clientConn.streamed); smaller bodies are copied once, whole.
const streamBodyBytes = 64 << 10

// lingerFor bounds how long a connection drains a refused body before closing.
const lingerFor = 5e9

// traffic handles bytes from the client: it frames requests and handles them one at a time
// (responses go out in request order; pipelined requests wait in the inbound buffer).
func (cc *clientConn) traffic() gnet.Action {
	now := cc.lp.now
	cc.lastActive = now
	for {
		switch cc.state {
		case stIdle, stBody:
		case stClosing:
			n, _ := cc.c.Discard(-1)
			if cc.lingerUntil != 0 {
				cc.lingerLeft -= int64(n)
				if cc.lingerLeft <= 0 {
					_ = cc.c.Close()
				}
			}
			return gnet.None
		default:
			// Busy with a request: later bytes wait, within the limits of one request.
			if cc.c.InboundBuffered() > cc.srv.cfg.MaxHeaderBytes+int(cc.srv.cfg.MaxBodyBytes) {
				return gnet.Close
			}
			return gnet.None
		}
		buf, _ := cc.c.Peek(-1)
		if len(buf) == 0 {
			return gnet.None
		}
		parsed := false
		if cc.state == stIdle {
			if cc.readStart == 0 {
				cc.readStart = now
			}
			// A head sent a few bytes at a time is parsed once it is whole (or too large),
			// not again from its start at every read: only the new bytes are searched for
			// its end.
			if len(buf) < cc.srv.cfg.MaxHeaderBytes && !headEnded(buf, cc.headScanned) {
				cc.headScanned = len(buf)
				return gnet.None
			}
			n, err := http1.ParseRequest(buf, &cc.req, cc.srv.limits)
			if err != nil {
				cc.protoError(err)
				return gnet.None
			}
			if n == 0 {
				cc.headScanned = len(buf)
				return gnet.None
			}
			cc.headScanned = 0
			cc.headLen, cc.bodyOff, cc.body = n, n, cc.body[:0]
			cc.sent100 = false
			cc.chunked.Reset(cc.srv.limits)
			cc.state = stBody
			parsed = true
			cc.streamed = cc.req.Body == http1.BodyChunked || cc.req.Body == http1.BodyLength && cc.req.ContentLength >= streamBodyBytes
			if cc.streamed {
				cc.headBuf = append(cc.headBuf[:0], buf[:n]...)
				if _, err := http1.ParseRequest(cc.headBuf, &cc.req, cc.srv.limits); err != nil {
					cc.protoError(err)
					return gnet.None
				}
				if cc.req.Body == http1.BodyLength {
					// Room for what has come, not for what the head claims: a few bytes of
					// head must not reserve the whole body before it arrives.
					cc.body = slices.Grow(cc.body, min(int(cc.req.ContentLength), max(len(buf)-n, 0)+streamBodyBytes))
				}
				cc.discard(n)
				cc.headLen, cc.bodyOff = 0, 0
				if buf, _ = cc.c.Peek(-1); len(buf) == 0 {
					cc.continue100()
					return gnet.None
				}
			}
		}
		// The head's slices alias the buffer of the read that parsed it: parsed again to
		// re-alias this Peek, but only once the body is whole (a body sent a byte at a time
		// does not parse the head at every read).
		reparse := func() bool {
			if parsed || cc.streamed {
				return true
			}
			if _, err := http1.ParseRequest(buf, &cc.req, cc.srv.limits); err != nil {
				cc.protoError(err)
				return false
			}
			return true
		}
		consumed := 0
		switch cc.req.Body {
		case http1.BodyNone:
			if !reparse() {
				return gnet.None
			}
			consumed = cc.headLen
		case http1.BodyLength:
			if cc.streamed {
				take := min(int(cc.req.ContentLength)-len(cc.body), len(buf))
				cc.body = append(cc.body, buf[:take]...)
				cc.discard(take)
				if len(cc.body) < int(cc.req.ContentLength) {
					cc.continue100()
					return gnet.None
				}
				break
			}
			need := cc.headLen + int(cc.req.ContentLength)
			if len(buf) < need {
				cc.continue100()
				return gnet.None
			}
			if !reparse() {
				return gnet.None
			}
			cc.body = append(cc.body[:0], buf[cc.headLen:need]...)
			consumed = need
		case http1.BodyChunked:
			out, n, done, err := cc.chunked.Decode(cc.body, buf[cc.bodyOff:])
			cc.body, cc.bodyOff = out, cc.bodyOff+n
			if err != nil {
				cc.protoError(err)
				return gnet.None
			}
			// The decoded bytes are in body: they leave the inbound buffer.
			cc.discard(cc.bodyOff)
			cc.bodyOff = 0
			if !done {
				cc.continue100()
				return gnet.None
			}
			if !reparse() {
				return gnet.None
			}
			consumed = cc.bodyOff
		}
		cc.captureHead()
		cc.discard(consumed)
		cc.readStart = 0
		cc.handle()
	}
}

// discard drops the first n inbound bytes; n ≤ 0 drops none (gnet's Discard drops all then).
func (cc *clientConn) discard(n int) {
	if n > 0 {
		_, _ = cc.c.Discard(n)
	}
}

// headEnded reports whether buf holds the blank line that ends a request head (CRLF CRLF,
// or bare LFs, which the parser accepts too), searching from near from: the bytes before it
// were searched already.
func headEnded(buf []byte, from int) bool {
	i := min(max(from-2, 0), len(buf))
	for {
		k := bytes.IndexByte(buf[i:], '\n')
		if k < 0 {
			return false
		}
		j := i + k
		if j >= 1 && buf[j-1] == '\n' || j >= 2 && buf[j-1] == '\r' && buf[j-2] == '\n' {
			return true
		}
		i = j + 1
	}
}

// continue100 answers Expect: 100-continue once, when the body has not arrived.
func (cc *clientConn) continue100() {
	if cc.req.Expect100 && !cc.sent100 {
		cc.sent100 = true
		_, _ = cc.c.Write([]byte(http1.Continue))
	}
}

// captureHead copies what the rest of the request needs from the head before its bytes are
// discarded.
func (cc *clientConn) captureHead() {
	r := &cc.req
	cc.method = append(cc.method[:0], r.Method...)
	cc.target = append(cc.target[:0], r.Target...)
	if len(r.Target) > 0 && r.Target[0] != '/' {
		// Absolute form: forward the origin form.
		cc.target = append(cc.target[:0], r.Path...)
		if len(r.RawQuery) > 0 {
			cc.target = append(append(cc.target, '?'), r.RawQuery...)
		}
	}
	cc.path = append(cc.path[:0], r.Path...)
	cc.keepAlive = r.KeepAlive
	cc.proto10 = r.ProtoMinor == 0
	if cc.srv.keys.Active() {
		// The client's key is the proxy's to check, not the engines' to see.
		cc.auth = append(cc.auth[:0], r.Authorization...)
		cc.fwd = http1.AppendForwardHeaders(cc.fwd[:0], r.Header.All(), forwardWithoutKey)
	} else {
		cc.fwd = http1.AppendForwardHeaders(cc.fwd[:0], r.Header.All(), http1.DefaultForwardHeaders)
	}
	cc.in.SetHints(r.SessionID, r.Priority, r.OSL, r.SLOTTFT, r.SLOTPOT)
	cc.noMigrate = bytes.EqualFold(bytes.TrimSpace(r.Migrate), []byte("off"))
	cc.fairness = append(cc.fairness[:0], bytes.TrimSpace(r.FairnessID)...)
}

// protoError answers a request that cannot be framed and closes the connection.
func (cc *clientConn) protoError(err error) {
	status := http1.StatusOf(err)
	msg := err.Error()
	var he *http1.Error
	if errors.As(err, &he) {
		msg = he.Reason
	}
	cc.keepAlive = false
	if status == 413 {
		// Let the client finish sending so that it reads the 413 rather than a reset: drop
		// what it sends, up to its Content-Length or lingerFor.
		buf, _ := cc.c.Peek(-1)
		cc.lingerLeft = 1 << 62
		if cl, err := strconv.ParseInt(string(cc.req.Header.Get("content-length")), 10, 64); err == nil {
			if head := bytes.Index(buf, []byte("\r\n\r\n")); head >= 0 {
				cc.lingerLeft = cl - int64(len(buf)-head-4)
			}
		}
		cc.lingerUntil = nanotime() + lingerFor
		_, _ = cc.c.Discard(-1)
	}
	cc.errorReply(status, msg, "", "")
}

// handle dispatches one complete request.
func (cc *clientConn) handle() {
	s := cc.srv
	path := cc.path
	get := bytes.Equal(cc.method, []byte("GET")) || bytes.Equal(cc.method, []byte("HEAD"))
	switch string(path) {
	case "/health":
		if !get {
			cc.methodNotAllowed()
			return
		}
		if s.core.Draining() {
			cc.reply(503, "application/json", []byte(`{"status":"draining"}`))
			return
		}
		cc.reply(200, "application/json", []byte(`{"status":"ok"}`))
		return
	case "/metrics":
		if !get {
			cc.methodNotAllowed()
			return
		}
		if !s.loopback {
			// Metrics name every worker and cost a scrape's work: clients reach them on the
			// admin listener only, unless the client port is local anyway.
			cc.errorReply(404, "/metrics is served on the proxy's admin listener", "", "")
			return
		}
		cc.reply(200, "text/plain; version=0.0.4; charset=utf-8", s.gatherMetrics())
		return
	case "/v1/models":
		if !get {
			cc.methodNotAllowed()
			return
		}
		cc.reply(200, "application/json", *s.models.Load())
		return
	}
	if id, ok := bytes.CutPrefix(path, []byte("/v1/responses/")); ok && len(id) > 0 {
		id, cancel := bytes.CutSuffix(id, []byte("/cancel"))
		switch {
		case cancel && !bytes.Equal(cc.method, []byte("POST")),
			!cancel && !get && !bytes.Equal(cc.method, []byte("DELETE")):
			cc.methodNotAllowed()
			return
		}
		cc.storedResponse(id)
		return
	}
	if id, ok := bytes.CutPrefix(path, []byte("/v1/models/")); ok && len(id) > 0 {
		if !get {
			cc.methodNotAllowed()
			return
		}
		cc.modelObject(string(id))
		return
	}
	cc.in.Start(0, cc.lp.now, false)
	kind := oai.KindForPath(path)
	if kind == 0 {
		cc.errorReply(404, "no route for "+string(cc.method)+" "+string(path), "", "")
		return
	}
	if !bytes.Equal(cc.method, []byte("POST")) {
		cc.methodNotAllowed()
		return
	}
	if s.core.Draining() {
		cc.keepAlive = false
		cc.errorReplyHeader(503, "the proxy is shutting down", "", "", retryAfterHeader(1))
		return
	}
	cc.tenant, cc.tm, cc.resv = nil, nil, tenant.Reservation{}
	if s.keys.Active() {
		if cc.tenant = s.keys.Lookup(cc.auth); cc.tenant == nil {
			s.metrics.tenantRefused.WithLabelValues("", "invalid_api_key").Inc()
			cc.errorReplyHeader(401, "Incorrect API key provided. Send the key as Authorization: Bearer <key>.", "", "invalid_api_key",
				"WWW-Authenticate: Bearer realm=\"kvrelay\"\r\n")
			return
		}
	}
	cc.lp.seq++
	cc.in.Start(kind, cc.lp.now, cc.lp.seq%decide.SampleEvery == 1)
	cc.setFlow()
	if len(cc.body) >= decide.OffLoopBytes {
		cc.parseOffLoop()
		return
	}
	cc.parsed(cc.in.Parse(cc.body))
}

// parseOffLoop parses a large body off the event loop and continues the request on it.
func (cc *clientConn) parseOffLoop() {
	var err error
	cc.offLoop(func() { err = cc.in.Parse(cc.body) }, func() { cc.parsed(err) })
}

// offLoop runs work on a goroutine (one of tokenizeSlots), the connection in stTokenize
// meanwhile, and then resume on the connection's loop, unless the client left. work is
// skipped for a client already gone. The request counts as in flight for a graceful stop
// until resume has run (and started it) or the loop has stopped.
func (cc *clientConn) offLoop(work, resume func()) {
	s := cc.srv
	s.metrics.offLoop.Inc()
	cc.state = stTokenize
	lp := cc.lp
	s.core.Enter()
	go func() {
		s.tokenizeSlots <- struct{}{}
		if !cc.gone.Load() {
			work()
		}
		<-s.tokenizeSlots
		if lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
			defer s.core.Leave()
			if cc.state != stTokenize {
				return nil // the client left
			}
			cc.lp.now = nanotime()
			cc.state = stIdle
			resume()
			return nil
		})) != nil {
			s.core.Leave() // the loop has stopped
		}
	}()
}

// parsed continues a request once its body is parsed (err: it was not): checks, routing
// input, routing.
func (cc *clientConn) parsed(err error) {
	r := &cc.in
	if err == nil {
		err = r.Validate()
	}
	if err != nil {
		cc.refuse(err)
		return
	}
	cc.pd.decodeBody = nil
	cc.spec.want, cc.spec.answer = false, cc.spec.answer[:0]
	o := r.OpenAI()
	if t := cc.tenant; t != nil && (r.Kind() == oai.ChatCompletions || r.Kind() == oai.Completions) {
		// The tenant's cache_salt, in the block hashes routing uses and in the body every
		// leg forwards. The new body is a copy: what the parse points into stays as it was.
		salt := t.Salt(o.CacheSalt)
		o.CacheSalt = salt
		body := make([]byte, 0, len(cc.body)+len(salt)+16)
		cc.body = oai.AppendWithRawField(body, cc.body, "cache_salt", append(append([]byte{'"'}, salt...), '"'))
	}
	cc.spec.want = o.Hints.SpeculativePrefill && r.Kind() == oai.ChatCompletions
	err = r.Prepare()
	if err == nil && r.Kind() == oai.Responses && len(o.PreviousResponseID) > 0 {
		cc.pinResponse(unsafeString(o.PreviousResponseID))
	}
	switch {
	case err == nil:
		cc.route(false)
	case errors.Is(err, decide.ErrRemote), errors.Is(err, decide.ErrIndex):
		cc.fetchRemote()
	case errors.Is(err, decide.ErrLarge):
		// Tokenized off the loop; the text aliases the connection's buffers, which nothing
		// on the loop changes while it is in stTokenize (a client that leaves abandons them).
		cc.offLoop(r.Work, cc.resumed)
	default:
		cc.refuse(err)
	}
}

// fetchRemote makes the request's round trip (a remote tokenizer's /tokenize, or the control
// plane's index query) on a goroutine of its own (not CPU: no tokenize slot) and resumes the
// request on its loop.
//
// The request counts as in flight for a graceful stop until it has resumed (or the loop has
// stopped), as offLoop's do; the round trip is skipped for a client already gone.
func (cc *clientConn) fetchRemote() {
	s := cc.srv
	cc.state = stTokenize
	lp := cc.lp
	s.core.Enter()
	go func() {
		if !cc.gone.Load() {
			cc.in.Work()
		}
		if lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
			defer s.core.Leave()
			if cc.state != stTokenize {
				return nil // the client left
			}
			cc.lp.now = nanotime()
			cc.state = stIdle
			cc.resumed()
			return nil
		})) != nil {
			s.core.Leave() // the loop has stopped
		}
	}()
}

// resumed continues a request whose off-loop work ended.
func (cc *clientConn) resumed() {
	if err := cc.in.Resume(); err != nil {
		if errors.Is(err, decide.ErrIndex) {
			cc.fetchRemote() // the prompt, now hashed, goes to the control plane's index
			return
		}
		cc.refuse(err)
		return
	}
	cc.route(false)
}

// refuse answers a request the routing core refused (a *decide.Refusal).
func (cc *clientConn) refuse(err error) {
	var rf *decide.Refusal
	if !errors.As(err, &rf) {
		rf = &decide.Refusal{Status: 500, Message: err.Error()}
	}
	extra := ""
	if rf.RetryAfter > 0 {
		extra = retryAfterHeader(rf.RetryAfter)
	}
	cc.errorReplyHeader(rf.Status, rf.Message, rf.Param, rf.Code, extra)
}

// route has the routing core decide the request and starts the exchange (or, for a
// disaggregated request, its prefill leg), or queues the request when every worker is busy.
// retry is true when an earlier attempt failed before its first byte.
func (cc *clientConn) route(retry bool) {
	r := &cc.in
	if retry {
		cc.pd.decodeBody = nil // a failed decode leg: the next decode worker prefills itself
	} else if t := cc.tenant; t != nil && cc.resv == (tenant.Reservation{}) && !cc.admit(t) {
		return
	}
	switch err := r.Decide(cc.lp.now, retry); {
	case err == nil:
		if p := r.PrefillWorker(); p != nil {
			cc.prefill(p)
			return
		}
		cc.start()
	case errors.Is(err, route.ErrBusy), errors.Is(err, route.ErrSLO), errors.Is(err, route.ErrNoWorker):
		cc.routeFailed(err, retry)
	default:
		cc.refuse(err)
	}
}

// setFlow gives the request its fair-queuing flow: within its tenant (weighed as the tenant,
// its flows sharing its part equally), its agent program's fairness id, or the tenant's
// requests without one; without API keys the fairness id alone.
func (cc *clientConn) setFlow() {
	const maxFairnessID = 128
	fid := cc.fairness
	if len(fid) > maxFairnessID {
		fid = fid[:maxFairnessID]
	}
	t := cc.tenant
	if t == nil {
		if len(fid) > 0 {
			cc.in.SetFlow(string(fid), 1)
		}
		return
	}
	cc.in.SetTenant(t.Name, cc.srv.keys.Table().Share(t))
	name := t.Name
	if len(fid) > 0 {
		name += "/" + string(fid)
	}
	cc.in.SetFlow(name, t.Limits.Weight)
}

// admit takes the request from its tenant's budgets (its prompt tokens, its output limit
// when it states one), or answers 429 with Retry-After and the budgets' headers. It reports
// whether the request goes on.
func (cc *clientConn) admit(t *tenant.Tenant) bool {
	r := &cc.in
	maxOut := 0
	if o := r.OpenAI(); o.HasMaxTokens {
		maxOut = o.MaxTokens
	}
	now := time.Unix(0, cc.lp.now)
	resv, ex := t.Admit(now, r.PromptTokens(), maxOut)
	tm := cc.srv.forTenant(t)
	if ex != nil {
		cc.srv.metrics.tenantRefused.WithLabelValues(tm.label, ex.Limit).Inc()
		secs := max(int((ex.RetryAfter+time.Second-1)/time.Second), 1)
		extra := t.Status(now).AppendHeaders([]byte(retryAfterHeader(secs)))
		cc.errorReplyHeader(429, "Rate limit reached for "+ex.Limit+" of tenant "+t.Name+": retry after "+ex.RetryAfter.Round(time.Millisecond).String()+".", "", "rate_limit_exceeded", string(extra))
		return false
	}
	cc.resv, cc.tm = resv, tm
	tm.requests.Inc()
	return true
}

// tenantAnswered records an answer in its tenant's series (none without API keys): the
// tokens its usage reports, and for a streamed answer its time to first token, as the
// routing core measured it for its own series.
func (cc *clientConn) tenantAnswered() {
	tm := cc.tm
	if tm == nil {
		return
	}
	res := cc.in.Result()
	if u := &res.Usage; u.Has {
		tm.prompt.Add(float64(max(u.PromptTokens, 0)))
		tm.output.Add(float64(max(u.CompletionTokens, 0)))
	}
	if u := &res.Usage; u.HasCached {
		tm.cached.Add(float64(max(u.CachedTokens, 0)))
	}
	if ns, ok := res.TTFT(); ok && res.Mode == oai.ModeSSE {
		tm.ttft.Observe(seconds(ns))
	}
}

// settle gives back to the request's tenant what its answer did not use of its reservation.
func (cc *clientConn) settle() {
	if cc.tenant == nil {
		return
	}
	out := 0
	if res := cc.in.Result(); res != nil && res.Usage.Has {
		out = int(res.Usage.CompletionTokens)
	}
	cc.resv.Settle(out)
	cc.tenant, cc.tm, cc.resv = nil, nil, tenant.Reservation{}
}

// forwardWithoutKey are the request fields passed to engines when the proxy checks API keys:
// the defaults but the client's Authorization.
var forwardWithoutKey = func() []string {
	var out []string
	for _, h := range http1.DefaultForwardHeaders {
		if h != "authorization" {
			out = append(out, h)
		}
	}
	return out
}()

// routeFailed answers a request the core could not place: it waits in the admission
// queue when every eligible worker is busy; otherwise it gets 502 after failed attempts
// (retry), 503 when no healthy worker serves its model.
func (cc *clientConn) routeFailed(err error, retry bool) {
	if cc.ex.mig.leg {
		// No worker to continue a migrating stream on: it ends as its engine left it.
		cc.ex.mig.leg, cc.ex.mig.ok = false, false
		cc.srv.metrics.migrations.WithLabelValues("failed").Inc()
		cc.ex.truncated()
		return
	}
	what := "worker"
	if cc.in.Disaggregated() {
		what = "decode worker"
	}
	switch {
	case errors.Is(err, route.ErrBusy):
		cc.enqueue(false)
	case errors.Is(err, route.ErrSLO):
		cc.enqueue(true)
	case retry:
		cc.errorReply(502, "every "+what+" that could serve the request failed", "", "upstream_error")
	default:
		cc.refuse(cc.in.NoWorker(what, cc.lp.now))
	}
}

// start begins the exchange with the decided worker.
func (cc *clientConn) start() {
	ex := &cc.ex
	if tm := cc.tm; tm != nil && !ex.active {
		// The request's first dispatch (not a retry's, nor a migrating stream's): its wait in
		// the admission queue ends here.
		tm.queue.Observe(seconds(cc.waited))
	}
	ex.begin(cc)
	cc.in.Dispatch(cc.lp.now, !ex.mig.leg)
	cc.state = stForward
	ex.send()
}

// pinResponse pins the request to the worker that served stored response id, if this proxy
// saw it (counted unknown otherwise: it routes as any other).
func (cc *clientConn) pinResponse(id string) {
	if w, ok := cc.srv.responses.get(id, cc.lp.now); ok {
		cc.in.Pin(w)
		return
	}
	cc.srv.core.UnknownResponse()
}

// storedResponse serves GET and DELETE /v1/responses/{id} (and POST …/{id}/cancel) from the
// worker that served the response: 404 as OpenAI answers when this proxy does not know it.
func (cc *clientConn) storedResponse(id []byte) {
	s := cc.srv
	if s.core.Draining() {
		cc.keepAlive = false
		cc.errorReplyHeader(503, "the proxy is shutting down", "", "", retryAfterHeader(1))
		return
	}
	worker, ok := s.responses.get(string(id), cc.lp.now)
	if !ok {
		s.core.UnknownResponse()
		cc.errorReply(404, "Response with id '"+string(id)+"' not found.", "", "")
		return
	}
	var model string
	for _, w := range s.core.Load().Pool().Workers {
		if w.ID == worker {
			model = w.Model
		}
	}
	cc.in.Start(oai.Responses, cc.lp.now, false)
	cc.in.PinOnly(model, worker) // no other worker has the response
	cc.pd.decodeBody = nil
	cc.spec.want = false
	cc.route(false)
}

// modelObject answers GET /v1/models/{id} as OpenAI does: the model object, or 404
// model_not_found. The id may be escaped (Qwen%2FQwen3-8B) or not (Qwen/Qwen3-8B).
func (cc *clientConn) modelObject(id string) {
	if u, err := url.PathUnescape(id); err == nil {
		id = u
	}
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	_ = json.Unmarshal(*cc.srv.models.Load(), &list)
	for _, m := range list.Data {
		var probe struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(m, &probe) == nil && probe.ID == id {
			cc.reply(200, "application/json", m)
			return
		}
	}
	cc.errorReply(404, "The model `"+id+"` does not exist.", "model", "model_not_found")
}

// methodNotAllowed answers a known path asked with the wrong method.
func (cc *clientConn) methodNotAllowed() {
	cc.errorReply(405, "method "+string(cc.method)+" is not allowed on "+string(cc.path), "", "")
}

// closed is called when the client connection closes: an exchange in progress is aborted
// at once (closing the engine connection makes the engine free the request's KV blocks), a
// queued request leaves the queue.
func (cc *clientConn) closed() {
	cc.gone.Store(true) // off-loop work for this connection stops where it can
	cc.lp.unlinkClient(cc)
	if cc.state == stQueued {
		cc.in.Abandon()
	}
	if cc.state == stPrefill {
		cc.abortPrefill()
	}
	if cc.ex.active {
		if cc.state == stForward {
			cc.srv.metrics.aborted.WithLabelValues("client_gone").Inc()
		}
		cc.ex.abort()
	}
	cc.settle() // a request cut short gives back the output it did not get
	cc.state = stClosing
}

// tick enforces the read and idle timeouts and resumes a stream paused for this client.
func (cc *clientConn) tick(now int64, cfg *Config) {
	switch cc.state {
	case stIdle:
		if cc.readStart != 0 && now-cc.readStart > int64(cfg.ReadTimeout) {
			cc.keepAlive = false
			cc.errorReply(408, "the request did not arrive in time", "", "")
			return
		}
		if cc.readStart == 0 && now-cc.lastActive > int64(cfg.IdleTimeout) {
			cc.state = stClosing
			_ = cc.c.Close()
		}
	case stBody:
		if now-cc.readStart > int64(cfg.ReadTimeout) {
			cc.keepAlive = false
			cc.errorReply(408, "the request body did not arrive in time", "", "")
		}
	case stForward:
		cc.ex.tick(now, cfg)
	case stClosing:
		if cc.lingerUntil != 0 && now > cc.lingerUntil {
			cc.lingerUntil = 0
			_ = cc.c.Close()
		}
	case stQueued:
		// The queue expires its own entries.
	}
}

// done ends a request: the connection takes the next pipelined request, or closes.
func (cc *clientConn) done() {
	cc.settle()
	cc.waited = 0
	if cc.state == stClosing {
		return
	}
	if !cc.keepAlive {
		cc.state = stClosing
		if cc.lingerUntil == 0 || cc.lingerLeft <= 0 {
			_ = cc.c.Close()
		}
		return
	}
	cc.state = stIdle
	cc.lastActive = cc.lp.now
	cc.shrink()
	if cc.c.InboundBuffered() > 0 {
		_ = cc.c.Wake(nil)
	}
}

// shrink drops the buffers a request grew past decide.KeepBytes when it ends, so that a
// connection that once carried a huge prompt does not keep its memory for the rest of its
// life (the parsed request and the rendered messages point into the body too).
func (cc *clientConn) shrink() {
	if cc.in.Shrink(cap(cc.body) > decide.KeepBytes) {
		cc.body = nil
	}
}

func seconds(ns int64) float64 { return float64(ns) / 1e9 }

// unsafeString views b as a string without copying; the caller keeps b unchanged while the
// string is in use.
func unsafeString(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

func unsafeBytes(s string) []byte {
	if s == "" {
		return nil
	}
	return unsafe.Slice(unsafe.StringData(s), len(s))
}
