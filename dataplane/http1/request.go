package http1

// BodyKind says how a message body is framed (RFC 9112 §6.3).
type BodyKind uint8

const (
	// BodyNone: the message has no body (a request without Content-Length or
	// Transfer-Encoding; a response to HEAD, 1xx, 204, 304).
	BodyNone BodyKind = iota
	// BodyLength: the body is exactly ContentLength bytes (possibly 0).
	BodyLength
	// BodyChunked: the body uses the chunked transfer coding; decode it with a
	// ChunkedDecoder (requests) or a ChunkScanner (responses).
	BodyChunked
	// BodyUntilClose: the body runs until the upstream closes the connection (responses
	// only, without Content-Length or Transfer-Encoding).
	BodyUntilClose
)

// String returns the kind's name.
func (k BodyKind) String() string {
	switch k {
	case BodyNone:
		return "none"
	case BodyLength:
		return "length"
	case BodyChunked:
		return "chunked"
	case BodyUntilClose:
		return "until-close"
	}
	return "invalid"
}

// Request is a parsed request head. Every []byte field aliases the buffer given to
// ParseRequest (except Path "/" for an absolute-form target without a path) and is valid
// only while that buffer is: copy what must outlive a gnet callback. A Request lives in a
// per-connection struct, is overwritten by each ParseRequest and is not safe for concurrent
// use.
type Request struct {
	// Method is the request method token, case preserved ("POST").
	Method []byte
	// Target is the request-target as sent: origin-form ("/v1/chat/completions?x=1"),
	// absolute-form ("http://host/v1/models") or "*" (OPTIONS only).
	Target []byte
	// Path is the target's path, RawQuery what follows its first '?' (without the '?'),
	// both still percent-encoded.
	Path, RawQuery []byte
	// Host is the authority of an absolute-form target, else the Host header (RFC 9112
	// §3.2.2); it may be empty for HTTP/1.0.
	Host []byte
	// ProtoMinor is 1 for HTTP/1.1 and 0 for HTTP/1.0.
	ProtoMinor int
	// Body is how the body is framed: BodyNone, BodyLength or BodyChunked.
	Body BodyKind
	// ContentLength is the body length for BodyLength, 0 for BodyNone, -1 for BodyChunked.
	ContentLength int64
	// KeepAlive reports whether the connection persists after this exchange: HTTP/1.1
	// unless "Connection: close", HTTP/1.0 only with "Connection: keep-alive".
	KeepAlive bool
	// Expect100 reports "Expect: 100-continue" on an HTTP/1.1 request: the client waits
	// for "100 Continue" (AppendContinue) before it sends the body.
	Expect100 bool

	// The first value of headers the proxy reads on every request, nil when absent.
	ContentType   []byte // content-type
	Authorization []byte // authorization
	RequestID     []byte // x-request-id
	SessionID     []byte // x-session-id
	Priority      []byte // x-kvrelay-priority
	OSL           []byte // x-kvrelay-osl
	SLOTTFT       []byte // x-slo-ttft-ms
	SLOTPOT       []byte // x-slo-tpot-ms
	Migrate       []byte // x-kvrelay-migrate
	FairnessID    []byte // x-llm-d-inference-fairness-id

	// Header holds every header field line, in order.
	Header HeaderList
}

func (r *Request) reset() {
	r.Method, r.Target, r.Path, r.RawQuery, r.Host = nil, nil, nil, nil, nil
	r.ProtoMinor, r.Body, r.ContentLength = 0, BodyNone, 0
	r.KeepAlive, r.Expect100 = false, false
	r.ContentType, r.Authorization, r.RequestID, r.SessionID, r.Priority, r.OSL = nil, nil, nil, nil, nil, nil
	r.SLOTTFT, r.SLOTPOT, r.Migrate, r.FairnessID = nil, nil, nil, nil
	r.Header.n = 0
}

var slash = []byte("/")

