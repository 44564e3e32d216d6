package proxy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestAPIKeys: with --api-keys-file, the OpenAI SDK gets 401 invalid_api_key without a
// listed key, its answers with one (and the tenant's budgets in OpenAI's x-ratelimit-*
// headers), and 429 rate_limit_exceeded with Retry-After once its tenant is past a budget;
// the engines never see the client's key; a key added to the file works without a restart.
func TestAPIKeys(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	if err := os.WriteFile(keys, []byte("sk-free tenant=free\nsk-slow tenant=slow,rps=1,prompt_tps=100000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// One engine behind a relay that records whether a request carried an Authorization.
	w := startWorker(t, nil)
	var sawKey atomic.Int32
	target, _ := http.NewRequest("GET", w.URL(), nil)
	relay := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "" {
			sawKey.Add(1)
		}
		r.URL.Scheme, r.URL.Host, r.RequestURI = "http", target.URL.Host, ""
		resp, err := http.DefaultTransport.RoundTrip(r)
		if err != nil {
			rw.WriteHeader(502)
			return
		}
		defer resp.Body.Close()
		for k, v := range resp.Header {
			rw.Header()[k] = v
		}
		rw.WriteHeader(resp.StatusCode)
		buf := make([]byte, 32<<10)
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				_, _ = rw.Write(buf[:n])
				if f, ok := rw.(http.Flusher); ok {
					f.Flush()
				}
			}
			if err != nil {
				return
			}
		}
	}))
	t.Cleanup(relay.Close)
	p := startProxy(t, []string{relay.URL}, func(c *proxy.Config) { c.APIKeysFile = keys })
	base := "http://" + p.Addr() + "/v1"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	params := openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello")},
		MaxTokens: openai.Int(4),
	}
	client := func(key string) *openai.Client {
		c := openai.NewClient(option.WithBaseURL(base), option.WithAPIKey(key), option.WithMaxRetries(0))
		return &c
	}

	var apiErr *openai.Error
	for _, key := range []string{"sk-nope", ""} {
		_, err := client(key).Chat.Completions.New(ctx, params)
		if !errors.As(err, &apiErr) || apiErr.StatusCode != 401 || apiErr.Code != "invalid_api_key" {
			t.Fatalf("key %q: %v, want 401 invalid_api_key", key, err)
		}
	}

	var resp *http.Response
	if _, err := client("sk-free").Chat.Completions.New(ctx, params, option.WithResponseInto(&resp)); err != nil {
		t.Fatalf("a listed key: %v", err)
	}
	if resp.Header.Get("x-ratelimit-limit-requests") != "" {
		t.Errorf("a tenant without limits gets rate limit headers: %v", resp.Header)
	}
	if _, err := client("sk-slow").Chat.Completions.New(ctx, params, option.WithResponseInto(&resp)); err != nil {
		t.Fatalf("the slow tenant's first request: %v", err)
	}
	if resp.Header.Get("x-ratelimit-limit-requests") != "1" || resp.Header.Get("x-ratelimit-remaining-requests") != "0" || resp.Header.Get("x-ratelimit-limit-tokens") != "100000" {
		t.Errorf("rate limit headers %v", resp.Header)
	}
	_, err := client("sk-slow").Chat.Completions.New(ctx, params, option.WithResponseInto(&resp))
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 429 || apiErr.Code != "rate_limit_exceeded" {
		t.Fatalf("past 1 request a second: %v, want 429 rate_limit_exceeded", err)
	}
	if ra, _ := strconv.Atoi(apiErr.Response.Header.Get("Retry-After")); ra < 1 {
		t.Errorf("429 without a Retry-After: %v", apiErr.Response.Header)
	}
	if sawKey.Load() != 0 {
		t.Errorf("the engine saw the client's key on %d requests", sawKey.Load())
	}

	// A key added to the file works within a few seconds, without a restart.
	if err := os.WriteFile(keys, []byte("sk-free tenant=free\nsk-slow tenant=slow,rps=1,prompt_tps=100000\nsk-new tenant=new\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(keys)
	_ = os.Chtimes(keys, fi.ModTime().Add(2*time.Second), fi.ModTime().Add(2*time.Second))
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := client("sk-new").Chat.Completions.New(ctx, params)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a key added to the file: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// The refusals and admissions are counted by tenant.
	mresp, err := http.Get("http://" + p.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer mresp.Body.Close()
	var b strings.Builder
	buf := make([]byte, 64<<10)
	for {
		n, err := mresp.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			break
		}
	}
	// (sk-new was refused until the file was read again: two refusals or more.)
	for _, want := range []string{
		`kvrelay_proxy_tenant_refused_total{reason="invalid_api_key",tenant=""} `,
		`kvrelay_proxy_tenant_refused_total{reason="requests",tenant="slow"} 1`,
		`kvrelay_proxy_tenant_requests_total{tenant="slow"} 1`,
	} {
		if !strings.Contains(b.String(), want) {
			var have []string
			for _, l := range strings.Split(b.String(), "\n") {
				if strings.HasPrefix(l, "kvrelay_proxy_tenant_") {
					have = append(have, l)
				}
			}
			t.Errorf("metrics lack %s; have %q", want, have)
		}
	}
}

// cachedTokens sends a chat completion of system and user as the tenant of key, with the
// client's cache salt (none: ""), through the proxy at base, and returns the prompt tokens
// the engine reports cached.
func cachedTokens(t *testing.T, ctx context.Context, base, key, salt, system, user string) int64 {
	t.Helper()
	cl := openai.NewClient(option.WithBaseURL(base+"/v1"), option.WithAPIKey(key), option.WithMaxRetries(0))
	opts := []option.RequestOption{}
	if salt != "" {
		opts = append(opts, option.WithJSONSet("cache_salt", salt))
	}
	comp, err := cl.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(system), openai.UserMessage(user)},
		MaxTokens: openai.Int(2),
	}, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return comp.Usage.PromptTokensDetails.CachedTokens
}

