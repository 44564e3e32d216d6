package oai

import (
	"bytes"
	"encoding/binary"
	"math/bits"
)

// Sink receives one measurement. prometheus.Observer (a Histogram or Summary, or one taken
// from a vector with WithLabelValues ahead of time) satisfies it, so the proxy can feed its
// histograms without allocating.
type Sink interface{ Observe(float64) }

// Mode says how an Observer reads the response payload.
type Mode uint8

const (
	// ModeAuto decides on the first non-blank byte: '{' or '[' starts a JSON body, anything
	// else a server-sent event stream.
	ModeAuto Mode = iota
	ModeSSE       // text/event-stream: data: {...} events
	ModeJSON      // application/json: one body (a further top-level value counts as another)
)

// Usage is the token accounting the engine reported last (a usage chunk, the JSON body's
// usage, or a Responses API response.completed event).
type Usage struct {
	PromptTokens     int64 // prompt_tokens (input_tokens)
	CompletionTokens int64 // completion_tokens (output_tokens)
	CachedTokens     int64 // prompt_tokens_details.cached_tokens (input_tokens_details)
	Has              bool  // a usage object with prompt or completion tokens was seen
	HasCached        bool  // cached_tokens was reported (not null)
}

// ErrorInfo is an error object the engine sent: {"error":{...}} as a body or as an event
// (vLLM and SGLang mid-stream errors), vLLM's older flat {"object":"error",...}, a Responses
// API "error" event, or an SSE event named "error". Text is kept as the engine sent it, still
// JSON-escaped, cut to the capacity of fixed buffers.
type ErrorInfo struct {
	Seen    bool
	msg     [256]byte
	typ     [48]byte
	code    [32]byte
	msgLen  uint16
	typLen  uint8
	codeLen uint8
}

// Message returns the error message (JSON-escaped, at most 256 bytes). The slice points into
// the Observer and is valid until its next Reset.
func (e *ErrorInfo) Message() []byte { return e.msg[:e.msgLen] }

// Type returns the error type, e.g. "BadRequestError".
func (e *ErrorInfo) Type() []byte { return e.typ[:e.typLen] }

// Code returns the error code as sent: digits for a numeric code, the text of a string code.
func (e *ErrorInfo) Code() []byte { return e.code[:e.codeLen] }

// Status returns the code when it is an HTTP status (vLLM and SGLang send 400, 500, …), or 0.
func (e *ErrorInfo) Status() int {
	c := e.Code()
	if len(c) != 3 {
		return 0
	}
	n := 0
	for _, d := range c {
		if d < '0' || d > '9' {
			return 0
		}
		n = n*10 + int(d-'0')
	}
	if n < 100 || n > 599 {
		return 0
	}
	return n
}

// Observation is what an Observer has measured so far. It holds no pointers: copying it is
// a snapshot, and == compares two.
type Observation struct {
	Start      int64 // as given to Reset
	FirstToken int64 // time of the first content-bearing chunk (valid when Chunks > 0)
	LastToken  int64 // time of the latest content-bearing chunk
	Chunks     int   // content-bearing chunks: SSE events, or 1 for a JSON body with content
	ITLSum     int64 // sum of the gaps between consecutive content chunks
	ITLMax     int64 // largest such gap
	Events     int   // SSE data events carrying JSON, or JSON bodies, completed
	Done       bool  // data: [DONE] seen
	Usage      Usage
	Err        ErrorInfo
	Malformed  int   // events whose data was not one complete JSON value ([DONE] excepted)
	Truncated  int   // captured values cut to fit (finish reason, error text, numbers)
	Bytes      int64 // payload bytes fed
	Mode       Mode  // ModeSSE or ModeJSON once decided
	finish     [24]byte
	finishLen  uint8
}

// TTFT returns the time from Start to the first content chunk.
func (o *Observation) TTFT() (ns int64, ok bool) {
	if o.Chunks == 0 {
		return 0, false
	}
	return o.FirstToken - o.Start, true
}

