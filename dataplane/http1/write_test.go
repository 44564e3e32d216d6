package http1

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"testing"
)

func TestWriters(t *testing.T) {
	rid := []byte("rid-1")
	tests := []struct {
		name string
		got  []byte
		want string
	}{
		{"status ok", AppendStatusLine(nil, 200), "HTTP/1.1 200 OK\r\n"},
		{"status 431", AppendStatusLine(nil, 431), "HTTP/1.1 431 Request Header Fields Too Large\r\n"},
		{"status unknown", AppendStatusLine(nil, 599), "HTTP/1.1 599 \r\n"},
		{"status out of range", AppendStatusLine(nil, 42), "HTTP/1.1 500 Internal Server Error\r\n"},
		{"header string", AppendHeader(nil, "X-A", "b"), "X-A: b\r\n"},
		{"header bytes", AppendHeader(nil, "X-Request-Id", rid), "X-Request-Id: rid-1\r\n"},
		{"header sanitized", AppendHeader(nil, "X", "a\r\nSet-Cookie: x\x00\x7f\tb"), "X: a  Set-Cookie: x  \tb\r\n"},
		{"content-length", AppendContentLength(nil, 1234567), "Content-Length: 1234567\r\n"},
		{
			"json response", AppendEndHead(AppendResponseHead(nil, 200, "application/json", 11, true)),
			"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\nConnection: keep-alive\r\n\r\n",
		},
		{
			"sse response", AppendEndHead(AppendHeader(AppendResponseHead(nil, 200, []byte("text/event-stream"), LengthChunked, true), "X-Request-Id", rid)),
			"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\nX-Request-Id: rid-1\r\n\r\n",
		},
		{
			"http/1.0 stream", AppendEndHead(AppendResponseHead(nil, 200, "text/event-stream", LengthUntilClose, true)),
			"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n",
		},
		{
			"error response", AppendEndHead(AppendResponseHead(nil, 413, "", 0, false)),
			"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
		},
		{"chunk", AppendChunk(nil, []byte("data: x\n\n")), "9\r\ndata: x\n\n\r\n"},
		{"big chunk", AppendChunk(nil, make([]byte, 4096))[:5], "1000\r"},
		{"empty chunk", AppendChunk([]byte("x"), nil), "x"},
		{"last chunk", AppendLastChunk(nil), "0\r\n\r\n"},
		{"continue", AppendContinue(nil), "HTTP/1.1 100 Continue\r\n\r\n"},
		{
			"request head", AppendEndHead(AppendRequestHead(nil, "POST", []byte("/v1/completions"), "engine-0:8000", 42)),
			"POST /v1/completions HTTP/1.1\r\nHost: engine-0:8000\r\nContent-Length: 42\r\nConnection: keep-alive\r\n\r\n",
		},
		{
			"chunked request head", AppendEndHead(AppendRequestHead(nil, []byte("POST"), "/", []byte("e"), LengthChunked)),
			"POST / HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if string(tt.got) != tt.want {
				t.Errorf("got %q, want %q", tt.got, tt.want)
			}
		})
	}
}

func TestAppendForwardHeaders(t *testing.T) {
	in := "POST /v1/chat/completions HTTP/1.1\r\n" +
		"Host: relay\r\n" +
		"Content-Type: application/json\r\n" +
		"Connection: keep-alive, x-session-id\r\n" +
		"Keep-Alive: timeout=5\r\n" +
		"Transfer-Encoding: chunked\r\n" +
		"TE: trailers\r\n" +
		"Expect: 100-continue\r\n" +
		"Authorization: Bearer k\r\n" +
		"X-Request-Id: a\r\n" +
		"x-request-id: b\r\n" +
		"Cookie: c\r\n" +
		"\r\n"
	var r Request
	if _, err := ParseRequest([]byte(in), &r, Limits{}); err != nil {
		t.Fatal(err)
	}
	allow := append([]string{"Connection", "Transfer-Encoding", "TE", "Expect", "Host"}, DefaultForwardHeaders...)
	got := AppendForwardHeaders(nil, r.Header.All(), allow)
	want := "Content-Type: application/json\r\nAuthorization: Bearer k\r\nX-Request-Id: a\r\nx-request-id: b\r\n"
	if string(got) != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestWritersRoundTrip reads what the writers produce with this package's parsers and with
// net/http's.
func TestWritersRoundTrip(t *testing.T) {
	events := [][]byte{[]byte("data: {\"a\":1}\n\n"), []byte("data: [DONE]\n\n")}
	var out []byte
	out = AppendEndHead(AppendResponseHead(out, 200, "text/event-stream", LengthChunked, true))
	for _, e := range events {
		out = AppendChunk(out, e)
	}
	out = AppendLastChunk(out)

	var resp Response
	n, err := ParseResponse(out, &resp, Limits{}, false)
	if err != nil || resp.Body != BodyChunked || !resp.KeepAlive {
		t.Fatalf("ParseResponse: %d %v %v", n, err, resp.Body)
	}
	var s ChunkScanner
	s.Reset(Limits{})
	payload, m, done, err := s.Scan([]byte{}, out[n:])
	if err != nil || !done || m != len(out)-n || string(payload) != string(bytes.Join(events, nil)) {
		t.Fatalf("Scan: %q %d %v %v", payload, m, done, err)
	}
	hr, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(out)), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(hr.Body)
	if err != nil || string(body) != string(payload) {
		t.Fatalf("net/http read %q, %v", body, err)
	}

	req := AppendRequestHead(nil, "POST", "/v1/completions", "engine:8000", 2)
	req = AppendHeader(req, "Content-Type", "application/json")
	req = AppendEndHead(req)
	req = append(req, "{}"...)
	var r Request
	if n, err := ParseRequest(req, &r, Limits{}); err != nil || r.ContentLength != 2 || string(req[n:]) != "{}" {
		t.Fatalf("ParseRequest: %d %v", n, err)
	}
	if _, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(req))); err != nil {
		t.Fatal(err)
	}
}

// TestStatusTextMatchesNetHTTP compares the reason phrases with net/http's, except where
// RFC 9110 renamed them (net/http keeps the RFC 7231 names).
func TestStatusTextMatchesNetHTTP(t *testing.T) {
	rfc9110 := map[int]bool{413: true, 414: true, 416: true, 422: true}
	for code := 100; code < 600; code++ {
		got, want := StatusText(code), http.StatusText(code)
		if got != want && !rfc9110[code] {
			t.Errorf("StatusText(%d) = %q, net/http says %q", code, got, want)
		}
	}
}
