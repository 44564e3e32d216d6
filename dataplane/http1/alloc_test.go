package http1

import (
	"errors"
	"strings"
	"testing"
)

// chunkedBody returns size payload bytes framed in chunks of chunk bytes, plus the payload.
func chunkedBody(size, chunk int) (body, payload []byte) {
	const event = "data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n"
	payload = []byte(strings.Repeat(event, size/len(event)+1)[:size])
	for off := 0; off < size; off += chunk {
		body = AppendChunk(body, payload[off:min(off+chunk, size)])
	}
	return AppendLastChunk(body), payload
}

const sseHead = "HTTP/1.1 200 OK\r\n" +
	"date: Mon, 01 Jun 2026 12:00:00 GMT\r\n" +
	"server: uvicorn\r\n" +
	"content-type: text/event-stream; charset=utf-8\r\n" +
	"x-request-id: 6f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b\r\n" +
	"transfer-encoding: chunked\r\n" +
	"\r\n"

// TestZeroAllocs proves the per-request paths allocate nothing: parsing heads (complete,
// partial and rejected), decoding and scanning chunked bodies into buffers with room, the
// writers, and error inspection.
func TestZeroAllocs(t *testing.T) {
	reqBuf := []byte(openAIHead + openAIBody)
	partial := reqBuf[:len(openAIHead)-3]
	bad := []byte("POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n")
	respBuf := []byte(sseHead)
	body, payload := chunkedBody(64<<10, 512)
	dst := make([]byte, 0, len(payload))
	out := make([]byte, 0, 4096)
	r := new(Request)
	rs := new(Response)
	d := new(ChunkedDecoder)
	s := new(ChunkScanner)
	allow := DefaultForwardHeaders
	var sink int

	tests := []struct {
		name string
		fn   func()
	}{
		{"ParseRequest", func() {
			n, _ := ParseRequest(reqBuf, r, Limits{})
			sink += n + len(r.SessionID)
		}},
		{"ParseRequest partial", func() {
			n, _ := ParseRequest(partial, r, Limits{})
			sink += n
		}},
		{"ParseRequest rejected", func() {
			_, err := ParseRequest(bad, r, Limits{})
			if errors.Is(err, ErrAmbiguousLength) {
				sink += StatusOf(err)
			}
		}},
		{"Header.Get", func() { sink += len(r.Header.Get("x-stainless-lang")) }},
		{"ParseResponse", func() {
			n, _ := ParseResponse(respBuf, rs, Limits{}, false)
			sink += n
		}},
		{"ChunkedDecoder.Decode", func() {
			d.Reset(Limits{})
			var n int
			dst, n, _, _ = d.Decode(dst[:0], body)
			sink += n
		}},
		{"ChunkScanner.Scan", func() {
			s.Reset(Limits{MaxBodyBytes: -1})
			var n int
			dst, n, _, _ = s.Scan(dst[:0], body)
			sink += n
		}},
		{"ChunkScanner.Next", func() {
			s.Reset(Limits{MaxBodyBytes: -1})
			for off := 0; off < len(body); {
				n, data, done, err := s.Next(body[off:])
				off += n
				sink += len(data)
				if done || err != nil || n == 0 {
					break
				}
			}
		}},
		{"writers", func() {
			out = AppendResponseHead(out[:0], 200, rs.ContentType, LengthChunked, true)
			out = AppendHeader(out, "X-Request-Id", r.RequestID)
			out = AppendEndHead(out)
			out = AppendChunk(out, payload[:100])
			out = AppendLastChunk(out)
			out = AppendContinue(out)
			out = AppendRequestHead(out, r.Method, r.Target, "engine-0:8000", r.ContentLength)
			out = AppendForwardHeaders(out, r.Header.All(), allow)
			out = AppendEndHead(out)
			sink += len(out)
		}},
	}
	if _, err := ParseRequest(reqBuf, r, Limits{}); err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.fn() // warm up: buffers reach their size
			if got := testing.AllocsPerRun(100, tt.fn); got != 0 {
				t.Errorf("%v allocations per run, want 0", got)
			}
		})
	}
	if string(dst) != string(payload) {
		t.Error("decoded payload differs")
	}
	_ = sink
}
