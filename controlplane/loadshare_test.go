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
