package http1

// Response is a parsed upstream response head. Every []byte field aliases the buffer given
// to ParseResponse and is valid only while that buffer is. A Response lives in a
// per-upstream-connection struct, is overwritten by each ParseResponse and is not safe for
// concurrent use.
type Response struct {
	// ProtoMinor is 1 for HTTP/1.1 and 0 for HTTP/1.0.
	ProtoMinor int
	// StatusCode is the three-digit status, 100 to 599 (101 is rejected: kvrelay never
	// asks an upstream to switch protocols).
	StatusCode int
	// Reason is the reason phrase, possibly empty.
	Reason []byte
	// Body is how the body is framed. A 1xx response has BodyNone and is followed by
	// another head on the same connection.
	Body BodyKind
	// ContentLength is the body length for BodyLength, 0 for BodyNone, -1 for BodyChunked
	// and BodyUntilClose. A HEAD response's Content-Length field stays in Header.
	ContentLength int64
	// KeepAlive reports whether the upstream connection may be reused after this response:
	// never for BodyUntilClose; HTTP/1.1 unless "Connection: close"; HTTP/1.0 only with
	// "Connection: keep-alive".
	KeepAlive bool
	// ContentType is the first content-type value, nil when absent ("text/event-stream"
	// marks a streamed completion).
	ContentType []byte
	// Header holds every header field line, in order.
	Header HeaderList
}

// Informational reports a 1xx interim response (100 Continue, 103 Early Hints).
func (r *Response) Informational() bool { return r.StatusCode < 200 }

func (r *Response) reset() {
	r.ProtoMinor, r.StatusCode, r.Reason = 0, 0, nil
	r.Body, r.ContentLength, r.KeepAlive, r.ContentType = BodyNone, 0, false, nil
	r.Header.n = 0
}

// ParseResponse parses the response head at the start of buf into resp. headRequest says
// whether the request was HEAD (its response never has a body).
//
// The results are those of ParseRequest: headLen > 0 for a complete head, 0 and nil when
// more bytes are needed, 0 and a response sentinel error (all 502) otherwise. Framing
// follows RFC 9112 §6.3: no body for HEAD, 1xx, 204 and 304; chunked when
// Transfer-Encoding is "chunked"; Content-Length; otherwise until close. Any other
// Transfer-Encoding, Transfer-Encoding together with Content-Length, and Transfer-Encoding
// on HTTP/1.0 are rejected rather than forwarded. lim.MaxHeadBytes and lim.MaxHeaders bound
// the head; lim.MaxBodyBytes bounds a Content-Length (use a negative value to stream
// responses of any size).
//
// resp aliases buf. ParseResponse does not allocate.
func ParseResponse(buf []byte, resp *Response, lim Limits, headRequest bool) (headLen int, err error) {
	resp.reset()
	maxHead := lim.headBytes()
	b := buf
	if len(b) > maxHead {
		b = b[:maxHead]
	}
	n, c := resp.parse(b, lim, headRequest)
	if c != cOK {
		return 0, c.resp()
	}
	if n == 0 {
		if len(buf) >= maxHead {
			return 0, ErrResponseHeadTooLarge
		}
		return 0, nil
	}
	return n, nil
}

func (r *Response) parse(b []byte, lim Limits, headRequest bool) (int, code) {
	// status-line = HTTP-version SP status-code SP [ reason-phrase ] CRLF
	if len(b) < 13 {
		// Fail early on a prefix that cannot become a status line.
		const pattern = "HTTP/1.x 000 "
		for i := 0; i < len(b); i++ {
			switch pattern[i] {
			case 'x':
				if b[i] != '0' && b[i] != '1' {
					return 0, cBadStatusLine
				}
			case '0':
				if b[i] < '0' || b[i] > '9' {
					return 0, cBadStatusLine
				}
			case ' ':
				if b[i] != ' ' {
					return 0, cBadStatusLine
				}
			default:
				if b[i] != pattern[i] {
					return 0, cBadStatusLine
				}
			}
		}
		return 0, cOK
	}
	if string(b[:7]) != "HTTP/1." || (b[7] != '0' && b[7] != '1') || b[8] != ' ' {
		return 0, cBadStatusLine
	}
	r.ProtoMinor = int(b[7] - '0')
	status := 0
	for _, c := range b[9:12] {
		if c < '0' || c > '9' {
			return 0, cBadStatusLine
		}
		status = status*10 + int(c-'0')
	}
	if status < 100 || status > 599 || status == 101 {
		return 0, cBadStatusLine
	}
	r.StatusCode = status
	p := 12
	if b[p] == ' ' {
		p++
	} else if b[p] != '\r' {
		// "HTTP/1.1 200\r\n": the SP before an empty reason is often left out; accept.
		return 0, cBadStatusLine
	}
	rs := p
	for p < len(b) && class[b[p]]&clValue != 0 {
		p++
	}
	switch {
	case p == len(b):
		return 0, cOK
	case b[p] == '\n':
		return 0, cBadLineEnding
	case b[p] != '\r':
		return 0, cBadStatusLine
	case p+1 == len(b):
		return 0, cOK
	case b[p+1] != '\n':
		return 0, cBadLineEnding
	}
	r.Reason = b[rs:p]
	p += 2

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
	return p, r.frame(&f, lim, headRequest)
}

func (r *Response) field(f *framing, name, value []byte) code {
	switch len(name) {
	case 10:
		if equalFold(name, "connection") {
			f.connection(value)
		}
	case 12:
		if equalFold(name, "content-type") && r.ContentType == nil {
			r.ContentType = value
		}
	case 14:
		if equalFold(name, "content-length") {
			return f.contentLength(value)
		}
	case 17:
		if equalFold(name, "transfer-encoding") {
			f.transferEncoding(value)
		}
	}
	return cOK
}

func (r *Response) frame(f *framing, lim Limits, headRequest bool) code {
	if f.te {
		if c := f.checkTE(r.ProtoMinor); c != cOK {
			return c
		}
	}
	r.KeepAlive = f.keepAlive(r.ProtoMinor)
	switch {
	case headRequest || r.StatusCode < 200 || r.StatusCode == 204 || r.StatusCode == 304:
		r.Body, r.ContentLength = BodyNone, 0
	case f.te:
		r.Body, r.ContentLength = BodyChunked, -1
	case f.clSeen:
		if max := lim.bodyBytes(); max >= 0 && f.cl > max {
			return cBodyTooLarge
		}
		r.Body, r.ContentLength = BodyLength, f.cl
	default:
		r.Body, r.ContentLength, r.KeepAlive = BodyUntilClose, -1, false
	}
	return cOK
}
