package loadview

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/trtllm"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/engines/vllm/vllmtest"
)

// adapters is the map cmd/ builds.
func adapters() engines.Adapters {
	return engines.Adapters{
		engines.KindVLLM:   vllm.New(),
		engines.KindSim:    vllm.NewSim(),
		engines.KindSGLang: sglang.New(),
		engines.KindTRTLLM: trtllm.New(),
	}
}

// testOptions polls every 20 ms.
func testOptions() Options {
	return Options{
		Interval:  20 * time.Millisecond,
		Timeout:   time.Second,
		FailAfter: 3,
		Adapters:  adapters(),
		Logger:    slog.New(slog.DiscardHandler),
	}
}

// newView returns a View closed when the test ends.
func newView(t testing.TB, opts Options) *View {
	t.Helper()
	v := New(opts)
	t.Cleanup(v.Close)
	return v
}

// simWorker is a simulated engine the test can stop and start again on the same address
// (vllmtest.StartSim ties the worker's life to the test's).
type simWorker struct {
	w      *sim.Worker
	addr   string
	cancel context.CancelFunc
	done   chan error
}

// startSim runs a simulated worker on listen ("127.0.0.1:0" for any port); it is stopped when
// the test ends if the test has not stopped it.
func startSim(t testing.TB, listen string, mut func(*sim.WorkerConfig)) *simWorker {
	t.Helper()
	cfg := vllmtest.Config()
	cfg.Listen = listen
	cfg.ShutdownTimeout = time.Second
	if mut != nil {
		mut(&cfg)
	}
	w, err := sim.NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	// The port of a worker just stopped may take a moment to be free again.
	deadline := time.Now().Add(5 * time.Second)
	for {
		err = w.Start(ctx)
		if err == nil {
			break
		}
		_ = w.Close()
		if time.Now().After(deadline) {
			cancel()
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		if w, err = sim.NewWorker(cfg); err != nil {
			cancel()
			t.Fatal(err)
		}
	}
	s := &simWorker{w: w, cancel: cancel, done: make(chan error, 1)}
	s.addr = w.URL()[len("http://"):]
	go func() { s.done <- w.Run(ctx) }()
	t.Cleanup(func() { s.stop(t) })
	return s
}

// stop ends the worker and frees its port; it is safe to call twice.
func (s *simWorker) stop(t testing.TB) {
	t.Helper()
	if s.cancel == nil {
		return
	}
	s.cancel()
	s.cancel = nil
	if err := <-s.done; err != nil {
		t.Errorf("simulated worker: %v", err)
	}
	_ = s.w.Close()
}

func (s *simWorker) URL() string { return s.w.URL() }

func (s *simWorker) target(id string) Target {
	return Target{ID: id, URL: s.URL(), Engine: engines.KindSim}
}

// eventually polls cond every few milliseconds until it holds or timeout passes.
func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", timeout, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// drain empties the Changed channel.
func drain(ch <-chan struct{}) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}
