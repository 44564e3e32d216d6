package http1

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

// requestSeeds are valid and invalid requests for FuzzParseRequest.
func requestSeeds() []string {
	seeds := append([]string(nil), crossCheckRequests...)
	return append(seeds,
		"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n b\r\n\r\n",
		"GET / HTTP/1.1\nHost: h\n\n",
		"GET /%zz HTTP/1.1\r\nHost: h\r\n\r\n",
		"GET / HTTP/2.0\r\n\r\n",
		"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
	)
}

// FuzzParseRequest checks that ParseRequest never panics, that a head is found at the same
// length (or the same error) whatever prefix of the input has arrived, that results alias
// the input, and that every head it accepts net/http accepts too, with the same meaning.
func FuzzParseRequest(f *testing.F) {
	for _, s := range requestSeeds() {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var r Request
		n, err := ParseRequest(data, &r, Limits{})
		if err != nil {
			if n != 0 {
				t.Fatalf("headLen %d with error %v", n, err)
			}
			var e *Error
			if !errors.As(err, &e) || e.Status < 400 || e.Status > 505 || e.Status == 502 {
				t.Fatalf("error %v is not a request sentinel", err)
			}
		}
		if n > len(data) {
			t.Fatalf("headLen %d > len %d", n, len(data))
		}
		checkPrefixes(t, data, n, err, func(b []byte) (int, error) { return ParseRequest(b, &r, Limits{}) })
		if n == 0 || err != nil {
			return
		}
		if n, err = ParseRequest(data, &r, Limits{}); err != nil {
			t.Fatal(err)
		}
		for _, s := range [][]byte{r.Method, r.Target, r.RawQuery, r.ContentType, r.SessionID} {
			if len(s) > 0 && !within(s, data[:n]) {
				t.Fatalf("%q does not alias the head", s)
			}
		}
		crossCheckRequest(t, data, n, &r)
	})
}

// checkPrefixes parses prefixes of data (every one for short inputs; for long ones a
// sample plus those around the head's end, which keeps minimization fast): a prefix
// shorter than a found head is incomplete, and any other prefix gives either
// "incomplete" or exactly the full input's result.
func checkPrefixes(t *testing.T, data []byte, n int, err error, parse func([]byte) (int, error)) {
	t.Helper()
	step := 1
	if len(data) > 256 {
		step = len(data) / 64
	}
	check := func(i int) {
		if i < 0 || i >= len(data) {
			return
		}
		m, e := parse(bytes.Clone(data[:i]))
		if m == 0 && e == nil {
			return
		}
		if n > 0 && i < n {
			t.Fatalf("prefix %d: headLen %d err %v before the head of %d bytes is complete", i, m, e, n)
		}
		if m != n || e != err {
			t.Fatalf("prefix %d: headLen %d err %v; whole input: %d %v", i, m, e, n, err)
		}
	}
	for i := 0; i < len(data); i += step {
		check(i)
	}
	for i := n - 4; i <= n+1 && n > 0; i++ {
		check(i)
	}
}

func responseSeeds() []string {
	seeds := append([]string(nil), crossCheckResponses...)
	return append(seeds,
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 101 Switching Protocols\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
		"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
	)
}

// FuzzParseResponse is FuzzParseRequest for response heads, with and without a HEAD
// request, cross-checked against net/http's ReadResponse.
func FuzzParseResponse(f *testing.F) {
	for _, s := range responseSeeds() {
		f.Add([]byte(s), false)
	}
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"), true)
	f.Fuzz(func(t *testing.T, data []byte, head bool) {
		var r Response
		n, err := ParseResponse(data, &r, Limits{}, head)
		if err != nil && (n != 0 || StatusOf(err) != 502) {
			t.Fatalf("headLen %d, error %v (status %d)", n, err, StatusOf(err))
		}
		checkPrefixes(t, data, n, err, func(b []byte) (int, error) { return ParseResponse(b, &r, Limits{}, head) })
		if n == 0 || err != nil {
			return
		}
		if _, err = ParseResponse(data, &r, Limits{}, head); err != nil {
			t.Fatal(err)
		}
		if r.Body == BodyNone && r.ContentLength != 0 || r.Body == BodyUntilClose && r.KeepAlive {
			t.Fatalf("inconsistent framing: %v cl %d keep-alive %v", r.Body, r.ContentLength, r.KeepAlive)
		}
		crossCheckResponse(t, data, n, &r, head)
	})
}

func chunkedSeeds() []string {
	var seeds []string
	for _, c := range chunkedCases {
		if len(c.in) < 1000 {
			seeds = append(seeds, c.in)
		}
	}
	return seeds
}

// chunkResult is everything a chunked scan reports.
type chunkResult struct {
	payload  string
	consumed int
	done     bool
	err      error
}

// decodeSplit runs a ChunkedDecoder over data arriving in three reads cut at a and b, with
// unconsumed bytes kept buffered as gnet does.
func decodeSplit(data []byte, lim Limits, a, b int) chunkResult {
	var d ChunkedDecoder
	d.Reset(lim)
	var out, pending []byte
	var res chunkResult
	off := 0
	for _, cut := range []int{a, b, len(data)} {
		if cut < off {
			cut = off
		}
		pending = append(pending, data[off:cut]...)
		off = cut
		var n int
		out, n, res.done, res.err = d.Decode(out, pending)
		res.consumed += n
		pending = pending[n:]
		if res.err != nil || res.done {
			break
		}
	}
	res.payload = string(out)
	return res
}