// TestTenantCacheSalt: the proxy gives each tenant's requests a cache_salt of its own, so a
// prompt one tenant sent is a cache hit for that tenant again and for no other; a client's
// own salt cannot reach another tenant's.
func TestTenantCacheSalt(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-a tenant=a\nsk-b tenant=b\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 1, func(c *proxy.Config) { c.APIKeysFile = keys }, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cached := func(key, salt string) int64 {
		t.Helper()
		return cachedTokens(t, ctx, c.base, key, salt, family(7), "the same question")
	}
	if n := cached("sk-a", ""); n != 0 {
		t.Fatalf("tenant a's first request: %d cached tokens", n)
	}
	if n := cached("sk-a", ""); n == 0 {
		t.Fatal("tenant a's repeat: no cached tokens")
	}
	if n := cached("sk-b", ""); n != 0 {
		t.Fatalf("tenant b hit tenant a's cache: %d cached tokens", n)
	}
	// A client that sends the salt the engine saw for tenant a gets its own tenant's salt
	// around it, not a's cache.
	if n := cached("sk-b", "kvrelay-"+strings.Repeat("0", 32)); n != 0 {
		t.Fatalf("a client's salt reached another tenant's cache: %d cached tokens", n)
	}
}

// TestTenantCacheRegion: tenants a and c name cache region public, b none: a prompt a sent is
// a cache hit for c (their requests carry the region's salt) and not for b (its own), nor for
// a client of c that sends its own salt (kept apart within the region).
func TestTenantCacheRegion(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-a tenant=a,cache=public\nsk-b tenant=b\nsk-c tenant=c,cache=public\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 1, func(c *proxy.Config) { c.APIKeysFile = keys }, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cached := func(key, salt string) int64 {
		t.Helper()
		return cachedTokens(t, ctx, c.base, key, salt, family(8), "a question of the region")
	}
	if n := cached("sk-a", ""); n != 0 {
		t.Fatalf("tenant a's first request: %d cached tokens", n)
	}
	if n := cached("sk-b", ""); n != 0 {
		t.Fatalf("tenant b, in no region, hit region public's cache: %d cached tokens", n)
	}
	if n := cached("sk-c", "own"); n != 0 {
		t.Fatalf("a client of tenant c with its own salt hit the region's cache: %d cached tokens", n)
	}
	if n := cached("sk-c", ""); n == 0 {
		t.Fatal("tenant c's repeat of tenant a's prompt, in one region: no cached tokens")
	}
}

