package http1

import "strconv"

// Text is a string or a byte slice: the writers take constants and parsed values alike
// without a conversion (and so without an allocation).
type Text interface{ ~string | ~[]byte }

// Special contentLength values for AppendResponseHead and AppendRequestHead.
const (
	// LengthChunked frames the body with "Transfer-Encoding: chunked" (AppendChunk,
	// AppendLastChunk). Only for HTTP/1.1 peers.
	LengthChunked int64 = -1
	// LengthUntilClose sends no length: the body ends when the proxy closes the connection
	// (a stream to an HTTP/1.0 client). It implies "Connection: close".
	LengthUntilClose int64 = -2
)

// The writers append to a caller-owned buffer and return it; they never allocate unless dst
// must grow. Names passed to them must be valid header field names (constants, or names
// from a parsed head); values are sanitized (control characters other than HTAB become SP)
// so a value that came from a peer cannot split a head.

// AppendStatusLine appends "HTTP/1.1 <status> <reason>\r\n" with the standard reason phrase
// (StatusText). A status outside 100..999 is written as 500.
func AppendStatusLine(dst []byte, status int) []byte {
	if status < 100 || status > 999 {
		status = 500
	}
	dst = append(dst, "HTTP/1.1 "...)
	dst = strconv.AppendUint(dst, uint64(status), 10)
	dst = append(dst, ' ')
	dst = append(dst, StatusText(status)...)
	return append(dst, "\r\n"...)
}

// AppendHeader appends "name: value\r\n".
func AppendHeader[T Text](dst []byte, name string, value T) []byte {
	dst = append(dst, name...)
	dst = append(dst, ": "...)
	return appendValue(dst, value)
}

func appendValue[T Text](dst []byte, v T) []byte {
	clean := true
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < ' ' && c != '\t') || c == 0x7f {
			clean = false
			break
		}
	}
	if clean {
		dst = append(dst, v...)
	} else {
		for i := 0; i < len(v); i++ {
			c := v[i]
			if (c < ' ' && c != '\t') || c == 0x7f {
				c = ' '
			}
			dst = append(dst, c)
		}
	}
	return append(dst, "\r\n"...)
}

// AppendContentLength appends "Content-Length: n\r\n".
func AppendContentLength(dst []byte, n int64) []byte {
	dst = append(dst, "Content-Length: "...)
	dst = strconv.AppendInt(dst, n, 10)
	return append(dst, "\r\n"...)
}

// AppendEndHead appends the empty line that ends a head.
func AppendEndHead(dst []byte) []byte { return append(dst, "\r\n"...) }

// AppendResponseHead appends a status line, Content-Type (unless contentType is empty),
// the framing field (Content-Length for contentLength >= 0, "Transfer-Encoding: chunked"
// for LengthChunked, nothing for LengthUntilClose) and "Connection: keep-alive" or
// "Connection: close". The head is left open: append further fields with AppendHeader and
// finish with AppendEndHead.
func AppendResponseHead[T Text](dst []byte, status int, contentType T, contentLength int64, keepAlive bool) []byte {
	dst = AppendStatusLine(dst, status)
	if len(contentType) > 0 {
		dst = AppendHeader(dst, "Content-Type", contentType)
	}
	dst = appendFraming(dst, contentLength)
	if keepAlive && contentLength != LengthUntilClose {
		return append(dst, "Connection: keep-alive\r\n"...)
	}
	return append(dst, "Connection: close\r\n"...)
}

func appendFraming(dst []byte, contentLength int64) []byte {
	switch {
	case contentLength >= 0:
		return AppendContentLength(dst, contentLength)
	case contentLength == LengthChunked:
		return append(dst, "Transfer-Encoding: chunked\r\n"...)
	}
	return dst
}

// AppendChunk appends data as one chunk: hex size, CRLF, data, CRLF. Empty data appends
// nothing (an empty chunk would end the body; use AppendLastChunk).
func AppendChunk(dst, data []byte) []byte {
	if len(data) == 0 {
		return dst
	}
	dst = strconv.AppendUint(dst, uint64(len(data)), 16)
	dst = append(dst, "\r\n"...)
	dst = append(dst, data...)
	return append(dst, "\r\n"...)
}

// AppendLastChunk appends the last chunk and an empty trailer section: "0\r\n\r\n".
func AppendLastChunk(dst []byte) []byte { return append(dst, "0\r\n\r\n"...) }

// Continue is the interim response that answers "Expect: 100-continue".
const Continue = "HTTP/1.1 100 Continue\r\n\r\n"

// AppendContinue appends Continue.
func AppendContinue(dst []byte) []byte { return append(dst, Continue...) }

// AppendRequestHead appends the head of a request to an upstream: the request line
// (HTTP/1.1), Host, the framing field (Content-Length for contentLength >= 0, chunked for
// LengthChunked; a request without a body passes 0) and "Connection: keep-alive" (upstream
// connections are pooled). The head is left open: append forwarded fields
// (AppendForwardHeaders, AppendHeader) and finish with AppendEndHead. method and target
// must be valid (a parsed Request's are).
func AppendRequestHead[M, T, H Text](dst []byte, method M, target T, host H, contentLength int64) []byte {
	dst = append(dst, method...)
	dst = append(dst, ' ')
	dst = append(dst, target...)
	dst = append(dst, " HTTP/1.1\r\nHost: "...)
	dst = appendValue(dst, host)
	dst = appendFraming(dst, contentLength)
	return append(dst, "Connection: keep-alive\r\n"...)
}

