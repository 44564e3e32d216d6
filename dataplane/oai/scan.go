package oai

import (
	"bytes"
	"encoding/binary"
	"math/bits"
	"unicode/utf8"
)

// MaxDepth is the deepest nesting of arrays and objects Parse accepts. CPython's json module
// gives up near its recursion limit (about 990 levels with the default limit of 1000), so a
// body the engine would accept is never rejected here; the fixed bound keeps the scanner's
// stack a constant 128 bytes.
const MaxDepth = 1024

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// specialMask flags, in the high bit of each byte, the bytes of x that end a fast run inside a
// JSON string: '"', '\\', control characters (< 0x20) and non-ASCII bytes. The lowest flagged
// byte is always exact (borrows only propagate upwards), which is all the caller relies on.
func specialMask(x uint64) uint64 {
	q := x ^ (lsb * '"')
	s := x ^ (lsb * '\\')
	return ((q-lsb)&^q | (s-lsb)&^s | (x-lsb*0x20)&^x | x) & msb
}

func isWS(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func hexVal(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// hex4 decodes the four hex digits at b[i:i+4], or returns -1.
func hex4(b []byte, i int) int {
	if i+4 > len(b) {
		return -1
	}
	a, c, d, e := hexVal(b[i]), hexVal(b[i+1]), hexVal(b[i+2]), hexVal(b[i+3])
	if a < 0 || c < 0 || d < 0 || e < 0 {
		return -1
	}
	return a<<12 | c<<8 | d<<4 | e
}

// strScan is what scanString learns about one string.
type strScan struct {
	start, end int  // raw content b[start:end], quotes excluded
	esc        bool // at least one backslash escape
	lone       bool // an unpaired UTF-16 surrogate escape (\uD800-\uDFFF)
}

// scanString validates the JSON string whose opening quote is at b[i] with the rules of
// Python's json module (strict mode): escapes limited to \" \\ \/ \b \f \n \r \t \uXXXX, no raw
// control characters. Bytes must be valid UTF-8 (Python decodes the whole body first). It
// returns the index just past the closing quote, or a negative value with a reason.
func scanString(b []byte, i int, s *strScan) (int, string) {
	i++
	s.start, s.esc, s.lone = i, false, false
	for {
		for i+8 <= len(b) {
			m := specialMask(binary.LittleEndian.Uint64(b[i:]))
			if m != 0 {
				i += bits.TrailingZeros64(m) >> 3
				break
			}
			i += 8
		}
		if i >= len(b) {
			return -1, "unterminated string"
		}
		c := b[i]
		switch {
		case c == '"':
			s.end = i
			return i + 1, ""
		case c == '\\':
			s.esc = true
			if i+1 >= len(b) {
				return -1, "unterminated string"
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				r := hex4(b, i+2)
				if r < 0 {
					return -i - 1, "invalid \\uXXXX escape"
				}
				i += 6
				if r >= 0xD800 && r < 0xDC00 {
					if i+6 <= len(b) && b[i] == '\\' && b[i+1] == 'u' {
						if lo := hex4(b, i+2); lo >= 0xDC00 && lo < 0xE000 {
							i += 6
							continue
						}
					}
					s.lone = true
				} else if r >= 0xDC00 && r < 0xE000 {
					s.lone = true
				}
			default:
				return -i - 1, "invalid \\escape"
			}
		case c < 0x20:
			return -i - 1, "invalid control character in string"
		case c < 0x80:
			i++ // a false positive of the fast path: an ordinary byte
		default:
			r, n := utf8.DecodeRune(b[i:])
			if r == utf8.RuneError && n <= 1 {
				return -i - 1, "invalid UTF-8 in string"
			}
			i += n
		}
	}
}

// appendUnescaped appends the text of a raw string that scanString accepted. An unpaired
// surrogate becomes U+FFFD (callers that must match the engine reject those before).
func appendUnescaped(dst, raw []byte) []byte {
	for len(raw) > 0 {
		k := bytes.IndexByte(raw, '\\')
		if k < 0 {
			return append(dst, raw...)
		}
		dst = append(dst, raw[:k]...)
		raw = raw[k:]
		c := raw[1]
		switch c {
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r := rune(hex4(raw, 2))
			raw = raw[6:]
			if r >= 0xD800 && r < 0xDC00 {
				if len(raw) >= 6 && raw[0] == '\\' && raw[1] == 'u' {
					if lo := rune(hex4(raw, 2)); lo >= 0xDC00 && lo < 0xE000 {
						r = 0x10000 + (r-0xD800)<<10 + (lo - 0xDC00)
						raw = raw[6:]
						dst = utf8.AppendRune(dst, r)
						continue
					}
				}
				r = utf8.RuneError
			} else if r >= 0xDC00 && r < 0xE000 {
				r = utf8.RuneError
			}
			dst = utf8.AppendRune(dst, r)
			continue
		default: // '"', '\\', '/'
			dst = append(dst, c)
		}
		raw = raw[2:]
	}
	return dst
}

// scanNumber validates the number at b[i] with Python's grammar
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)? and returns its end and whether it is an
// integer literal (no fraction, no exponent); end < 0 means invalid.
func scanNumber(b []byte, i int) (end int, isInt bool) {
	if i < len(b) && b[i] == '-' {
		i++
	}
	if i >= len(b) {
		return -1, false
	}
	switch c := b[i]; {
	case c == '0':
		i++
	case c >= '1' && c <= '9':
		i++
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		return -1, false
	}
	isInt = true
	if i < len(b) && b[i] == '.' {
		j := i + 1
		for j < len(b) && b[j] >= '0' && b[j] <= '9' {
			j++
		}
		if j == i+1 {
			// Python's NUMBER_RE stops before a '.' with no digits; what follows is then
			// extra data, which is an error at every position a number can stand.
			return -1, false
		}
		i, isInt = j, false
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		j := i + 1
		if j < len(b) && (b[j] == '+' || b[j] == '-') {
			j++
		}
		k := j
		for k < len(b) && b[k] >= '0' && b[k] <= '9' {
			k++
		}
		if k == j {
			return -1, false
		}
		i, isInt = k, false
	}
	return i, isInt
}

// literal reports the length of the JSON literal (Python's set: true, false, null, NaN,
// Infinity, -Infinity) at b[i], or 0.
func literal(b []byte, i int) int {
	var lit string
	switch b[i] {
	case 't':
		lit = "true"
	case 'f':
		lit = "false"
	case 'n':
		lit = "null"
	case 'N':
		lit = "NaN"
	case 'I':
		lit = "Infinity"
	case '-':
		lit = "-Infinity"
	default:
		return 0
	}
	if len(b)-i >= len(lit) && string(b[i:i+len(lit)]) == lit {
		return len(lit)
	}
	return 0
}
