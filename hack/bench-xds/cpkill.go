package main

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// runCPKill runs load through P proxies (C concurrent clients, short prompts drawn from 8
// families so that KV routing matters), closes the control plane at 1/3 of the run and
// starts a new one on the same xDS address and data dir at 1/2. It reports requests ok and
// failed per phase, the time from the restart until each proxy's ADS stream is connected
// again and its index journal is resynced (a new stream whose snapshot is complete, polled
// from XDSStats every 2 ms), and routing quality per phase: the hit rate, the share of
// requests served from cache (cached ≥ half the prompt), and the share that went to their
// family's home worker (where most of the family went before the kill).
func runCPKill(f flags, res *results) error {
	c, err := newCluster(clusterOpts{workers: f.workers, speedup: f.speedup, gpuBlocks: 4096}, logger(f))
	if err != nil {
		return err
	}
	defer c.close()
	if err := c.startControlPlane("127.0.0.1:0"); err != nil {
		return err
	}
	addr := c.xds
	var ps []*proxy.Server
	for range f.proxies {
		p, err := c.addProxy(nil)
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
	const families = 8
	prefixes := make([]string, families)
	for fam := range prefixes {
		var b strings.Builder
		for i := range 120 {
			fmt.Fprintf(&b, "family%d word%d ", fam, i)
		}
		prefixes[fam] = b.String()
	}

	type rec struct {
		reply
		at     time.Duration
		family int
	}
	var mu sync.Mutex
	var recs []rec
	t0 := time.Now()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := range f.concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 3))
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				fam := rng.IntN(families)
				at := time.Since(t0)
				r := chat("http://"+ps[g%len(ps)].Addr(), prefixes[fam], "client "+strconv.Itoa(g)+" turn "+strconv.Itoa(n), 8)
				mu.Lock()
				recs = append(recs, rec{r, at, fam})
				mu.Unlock()
			}
		}()
	}

	killAt, restartAt := f.duration/3, f.duration/2
	time.Sleep(time.Until(t0.Add(killAt)))
	// Close stops the control plane's listeners at once but returns only when its streams
	// have ended (or its shutdown grace has passed) and its data dir is released; the new
	// one cannot open the data dir before that, so a restart waits for Close.
	killed := time.Since(t0)
	old := c.cp
	closed := make(chan time.Duration, 1)
	go func() { t := time.Now(); _ = old.Close(); closed <- time.Since(t) }()
	time.Sleep(time.Until(t0.Add(restartAt)))
	closeTook := <-closed
	type before struct{ ads, jstreams, jbatches uint64 }
	bs := make([]before, len(ps))
	for i, p := range ps {
		st, _ := p.XDSStats()
		bs[i] = before{st.ADS.Streams, st.Journal.Streams, st.Journal.Batches}
	}
	if err := c.startControlPlane(addr); err != nil {
		close(stop)
		wg.Wait()
		return fmt.Errorf("restarting the control plane on %s: %w", addr, err)
	}
	restarted := time.Now()
	restartedAt := restarted.Sub(t0)
	adsAt := make([]time.Duration, len(ps))
	jAt := make([]time.Duration, len(ps))
	for done := 0; done < 2*len(ps) && time.Since(restarted) < f.duration/2; {
		done = 0
		for i, p := range ps {
			st, _ := p.XDSStats()
			if adsAt[i] == 0 && st.ADS.Streams > bs[i].ads && st.ADS.Connected {
				adsAt[i] = time.Since(restarted)
			}
			if jAt[i] == 0 && st.Journal.Streams > bs[i].jstreams && st.Journal.Batches > bs[i].jbatches && st.Journal.Synced {
				jAt[i] = time.Since(restarted)
			}
			if adsAt[i] != 0 {
				done++
			}
			if jAt[i] != 0 {
				done++
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	resynced := time.Since(t0)
	time.Sleep(time.Until(t0.Add(f.duration)))
	close(stop)
	wg.Wait()

	for i, p := range ps {
		st, _ := p.XDSStats()
		res.add("cpkill_resync", "proxy", "proxy-"+strconv.Itoa(i), "ads_connected_after", durOrNever(adsAt[i]),
			"journal_synced_after", durOrNever(jAt[i]), "ads_streams", st.ADS.Streams, "journal_streams", st.Journal.Streams,
			"replica_blocks", st.Blocks)
	}
	// The family's home: where most of its requests went before the kill.
	count := map[int]map[string]int{}
	for _, r := range recs {
		if r.at < killAt && r.status == 200 {
			if count[r.family] == nil {
				count[r.family] = map[string]int{}
			}
			count[r.family][r.worker]++
		}
	}
	home := map[int]string{}
	for fam, m := range count {
		best := -1
		for w, n := range m {
			if n > best {
				home[fam], best = w, n
			}
		}
	}
	phases := []struct {
		name     string
		from, to time.Duration
	}{
		{"before_kill", 0, killed},
		{"cp_down", killed, restartedAt},
		{"resyncing", restartedAt, resynced},
		{"after_resync", resynced, f.duration + time.Hour},
	}
	var okAll, errAll int
	var firstErr string
	for _, ph := range phases {
		var ok, errs, hits, atHome, cached, prompt int
		for _, r := range recs {
			if r.at < ph.from || r.at >= ph.to {
				continue
			}
			if r.status != 200 {
				errs++
				if firstErr == "" {
					firstErr = fmt.Sprintf("status %d %s", r.status, r.err)
				}
				continue
			}
			ok++
			cached += r.cached
			prompt += r.prompt
			if 2*r.cached >= r.prompt {
				hits++
			}
			if home[r.family] == r.worker {
				atHome++
			}
		}
		okAll += ok
		errAll += errs
		res.add("cpkill_phase", "phase", ph.name, "from", ph.from.Round(time.Millisecond), "ok", ok, "errors", errs,
			"hit_rate", float64(cached)/float64(max(prompt, 1)), "served_from_cache", float64(hits)/float64(max(ok, 1)),
			"at_family_home", float64(atHome)/float64(max(ok, 1)))
	}
	homes := make([]string, families)
	for fam := range homes {
		homes[fam] = strconv.Itoa(fam) + ":" + home[fam]
	}
	res.add("cpkill", "proxies", f.proxies, "workers", f.workers, "concurrency", f.concurrency, "duration", f.duration,
		"killed_at", killed.Round(time.Millisecond), "close_took", closeTook.Round(time.Millisecond),
		"restarted_at", restartedAt.Round(time.Millisecond),
		"requests_ok", okAll, "errors", errAll, "first_error", firstErr, "family_homes", strings.Join(homes, ","))
	return nil
}

func durOrNever(d time.Duration) any {
	if d == 0 {
		return "never"
	}
	return d
}
