package sim

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/internal/cputime"
)

// BenchmarkFleetCPU runs 8 workers with 256 running sequences each, in real time at speedup
// 1, and reports the share of one core the process uses while they decode: the scheduler,
// the step clock, token delivery, metrics and (per sub-benchmark) KV event encoding and
// publishing, with or without a ZMQ subscriber reading them in the same process. Nobody reads
// the generated tokens, so HTTP costs are not part of it (BenchmarkRequestOverhead has them).
func BenchmarkFleetCPU(b *testing.B) {
	for _, mode := range []string{"no-events", "events", "events+subscriber"} {
		b.Run(mode, func(b *testing.B) {
			for b.Loop() {
				frac, steps := runFleet(b, 8, 256, mode, 3*time.Second)
				b.ReportMetric(frac*100, "%core")
				b.ReportMetric(steps, "steps/s/worker")
			}
		})
	}
}

func runFleet(b *testing.B, workers, seqs int, mode string, window time.Duration) (coreFrac, stepsPerSec float64) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	engines := make([]*Engine, workers)
	metrics := make([]*Metrics, workers)
	for i := range engines {
		cfg := DefaultConfig()
		var sink EventSink
		if mode != "no-events" {
			pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
			if err != nil {
				b.Fatal(err)
			}
			if err := pub.Start(ctx); err != nil {
				b.Fatal(err)
			}
			defer pub.Close()
			sink = &eventAdapter{pub: pub, blockSize: cfg.BlockSize}
			if mode == "events+subscriber" {
				sub := zmq4.NewSub(ctx)
				defer sub.Close()
				if err := sub.Dial(pub.Endpoint()); err != nil {
					b.Fatal(err)
				}
				_ = sub.SetOption(zmq4.OptionSubscribe, "")
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						if _, err := sub.Recv(); err != nil {
							return
						}
					}
				}()
			}
		}
		metrics[i] = NewMetrics(cfg)
		e, err := NewEngine(cfg, []uint32{1, 2, 3, 4, 5, 6, 7}, sink, metrics[i])
		if err != nil {
			b.Fatal(err)
		}
		engines[i] = e
		wg.Add(1)
		go func() { defer wg.Done(); _ = e.Run(ctx) }()
		for s := range seqs {
			r, err := e.NewRequest("r", prompt(256, uint32(i*1000+s+1)), blockhash.Keys{}, Params{MaxTokens: 4000, IgnoreEOS: true})
			if err != nil {
				b.Fatal(err)
			}
			e.Submit(r)
		}
	}
	// Wait until every sequence is past its prefill and decoding.
	for deadline := time.Now().Add(time.Minute); ; {
		all := true
		for _, e := range engines {
			if l := e.Load(); l.Running != seqs || l.Waiting != 0 {
				all = false
			}
		}
		if all {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("sequences did not all start")
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // past the last prefill step
	gen0 := counterValue0(metrics)
	c0, t0 := cputime.Self(), time.Now()
	time.Sleep(window)
	c1, t1 := cputime.Self(), time.Now()
	gen1 := counterValue0(metrics)
	cancel()
	wg.Wait()
	wall := t1.Sub(t0)
	steps := (gen1 - gen0) / float64(seqs) / float64(workers) / wall.Seconds()
	return float64(c1-c0) / float64(wall), steps
}

// counterValue0 sums the generation token counters of a fleet.
func counterValue0(ms []*Metrics) float64 {
	var sum float64
	for _, m := range ms {
		sum += counterValueOf(m.genTokens)
	}
	return sum
}

// BenchmarkRequestOverhead measures the CPU a request costs a worker at speedup 1000, end to
// end over loopback HTTP: decode, admission, scheduling, 64 output tokens, response. The
// client runs in the same process, so the figure is an upper bound on the engine's share.
func BenchmarkRequestOverhead(b *testing.B) {
	for _, stream := range []bool{false, true} {
		b.Run(fmt.Sprintf("stream=%v", stream), func(b *testing.B) {
			w := startWorkerB(b)
			ids := make([]string, 512)
			for i := range ids {
				ids[i] = fmt.Sprint(1000 + i)
			}
			body := fmt.Sprintf(`{"prompt":[%s],"max_tokens":64,"ignore_eos":true,"stream":%v}`, strings.Join(ids, ","), stream)
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			url := w.URL() + "/v1/completions"
			b.SetParallelism(16)
			b.ReportAllocs()
			c0 := cputime.Self()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := client.Post(url, "application/json", strings.NewReader(body))
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != 200 {
						b.Errorf("status %d", resp.StatusCode)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(cputime.Self()-c0)/float64(b.N)/1e3, "cpu-µs/req")
		})
	}
}

func startWorkerB(b *testing.B) *Worker {
	cfg := WorkerConfig{Engine: DefaultConfig(), Listen: "127.0.0.1:0", Codec: &wordCodec{}}
	cfg.Engine.Timing.Speedup = 1000
	w, err := NewWorker(cfg)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := w.Start(ctx); err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	b.Cleanup(func() { cancel(); <-done; w.Close() })
	return w
}

// BenchmarkStep is the cost of one scheduler step of one worker that keeps 256 sequences
// running (finished ones are replaced, so some steps also admit and prefill), on virtual time
// (no sleeping), with events encoded but not sent.
func BenchmarkStep(b *testing.B) {
	cfg := DefaultConfig()
	sink := &eventAdapter{pub: discardPublisher{}, blockSize: cfg.BlockSize}
	e, err := NewEngine(cfg, []uint32{1, 2, 3}, sink, NewMetrics(cfg))
	if err != nil {
		b.Fatal(err)
	}
	c := &vclock{e: e, now: time.Unix(0, 0)}
	next := uint32(1)
	topUp := func() {
		for len(e.running)+e.waiting.len() < 256 {
			r, _ := e.NewRequest("r", prompt(256, next), blockhash.Keys{}, Params{MaxTokens: 512, IgnoreEOS: true})
			next++
			e.Submit(r)
			e.drain(c.now)
		}
	}
	for range 1000 {
		topUp()
		c.step()
	}
	b.ReportAllocs()
	for b.Loop() {
		topUp()
		c.step()
	}
}

type discardPublisher struct{}

func (discardPublisher) Publish(b *kvevents.Batch) error {
	_ = kvevents.AppendBatch(nil, b, kvevents.FormatMap)
	return nil
}
