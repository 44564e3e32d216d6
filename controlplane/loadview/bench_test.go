package loadview

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/vllm"
)

// BenchmarkScrape measures one poll's scrape of a real simulated engine's /metrics, which
// has served a few requests so that its histograms carry samples: "http" is the whole
// request on loopback plus parsing, as a poller does it (the engine's side, promhttp
// rendering its registry, runs in this process too and is counted); "http_static" serves the
// captured body as a static file, leaving the poller's own cost; "parse" only reads the body
// with the adapter.
func BenchmarkScrape(b *testing.B) {
	w := startSim(b, "127.0.0.1:0", func(c *sim.WorkerConfig) { c.Engine.Timing.Speedup = 1000 })
	eng := w.w.Engine()
	for i := range 8 {
		prompt := make([]uint32, 100+10*i)
		for j := range prompt {
			prompt[j] = uint32(j + 1)
		}
		r, err := eng.NewRequest(fmt.Sprint(i), prompt, blockhash.Keys{}, sim.Params{MaxTokens: 32})
		if err != nil {
			b.Fatal(err)
		}
		eng.Submit(r)
		<-waitDone(r)
	}
	v := New(testOptions())
	b.Cleanup(v.Close)
	p := v.newPoller(w.target("w"))
	ctx := context.Background()

	resp, err := http.Get(w.URL() + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	raw, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		b.Fatal(err)
	}

	b.Run("http", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if l, err := p.scrape(ctx); err != nil || !l.Found.Has(engines.FieldRunning|engines.FieldBlockSize) {
				b.Fatal(l, err)
			}
		}
	})
	// The same body served as a static file: the poller's own cost, without the engine's
	// rendering of its registry.
	static := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = w.Write(raw)
	}))
	b.Cleanup(static.Close)
	ps := v.newPoller(Target{ID: "s", URL: static.URL, Engine: engines.KindSim})
	b.Run("http_static", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(raw)))
		for b.Loop() {
			if l, err := ps.scrape(ctx); err != nil || !l.Found.Has(engines.FieldRunning|engines.FieldBlockSize) {
				b.Fatal(l, err)
			}
		}
	})
	b.Run("parse", func(b *testing.B) {
		a := vllm.NewSim()
		b.ReportAllocs()
		b.SetBytes(int64(len(raw)))
		for b.Loop() {
			if _, err := a.ParseLoad(bytes.NewReader(raw)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Logf("sim /metrics body: %d bytes", len(raw))
}

// waitDone returns a channel closed when r has finished.
func waitDone(r *sim.Request) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if _, fin, _, _ := r.Output(nil, 0); fin {
				return
			}
			<-r.Wait()
		}
	}()
	return done
}
