package http1

import (
	"errors"
	"strings"
	"testing"
)

// reqWant is what a request case expects. Fields left at their zero value are checked
// against zero too, so every case states the framing it expects.
type reqWant struct {
	method, target, path, query, host string
	minor                             int
	body                              BodyKind
	cl                                int64
	keepAlive, expect100              bool
	headers                           int
}

func checkRequest(t *testing.T, r *Request, w reqWant) {
	t.Helper()
	if string(r.Method) != w.method || string(r.Path) != w.path || string(r.RawQuery) != w.query || string(r.Host) != w.host {
		t.Errorf("method/path/query/host = %q %q %q %q, want %q %q %q %q", r.Method, r.Path, r.RawQuery, r.Host, w.method, w.path, w.query, w.host)
	}
	if w.target != "" && string(r.Target) != w.target {
		t.Errorf("target = %q, want %q", r.Target, w.target)
	}
	if r.ProtoMinor != w.minor || r.Body != w.body || r.ContentLength != w.cl {
		t.Errorf("minor/body/cl = %d %v %d, want %d %v %d", r.ProtoMinor, r.Body, r.ContentLength, w.minor, w.body, w.cl)
	}
	if r.KeepAlive != w.keepAlive || r.Expect100 != w.expect100 {
		t.Errorf("keepAlive/expect100 = %v %v, want %v %v", r.KeepAlive, r.Expect100, w.keepAlive, w.expect100)
	}
	if w.headers != 0 && r.Header.Len() != w.headers {
		t.Errorf("headers = %d, want %d", r.Header.Len(), w.headers)
	}
}

