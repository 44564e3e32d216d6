package controlplane_test

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

var herding = flag.Bool("herding", false, "run TestHerding, a measurement (hack/bench-herding.sh)")

// TestHerding measures how evenly two proxies spread a burst over four workers when they
// follow one control-plane replica, two replicas that share their proxies' in-flight load,
// and two that do not: each proxy gets 24 long streamed requests of distinct prompts, one
// every 40 ms, both at once; every request outlasts the burst, so the requests each worker
// got are its in-flight requests at the burst's end. It logs, per setup, the workers'
// counts and max/mean (1 is even; 4 is every request on one worker). A measurement, not a
// check: it runs only with -herding.
func TestHerding(t *testing.T) {
	if !*herding {
		t.Skip("a measurement: go test -run TestHerding -herding ./controlplane/ (hack/bench-herding.sh)")
	}
	old := workerSpeedup
	workerSpeedup = 1 // decodes of several seconds
	defer func() { workerSpeedup = old }()
	for _, setup := range []struct {
		name     string
		replicas int
		share    bool
	}{{"one replica", 1, true}, {"two replicas, load shared", 2, true}, {"two replicas, load not shared", 2, false}} {
		t.Run(setup.name, func(t *testing.T) {
			opts := func(o *controlplane.Options) { o.NoReplicaLoadShare = !setup.share }
			var follow []func(*controlplane.Options)
			if setup.replicas == 2 {
				follow = append(follow, opts)
			}
			lead, followers := leaderThen(t, opts, follow...)
			second := lead
			if setup.replicas == 2 {
				second = followers[0]
			}
			ps := [2]*proxy.Server{
				lead.c.addProxyWith(lead.c.cp.XDSAddr(), func(cfg *proxy.Config) { cfg.NodeID = "proxy-a" }),
				second.c.addProxyWith(second.c.cp.XDSAddr(), func(cfg *proxy.Config) { cfg.NodeID = "proxy-b" }),
			}
			for _, p := range ps {
				waitWorkers(t, p, 4)
			}
			ctx, cancel := context.WithCancel(context.Background())
			var mu sync.Mutex
			counts := map[string]int{}
			var ttfts []float64 // seconds to the answer's headers, which the proxy sends with the first token
			var wg sync.WaitGroup
			var started sync.WaitGroup // every request answered its headers (or failed)
			started.Add(2 * 24)
			for i, p := range ps {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for j := range 24 {
						wg.Add(1)
						go func() {
							defer wg.Done()
							body := fmt.Sprintf(`{"model":%q,"max_tokens":2000,"ignore_eos":true,"stream":true,"messages":[{"role":"user","content":"burst %d-%d: tell me a long story"}]}`, model, i, j)
							req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+p.Addr()+"/v1/chat/completions", strings.NewReader(body))
							req.Header.Set("Content-Type", "application/json")
							sent := time.Now()
							resp, err := http.DefaultClient.Do(req)
							took := time.Since(sent).Seconds()
							started.Done()
							if err != nil {
								return
							}
							mu.Lock()
							counts[resp.Header.Get("x-kvrelay-worker")]++
							ttfts = append(ttfts, took)
							mu.Unlock()
							_, _ = io.Copy(io.Discard, resp.Body)
							resp.Body.Close()
						}()
						time.Sleep(40 * time.Millisecond)
					}
				}()
			}
			started.Wait()
			mu.Lock()
			var n []int
			total := 0
			for _, c := range counts {
				n = append(n, c)
				total += c
			}
			slices.Sort(ttfts)
			q := func(f float64) float64 {
				if len(ttfts) == 0 {
					return 0
				}
				return 1000 * ttfts[min(int(f*float64(len(ttfts))), len(ttfts)-1)]
			}
			p50, p90 := q(0.5), q(0.9)
			mu.Unlock()
			cancel()
			wg.Wait()
			for len(n) < 4 {
				n = append(n, 0)
			}
			slices.Sort(n)
			mean := float64(total) / 4
			t.Logf("herding %s: requests per worker %v, max/mean %.2f, time to first token p50 %.0f ms, p90 %.0f ms", setup.name, n, float64(n[3])/mean, p50, p90)
		})
	}
}
