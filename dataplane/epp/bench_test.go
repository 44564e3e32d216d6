package epp_test

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// BenchmarkPick measures a pick as a gateway sees it, over real gRPC on loopback: an
// agentic request (a 6,000-token preamble, a distinct task) in FULL_DUPLEX_STREAMED mode,
// from opening the stream to the last body answer, with local tokenization. It reports the
// p50 and p99 per pick besides the mean.
func BenchmarkPick(b *testing.B) {
	e := newEnv(b, envOpts{workers: 4})
	pre := family(1) + family(2) + family(3) // about 6,000 tokens
	body := func(i int) []byte { return chatBody(pre, "task "+strconv.Itoa(i)+": check the build", 32, true) }
	// Warm the tokenizer's segment cache and the index as a running fleet has them.
	for i := range 8 {
		r := e.open(b, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
		d := r.request("/v1/chat/completions", nil, body(i), 0, nil)
		r.respond(200, d.dest, sse(1, 6000, 0)...)
		r.close()
	}
	var ds []time.Duration
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		t0 := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		st, err := e.client.Process(ctx)
		if err != nil {
			b.Fatal(err)
		}
		r := &raw{t: b, st: st, mode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, cancel: cancel}
		d := r.request("/v1/chat/completions", nil, body(100+i), 0, nil)
		ds = append(ds, time.Since(t0))
		if d.dest == "" {
			b.Fatalf("%+v", d)
		}
		_ = st.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extproc.HttpHeaders{EndOfStream: true}}})
		_, _ = st.Recv()
		r.close()
	}
	slices.Sort(ds)
	b.ReportMetric(float64(ds[len(ds)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(ds[len(ds)*99/100].Microseconds()), "p99-µs")
}
