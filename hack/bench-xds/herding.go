package main

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// runHerding sends requests that all share one ~4k-token system prompt, each with its own
// user turn, through P proxies at once (C concurrent clients, request i through proxy
// i % P), to W simulated workers behind one control plane: every proxy's replica says the
// same worker holds the shared prefix, so without knowing each other's in-flight requests
// the proxies may all pile onto it. It runs once per -sharing setting (on: proxies report
// their in-flight requests and the control plane merges them into the load it pushes; off:
// proxy.Config.DisableLoadReports), each on a fresh cluster, and reports every worker's share
// of the requests (max/min) and the hit rate (Σ cached_tokens / Σ prompt_tokens).
func runHerding(f flags, res *results) error {
	system := sharedSystemPrompt(4000)
	for _, setting := range strings.Split(f.sharing, ",") {
		var off bool
		switch setting {
		case "on":
		case "off":
			off = true
		default:
			return errorf("-sharing: %q is neither on nor off", setting)
		}
		if err := herdOnce(f, res, system, setting, off); err != nil {
			return fmt.Errorf("sharing %s: %w", setting, err)
		}
	}
	return nil
}

func sharedSystemPrompt(words int) string {
	rng := rand.New(rand.NewPCG(42, 7))
	vocab := strings.Fields("river stone cloud market engine garden silver window planet music forest signal copper lantern harbor meadow")
	var b strings.Builder
	b.WriteString("You are the shared assistant of this benchmark. ")
	for range words {
		b.WriteString(vocab[rng.IntN(len(vocab))])
		b.WriteByte(' ')
	}
	return b.String()
}

func herdOnce(f flags, res *results, system, setting string, noReports bool) error {
	c, err := newCluster(clusterOpts{workers: f.workers, speedup: f.speedup, gpuBlocks: 16384}, logger(f))
	if err != nil {
		return err
	}
	defer c.close()
	if err := c.startControlPlane("127.0.0.1:0"); err != nil {
		return err
	}
	var ps []*proxy.Server
	for range f.proxies {
		p, err := c.addProxy(func(cfg *proxy.Config) { cfg.DisableLoadReports = noReports })
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	for _, p := range ps {
		if err := waitWorkers(p, f.workers); err != nil {
			return err
		}
	}
	type rec struct {
		reply
		proxy int
	}
	recs := make([]rec, f.requests)
	next := make(chan int)
	var wg sync.WaitGroup
	t0 := time.Now()
	for range f.concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				p := i % len(ps)
				r := chat("http://"+ps[p].Addr(), system, "User "+strconv.Itoa(i)+": please summarise the passage above in one line, case "+strconv.Itoa(i*7919%1000), 16)
				recs[i] = rec{r, p}
			}
		}()
	}
	for i := range f.requests {
		next <- i
	}
	close(next)
	wg.Wait()
	elapsed := time.Since(t0)

	share := map[string]int{}
	var cached, prompt, errs int
	var lat []time.Duration
	for _, r := range recs {
		if r.status != 200 {
			errs++
			continue
		}
		share[r.worker]++
		cached += r.cached
		prompt += r.prompt
		lat = append(lat, r.latency)
	}
	for _, s := range c.specs {
		if _, ok := share[s.ID]; !ok {
			share[s.ID] = 0
		}
	}
	ids := make([]string, 0, len(share))
	mx, mn := 0, f.requests
	for id, n := range share {
		ids = append(ids, id)
		mx, mn = max(mx, n), min(mn, n)
	}
	sort.Strings(ids)
	var per []string
	for _, id := range ids {
		per = append(per, id+":"+strconv.Itoa(share[id]))
	}
	ratio := "inf"
	if mn > 0 {
		ratio = fmt.Sprintf("%.2f", float64(mx)/float64(mn))
	}
	p50, p99, _ := percentiles(lat)
	var reports uint64
	for _, p := range ps {
		if st, ok := p.XDSStats(); ok {
			reports += st.Reports
		}
	}
	res.add("herding", "sharing", setting, "proxies", f.proxies, "workers", f.workers, "requests", f.requests,
		"concurrency", f.concurrency, "errors", errs, "share_max_min", ratio, "max", mx, "min", mn,
		"hit_rate", float64(cached)/float64(max(prompt, 1)), "prompt_tokens_mean", prompt/max(len(lat), 1),
		"p50", p50, "p99", p99, "elapsed", elapsed, "load_reports_sent", reports)
	res.add("herding_share", "sharing", setting, "per_worker", strings.Join(per, ","))
	return nil
}
