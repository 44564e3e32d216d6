package controlplane_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// TestIndexQueryProxy: a proxy that keeps no replica (index_query) asks the control plane's
// index about each prompt and routes every warmed family to the worker caching it, tokenizing
// locally or through the engines' /tokenize; its replica stays empty and every routing found
// its answer. A proxy whose queries time out
// (the control plane 60 ms away, a 10 ms budget) still answers every request, routed as
// uncached, and counts the failures.
func TestIndexQueryProxy(t *testing.T) {
	c := newCluster(t, 4)
	pol := c.cp.Registry().Policy()
	pol.Name = "kv"
	if _, err := c.cp.Registry().SetPolicy(pol); err != nil {
		t.Fatal(err)
	}
	p := c.addProxyWith(c.xds, func(cfg *proxy.Config) {
		cfg.IndexQuery, cfg.IndexQueryTimeout = true, 5*time.Second
	})
	// Tokenizing through the engines' /tokenize: the query goes in the same trip.
	remote := c.addProxyWith(c.xds, func(cfg *proxy.Config) {
		cfg.IndexQuery, cfg.IndexQueryTimeout, cfg.Tokenizer = true, 5*time.Second, "remote"
	})
	slow := c.addProxyWith(delayRelay(t, c.xds, 60*time.Millisecond), func(cfg *proxy.Config) {
		cfg.IndexQuery, cfg.IndexQueryTimeout = true, 10*time.Millisecond
	})
	waitWorkers(t, p, 4)
	waitWorkers(t, remote, 4)
	waitWorkers(t, slow, 4)
	c.warm(8)
	c.waitBlocks(8 * 150)
	for _, px := range []*proxy.Server{p, remote} {
		time.Sleep(300 * time.Millisecond) // the other proxy's requests out of the fleet's load
		for f := range 8 {
			want := "w" + strconv.Itoa(f%4)
			r := chat(t, "http://"+px.Addr(), family(f), "variant "+px.Addr())
			if r.status != 200 || r.worker != want || r.cached == 0 {
				t.Errorf("family %d via %s: status %d worker %q cached %d, want %s with cached tokens", f, px.Addr(), r.status, r.worker, r.cached, want)
			}
		}
		st, _ := px.XDSStats()
		if st.Blocks != 0 || st.Journal.Streams != 0 || st.IndexQueries < 8 || st.IndexQueryFailures != 0 || st.IndexUnasked != 0 || st.IndexQueryBytes == 0 {
			t.Fatalf("%s: replica %d blocks, %d journal streams; %d queries, %d failed, %d unasked, %d bytes", px.Addr(), st.Blocks, st.Journal.Streams, st.IndexQueries, st.IndexQueryFailures, st.IndexUnasked, st.IndexQueryBytes)
		}
	}
	for f := range 4 {
		if r := chat(t, "http://"+slow.Addr(), family(f), "slow variant"); r.status != 200 {
			t.Fatalf("via the slow proxy: status %d %s", r.status, r.body)
		}
	}
	if st, _ := slow.XDSStats(); st.IndexQueryFailures < 4 || st.IndexUnasked < 4 {
		t.Fatalf("the slow proxy counted %d failed queries and %d unasked matches of 4 requests", st.IndexQueryFailures, st.IndexUnasked)
	}
	checkExposition(t, map[string]string{
		"http://" + p.Addr() + "/metrics":       "kvrelay_proxy_xds_index_queries_total",
		"http://" + slow.Addr() + "/metrics":    "kvrelay_proxy_xds_index_query_failures_total",
		"http://" + c.cp.APIAddr() + "/metrics": `kvrelay_controlplane_index_queries_total{result="answered"}`,
	})
}
