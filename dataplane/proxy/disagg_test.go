package proxy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// pdCluster is a proxy in front of simulated prefill and decode workers (static upstreams
// with roles), plus the URLs of extra upstreams (dead ones, for failure tests).
type pdCluster struct {
	prefill, decode []*sim.Worker
	proxy           *proxy.Server
	base            string
}

func startPD(t *testing.T, nPrefill, nDecode int, extra []proxy.Upstream, mut func(*proxy.Config)) *pdCluster {
	t.Helper()
	c := &pdCluster{}
	cfg := func(role sim.Role) func(*sim.WorkerConfig) {
		return func(w *sim.WorkerConfig) { w.Engine.Role = role }
	}
	var ups []proxy.Upstream
	for i := range nPrefill {
		w := startWorker(t, cfg(sim.RolePrefill))
		c.prefill = append(c.prefill, w)
		ups = append(ups, proxy.Upstream{ID: "p" + string(rune('0'+i)), URL: w.URL(), Model: model, Role: "prefill"})
	}
	for i := range nDecode {
		w := startWorker(t, cfg(sim.RoleDecode))
		c.decode = append(c.decode, w)
		ups = append(ups, proxy.Upstream{ID: "d" + string(rune('0'+i)), URL: w.URL(), Model: model, Role: "decode"})
	}
	ups = append(ups, extra...)
	c.proxy = startProxy(t, nil, func(pc *proxy.Config) {
		pc.Upstreams = ups
		if mut != nil {
			mut(pc)
		}
	})
	c.base = "http://" + c.proxy.Addr()
	return c
}

func (c *pdCluster) metrics(t *testing.T) string {
	t.Helper()
	_, m := get(t, c.base+"/metrics")
	return m
}

func workerMetrics(t *testing.T, w *sim.Worker) string {
	t.Helper()
	_, m := get(t, w.URL()+"/metrics")
	return m
}