func TestParseRequest(t *testing.T) {
	tests := []struct {
		name string
		in   string
		lim  Limits
		want reqWant
		err  error
	}{
		{
			name: "get",
			in:   "GET /v1/models HTTP/1.1\r\nHost: relay\r\n\r\n",
			want: reqWant{method: "GET", path: "/v1/models", host: "relay", minor: 1, keepAlive: true, headers: 1},
		},
		{
			name: "openai post with content-length",
			in:   openAIHead,
			want: reqWant{method: "POST", path: "/v1/chat/completions", host: "kvrelay.local:8080", minor: 1, body: BodyLength, cl: 181, keepAlive: true, headers: 10},
		},
		{
			name: "query and raw target",
			in:   "GET /v1/models?limit=2&x=%20 HTTP/1.1\r\nHost: h\r\n\r\n",
			want: reqWant{method: "GET", target: "/v1/models?limit=2&x=%20", path: "/v1/models", query: "limit=2&x=%20", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "percent-encoded path",
			in:   "GET /v1/models/org%2Fmodel%20x HTTP/1.1\r\nHost: h\r\n\r\n",
			want: reqWant{method: "GET", path: "/v1/models/org%2Fmodel%20x", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "empty query",
			in:   "GET /a? HTTP/1.1\r\nHost: h\r\n\r\n",
			want: reqWant{method: "GET", path: "/a", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "chunked",
			in:   "POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
			want: reqWant{method: "POST", path: "/v1/completions", host: "h", minor: 1, body: BodyChunked, cl: -1, keepAlive: true},
		},
		{
			name: "chunked any case, over two fields",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: \r\nTransfer-Encoding: ChUnKeD\r\n\r\n",
			err:  ErrBadTransferEncoding,
		},
		{
			name: "chunked any case",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:  ChUnKeD \r\n\r\n",
			want: reqWant{method: "POST", path: "/", host: "h", minor: 1, body: BodyChunked, cl: -1, keepAlive: true},
		},
		{
			name: "zero content-length",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
			want: reqWant{method: "POST", path: "/", host: "h", minor: 1, body: BodyLength, cl: 0, keepAlive: true},
		},
		{
			name: "content-length leading zeros",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 007\r\n\r\n",
			want: reqWant{method: "POST", path: "/", host: "h", minor: 1, body: BodyLength, cl: 7, keepAlive: true},
		},
		{
			name: "repeated identical content-length",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\n",
			want: reqWant{method: "POST", path: "/", host: "h", minor: 1, body: BodyLength, cl: 5, keepAlive: true},
		},
		{
			name: "http/1.0 closes by default, no host needed",
			in:   "GET / HTTP/1.0\r\n\r\n",
			want: reqWant{method: "GET", path: "/", minor: 0},
		},
		{
			name: "http/1.0 keep-alive",
			in:   "GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n",
			want: reqWant{method: "GET", path: "/", minor: 0, keepAlive: true},
		},
		{
			name: "http/1.0 ignores expect",
			in:   "POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
			want: reqWant{method: "POST", path: "/", minor: 0, body: BodyLength, cl: 2},
		},
		{
			name: "expect 100-continue",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\n",
			want: reqWant{method: "POST", path: "/", host: "h", minor: 1, body: BodyLength, cl: 2, keepAlive: true, expect100: true},
		},
		{
			name: "leading empty lines skipped",
			in:   "\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n",
			want: reqWant{method: "GET", path: "/", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "absolute-form overrides host",
			in:   "GET http://engine-0:8000/v1/models?x=1 HTTP/1.1\r\nHost: other\r\n\r\n",
			want: reqWant{method: "GET", target: "http://engine-0:8000/v1/models?x=1", path: "/v1/models", query: "x=1", host: "engine-0:8000", minor: 1, keepAlive: true},
		},
		{
			name: "absolute-form without path",
			in:   "GET HTTPS://[::1]:443 HTTP/1.1\r\nHost: [::1]:443\r\n\r\n",
			want: reqWant{method: "GET", path: "/", host: "[::1]:443", minor: 1, keepAlive: true},
		},
		{
			name: "absolute-form query without path",
			in:   "GET http://h?q HTTP/1.1\r\nHost: h\r\n\r\n",
			want: reqWant{method: "GET", path: "/", query: "q", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "options asterisk",
			in:   "OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
			want: reqWant{method: "OPTIONS", path: "*", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "empty host on 1.1",
			in:   "GET / HTTP/1.1\r\nHost:\r\n\r\n",
			want: reqWant{method: "GET", path: "/", minor: 1, keepAlive: true},
		},
		{
			name: "value whitespace trimmed, obs-text kept",
			in:   "GET / HTTP/1.1\r\nHost: h\r\nX-Note: \t caf\xc3\xa9 \t\r\n\r\n",
			want: reqWant{method: "GET", path: "/", host: "h", minor: 1, keepAlive: true, headers: 2},
		},
		{
			name: "unknown connection options ignored",
			in:   "GET / HTTP/1.1\r\nHost: h\r\nConnection: upgrade, ,keep-alive\r\n\r\n",
			want: reqWant{method: "GET", path: "/", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "negative max body means unlimited",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 9223372036854775807\r\n\r\n",
			lim:  Limits{MaxBodyBytes: -1},
			want: reqWant{method: "POST", path: "/", host: "h", minor: 1, body: BodyLength, cl: 1<<63 - 1, keepAlive: true},
		},

		// Incomplete heads.
		{name: "empty", in: ""},
		{name: "lone cr", in: "\r"},
		{name: "partial method", in: "POS"},
		{name: "partial target", in: "POST /v1/ch"},
		{name: "partial version", in: "POST / HTT"},
		{name: "version without crlf", in: "POST / HTTP/1.1"},
		{name: "version cr", in: "POST / HTTP/1.1\r"},
		{name: "partial name", in: "GET / HTTP/1.1\r\nHo"},
		{name: "partial value", in: "GET / HTTP/1.1\r\nHost: h"},
		{name: "value cr", in: "GET / HTTP/1.1\r\nHost: h\r"},
		{name: "no final crlf", in: "GET / HTTP/1.1\r\nHost: h\r\n"},
		{name: "final cr", in: "GET / HTTP/1.1\r\nHost: h\r\n\r"},

		// Request line.
		{name: "empty method", in: " / HTTP/1.1\r\n", err: ErrBadRequestLine},
		{name: "bad method char", in: "GE(T / HTTP/1.1\r\n", err: ErrBadRequestLine},
		{name: "double space", in: "GET  / HTTP/1.1\r\n", err: ErrBadRequestLine},
		{name: "http/0.9", in: "GET /\r\n", err: ErrBadRequestLine},
		{name: "tab separator", in: "GET\t/ HTTP/1.1\r\n", err: ErrBadRequestLine},
		{name: "fragment in target", in: "GET /a#b HTTP/1.1\r\n", err: ErrBadTarget},
		{name: "control in target", in: "GET /a\x01 HTTP/1.1\r\n", err: ErrBadRequestLine},
		{name: "utf-8 in target", in: "GET /caf\xc3\xa9 HTTP/1.1\r\n", err: ErrBadTarget},
		{name: "relative target", in: "GET v1/models HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "asterisk for get", in: "GET * HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "ftp scheme", in: "GET ftp://h/ HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "userinfo in authority", in: "GET http://u:p@h/ HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "empty authority", in: "GET http:///x HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "bad percent-encoding", in: "GET /a%zz HTTP/1.1\r\n", err: ErrBadTarget},
		{name: "short percent-encoding", in: "GET /a%4 HTTP/1.1\r\n", err: ErrBadTarget},
		{name: "percent at end of target", in: "GET /a% HTTP/1.1\r\n", err: ErrBadTarget},
		{name: "non-numeric port", in: "GET http://h:port/ HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "two colons in authority", in: "GET http://a:1:2/ HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "percent in authority", in: "GET http://a%41/ HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "unclosed ipv6 literal", in: "GET http://[::1/ HTTP/1.1\r\nHost: h\r\n\r\n", err: ErrBadTarget},
		{name: "connect", in: "CONNECT engine:443 HTTP/1.1\r\nHost: engine:443\r\n\r\n", err: ErrMethodNotImplemented},
		{name: "lowercase version", in: "GET / http/1.1\r\n", err: ErrBadRequestLine},
		{name: "long version", in: "GET / HTTP/1.10\r\n", err: ErrBadRequestLine},
		{name: "http/2", in: "GET / HTTP/2.0\r\n\r\n", err: ErrVersionNotSupported},
		{name: "http/1.2", in: "GET / HTTP/1.2\r\n\r\n", err: ErrVersionNotSupported},
		{name: "prior-knowledge h2 preface", in: "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", err: ErrVersionNotSupported},
		{name: "tls client hello", in: "\x16\x03\x01\x02\x00\x01\x00\x01", err: ErrBadRequestLine},

		// Line endings and field syntax.
		{name: "bare lf after request line", in: "GET / HTTP/1.1\nHost: h\n\n", err: ErrBadLineEnding},
		{name: "bare lf after field", in: "GET / HTTP/1.1\r\nHost: h\n\r\n", err: ErrBadLineEnding},
		{name: "bare lf ending head", in: "GET / HTTP/1.1\r\nHost: h\r\n\n", err: ErrBadLineEnding},
		{name: "bare cr in value", in: "GET / HTTP/1.1\r\nHost: h\rX: y\r\n\r\n", err: ErrBadLineEnding},
		{name: "bare cr ending head", in: "GET / HTTP/1.1\r\nHost: h\r\n\rX", err: ErrBadLineEnding},
		{name: "leading bare lf", in: "\nGET / HTTP/1.1\r\n", err: ErrBadRequestLine},
		{name: "obs-fold", in: "GET / HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n 2\r\n\r\n", err: ErrObsFold},
		{name: "whitespace before first field", in: "GET / HTTP/1.1\r\n Host: h\r\n\r\n", err: ErrObsFold},
		{name: "space before colon", in: "GET / HTTP/1.1\r\nHost : h\r\n\r\n", err: ErrSpaceBeforeColon},
		{name: "tab before colon", in: "GET / HTTP/1.1\r\nContent-Length\t: 5\r\n\r\n", err: ErrSpaceBeforeColon},
		{name: "empty name", in: "GET / HTTP/1.1\r\n: h\r\n\r\n", err: ErrBadHeaderName},
		{name: "no colon", in: "GET / HTTP/1.1\r\nHost\r\n\r\n", err: ErrBadHeaderName},
		{name: "bad name char", in: "GET / HTTP/1.1\r\nX(y): 1\r\n\r\n", err: ErrBadHeaderName},
		{name: "utf-8 name", in: "GET / HTTP/1.1\r\nCaf\xc3\xa9: 1\r\n\r\n", err: ErrBadHeaderName},
		{name: "nul in value", in: "GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", err: ErrBadHeaderValue},
		{name: "del in value", in: "GET / HTTP/1.1\r\nX: a\x7fb\r\n\r\n", err: ErrBadHeaderValue},
		{name: "escape in value", in: "GET / HTTP/1.1\r\nX: \x1b[31m\r\n\r\n", err: ErrBadHeaderValue},

		// Content-Length.
		{name: "negative content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n", err: ErrBadContentLength},
		{name: "plus content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: +5\r\n\r\n", err: ErrBadContentLength},
		{name: "empty content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: \r\n\r\n", err: ErrBadContentLength},
		{name: "hex content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0x10\r\n\r\n", err: ErrBadContentLength},
		{name: "inner space content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1 2\r\n\r\n", err: ErrBadContentLength},
		{name: "list content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 5\r\n\r\n", err: ErrBadContentLength},
		{name: "overflowing content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 9223372036854775808\r\n\r\n", err: ErrBadContentLength},
		{name: "huge content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 99999999999999999999999\r\n\r\n", err: ErrBadContentLength},
		{name: "conflicting content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", err: ErrContentLengthDiffer},
		{name: "differently spelled content-length", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 05\r\n\r\n", err: ErrContentLengthDiffer},

		// Transfer-Encoding and smuggling.
		{name: "cl.te", in: "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n", err: ErrAmbiguousLength},
		{name: "te.cl", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n", err: ErrAmbiguousLength},
		{name: "te.cl with unknown coding", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\nContent-Length: 4\r\n\r\n", err: ErrAmbiguousLength},
		{name: "chunked not last", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", err: ErrBadTransferEncoding},
		{name: "chunked twice", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", err: ErrBadTransferEncoding},
		{name: "trailing comma", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked,\r\n\r\n", err: ErrBadTransferEncoding},
		{name: "empty transfer-encoding", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:\r\n\r\n", err: ErrBadTransferEncoding},
		{name: "te on http/1.0", in: "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", err: ErrBadTransferEncoding},
		{name: "gzip", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n", err: ErrUnsupportedEncoding},
		{name: "gzip then chunked", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", err: ErrUnsupportedEncoding},
		{name: "gzip then chunked over two fields", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n", err: ErrUnsupportedEncoding},
		{name: "identity", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: identity\r\n\r\n", err: ErrUnsupportedEncoding},
		{name: "chunked with parameter", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked;q=1\r\n\r\n", err: ErrUnsupportedEncoding},
		{name: "chunked misspelt", in: "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: xchunked\r\n\r\n", err: ErrUnsupportedEncoding},

		// Host and Expect.
		{name: "missing host", in: "GET / HTTP/1.1\r\n\r\n", err: ErrMissingHost},
		{name: "missing host with absolute-form", in: "GET http://h/ HTTP/1.1\r\n\r\n", err: ErrMissingHost},
		{name: "two hosts", in: "GET / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n", err: ErrBadHost},
		{name: "bad host", in: "GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", err: ErrBadHost},
		{name: "host with space", in: "GET / HTTP/1.1\r\nHost: a b\r\n\r\n", err: ErrBadHost},
		{name: "unknown expectation", in: "POST / HTTP/1.1\r\nHost: h\r\nExpect: 200-ok\r\n\r\n", err: ErrExpectation},

		// Limits.
		{
			name: "body over limit",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 33554433\r\n\r\n",
			err:  ErrBodyTooLarge,
		},
		{
			name: "body at limit",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\n",
			lim:  Limits{MaxBodyBytes: 100},
			want: reqWant{method: "POST", path: "/", host: "h", minor: 1, body: BodyLength, cl: 100, keepAlive: true},
		},
		{
			name: "body over custom limit",
			in:   "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 101\r\n\r\n",
			lim:  Limits{MaxBodyBytes: 100},
			err:  ErrBodyTooLarge,
		},
		{
			name: "head at limit",
			in:   "GET / HTTP/1.1\r\nHost: h\r\n\r\n",
			lim:  Limits{MaxHeadBytes: 27},
			want: reqWant{method: "GET", path: "/", host: "h", minor: 1, keepAlive: true},
		},
		{
			name: "head over limit",
			in:   "GET / HTTP/1.1\r\nHost: h\r\n\r\n",
			lim:  Limits{MaxHeadBytes: 26},
			err:  ErrHeadTooLarge,
		},
		{
			name: "incomplete head reaching limit",
			in:   "GET / HTTP/1.1\r\nHost: h\r\nX-Pad: " + strings.Repeat("p", 100),
			lim:  Limits{MaxHeadBytes: 64},
			err:  ErrHeadTooLarge,
		},
		{
			name: "default head limit",
			in:   "GET / HTTP/1.1\r\nHost: h\r\nX-Pad: " + strings.Repeat("p", 64<<10),
			err:  ErrHeadTooLarge,
		},
		{
			name: "header count at limit",
			in:   "GET / HTTP/1.1\r\nHost: h\r\n" + strings.Repeat("X: y\r\n", 99) + "\r\n",
			want: reqWant{method: "GET", path: "/", host: "h", minor: 1, keepAlive: true, headers: 100},
		},
		{
			name: "too many headers",
			in:   "GET / HTTP/1.1\r\nHost: h\r\n" + strings.Repeat("X: y\r\n", 100) + "\r\n",
			err:  ErrTooManyHeaders,
		},
		{
			name: "too many headers custom",
			in:   "GET / HTTP/1.1\r\nHost: h\r\nA: 1\r\nB: 2\r\n\r\n",
			lim:  Limits{MaxHeaders: 2},
			err:  ErrTooManyHeaders,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r Request
			n, err := ParseRequest([]byte(tt.in), &r, tt.lim)
			if !errors.Is(err, tt.err) {
				t.Fatalf("err = %v, want %v", err, tt.err)
			}
			if err != nil {
				if n != 0 {
					t.Errorf("headLen = %d with an error", n)
				}
				return
			}
			if tt.want.method == "" {
				if n != 0 {
					t.Fatalf("headLen = %d, want 0 (incomplete)", n)
				}
				return
			}
			if n != len(tt.in) {
				t.Fatalf("headLen = %d, want %d", n, len(tt.in))
			}
			checkRequest(t, &r, tt.want)
		})
	}
}

const openAIHead = "POST /v1/chat/completions HTTP/1.1\r\n" +
	"Host: kvrelay.local:8080\r\n" +
	"User-Agent: OpenAI/Python 1.99.1\r\n" +
	"Accept: application/json\r\n" +
	"Accept-Encoding: gzip, deflate\r\n" +
	"Content-Type: application/json\r\n" +
	"Authorization: Bearer sk-kvrelay-0123456789abcdef\r\n" +
	"X-Stainless-Lang: python\r\n" +
	"X-Request-Id: 6f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b\r\n" +
	"X-Session-Id: agent-42\r\n" +
	"Content-Length: 181\r\n" +
	"\r\n"

const openAIBody = `{"model":"openai/gpt-oss-20b","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hi."}],"stream":true,"max_tokens":64,"nvext":{"agent_hints":{}}}`

func TestOpenAIBodyLength(t *testing.T) {
	if len(openAIBody) != 181 {
		t.Fatalf("openAIBody is %d bytes; fix the Content-Length in openAIHead", len(openAIBody))
	}
}

func TestFastLookups(t *testing.T) {
	in := "POST / HTTP/1.1\r\n" +
		"host: h\r\n" +
		"CONTENT-TYPE: application/json\r\n" +
		"authorization: Bearer x\r\n" +
		"X-Request-ID: rid\r\n" +
		"x-session-id: sid\r\n" +
		"X-KVRelay-Priority: 7\r\n" +
		"X-Kvrelay-Osl: 512\r\n" +
		"x-slo-ttft-ms: 250\r\n" +
		"X-SLO-TPOT-MS: 30\r\n" +
		"X-LLM-D-Inference-Fairness-Id: agent-7\r\n" +
		"x-slo-ttft-ms: 999\r\n" +
		"x-session-id: second\r\n" +
		"X-Empty:\r\n" +
		"\r\n"
	var r Request
	if _, err := ParseRequest([]byte(in), &r, Limits{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ got, want string }{
		{string(r.ContentType), "application/json"},
		{string(r.Authorization), "Bearer x"},
		{string(r.RequestID), "rid"},
		{string(r.SessionID), "sid"},
		{string(r.Priority), "7"},
		{string(r.OSL), "512"},
		{string(r.SLOTTFT), "250"},
		{string(r.SLOTPOT), "30"},
		{string(r.FairnessID), "agent-7"},
		{string(r.Host), "h"},
		{string(r.Header.Get("X-SESSION-ID")), "sid"},
		{string(r.Header.Get("content-type")), "application/json"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
	if v := r.Header.Get("x-empty"); v == nil || len(v) != 0 {
		t.Errorf("empty field = %q (nil %v), want empty non-nil", v, v == nil)
	}
	if v := r.Header.Get("x-missing"); v != nil {
		t.Errorf("missing field = %q, want nil", v)
	}
	if got := len(r.Header.All()); got != 13 {
		t.Errorf("All() has %d fields, want 13", got)
	}
	// A new parse clears what the last one found.
	if _, err := ParseRequest([]byte("GET / HTTP/1.0\r\n\r\n"), &r, Limits{}); err != nil {
		t.Fatal(err)
	}
	if r.SessionID != nil || r.ContentType != nil || r.Header.Len() != 0 || r.Host != nil {
		t.Errorf("fields survived a reparse: %q %q %d %q", r.SessionID, r.ContentType, r.Header.Len(), r.Host)
	}
}

func TestKeepAliveMatrix(t *testing.T) {
	tests := []struct {
		name       string
		version    string
		connection string // "" for none
		want       bool
	}{
		{"1.1 default", "HTTP/1.1", "", true},
		{"1.1 close", "HTTP/1.1", "close", false},
		{"1.1 Close", "HTTP/1.1", "Close", false},
		{"1.1 keep-alive", "HTTP/1.1", "keep-alive", true},
		{"1.1 keep-alive, close", "HTTP/1.1", "keep-alive, close", false},
		{"1.1 upgrade", "HTTP/1.1", "Upgrade", true},
		{"1.1 closed substring", "HTTP/1.1", "closed", true},
		{"1.0 default", "HTTP/1.0", "", false},
		{"1.0 keep-alive", "HTTP/1.0", "keep-alive", true},
		{"1.0 KEEP-ALIVE", "HTTP/1.0", "KEEP-ALIVE", true},
		{"1.0 close", "HTTP/1.0", "close", false},
		{"1.0 keep-alive, close", "HTTP/1.0", "keep-alive,close", false},
		{"1.0 te, keep-alive", "HTTP/1.0", "TE, keep-alive", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := "GET / " + tt.version + "\r\nHost: h\r\n"
			if tt.connection != "" {
				in += "Connection: " + tt.connection + "\r\n"
			}
			in += "\r\n"
			var r Request
			if _, err := ParseRequest([]byte(in), &r, Limits{}); err != nil {
				t.Fatal(err)
			}
			if r.KeepAlive != tt.want {
				t.Errorf("request KeepAlive = %v, want %v", r.KeepAlive, tt.want)
			}
			resp := strings.Replace(in, "GET / "+tt.version, tt.version+" 200 OK", 1)
			resp = strings.Replace(resp, "\r\n\r\n", "\r\nContent-Length: 0\r\n\r\n", 1)
			var rs Response
			if _, err := ParseResponse([]byte(resp), &rs, Limits{}, false); err != nil {
				t.Fatal(err)
			}
			if rs.KeepAlive != tt.want {
				t.Errorf("response KeepAlive = %v, want %v", rs.KeepAlive, tt.want)
			}
		})
	}
}

func TestPipelined(t *testing.T) {
	msgs := []string{
		openAIHead + openAIBody,
		"GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n",
		"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" +
			"4\r\n{\"a\"\r\n3;ext=1\r\n:1}\r\n0\r\nX-Trailer: t\r\n\r\n",
		"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
	}
	bodies := []string{openAIBody, "", `{"a":1}`, "{}"}
	buf := []byte(strings.Join(msgs, ""))
	var r Request
	var d ChunkedDecoder
	var body []byte
	for i := range msgs {
		n, err := ParseRequest(buf, &r, Limits{})
		if err != nil || n == 0 {
			t.Fatalf("request %d: headLen %d, err %v", i, n, err)
		}
		buf = buf[n:]
		body = body[:0]
		switch r.Body {
		case BodyLength:
			body = append(body, buf[:r.ContentLength]...)
			buf = buf[r.ContentLength:]
		case BodyChunked:
			d.Reset(Limits{})
			var m int
			var done bool
			body, m, done, err = d.Decode(body, buf)
			if err != nil || !done {
				t.Fatalf("request %d: chunked body: done %v, err %v", i, done, err)
			}
			buf = buf[m:]
		}
		if string(body) != bodies[i] {
			t.Errorf("request %d: body %q, want %q", i, body, bodies[i])
		}
		if want := i != len(msgs)-1; r.KeepAlive != want {
			t.Errorf("request %d: KeepAlive = %v, want %v", i, r.KeepAlive, want)
		}
	}
	if len(buf) != 0 {
		t.Errorf("%d bytes left over", len(buf))
	}
}

// TestRequestEverySplit feeds each message one byte at a time and at every split point:
// every proper prefix of the head is incomplete, every longer buffer gives the same head.
func TestRequestEverySplit(t *testing.T) {
	msgs := map[string]string{
		"openai":      openAIHead + openAIBody,
		"chunked":     "POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
		"http/1.0":    "\r\nGET http://engine:8000/metrics?x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
		"empty value": "GET / HTTP/1.1\r\nHost: h\r\nX-Empty:\r\nX-Space:  \r\n\r\n",
	}
	for name, msg := range msgs {
		t.Run(name, func(t *testing.T) {
			var full Request
			headLen, err := ParseRequest([]byte(msg), &full, Limits{})
			if err != nil || headLen == 0 {
				t.Fatalf("full parse: %d %v", headLen, err)
			}
			for i := 0; i <= len(msg); i++ {
				// A fresh copy per prefix so that nothing past i can be read.
				b := []byte(msg[:i])
				var r Request
				n, err := ParseRequest(b, &r, Limits{})
				if err != nil {
					t.Fatalf("prefix %d: %v", i, err)
				}
				if i < headLen {
					if n != 0 {
						t.Fatalf("prefix %d: headLen %d before the head is complete", i, n)
					}
					continue
				}
				if n != headLen {
					t.Fatalf("prefix %d: headLen %d, want %d", i, n, headLen)
				}
				if !sameRequest(&r, &full) {
					t.Fatalf("prefix %d: parsed differently", i)
				}
			}
		})
	}
}

func sameRequest(a, b *Request) bool {
	if string(a.Method) != string(b.Method) || string(a.Target) != string(b.Target) || string(a.Path) != string(b.Path) ||
		string(a.RawQuery) != string(b.RawQuery) || string(a.Host) != string(b.Host) || a.ProtoMinor != b.ProtoMinor ||
		a.Body != b.Body || a.ContentLength != b.ContentLength || a.KeepAlive != b.KeepAlive || a.Expect100 != b.Expect100 ||
		string(a.ContentType) != string(b.ContentType) || string(a.SessionID) != string(b.SessionID) ||
		string(a.Authorization) != string(b.Authorization) || string(a.RequestID) != string(b.RequestID) ||
		string(a.Priority) != string(b.Priority) || string(a.OSL) != string(b.OSL) || a.Header.Len() != b.Header.Len() ||
		string(a.SLOTTFT) != string(b.SLOTTFT) || string(a.SLOTPOT) != string(b.SLOTPOT) {
		return false
	}
	for i, h := range a.Header.All() {
		g := b.Header.All()[i]
		if string(h.Name) != string(g.Name) || string(h.Value) != string(g.Value) {
			return false
		}
	}
	return true
}

func TestStatusOf(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want int
	}{
		{"nil", nil, 200},
		{"head", ErrHeadTooLarge, 431},
		{"body", ErrBodyTooLarge, 413},
		{"smuggling", ErrAmbiguousLength, 400},
		{"te", ErrUnsupportedEncoding, 501},
		{"version", ErrVersionNotSupported, 505},
		{"expect", ErrExpectation, 417},
		{"upstream", ErrBadResponseChunk, 502},
		{"wrapped", wrapErr{ErrTooManyHeaders}, 431},
		{"other", errors.New("boom"), 500},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := StatusOf(tt.err); got != tt.want {
				t.Errorf("StatusOf = %d, want %d", got, tt.want)
			}
		})
	}
	if !errors.Is(wrapErr{ErrBadChunk}, ErrBadChunk) {
		t.Error("errors.Is does not see a wrapped sentinel")
	}
	if ErrBadChunk.Error() != "http1: malformed chunked encoding" {
		t.Errorf("Error() = %q", ErrBadChunk.Error())
	}
}

type wrapErr struct{ err error }

func (w wrapErr) Error() string { return "wrapped: " + w.err.Error() }
func (w wrapErr) Unwrap() error { return w.err }

// TestErrorTables checks that every internal code maps to a sentinel on both sides and
// that response errors are all 502.
func TestErrorTables(t *testing.T) {
	for c := cOK + 1; c < numCodes; c++ {
		e := errs[c]
		if e.req == nil || e.resp == nil {
			t.Errorf("code %d has no sentinel", c)
			continue
		}
		if e.resp.Status != 502 {
			t.Errorf("code %d: response status %d, want 502", c, e.resp.Status)
		}
	}
}

func TestValidIPv6(t *testing.T) {
	tests := []struct {
		in   string
		want bool
	}{
		{"::", true},
		{"::1", true},
		{"1::", true},
		{"fe80::1:2", true},
		{"1:2:3:4:5:6:7:8", true},
		{"1:2:3:4:5:6::8", true},
		{"::ffff:10.0.0.1", true},
		{"1:2:3:4:5:6:1.2.3.4", true},
		{"0", false},
		{"", false},
		{":", false},
		{":1", false},
		{"1:", false},
		{":::", false},
		{"1::2::3", false},
		{"1:2:3:4:5:6:7:8:9", false},
		{"1:2:3:4:5:6:7::8", false},
		{"1:2:3:4:5:6:7:8::", false},
		{"12345::", false},
		{"g::", false},
		{"::1.2.3", false},
		{"::01.2.3.4", false},
		{"::256.2.3.4", false},
		{"1.2.3.4", false},
		{"::1.2.3.4:5", false},
		{"fe80::1%25eth0", false},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			if got := validIPv6([]byte(tt.in)); got != tt.want {
				t.Errorf("validIPv6(%q) = %v, want %v", tt.in, got, tt.want)
			}
		})
	}
}