// FinishReason returns the last finish_reason sent (for the Responses API, the response
// status: "completed", "incomplete", "failed"). The slice points into the Observation.
func (o *Observation) FinishReason() []byte { return o.finish[:o.finishLen] }

// Semantic positions in a response object, tracked per nesting level.
const (
	nNone uint8 = iota
	nRoot
	nChoices
	nChoice
	nDelta
	nContent   // a string whose non-emptiness makes the chunk content-bearing
	nToolCalls // a container any member of which makes the chunk content-bearing
	nFinish
	nUsage
	nUPrompt
	nUCompl
	nUDetails
	nUCached
	nError
	nErrMsg
	nErrType
	nErrCode
	nResp
	nStatus
	nRootType
	nRootObject
	nRootMsg
	nRootCode
	nRootDelta
	nOutput
	nOutputItem
	nOutputParts
	nOutputPart
)

func child(parent uint8, key []byte) uint8 {
	switch parent {
	case nRoot:
		switch string(key) {
		case "choices":
			return nChoices
		case "usage":
			return nUsage
		case "error":
			return nError
		case "type":
			return nRootType
		case "object":
			return nRootObject
		case "message":
			return nRootMsg
		case "code":
			return nRootCode
		case "delta":
			return nRootDelta
		case "response":
			return nResp
		case "status":
			return nStatus
		case "output":
			return nOutput
		}
	case nChoice:
		switch string(key) {
		case "delta", "message":
			return nDelta
		case "text":
			return nContent
		case "finish_reason":
			return nFinish
		}
	case nDelta:
		switch string(key) {
		case "content", "reasoning_content", "reasoning":
			return nContent
		case "tool_calls", "function_call":
			return nToolCalls
		}
	case nUsage:
		switch string(key) {
		case "prompt_tokens", "input_tokens":
			return nUPrompt
		case "completion_tokens", "output_tokens":
			return nUCompl
		case "prompt_tokens_details", "input_tokens_details":
			return nUDetails
		}
	case nUDetails:
		if string(key) == "cached_tokens" {
			return nUCached
		}
	case nError:
		switch string(key) {
		case "message":
			return nErrMsg
		case "type":
			return nErrType
		case "code":
			return nErrCode
		}
	case nResp:
		switch string(key) {
		case "usage":
			return nUsage
		case "status":
			return nStatus
		case "error":
			return nError
		}
	case nOutputItem:
		switch string(key) {
		case "content":
			return nOutputParts
		case "arguments":
			return nContent
		}
	case nOutputPart:
		if string(key) == "text" {
			return nContent
		}
	}
	return nNone
}

func elem(parent uint8) uint8 {
	switch parent {
	case nChoices:
		return nChoice
	case nOutput:
		return nOutputItem
	case nOutputParts:
		return nOutputPart
	}
	return nNone
}

// container returns the node a container opened at position n takes.
func container(n uint8, obj bool) uint8 {
	if obj {
		switch n {
		case nRoot, nChoice, nDelta, nUsage, nUDetails, nError, nResp, nOutputItem, nOutputPart, nToolCalls:
			return n
		}
		return nNone
	}
	switch n {
	case nChoices, nToolCalls, nOutput, nOutputParts:
		return n
	}
	return nNone
}

// captured reports whether a string or scalar at node n is copied.
func captured(n uint8) bool {
	switch n {
	case nFinish, nError, nUPrompt, nUCompl, nUCached, nErrMsg, nErrType, nErrCode, nStatus,
		nRootType, nRootObject, nRootMsg, nRootCode:
		return true
	}
	return false
}

const maxTrack = 64 // nesting levels whose positions are tracked; deeper ones are only counted

// JSON tokenizer states.
const (
	jValue  uint8 = iota // a value may start
	jKey                 // a key (or '}') may start
	jColon               // after a key
	jAfter               // after a value
	jString              // inside a string
	jEscape              // after a backslash inside a string
	jScalar              // inside a number or literal
)

