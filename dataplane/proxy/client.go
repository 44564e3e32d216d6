package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/url"
	"slices"
	"strconv"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/panjf2000/gnet/v2"

	"github.com/kvrelay/kvrelay/dataplane/http1"
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
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
	// input is the request's routing input and what derives it (input.go); its srv is the
	// connection's proxy.
	input
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
	// routing hints among it are input's).
	method    []byte
	target    []byte
	path      []byte
	keepAlive bool
	proto10   bool
	fwd       []byte // forwarded header lines
	// headScanned is how much of a head still arriving was searched for its end.
	headScanned int
	noMigrate   bool // x-kvrelay-migrate: off

	dec  route.Decision
	arm  *armSeries  // the policy version that routed this request
	gone atomic.Bool // the client closed: its off-loop work is dropped

	ex   exchange
	pd   pdState
	spec specState
	obs  oai.Observer
	itl  armITL // the Observer's ITL sink while the request has an arm
	mm   *modelMetrics

	queuedAt int64
	qitem    *queueItem
	// arrived is when the request's body was complete (its latency targets count from it);
	// decideAt when its routing began, for the total decision time of a timed request.
	arrived  int64
	decideAt int64

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
	cc.fwd = http1.AppendForwardHeaders(cc.fwd[:0], r.Header.All(), http1.DefaultForwardHeaders)
	cc.session = append(cc.session[:0], r.SessionID...)
	cc.hdrPrio, cc.hasPrio = atoi(r.Priority)
	cc.hdrOSL, _ = atoi(r.OSL)
	cc.noMigrate = bytes.EqualFold(bytes.TrimSpace(r.Migrate), []byte("off"))
	cc.sloTTFT, cc.sloTPOT = millis(r.SLOTTFT), millis(r.SLOTPOT)
}

// millis reads a latency target in milliseconds (x-slo-ttft-ms: 250, or 0.5); 0 when it is
// absent, malformed, not positive or beyond a day.
func millis(b []byte) float64 {
	if len(b) == 0 || len(b) > 16 {
		return 0
	}
	v, err := strconv.ParseFloat(string(b), 64)
	if err != nil || !(v > 0 && v <= 86400e3) {
		return 0
	}
	return v
}

func atoi(b []byte) (int, bool) {
	if len(b) == 0 || len(b) > 12 {
		return 0, false
	}
	n, err := strconv.Atoi(string(b))
	return n, err == nil
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
		if s.draining.Load() {
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
	cc.kind, cc.model, cc.arm, cc.decID = 0, "", nil, 0
	kind := oai.KindForPath(path)
	if kind == 0 {
		cc.errorReply(404, "no route for "+string(cc.method)+" "+string(path), "", "")
		return
	}
	if !bytes.Equal(cc.method, []byte("POST")) {
		cc.methodNotAllowed()
		return
	}
	if s.draining.Load() {
		cc.keepAlive = false
		cc.errorReplyHeader(503, "the proxy is shutting down", "", "", retryAfterHeader(1))
		return
	}
	cc.kind, cc.model = kind, ""
	cc.lp.seq++
	cc.timed = cc.lp.seq%timedEvery == 1
	cc.arrived = cc.lp.now
	// A new request: the queue item of the connection's last one (dequeued and served) is not
	// its own, neither its deadline nor its place in line.
	cc.qitem = nil
	t0 := cc.clock()
	cc.decideAt = t0
	if len(cc.body) >= offLoopBytes {
		cc.parseOffLoop(kind, t0)
		return
	}
	cc.parsed(cc.parser.Parse(cc.body, kind, &cc.oreq), t0)
}

// parseOffLoop parses a large body off the event loop and continues the request on it.
func (cc *clientConn) parseOffLoop(kind oai.Kind, t0 int64) {
	var err error
	cc.offLoop(func() { err = cc.parser.Parse(cc.body, kind, &cc.oreq) }, func() { cc.parsed(err, t0) })
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
	s.inflight.Add(1)
	go func() {
		s.tokenizeSlots <- struct{}{}
		if !cc.gone.Load() {
			work()
		}
		<-s.tokenizeSlots
		if lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
			defer s.inflight.Add(-1)
			if cc.state != stTokenize {
				return nil // the client left
			}
			cc.lp.now = nanotime()
			cc.state = stIdle
			resume()
			return nil
		})) != nil {
			s.inflight.Add(-1) // the loop has stopped
		}
	}()
}

