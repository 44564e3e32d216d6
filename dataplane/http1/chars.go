package http1

// Character classes of RFC 9110 and RFC 9112, one table lookup per byte.
const (
	clTchar  = 1 << iota // token: field names, methods, chunk extension names
	clValue              // field-value, reason-phrase: HTAB, SP, VCHAR, obs-text
	clTarget             // request-target: VCHAR except '#'
	clHex                // HEXDIG
	clQdtext             // quoted-string content: HTAB, SP, VCHAR except '"' and '\', obs-text
	clHost               // Host: unreserved, pct-encoded, sub-delims, ':', '[', ']'
)

var class = func() (t [256]uint8) {
	for c := 0; c < 256; c++ {
		var m uint8
		switch {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
			m |= clTchar | clHost
		}
		switch c {
		case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~':
			m |= clTchar
		}
		switch c {
		case '-', '.', '_', '~', '%', '!', '$', '&', '\'', '(', ')', '*', '+', ',', ';', '=', ':', '[', ']':
			m |= clHost
		}
		if c == '\t' || c == ' ' || (c > 0x20 && c < 0x7f) || c >= 0x80 {
			m |= clValue
			if c != '"' && c != '\\' {
				m |= clQdtext
			}
		}
		if c > 0x20 && c < 0x7f && c != '#' {
			m |= clTarget
		}
		if (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') {
			m |= clHex
		}
		t[c] = m
	}
	return t
}()

func isTchar(c byte) bool { return class[c]&clTchar != 0 }

func lower(c byte) byte {
	if c >= 'A' && c <= 'Z' {
		return c + ('a' - 'A')
	}
	return c
}

// equalFold reports whether b equals the lowercase ASCII string s, ignoring ASCII case in b.
func equalFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := 0; i < len(b); i++ {
		if lower(b[i]) != s[i] {
			return false
		}
	}
	return true
}

// equalFoldAny reports whether a and b are equal ignoring ASCII case.
func equalFoldAny(a []byte, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		if lower(a[i]) != lower(b[i]) {
			return false
		}
	}
	return true
}

func isOWS(c byte) bool { return c == ' ' || c == '\t' }

func trimOWS(b []byte) []byte {
	for len(b) > 0 && isOWS(b[0]) {
		b = b[1:]
	}
	for len(b) > 0 && isOWS(b[len(b)-1]) {
		b = b[:len(b)-1]
	}
	return b
}

// nextElem returns the element of a comma-separated list that starts at v[i:], with OWS
// trimmed, and the index after its comma (len(v) at the end). Elements may be empty.
func nextElem(v []byte, i int) (elem []byte, next int) {
	j := i
	for j < len(v) && v[j] != ',' {
		j++
	}
	next = j
	if j < len(v) {
		next = j + 1
	}
	return trimOWS(v[i:j]), next
}

// parseDecimal parses a Content-Length value: 1*DIGIT without sign or whitespace, below
// 2^63. ok is false for anything else, including overflow.
func parseDecimal(b []byte) (n int64, ok bool) {
	if len(b) == 0 {
		return 0, false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		d := int64(c - '0')
		if n > (1<<63-1-d)/10 {
			return 0, false
		}
		n = n*10 + d
	}
	return n, true
}
