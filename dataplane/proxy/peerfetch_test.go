package proxy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestPeerFetchThroughProxy: the worker caching a long prompt is full; a request extending
// that prompt goes to the idle worker, told to pull the prefix from the busy one (its
// transfer beats recomputing it, as the latency policy predicts), and is answered with the
// prefix cached: the subagent cold start, fixed.
func TestPeerFetchThroughProxy(t *testing.T) {
	c := startCluster(t, 2, func(cfg *proxy.Config) {
		cfg.Policy = route.PolicyLatency
		for i := range cfg.Upstreams {
			u := &cfg.Upstreams[i]
			u.MaxNumSeqs, u.KVBytesPerToken, u.PeerBandwidth = 1, 73728, 50e9
		}
	}, func(w *sim.WorkerConfig) {
		w.Engine.MaxNumSeqs = 1
		w.Engine.PeerFetch = true
	})
	parent := family(7) + strings.Repeat(" the long context of a parent agent", 600)
	// The parent's first call caches the context on one worker.
	resp, body := post(t, c.base+"/v1/chat/completions", chatBody(parent, "plan", 2, false))
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	holder := resp.Header.Get("x-kvrelay-worker")
	// The parent keeps that worker's only slot busy with a long stream.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", c.base+"/v1/chat/completions",
		strings.NewReader(`{"model":"`+model+`","messages":[{"role":"system","content":`+quote(parent)+`},{"role":"user","content":"plan"}],"max_tokens":100000,"ignore_eos":true,"stream":true}`))
	req.Header.Set("Content-Type", "application/json")
	long, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Body.Close()
	if w := long.Header.Get("x-kvrelay-worker"); w != holder {
		t.Fatalf("the long stream went to %s, not the holder %s", w, holder)
	}
	if _, err := bufio.NewReader(long.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	// A subagent forked from the parent's context.
	resp, body = post(t, c.base+"/v1/chat/completions", chatBody(parent, "subtask: check the tests", 2, false))
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if w := resp.Header.Get("x-kvrelay-worker"); w == holder {
		t.Fatalf("the subagent waited for the busy holder %s", holder)
	}
	if r := resp.Header.Get("x-kvrelay-route"); !strings.HasSuffix(r, "; fetch="+holder) {
		t.Fatalf("x-kvrelay-route %q does not name the holder %s it fetched from", r, holder)
	}
	var out struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatal(err)
	}
	if u := out.Usage; u.PromptTokensDetails.CachedTokens < u.PromptTokens/2 {
		t.Fatalf("the subagent's worker cached %d of %d prompt tokens: it did not fetch the parent's context", u.PromptTokensDetails.CachedTokens, u.PromptTokens)
	}
	if _, m := get(t, c.base+"/metrics"); !strings.Contains(m, "kvrelay_proxy_peer_fetches_total 1") {
		t.Fatalf("the proxy counts no peer fetch")
	}
}

func quote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