// SSE line states.
const (
	lsStart  uint8 = iota // at the start of a line
	lsField               // reading a field name
	lsSpace               // after the colon: one optional space
	lsData                // in a data value
	lsEvent               // in an event value
	lsIgnore              // in a comment or a field kvrelay does not read
)

// Observer measures one response as its payload streams through the proxy, without
// buffering it: a resumable tokenizer follows SSE framing and JSON structure byte by byte and
// copies only the few short values it reports, so memory stays fixed (about 1.3 KiB) whatever
// the size of an event or body, and bytes may be fed split anywhere. An Observer is reused
// across requests (Reset) and allocates nothing. It is not safe for concurrent use; the
// Observation it returns is valid until the next Reset.
type Observer struct {
	// ITL, if set, receives each gap between consecutive content chunks, in seconds. It is
	// kept across Reset.
	ITL Sink

	res Observation

	// SSE framing.
	ls        uint8
	lastCR    bool
	fieldLen  uint8
	evNameLen uint8
	field     [8]byte
	evName    [8]byte
	evLines   int
	dlen      int
	dprefix   [8]byte

	// JSON tokenizer.
	st      uint8
	cur     uint8 // node of the value about to start
	strKey  bool
	strAny  bool
	strCap  bool // copying the current string or scalar into cap
	keyLen  uint8
	capLen  uint16
	capOver bool
	top     bool // a top-level value completed
	bad     bool // a byte that cannot appear in JSON at this point
	depth   int
	objBits uint64 // bit d-1: the container at depth d is an object
	node    [maxTrack + 1]uint8
	key     [32]byte
	cap     [256]byte

	// Per event.
	content     bool
	rootDelta   bool
	rootTypeLen uint8
	rootObjLen  uint8
	rootMsgLen  uint16
	rootCodeLen uint8
	statusLen   uint8
	rootType    [48]byte
	rootObj     [24]byte
	rootCode    [32]byte
	status      [24]byte
	rootMsg     [256]byte
}

// Reset prepares o for a new response whose request was sent at start (nanoseconds on the
// caller's monotonic clock; every Feed's now must use the same clock).
func (o *Observer) Reset(mode Mode, start int64) {
	itl := o.ITL
	*o = Observer{ITL: itl}
	o.res.Start = start
	o.res.Mode = mode
}

// Result returns the observations so far. The pointer stays valid, and is updated by later
// Feeds, until the next Reset.
func (o *Observer) Result() *Observation { return &o.res }

// Feed observes the next piece of the payload, received at now (nanoseconds, the clock of
// Reset). Pieces may split events, lines and JSON tokens anywhere. p is not retained.
func (o *Observer) Feed(p []byte, now int64) {
	o.res.Bytes += int64(len(p))
	if o.res.Mode == ModeAuto {
		k := 0
		for k < len(p) && isWS(p[k]) {
			k++
		}
		if k == len(p) {
			return
		}
		p = p[k:]
		if p[0] == '{' || p[0] == '[' {
			o.res.Mode = ModeJSON
		} else {
			o.res.Mode = ModeSSE
		}
	}
	if o.res.Mode == ModeJSON {
		o.json(p, now)
		return
	}
	o.sse(p, now)
}

