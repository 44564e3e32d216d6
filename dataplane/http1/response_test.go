package http1

import (
	"errors"
	"strings"
	"testing"
)

func TestParseResponse(t *testing.T) {
	tests := []struct {
		name      string
		in        string
		head      bool // the request was HEAD
		lim       Limits
		status    int // 0: incomplete or error
		reason    string
		minor     int
		body      BodyKind
		cl        int64
		keepAlive bool
		ctype     string
		err       error
	}{
		{
			name: "json with content-length", in: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n",
			status: 200, reason: "OK", minor: 1, body: BodyLength, cl: 2, keepAlive: true, ctype: "application/json",
		},
		{
			name: "sse over chunked (uvicorn)", in: "HTTP/1.1 200 OK\r\ndate: Mon, 01 Jun 2026 00:00:00 GMT\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n",
			status: 200, reason: "OK", minor: 1, body: BodyChunked, cl: -1, keepAlive: true, ctype: "text/event-stream; charset=utf-8",
		},
		{
			name: "close-delimited", in: "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n",
			status: 200, reason: "OK", minor: 1, body: BodyUntilClose, cl: -1, ctype: "text/event-stream",
		},
		{
			name: "close-delimited http/1.0 keep-alive ignored", in: "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n\r\n",
			status: 200, reason: "OK", minor: 0, body: BodyUntilClose, cl: -1,
		},
		{
			name: "http/1.0 keep-alive with length", in: "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
			status: 200, reason: "OK", minor: 0, body: BodyLength, keepAlive: true,
		},
		{
			name: "http/1.0 default close", in: "HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\n",
			status: 200, reason: "OK", minor: 0, body: BodyLength, cl: 3,
		},
		{
			name: "connection close", in: "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 3\r\n\r\n",
			status: 503, reason: "Service Unavailable", minor: 1, body: BodyLength, cl: 3,
		},
		{
			name: "204 ignores content-length", in: "HTTP/1.1 204 No Content\r\nContent-Length: 10\r\n\r\n",
			status: 204, reason: "No Content", minor: 1, body: BodyNone, keepAlive: true,
		},
		{
			name: "204 without length is not close-delimited", in: "HTTP/1.1 204 No Content\r\n\r\n",
			status: 204, reason: "No Content", minor: 1, body: BodyNone, keepAlive: true,
		},
		{
			name: "304", in: "HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
			status: 304, reason: "Not Modified", minor: 1, body: BodyNone, keepAlive: true,
		},
		{
			name: "head", in: "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", head: true,
			status: 200, reason: "OK", minor: 1, body: BodyNone, keepAlive: true,
		},
		{
			name: "head ignores the body limit", in: "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", head: true, lim: Limits{MaxBodyBytes: 10},
			status: 200, reason: "OK", minor: 1, body: BodyNone, keepAlive: true,
		},
		{
			name: "100 continue", in: "HTTP/1.1 100 Continue\r\n\r\n",
			status: 100, reason: "Continue", minor: 1, body: BodyNone, keepAlive: true,
		},
		{
			name: "103 early hints", in: "HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
			status: 103, reason: "Early Hints", minor: 1, body: BodyNone, keepAlive: true,
		},
		{
			name: "no reason, no space (go, some engines)", in: "HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n",
			status: 200, minor: 1, body: BodyLength, keepAlive: true,
		},
		{
			name: "empty reason", in: "HTTP/1.1 404 \r\nContent-Length: 0\r\n\r\n",
			status: 404, minor: 1, body: BodyLength, keepAlive: true,
		},
		{
			name: "reason with spaces and obs-text", in: "HTTP/1.1 400 Bad  Request \xe2\x9c\x97\r\nContent-Length: 0\r\n\r\n",
			status: 400, reason: "Bad  Request \xe2\x9c\x97", minor: 1, body: BodyLength, keepAlive: true,
		},
		{
			name: "unlimited body", in: "HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n", lim: Limits{MaxBodyBytes: -1},
			status: 200, reason: "OK", minor: 1, body: BodyLength, cl: 1 << 40, keepAlive: true,
		},

		{name: "incomplete version", in: "HTTP/1."},
		{name: "incomplete status", in: "HTTP/1.1 20"},
		{name: "incomplete reason", in: "HTTP/1.1 200 O"},
		{name: "incomplete status cr", in: "HTTP/1.1 200 OK\r"},
		{name: "incomplete fields", in: "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"},

		{name: "not http", in: "SSH-2.0-OpenSSH_9.6\r\n", err: ErrBadStatusLine},
		{name: "http/2", in: "HTTP/2 200\r\n\r\n", err: ErrBadStatusLine},
		{name: "http/1.2", in: "HTTP/1.2 200 OK\r\n\r\n", err: ErrBadStatusLine},
		{name: "two-digit status", in: "HTTP/1.1 20 OK\r\n\r\n", err: ErrBadStatusLine},
		{name: "four-digit status", in: "HTTP/1.1 2000 OK\r\n\r\n", err: ErrBadStatusLine},
		{name: "status 600", in: "HTTP/1.1 600 Odd\r\n\r\n", err: ErrBadStatusLine},
		{name: "status 099", in: "HTTP/1.1 099 Odd\r\n\r\n", err: ErrBadStatusLine},
		{name: "101 switching", in: "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n", err: ErrBadStatusLine},
		{name: "bare lf status line", in: "HTTP/1.1 200 OK\nContent-Length: 0\n\n", err: ErrBadResponseHeader},
		{name: "control in reason", in: "HTTP/1.1 200 O\x01K\r\n\r\n", err: ErrBadStatusLine},
		{name: "obs-fold", in: "HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n", err: ErrBadResponseHeader},
		{name: "space before colon", in: "HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n", err: ErrBadResponseHeader},
		{name: "bad content-length", in: "HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n", err: ErrBadResponseFraming},
		{name: "conflicting content-length", in: "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", err: ErrBadResponseFraming},
		{name: "te and cl", in: "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", err: ErrBadResponseFraming},
		{name: "gzip te", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", err: ErrBadResponseFraming},
		{name: "chunked not last", in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", err: ErrBadResponseFraming},
		{name: "te on http/1.0", in: "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", err: ErrBadResponseFraming},
		{name: "body over limit", in: "HTTP/1.1 200 OK\r\nContent-Length: 33554433\r\n\r\n", err: ErrResponseTooLarge},
		{name: "head over limit", in: "HTTP/1.1 200 OK\r\nX: " + strings.Repeat("x", 64), lim: Limits{MaxHeadBytes: 64}, err: ErrResponseHeadTooLarge},
		{name: "too many headers", in: "HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\n\r\n", lim: Limits{MaxHeaders: 1}, err: ErrResponseHeadTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r Response
			n, err := ParseResponse([]byte(tt.in), &r, tt.lim, tt.head)
			if !errors.Is(err, tt.err) {
				t.Fatalf("err = %v, want %v", err, tt.err)
			}
			if err != nil {
				if StatusOf(err) != 502 {
					t.Errorf("status of %v = %d, want 502", err, StatusOf(err))
				}
				return
			}
			if tt.status == 0 {
				if n != 0 {
					t.Fatalf("headLen = %d, want 0 (incomplete)", n)
				}
				return
			}
			if n != len(tt.in) {
				t.Fatalf("headLen = %d, want %d", n, len(tt.in))
			}
			if r.StatusCode != tt.status || string(r.Reason) != tt.reason || r.ProtoMinor != tt.minor {
				t.Errorf("status/reason/minor = %d %q %d, want %d %q %d", r.StatusCode, r.Reason, r.ProtoMinor, tt.status, tt.reason, tt.minor)
			}
			if r.Body != tt.body || r.ContentLength != tt.cl || r.KeepAlive != tt.keepAlive || string(r.ContentType) != tt.ctype {
				t.Errorf("body/cl/keepAlive/ctype = %v %d %v %q, want %v %d %v %q", r.Body, r.ContentLength, r.KeepAlive, r.ContentType, tt.body, tt.cl, tt.keepAlive, tt.ctype)
			}
			if r.Informational() != (tt.status < 200) {
				t.Errorf("Informational() = %v", r.Informational())
			}
		})
	}
}

// TestResponseSequence reads what an upstream connection carries for three requests: a
// 100 Continue before a JSON answer, an SSE stream over chunked encoding, then a
// close-delimited answer. It runs the whole buffer and every split of it through the same
// loop the proxy uses.
func TestResponseSequence(t *testing.T) {
	sse := "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n" + "data: [DONE]\n\n"
	stream := "HTTP/1.1 100 Continue\r\n\r\n" +
		"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}" +
		"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
		"30\r\n" + sse[:48] + "\r\n" + "e;x=\"y\"\r\n" + sse[48:] + "\r\n0\r\nX-Usage: 2\r\n\r\n" +
		"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\nengine died"
	want := []string{"", `{"ok":true}`, sse, "engine died"}
	got := runUpstream(t, []byte(stream), len(stream))
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("bodies = %q, want %q", got, want)
	}
	for split := 1; split < len(stream); split++ {
		got := runUpstream(t, []byte(stream), split)
		if strings.Join(got, "|") != strings.Join(want, "|") {
			t.Fatalf("split %d: bodies = %q, want %q", split, got, want)
		}
	}
}