// TestTenantsQueueFairly: one worker that takes one request at a time (busy thresholds), a
// tenant that queued a burst of twelve, then another tenant's one request: the admission
// queue lets the second tenant's request go next, not after the whole burst.
func TestTenantsQueueFairly(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-batch tenant=batch\nsk-chat tenant=chat\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 1, func(cfg *proxy.Config) {
		cfg.APIKeysFile = keys
		cfg.BusyDecodeBlocks = 1 // any request running makes the worker busy
		cfg.QueueTimeout = time.Minute
	}, func(w *sim.WorkerConfig) { w.Engine.Timing.Speedup = 0.2 })
	type done struct {
		who string
		at  time.Time
	}
	finished := make(chan done, 16)
	send := func(key, who string) {
		body := strings.Replace(chatBody("fair "+who, "queue", 3, false), `{`, `{"ignore_eos":true,`, 1)
		req, _ := http.NewRequest("POST", c.base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			finished <- done{who, time.Now()}
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%s: %d", who, resp.StatusCode)
		}
		finished <- done{who, time.Now()}
	}
	for i := range 12 {
		go send("sk-batch", "batch"+strconv.Itoa(i))
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // the burst is queued behind the first
	var order []string
	for len(finished) > 0 {
		order = append(order, (<-finished).who)
	}
	before := len(order) // finished before the other tenant sent its request
	go send("sk-chat", "chat")
	for len(order) < 13 {
		order = append(order, (<-finished).who)
	}
	// The batch requests running or let go when it came finish first (a worker busy by its
	// thresholds still takes what was dispatched to it a moment before); then it goes, far
	// ahead of the burst's end, where first come, first served would put it.
	pos := slices.Index(order, "chat")
	if pos < 0 || pos-before > 4 || before > 6 {
		t.Fatalf("the other tenant's request came after %d had finished and finished %d-th of 13 (%v), want within the next five", before, pos+1, order)
	}
	t.Logf("%d of the burst finished before the other tenant's request came; finish order %v", before, order)
}

