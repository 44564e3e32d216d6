package controlplane_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// serviceRelay plays a Kubernetes Service in front of control plane replicas: each
// connection goes to the first backend that accepts it.
func serviceRelay(t *testing.T, backends ...string) string {
	t.Helper()
	dial := func() (up net.Conn, err error) {
		for _, b := range backends {
			if up, err = net.DialTimeout("tcp", b, time.Second); err == nil {
				return up, nil
			}
		}
		return nil, err
	}
	return relay(t, dial, func(dst, src net.Conn) { _, _ = io.Copy(dst, src); dst.Close() })
}

// Two control plane replicas follow the same engines and each keeps the whole index; the
// proxies reach them through one address. When the replica a proxy follows dies, the proxy
// moves to the other and no request fails meanwhile. Its index replica goes on without a
// snapshot: the other replica gave the workers the same slots and follows the same events,
// so it replays from the proxy's marks (another journal's epoch, resumed worker by worker).
func TestReplicaDeathMovesProxies(t *testing.T) {
	c := newCluster(t, 4)
	a := c.cp
	// The second replica: the same engines, its own data directory.
	c2 := &cluster{t: t, workers: c.workers, specs: c.specs, dataDir: t.TempDir()}
	c2.startControlPlane("127.0.0.1:0")
	b := c2.cp
	svc := serviceRelay(t, a.XDSAddr(), b.XDSAddr())
	p := c.addProxyWith(svc, func(cfg *proxy.Config) { cfg.ExposeDecisionHeader = true })
	waitWorkers(t, p, 4)
	c.warm(4)
	c.waitBlocks(4 * 150)
	c2.warmed = c.warmed
	c2.waitBlocks(4 * 150)
	before, _ := p.XDSStats()

	// Requests all along, from two clients: none may fail.
	load := clients(t, "http://"+p.Addr(), "the failover")
	load.await(10, "before the kill")
	// The proxy holds every worker's mark once a checkpoint (about a second) has followed
	// the warm-up's events; a worker without one would be filled again on the other replica.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if st, _ := p.XDSStats(); st.Journal.Marks >= 4 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the proxy holds %d workers' marks, want 4", st.Journal.Marks)
		}
	}
	killed := time.Now()
	_ = a.Close()

	// The proxy follows b: new ADS and journal streams, and its replica, resumed on b's
	// journal, holds b's index.
	deadline := time.Now().Add(15 * time.Second)
	for {
		st, _ := p.XDSStats()
		_, js := b.Journal()
		if st.ADS.Streams > before.ADS.Streams && st.Journal.Streams > before.Journal.Streams && js.Stats().Resumes > 0 &&
			st.Journal.Synced && p.Replica().Len() >= b.Index().Len() {
			// Both replicas gave the workers the same slots and hold the proxy's marks in
			// their history: no snapshot, and at most a worker filled again (a replica
			// whose subscriber joined a worker's events a batch later than the other's
			// covers less of it, and fills it rather than replay onto it).
			if st := js.Stats(); st.Snapshots != 0 || st.ResumedSlots > 1 {
				t.Fatalf("the proxy resumed on the other replica but took %d snapshots and had %d slots filled again there", st.Snapshots, st.ResumedSlots)
			}
			t.Logf("proxy moved to the other replica in %s: %+v", time.Since(killed).Round(time.Millisecond), st.Journal)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the proxy did not move to the other replica: %+v (before %+v), replica %d blocks, b's index %d", st, before, p.Replica().Len(), b.Index().Len())
		}
		time.Sleep(20 * time.Millisecond)
	}
	load.await(10, "after the move")
	if sent, failed := load.stop(); failed != 0 {
		t.Fatalf("%d of %d requests failed across the failover", failed, sent)
	}
	// Routing still follows the index: for each family the proxy's decision sees, from b's
	// index, a worker caching its prompt, and the families are served from a cache (the
	// worker they were warmed on, or one the latency policy spilled them to while the
	// clients queued). The policy weighs load and hold-back beside the cache, so one family
	// of four may go elsewhere.
	served := 0
	for f := range 4 {
		r := chat(t, "http://"+p.Addr(), family(f), "after the failover")
		if r.status != 200 || maxCached(r.decision) < 150 {
			t.Fatalf("after the failover, family %d: status %d worker %q, and no candidate caching 150 blocks of it\ndecision: %s\nproxy's workers: %s",
				f, r.status, r.worker, r.decision, workerStates(p))
		}
		if r.cached >= 150*16 {
			served++
		} else {
			t.Logf("family %d went to %s, caching %d tokens of it (decision: %s)", f, r.worker, r.cached, r.decision)
		}
	}
	if served < 3 {
		t.Fatalf("%d of 4 families served from a cache after the failover, want at least 3\nproxy's workers: %s", served, workerStates(p))
	}
}

