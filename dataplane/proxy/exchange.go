package proxy

import (
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/http1"
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// Failure kinds of an exchange with an engine.
const (
	failConnect  = iota // could not connect
	failReset           // the connection closed before a complete response head
	failStatus          // a 5xx status before any byte reached the client
	failTimeout         // no response head within the upstream timeout
	failProtocol        // the response could not be framed
)

// highWater pauses forwarding from an engine while the client's outbound buffer holds this
// much; the stream resumes when it drains below lowWater.
const (
	highWater = 256 << 10
	lowWater  = 64 << 10
)

// upstreamLimits frame engine responses: streamed bodies of any size.
var upstreamLimits = http1.Limits{MaxBodyBytes: -1}

// exchange is one request's round trip to an engine, possibly over several attempts. It
// lives in its clientConn and is reused.
type exchange struct {
	cc *clientConn
	up *upstream

	attempts int
	stale    bool // a reused idle connection failed before any byte: one free retry
	// suspect is the worker an earlier attempt of this request got a 5xx from. It is blamed
	// (counts towards its ejection) only once another worker answers the request without
	// one: a request that gets a 5xx from two workers is the likely cause itself, so the
	// second 5xx goes to the client and neither worker is blamed.
	suspect *route.Worker

	out []byte // the request as sent upstream

	start  int64 // the request was complete
	sentAt int64
	// firstByteBy is when the engine must have started answering (FirstByteTimeout);
	// lastByteAt when it last sent anything (StreamIdleTimeout).
	firstByteBy, lastByteAt int64
	active                  bool
	headSent                bool
	status                  int
	chunked                 bool // re-chunking the body to the client
	untilEOF                bool // the client's body ends when the connection closes
	paused                  bool
	pausedAt                int64 // when forwarding last paused for the client
	// The client's progress as its kernel sees it: the bytes it has acknowledged, when that
	// last grew (or nothing was owed), and when it was last read (clientTaking).
	acked               uint64
	ackedAt, ackCheckAt int64
	// respHead gathers the start of a Responses API answer until its id is found
	// (respDone), to remember which worker holds the stored response.
	respHead []byte
	respDone bool
	flushing bool // forwarding what a closed engine connection left, past highWater
	mig      migration
}

// begin resets the exchange for a request the core decided, before its dispatch.
func (ex *exchange) begin(cc *clientConn) {
	if !ex.active {
		ex.start = cc.lp.now
		ex.attempts, ex.stale, ex.suspect = 0, false, nil
		cc.srv.core.Enter()
	}
	ex.active = true
	if ex.mig.leg {
		// A continuation: the client's response (head, chunking, what it was sent) goes on.
		ex.untilEOF, ex.paused = false, false
		return
	}
	ex.headSent, ex.status, ex.chunked, ex.untilEOF, ex.paused = false, 0, false, false, false
	ex.acked, ex.ackedAt, ex.ackCheckAt = 0, 0, 0
	ex.respHead, ex.respDone = ex.respHead[:0], cc.in.Kind() != oai.Responses
	m := &ex.mig
	*m = migration{ok: cc.migratable(), raw: m.raw[:0], tail: m.tail[:0], pend: m.pend[:0]}
	cc.in.Answer(ex.start)
}

// worker is the worker of the exchange's current attempt.
func (ex *exchange) worker() *route.Worker { return ex.cc.in.Worker() }

// send writes the request to a pooled connection of the worker, or dials one.
func (ex *exchange) send() {
	cc := ex.cc
	w := ex.worker()
	dec := cc.in.Decision()
	body := cc.body
	if cc.pd.decodeBody != nil {
		body = cc.pd.decodeBody
	}
	if ex.mig.leg {
		body = ex.mig.body
	}
	if h := dec.PeerFetch; h != nil && cc.pd.decodeBody == nil && !ex.mig.leg && h != w {
		// The worker pulls the prefix h caches (kvrelay's peer fetch) instead of computing it.
		cc.fetchBody = oai.AppendWithRawField(cc.fetchBody[:0], body, "kv_transfer_params", decide.PeerFetchParams(h.P2PAddr()))
		body = cc.fetchBody
		cc.srv.core.PeerFetch()
	} else if dec.Recompute && cc.pd.decodeBody == nil && !ex.mig.leg {
		// The worker computes what it caches below GPU memory instead of loading it.
		cc.fetchBody = oai.AppendWithRawField(cc.fetchBody[:0], body, "kv_transfer_params", decide.RecomputeParams)
		body = cc.fetchBody
		cc.srv.core.Recompute()
	}
	if prio, kind := cc.in.Priority(), cc.in.Kind(); cc.srv.cfg.ForwardPriority && prio != 0 && (kind == oai.ChatCompletions || kind == oai.Completions) {
		// vLLM runs lower priority values first; kvrelay's hints say higher is more urgent.
		body = oai.AppendWithField(cc.lp.wbuf[:0], body, "priority", -prio)
		cc.lp.wbuf = body
	}
	b := http1.AppendRequestHead(ex.out[:0], cc.method, cc.target, w.Addr, int64(len(body)))
	b = append(b, cc.fwd...)
	b = http1.AppendEndHead(b)
	b = append(b, body...)
	ex.out = b
	ex.sentAt = cc.lp.now
	ex.lastByteAt = cc.lp.now
	cfg := &cc.srv.cfg
	wait := cfg.FirstByteTimeout
	if dec.HasPrediction {
		wait = max(wait, time.Duration(10*dec.Prediction.TTFT*float64(time.Second)))
	}
	ex.firstByteBy = cc.lp.now + int64(min(wait, cfg.UpstreamTimeout))
	if up := cc.lp.take(w); up != nil {
		ex.up = up
		up.attach(ex, true)
		_, _ = up.c.Write(ex.out)
		return
	}
	ex.up = cc.lp.dial(w, ex)
}

// data handles response bytes from the engine: the head first, then the body, forwarded to
// the client as it arrives.
func (ex *exchange) data(up *upstream) {
	cc := ex.cc
	buf, _ := up.c.Peek(-1)
	now := cc.lp.now
	if len(buf) > 0 {
		ex.lastByteAt = now
		ex.worker().Heard(now)
	}
	out := cc.lp.wbuf[:0]
	consumed := 0
	finished := false
	for consumed < len(buf) && !finished {
		if !up.headDone {
			n, err := http1.ParseResponse(buf[consumed:], &up.resp, upstreamLimits, false)
			if err != nil {
				cc.lp.wbuf = out
				ex.fail(up, failProtocol)
				return
			}
			if n == 0 {
				break
			}
			consumed += n
			if up.resp.Informational() {
				continue
			}
			up.headDone = true
			up.gotBytes = true
			if up.resp.StatusCode >= 500 && ex.suspect == nil && ex.canRetry() {
				cc.lp.wbuf = out
				ex.fail(up, failStatus)
				return
			}
			if ex.mig.leg {
				if up.resp.StatusCode != 200 {
					// The continuation was refused: end the stream as the first engine left it.
					cc.lp.wbuf = out
					ex.mig.leg, ex.mig.ok = false, false
					up.detach()
					up.kill()
					ex.truncated()
					return
				}
				up.remaining = up.resp.ContentLength
				up.scan.Reset(upstreamLimits)
				continue
			}
			if sus := ex.suspect; sus != nil {
				ex.suspect = nil
				if up.resp.StatusCode >= 500 {
					cc.srv.metrics.poisoned.Inc()
				} else {
					ex.blame(sus)
				}
			}
			out = ex.head(out, &up.resp)
			up.remaining = up.resp.ContentLength
			up.scan.Reset(upstreamLimits)
			if up.resp.Body == http1.BodyNone {
				finished = true
			}
			continue
		}
		if cc.c.OutboundBuffered()+len(out) > highWater && !ex.flushing {
			ex.pause(up)
			break
		}
		rest := buf[consumed:]
		switch up.resp.Body {
		case http1.BodyLength:
			ex.mig.ok = false // not a stream
			n := int(min(up.remaining, int64(len(rest))))
			out = append(out, rest[:n]...)
			ex.observe(rest[:n], now)
			up.remaining -= int64(n)
			consumed += n
			finished = up.remaining == 0
		case http1.BodyChunked:
			n, data, done, err := up.scan.Next(rest)
			if err != nil {
				cc.lp.wbuf = out
				ex.fail(up, failProtocol)
				return
			}
			consumed += n
			if len(data) > 0 {
				out = ex.forward(out, data, now)
			}
			finished = done
			if n == 0 && !done {
				consumed = len(buf) // cannot happen with non-empty input; guards the loop
			}
		default: // until close
			out = ex.forward(out, rest, now)
			consumed = len(buf)
		}
	}
	if consumed > 0 {
		// gnet's Discard(0) drops everything buffered: never call it with nothing consumed.
		_, _ = up.c.Discard(consumed)
	}
	cc.lp.wbuf = out[:0]
	if len(out) > 0 {
		_, _ = cc.c.Write(out)
	}
	if finished {
		ex.complete(up)
		return
	}
	if up.c.InboundBuffered()+cc.c.OutboundBuffered() > cc.srv.cfg.MaxBufferedResponse {
		cc.srv.metrics.aborted.WithLabelValues("slow_client").Inc()
		ex.abort()
		cc.state = stClosing
		_ = cc.c.Close()
	}
}

// head appends the client's response head for the engine's.
func (ex *exchange) head(out []byte, r *http1.Response) []byte {
	cc := ex.cc
	ex.headSent = true
	ex.status = r.StatusCode
	var length int64
	switch {
	case r.Body == http1.BodyNone:
		length = 0
	case r.Body == http1.BodyLength:
		length = r.ContentLength
	case cc.proto10:
		length = http1.LengthUntilClose
		ex.untilEOF = true
		cc.keepAlive = false
	default:
		length = http1.LengthChunked
		ex.chunked = true
	}
	out = http1.AppendStatusLine(out, r.StatusCode)
	for _, h := range r.Header.All() {
		if skipResponseHeader(h.Name) {
			continue
		}
		out = http1.AppendHeader(out, unsafeString(h.Name), h.Value)
	}
	if length >= 0 {
		out = http1.AppendContentLength(out, length)
	} else if length == http1.LengthChunked {
		out = append(out, "Transfer-Encoding: chunked\r\n"...)
	}
	if cc.keepAlive && !cc.srv.core.Draining() {
		out = append(out, "Connection: keep-alive\r\n"...)
	} else {
		cc.keepAlive = false
		out = append(out, "Connection: close\r\n"...)
	}
	if cc.srv.cfg.ExposeWorkerHeader {
		out = http1.AppendHeader(out, "x-kvrelay-worker", ex.worker().ID)
		out = appendRouteHeader(out, cc.in.Decision(), cc.in.Waited())
	}
	if cc.srv.cfg.ExposeDecisionHeader && cc.in.Decision().HasPrediction {
		out = appendDecisionHeader(out, &cc.in)
	}
	if t := cc.tenant; t != nil {
		// The tenant's budgets as OpenAI reports them.
		out = t.Status(time.Unix(0, cc.lp.now)).AppendHeaders(out)
	}
	return http1.AppendEndHead(out)
}

// skipResponseHeader drops hop-by-hop and framing fields of an engine's response; the proxy
// writes its own.
func skipResponseHeader(name []byte) bool {
	switch len(name) {
	case 2:
		return eqFold(name, "te")
	case 7:
		return eqFold(name, "trailer") || eqFold(name, "upgrade")
	case 10:
		return eqFold(name, "connection") || eqFold(name, "keep-alive")
	case 14:
		return eqFold(name, "content-length")
	case 15:
		return eqFold(name, "x-kvrelay-route")
	case 16:
		return eqFold(name, "proxy-connection") || eqFold(name, "x-kvrelay-worker")
	case 17:
		return eqFold(name, "transfer-encoding")
	}
	return false
}

func eqFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// payload appends body bytes in the client's framing.
// forward passes body bytes on to the client: as they are, in whole events while the
// stream may still migrate, or rewritten into the original stream's events on a
// continuation.
func (ex *exchange) forward(out, data []byte, now int64) []byte {
	switch {
	case ex.mig.leg:
		return ex.continueEvents(out, data, now)
	case ex.mig.ok || len(ex.mig.tail) > 0:
		out = ex.forwardEvents(out, data)
	default:
		out = ex.payload(out, data)
	}
	ex.observe(data, now)
	return out
}

func (ex *exchange) payload(out, data []byte) []byte {
	if ex.chunked {
		return http1.AppendChunk(out, data)
	}
	return append(out, data...)
}

// observe reads metrics off the payload and keeps the worker's load current.
func (ex *exchange) observe(data []byte, now int64) {
	cc := ex.cc
	if !ex.respDone {
		ex.noteResponseID(data)
	}
	if cc.spec.want && len(cc.spec.answer)+len(data) <= maxSpeculativeAnswer {
		cc.spec.answer = append(cc.spec.answer, data...)
	}
	cc.in.Feed(data, now)
}

// noteResponseID looks for the id of a Responses API answer in its first bytes and
// remembers the worker that stored it.
func (ex *exchange) noteResponseID(data []byte) {
	if ex.status != 200 {
		ex.respDone = true
		return
	}
	ex.respHead = append(ex.respHead, data[:min(len(data), maxRespIDScan-len(ex.respHead))]...)
	if id, ok := responseID(ex.respHead); ok {
		ex.cc.srv.responses.put(id, ex.worker().ID, ex.cc.lp.now)
		ex.respDone = true
	} else if len(ex.respHead) >= maxRespIDScan {
		ex.respDone = true
	}
}

// pause stops forwarding while the client is slow; housekeeping resumes it.
func (ex *exchange) pause(up *upstream) {
	if !ex.paused {
		ex.paused = true
		ex.pausedAt = ex.cc.lp.now
		ex.cc.srv.paused.Add(1)
	}
}

func (ex *exchange) resume() {
	if ex.paused {
		ex.paused = false
		ex.lastByteAt = ex.cc.lp.now // the engine was held back, not silent
		ex.cc.srv.paused.Add(-1)
	}
}

// complete ends a response the engine finished.
func (ex *exchange) complete(up *upstream) {
	cc := ex.cc
	if m := &ex.mig; len(m.tail) > 0 || len(m.pend) > 0 {
		// An answer that did not end on an event boundary: pass its end on as it is.
		out := ex.payload(cc.lp.wbuf[:0], m.tail)
		out = ex.payload(out, m.pend)
		_, _ = cc.c.Write(out)
		m.tail, m.pend = m.tail[:0], m.pend[:0]
	}
	ex.mig.leg = false
	if ex.chunked {
		_, _ = cc.c.Write(http1.AppendLastChunk(cc.lp.wbuf[:0]))
	}
	up.detach()
	if up.state != upClosed && up.resp.KeepAlive && up.c.InboundBuffered() == 0 {
		cc.lp.putIdle(up)
	} else {
		up.state = upClosed
		_ = up.c.Close()
	}
	ex.worker().Succeeded()
	if ex.status == 200 {
		cc.in.RecordCached(cc.lp.now) // a response without content chunks ends its prefill here
	}
	if cc.spec.want && ex.status == 200 {
		cc.speculativePrefill(ex.worker())
	}
	ex.finish()
	if ex.untilEOF {
		cc.keepAlive = false
	}
	cc.done()
}

// finish records the request's metrics and releases what it held.
func (ex *exchange) finish() {
	cc := ex.cc
	s := cc.srv
	if !ex.active {
		return
	}
	ex.active = false
	ex.resume()
	cc.in.Settle(ex.status, cc.lp.now)
	cc.tenantAnswered()
	s.core.Leave()
}

// abort ends the exchange because the client is gone or too slow: the engine connection is
// closed, which makes the engine abort the request and free its KV blocks. Its arm counts
// it as the client's doing.
func (ex *exchange) abort() {
	if !ex.active {
		return
	}
	ex.cc.in.ClientGone()
	if up := ex.up; up != nil {
		up.detach()
		up.kill()
	}
	ex.finish()
}

// canRetry reports whether a failure now may try another worker: nothing has reached the
// client and attempts remain.
func (ex *exchange) canRetry() bool {
	return !ex.headSent && ex.attempts < ex.cc.srv.cfg.Retries
}

// fail handles a failed attempt on up: before anything reached the client it counts against
// the worker and tries the next-best one; afterwards it ends the client's response with an
// error it can parse.
func (ex *exchange) fail(up *upstream, kind int) {
	cc := ex.cc
	s := cc.srv
	w := ex.worker()
	up.detach()
	up.kill()
	if kind == failReset && up.reused && !up.gotBytes && !ex.stale && !ex.headSent {
		// A pooled connection the engine had already closed: try a fresh one, no blame.
		ex.stale = true
		ex.send()
		return
	}
	um := s.metrics.forUpstream(w.ID)
	switch kind {
	case failConnect:
		um.connectErr.Inc()
	case failStatus:
		um.statusErr.Inc()
	case failTimeout:
		um.timeoutErr.Inc()
	default:
		um.resetErr.Inc()
	}
	switch {
	case kind == failStatus && ex.suspect == nil:
		ex.suspect = w // blamed if another worker answers without a 5xx
	case kind == failTimeout && cc.lp.now-w.LastHeard() > int64(s.cfg.FirstByteTimeout):
		// A worker silent on every connection for the whole timeout has stopped answering
		// (hung, frozen): it is out at once, not after EjectAfter requests each waited the
		// timeout on it. One that streams to others is busy: only this request moves.
		s.core.Blame(w, cc.lp.now, 1, "worker ejected: it stopped answering")
	case kind == failTimeout:
	case kind != failProtocol:
		ex.blame(w)
	}
	if ex.canRetry() {
		ex.attempts++
		s.metrics.retries.Inc()
		cc.in.Withdraw()
		cc.route(true)
		return
	}
	if !ex.headSent {
		status, msg := 502, "the engine failed before answering"
		if kind == failTimeout {
			status, msg = 504, "the engine did not answer in time"
		}
		ex.status = status
		ex.finish()
		cc.errorReply(status, msg, "", "upstream_error")
		return
	}
	ex.truncated()
}

// blame counts a failure against w, ejecting it after EjectAfter in a row.
func (ex *exchange) blame(w *route.Worker) {
	s := ex.cc.srv
	s.core.Blame(w, ex.cc.lp.now, s.cfg.EjectAfter, "worker ejected after consecutive failures")
}

// truncated ends a response the engine stopped in the middle of: a stream gets an error
// event and [DONE] and a proper end, so clients see a clean stream error; any other body
// cannot be completed and the connection closes.
func (ex *exchange) truncated() {
	cc := ex.cc
	if ex.migrate() {
		return
	}
	ex.mig.leg = false
	cc.srv.metrics.aborted.WithLabelValues("upstream_died").Inc()
	cc.in.Broken()
	if ex.chunked && cc.in.Result().Mode == oai.ModeSSE {
		ev := cc.lp.wbuf[:0]
		ev = append(ev, "data: "...)
		ev = decide.AppendErrorJSON(ev, 502, "the engine stopped before the response was complete", "", "upstream_error")
		ev = append(ev, "\n\ndata: [DONE]\n\n"...)
		out := http1.AppendChunk(make([]byte, 0, len(ev)+16), ev)
		out = http1.AppendLastChunk(out)
		_, _ = cc.c.Write(out)
		ex.finish()
		cc.done()
		return
	}
	ex.finish()
	cc.keepAlive = false
	cc.state = stClosing
	_ = cc.c.Close()
}

// endStream ends a stream whose engine had sent all but its [DONE].
func (ex *exchange) endStream() {
	cc := ex.cc
	ev := append(cc.lp.wbuf[:0], "data: [DONE]\n\n"...)
	out := http1.AppendChunk(make([]byte, 0, len(ev)+16), ev)
	out = http1.AppendLastChunk(out)
	_, _ = cc.c.Write(out)
	ex.finish()
	cc.done()
}

// upstreamClosed handles the engine closing the connection during the exchange.
func (ex *exchange) upstreamClosed(up *upstream) {
	if ex.paused && up.headDone {
		// Held back for a slow client, the rest of the answer is still in the connection's
		// inbound buffer: it is in memory already, so hand it all to the client now.
		ex.resume()
		ex.flushing = true
		ex.data(up)
		ex.flushing = false
		if ex.up != up {
			return // complete, or a failure, ended the exchange
		}
	}
	if up.headDone && up.resp.Body == http1.BodyUntilClose {
		ex.complete(up)
		return
	}
	if !up.headDone {
		ex.fail(up, failReset)
		return
	}
	up.detach()
	ex.truncated()
}

// tick enforces the first-byte timeout and resumes a paused stream once the client drained.
func (ex *exchange) tick(now int64, cfg *Config) {
	up := ex.up
	if up == nil || !ex.active {
		return
	}
	if !up.headDone && now > ex.firstByteBy {
		ex.fail(up, failTimeout)
		return
	}
	if up.headDone && !ex.paused && now-ex.lastByteAt > int64(cfg.StreamIdleTimeout) {
		ex.fail(up, failTimeout)
		return
	}
	if f := int64(cfg.FrozenAfter); f > 0 {
		w := ex.worker()
		switch {
		case up.headDone && !ex.paused && now-ex.lastByteAt > f && now-w.LastHeard() > f:
			// A stream that stopped, on a worker silent on every connection: frozen. It is
			// taken out, and this stream moves or ends as at StreamIdleTimeout.
			ex.cc.srv.core.Blame(w, now, 1, "worker ejected: frozen (no stream of it moved for frozen_after)")
			ex.fail(up, failTimeout)
			return
		case !up.headDone && w.EjectedFor(now) > 0 && now-w.LastHeard() > f:
			// Waiting for a first byte from a worker found frozen: try another now.
			ex.fail(up, failTimeout)
			return
		}
	}
	if ex.paused && ex.cc.c.OutboundBuffered() < lowWater && up.c != nil {
		ex.resume()
		ex.data(up)
		return
	}
	stalled := ex.paused && now-ex.pausedAt > int64(cfg.ClientStallTimeout)
	if !stalled && ex.headSent {
		stalled = !ex.clientTaking(now, cfg)
	}
	if stalled {
		// The client has not taken what was held for it, or acknowledged anything sent to
		// it, for the whole stall timeout: it is gone or stuck, and the engine's slot and
		// KV must not wait on it.
		cc := ex.cc
		cc.srv.metrics.aborted.WithLabelValues("slow_client").Inc()
		cc.srv.log.Debug("client stalled; request cancelled", "worker", ex.worker().ID, "stalled", time.Duration(now-min(ex.pausedAt, ex.ackedAt)))
		ex.abort()
		cc.state = stClosing
		_ = cc.c.Close()
	}
}

// ackCheckEvery is how often a streaming exchange asks the kernel what its client took.
const ackCheckEvery = int64(250 * time.Millisecond)

// clientTaking reports whether the client has acknowledged bytes sent to it within the stall
// timeout, or is owed none: the kernel's count of the bytes the client acknowledged
// (TCP_INFO), so that a client that stops reading is seen when its receive window closes,
// not once the kernel's send buffer towards it (megabytes) has filled behind it and the
// proxy's own buffer past its high-water mark. A connection that tells nothing (not TCP)
// is taking.
func (ex *exchange) clientTaking(now int64, cfg *Config) bool {
	if now-ex.ackCheckAt < ackCheckEvery {
		return true
	}
	ex.ackCheckAt = now
	fd := ex.cc.c.Fd()
	if fd < 0 {
		return true
	}
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return true
	}
	owed := info.Unacked > 0 || info.Notsent_bytes > 0 || ex.cc.c.OutboundBuffered() > 0
	if info.Bytes_acked != ex.acked || !owed || ex.ackedAt == 0 {
		ex.acked, ex.ackedAt = info.Bytes_acked, now
		return true
	}
	return now-ex.ackedAt <= int64(cfg.ClientStallTimeout)
}