// ParseRequest parses the request head at the start of buf into req.
//
// It returns the head's length in bytes when buf holds a complete head (the body, if any,
// and any pipelined requests follow at buf[headLen:]), 0 and a nil error when more bytes
// are needed, or 0 and one of the request sentinel errors (StatusOf gives the status to
// answer; close the connection after answering). Empty lines (CRLF) before the request
// line are skipped and counted in headLen (RFC 9112 §2.2). Once buf holds
// lim.MaxHeadBytes bytes without a complete head it returns ErrHeadTooLarge; a
// Content-Length above lim.MaxBodyBytes is ErrBodyTooLarge.
//
// req aliases buf (see Request). ParseRequest does not allocate; it parses the head from
// the start on each call, which costs O(head) per call and lets the caller keep no state
// between partial reads.
func ParseRequest(buf []byte, req *Request, lim Limits) (headLen int, err error) {
	req.reset()
	maxHead := lim.headBytes()
	b := buf
	if len(b) > maxHead {
		b = b[:maxHead]
	}
	n, c := req.parse(b, lim)
	if c != cOK {
		return 0, c.req()
	}
	if n == 0 {
		if len(buf) >= maxHead {
			return 0, ErrHeadTooLarge
		}
		return 0, nil
	}
	return n, nil
}

func (r *Request) parse(b []byte, lim Limits) (int, code) {
	p := 0
	for p+1 < len(b) && b[p] == '\r' && b[p+1] == '\n' {
		p += 2
	}
	if p+1 == len(b) && b[p] == '\r' {
		return 0, cOK
	}

	// request-line = method SP request-target SP HTTP-version CRLF
	ms := p
	for p < len(b) && class[b[p]]&clTchar != 0 {
		p++
	}
	if p == len(b) {
		return 0, cOK
	}
	if b[p] != ' ' || p == ms {
		return 0, cBadRequestLine
	}
	r.Method = b[ms:p]
	p++
	ts := p
	for p < len(b) && class[b[p]]&clTarget != 0 {
		if b[p] == '%' {
			// pct-encoded = "%" HEXDIG HEXDIG (RFC 3986 §2.1)
			if p+1 < len(b) && class[b[p+1]]&clHex == 0 || p+2 < len(b) && class[b[p+2]]&clHex == 0 {
				return 0, cBadTarget
			}
			p += 2
			if p >= len(b) {
				return 0, cOK
			}
		}
		p++
	}
	if p == len(b) {
		return 0, cOK
	}
	if b[p] != ' ' {
		if b[p] == '#' || b[p] >= 0x7f {
			return 0, cBadTarget
		}
		return 0, cBadRequestLine
	}
	if p == ts {
		return 0, cBadRequestLine
	}
	target := b[ts:p]
	p++
	minor, n, c := parseVersion(b[p:])
	if c != cOK || n == 0 {
		return 0, c
	}
	p += n
	r.ProtoMinor = minor
	if c := r.parseTarget(target); c != cOK {
		return 0, c
	}

	var f framing
	maxHeaders := lim.headers()
	for {
		name, value, next, c := parseField(b, p)
		if c != cOK || next == 0 {
			return 0, c
		}
		p = next
		if name == nil {
			break
		}
		if !r.Header.add(name, value, maxHeaders) {
			return 0, cTooManyHeaders
		}
		if c := r.field(&f, name, value); c != cOK {
			return 0, c
		}
	}
	return p, r.frame(&f, lim)
}

// parseVersion parses "HTTP/1.1" or "HTTP/1.0" and the CRLF after it at the start of b. It
// returns n == 0 and cOK when b is a valid but incomplete prefix.
func parseVersion(b []byte) (minor, n int, c code) {
	const pattern = "HTTP/0.0"
	for i := 0; i < len(b) && i < len(pattern); i++ {
		ok := b[i] == pattern[i]
		if pattern[i] == '0' {
			ok = b[i] >= '0' && b[i] <= '9'
		}
		if !ok {
			if b[i] == '\r' || b[i] == '\n' {
				return 0, 0, cBadRequestLine
			}
			return 0, 0, cBadVersion
		}
	}
	switch {
	case len(b) < 9:
		return 0, 0, cOK
	case b[8] == '\n':
		return 0, 0, cBadLineEnding
	case b[8] != '\r':
		return 0, 0, cBadVersion
	case len(b) == 9:
		return 0, 0, cOK
	case b[9] != '\n':
		return 0, 0, cBadLineEnding
	}
	if b[5] != '1' || (b[7] != '0' && b[7] != '1') {
		return 0, 0, cVersionNotSupported
	}
	return int(b[7] - '0'), 10, cOK
}