func (o *Observer) sse(p []byte, now int64) {
	i := 0
	for i < len(p) {
		if o.lastCR {
			o.lastCR = false
			if p[i] == '\n' {
				i++
				continue
			}
		}
		switch o.ls {
		case lsStart:
			switch p[i] {
			case '\n', '\r':
				o.lastCR = p[i] == '\r'
				i++
				o.endEvent(now)
				continue
			case ':':
				o.ls = lsIgnore
				i++
				continue
			}
			o.ls, o.fieldLen = lsField, 0
		case lsField:
			c := p[i]
			switch c {
			case ':':
				i++
				o.ls = lsSpace
			case '\n', '\r':
				o.startValue(now) // a field with no colon has an empty value
				o.endLine(c)
				i++
			default:
				if int(o.fieldLen) < len(o.field) {
					o.field[o.fieldLen] = c
				}
				if o.fieldLen < 255 {
					o.fieldLen++
				}
				i++
			}
		case lsSpace:
			if p[i] == ' ' {
				i++
			}
			o.startValue(now)
		default:
			rest := p[i:]
			e := bytes.IndexByte(rest, '\n')
			if e < 0 {
				e = len(rest)
			}
			if r := bytes.IndexByte(rest[:e], '\r'); r >= 0 {
				e = r
			}
			seg := rest[:e]
			switch o.ls {
			case lsData:
				if len(seg) > 0 {
					for k := 0; k < len(seg) && o.dlen+k < len(o.dprefix); k++ {
						o.dprefix[o.dlen+k] = seg[k]
					}
					o.dlen += len(seg)
					o.json(seg, now)
				}
			case lsEvent:
				for _, c := range seg {
					if int(o.evNameLen) < len(o.evName) {
						o.evName[o.evNameLen] = c
					}
					if o.evNameLen < 255 {
						o.evNameLen++
					}
				}
			}
			i += e
			if i < len(p) {
				o.endLine(p[i])
				i++
			}
		}
	}
}

// startValue begins the value of the field just read.
func (o *Observer) startValue(now int64) {
	switch string(o.field[:min(int(o.fieldLen), len(o.field))]) {
	case "data":
		if o.fieldLen == 4 {
			if o.evLines > 0 {
				// Data lines join with "\n": JSON whitespace between the lines, which ends
				// a number or literal the line before left open.
				if o.dlen < len(o.dprefix) {
					o.dprefix[o.dlen] = '\n'
				}
				o.dlen++
				o.json(newline, now)
			}
			o.evLines++
			o.ls = lsData
			return
		}
	case "event":
		if o.fieldLen == 5 {
			o.evNameLen = 0
			o.ls = lsEvent
			return
		}
	}
	o.ls = lsIgnore
}

var newline = []byte{'\n'}

func (o *Observer) endLine(c byte) {
	o.lastCR = c == '\r'
	o.ls = lsStart
}

// endEvent dispatches the SSE event that a blank line ended, or a completed JSON body.
func (o *Observer) endEvent(now int64) {
	r := &o.res
	isErrEvent := o.evNameLen == 5 && string(o.evName[:5]) == "error"
	if r.Mode == ModeSSE && o.dlen == 0 {
		// No data (a comment block, an event name alone, or empty data lines): nothing to
		// dispatch, as in the EventSource algorithm.
		if isErrEvent {
			r.Err.Seen = true
		}
		o.resetEvent()
		return
	}
	if r.Mode == ModeSSE && o.dlen == 6 && string(o.dprefix[:6]) == "[DONE]" {
		r.Done = true
		o.resetEvent()
		return
	}
	if o.st == jScalar {
		o.endScalar(now)
	}
	r.Events++
	if !o.top || o.depth != 0 || o.bad || o.st == jString || o.st == jEscape {
		r.Malformed++
	}
	typ := o.rootType[:o.rootTypeLen]
	if isErrEvent || string(o.rootObj[:o.rootObjLen]) == "error" || string(typ) == "error" {
		r.Err.Seen = true
		if o.rootMsgLen > 0 {
			r.Err.msgLen = uint16(o.put(r.Err.msg[:], o.rootMsg[:o.rootMsgLen]))
		}
		if o.rootTypeLen > 0 && string(typ) != "error" {
			r.Err.typLen = uint8(o.put(r.Err.typ[:], typ))
		}
		if o.rootCodeLen > 0 {
			r.Err.codeLen = uint8(o.put(r.Err.code[:], o.rootCode[:o.rootCodeLen]))
		}
	}
	if o.rootDelta && len(typ) > len("response..delta") && string(typ[:9]) == "response." &&
		string(typ[len(typ)-6:]) == ".delta" {
		o.content = true
	}
	if o.statusLen > 0 && (r.Mode == ModeJSON || len(typ) > 9 && string(typ[:9]) == "response.") {
		r.finishLen = uint8(o.put(r.finish[:], o.status[:o.statusLen]))
	}
	if o.content {
		o.token(now)
	}
	o.resetEvent()
}

