package http1

import (
	"bufio"
	"bytes"
	"net/http"
	"strconv"
	"testing"
)

// BenchmarkParseRequest parses the head of a typical OpenAI SDK chat completion POST
// (10 header fields, 461 bytes), whole and arriving in halves (the first call sees an
// incomplete head), with net/http's ReadRequest for scale.
func BenchmarkParseRequest(b *testing.B) {
	buf := []byte(openAIHead)
	b.Run("openai", func(b *testing.B) {
		var r Request
		b.SetBytes(int64(len(buf)))
		b.ReportAllocs()
		for b.Loop() {
			if n, err := ParseRequest(buf, &r, Limits{}); n != len(buf) || err != nil {
				b.Fatal(n, err)
			}
		}
	})
	b.Run("openai-split", func(b *testing.B) {
		var r Request
		half := buf[:len(buf)/2]
		b.SetBytes(int64(len(buf)))
		b.ReportAllocs()
		for b.Loop() {
			if n, _ := ParseRequest(half, &r, Limits{}); n != 0 {
				b.Fatal(n)
			}
			if n, _ := ParseRequest(buf, &r, Limits{}); n != len(buf) {
				b.Fatal(n)
			}
		}
	})
	b.Run("net-http", func(b *testing.B) {
		rd := bytes.NewReader(buf)
		br := bufio.NewReader(rd)
		b.SetBytes(int64(len(buf)))
		b.ReportAllocs()
		for b.Loop() {
			rd.Reset(buf)
			br.Reset(rd)
			if _, err := http.ReadRequest(br); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkParseResponse parses a vLLM (uvicorn) streaming response head.
func BenchmarkParseResponse(b *testing.B) {
	buf := []byte(sseHead)
	var r Response
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	for b.Loop() {
		if n, err := ParseResponse(buf, &r, Limits{}, false); n != len(buf) || err != nil {
			b.Fatal(n, err)
		}
	}
}

// BenchmarkChunkedDecode de-chunks a 1 MB request body in chunks of several sizes.
func BenchmarkChunkedDecode(b *testing.B) {
	for _, chunk := range []int{64, 1 << 10, 16 << 10, 1 << 20} {
		body, payload := chunkedBody(1<<20, chunk)
		b.Run("1MB/chunk="+strconv.Itoa(chunk), func(b *testing.B) {
			var d ChunkedDecoder
			dst := make([]byte, 0, len(payload))
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				d.Reset(Limits{})
				var done bool
				var err error
				dst, _, done, err = d.Decode(dst[:0], body)
				if !done || err != nil {
					b.Fatal(done, err)
				}
			}
		})
	}
}

// BenchmarkChunkScan follows a 1 MB chunked SSE response as the proxy does when it
// forwards it: framing only, framing plus a payload copy, and copy-free with Next.
func BenchmarkChunkScan(b *testing.B) {
	for _, chunk := range []int{64, 16 << 10} {
		body, payload := chunkedBody(1<<20, chunk)
		dst := make([]byte, 0, len(payload))
		var s ChunkScanner
		b.Run("1MB/frame/chunk="+strconv.Itoa(chunk), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				s.Reset(Limits{MaxBodyBytes: -1})
				if _, _, done, _ := s.Scan(nil, body); !done {
					b.Fatal("not done")
				}
			}
		})
		b.Run("1MB/copy/chunk="+strconv.Itoa(chunk), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				s.Reset(Limits{MaxBodyBytes: -1})
				if dst, _, _, _ = s.Scan(dst[:0], body); len(dst) != len(payload) {
					b.Fatal(len(dst))
				}
			}
		})
		b.Run("1MB/next/chunk="+strconv.Itoa(chunk), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				s.Reset(Limits{MaxBodyBytes: -1})
				for off := 0; off < len(body); {
					n, _, done, err := s.Next(body[off:])
					off += n
					if done || err != nil {
						break
					}
				}
			}
		})
	}
}

// BenchmarkWriteResponse writes an SSE response head and one token event as a chunk.
func BenchmarkWriteResponse(b *testing.B) {
	event := []byte("data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n")
	rid := []byte("6f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b")
	out := make([]byte, 0, 512)
	b.ReportAllocs()
	for b.Loop() {
		out = AppendResponseHead(out[:0], 200, "text/event-stream", LengthChunked, true)
		out = AppendHeader(out, "X-Request-Id", rid)
		out = AppendEndHead(out)
		out = AppendChunk(out, event)
	}
	b.SetBytes(int64(len(out)))
}

// BenchmarkWriteRequest writes the upstream request head for a parsed OpenAI request.
func BenchmarkWriteRequest(b *testing.B) {
	var r Request
	if _, err := ParseRequest([]byte(openAIHead), &r, Limits{}); err != nil {
		b.Fatal(err)
	}
	out := make([]byte, 0, 1024)
	b.ReportAllocs()
	for b.Loop() {
		out = AppendRequestHead(out[:0], r.Method, r.Target, "engine-0:8000", r.ContentLength)
		out = AppendForwardHeaders(out, r.Header.All(), DefaultForwardHeaders)
		out = AppendEndHead(out)
	}
	b.SetBytes(int64(len(out)))
}
