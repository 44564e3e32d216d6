package proxy_test

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestLoRAAdaptersRouteToTheirWorkers: a proxy that learns its workers' models from their
// /v1/models finds the LoRA adapter one of them serves, lists it, sends requests naming it
// only to that worker (a repeat hits its cache), answers 404 for an adapter nobody serves,
// and keeps plain requests on every worker.
func TestLoRAAdaptersRouteToTheirWorkers(t *testing.T) {
	plain := startWorker(t, nil)
	adapted := startWorker(t, func(c *sim.WorkerConfig) { c.Engine.LoRAModules = []string{"sql-lora"} })
	p := startProxy(t, nil, func(c *proxy.Config) {
		c.Policy = "round-robin"
		c.Upstreams = []proxy.Upstream{{ID: "plain", URL: plain.URL()}, {ID: "adapted", URL: adapted.URL()}}
	})
	base := "http://" + p.Addr()

	resp, err := http.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct{ Data []struct{ ID string } }
	_ = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if !slices.Equal(ids, []string{model, "sql-lora"}) {
		t.Fatalf("/v1/models lists %v", ids)
	}

	body := func(m string) string {
		b, _ := json.Marshal(map[string]any{"model": m, "max_tokens": 2, "messages": []map[string]string{{"role": "user", "content": family(3)}}})
		return string(b)
	}
	for i := range 4 {
		r, b := post(t, base+"/v1/chat/completions", body("sql-lora"))
		if r.StatusCode != 200 || r.Header.Get("x-kvrelay-worker") != "adapted" {
			t.Fatalf("adapter request %d: %d on %q: %s", i, r.StatusCode, r.Header.Get("x-kvrelay-worker"), b)
		}
		var out struct {
			Model string
			Usage struct {
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			}
		}
		_ = json.Unmarshal(b, &out)
		if out.Model != "sql-lora" || (i > 0 && out.Usage.PromptTokensDetails.CachedTokens == 0) {
			t.Errorf("adapter request %d: model %q, cached %d", i, out.Model, out.Usage.PromptTokensDetails.CachedTokens)
		}
	}
	if r, b := post(t, base+"/v1/chat/completions", body("other-lora")); r.StatusCode != 404 {
		t.Errorf("an adapter nobody serves: %d %s", r.StatusCode, b)
	}
	seen := map[string]bool{}
	for range 4 {
		r, _ := post(t, base+"/v1/chat/completions", body(model))
		seen[r.Header.Get("x-kvrelay-worker")] = true
	}
	if !seen["plain"] || !seen["adapted"] {
		t.Errorf("plain requests reached %v, want both workers", seen)
	}
}

// TestRoutingRegretIsExported: every routed request adds to the regret histograms of the
// policy routing it (a static proxy's version is "local"); a repeat of a prompt its worker
// holds regrets nothing.
func TestRoutingRegretIsExported(t *testing.T) {
	c := startCluster(t, 2, func(cfg *proxy.Config) { cfg.Policy = "kv" }, nil)
	for range 3 {
		if r, b := post(t, c.base+"/v1/chat/completions", chatBody(family(1), "again", 2, false)); r.StatusCode != 200 {
			t.Fatalf("%d %s", r.StatusCode, b)
		}
	}
	_, m := get(t, c.base+"/metrics")
	for _, want := range []string{
		`kvrelay_proxy_routing_regret_blocks_count{policy="kv",policy_version="local"} 3`,
		`kvrelay_proxy_routing_regret_blocks_sum{policy="kv",policy_version="local"} 0`,
		// The first, on an empty index, went by the spread rule; the repeats by cost.
		`kvrelay_proxy_routing_cost_gap_count{policy="kv",policy_version="local"} 2`,
		`kvrelay_proxy_routing_cost_gap_sum{policy="kv",policy_version="local"} 0`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}