func (o *Observer) token(now int64) {
	r := &o.res
	if r.Chunks == 0 {
		r.FirstToken = now
	} else {
		gap := now - r.LastToken
		r.ITLSum += gap
		if gap > r.ITLMax {
			r.ITLMax = gap
		}
		if o.ITL != nil {
			o.ITL.Observe(float64(gap) / 1e9)
		}
	}
	r.LastToken = now
	r.Chunks++
}

func (o *Observer) resetEvent() {
	o.evLines, o.dlen, o.evNameLen = 0, 0, 0
	o.st, o.cur, o.depth, o.top, o.bad = jValue, nNone, 0, false, false
	o.strCap, o.capLen, o.capOver = false, 0, false
	o.content, o.rootDelta = false, false
	o.rootTypeLen, o.rootObjLen, o.rootMsgLen, o.rootCodeLen, o.statusLen = 0, 0, 0, 0, 0
}

// json runs the JSON tokenizer over seg, which holds no SSE line terminators.
func (o *Observer) json(seg []byte, now int64) {
	i := 0
	for i < len(seg) {
		switch o.st {
		case jString:
			rest := seg[i:]
			k := quoteOrBackslash(rest)
			if k >= 0 && rest[k] == '"' && o.strCap && !o.capOver && (o.strKey && o.keyLen == 0 || !o.strKey && o.capLen == 0) {
				// The whole string lies in this segment: use it in place.
				o.strAny = o.strAny || k > 0
				i += k + 1
				o.endString(now, rest[:k])
				continue
			}
			run := rest
			if k >= 0 {
				run = rest[:k]
			}
			if len(run) > 0 {
				o.strAny = true
				if o.strCap {
					o.captureRun(run)
				}
			}
			if k < 0 {
				return
			}
			i += k + 1
			if rest[k] == '"' {
				if o.strKey {
					o.endString(now, o.key[:o.keyLen])
				} else {
					o.endString(now, o.cap[:o.capLen])
				}
				continue
			}
			o.strAny = true
			o.capture('\\')
			o.st = jEscape
		case jEscape:
			o.capture(seg[i])
			i++
			o.st = jString
		case jScalar:
			j := i
			for j < len(seg) && isScalarByte(seg[j]) {
				j++
			}
			if o.strCap {
				o.captureRun(seg[i:j])
			}
			i = j
			if i < len(seg) {
				o.endScalar(now)
			}
		default:
			c := seg[i]
			i++
			switch c {
			case ' ', '\t', '\n', '\r':
			case '{', '[':
				o.open(c == '{')
			case '}', ']':
				o.close(now)
			case ',':
				o.comma()
			case ':':
				o.st = jValue
			case '"':
				if o.st == jKey || o.st == jValue && o.depth > 0 {
					// The common case, a whole key or a value string inside a container
					// that lies in this segment and has no escapes, in one step.
					rest := seg[i:]
					if k := quoteOrBackslash(rest); k >= 0 && rest[k] == '"' && o.wholeString(rest[:k]) {
						i += k + 1
						continue
					}
				}
				o.startString()
			default:
				if isScalarByte(c) && c != '.' && c != '+' {
					if o.st == jValue && o.depth > 0 {
						// A whole number or literal inside a container, in one step.
						j := i
						for j < len(seg) && isScalarByte(seg[j]) {
							j++
						}
						if j < len(seg) && j-i < len(o.cap) {
							o.wholeScalar(seg[i-1 : j])
							i = j
							continue
						}
					}
					o.startScalar(c)
				} else {
					o.bad = true
				}
			}
		}
	}
}

// wholeString takes a string, v its bytes between the quotes (no backslash among them), that
// starts where a key may (o.st == jKey) or where a value may inside a container (jValue,
// depth > 0): what startString, the string's bytes and endString would do, in one step. It
// reports false, changing nothing, for a value that is copied (o.cur captured): those take
// the general path.
func (o *Observer) wholeString(v []byte) bool {
	if o.st == jKey {
		o.cur = nNone
		if n := o.containerNode(); n != nNone && len(v) <= len(o.key) {
			o.cur = child(n, v)
		}
		o.st = jColon
		return true
	}
	if captured(o.cur) {
		return false
	}
	o.valueStart()
	o.text(len(v) > 0)
	o.st = jAfter
	return true
}

