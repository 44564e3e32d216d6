package http1

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"net/textproto"
	"net/url"
	"slices"
	"testing"
)

// crossCheckRequest reads a head this package accepted with net/http's ReadRequest and
// fails unless net/http accepts it too and agrees on method, target, path, query, host,
// header fields, framing, keep-alive and (when the body is in buf) the body.
func crossCheckRequest(t testing.TB, buf []byte, headLen int, r *Request) {
	t.Helper()
	skip := 0
	for skip+1 < len(buf) && buf[skip] == '\r' && buf[skip+1] == '\n' {
		skip += 2 // net/http does not skip empty lines before the request line
	}
	hr, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(buf[skip:])))
	if err != nil {
		t.Fatalf("net/http rejects a request http1 accepts: %v\n%q", err, buf[:headLen])
	}
	if hr.Method != string(r.Method) || hr.RequestURI != string(r.Target) || hr.Host != string(r.Host) {
		t.Fatalf("method/target/host: net/http %q %q %q, http1 %q %q %q", hr.Method, hr.RequestURI, hr.Host, r.Method, r.Target, r.Host)
	}
	if string(r.Target) != "*" {
		path, err := url.PathUnescape(string(r.Path))
		if err != nil {
			t.Fatalf("path %q: %v", r.Path, err)
		}
		if hr.URL.Path != path && !(hr.URL.Path == "" && path == "/") {
			t.Fatalf("path: net/http %q, http1 %q", hr.URL.Path, path)
		}
		if hr.URL.RawQuery != string(r.RawQuery) {
			t.Fatalf("query: net/http %q, http1 %q", hr.URL.RawQuery, r.RawQuery)
		}
	}
	if hr.ProtoMajor != 1 || hr.ProtoMinor != r.ProtoMinor {
		t.Fatalf("version: net/http %d.%d, http1 1.%d", hr.ProtoMajor, hr.ProtoMinor, r.ProtoMinor)
	}
	// net/http removes Host and Transfer-Encoding from Header, Connection when it carries
	// "close", and collapses repeated Content-Length fields (compared as framing below).
	ours := http.Header{}
	for _, h := range r.Header.All() {
		k := textproto.CanonicalMIMEHeaderKey(string(h.Name))
		if k != "Host" && k != "Transfer-Encoding" && k != "Connection" && k != "Content-Length" {
			ours[k] = append(ours[k], string(h.Value))
		}
	}
	delete(hr.Header, "Connection")
	delete(hr.Header, "Content-Length")
	if len(ours) != len(hr.Header) {
		t.Fatalf("headers: net/http %q, http1 %q", hr.Header, ours)
	}
	for k, v := range ours {
		if !slices.Equal(v, hr.Header[k]) {
			t.Fatalf("header %s: net/http %q, http1 %q", k, hr.Header[k], v)
		}
	}
	wantCL := map[BodyKind]int64{BodyNone: 0, BodyLength: r.ContentLength, BodyChunked: -1}[r.Body]
	if hr.ContentLength != wantCL || (len(hr.TransferEncoding) == 1 && hr.TransferEncoding[0] == "chunked") != (r.Body == BodyChunked) {
		t.Fatalf("framing: net/http cl %d te %q, http1 %v %d", hr.ContentLength, hr.TransferEncoding, r.Body, r.ContentLength)
	}
	if hr.Close == r.KeepAlive {
		t.Fatalf("keep-alive: net/http close %v, http1 keep-alive %v", hr.Close, r.KeepAlive)
	}

	rest := buf[headLen:]
	var want []byte
	complete := false
	switch r.Body {
	case BodyNone:
		complete = true
	case BodyLength:
		if int64(len(rest)) >= r.ContentLength {
			want, complete = rest[:r.ContentLength], true
		}
	case BodyChunked:
		var d ChunkedDecoder
		d.Reset(Limits{})
		var err error
		want, _, complete, err = d.Decode(nil, rest)
		if err != nil {
			complete = false
		}
	}
	if !complete {
		return
	}
	got, err := io.ReadAll(hr.Body)
	if err != nil {
		t.Fatalf("net/http fails on a body http1 accepts: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("body: net/http %q, http1 %q", got, want)
	}
}

