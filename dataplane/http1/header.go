package http1

// Header is one header field line of a parsed head. Name and Value alias the buffer that
// was parsed: they are valid only as long as that buffer is (for a gnet Peek, until the
// callback returns) and must be copied to be kept. Value has leading and trailing
// whitespace removed; Name keeps the sender's case.
type Header struct {
	Name  []byte
	Value []byte
}

// HeaderList holds the header fields of one head in a fixed array of MaxHeaderCount
// entries, so parsing never allocates. It is reused by each parse and is not safe for
// concurrent use.
type HeaderList struct {
	n    int
	list [MaxHeaderCount]Header
}

// Len returns the number of header field lines.
func (h *HeaderList) Len() int { return h.n }

// All returns the header fields in the order received. The slice aliases the list and the
// parsed buffer: it is overwritten by the next parse.
func (h *HeaderList) All() []Header { return h.list[:h.n:h.n] }

// Get returns the value of the first field named name (compared ignoring ASCII case) or
// nil when there is none; a present but empty field returns an empty non-nil slice. It
// does not allocate.
func (h *HeaderList) Get(name string) []byte {
	for i := 0; i < h.n; i++ {
		if equalFoldAny(h.list[i].Name, name) {
			v := h.list[i].Value
			if v == nil {
				v = h.list[i].Name[:0]
			}
			return v
		}
	}
	return nil
}

func (h *HeaderList) add(name, value []byte, max int) bool {
	if h.n >= max {
		return false
	}
	h.list[h.n] = Header{Name: name, Value: value}
	h.n++
	return true
}

// parseField parses the field line at b[p:]. It returns next == 0 when the line is not
// complete yet, name == nil with next > 0 for the empty line that ends the head, and
// otherwise the field with next just past its CRLF.
//
// Strictness (RFC 9112 §2.2, §5): lines end in CRLF, a bare CR or LF is an error; a line
// starting with SP or HTAB (obs-fold) is an error; the name is a non-empty token followed
// directly by ':'; the value holds no control characters other than HTAB.
func parseField(b []byte, p int) (name, value []byte, next int, c code) {
	if p >= len(b) {
		return nil, nil, 0, cOK
	}
	switch b[p] {
	case '\r':
		if p+1 >= len(b) {
			return nil, nil, 0, cOK
		}
		if b[p+1] != '\n' {
			return nil, nil, 0, cBadLineEnding
		}
		return nil, nil, p + 2, cOK
	case '\n':
		return nil, nil, 0, cBadLineEnding
	case ' ', '\t':
		return nil, nil, 0, cObsFold
	}
	start := p
	for p < len(b) && class[b[p]]&clTchar != 0 {
		p++
	}
	if p == len(b) {
		return nil, nil, 0, cOK
	}
	if b[p] != ':' {
		if p > start && isOWS(b[p]) {
			return nil, nil, 0, cSpaceBeforeColon
		}
		return nil, nil, 0, cBadHeaderName
	}
	if p == start {
		return nil, nil, 0, cBadHeaderName
	}
	name = b[start:p]
	p++
	for p < len(b) && isOWS(b[p]) {
		p++
	}
	vs := p
	for p < len(b) && class[b[p]]&clValue != 0 {
		p++
	}
	if p == len(b) {
		return nil, nil, 0, cOK
	}
	switch b[p] {
	case '\r':
	case '\n':
		return nil, nil, 0, cBadLineEnding
	default:
		return nil, nil, 0, cBadHeaderValue
	}
	if p+1 == len(b) {
		return nil, nil, 0, cOK
	}
	if b[p+1] != '\n' {
		return nil, nil, 0, cBadLineEnding
	}
	ve := p
	for ve > vs && isOWS(b[ve-1]) {
		ve--
	}
	return name, b[vs:ve], p + 2, cOK
}

// framing collects the framing facts of one head while its fields are parsed.
type framing struct {
	clSeen         bool
	clValue        []byte
	cl             int64
	te             bool
	teChunked      bool // chunked appeared
	teChunkedLast  bool // the last coding so far is chunked
	teOther        bool // a coding other than chunked appeared
	teBad          bool // empty element or chunked applied twice
	connClose      bool
	connKeepAlive  bool
	hostCount      int
	expectContinue bool
	expectOther    bool
}

// contentLength records one Content-Length field. Repeated fields must carry the same
// value byte for byte; a list ("5, 5") in one field is rejected.
func (f *framing) contentLength(v []byte) code {
	n, ok := parseDecimal(v)
	if !ok {
		return cBadContentLength
	}
	if f.clSeen {
		if string(v) != string(f.clValue) {
			return cContentLengthDiffer
		}
		return cOK
	}
	f.clSeen, f.clValue, f.cl = true, v, n
	return cOK
}

// transferEncoding records one Transfer-Encoding field; codings accumulate across fields.
func (f *framing) transferEncoding(v []byte) {
	f.te = true
	for i := 0; ; {
		j := i
		for j < len(v) && v[j] != ',' {
			j++
		}
		switch e := trimOWS(v[i:j]); {
		case len(e) == 0:
			f.teBad = true
		case equalFold(e, "chunked"):
			if f.teChunked {
				f.teBad = true
			}
			f.teChunked, f.teChunkedLast = true, true
		default:
			f.teOther, f.teChunkedLast = true, false
		}
		if j == len(v) {
			return
		}
		i = j + 1
	}
}

// connection records one Connection field's options.
func (f *framing) connection(v []byte) {
	for i := 0; i < len(v); {
		e, next := nextElem(v, i)
		if equalFold(e, "close") {
			f.connClose = true
		} else if equalFold(e, "keep-alive") {
			f.connKeepAlive = true
		}
		i = next
	}
}

// keepAlive applies RFC 9112 §9.3: HTTP/1.1 persists unless "close", HTTP/1.0 closes
// unless "keep-alive" (and not "close").
func (f *framing) keepAlive(minor int) bool {
	if f.connClose {
		return false
	}
	return minor == 1 || f.connKeepAlive
}

// checkTE validates a Transfer-Encoding for HTTP/1.1: it must be exactly "chunked"
// (case-insensitive), possibly split over several fields.
func (f *framing) checkTE(minor int) code {
	switch {
	case minor == 0:
		// RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing.
		return cBadTransferEncoding
	case f.clSeen:
		return cAmbiguousLength
	case f.teBad, f.teChunked && !f.teChunkedLast:
		return cBadTransferEncoding
	case f.teOther:
		return cUnsupportedEncoding
	}
	return cOK
}