// TestTenantBudgetRefundedWhenClientLeaves: a streamed request reserves its max_tokens of
// the tenant's output budget; a client that leaves after its first tokens gets back what it
// did not receive, so the tenant's next request of that size is admitted.
func TestTenantBudgetRefundedWhenClientLeaves(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-a tenant=a,output_tpm=600\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 1, func(cfg *proxy.Config) { cfg.APIKeysFile = keys },
		func(w *sim.WorkerConfig) { w.Engine.Timing.Speedup = 0.2 })
	send := func(ctx context.Context) (*http.Response, error) {
		body := strings.Replace(chatBody("refund", "me", 500, true), `{`, `{"ignore_eos":true,`, 1)
		req, _ := http.NewRequestWithContext(ctx, "POST", c.base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk-a")
		return http.DefaultClient.Do(req)
	}
	ctx, cancel := context.WithCancel(context.Background())
	resp, err := send(ctx)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("the first request: %v %v", resp, err)
	}
	buf := make([]byte, 256)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	cancel() // the client leaves after its first bytes
	resp.Body.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := send(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		code := resp.StatusCode
		resp.Body.Close()
		if code == 200 {
			return
		}
		if code != 429 || time.Now().After(deadline) {
			t.Fatalf("after the first client left: %d, want the second request admitted (its output refunded)", code)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestTenantHeadroom: a worker of two slots (busy_requests 2), two tenants of equal weight,
// a slot of headroom: the tenant that floods runs its share (one request) and queues the
// rest; the other tenant's request takes the free slot at once instead of waiting for the
// flood's to end. Without headroom the flood takes both slots and it waits, which the
// x-kvrelay-route header tells (waited_ms).
func TestTenantHeadroom(t *testing.T) {
	for _, headroom := range []int64{1, 0} {
		t.Run(fmt.Sprintf("headroom %d", headroom), func(t *testing.T) {
			keys := filepath.Join(t.TempDir(), "keys")
			if err := os.WriteFile(keys, []byte("sk-flood tenant=flood\nsk-chat tenant=chat\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			c := startCluster(t, 1, func(cfg *proxy.Config) {
				cfg.APIKeysFile = keys
				cfg.BusyRequests, cfg.TenantHeadroom = 2, headroom
				cfg.QueueTimeout = time.Minute
				cfg.ExposeWorkerHeader = true
			}, func(w *sim.WorkerConfig) { w.Engine.Timing.Speedup = 0.2 })
			// send returns the request's time and its x-kvrelay-route.
			send := func(ctx context.Context, key string, tokens int) (time.Duration, string, error) {
				body := strings.Replace(chatBody("headroom "+key, "q", tokens, false), `{`, `{"ignore_eos":true,`, 1)
				req, _ := http.NewRequestWithContext(ctx, "POST", c.base+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+key)
				t0 := time.Now()
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return 0, "", err
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					return 0, "", fmt.Errorf("status %d", resp.StatusCode)
				}
				return time.Since(t0), resp.Header.Get("x-kvrelay-route"), nil
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			// One after another: two decided at the same moment on two event loops may both
			// find the worker's last slot free (busy thresholds are read, not reserved).
			for range 4 {
				go func() { _, _, _ = send(ctx, "sk-flood", 120) }() // seconds each
				time.Sleep(100 * time.Millisecond)
			}
			time.Sleep(200 * time.Millisecond)
			took, lastRoute, err := send(context.Background(), "sk-chat", 2)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("the other tenant's request took %v (x-kvrelay-route: %s)", took.Round(time.Millisecond), lastRoute)
			var waited int
			if _, after, ok := strings.Cut(lastRoute, "; waited_ms="); ok {
				waited, _ = strconv.Atoi(after)
			}
			if headroom == 0 && waited < 1000 {
				t.Fatalf("it waited %v for the flood's slot, and x-kvrelay-route %q says waited_ms %d", took, lastRoute, waited)
			}
			switch fast := took < 1500*time.Millisecond; {
			case headroom > 0 && !fast:
				t.Fatalf("with headroom the other tenant's request took %v, want a free slot at once", took)
			case headroom == 0 && fast:
				t.Fatalf("without headroom the other tenant's request took only %v: the flood left a slot free", took)
			}
		})
	}
}

// TestTenantMetrics: each tenant's prompt, generated and cached tokens are counted as its
// answers' usage reports them, its requests' wait in the admission queue and its streamed
// answers' time to first token are observed, each under its own tenant label.
func TestTenantMetrics(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-a tenant=a\nsk-b tenant=b\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 1, func(cfg *proxy.Config) {
		cfg.APIKeysFile = keys
		cfg.BusyRequests = 1 // a request running makes the worker busy: the next one waits
		cfg.QueueTimeout = time.Minute
	}, func(w *sim.WorkerConfig) { w.Engine.Timing.Speedup = 0.2 })
	type usage struct{ prompt, output, cached int64 }
	// send sends a chat completion as key and returns its answer, whose usage read returns
	// (streamed: the usage chunk that include_usage asks for).
	send := func(key string, tokens int, stream bool) *http.Response {
		t.Helper()
		m := map[string]any{
			"model": model, "max_tokens": tokens, "stream": stream, "ignore_eos": true,
			"messages": []map[string]string{{"role": "system", "content": family(5)}, {"role": "user", "content": "count"}},
		}
		if stream {
			m["stream_options"] = map[string]any{"include_usage": true}
		}
		body, _ := json.Marshal(m)
		req, _ := http.NewRequest("POST", c.base+"/v1/chat/completions", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			t.Fatalf("%s: %d %s", key, resp.StatusCode, b)
		}
		return resp
	}
	read := func(resp *http.Response) (u usage, err error) {
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return u, err
		}
		var got struct {
			Usage *struct {
				PromptTokens     int64 `json:"prompt_tokens"`
				CompletionTokens int64 `json:"completion_tokens"`
				Details          *struct {
					CachedTokens int64 `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			}
		}
		docs := []string{string(b)}
		if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
			docs = nil
			for _, l := range strings.Split(string(b), "\n") {
				if d, ok := strings.CutPrefix(l, "data: "); ok && d != "[DONE]" {
					docs = append(docs, d)
				}
			}
		}
		for _, d := range docs {
			got.Usage = nil
			if err := json.Unmarshal([]byte(d), &got); err != nil {
				return u, err
			}
			if got.Usage != nil {
				u = usage{prompt: got.Usage.PromptTokens, output: got.Usage.CompletionTokens}
				if got.Usage.Details != nil {
					u.cached = got.Usage.Details.CachedTokens
				}
			}
		}
		if u.prompt == 0 || u.output == 0 {
			return u, fmt.Errorf("no usage in %s", b)
		}
		return u, nil
	}
	depth := func() float64 {
		_, m := get(t, c.base+"/metrics")
		return metricValue(t, m, "kvrelay_proxy_queue_depth")
	}

	// Tenant a: a long stream, and while it runs a second stream, which waits for it in the
	// admission queue.
	first := send("sk-a", 60, true)
	second := make(chan usage, 1)
	go func() {
		u, err := read(send("sk-a", 4, true))
		if err != nil {
			t.Error(err)
		}
		second <- u
	}()
	deadline := time.Now().Add(5 * time.Second)
	for depth() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the second request did not queue behind the first")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The second waits out the first (about 2 s at this speed). The queue's depth is not
	// looked at again: a queued request that the queue wakes to try again and that finds the
	// worker still busy leaves it for a moment.
	const held = 200 * time.Millisecond
	time.Sleep(held)
	var u2 usage
	select {
	case u2 = <-second:
		t.Fatal("the second request was answered within the hold: the first did not hold it in the queue")
	default:
	}
	u1, err := read(first)
	if err != nil {
		t.Fatal(err)
	}
	u2 = <-second
	// Tenant b: one answer not streamed, once the worker is free.
	u3, err := read(send("sk-b", 3, false))
	if err != nil {
		t.Fatal(err)
	}
	if u2.cached == 0 {
		t.Fatalf("tenant a's second request found nothing cached (%+v): the test wants cached tokens to count", u2)
	}

	_, m := get(t, c.base+"/metrics")
	problems, err := promlint.New(strings.NewReader(m)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "kvrelay_proxy_tenant_") {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		}
	}
	val := func(series string) float64 { return metricValue(t, m, series) }
	for tenant, want := range map[string]usage{
		"a": {u1.prompt + u2.prompt, u1.output + u2.output, u1.cached + u2.cached},
		"b": u3,
	} {
		got := usage{
			prompt: int64(val(`kvrelay_proxy_tenant_prompt_tokens_total{tenant="` + tenant + `"}`)),
			output: int64(val(`kvrelay_proxy_tenant_output_tokens_total{tenant="` + tenant + `"}`)),
			cached: int64(val(`kvrelay_proxy_tenant_cached_tokens_total{tenant="` + tenant + `"}`)),
		}
		if got != want {
			t.Errorf("tenant %s: tokens (prompt, output, cached) %+v, want the usage its answers reported, %+v", tenant, got, want)
		}
	}
	// Every request of each tenant was dispatched once; a's second waited at least as long
	// as the queue was seen holding it, b's not at all.
	if n := val(`kvrelay_proxy_tenant_queue_seconds_count{tenant="a"}`); n != 2 {
		t.Errorf("tenant a: %v queue times, want 2", n)
	}
	if s := val(`kvrelay_proxy_tenant_queue_seconds_sum{tenant="a"}`); s < held.Seconds() || s > 30 {
		t.Errorf("tenant a waited %v s in the queue, want at least %v", s, held.Seconds())
	}
	if n, s := val(`kvrelay_proxy_tenant_queue_seconds_count{tenant="b"}`), val(`kvrelay_proxy_tenant_queue_seconds_sum{tenant="b"}`); n != 1 || s != 0 {
		t.Errorf("tenant b: %v queue times summing to %v s, want one of 0", n, s)
	}
	// Time to first token of the streamed answers alone: a's two, none of b's.
	if n, s := val(`kvrelay_proxy_tenant_ttft_seconds_count{tenant="a"}`), val(`kvrelay_proxy_tenant_ttft_seconds_sum{tenant="a"}`); n != 2 || s <= 0 {
		t.Errorf("tenant a: %v times to first token summing to %v s, want two", n, s)
	}
	if n := val(`kvrelay_proxy_tenant_ttft_seconds_count{tenant="b"}`); n != 0 {
		t.Errorf("tenant b: %v times to first token of an answer not streamed", n)
	}
	if a, b := val(`kvrelay_proxy_tenant_requests_total{tenant="a"}`), val(`kvrelay_proxy_tenant_requests_total{tenant="b"}`); a != 2 || b != 1 {
		t.Errorf("requests admitted: a %v, b %v, want 2 and 1", a, b)
	}
}

// TestTenantBudgetRefundedWhenNeverDispatched: a request admitted and then refused before
// any worker had it (here its TTFT target cannot be met) gives back its whole reservation,
// whatever the connection's previous answer generated: the tenant's next request of the
// size of the budget's rest is admitted.
func TestTenantBudgetRefundedWhenNeverDispatched(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	// 60 tokens a minute: one a second refills, so a few seconds change little.
	if err := os.WriteFile(keys, []byte("sk-a tenant=a,output_tpm=60\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 1, func(cfg *proxy.Config) { cfg.APIKeysFile = keys }, nil)
	hc := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}} // one connection: one clientConn
	defer hc.CloseIdleConnections()
	send := func(maxTokens int, slo string) (int, string) {
		t.Helper()
		body := strings.Replace(chatBody("refund", "never sent", maxTokens, false), `{`, `{"ignore_eos":true,`, 1)
		req, _ := http.NewRequest("POST", c.base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk-a")
		req.Header.Set("Content-Type", "application/json")
		if slo != "" {
			req.Header.Set("x-slo-ttft-ms", slo)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b)
	}
	if code, _ := send(20, ""); code != 200 { // generates 20: the budget holds 40 after it
		t.Fatalf("the first request: %d", code)
	}
	// Refused by the routing core, not by the budget: admitted first.
	if code, body := send(40, "0.001"); code == 200 || strings.Contains(body, "rate_limit_exceeded") {
		t.Fatalf("a request with a TTFT target of 1 µs: %d %s, want it admitted and refused by the routing core", code, body)
	}
	// Refunded whole, the budget holds 40 again; refunded by the first answer's 20 tokens,
	// it would hold 20 and refuse 35.
	if code, _ := send(35, ""); code != 200 {
		t.Fatalf("after a request refused before dispatch: %d, want the next of 35 tokens admitted (its 40 refunded)", code)
	}
}