// parsed continues a request once its body is parsed: checks, routing input, routing.
func (cc *clientConn) parsed(err error, t0 int64) {
	s := cc.srv
	if err != nil {
		cc.parseError(err)
		return
	}
	cc.stage(stageParse, t0)
	if len(cc.oreq.Model) == 0 {
		cc.errorReply(400, "you must provide a model parameter", "model", "")
		return
	}
	if !s.kv.Pool().Serves(unsafeString(cc.oreq.Model)) {
		cc.errorReply(404, "The model `"+string(cc.oreq.Model)+"` does not exist.", "model", "model_not_found")
		return
	}
	if p := cc.oreq.KVTransferParams; len(p) > 0 && string(p) != "null" {
		// The engines' KV connector parameters say where to pull or push KV blocks: only
		// kvrelay's own prefill and decode legs may carry them, or a client could make an
		// engine dial any host it names.
		s.metrics.refused.WithLabelValues("kv_transfer_params").Inc()
		s.log.Debug("refused a request carrying kv_transfer_params", "remote", cc.c.RemoteAddr())
		cc.errorReply(400, "kv_transfer_params is set by kvrelay for its prefill and decode legs; requests may not carry it", "kv_transfer_params", "")
		return
	}
	cc.model = s.modelLabel(cc.oreq.Model)
	cc.pd.on, cc.pd.decodeBody, cc.pd.fallback = false, nil, false
	cc.spec.want, cc.spec.answer = false, cc.spec.answer[:0]
	cc.spec.want = cc.oreq.Hints.SpeculativePrefill && cc.kind == oai.ChatCompletions
	err = cc.prepare()
	if err == nil && cc.kind == oai.Responses && len(cc.oreq.PreviousResponseID) > 0 {
		cc.pinResponse(unsafeString(cc.oreq.PreviousResponseID))
	}
	if err != nil {
		if errors.Is(err, errPending) {
			cc.fetchRemote() // resumes in remoteDone
			return
		}
		if errors.Is(err, errLarge) {
			cc.tokenizeOffLoop(cc.large.cd, cc.large.text, cc.large.limit, cc.large.t0)
			return
		}
		if errors.Is(err, errNoTokenizer) {
			cc.errorReplyHeader(503, err.Error(), "", "no_worker", cc.noWorkerRetryAfter())
			return
		}
		if limit, ok := err.(contextLengthError); ok {
			cc.refuseTooLong(int(limit))
			return
		}
		cc.errorReply(400, err.Error(), "messages", "")
		return
	}
	cc.route(false)
}

// tokenizeOffLoop tokenizes a large prompt on a goroutine, at most tokenizeSlots at once,
// and resumes the request on its loop. text aliases the connection's buffers, which nothing
// on the loop changes while it is in stTokenize (a client that leaves abandons them).
func (cc *clientConn) tokenizeOffLoop(cd *codec, text string, limit int, t0 int64) {
	cc.tokStart = t0
	var toks []uint32
	ok := true
	cc.offLoop(func() { toks, ok = tokenizer.AppendEncodeLimit(cd.tok, nil, text, limit) }, func() {
		if !ok {
			cc.refuseTooLong(limit)
			return
		}
		cc.toks = toks
		cc.stage(stageTokenize, cc.tokStart)
		cc.hashTokens()
		cc.route(false)
	})
}

// refuseTooLong answers a prompt longer than every worker of its model takes.
func (cc *clientConn) refuseTooLong(limit int) {
	cc.srv.metrics.tooLong.Inc()
	param := "messages"
	if cc.kind == oai.Completions {
		param = "prompt"
	}
	cc.errorReply(400, contextLengthError(limit).Error(), param, "context_length_exceeded")
}

