package controlplane_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/client"
)

// With a LoadPushBudget, a load that moves on every scrape reaches a proxy as often as the
// budget pays for its bytes, not every PublishInterval nor every LoadRefresh (1 s): one
// worker's Loads shard is about 160 bytes with its delta framing, so a budget of 40 bytes
// a second pushes it about every 4 s where it would be pushed every 50 ms.
func TestLoadPushBudget(t *testing.T) {
	ws := startWorkers(t, 1)
	var scrapes atomic.Int64
	cp, err := controlplane.New(controlplane.Options{
		XDSListen: "127.0.0.1:0", APIListen: "127.0.0.1:0", DataDir: t.TempDir(), APIToken: "secret",
		Workers:        []registry.Worker{{ID: "w0", URL: ws[0].URL(), BlockSize: 16, Engine: "sim"}},
		ScrapeInterval: 20 * time.Millisecond, LoadPushBudget: 40, Logger: quiet(),
		// The engine's queue seen by the kernel: empty and 50 by turns, past the load band
		// every time.
		KernelWaiting: func(id string) (int, bool) { return 50 * int(scrapes.Add(1)%2), id == "w0" },
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Close() })
	kernelLoadSignalsOn(t, cp)

	conn, err := client.Dial(cp.XDSAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Each push of the worker's loads is one update (the worker and the policy stay put).
	var updates atomic.Int64
	c, err := client.New(conn, client.Options{NodeID: "p", OnUpdate: func([]*xdsv1.Worker, *xdsv1.RoutingPolicy, xds.PushedLoads) {
		updates.Add(1)
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	select {
	case <-c.Synced():
	case <-time.After(10 * time.Second):
		t.Fatal("proxy never synced")
	}
	time.Sleep(500 * time.Millisecond) // the policy's change and the first loads
	before, s0 := updates.Load(), scrapes.Load()
	time.Sleep(6 * time.Second)
	got, moves := updates.Load()-before, scrapes.Load()-s0
	if moves < 40 {
		t.Skipf("the engine was read %d times in 6 s: too few to tell", moves)
	}
	// Each push of the one shard is 150-180 bytes: 40 bytes a second allows a push every
	// 3.7-4.5 s, so one or two in 6 s (the budget off, about 60; pushed at each LoadRefresh
	// whatever the budget, about 6).
	if got > 2 || got == 0 {
		t.Fatalf("the load moved %d times in 6 s and reached the proxy %d times under a budget of 40 B/s, want 1-2", moves, got)
	}
}