// text notes a value string at a node that only asks whether text is there (a content or a
// Responses delta string; nonEmpty says whether this one has any) and reports whether o.cur
// is such a node.
func (o *Observer) text(nonEmpty bool) bool {
	switch o.cur {
	case nContent:
		o.content = o.content || nonEmpty
	case nRootDelta:
		o.rootDelta = o.rootDelta || nonEmpty
	default:
		return false
	}
	return true
}

// wholeScalar takes a number or literal v, at most len(o.cap) bytes, that starts where a value may
// inside a container (jValue, depth > 0) and ends within the segment: what startScalar, its
// bytes and endScalar would do, in one step.
func (o *Observer) wholeScalar(v []byte) {
	o.valueStart()
	o.st = jAfter
	if captured(o.cur) && o.cur != nError && string(v) != "null" {
		o.capOver = false
		o.store(v)
	}
}

func (o *Observer) capture(c byte) {
	if o.strCap {
		o.captureRun([]byte{c})
	}
}

// captureRun copies a run of the current key, string or scalar into its buffer, up to the
// buffer's capacity.
func (o *Observer) captureRun(run []byte) {
	if o.strKey {
		n := copy(o.key[o.keyLen:], run)
		o.keyLen += uint8(n)
		if n < len(run) {
			o.capOver = true
		}
		return
	}
	n := copy(o.cap[o.capLen:], run)
	o.capLen += uint16(n)
	if n < len(run) {
		o.capOver = true
	}
}

// isScalarByte reports whether c can continue a number or literal.
func isScalarByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '+' || c == '-'
}

// quoteOrBackslash returns the index of the first '"' or '\\' in b, or -1.
func quoteOrBackslash(b []byte) int {
	i := 0
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		q := x ^ (lsb * '"')
		s := x ^ (lsb * '\\')
		if m := ((q-lsb)&^q | (s-lsb)&^s) & msb; m != 0 {
			return i + bits.TrailingZeros64(m)>>3
		}
	}
	for ; i < len(b); i++ {
		if b[i] == '"' || b[i] == '\\' {
			return i
		}
	}
	return -1
}

// containerNode is the node of the innermost container, or nNone past the tracked depth.
func (o *Observer) containerNode() uint8 {
	if o.depth >= 1 && o.depth <= maxTrack {
		return o.node[o.depth]
	}
	return nNone
}

// valueStart notes a value starting in the current container.
func (o *Observer) valueStart() {
	if o.containerNode() == nToolCalls {
		o.content = true
	}
}

func (o *Observer) open(obj bool) {
	if o.st == jAfter || o.st == jColon {
		o.bad = true
	}
	n := nNone
	if o.depth == 0 {
		if obj {
			n = nRoot
		}
	} else {
		o.valueStart()
		n = container(o.cur, obj)
	}
	if n == nError && obj {
		o.res.Err.Seen = true
	}
	o.depth++
	if o.depth <= maxTrack {
		bit := uint64(1) << (o.depth - 1)
		if obj {
			o.objBits |= bit
		} else {
			o.objBits &^= bit
		}
		o.node[o.depth] = n
	}
	if obj {
		o.st = jKey
	} else {
		o.st, o.cur = jValue, elem(n)
	}
}

func (o *Observer) close(now int64) {
	if o.depth == 0 {
		o.bad = true
		return
	}
	o.depth--
	o.st = jAfter
	if o.depth == 0 {
		o.valueDone(now)
	}
}

// valueDone notes a complete top-level value; a JSON body is dispatched then.
func (o *Observer) valueDone(now int64) {
	o.top = true
	if o.res.Mode == ModeJSON {
		o.endEvent(now)
	}
}

