package controlplane_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/internal/loopback"
)

// TestReplicasShareInflightLoad: two replicas on a real API server, a proxy on each. The
// decodes a proxy of one replica holds on the workers reach the proxy of the other (as
// others' decode blocks on those workers) through the replicas asking each other for their
// proxies' load; with the sharing off they never do (the engines' own metrics carry no
// decode blocks).
func TestReplicasShareInflightLoad(t *testing.T) {
	for _, share := range []bool{true, false} {
		name := map[bool]string{true: "shared", false: "not shared"}[share]
		t.Run(name, func(t *testing.T) {
			old := workerSpeedup
			workerSpeedup = 2 // decodes that last
			defer func() { workerSpeedup = old }()
			opts := func(o *controlplane.Options) { o.NoReplicaLoadShare = !share }
			lead, follow := leaderThen(t, opts, opts)
			f := follow[0]
			p0 := lead.c.addProxyWith(lead.c.cp.XDSAddr(), func(cfg *proxy.Config) { cfg.NodeID = "proxy-of-cp-0" })
			p1 := f.c.addProxyWith(f.c.cp.XDSAddr(), func(cfg *proxy.Config) { cfg.NodeID = "proxy-of-cp-1" })
			waitWorkers(t, p0, 4)
			waitWorkers(t, p1, 4)
			waitKnown(t, p0, 4)
			waitKnown(t, p1, 4)
			// Four long streamed decodes through the second replica's proxy.
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			defer wg.Wait()
			defer cancel()
			for i := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					body := `{"model":"` + model + `","max_tokens":1500,"ignore_eos":true,"stream":true,"messages":[{"role":"user","content":"hold ` + family(i) + `"}]}`
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+p1.Addr()+"/v1/chat/completions", strings.NewReader(body))
					req.Header.Set("Content-Type", "application/json")
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						if ctx.Err() == nil {
							t.Errorf("a held decode: %v", err)
						}
						return
					}
					if resp.StatusCode != 200 {
						b, _ := io.ReadAll(resp.Body)
						t.Errorf("a held decode: %s %s", resp.Status, b) // before wg.Wait returns
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}()
			}
			seen := func() (own, other int64) {
				for _, w := range p1.Workers() {
					_, _, d := w.Own()
					own += d
				}
				for _, w := range p0.Workers() {
					other += w.DecodeBlocks()
				}
				return own, other
			}
			// Shared, the first replica's proxy sees the decodes within a second or so; not
			// shared, it sees none while they run (watched for 1.5 s of them).
			deadline := time.Now().Add(10 * time.Second)
			var holding time.Time
			for time.Now().Before(deadline) {
				own, other := seen()
				if other > 0 {
					if !share {
						t.Fatalf("without sharing, the first replica's proxy sees %d decode blocks of the other's", other)
					}
					t.Logf("the first replica's proxy sees %d decode blocks of the %d the second's holds", other, own)
					return
				}
				if own > 0 && holding.IsZero() {
					holding = time.Now()
				}
				if !share && !holding.IsZero() && time.Since(holding) > 1500*time.Millisecond {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
			t.Fatalf("the second replica's proxy held decodes from %v; the first's never saw them", holding)
		})
	}
}

// TestReplicasPollEachEngineOnce: two replicas on a real API server share their polls of
// the engines, so that each engine is scraped by one of them, and the other takes that
// replica's readings; with the sharing off both scrape every engine. When the replica that
// polls an engine stops, the other polls it again within a second.
func TestReplicasPollEachEngineOnce(t *testing.T) {
	for _, share := range []bool{true, false} {
		name := map[bool]string{true: "shared", false: "not shared"}[share]
		t.Run(name, func(t *testing.T) {
			opts := func(o *controlplane.Options) { o.NoPollShare = !share }
			lead, follow := leaderThen(t, opts, opts)
			checkPollShare(t, lead.c.cp, follow[0].c.cp, share)
		})
	}
}

