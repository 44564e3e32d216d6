// Package simtest runs simulated engine workers (package sim) for the tests of the packages
// that route to them: started on loopback, serving until the test ends.
package simtest

import (
	"context"
	"testing"

	"github.com/kvrelay/kvrelay/engines/sim"
)

// Start runs a worker of cfg for t's lifetime: built, started and running, stopped and
// closed when t's cleanups run.
func Start(t testing.TB, cfg sim.WorkerConfig) *sim.Worker {
	t.Helper()
	w, err := sim.NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := w.Start(ctx); err != nil {
		cancel()
		w.Close()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; w.Close() })
	return w
}