func (o *Observer) comma() {
	switch {
	case o.depth == 0:
		o.bad = true
	case o.depth <= maxTrack && o.objBits&(1<<(o.depth-1)) != 0:
		o.st = jKey
	default:
		o.st, o.cur = jValue, elem(o.containerNode())
	}
}

func (o *Observer) startString() {
	o.strAny, o.capLen, o.capOver = false, 0, false
	if o.st == jKey {
		o.strKey, o.keyLen = true, 0
		o.strCap = o.containerNode() != nNone
	} else {
		o.strKey = false
		if o.st == jAfter || o.st == jColon {
			o.bad = true
		}
		if o.depth > 0 {
			o.valueStart()
		}
		o.strCap = captured(o.cur)
	}
	o.st = jString
}

// endString ends the current string; v is its captured (raw) bytes when strCap is set.
func (o *Observer) endString(now int64, v []byte) {
	if o.strKey {
		o.cur = nNone
		if o.strCap && !o.capOver {
			o.cur = child(o.containerNode(), v)
		}
		o.st = jColon
		o.strCap = false
		return
	}
	o.st = jAfter
	if !o.text(o.strAny) && o.strCap {
		o.store(v)
	}
	o.strCap = false
	if o.depth == 0 {
		o.valueDone(now)
	}
}

func (o *Observer) startScalar(c byte) {
	if o.st == jAfter || o.st == jColon {
		o.bad = true
	}
	if o.depth > 0 {
		o.valueStart()
	}
	o.strKey = false
	o.capLen, o.capOver = 0, false
	o.strCap = captured(o.cur)
	o.st = jScalar
	o.capture(c)
}

func (o *Observer) endScalar(now int64) {
	o.st = jAfter
	if o.strCap && o.cur != nError {
		if v := o.cap[:o.capLen]; string(v) != "null" {
			o.store(v)
		}
	}
	o.strCap = false
	if o.depth == 0 {
		o.valueDone(now)
	}
}

// store puts the captured value v where its node says.
func (o *Observer) store(v []byte) {
	r := &o.res
	if o.capOver && o.cur != nRootType && o.cur != nRootObject && o.cur != nStatus {
		r.Truncated++
	}
	switch o.cur {
	case nFinish:
		r.finishLen = uint8(o.put(r.finish[:], v))
	case nError:
		// A bare string error ({"error": "..."}), as some servers send.
		r.Err.Seen = true
		r.Err.msgLen = uint16(o.put(r.Err.msg[:], v))
	case nUPrompt:
		if n, ok := parseInt(v); ok {
			r.Usage.PromptTokens, r.Usage.Has = n, true
		}
	case nUCompl:
		if n, ok := parseInt(v); ok {
			r.Usage.CompletionTokens, r.Usage.Has = n, true
		}
	case nUCached:
		if n, ok := parseInt(v); ok {
			r.Usage.CachedTokens, r.Usage.HasCached = n, true
		}
	case nErrMsg:
		r.Err.msgLen = uint16(o.put(r.Err.msg[:], v))
	case nErrType:
		r.Err.typLen = uint8(o.put(r.Err.typ[:], v))
	case nErrCode:
		r.Err.codeLen = uint8(o.put(r.Err.code[:], v))
	case nStatus:
		o.statusLen = uint8(copy(o.status[:], v))
	case nRootType:
		// Compared against known values only, so a longer type is not a loss worth counting.
		o.rootTypeLen = uint8(copy(o.rootType[:], v))
	case nRootObject:
		o.rootObjLen = uint8(copy(o.rootObj[:], v))
	case nRootMsg:
		o.rootMsgLen = uint16(o.put(o.rootMsg[:], v))
	case nRootCode:
		o.rootCodeLen = uint8(o.put(o.rootCode[:], v))
	}
}

// put copies v into dst and counts a value cut short.
func (o *Observer) put(dst, v []byte) int {
	if len(v) > len(dst) && !o.capOver {
		o.res.Truncated++
	}
	return copy(dst, v)
}