// route picks a worker and starts the exchange, or queues the request when every worker is
// busy. retry is true when an earlier attempt failed before its first byte.
func (cc *clientConn) route(retry bool) {
	s := cc.srv
	router := s.kv
	if cc.kind != oai.ChatCompletions && cc.kind != oai.Completions {
		router = s.load
	}
	cc.arm = nil
	if cc.kind == oai.ChatCompletions || cc.kind == oai.Completions {
		cc.arm = s.stableArm.Load()
	}
	if router == s.kv && (cc.pd.on || cc.disaggFor(router.Pool())) {
		cc.routeDisagg(retry) // sets the routing time itself; the stable policy's arm
		return
	}
	// During a rollout the candidate policy routes its share of the requests.
	var cand *candidate
	if router == s.kv {
		if router, cand = cc.armFor(s.kv, cc.body); cand != nil {
			cc.arm = cand.arm
		}
	}
	// Route at this event's time: a request may be routed again well after it was parsed
	// (released from the admission queue, retried after a failure, tokenized remotely).
	cc.rreq.Now = cc.lp.now
	if cc.sloTTFT > 0 {
		// What is left of the TTFT target after the time already spent here.
		cc.rreq.SLOTTFT = cc.sloTTFT/1e3 - seconds(cc.lp.now-cc.arrived)
		if cc.rreq.SLOTTFT <= 0 {
			cc.sloRefused()
			return
		}
	}
	err := router.Route(&cc.rreq, &cc.dec)
	if errors.Is(err, route.ErrNoWorker) && router == s.load && !retry && router.Pool().Disaggregated(unsafeString(cc.oreq.Model)) {
		// Embeddings and responses in a disaggregated pool go to the decode workers.
		cc.rreq.Role = route.RoleDecode
		err = router.Route(&cc.rreq, &cc.dec)
	}
	cc.observeRoute(&cc.dec, !retry)
	if cc.timed && !retry && cc.decideAt != 0 {
		cc.stage(stageTotal, cc.decideAt)
		cc.decideAt = 0
	}
	if err != nil {
		cc.routeFailed(err, retry, "worker")
		return
	}
	if cc.timed {
		cc.decID = s.decisions.record(&cc.input, cc.lp.now, &cc.dec, cc.arm)
	}
	if cand == nil && router == s.kv && !retry {
		cc.shadowPick(&cc.lp.shadowReq, &cc.dec)
	}
	cc.start(cc.dec.Worker)
}

// routeFailed answers a request the router could not place: it waits in the admission
// queue when every eligible worker is busy; otherwise it gets 502 after failed attempts
// (retry), 503 when no healthy worker serves its model. what names the workers asked.
func (cc *clientConn) routeFailed(err error, retry bool, what string) {
	if cc.ex.mig.leg {
		// No worker to continue a migrating stream on: it ends as its engine left it.
		cc.ex.mig.leg, cc.ex.mig.ok = false, false
		cc.srv.metrics.migrations.WithLabelValues("failed").Inc()
		cc.ex.truncated()
		return
	}
	switch {
	case errors.Is(err, route.ErrBusy):
		cc.enqueue()
	case errors.Is(err, route.ErrSLO):
		cc.enqueueSLO()
	case retry:
		cc.errorReply(502, "every "+what+" that could serve the request failed", "", "upstream_error")
	default:
		cc.errorReplyHeader(503, "no healthy "+what+" serves model "+cc.model, "", "no_worker", cc.noWorkerRetryAfter())
	}
}

// noWorkerRetryAfter is the Retry-After for a request no worker can take: until the first
// ejected worker of its model may be probed again, or a second when none is ejected (health
// comes back with the next check or report).
func (cc *clientConn) noWorkerRetryAfter() string {
	soonest := time.Duration(0)
	for _, w := range cc.srv.kv.Pool().Workers {
		if w.Model != unsafeString(cc.oreq.Model) {
			continue
		}
		if d := w.EjectedFor(cc.lp.now); d > 0 && (soonest == 0 || d < soonest) {
			soonest = d
		}
	}
	return retryAfterHeader(int(math.Ceil(soonest.Seconds())))
}