// crossCheckResponse does the same for a response head and its body.
func crossCheckResponse(t testing.TB, buf []byte, headLen int, r *Response, headRequest bool) {
	t.Helper()
	req := &http.Request{Method: "GET"}
	if headRequest {
		req.Method = "HEAD"
	}
	hr, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(buf)), req)
	if err != nil {
		t.Fatalf("net/http rejects a response http1 accepts: %v\n%q", err, buf[:headLen])
	}
	if hr.StatusCode != r.StatusCode || hr.ProtoMinor != r.ProtoMinor {
		t.Fatalf("status: net/http %d 1.%d, http1 %d 1.%d", hr.StatusCode, hr.ProtoMinor, r.StatusCode, r.ProtoMinor)
	}
	switch r.Body {
	case BodyNone:
		if hr.ContentLength > 0 && !headRequest && r.StatusCode != 304 {
			t.Fatalf("framing: net/http cl %d, http1 none", hr.ContentLength)
		}
	case BodyLength:
		if hr.ContentLength != r.ContentLength {
			t.Fatalf("content-length: net/http %d, http1 %d", hr.ContentLength, r.ContentLength)
		}
	case BodyChunked:
		if len(hr.TransferEncoding) != 1 || hr.TransferEncoding[0] != "chunked" {
			t.Fatalf("framing: net/http te %q, http1 chunked", hr.TransferEncoding)
		}
	case BodyUntilClose:
		if hr.ContentLength != -1 || len(hr.TransferEncoding) != 0 || !hr.Close {
			t.Fatalf("framing: net/http cl %d te %q close %v, http1 until close", hr.ContentLength, hr.TransferEncoding, hr.Close)
		}
	}
	if r.Body != BodyNone && hr.Close == r.KeepAlive {
		t.Fatalf("keep-alive: net/http close %v, http1 keep-alive %v", hr.Close, r.KeepAlive)
	}
	if r.Body == BodyChunked {
		var s ChunkScanner
		s.Reset(Limits{MaxBodyBytes: -1})
		want, _, done, err := s.Scan([]byte{}, buf[headLen:])
		if err == nil && done {
			got, err := io.ReadAll(hr.Body)
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("body: net/http %q %v, http1 %q", got, err, want)
			}
		}
	}
}

var crossCheckRequests = []string{
	openAIHead + openAIBody,
	"GET /v1/models HTTP/1.1\r\nHost: relay\r\n\r\n",
	"GET /v1/models?limit=2&x=%20 HTTP/1.1\r\nHost: h\r\nAccept: */*\r\nAccept: text/plain\r\n\r\n",
	"GET /a%2Fb/c HTTP/1.1\r\nHost: h\r\n\r\n",
	"\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n",
	"GET http://engine-0:8000/v1/models?x=1 HTTP/1.1\r\nHost: other\r\n\r\n",
	"GET http://[::1]:8000 HTTP/1.1\r\nHost: x\r\n\r\n",
	"GET / HTTP/1.0\r\n\r\n",
	"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
	"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
	"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, Close\r\n\r\n",
	"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
	"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 005\r\n\r\nhello",
	"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;a=b\r\n world\r\n0\r\nX-T: 1\r\n\r\n",
	"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\nExpect: 100-continue\r\n\r\n0\r\n\r\n",
	"GET / HTTP/1.1\r\nHost: h\r\nX-Empty:\r\nX-Note: \t caf\xc3\xa9 \t\r\nx-lower: a\r\nX-LOWER: b\r\n\r\n",
	"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
	"DELETE /v1/files/f-1 HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer x\r\n\r\n",
}

func TestRequestAgreesWithNetHTTP(t *testing.T) {
	for _, in := range crossCheckRequests {
		var r Request
		n, err := ParseRequest([]byte(in), &r, Limits{})
		if err != nil || n == 0 {
			t.Fatalf("%q: %d %v", in, n, err)
		}
		crossCheckRequest(t, []byte(in), n, &r)
	}
}

var crossCheckResponses = []string{
	"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: x\n\n",
	"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 204 No Content\r\n\r\n",
	"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
	"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye",
}

func TestResponseAgreesWithNetHTTP(t *testing.T) {
	for _, in := range crossCheckResponses {
		for _, head := range []bool{false, true} {
			var r Response
			n, err := ParseResponse([]byte(in), &r, Limits{}, head)
			if err != nil || n == 0 {
				t.Fatalf("%q: %d %v", in, n, err)
			}
			crossCheckResponse(t, []byte(in), n, &r, head)
		}
	}
}