// FuzzChunkedDecoder checks split invariance (the whole input at once, cut in three at
// fuzzed points, one byte at a time and the copy-free Next loop all agree), that the
// scanner frames identically, and that net/http decodes the same payload from any body
// this package accepts.
func FuzzChunkedDecoder(f *testing.F) {
	for _, s := range chunkedSeeds() {
		f.Add([]byte(s), uint16(1), uint16(3))
	}
	f.Fuzz(func(t *testing.T, data []byte, a, b uint16) {
		lim := Limits{MaxBodyBytes: 1 << 16, MaxHeadBytes: 1 << 10}
		whole := decodeSplit(data, lim, len(data), len(data))
		x, y := int(a)%(len(data)+1), int(b)%(len(data)+1)
		if x > y {
			x, y = y, x
		}
		if got := decodeSplit(data, lim, x, y); got != whole {
			t.Fatalf("split at %d,%d: %+v, whole: %+v", x, y, got, whole)
		}
		var d ChunkedDecoder
		d.Reset(lim)
		bytewise := chunkResult{}
		var out []byte
		for i := 0; i < len(data); i++ {
			var n int
			out, n, bytewise.done, bytewise.err = d.Decode(out, data[i:i+1])
			bytewise.consumed += n
			if bytewise.err != nil || bytewise.done {
				break
			}
		}
		bytewise.payload = string(out)
		if bytewise != whole {
			t.Fatalf("byte by byte: %+v, whole: %+v", bytewise, whole)
		}

		// The scanner is the same machine with response errors.
		var s ChunkScanner
		s.Reset(lim)
		sp, sn, sdone, serr := s.Scan([]byte{}, data)
		if string(sp) != whole.payload || sn != whole.consumed || sdone != whole.done || (serr == nil) != (whole.err == nil) {
			t.Fatalf("scanner %q %d %v %v, decoder %+v", sp, sn, sdone, serr, whole)
		}
		if whole.err != nil {
			if whole.consumed > len(data) {
				t.Fatalf("consumed %d of %d", whole.consumed, len(data))
			}
			return
		}
		if !whole.done {
			if whole.consumed != len(data) {
				t.Fatalf("not done but consumed %d of %d", whole.consumed, len(data))
			}
			return
		}
		crossCheckChunked(t, data[:whole.consumed], whole.payload)
	})
}

// crossCheckChunked decodes an accepted chunked body with net/http (as a request body, so
// trailers are read too). net/http is stricter in two known ways, both skipped: it rejects
// whitespace between the chunk size and ';' (RFC 9112's BWS, which this package accepts),
// and it rejects bodies with too much non-data overhead.
func crossCheckChunked(t *testing.T, body []byte, payload string) {
	t.Helper()
	msg := append([]byte("POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"), body...)
	hr, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(msg)))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(hr.Body)
	if err != nil {
		if strings.Contains(err.Error(), "too much non-data") ||
			strings.Contains(err.Error(), "invalid byte in chunk length") && bytes.ContainsAny(body, " \t") {
			return
		}
		t.Fatalf("net/http rejects a chunked body http1 accepts: %v\n%q", err, body)
	}
	if string(got) != payload {
		t.Fatalf("payload: net/http %q, http1 %q", got, payload)
	}
}

// FuzzChunkScanner checks the pass-through scanner: the copy-free Next loop, Scan with a
// payload buffer and Scan without one agree on the raw body length, the payload and the
// end, at any split of the input; the data runs alias the input and add up to Len.
func FuzzChunkScanner(f *testing.F) {
	for _, s := range chunkedSeeds() {
		f.Add([]byte(s), uint16(2))
	}
	f.Fuzz(func(t *testing.T, data []byte, a uint16) {
		lim := Limits{MaxBodyBytes: -1, MaxHeadBytes: 1 << 10}
		var s ChunkScanner
		s.Reset(lim)
		payload, n, done, err := s.Scan([]byte{}, data)
		if err != nil && StatusOf(err) != 502 {
			t.Fatalf("error %v is not a response sentinel", err)
		}
		if err == nil && !done && n != len(data) || n > len(data) {
			t.Fatalf("raw %d of %d, done %v", n, len(data), done)
		}
		if err == nil && s.Len() != int64(len(payload)) {
			t.Fatalf("Len %d, payload %d", s.Len(), len(payload))
		}

		// Frame only, in two reads.
		cut := int(a) % (len(data) + 1)
		s.Reset(lim)
		_, n1, done1, err1 := s.Scan(nil, data[:cut])
		raw, fdone, ferr := n1, done1, err1
		if err1 == nil && !done1 {
			_, n2, done2, err2 := s.Scan(nil, data[cut:])
			raw, fdone, ferr = raw+n2, done2, err2
		}
		if raw != n || fdone != done || ferr != err {
			t.Fatalf("framing in two reads: %d %v %v, at once: %d %v %v", raw, fdone, ferr, n, done, err)
		}

		// Copy-free.
		s.Reset(lim)
		var got []byte
		total := 0
		for {
			k, d, done, err := s.Next(data[total:])
			if len(d) > 0 && !within(d, data[total:total+k]) {
				t.Fatal("data run outside the consumed bytes")
			}
			got = append(got, d...)
			total += k
			if err != nil || done || k == 0 {
				break
			}
		}
		if total != n || (err == nil && !bytes.Equal(got, payload)) {
			t.Fatalf("Next: raw %d payload %q; Scan: raw %d payload %q", total, got, n, payload)
		}
	})
}