// A long prompt goes prefill worker → decode worker (the decode side pulls the KV over
// nixl), streaming and not, through the official SDK; the same prompt again is cached on
// the decode worker and prefills there (conditional disaggregation).
func TestDisaggThroughProxy(t *testing.T) {
	c := startPD(t, 1, 1, nil, nil)
	client := openai.NewClient(option.WithBaseURL(c.base+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(0))
	ctx := context.Background()
	params := openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(family(1)), openai.UserMessage("first question")},
		MaxTokens: openai.Int(8),
	}
	var hdr *http.Response
	got, err := client.Chat.Completions.New(ctx, params, option.WithResponseInto(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	if got.Usage.CompletionTokens != 8 || got.Choices[0].Message.Content == "" {
		t.Fatalf("answer %+v", got)
	}
	if w := hdr.Header.Get("x-kvrelay-worker"); w != "d0" {
		t.Fatalf("answered by %q, want the decode worker", w)
	}
	m := c.metrics(t)
	if v := metricValue(t, m, `kvrelay_proxy_disagg_requests_total{path="remote"}`); v != 1 {
		t.Fatalf("remote prefills %v, want 1", v)
	}
	if v := metricSum(t, workerMetrics(t, c.decode[0]), "kvrelay_sim_kv_pulls_total"); v != 1 {
		t.Fatalf("decode worker pulled %v times, want 1", v)
	}

	// Streaming, a different user turn after the same long system prompt: the decode worker
	// caches the system prompt now, so the uncached part is short and it prefills itself.
	params.Messages[1] = openai.UserMessage("second question")
	stream := client.Chat.Completions.NewStreaming(ctx, params)
	var text strings.Builder
	for stream.Next() {
		if ch := stream.Current(); len(ch.Choices) > 0 {
			text.WriteString(ch.Choices[0].Delta.Content)
		}
	}
	if err := stream.Err(); err != nil || text.Len() == 0 {
		t.Fatalf("stream: %v, %q", err, text.String())
	}
	m = c.metrics(t)
	if v := metricValue(t, m, `kvrelay_proxy_disagg_requests_total{path="local"}`); v != 1 {
		t.Fatalf("local prefills %v, want 1 (the decode worker caches the prefix)", v)
	}
	if v := metricSum(t, workerMetrics(t, c.decode[0]), "kvrelay_sim_kv_pulls_total"); v != 1 {
		t.Fatalf("decode worker pulled %v times, want still 1", v)
	}
}

// A prefill worker with a P2P side channel (vLLM's OffloadingConnector p2p tier; the
// simulated engine's is its HTTP port) takes the legs in that tier's form: the prefill leg
// names a kv_request_id, the decode leg names it and the prefiller's side channel, and the
// decode worker pulls the prompt from there; the prefill worker's hold ends when its decoder
// has taken the blocks.
func TestDisaggP2PFormThroughProxy(t *testing.T) {
	c := startPD(t, 1, 1, nil, func(pc *proxy.Config) {
		for i, u := range pc.Upstreams {
			if u.Role == "prefill" {
				_, port, _ := net.SplitHostPort(strings.TrimPrefix(u.URL, "http://"))
				fmt.Sscan(port, &pc.Upstreams[i].P2PPort)
			}
		}
	})
	client := openai.NewClient(option.WithBaseURL(c.base+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(0))
	var hdr *http.Response
	got, err := client.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(family(2)), openai.UserMessage("a question")},
		MaxTokens: openai.Int(8),
	}, option.WithResponseInto(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	if got.Usage.CompletionTokens != 8 || hdr.Header.Get("x-kvrelay-worker") != "d0" {
		t.Fatalf("answer %+v from %q", got.Usage, hdr.Header.Get("x-kvrelay-worker"))
	}
	if v := metricValue(t, c.metrics(t), `kvrelay_proxy_disagg_requests_total{path="remote"}`); v != 1 {
		t.Fatalf("remote prefills %v, want 1", v)
	}
	if pulls(t, c.decode[0]) != 1 {
		t.Fatal("the decode worker did not pull from its prefiller once")
	}
	if got.Usage.PromptTokensDetails.CachedTokens < got.Usage.PromptTokens/2 {
		t.Fatalf("usage %+v: the decode worker should have pulled the prompt", got.Usage)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if reqs, _ := c.prefill[0].Engine().HeldKV(); reqs == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the prefill worker still holds the leg's blocks 5 s after its decoder took them")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// With a threshold below zero every request prefills remotely; a prefill worker that
// refuses connections makes the decode worker prefill itself, and the client sees nothing.
func TestDisaggPrefillDownFallsBack(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()
	c := startPD(t, 0, 1, []proxy.Upstream{{ID: "p-dead", URL: dead, Model: model, Role: "prefill"}},
		func(pc *proxy.Config) { pc.DisaggThreshold = -1 })
	for i := range 3 {
		resp, body := post(t, c.base+"/v1/chat/completions", chatBody(family(i), "hi", 4, i%2 == 1))
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	m := c.metrics(t)
	if v := metricValue(t, m, `kvrelay_proxy_disagg_requests_total{path="fallback"}`); v != 3 {
		t.Fatalf("fallbacks %v, want 3", v)
	}
	if v := metricValue(t, m, "kvrelay_proxy_prefill_leg_failures_total"); v != 3 {
		t.Fatalf("prefill failures %v, want 3", v)
	}
}

// A decode worker that refuses connections: the request is retried on the other decode
// worker, prefilling there; every request succeeds.
func TestDisaggDecodeRetried(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()
	c := startPD(t, 1, 1, []proxy.Upstream{{ID: "d-dead", URL: dead, Model: model, Role: "decode"}},
		func(pc *proxy.Config) { pc.DisaggThreshold = -1; pc.EjectAfter = 100 })
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post(c.base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(family(10+i), "hi", 4, false)))
			if err != nil {
				errs <- err.Error()
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || resp.Header.Get("x-kvrelay-worker") != "d0" {
				errs <- resp.Status + " from " + resp.Header.Get("x-kvrelay-worker") + ": " + string(b)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// The client leaving during the prefill leg ends it; nothing hangs and the proxy serves on.
func TestDisaggClientGoneDuringPrefill(t *testing.T) {
	c := startPD(t, 1, 1, nil, func(pc *proxy.Config) { pc.DisaggThreshold = -1 })
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", c.base+"/v1/chat/completions", strings.NewReader(chatBody(family(30), "hi", 4, true)))
	req.Header.Set("Content-Type", "application/json")
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
	}()
	cancel()
	<-done
	resp, body := post(t, c.base+"/v1/chat/completions", chatBody(family(31), "hi", 4, false))
	if resp.StatusCode != 200 {
		t.Fatalf("after an abandoned request: %d %s", resp.StatusCode, body)
	}
}

// TestP2PPrefillLegBody: in vLLM's p2p form the prefill leg names the proxy's transfer to
// its decoder and, when the routing core chose a peer to pull the prompt's prefix from, that
// peer's side channel under a transfer of its own, beside it in the one kv_transfer_params.
func TestP2PPrefillLegBody(t *testing.T) {
	client := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":50}`)
	for _, tc := range []struct {
		source   string
		wantPeer bool
	}{{"", false}, {"10.0.0.7:5600", true}} {
		out, err := proxy.PrefillLegBody(client, "kvrelay-0011223344556677", tc.source)
		if err != nil {
			t.Fatal(err)
		}
		var got struct {
			Params struct {
				Decoder struct {
					ID string `json:"kv_request_id"`
				} `json:"remote_decoder"`
				Source *struct {
					ID   string `json:"kv_request_id"`
					Host string `json:"remote_host"`
					Port int    `json:"remote_port"`
				} `json:"remote_kv_source"`
			} `json:"kv_transfer_params"`
			MaxTokens int  `json:"max_tokens"`
			Stream    bool `json:"stream"`
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("%s: %v", out, err)
		}
		p := got.Params
		if p.Decoder.ID != "kvrelay-0011223344556677" || got.MaxTokens != 1 || got.Stream {
			t.Fatalf("source %q: %s", tc.source, out)
		}
		switch {
		case !tc.wantPeer && p.Source != nil:
			t.Fatalf("no peer chosen, yet %s", out)
		case tc.wantPeer && (p.Source == nil || p.Source.Host != "10.0.0.7" || p.Source.Port != 5600 ||
			!strings.HasPrefix(p.Source.ID, "kvrelay-") || p.Source.ID == p.Decoder.ID):
			t.Fatalf("peer %s: %s", tc.source, out)
		}
	}
}

// Both legs' bodies follow vLLM NixlConnector's fixtures: the client's request becomes the
// prefill request exactly, and with the prefill answer's kv_transfer_params the decode
// request exactly.
func TestDisaggLegBodiesMatchFixtures(t *testing.T) {
	read := func(name string) map[string]any {
		b, err := os.ReadFile("../../engines/sim/testdata/nixl/" + name)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	decodeReq := read("decode_request.json")
	client := map[string]any{}
	for k, v := range decodeReq {
		if k != "kv_transfer_params" {
			client[k] = v
		}
	}
	clientBody, _ := json.Marshal(client)
	pre, err := proxy.PrefillLegBody(clientBody, "", "")
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(pre, &got); err != nil {
		t.Fatal(err)
	}
	if want := read("prefill_request.json"); !reflect.DeepEqual(got, want) {
		t.Fatalf("prefill leg\n got %v\nwant %v", got, want)
	}
	answer, _ := json.Marshal(read("prefill_response.json"))
	params, err := proxy.PrefillParams(answer)
	if err != nil {
		t.Fatal(err)
	}
	dec, err := proxy.DecodeLegBody(clientBody, params)
	if err != nil {
		t.Fatal(err)
	}
	got = nil
	if err := json.Unmarshal(dec, &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, decodeReq) {
		t.Fatalf("decode leg\n got %v\nwant %v", got, decodeReq)
	}
	// Answers that cannot start a decode leg are refused.
	for _, bad := range []string{`{}`, `{"kv_transfer_params":null}`, `{"kv_transfer_params":{"do_remote_prefill":false}}`, `{"kv_transfer_params":[1]}`, `not json`} {
		if _, err := proxy.PrefillParams([]byte(bad)); err == nil {
			t.Errorf("PrefillParams(%s) accepted", bad)
		}
	}
}

// metricSum adds up every series of a metric, whatever its labels.
func metricSum(t *testing.T, exposition, name string) float64 {
	t.Helper()
	var sum float64
	found := false
	for _, line := range strings.Split(exposition, "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err != nil {
			t.Fatal(err)
		}
		sum, found = sum+v, true
	}
	if !found {
		t.Fatalf("no series %s", name)
	}
	return sum
}

// A turn sent with the speculative_prefill hint is followed by a warm-up of the
// conversation with its answer, so the next turn finds the answer's tokens cached too.
func TestSpeculativePrefill(t *testing.T) {
	c := startCluster(t, 1, nil, nil)
	msgs := []map[string]string{{"role": "system", "content": family(40)}, {"role": "user", "content": "first"}}
	body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 48, "stream": true,
		"stream_options": map[string]bool{"include_usage": true}, "messages": msgs,
		"nvext": map[string]any{"agent_hints": map[string]any{"speculative_prefill": true}}})
	resp, raw := post(t, c.base+"/v1/chat/completions", string(body))
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, raw)
	}
	var answer strings.Builder
	prompt1 := 0
	for _, line := range strings.Split(string(raw), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || !strings.HasPrefix(data, "{") {
			continue
		}
		var ch struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			t.Fatal(err)
		}
		if len(ch.Choices) > 0 {
			answer.WriteString(ch.Choices[0].Delta.Content)
		}
		if ch.Usage != nil {
			prompt1 = ch.Usage.PromptTokens
		}
	}
	if answer.Len() == 0 || prompt1 == 0 {
		t.Fatalf("no answer or usage in %s", raw)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, m := get(t, c.base+"/metrics"); strings.Contains(m, `kvrelay_proxy_speculative_prefills_total{outcome="sent"} 1`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no speculative prefill sent")
		}
		time.Sleep(20 * time.Millisecond)
	}
	msgs = append(msgs, map[string]string{"role": "assistant", "content": answer.String()}, map[string]string{"role": "user", "content": "second"})
	body, _ = json.Marshal(map[string]any{"model": model, "max_tokens": 4, "messages": msgs})
	resp, raw = post(t, c.base+"/v1/chat/completions", string(body))
	var out struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, raw)
	}
	// Without the warm-up only the first prompt's full blocks would be cached; with it,
	// the answer's blocks too.
	if cached := out.Usage.Details.Cached; cached < prompt1+32 {
		t.Fatalf("second turn cached %d of %d tokens; the first prompt had %d", cached, out.Usage.PromptTokens, prompt1)
	}
}