// AppendForwardHeaders appends the fields of h whose names are in allow (compared ignoring
// ASCII case), in order, repeats included. Hop-by-hop and framing fields (Connection,
// Keep-Alive, Proxy-Connection, Proxy-Authenticate, Proxy-Authorization, TE, Trailer,
// Transfer-Encoding, Upgrade, Host, Content-Length, Expect) are never forwarded: the
// writer of the new head sets those itself. Fields that a Connection header nominates as
// hop-by-hop are not tracked: list only end-to-end names in allow.
func AppendForwardHeaders(dst []byte, h []Header, allow []string) []byte {
	for i := range h {
		name := h[i].Name
		if hopByHop(name) {
			continue
		}
		for _, a := range allow {
			if equalFoldAny(name, a) {
				dst = append(dst, name...)
				dst = append(dst, ": "...)
				dst = appendValue(dst, h[i].Value)
				break
			}
		}
	}
	return dst
}

// DefaultForwardHeaders are the request fields the proxy passes to engines by default.
var DefaultForwardHeaders = []string{
	"content-type", "accept", "authorization", "user-agent", "x-request-id",
	"traceparent", "tracestate",
}

func hopByHop(name []byte) bool {
	switch len(name) {
	case 2:
		return equalFold(name, "te")
	case 4:
		return equalFold(name, "host")
	case 6:
		return equalFold(name, "expect")
	case 7:
		return equalFold(name, "trailer") || equalFold(name, "upgrade")
	case 10:
		return equalFold(name, "connection") || equalFold(name, "keep-alive")
	case 14:
		return equalFold(name, "content-length")
	case 16:
		return equalFold(name, "proxy-connection")
	case 17:
		return equalFold(name, "transfer-encoding")
	case 18:
		return equalFold(name, "proxy-authenticate")
	case 19:
		return equalFold(name, "proxy-authorization")
	}
	return false
}

// StatusText returns the standard reason phrase for status (RFC 9110 §15 and the IANA
// registry), or "" for an unknown code.
func StatusText(status int) string {
	switch status {
	case 100:
		return "Continue"
	case 101:
		return "Switching Protocols"
	case 102:
		return "Processing"
	case 103:
		return "Early Hints"
	case 200:
		return "OK"
	case 201:
		return "Created"
	case 202:
		return "Accepted"
	case 203:
		return "Non-Authoritative Information"
	case 204:
		return "No Content"
	case 205:
		return "Reset Content"
	case 206:
		return "Partial Content"
	case 207:
		return "Multi-Status"
	case 208:
		return "Already Reported"
	case 226:
		return "IM Used"
	case 300:
		return "Multiple Choices"
	case 301:
		return "Moved Permanently"
	case 302:
		return "Found"
	case 303:
		return "See Other"
	case 304:
		return "Not Modified"
	case 305:
		return "Use Proxy"
	case 307:
		return "Temporary Redirect"
	case 308:
		return "Permanent Redirect"
	case 400:
		return "Bad Request"
	case 401:
		return "Unauthorized"
	case 402:
		return "Payment Required"
	case 403:
		return "Forbidden"
	case 404:
		return "Not Found"
	case 405:
		return "Method Not Allowed"
	case 406:
		return "Not Acceptable"
	case 407:
		return "Proxy Authentication Required"
	case 408:
		return "Request Timeout"
	case 409:
		return "Conflict"
	case 410:
		return "Gone"
	case 411:
		return "Length Required"
	case 412:
		return "Precondition Failed"
	case 413:
		return "Content Too Large"
	case 414:
		return "URI Too Long"
	case 415:
		return "Unsupported Media Type"
	case 416:
		return "Range Not Satisfiable"
	case 417:
		return "Expectation Failed"
	case 418:
		return "I'm a teapot"
	case 421:
		return "Misdirected Request"
	case 422:
		return "Unprocessable Content"
	case 423:
		return "Locked"
	case 424:
		return "Failed Dependency"
	case 425:
		return "Too Early"
	case 426:
		return "Upgrade Required"
	case 428:
		return "Precondition Required"
	case 429:
		return "Too Many Requests"
	case 431:
		return "Request Header Fields Too Large"
	case 451:
		return "Unavailable For Legal Reasons"
	case 500:
		return "Internal Server Error"
	case 501:
		return "Not Implemented"
	case 502:
		return "Bad Gateway"
	case 503:
		return "Service Unavailable"
	case 504:
		return "Gateway Timeout"
	case 505:
		return "HTTP Version Not Supported"
	case 506:
		return "Variant Also Negotiates"
	case 507:
		return "Insufficient Storage"
	case 508:
		return "Loop Detected"
	case 510:
		return "Not Extended"
	case 511:
		return "Network Authentication Required"
	}
	return ""
}