// start begins the exchange with worker w.
func (cc *clientConn) start(w *route.Worker) {
	s := cc.srv
	ws := s.workerState(w)
	ws.m.routedBy(cc.dec.Mode).Inc()
	s.observeRegret(cc.arm, &cc.dec)
	ex := &cc.ex
	ex.begin(cc, ws)
	ex.receipt, ex.recorded = prefix.Receipt{}, false // recorded at the first token (recordCached)
	if cc.kind == oai.ChatCompletions || cc.kind == oai.Completions {
		overlap := int(cc.dec.Overlap)
		ex.predicted = overlap
		ex.usage.BeginAt(cc.lp.now, w, cc.rreq.PromptTokens, overlap*s.cfg.BlockSize, cc.rreq.OSL)
		// A streamed answer's first chunk is its first token: only those teach the
		// worker's latency model (not a migrated stream's continuation).
		if !ex.mig.leg {
			// A request that fetches its prefix from a peer teaches nothing: its TTFT holds a
			// transfer the model's features do not.
			ex.usage.Predicted(&cc.dec, cc.prio, cc.oreq.Stream && cc.dec.PeerFetch == nil)
		}
	} else {
		ex.usage.BeginAt(cc.lp.now, w, cc.rreq.PromptTokens, 0, 0)
	}
	ws.m.inflight.Inc()
	cc.state = stForward
	ex.send()
}

// pinResponse pins the request to the worker that served stored response id, if this proxy
// saw it (counted unknown otherwise: it routes as any other).
func (cc *clientConn) pinResponse(id string) {
	if w, ok := cc.srv.responses.get(id, cc.lp.now); ok {
		cc.rreq.Pin = w
		return
	}
	cc.srv.metrics.affinity.WithLabelValues("unknown").Inc()
}

// storedResponse serves GET and DELETE /v1/responses/{id} (and POST …/{id}/cancel) from the
// worker that served the response: 404 as OpenAI answers when this proxy does not know it.
func (cc *clientConn) storedResponse(id []byte) {
	s := cc.srv
	if s.draining.Load() {
		cc.keepAlive = false
		cc.errorReplyHeader(503, "the proxy is shutting down", "", "", retryAfterHeader(1))
		return
	}
	worker, ok := s.responses.get(string(id), cc.lp.now)
	if !ok {
		s.metrics.affinity.WithLabelValues("unknown").Inc()
		cc.errorReply(404, "Response with id '"+string(id)+"' not found.", "", "")
		return
	}
	var model string
	for _, w := range s.load.Pool().Workers {
		if w.ID == worker {
			model = w.Model
		}
	}
	cc.kind = oai.Responses
	cc.oreq = oai.Request{}
	cc.oreq.Model = []byte(model)
	cc.model = s.modelLabel(cc.oreq.Model)
	cc.arrived = cc.lp.now
	cc.qitem = nil
	cc.pd.on, cc.pd.decodeBody, cc.pd.fallback = false, nil, false
	cc.spec.want = false
	cc.rreq.Reset()
	cc.rreq.Model = model
	cc.rreq.Pin, cc.rreq.PinOnly = worker, true // no other worker has the response
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

// parseError answers an OpenAI body that does not parse or validate.
func (cc *clientConn) parseError(err error) {
	var pe *oai.Error
	if errors.As(err, &pe) {
		cc.errorReply(pe.Status(), pe.Message, pe.Param, pe.Code)
		return
	}
	cc.errorReply(400, err.Error(), "", "")
}

// closed is called when the client connection closes: an exchange in progress is aborted
// at once (closing the engine connection makes the engine free the request's KV blocks), a
// queued request leaves the queue.
func (cc *clientConn) closed() {
	cc.gone.Store(true) // off-loop work for this connection stops where it can
	cc.lp.unlinkClient(cc)
	if cc.state == stQueued {
		cc.srv.queue.remove(&cc.qitem)
		cc.srv.metrics.queued.WithLabelValues("abandoned").Inc()
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

// Buffers a request grew past these sizes are dropped when it ends, so that a connection
// that once carried a huge prompt does not keep its memory for the rest of its life.
const (
	keepBufBytes = 4 << 20
	keepToks     = 1 << 20
)

func (cc *clientConn) shrink() {
	if cap(cc.body) > keepBufBytes || cap(cc.text) > keepBufBytes {
		// The parsed request and the rendered messages point into them too.
		cc.body, cc.text = nil, nil
		cc.oreq.Release()
		cc.parser.Release()
		clear(cc.msgs[:cap(cc.msgs)])
		cc.msgs = nil
	}
	if cap(cc.toks) > keepToks {
		cc.toks = nil
	}
	if cap(cc.rreq.Hashes) > keepToks/16 {
		cc.rreq.Hashes = nil
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