// runUpstream frames responses the way the proxy does, with bytes arriving in reads of
// step bytes: parse a head, then follow the body, discarding only what was consumed.
func runUpstream(t *testing.T, all []byte, step int) []string {
	t.Helper()
	var (
		resp     Response
		sc       ChunkScanner
		inHead   = true
		body     []byte
		bodies   []string
		pending  []byte // bytes received and not yet consumed (the gnet inbound buffer)
		left     int64
		untilEOF bool
	)
	for off := 0; off < len(all) || len(pending) > 0; {
		if off < len(all) {
			end := min(off+step, len(all))
			pending = append(pending, all[off:end]...)
			off = end
		}
		for len(pending) > 0 {
			if inHead {
				n, err := ParseResponse(pending, &resp, Limits{MaxBodyBytes: -1}, false)
				if err != nil {
					t.Fatalf("response head: %v", err)
				}
				if n == 0 {
					break
				}
				pending = pending[n:]
				body = body[:0]
				switch resp.Body {
				case BodyNone:
					bodies = append(bodies, "")
					continue
				case BodyLength:
					left = resp.ContentLength
				case BodyChunked:
					sc.Reset(Limits{MaxBodyBytes: -1})
				case BodyUntilClose:
					untilEOF = true
				}
				inHead = false
				continue
			}
			switch resp.Body {
			case BodyLength:
				k := min(int64(len(pending)), left)
				body = append(body, pending[:k]...)
				pending, left = pending[k:], left-k
				if left == 0 {
					bodies = append(bodies, string(body))
					inHead = true
				}
			case BodyChunked:
				var n int
				var done bool
				var err error
				body, n, done, err = sc.Scan(body, pending)
				if err != nil {
					t.Fatalf("chunked response: %v", err)
				}
				pending = pending[n:]
				if done {
					bodies = append(bodies, string(body))
					inHead = true
				}
			case BodyUntilClose:
				body = append(body, pending...)
				pending = pending[:0]
			}
			if !inHead && len(pending) == 0 {
				break
			}
		}
	}
	if untilEOF {
		bodies = append(bodies, string(body))
	}
	return bodies
}

func TestResponseEverySplit(t *testing.T) {
	msgs := map[string]string{
		"sse":      "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
		"no space": "HTTP/1.1 204\r\n\r\n",
		"http/1.0": "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello",
	}
	for name, msg := range msgs {
		t.Run(name, func(t *testing.T) {
			var full Response
			headLen, err := ParseResponse([]byte(msg), &full, Limits{}, false)
			if err != nil || headLen == 0 {
				t.Fatalf("full parse: %d %v", headLen, err)
			}
			for i := 0; i <= len(msg); i++ {
				var r Response
				n, err := ParseResponse([]byte(msg[:i]), &r, Limits{}, false)
				if err != nil {
					t.Fatalf("prefix %d: %v", i, err)
				}
				want := 0
				if i >= headLen {
					want = headLen
				}
				if n != want {
					t.Fatalf("prefix %d: headLen %d, want %d", i, n, want)
				}
				if n > 0 && (r.StatusCode != full.StatusCode || r.Body != full.Body || r.KeepAlive != full.KeepAlive || r.Header.Len() != full.Header.Len()) {
					t.Fatalf("prefix %d: parsed differently", i)
				}
			}
		})
	}
}