// parseTarget splits the request-target. Accepted: origin-form, absolute-form with an
// http or https scheme and a non-empty authority without userinfo, and "*" for OPTIONS.
// CONNECT (authority-form) is not implemented: kvrelay does not tunnel.
func (r *Request) parseTarget(t []byte) code {
	r.Target = t
	if string(r.Method) == "CONNECT" {
		return cMethodNotImplemented
	}
	switch {
	case t[0] == '/':
		r.splitQuery(t)
		return cOK
	case len(t) == 1 && t[0] == '*':
		if string(r.Method) != "OPTIONS" {
			return cBadTarget
		}
		r.Path = t
		return cOK
	}
	var rest []byte
	switch {
	case len(t) > 7 && equalFold(t[:7], "http://"):
		rest = t[7:]
	case len(t) > 8 && equalFold(t[:8], "https://"):
		rest = t[8:]
	default:
		return cBadTarget
	}
	i := 0
	for i < len(rest) && rest[i] != '/' && rest[i] != '?' {
		i++
	}
	if !validAuthority(rest[:i]) {
		return cBadTarget
	}
	r.Host = rest[:i]
	if i == len(rest) || rest[i] == '?' {
		r.Path = slash
		if i < len(rest) {
			r.RawQuery = rest[i+1:]
		}
		return cOK
	}
	r.splitQuery(rest[i:])
	return cOK
}