// maxCached is the most cached blocks of any candidate in an x-kvrelay-decision header.
func maxCached(decision string) int {
	best := 0
	for _, f := range strings.Fields(decision) {
		if v, ok := strings.CutPrefix(strings.TrimSuffix(f, ","), "cached="); ok {
			if n, err := strconv.Atoi(v); err == nil {
				best = max(best, n)
			}
		}
	}
	return best
}

// clients sends chat requests through the proxy at base from two clients, each cycling
// through the four prompt families, until stopped; a request that is not answered 200 is a
// test error naming what the requests run across.
func clients(t *testing.T, base, across string) *clientLoad {
	ctx, cancel := context.WithCancel(context.Background())
	l := &clientLoad{t: t, cancel: cancel}
	// A test that fails before it stops them stops them on its way out, before the proxy
	// they send to closes (cleanups run last registered first): a client must not report
	// to a test that has ended.
	t.Cleanup(func() { cancel(); l.wg.Wait() })
	for g := range 2 {
		l.wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				f := (i + g) % 4
				r := chat(t, base, family(f), "request "+strconv.Itoa(i))
				l.sent.Add(1)
				if r.status != 200 {
					l.failed.Add(1)
					t.Errorf("family %d during %s: status %d: %s", f, across, r.status, r.body)
				}
			}
		})
	}
	return l
}

// clientLoad is the requests of clients.
type clientLoad struct {
	t            *testing.T
	sent, failed atomic.Int64 // answered, and of those not with 200
	cancel       context.CancelFunc
	wg           sync.WaitGroup
}

// await waits until the clients have had n more requests answered than when it was
// called: requests on either side of an event, however fast a loaded machine serves them.
func (l *clientLoad) await(n int64, when string) {
	l.t.Helper()
	const within = 30 * time.Second
	target := l.sent.Load() + n
	for deadline := time.Now().Add(within); l.sent.Load() < target; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			l.t.Fatalf("%d requests answered %s, not %d within %v", n-(target-l.sent.Load()), when, n, within)
		}
	}
}

// stop stops the clients and returns how many requests were answered and how many of
// them failed.
func (l *clientLoad) stop() (sent, failed int64) {
	l.cancel()
	l.wg.Wait()
	return l.sent.Load(), l.failed.Load()
}

// TestScopedProxy: a proxy that routes a model no worker serves takes none of the workers
// and, once the control plane knows their model (from their engines), none of their blocks;
// a proxy scoped to the workers' model follows them all, as an unscoped one does.
func TestScopedProxy(t *testing.T) {
	c := newCluster(t, 2)
	all := c.addProxy(c.xds)
	waitWorkers(t, all, 2)
	waitKnown(t, all, 2)
	model := all.Workers()[0].Model
	mine := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.ServeModels = []string{model} })
	other := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.ServeModels = []string{"not-" + model} })
	waitWorkers(t, mine, 2)
	c.warm(2) // 150 blocks a worker at least
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := c.cp.Index().Len()
		if n >= 2*150 && all.Replica().Len() == n && mine.Replica().Len() == n && other.Replica().Len() == 0 && len(other.Workers()) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("index %d blocks; replicas: unscoped %d, scoped to %s %d, scoped to another model %d (%d workers)",
				n, all.Replica().Len(), model, mine.Replica().Len(), other.Replica().Len(), len(other.Workers()))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSlotsFollowModelsThenIDs: the control plane gives slots in the order of the workers'
// models and then ids, so that two replicas with the same registry agree, and each model's
// workers sit in neighbouring slots (a scoped proxy's replica then holds few of the index's
// shards).
func TestSlotsFollowModelsThenIDs(t *testing.T) {
	var specs []registry.Worker
	for i := range 6 {
		model := "b-model"
		if i%2 == 1 {
			model = "a-model"
		}
		specs = append(specs, registry.Worker{ID: fmt.Sprintf("w%d", 5-i), URL: fmt.Sprintf("http://127.0.0.1:%d", 1+i), Model: model, BlockSize: 16})
	}
	c := &cluster{t: t, specs: specs, dataDir: t.TempDir()}
	c.startControlPlane("127.0.0.1:0")
	got := c.cp.Index().Workers()
	// w4, w2, w0 serve a-model; w5, w3, w1 b-model.
	if want := []string{"w0", "w2", "w4", "w1", "w3", "w5"}; !slices.Equal(got, want) {
		t.Fatalf("slots %v, want %v", got, want)
	}
}
