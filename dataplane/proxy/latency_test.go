package proxy_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
)

func latencyCluster(t *testing.T, mut func(*proxy.Config)) *cluster {
	t.Helper()
	return startCluster(t, 3, func(cfg *proxy.Config) {
		cfg.Policy = route.PolicyLatency
		cfg.ExposeDecisionHeader = true
		for i := range cfg.Upstreams {
			cfg.Upstreams[i].MaxNumSeqs = 2
		}
		if mut != nil {
			mut(cfg)
		}
	}, func(w *sim.WorkerConfig) { w.Engine.MaxNumSeqs = 2 })
}

// TestLatencyPolicyThroughProxy: streamed requests under the latency policy carry the
// prediction in x-kvrelay-route and every candidate's in x-kvrelay-decision; they teach the
// chosen workers' models, show up in the prediction error metrics, and the sampled decisions
// are served with each candidate's prediction.
func TestLatencyPolicyThroughProxy(t *testing.T) {
	c := latencyCluster(t, nil)
	client := openai.NewClient(option.WithBaseURL(c.base+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(0))
	ctx := context.Background()
	for i := range 24 {
		var resp *http.Response
		params := openai.ChatCompletionNewParams{
			Model:     model,
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(family(i % 3)), openai.UserMessage("hello")},
			MaxTokens: openai.Int(4),
		}
		stream := client.Chat.Completions.NewStreaming(ctx, params, option.WithResponseInto(&resp))
		for stream.Next() {
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		rt, dec := resp.Header.Get("x-kvrelay-route"), resp.Header.Get("x-kvrelay-decision")
		if !strings.Contains(rt, "; ttft_ms=") {
			t.Fatalf("x-kvrelay-route %q has no prediction", rt)
		}
		if parts := strings.Split(dec, ", "); len(parts) != 3 || !strings.HasPrefix(parts[0], resp.Header.Get("x-kvrelay-worker")+" ttft=") {
			t.Fatalf("x-kvrelay-decision %q: want the chosen worker first, then the other two", dec)
		}
	}
	var learned int64
	for _, m := range c.proxy.WorkerModels() {
		learned += m.Observations
		if m.MaxNumSeqs != 2 {
			t.Fatalf("worker %s: max_num_seqs %d, want the configured 2", m.Worker, m.MaxNumSeqs)
		}
	}
	if learned != 24 {
		t.Fatalf("the models learned from %d first tokens, want 24", learned)
	}
	_, metrics := get(t, c.base+"/metrics")
	for _, want := range []string{"kvrelay_proxy_ttft_prediction_error_seconds_count", "kvrelay_proxy_ttft_prediction_relative_error_bucket", `stage="total"`} {
		if !strings.Contains(metrics, want) {
			t.Fatalf("/metrics lacks %s", want)
		}
	}
	srv := httptest.NewServer(c.proxy.DecisionsHandler())
	defer srv.Close()
	var decisions []proxy.DecisionJSON
	_, body := get(t, srv.URL+"/debug/decisions?n=2")
	if err := json.Unmarshal([]byte(body), &decisions); err != nil {
		t.Fatal(err)
	}
	if len(decisions) != 2 || len(decisions[0].Candidates) != 3 || decisions[0].Candidates[0].TTFTMs <= 0 {
		t.Fatalf("decisions: %+v", decisions)
	}
}

// TestLatencySLORefused: a TTFT target no worker can meet is queued until it passes and then
// refused with 429 slo_unmet; a reachable one is served.
func TestLatencySLORefused(t *testing.T) {
	c := latencyCluster(t, nil)
	body := chatBody(family(1), "hello", 4, false)
	for _, tc := range []struct {
		target string
		status int
	}{
		{"0.001", 429},
		{"1", 429},
		{"60000", 200},
	} {
		req, _ := http.NewRequest("POST", c.base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("x-slo-ttft-ms", tc.target)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Fatalf("x-slo-ttft-ms %s: status %d (%s), want %d", tc.target, resp.StatusCode, b, tc.status)
		}
		if tc.status == 429 {
			var e struct {
				Error struct{ Code string } `json:"error"`
			}
			if json.Unmarshal(b, &e) != nil || e.Error.Code != "slo_unmet" || resp.Header.Get("Retry-After") == "" {
				t.Fatalf("429 body %s, Retry-After %q", b, resp.Header.Get("Retry-After"))
			}
		}
	}
	// The OpenAI SDK sees an API error it can act on.
	client := openai.NewClient(option.WithBaseURL(c.base+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(0),
		option.WithHeader("x-slo-ttft-ms", "1"))
	_, err := client.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model: model, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}, MaxTokens: openai.Int(2),
	})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 429 || apiErr.Code != "slo_unmet" {
		t.Fatalf("SDK error %v", err)
	}
}