// Conditional disaggregation: with a prefill leg already queued past DisaggMaxQueue on the
// only prefill worker, the next request prefills on the decode worker.
func TestDisaggSaturatedPrefillPoolGoesLocal(t *testing.T) {
	slow := startWorker(t, func(w *sim.WorkerConfig) { w.Engine.Role = sim.RolePrefill; w.Engine.Timing.Speedup = 0.5 })
	dec := startWorker(t, func(w *sim.WorkerConfig) { w.Engine.Role = sim.RoleDecode })
	p := startProxy(t, nil, func(pc *proxy.Config) {
		pc.Upstreams = []proxy.Upstream{{ID: "p0", URL: slow.URL(), Model: model, Role: "prefill"}, {ID: "d0", URL: dec.URL(), Model: model, Role: "decode"}}
		pc.DisaggMaxQueue = 100
	})
	base := "http://" + p.Addr()
	first := make(chan int, 1)
	go func() {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(family(50), "hi", 2, false)))
		if err != nil {
			first <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	scrape := func() string {
		_, m := get(t, base+"/metrics")
		return m
	}
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(scrape(), "kvrelay_proxy_prefill_legs_inflight 1") {
		if time.Now().After(deadline) {
			t.Fatal("the first request's prefill leg never started")
		}
		time.Sleep(5 * time.Millisecond)
	}
	resp, body := post(t, base+"/v1/chat/completions", chatBody(family(51), "hi", 2, false))
	if resp.StatusCode != 200 {
		t.Fatalf("second: %d %s", resp.StatusCode, body)
	}
	m := scrape()
	if v := metricValue(t, m, `kvrelay_proxy_disagg_requests_total{path="local"}`); v != 1 {
		t.Fatalf("local prefills %v, want 1 (the prefill pool was saturated)", v)
	}
	if code := <-first; code != 200 {
		t.Fatalf("first: %d", code)
	}
	if v := metricValue(t, scrape(), `kvrelay_proxy_disagg_requests_total{path="remote"}`); v != 1 {
		t.Fatalf("remote prefills %v, want 1", v)
	}
}

