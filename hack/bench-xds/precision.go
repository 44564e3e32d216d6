package main

import (
	"strconv"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// runPrecision warms 8 prompt families directly on the simulated workers (family f on
// worker f % W, bypassing every proxy), then sends one variant of each (same family prompt,
// a different user turn) through a proxy following the control plane (--xds) and, after
// that, through a proxy in approximate mode (static upstreams, its own index of its own
// decisions): how many land on the warmed worker, and the cached tokens they get.
func runPrecision(f flags, res *results) error {
	c, err := newCluster(clusterOpts{workers: f.workers, speedup: f.speedup, gpuBlocks: 4096}, logger(f))
	if err != nil {
		return err
	}
	defer c.close()
	if err := c.startControlPlane("127.0.0.1:0"); err != nil {
		return err
	}
	// -sharing off: the proxy does not report its in-flight requests (DisableLoadReports).
	noReports := f.sharing == "off"
	px, err := c.addProxy(func(cfg *proxy.Config) { cfg.DisableLoadReports = noReports })
	if err != nil {
		return err
	}
	if err := waitWorkers(px, f.workers); err != nil {
		return err
	}
	const families = 8
	var warmPrompt int
	for fam := range families {
		w := c.workers[fam%len(c.workers)]
		r := chat(w.URL(), family(fam), "warm", 4)
		if r.status != 200 {
			return errorf("warming family %d: %d %s", fam, r.status, r.err)
		}
		warmPrompt += r.prompt
	}
	// Each family's prompt is about 180 blocks; wait for the index and the replica.
	if err := c.waitBlocks(families * (warmPrompt / families / 16) * 9 / 10); err != nil {
		return err
	}
	res.add("precision_setup", "load_reports", !noReports, "workers", f.workers, "families", families, "prompt_tokens_mean", warmPrompt/families,
		"cp_index_blocks", c.cp.Index().Len(), "replica_blocks", px.Replica().Len())

	pa, err := c.addProxy(func(cfg *proxy.Config) { c.staticUpstreams(cfg) })
	if err != nil {
		return err
	}
	for _, m := range []struct {
		name string
		p    *proxy.Server
	}{{"xds", px}, {"approximate", pa}} {
		k, cached, prompt := 0, 0, 0
		for fam := range families {
			want := "w" + strconv.Itoa(fam%len(c.workers))
			// The load the proxy sees on the warmed worker just before routing: with no
			// request of its own in flight (variants go one at a time), any decode blocks
			// are what the control plane pushed from proxies' in-flight reports.
			seen := int64(-1)
			for _, w := range m.p.Workers() {
				if w.ID == want {
					seen = w.DecodeBlocks()
				}
			}
			r := chat("http://"+m.p.Addr(), family(fam), "variant through the "+m.name+" proxy", 4)
			if r.status != 200 {
				return errorf("%s proxy, family %d: %d %s", m.name, fam, r.status, r.err)
			}
			if r.worker == want {
				k++
			}
			cached += r.cached
			prompt += r.prompt
			res.add("precision_variant", "mode", m.name, "family", fam, "warmed_on", want, "routed_to", r.worker,
				"cached_tokens", r.cached, "prompt_tokens", r.prompt, "warmed_decode_blocks_seen", seen)
		}
		res.add("precision", "mode", m.name, "landed_on_warmed", strconv.Itoa(k)+"/"+strconv.Itoa(families),
			"cached_tokens_total", cached, "prompt_tokens_total", prompt, "hit_rate", float64(cached)/float64(max(prompt, 1)))
	}
	return nil
}