// validAuthority accepts host [":" port] where host is a bracketed IPv6 literal or a
// reg-name / IPv4 address of unreserved and sub-delim characters, and port is digits.
// Userinfo ('@') and percent-encoding are rejected: no client of kvrelay needs them and
// engines parse them differently.
func validAuthority(a []byte) bool {
	if len(a) == 0 {
		return false
	}
	i := 0
	if a[0] == '[' {
		for i = 1; i < len(a) && a[i] != ']'; i++ {
		}
		if i == len(a) || !validIPv6(a[1:i]) {
			return false
		}
		i++
	} else {
		for ; i < len(a) && a[i] != ':'; i++ {
			if c := a[i]; class[c]&clHost == 0 || c == '%' || c == '[' || c == ']' {
				return false
			}
		}
		if i == 0 {
			return false
		}
	}
	if i == len(a) {
		return true
	}
	if a[i] != ':' {
		return false
	}
	for _, c := range a[i+1:] {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// validIPv6 accepts the text forms of RFC 4291 §2.2: eight groups of one to four hex
// digits, at most one "::" standing for at least one zero group, and an optional dotted
// IPv4 tail. Zone identifiers are not accepted.
func validIPv6(s []byte) bool {
	groups, ellipsis, i := 0, false, 0
	if len(s) >= 2 && s[0] == ':' && s[1] == ':' {
		ellipsis, i = true, 2
	}
	for i < len(s) {
		j := i
		for j < len(s) && class[s[j]]&clHex != 0 {
			j++
		}
		if j < len(s) && s[j] == '.' {
			if !validIPv4(s[i:]) {
				return false
			}
			groups += 2
			break
		}
		if j == i || j-i > 4 {
			return false
		}
		groups++
		if j == len(s) {
			break
		}
		if s[j] != ':' || j+1 == len(s) {
			return false
		}
		i = j + 1
		if s[i] == ':' {
			if ellipsis {
				return false
			}
			ellipsis = true
			i++
		}
	}
	if ellipsis {
		return groups < 8
	}
	return groups == 8
}

// validIPv4 accepts four decimal octets without leading zeros.
func validIPv4(s []byte) bool {
	for k := 0; k < 4; k++ {
		j, v := 0, 0
		for j < len(s) && j < 4 && s[j] >= '0' && s[j] <= '9' {
			v = v*10 + int(s[j]-'0')
			j++
		}
		if j == 0 || j > 3 || v > 255 || (j > 1 && s[0] == '0') {
			return false
		}
		s = s[j:]
		if k < 3 {
			if len(s) == 0 || s[0] != '.' {
				return false
			}
			s = s[1:]
		}
	}
	return len(s) == 0
}

func (r *Request) splitQuery(t []byte) {
	for i, c := range t {
		if c == '?' {
			r.Path, r.RawQuery = t[:i], t[i+1:]
			return
		}
	}
	r.Path = t
}

// field records the framing facts and the fast-lookup headers of one field line.
func (r *Request) field(f *framing, name, value []byte) code {
	switch len(name) {
	case 4:
		if equalFold(name, "host") {
			f.hostCount++
			if f.hostCount > 1 {
				return cBadHost
			}
			for _, c := range value {
				if class[c]&clHost == 0 {
					return cBadHost
				}
			}
			if r.Host == nil {
				r.Host = value
			}
		}
	case 6:
		if equalFold(name, "expect") {
			if equalFold(value, "100-continue") {
				f.expectContinue = true
			} else {
				f.expectOther = true
			}
		}
	case 10:
		if equalFold(name, "connection") {
			f.connection(value)
		}
	case 12:
		switch {
		case equalFold(name, "content-type"):
			if r.ContentType == nil {
				r.ContentType = value
			}
		case equalFold(name, "x-request-id"):
			if r.RequestID == nil {
				r.RequestID = value
			}
		case equalFold(name, "x-session-id"):
			if r.SessionID == nil {
				r.SessionID = value
			}
		}
	case 13:
		switch {
		case equalFold(name, "authorization"):
			if r.Authorization == nil {
				r.Authorization = value
			}
		case equalFold(name, "x-kvrelay-osl"):
			if r.OSL == nil {
				r.OSL = value
			}
		case equalFold(name, "x-slo-ttft-ms"):
			if r.SLOTTFT == nil {
				r.SLOTTFT = value
			}
		case equalFold(name, "x-slo-tpot-ms"):
			if r.SLOTPOT == nil {
				r.SLOTPOT = value
			}
		}
	case 14:
		if equalFold(name, "content-length") {
			return f.contentLength(value)
		}
	case 29:
		if equalFold(name, "x-llm-d-inference-fairness-id") && r.FairnessID == nil {
			r.FairnessID = value
		}
	case 17:
		switch {
		case equalFold(name, "transfer-encoding"):
			f.transferEncoding(value)
		case equalFold(name, "x-kvrelay-migrate"):
			if r.Migrate == nil {
				r.Migrate = value
			}
		}
	case 18:
		if equalFold(name, "x-kvrelay-priority") {
			if r.Priority == nil {
				r.Priority = value
			}
		}
	}
	return cOK
}

// frame decides the body framing and connection semantics once the head is complete.
func (r *Request) frame(f *framing, lim Limits) code {
	if r.ProtoMinor == 1 && f.hostCount == 0 {
		return cMissingHost
	}
	if f.expectOther {
		return cExpectation
	}
	r.Expect100 = f.expectContinue && r.ProtoMinor == 1
	r.KeepAlive = f.keepAlive(r.ProtoMinor)
	switch {
	case f.te:
		if c := f.checkTE(r.ProtoMinor); c != cOK {
			return c
		}
		r.Body, r.ContentLength = BodyChunked, -1
	case f.clSeen:
		if max := lim.bodyBytes(); max >= 0 && f.cl > max {
			return cBodyTooLarge
		}
		r.Body, r.ContentLength = BodyLength, f.cl
	}
	return cOK
}