// A request whose decode pool is busy when its prefill leg ends waits in the admission queue
// with its kv_transfer_params, and decodes remotely prefilled once the decode worker frees.
func TestDisaggDecodeBusyAfterPrefillWaits(t *testing.T) {
	slow := startWorker(t, func(w *sim.WorkerConfig) { w.Engine.Role = sim.RolePrefill; w.Engine.Timing.Speedup = 0.2 })
	dec := startWorker(t, func(w *sim.WorkerConfig) { w.Engine.Role = sim.RoleDecode; w.Engine.Timing.Speedup = 1 })
	p := startProxy(t, nil, func(pc *proxy.Config) {
		pc.Upstreams = []proxy.Upstream{{ID: "p0", URL: slow.URL(), Model: model, Role: "prefill"}, {ID: "d0", URL: dec.URL(), Model: model, Role: "decode"}}
		pc.BusyDecodeBlocks = 1 // the decode worker takes one request at a time
	})
	base := "http://" + p.Addr()
	long := make(chan int, 1)
	go func() {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(family(60), "hi", 2, false)))
		if err != nil {
			long <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		long <- resp.StatusCode
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, m := get(t, base+"/metrics"); strings.Contains(m, "kvrelay_proxy_prefill_legs_inflight 1") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the long request's prefill leg never started")
		}
		time.Sleep(2 * time.Millisecond)
	}
	// A short prompt prefills on the decode worker (under the threshold) and keeps it busy
	// decoding while the long request's prefill leg ends.
	resp, body := post(t, base+"/v1/chat/completions", chatBody("short", "hi", 200, false))
	if resp.StatusCode != 200 {
		t.Fatalf("short request: %d %s", resp.StatusCode, body)
	}
	if code := <-long; code != 200 {
		t.Fatalf("long request: %d", code)
	}
	_, m := get(t, base+"/metrics")
	if v := metricValue(t, m, `kvrelay_proxy_queue_requests_total{outcome="dispatched"}`); v < 1 {
		t.Fatalf("queue dispatched %v requests, want the long one", v)
	}
	if v := metricValue(t, m, `kvrelay_proxy_disagg_requests_total{path="remote"}`); v != 1 {
		t.Fatalf("remote prefills %v, want 1", v)
	}
	if v := metricSum(t, workerMetrics(t, dec), "kvrelay_sim_kv_pulls_total"); v != 1 {
		t.Fatalf("decode worker pulled %v times, want 1", v)
	}
}