// appendRouteHeader writes x-kvrelay-route: how the worker was chosen ("cost", "spread",
// "session", "slo", a picker's name), the prompt blocks it caches and the most any worker
// cached, and under a predicting policy the chosen worker's predicted TTFT, as
// "cost; overlap=12; best=12; ttft_ms=41.2", and "; fetch=w2" when the worker is told to
// pull the prompt's prefix from a peer, and "; waited_ms=250" when the request took a
// millisecond or more from its arrival to its dispatch (the admission queue, mostly).
// Exposed with x-kvrelay-worker, for debugging placement.
func appendRouteHeader(out []byte, d *route.Decision, waited int64) []byte {
	out = append(out, "x-kvrelay-route: "...)
	if d.Mode == "" {
		out = append(out, "none"...)
	} else {
		out = append(out, d.Mode...)
	}
	out = append(out, "; overlap="...)
	out = strconv.AppendInt(out, int64(d.Overlap), 10)
	out = append(out, "; best="...)
	out = strconv.AppendInt(out, int64(d.BestOverlap), 10)
	if d.HasPrediction {
		out = append(out, "; ttft_ms="...)
		out = strconv.AppendFloat(out, d.Prediction.TTFT*1e3, 'f', 1, 64)
	}
	if h := d.PeerFetch; h != nil && h != d.Worker {
		out = append(out, "; fetch="...)
		out = append(out, h.ID...)
	}
	if d.Recompute {
		out = append(out, "; load=0"...)
	}
	if waited >= 1e6 {
		out = append(out, "; waited_ms="...)
		out = strconv.AppendInt(out, waited/1e6, 10)
	}
	return append(out, "\r\n"...)
}

// appendDecisionHeader writes x-kvrelay-decision: every candidate of the request's decision
// with its predicted TTFT, queue and prefill in milliseconds and its cached blocks, the
// chosen one first, as "w1 ttft=41.2 queue=3.1 prefill=38.1 cached=375, w0 ttft=…";
// nothing under a policy that predicts nothing. Exposed with ExposeDecisionHeader.
func appendDecisionHeader(out []byte, r *decide.Request) []byte {
	n := len(out)
	out = append(out, "x-kvrelay-decision: "...)
	m := len(out)
	if out = r.AppendExplain(out); len(out) == m {
		return out[:n]
	}
	return append(out, "\r\n"...)
}