// TestReplicaPeersShare: replicas without Kubernetes, each given the other's operator API
// address (--replica-peers), share their polls and their proxies' load as elected replicas
// do.
func TestReplicaPeersShare(t *testing.T) {
	addrs := []string{freeAddr(t), freeAddr(t)}
	c := &cluster{t: t, workers: startWorkers(t, 4), dataDir: t.TempDir()}
	for i, w := range c.workers {
		c.specs = append(c.specs, specOf(i, w.URL(), w.EventsEndpoint(), w.ReplayEndpoint()))
	}
	c.cpOpts = func(o *controlplane.Options) { o.APIListen, o.ReplicaPeers = addrs[0], addrs[1:] }
	c.startControlPlane("127.0.0.1:0")
	c2 := &cluster{t: t, workers: c.workers, specs: c.specs, dataDir: t.TempDir(),
		cpOpts: func(o *controlplane.Options) { o.APIListen, o.ReplicaPeers, o.ReplicaID = addrs[1], addrs, "second" }}
	c2.startControlPlane("127.0.0.1:0")
	checkPollShare(t, c.cp, c2.cp, true)
}

// freeAddr is a loopback address with a port free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	a, err := loopback.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// checkPollShare counts the scrapes of every engine by replicas a and b over a second: with
// share, each engine is scraped by one of them and the other takes its readings, knowing
// its load and model all the same; without, both scrape it. With share, a is then closed
// and b must poll every engine itself within 5 s.
func checkPollShare(t *testing.T, a, b *controlplane.Server, share bool) {
	t.Helper()
	rs := []*controlplane.Server{a, b}
	const window = time.Second // 20 polls at the harness's 50 ms
	type counts struct{ scrapes, remote uint64 }
	read := func() [2]map[string]counts {
		var out [2]map[string]counts
		for i, r := range rs {
			out[i] = map[string]counts{}
			for id, st := range r.View().Stats() {
				out[i][id] = counts{st.Scrapes, st.Remote}
			}
		}
		return out
	}
	// Let the replicas hear each other, then count over a window.
	deadline := time.Now().Add(10 * time.Second)
	for share {
		taken := 0
		for _, r := range rs {
			for _, st := range r.View().Snapshot() {
				if st.From != "" {
					taken++
				}
			}
		}
		if taken == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s after the start, %d of the 4 engines are polled by one replica for the other", taken)
		}
		time.Sleep(20 * time.Millisecond)
	}
	before := read()
	time.Sleep(window)
	after := read()
	for id := range before[0] {
		d0 := counts{after[0][id].scrapes - before[0][id].scrapes, after[0][id].remote - before[0][id].remote}
		d1 := counts{after[1][id].scrapes - before[1][id].scrapes, after[1][id].remote - before[1][id].remote}
		t.Logf("%s over %s: the first replica scraped it %d times and took %d readings, the second %d and %d", id, window, d0.scrapes, d0.remote, d1.scrapes, d1.remote)
		if !share {
			if d0.scrapes < 10 || d1.scrapes < 10 || d0.remote+d1.remote != 0 {
				t.Errorf("%s: not shared, both replicas should scrape it", id)
			}
			continue
		}
		// The other replica polls an engine itself when no reading younger than three
		// scrape intervals is at hand (150 ms here): under a loaded -race suite a reading
		// can come that late now and then, so a few polls of its own are allowed, a fifth
		// of the poller's at most.
		if 5*min(d0.scrapes, d1.scrapes) > max(d0.scrapes, d1.scrapes) || max(d0.scrapes, d1.scrapes) < 10 || max(d0.remote, d1.remote) < 5 {
			t.Errorf("%s: want it scraped by one replica and the other taking its readings", id)
		}
		for i, r := range rs {
			if st, _ := r.View().Get(id); !st.Healthy || st.Model.ID == "" || time.Since(st.CheckedAt) > time.Second {
				t.Errorf("replica %d's state of %s: %+v, want healthy, its model, checked within a second", i, id, st)
			}
		}
	}
	if !share {
		return
	}
	// a stops: b polls every engine itself again.
	_ = a.Close()
	stopped := time.Now()
	deadline = time.Now().Add(5 * time.Second)
	for {
		own := 0
		for _, st := range b.View().Snapshot() {
			if st.From == "" && st.CheckedAt.After(stopped) && st.Healthy {
				own++
			}
		}
		if own == 4 {
			t.Logf("the other replica polls every engine itself %s after the first stopped", time.Since(stopped).Round(time.Millisecond))
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the first replica stopped, the other polls %d of the 4 engines itself", own)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