// TestDisaggP2PPrefillPullsFromBusyHolder: in vLLM's p2p form, the prefill worker that
// caches a long system prompt is busy (its one slot prefilling a longer request that shares
// the prompt); a request with that prompt goes to the other prefill worker, whose leg names
// the holder (remote_kv_source beside remote_decoder): it pulls the prompt's blocks from the
// holder, computes only the rest, and its decoder pulls from it in turn.
func TestDisaggP2PPrefillPullsFromBusyHolder(t *testing.T) {
	c := &pdCluster{}
	var ups []proxy.Upstream
	for i := range 2 {
		w := startWorker(t, func(w *sim.WorkerConfig) {
			w.Engine.Role, w.Engine.MaxNumSeqs, w.Engine.PeerFetch = sim.RolePrefill, 1, true
			w.Engine.Timing.Speedup = 0.5 // a long prefill takes long enough (about 1.4 s) to be seen busy
		})
		c.prefill = append(c.prefill, w)
		_, port, _ := net.SplitHostPort(strings.TrimPrefix(w.URL(), "http://"))
		u := proxy.Upstream{ID: "p" + string(rune('0'+i)), URL: w.URL(), Model: model, Role: "prefill",
			MaxNumSeqs: 1, KVBytesPerToken: 73728, PeerBandwidth: 50e9}
		fmt.Sscan(port, &u.P2PPort)
		ups = append(ups, u)
	}
	d := startWorker(t, func(w *sim.WorkerConfig) { w.Engine.Role = sim.RoleDecode })
	c.decode = append(c.decode, d)
	ups = append(ups, proxy.Upstream{ID: "d0", URL: d.URL(), Model: model, Role: "decode"})
	c.proxy = startProxy(t, nil, func(pc *proxy.Config) {
		pc.Upstreams = ups
		pc.Policy = "latency"
		// Every request prefills remotely: the decode worker holds the prompt once it has
		// pulled the first request's, and would prefill the rest itself.
		pc.DisaggThreshold = -1
	})
	c.base = "http://" + c.proxy.Addr()

	system := family(11) + strings.Repeat(" the shared context of an agent", 300)
	if resp, body := post(t, c.base+"/v1/chat/completions", chatBody(system, "first", 2, false)); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	holder := -1
	for i, w := range c.prefill {
		if metricSum(t, workerMetrics(t, w), "kvrelay_sim_kv_held_requests_total") > 0 {
			holder = i
		}
	}
	if holder < 0 {
		t.Fatal("no prefill worker served the first request")
	}
	// A longer request sharing the prompt keeps the holder's slot busy prefilling.
	long := make(chan error, 1)
	go func() {
		resp, body := post(t, c.base+"/v1/chat/completions", chatBody(system, strings.Repeat("a long task description ", 6000), 2, false))
		if resp.StatusCode != 200 {
			long <- fmt.Errorf("%d %s", resp.StatusCode, body)
			return
		}
		long <- nil
	}()
	deadline := time.Now().Add(5 * time.Second)
	for c.prefill[holder].Engine().Load().Running == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the long request never ran on the holder")
		}
		time.Sleep(time.Millisecond)
	}
	resp, body := post(t, c.base+"/v1/chat/completions", chatBody(system, "a subagent's task", 2, false))
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if err := <-long; err != nil {
		t.Fatal(err)
	}
	other := c.prefill[1-holder]
	if pulls(t, other) == 0 {
		t.Fatalf("the other prefill worker did not pull the prompt from the busy holder:\n%s", workerMetrics(t, other))
	}
	if v := metricValue(t, c.metrics(t), "kvrelay_proxy_peer_fetches_total"); v != 1 {
		t.Fatalf("peer fetches %v, want 1", v)
	}
}

// pulls is how many of a simulated worker's pulls from a peer got the blocks they asked for.
func pulls(t *testing.T, w *sim.Worker) float64 {
	t.Helper()
	for _, l := range strings.Split(workerMetrics(t, w), "\n") {
		if strings.HasPrefix(l, "kvrelay_sim_kv_peer_fetches_total{") && strings.Contains(l, `result="pulled"`) {
			v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
	}
	return 0
}
