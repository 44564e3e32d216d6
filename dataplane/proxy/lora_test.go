package proxy_test

import (
	"encoding/json"
	"net/http"
	"slices"
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
