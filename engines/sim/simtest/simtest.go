// Package simtest runs simulated engine workers (package sim) for the tests of the packages
// that route to them: started on loopback, serving until the test ends.
package simtest

import (
	"context"
	"sync"
	"testing"

	"github.com/kvrelay/kvrelay/engines/sim"
)

// Start runs a worker of cfg for t's lifetime: built, started and running, stopped and
// closed when t's cleanups run, which report an error its run ended with.
func Start(t testing.TB, cfg sim.WorkerConfig) *sim.Worker {
	t.Helper()
	w, err := sim.NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := w.Start(ctx); err != nil {
		cancel()
		_ = w.Close()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("simulated worker: %v", err)
		}
		_ = w.Close()
	})
	return w
}

// Worker runs a worker of model for t's lifetime, with the defaults the routing tests use
// (loopback, 8,192 KV blocks, 50 times real speed) changed by mut (nil: none).
func Worker(t testing.TB, model string, mut func(*sim.WorkerConfig)) *sim.Worker {
	t.Helper()
	cfg := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: Codec(t, model)}
	cfg.Engine.NumGPUBlocks = 8192
	cfg.Engine.Timing.Speedup = 50
	if mut != nil {
		mut(&cfg)
	}
	return Start(t, cfg)
}

// codecs keeps each model's codec: building one loads its tokenizer.
var codecs sync.Map // model → sim.Codec

// Codec returns model's codec (its tokenizer and chat template), built once per process.
func Codec(t testing.TB, model string) sim.Codec {
	t.Helper()
	if c, ok := codecs.Load(model); ok {
		return c.(sim.Codec)
	}
	c, err := sim.NewCodec(model, "", "")
	if err != nil {
		t.Fatal(err)
	}
	codecs.Store(model, c)
	return c
}
