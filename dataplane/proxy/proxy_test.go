package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/sim/simtest"
)

const model = "gpt-oss-120b"

type cluster struct {
	workers []*sim.Worker
	proxy   *proxy.Server
	base    string // http://addr
}

// startWorker runs one simulated engine for the test's lifetime.
func startWorker(t testing.TB, mut func(*sim.WorkerConfig)) *sim.Worker {
	t.Helper()
	return simtest.Worker(t, model, mut)
}

// startProxy runs a proxy in front of the given upstream URLs.
func startProxy(t testing.TB, urls []string, mut func(*proxy.Config)) *proxy.Server {
	t.Helper()
	cfg := proxy.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.ExposeWorkerHeader = true
	cfg.EventLoops = 2
	// No exploration: the tests assert where requests go, and one latency decision in 64
	// would try a worker never chosen instead (a test of exploration turns it back on).
	cfg.Explore = 0
	for i, u := range urls {
		cfg.Upstreams = append(cfg.Upstreams, proxy.Upstream{ID: "w" + strconv.Itoa(i), URL: u, Model: model})
	}
	if mut != nil {
		mut(&cfg)
	}
	p, err := proxy.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func startCluster(t *testing.T, n int, mut func(*proxy.Config), simMut func(*sim.WorkerConfig)) *cluster {
	t.Helper()
	c := &cluster{}
	var urls []string
	for range n {
		w := startWorker(t, simMut)
		c.workers = append(c.workers, w)
		urls = append(urls, w.URL())
	}
	c.proxy = startProxy(t, urls, mut)
	c.base = "http://" + c.proxy.Addr()
	return c
}

func post(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, b
}

func chatBody(system, user string, maxTokens int, stream bool) string {
	b, _ := json.Marshal(map[string]any{
		"model":      model,
		"max_tokens": maxTokens,
		"stream":     stream,
		"messages":   []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}},
	})
	return string(b)
}

func family(g int) string {
	var b strings.Builder
	for i := range 400 {
		fmt.Fprintf(&b, "family%d rule%d. ", g, i)
	}
	return b.String()
}

func TestOpenAISDKThroughProxy(t *testing.T) {
	c := startCluster(t, 2, nil, nil)
	client := openai.NewClient(option.WithBaseURL(c.base+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(0))
	ctx := context.Background()
	params := openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(family(1)), openai.UserMessage("hello")},
		MaxTokens: openai.Int(6),
	}
	var first, second *openai.ChatCompletion
	var err error
	var r1, r2 *http.Response
	if first, err = client.Chat.Completions.New(ctx, params, option.WithResponseInto(&r1)); err != nil {
		t.Fatal(err)
	}
	if second, err = client.Chat.Completions.New(ctx, params, option.WithResponseInto(&r2)); err != nil {
		t.Fatal(err)
	}
	hdr1, hdr2 := r1.Header, r2.Header
	if first.Usage.CompletionTokens != 6 || first.Choices[0].Message.Content == "" {
		t.Fatalf("first: %+v", first)
	}
	if hdr1.Get("x-kvrelay-worker") == "" || hdr1.Get("x-kvrelay-worker") != hdr2.Get("x-kvrelay-worker") {
		t.Fatalf("same prompt went to %q then %q", hdr1.Get("x-kvrelay-worker"), hdr2.Get("x-kvrelay-worker"))
	}
	// The second request's route header says the cost decided, how much it matched, and what
	// the latency policy (the default) predicted.
	if pt, rt := second.Usage.PromptTokens, hdr2.Get("x-kvrelay-route"); !strings.HasPrefix(rt, fmt.Sprintf("cost; overlap=%d; best=%d; ttft_ms=", pt/16, pt/16)) {
		t.Fatalf("x-kvrelay-route of the repeat = %q (prompt %d tokens)", rt, pt)
	}
	if pt := second.Usage.PromptTokens; second.Usage.PromptTokensDetails.CachedTokens != pt/16*16 {
		t.Fatalf("second identical prompt: cached %d of %d", second.Usage.PromptTokensDetails.CachedTokens, pt)
	}

	p := params
	p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := client.Chat.Completions.NewStreaming(ctx, p)
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if acc.Usage.CompletionTokens != 6 || len(strings.Fields(acc.Choices[0].Message.Content)) != 6 {
		t.Fatalf("stream: usage %+v content %q", acc.Usage, acc.Choices[0].Message.Content)
	}

	comp, err := client.Completions.New(ctx, openai.CompletionNewParams{
		Model: model, Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")}, MaxTokens: openai.Int(3),
	})
	if err != nil || comp.Usage.CompletionTokens != 3 {
		t.Fatalf("completion: %v %+v", err, comp)
	}

	_, err = client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "nope", Messages: params.Messages})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 {
		t.Fatalf("unknown model: %v", err)
	}

	models, err := client.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != model {
		t.Fatalf("models: %v %+v", err, models)
	}
	if m, err := client.Models.Get(ctx, model); err != nil || m.ID != model || m.Object != "model" {
		t.Fatalf("models.get: %v %+v", err, m)
	}
	_, err = client.Models.Get(ctx, "no-such-model")
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Fatalf("models.get of an unknown model: %v", err)
	}
}

func TestSamePrefixSameWorkerSpreadAcrossPrefixes(t *testing.T) {
	c := startCluster(t, 4, nil, nil)
	placement := map[int]map[string]int{}
	for round := range 4 {
		for g := range 6 {
			resp, body := post(t, c.base+"/v1/chat/completions", chatBody(family(g), fmt.Sprintf("question %d", round), 2, false))
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			w := resp.Header.Get("x-kvrelay-worker")
			if placement[g] == nil {
				placement[g] = map[string]int{}
			}
			placement[g][w]++
		}
	}
	homes := map[string]bool{}
	for g, ws := range placement {
		if len(ws) != 1 {
			t.Fatalf("family %d was split across %v", g, ws)
		}
		for w := range ws {
			homes[w] = true
		}
	}
	if len(homes) < 4 {
		t.Fatalf("6 families landed on only %d of 4 workers: %v", len(homes), placement)
	}
}

func TestBadRequests(t *testing.T) {
	c := startCluster(t, 1, func(cfg *proxy.Config) { cfg.MaxBodyBytes = 1 << 20 }, nil)
	cases := []struct {
		name, method, path, body string
		status                   int
	}{
		{"malformed json", "POST", "/v1/chat/completions", `{broken`, 400},
		{"no messages", "POST", "/v1/chat/completions", `{"model":"` + model + `"}`, 400},
		{"no model", "POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, 400},
		{"unknown model", "POST", "/v1/chat/completions", `{"model":"other","messages":[{"role":"user","content":"x"}]}`, 404},
		{"wrong type", "POST", "/v1/chat/completions", `{"model":"` + model + `","messages":"hi"}`, 400},
		{"body over the limit", "POST", "/v1/completions", `{"model":"` + model + `","prompt":"` + strings.Repeat("x", 2<<20) + `"}`, 413},
		{"unknown route", "POST", "/v1/nothing", `{}`, 404},
		{"wrong method", "GET", "/v1/chat/completions", ``, 405},
		{"engine rejects", "POST", "/v1/chat/completions", `{"model":"` + model + `","messages":[{"role":"user","content":"x"}],"n":3}`, 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(tc.method, c.base+tc.path, strings.NewReader(tc.body))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, b)
			}
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
				} `json:"error"`
			}
			if json.Unmarshal(b, &e) != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("not an OpenAI error: %s", b)
			}
		})
	}
}

// rawExchange writes raw bytes on one connection and reads n responses.
func rawExchange(t *testing.T, addr, raw string, n int) []*http.Response {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(conn)
	var out []*http.Response
	for range n {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("response %d: %v", len(out), err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body = io.NopCloser(bytes.NewReader(body))
		out = append(out, resp)
	}
	return out
}

func TestFraming(t *testing.T) {
	c := startCluster(t, 1, nil, nil)
	addr := c.proxy.Addr()
	small := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	t.Run("pipelined requests answer in order", func(t *testing.T) {
		raw := "GET /health HTTP/1.1\r\nHost: x\r\n\r\n" +
			"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(small)) + "\r\n\r\n" + small +
			"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
		rs := rawExchange(t, addr, raw, 3)
		b1, _ := io.ReadAll(rs[1].Body)
		b2, _ := io.ReadAll(rs[2].Body)
		if rs[0].StatusCode != 200 || rs[1].StatusCode != 200 || !bytes.Contains(b1, []byte("chat.completion")) || !bytes.Contains(b2, []byte(`"object":"list"`)) {
			t.Fatalf("pipelined: %d %d %s %s", rs[0].StatusCode, rs[1].StatusCode, b1, b2)
		}
	})
	t.Run("chunked request body", func(t *testing.T) {
		half := len(small) / 2
		raw := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
			strconv.FormatInt(int64(half), 16) + "\r\n" + small[:half] + "\r\n" +
			strconv.FormatInt(int64(len(small)-half), 16) + "\r\n" + small[half:] + "\r\n0\r\n\r\n"
		rs := rawExchange(t, addr, raw, 1)
		if rs[0].StatusCode != 200 {
			b, _ := io.ReadAll(rs[0].Body)
			t.Fatalf("chunked body: %d %s", rs[0].StatusCode, b)
		}
	})
	t.Run("expect 100-continue", func(t *testing.T) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		io.WriteString(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: "+strconv.Itoa(len(small))+"\r\n\r\n")
		br := bufio.NewReader(conn)
		line, err := br.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "HTTP/1.1 100") {
			t.Fatalf("want 100 Continue, got %q %v", line, err)
		}
		br.ReadString('\n')
		io.WriteString(conn, small)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("after 100-continue: %v %v", resp, err)
		}
	})
	t.Run("header too large", func(t *testing.T) {
		raw := "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("a", 70<<10) + "\r\n\r\n"
		rs := rawExchange(t, addr, raw, 1)
		if rs[0].StatusCode != 431 {
			t.Fatalf("status %d", rs[0].StatusCode)
		}
	})
	t.Run("smuggling attempt", func(t *testing.T) {
		raw := "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
		rs := rawExchange(t, addr, raw, 1)
		if rs[0].StatusCode != 400 {
			t.Fatalf("status %d", rs[0].StatusCode)
		}
	})
}

// fakeEngine serves raw TCP connections with handle, answering /v1/models itself.
func fakeEngine(t *testing.T, handle func(conn net.Conn, br *bufio.Reader, req *http.Request)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				br := bufio.NewReader(conn)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					body, _ := io.ReadAll(req.Body)
					req.Body = io.NopCloser(bytes.NewReader(body))
					handle(conn, br, req)
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

func TestEngineDiesMidStream(t *testing.T) {
	url := fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		ev := `data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}` + "\n\n"
		for range 3 {
			fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev), ev)
			time.Sleep(5 * time.Millisecond)
		}
		conn.Close() // the engine dies
	})
	p := startProxy(t, []string{url}, nil)
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Post("http://"+p.Addr()+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s", "u", 10, true)))
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("the stream must end cleanly, got %v after %q", err, body)
	}
	if bytes.Count(body, []byte(`"content":"hi"`)) != 3 || !bytes.Contains(body, []byte(`"error"`)) || !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
		t.Fatalf("stream: %s", body)
	}
	// Answered 200, but broken: the routing's failure in its policy's figures, not a success.
	waitMetric(t, "http://"+p.Addr()+"/metrics", `kvrelay_proxy_policy_requests_total{outcome="router_error",policy_version="local"}`, 1)
	_, m := get(t, "http://"+p.Addr()+"/metrics")
	if v := metricValue(t, m, `kvrelay_proxy_policy_requests_total{outcome="ok",policy_version="local"}`); v != 0 {
		t.Fatalf("a broken stream counted %v ok", v)
	}
}

// waitMetric waits until series reads want at url.
func waitMetric(t *testing.T, url, series string, want float64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, m := get(t, url)
		if strings.Contains(m, series+" ") && metricValue(t, m, series) == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is not %v:\n%s", series, want, m)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestRetryOnRefusedAndFailingEngines(t *testing.T) {
	// One address refuses connections, one engine answers 500, one is healthy.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	refused := "http://" + ln.Addr().String()
	ln.Close()
	var failing int
	var mu sync.Mutex
	failURL := fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
		mu.Lock()
		failing++
		mu.Unlock()
		io.WriteString(conn, "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
	})
	good := startWorker(t, nil)
	p := startProxy(t, []string{refused, failURL, good.URL()}, func(cfg *proxy.Config) {
		cfg.Policy = "round-robin"
		cfg.EjectAfter = 2
		cfg.EjectFor = time.Minute
	})
	for i := range 6 {
		resp, body := post(t, "http://"+p.Addr()+"/v1/chat/completions", chatBody("s", "u", 2, false))
		if resp.StatusCode != 200 || resp.Header.Get("x-kvrelay-worker") != "w2" {
			t.Fatalf("request %d: %d from %q: %s", i, resp.StatusCode, resp.Header.Get("x-kvrelay-worker"), body)
		}
	}
	// With the healthy one gone too, a request no worker can take is told to come back when
	// the first ejected one may be probed again (a minute here).
	good.Close()
	for range 3 {
		post(t, "http://"+p.Addr()+"/v1/chat/completions", chatBody("s", "u", 2, false))
	}
	resp, body := post(t, "http://"+p.Addr()+"/v1/chat/completions", chatBody("s", "u", 2, false))
	if n, _ := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode != 503 || n < 50 || n > 60 {
		t.Fatalf("with every worker ejected: %d, Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	ws := p.Workers()
	if ws[0].EjectedUntil().IsZero() || ws[1].EjectedUntil().IsZero() {
		t.Fatal("workers failing twice in a row must be ejected")
	}
	mu.Lock()
	n := failing
	mu.Unlock()
	if n > 2 {
		t.Fatalf("an ejected engine still got requests: %d", n)
	}
	_, m := get(t, "http://"+p.Addr()+"/metrics")
	for _, want := range []string{`kvrelay_proxy_worker_ejections_total{worker="w0"} 1`, `kvrelay_proxy_upstream_errors_total{kind="connect",worker="w0"}`, `kvrelay_proxy_upstream_errors_total{kind="status_5xx",worker="w1"}`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode, string(b)
}

func TestAllEnginesDown(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	refused := "http://" + ln.Addr().String()
	ln.Close()
	p := startProxy(t, []string{refused}, nil)
	resp, body := post(t, "http://"+p.Addr()+"/v1/chat/completions", chatBody("s", "u", 2, false))
	if resp.StatusCode != 502 && resp.StatusCode != 503 || !bytes.Contains(body, []byte(`"error"`)) {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

func TestClientDisconnectFreesEngineBlocks(t *testing.T) {
	c := startCluster(t, 1, nil, func(cfg *sim.WorkerConfig) { cfg.Engine.Timing.Speedup = 1 })
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", c.base+"/v1/chat/completions",
		strings.NewReader(`{"model":"`+model+`","messages":[{"role":"user","content":"go on"}],"max_tokens":5000,"ignore_eos":true,"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if l := c.workers[0].Engine().Load(); l.Running != 1 {
		t.Fatalf("engine load while streaming: %+v", l)
	}
	cancel()
	resp.Body.Close()
	deadline := time.Now().Add(5 * time.Second)
	for c.workers[0].Engine().Load() != (sim.Load{}) {
		if time.Now().After(deadline) {
			t.Fatalf("the engine still holds the request after the client left: %+v", c.workers[0].Engine().Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The client's doing, not the routing's: counted apart in its policy's figures.
	waitMetric(t, c.base+"/metrics", `kvrelay_proxy_policy_requests_total{outcome="client_gone",policy_version="local"}`, 1)
	_, m := get(t, c.base+"/metrics")
	for _, o := range []string{"ok", "router_error"} {
		if series := `kvrelay_proxy_policy_requests_total{outcome="` + o + `",policy_version="local"}`; strings.Contains(m, series+" ") && metricValue(t, m, series) != 0 {
			t.Fatalf("a client that left counted as %s", o)
		}
	}
}

func TestQueueOverflowAndTimeout(t *testing.T) {
	c := startCluster(t, 1, func(cfg *proxy.Config) {
		cfg.BusyPrefillTokens = 1 // one request in prefill makes the worker busy
		cfg.QueueSize = 1
		cfg.QueueTimeout = 300 * time.Millisecond
	}, func(cfg *sim.WorkerConfig) { cfg.Engine.Timing.Speedup = 0.05 }) // a 1 s+ prefill
	statuses := make(chan int, 4)
	retryAfter := make(chan string, 4)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * 30 * time.Millisecond)
			resp, err := http.Post(c.base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(family(i), "x", 1, false)))
			if err != nil {
				statuses <- 0
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses <- resp.StatusCode
			if resp.StatusCode != 200 {
				retryAfter <- resp.Header.Get("Retry-After")
			}
		}()
	}
	wg.Wait()
	close(statuses)
	got := map[int]int{}
	for s := range statuses {
		got[s]++
	}
	// One runs, one waits and times out (503), two find the queue full (429).
	if got[200] != 1 || got[503] != 1 || got[429] != 2 {
		t.Fatalf("statuses %v", got)
	}
	close(retryAfter)
	for ra := range retryAfter {
		if n, err := strconv.Atoi(ra); err != nil || n < 1 || n > 60 {
			t.Fatalf("a refusal with Retry-After %q, want 1-60 seconds", ra)
		}
	}
}

func TestDrainFinishesStreamsAndRefusesNew(t *testing.T) {
	c := startCluster(t, 1, nil, func(cfg *sim.WorkerConfig) { cfg.Engine.Timing.Speedup = 5 })
	resp, err := http.Post(c.base+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"`+model+`","messages":[{"role":"user","content":"x"}],"max_tokens":40,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	drained := make(chan struct{})
	go func() { c.proxy.Drain(10 * time.Second); close(drained) }()
	time.Sleep(50 * time.Millisecond)
	r2, b2 := post(t, c.base+"/v1/chat/completions", chatBody("s", "u", 2, false))
	if r2.StatusCode != 503 || r2.Header.Get("Retry-After") != "1" {
		t.Fatalf("a request during drain: %d (Retry-After %q) %s", r2.StatusCode, r2.Header.Get("Retry-After"), b2)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) || bytes.Count(body, []byte(`"content":" `)) != 40 {
		t.Fatalf("the stream in flight must finish: %v %d bytes", err, len(body))
	}
	select {
	case <-drained:
	case <-time.After(10 * time.Second):
		t.Fatal("drain did not return once the stream finished")
	}
}

func TestMetricsArePromlintClean(t *testing.T) {
	c := startCluster(t, 1, nil, nil)
	post(t, c.base+"/v1/chat/completions", chatBody("s", "u", 2, false))
	post(t, c.base+"/v1/chat/completions", `{bad`)
	_, m := get(t, c.base+"/metrics")
	problems, err := promlint.New(strings.NewReader(m)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, "kvrelay_") {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		}
	}
	for _, want := range []string{
		`kvrelay_proxy_requests_total{code="200",model="gpt-oss-120b",route="/v1/chat/completions"} 1`,
		`kvrelay_proxy_requests_total{code="400",model="unknown",route="/v1/chat/completions"} 1`,
		`kvrelay_proxy_decision_seconds_count{stage="tokenize"}`,
		`kvrelay_proxy_time_to_first_token_seconds_count{model="gpt-oss-120b"} 1`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

func TestModelDiscovery(t *testing.T) {
	w := startWorker(t, nil)
	cfg := proxy.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.Upstreams = []proxy.Upstream{{URL: w.URL()}}
	p, err := proxy.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.Workers()[0].Model != model {
		t.Fatalf("discovered model %q", p.Workers()[0].Model)
	}
}

// TestTokenizerModesAgree routes the same conversation with the in-process tokenizer and
// with the engine's /tokenize: both must produce the very same block chain, so a prompt
// routed by one finds the blocks the other recorded.
func TestTokenizerModesAgree(t *testing.T) {
	// One engine each, so that each proxy's first request finds an empty cache.
	local := startProxy(t, []string{startWorker(t, nil).URL()}, nil)
	remote := startProxy(t, []string{startWorker(t, nil).URL()}, func(cfg *proxy.Config) { cfg.Tokenizer = proxy.TokenizerRemote })
	estimate := startProxy(t, []string{startWorker(t, nil).URL()}, func(cfg *proxy.Config) { cfg.Tokenizer = proxy.TokenizerEstimate })
	body := chatBody(family(3), "which family?", 2, false)
	for _, p := range []*proxy.Server{local, remote, estimate} {
		for range 2 { // the second time the remote answer comes from the cache
			if resp, b := post(t, "http://"+p.Addr()+"/v1/chat/completions", body); resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, b)
			}
		}
	}
	// The second request found what the first recorded: the blocks the proxy predicted are
	// the blocks the engine reported cached, which holds only if both counted the same tokens.
	for name, p := range map[string]*proxy.Server{"local": local, "remote": remote} {
		_, m := get(t, "http://"+p.Addr()+"/metrics")
		predicted := metricValue(t, m, `kvrelay_proxy_prefix_predicted_blocks_total{worker="w0"}`)
		reported := metricValue(t, m, `kvrelay_proxy_prefix_reported_blocks_total{worker="w0"}`)
		if predicted < 50 || predicted != reported {
			t.Fatalf("%s: predicted %v cached blocks, engine reported %v", name, predicted, reported)
		}
	}
}

func metricValue(t *testing.T, exposition, series string) float64 {
	t.Helper()
	for _, line := range strings.Split(exposition, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no series %s", series)
	return 0
}

func TestPassThroughRoutesAndPriority(t *testing.T) {
	var mu sync.Mutex
	var bodies []string
	url := fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, req *http.Request) {
		// fakeEngine drained the body; echo what the proxy sent in the path + a header check.
		mu.Lock()
		bodies = append(bodies, req.URL.Path+" "+req.Header.Get("X-Test-Body"))
		mu.Unlock()
		resp := `{"object":"list","data":[{"embedding":[0.1],"index":0}],"usage":{"prompt_tokens":2,"total_tokens":2}}`
		fmt.Fprintf(conn, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(resp), resp)
	})
	p := startProxy(t, []string{url}, func(cfg *proxy.Config) { cfg.ForwardPriority = true })
	for _, path := range []string{"/v1/embeddings", "/v1/responses"} {
		resp, b := post(t, "http://"+p.Addr()+path, `{"model":"`+model+`","input":"hello"}`)
		if resp.StatusCode != 200 || !bytes.Contains(b, []byte("embedding")) {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
		}
	}
	mu.Lock()
	if len(bodies) != 2 || !strings.HasPrefix(bodies[0], "/v1/embeddings") || !strings.HasPrefix(bodies[1], "/v1/responses") {
		t.Fatalf("engine saw %v", bodies)
	}
	mu.Unlock()
}

func TestForwardPriorityRewritesTheBody(t *testing.T) {
	got := make(chan []byte, 1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		req, err := http.ReadRequest(bufio.NewReader(conn))
		if err != nil {
			return
		}
		b, _ := io.ReadAll(req.Body)
		got <- b
		resp := `{"choices":[]}`
		fmt.Fprintf(conn, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(resp), resp)
	}()
	p := startProxy(t, []string{"http://" + ln.Addr().String()}, func(cfg *proxy.Config) { cfg.ForwardPriority = true })
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"nvext":{"agent_hints":{"priority":5}}}`
	if resp, b := post(t, "http://"+p.Addr()+"/v1/chat/completions", body); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	sent := <-got
	var m map[string]any
	if err := json.Unmarshal(sent, &m); err != nil {
		t.Fatalf("forwarded body is not JSON: %s", sent)
	}
	if m["priority"] != float64(-5) || !bytes.HasPrefix(sent, []byte(body[:len(body)-1])) {
		t.Fatalf("forwarded %s", sent)
	}
}

// An agent's conversation (an assistant turn with tool_calls, then the tool's output) is
// rendered with its calls, so the proxy's prompt hashes match what the engine caches.
func TestToolCallConversation(t *testing.T) {
	c := startCluster(t, 2, nil, nil)
	body, _ := json.Marshal(map[string]any{
		"model": model, "max_tokens": 4,
		"messages": []any{
			map[string]any{"role": "system", "content": family(7)},
			map[string]any{"role": "user", "content": "find the bug"},
			map[string]any{"role": "assistant", "content": "", "tool_calls": []any{map[string]any{
				"id": "call_1", "type": "function", "function": map[string]any{"name": "grep", "arguments": `{"pattern":"tran\\("}`}}}},
			map[string]any{"role": "tool", "name": "grep", "tool_call_id": "call_1", "content": "driver.go:12: tran(x)"},
		},
	})
	var worker string
	for i := range 2 {
		resp, b := post(t, c.base+"/v1/chat/completions", string(body))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		var out struct {
			Usage struct {
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		_ = json.Unmarshal(b, &out)
		w := resp.Header.Get("x-kvrelay-worker")
		if i == 1 && (w != worker || out.Usage.PromptTokensDetails.CachedTokens == 0) {
			t.Fatalf("second send went to %s (first %s) with %d cached tokens", w, worker, out.Usage.PromptTokensDetails.CachedTokens)
		}
		worker = w
	}
	bad := strings.Replace(string(body), `"tool_calls":[`, `"tool_calls":[1,`, 1)
	if resp, b := post(t, c.base+"/v1/chat/completions", bad); resp.StatusCode != 400 {
		t.Fatalf("malformed tool_calls: status %d: %s", resp.StatusCode, b)
	}
}

// Sessions stick to their workers whatever the policy. Each round pipelines one request per
// session on one keep-alive connection, in a new order and with messages of new lengths: the
// session ids are read from the bodies in place, and the next round's bytes land where the
// last round's ids were.
func TestSessionsStickThroughTheProxy(t *testing.T) {
	c := startCluster(t, 4, func(cfg *proxy.Config) { cfg.Policy = route.PolicyRoundRobin }, nil)
	conn, err := net.Dial("tcp", c.proxy.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(conn)
	bound := map[string]string{}
	for round := range 4 {
		var raw strings.Builder
		var ids []string
		for k := range 4 {
			i := (k + 3*round) % 4 // another order each round: round-robin alone would not repeat the bindings
			id := fmt.Sprintf("agent-%d", i)
			ids = append(ids, id)
			body := fmt.Sprintf(`{"model":%q,"max_tokens":2,"messages":[{"role":"user","content":%q}],"nvext":{"session_id":%q}}`, model, strings.Repeat("hello ", 1+(5*round+3*k)%7), id)
			fmt.Fprintf(&raw, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		}
		if _, err := io.WriteString(conn, raw.String()); err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("round %d, %s: %v", round, id, err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			w := resp.Header.Get("x-kvrelay-worker")
			if resp.StatusCode != 200 || w == "" {
				t.Fatalf("round %d, %s: status %d, worker %q", round, id, resp.StatusCode, w)
			}
			if round == 0 {
				bound[id] = w
			} else if w != bound[id] {
				t.Fatalf("round %d: %s went to %s (%s), bound to %s (bindings %v)", round, id, w, resp.Header.Get("x-kvrelay-route"), bound[id], bound)
			}
		}
	}
	if len(slices.Compact(slices.Sorted(maps.Values(bound)))) != 4 {
		t.Fatalf("round-robin should have bound the four sessions to four workers: %v", bound)
	}
}

// The proxy's index counts a prompt as cached on its worker once the worker has computed it
// (the first token), not when it was routed there: a request with the same prompt that
// arrives while the first is still in its prefill would compute it again on that worker
// (engines do not share blocks still being computed), so it spreads instead.
func TestPromptCountsAsCachedOnceComputed(t *testing.T) {
	c := startCluster(t, 2, nil, func(cfg *sim.WorkerConfig) { cfg.Engine.Timing.Speedup = 0.05 }) // ~1 s prefill
	type result struct {
		worker, route string
		err           error
	}
	send := func(user string) result {
		resp, err := http.Post(c.base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(family(0), user, 1, false)))
		if err != nil {
			return result{err: err}
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return result{err: fmt.Errorf("status %d", resp.StatusCode)}
		}
		return result{worker: resp.Header.Get("x-kvrelay-worker"), route: resp.Header.Get("x-kvrelay-route")}
	}
	first := make(chan result, 1)
	go func() { first <- send("first") }()
	time.Sleep(300 * time.Millisecond) // the first request is routed and still prefilling
	second := send("second")
	a := <-first
	if a.err != nil || second.err != nil {
		t.Fatal(a.err, second.err)
	}
	if second.worker == a.worker {
		t.Fatalf("the second request joined the first on %s while its prompt was still being computed (route %q)", a.worker, second.route)
	}
	// Both workers have computed the prompt now: the next one finds it cached on either.
	third := send("third")
	if third.err != nil {
		t.Fatal(third.err)
	}
	if !strings.Contains(third.route, "; overlap=") || strings.Contains(third.route, "overlap=0;") {
		t.Fatalf("the third request should find its prompt cached, got route %q", third.route)
	}
}

// A request that makes every engine answer 500 (its own content is the cause) gets the second
// worker's 500 and ejects nobody; requests from other clients keep reaching every worker.
func TestPoisonRequestEjectsNobody(t *testing.T) {
	var mu sync.Mutex
	hits := map[string]int{}
	engine := func(name string) string {
		return fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, req *http.Request) {
			body, _ := io.ReadAll(req.Body)
			if bytes.Contains(body, []byte("poison")) {
				mu.Lock()
				hits[name]++
				mu.Unlock()
				io.WriteString(conn, "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: 45\r\n\r\n"+`{"error":{"message":"bad","type":"internal"}}`)
				return
			}
			const ok = `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`
			fmt.Fprintf(conn, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(ok), ok)
		})
	}
	p := startProxy(t, []string{engine("w0"), engine("w1"), engine("w2")}, func(cfg *proxy.Config) {
		cfg.Policy = "round-robin"
		cfg.EjectAfter = 2
		cfg.EjectFor = time.Minute
	})
	base := "http://" + p.Addr()
	for i := range 4 {
		resp, body := post(t, base+"/v1/chat/completions", chatBody("s", fmt.Sprintf("poison %d", i), 2, false))
		if resp.StatusCode != 500 || !bytes.Contains(body, []byte(`"bad"`)) {
			t.Fatalf("poison request %d: %d %s, want the engine's 500", i, resp.StatusCode, body)
		}
	}
	mu.Lock()
	total := hits["w0"] + hits["w1"] + hits["w2"]
	mu.Unlock()
	if total != 8 {
		t.Fatalf("4 poison requests reached engines %d times (%v), want 8: two workers each", total, hits)
	}
	seen := map[string]bool{}
	for i := range 6 {
		resp, body := post(t, base+"/v1/chat/completions", chatBody("s", fmt.Sprintf("fine %d", i), 2, false))
		if resp.StatusCode != 200 {
			t.Fatalf("request %d after the poison: %d %s", i, resp.StatusCode, body)
		}
		seen[resp.Header.Get("x-kvrelay-worker")] = true
	}
	for _, w := range p.Workers() {
		if !w.EjectedUntil().IsZero() {
			t.Errorf("%s ejected by requests that failed everywhere", w.ID)
		}
	}
	_, m := get(t, base+"/metrics")
	if v := metricValue(t, m, "kvrelay_proxy_poisoned_requests_total"); v != 4 {
		t.Errorf("poisoned requests %v, want 4", v)
	}
	if len(seen) != 3 {
		t.Errorf("later requests reached only %v", seen)
	}
}

// A client's own kv_transfer_params (where an engine should pull KV blocks from) is refused
// before any engine sees it; null passes.
func TestClientKVTransferParamsRefused(t *testing.T) {
	var mu sync.Mutex
	var leaked int
	url := fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		if bytes.Contains(body, []byte("remote_host")) {
			mu.Lock()
			leaked++
			mu.Unlock()
		}
		const ok = `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`
		fmt.Fprintf(conn, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(ok), ok)
	})
	p := startProxy(t, []string{url}, nil)
	base := "http://" + p.Addr()
	evil := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2,` +
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"x","remote_block_ids":[1],"remote_host":"10.1.2.3","remote_port":5600}}`
	resp, body := post(t, base+"/v1/chat/completions", evil)
	if resp.StatusCode != 400 || !bytes.Contains(body, []byte(`"param":"kv_transfer_params"`)) {
		t.Fatalf("kv_transfer_params from a client: %d %s, want 400 naming the field", resp.StatusCode, body)
	}
	// Spellings a case-insensitive decoder takes for the same key: other letter cases, a
	// long s (U+017F), a Kelvin sign (U+212A), and the key escaped.
	for _, key := range []string{"KV_TRANSFER_PARAMS", "Kv_Transfer_Params", "kv_tran\u017ffer_params", "kv_tranſfer_params",
		"\u212av_transfer_params", "Kv_transfer_params", "kv_transfer\u005fparams"} {
		evil := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2,` +
			`"` + key + `":{"do_remote_prefill":true,"remote_engine_id":"x","remote_block_ids":[1],"remote_host":"10.1.2.3","remote_port":5600}}`
		if resp, body := post(t, base+"/v1/chat/completions", evil); resp.StatusCode != 400 || !bytes.Contains(body, []byte(`"param":"kv_transfer_params"`)) {
			t.Fatalf("%q from a client: %d %s, want 400 naming kv_transfer_params", key, resp.StatusCode, body)
		}
	}
	plain := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"kv_transfer_params":null}`
	if resp, body := post(t, base+"/v1/chat/completions", plain); resp.StatusCode != 200 {
		t.Fatalf("kv_transfer_params null: %d %s", resp.StatusCode, body)
	}
	// A key that only looks alike (a Cyrillic а) folds to nothing reserved: no engine reads it.
	lookalike := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"kv_trаnsfer_params":{"remote_host":"10.1.2.3"}}`
	if resp, body := post(t, base+"/v1/chat/completions", lookalike); resp.StatusCode != 200 {
		t.Fatalf("a look-alike key: %d %s", resp.StatusCode, body)
	}
	mu.Lock()
	if leaked != 1 { // the look-alike's body, which the engine decodes as an unknown field
		t.Fatalf("an engine received remote_host %d times, want only the look-alike's once", leaked)
	}
	mu.Unlock()
	_, m := get(t, base+"/metrics")
	if v := metricValue(t, m, `kvrelay_proxy_refused_fields_total{field="kv_transfer_params"}`); v != 8 {
		t.Errorf("refused counter %v, want 8", v)
	}
}

// The proxy refuses exactly what the engine refuses, and agrees with it on what a lax field
// means (vLLM validates with pydantic in lax mode; the simulated engine does the same): each
// body gets the same status from the proxy as from the engine directly, a 4xx is the proxy's
// own (the engine never sees it), and a request both accept streams on both or on neither.
func TestValidationAgreesWithEngine(t *testing.T) {
	w := startWorker(t, nil)
	p := startProxy(t, []string{w.URL()}, nil)
	msgs := `"messages":[{"role":"user","content":"hi"}]`
	bodies := []string{
		"\xEF\xBB\xBF{\"model\":\"" + model + "\"," + msgs + ",\"max_tokens\":2}",
		`{"model":"` + model + `",` + msgs + `,"max_tokens":"2"}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":" 3 "}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2.0}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":1e1}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":"1_0"}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":true}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2.5}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":"two"}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":0}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":-1}`,
		`{"model":"` + model + `",` + msgs + `,"max_completion_tokens":0}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2,"stream":"yes"}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2,"stream":"OFF"}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2,"stream":1}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2,"stream":"maybe"}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2,"stream":2}`,
		`{"model":"` + model + `",` + msgs + `,"max_tokens":2,"ignore_eos":"on","n":"1"}`,
		`{"model":"` + model + `","prompt":"once","max_tokens":"4"}`,
	}
	for _, body := range bodies {
		path := "/v1/chat/completions"
		if strings.Contains(body, `"prompt"`) {
			path = "/v1/completions"
		}
		direct, db := post(t, w.URL()+path, body)
		via, vb := post(t, "http://"+p.Addr()+path, body)
		if direct.StatusCode != via.StatusCode {
			t.Errorf("%q: engine %d (%s), proxy %d (%s)", body, direct.StatusCode, db, via.StatusCode, vb)
			continue
		}
		if via.StatusCode != 200 {
			if via.Header.Get("x-kvrelay-worker") != "" {
				t.Errorf("%q: the proxy passed a request the engine refuses on to it", body)
			}
			continue
		}
		if a, b := direct.Header.Get("Content-Type"), via.Header.Get("Content-Type"); strings.HasPrefix(a, "text/event-stream") != strings.HasPrefix(b, "text/event-stream") {
			t.Errorf("%q: engine answered %s, proxy %s", body, a, b)
		}
	}
}

// A proxy whose client listener is not loopback-only answers /metrics on its admin handler
// only; one on loopback answers it on the client port too.
func TestMetricsOffTheClientPort(t *testing.T) {
	w := startWorker(t, nil)
	p := startProxy(t, []string{w.URL()}, func(cfg *proxy.Config) { cfg.Listen = "0.0.0.0:0" })
	_, port, _ := net.SplitHostPort(p.Addr())
	code, body := get(t, "http://127.0.0.1:"+port+"/metrics")
	if code != 404 || strings.Contains(body, "kvrelay_proxy_") {
		t.Fatalf("/metrics on a wildcard client port: %d %.200s", code, body)
	}
	admin := httptest.NewServer(p.DecisionsHandler())
	defer admin.Close()
	if code, body := get(t, admin.URL+"/metrics"); code != 200 || !strings.Contains(body, "kvrelay_proxy_queue_depth") {
		t.Fatalf("/metrics on the admin handler: %d %.200s", code, body)
	}
	local := startProxy(t, []string{w.URL()}, nil)
	if code, body := get(t, "http://"+local.Addr()+"/metrics"); code != 200 || !strings.Contains(body, "kvrelay_proxy_") {
		t.Fatalf("/metrics on a loopback client port: %d", code)
	}
}

// A worker that streams to one client but does not start answering another within the
// first-byte timeout is busy, not hung: the request moves to another worker and the busy
// one stays in rotation.
//
// The busy worker streams an event every 20 ms until the test ends, and the first-byte
// timeout is 1 s: the proxy reads the worker as silent (hung) only if it hears nothing of
// the stream for 50 events' time, where a loaded machine stalled it past the 300 ms (six
// events) allowed before. The stream has no fixed length, so it still flows at the fourth
// request's timeout however slowly the requests go; the timeout also gives the good worker
// time to start answering a moved request on a loaded machine.
func TestFirstByteTimeoutMovesWithoutEjectingABusyWorker(t *testing.T) {
	done := make(chan struct{})
	busyURL := fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		if !bytes.Contains(body, []byte(`"stream":true`)) {
			<-done // queued behind the stream: no answer in time
			return
		}
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				io.WriteString(conn, "0\r\n\r\n")
				return
			case <-tick.C:
			}
			ev := `data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"t"},"finish_reason":null}]}` + "\n\n"
			if _, err := fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev), ev); err != nil {
				return
			}
		}
	})
	good := startWorker(t, nil)
	p := startProxy(t, []string{busyURL, good.URL()}, func(cfg *proxy.Config) {
		cfg.Policy = "round-robin"
		cfg.FirstByteTimeout = time.Second
		cfg.EjectAfter = 5
	})
	defer close(done) // before the cleanups close the engine and the proxy
	base := "http://" + p.Addr()
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s", "u", 60, true)))
	if err != nil || resp.Header.Get("x-kvrelay-worker") != "w0" {
		t.Fatalf("the stream went to %q (%v), want w0", resp.Header.Get("x-kvrelay-worker"), err)
	}
	defer resp.Body.Close()
	go io.Copy(io.Discard, resp.Body)
	for i := range 4 {
		r, body := post(t, base+"/v1/chat/completions", chatBody("s", fmt.Sprintf("q%d", i), 2, false))
		if r.StatusCode != 200 || r.Header.Get("x-kvrelay-worker") != "w1" {
			t.Fatalf("request %d: %d from %q: %s", i, r.StatusCode, r.Header.Get("x-kvrelay-worker"), body)
		}
	}
	if ws := p.Workers(); !ws[0].EjectedUntil().IsZero() {
		t.Fatal("a worker streaming to another client was ejected as hung")
	}
}

// A request whose head and body arrive a few bytes at a time is parsed once whole and served.
func TestTrickledRequest(t *testing.T) {
	w := startWorker(t, nil)
	p := startProxy(t, []string{w.URL()}, nil)
	conn, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.(*net.TCPConn).SetNoDelay(true)
	body := chatBody("s", "u", 2, false)
	req := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	for i := 0; i < len(req); i += 3 {
		if _, err := conn.Write([]byte(req[i:min(i+3, len(req))])); err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Microsecond)
	}
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !bytes.Contains(b, []byte(`"completion_tokens":2`)) {
		t.Fatalf("trickled request: %d %s", resp.StatusCode, b)
	}
}

// A stream that may migrate is forwarded in whole events, and events framed with CRLF are
// whole events too: the client gets each as the engine sends it, not at the end.
func TestMigratableStreamForwardsEventsAsTheyCome(t *testing.T) {
	release := make(chan struct{})
	url := fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		ev := "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\r\n\r\n"
		fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev), ev)
		<-release
		end := "data: [DONE]\r\n\r\n"
		fmt.Fprintf(conn, "%x\r\n%s\r\n0\r\n\r\n", len(end), end)
	})
	p := startProxy(t, []string{url}, nil)
	resp, err := http.Post("http://"+p.Addr()+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s", "u", 5, true)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(resp.Body).ReadString('\n')
		got <- line
	}()
	select {
	case line := <-got:
		if !strings.Contains(line, `"content":"hi"`) {
			t.Fatalf("first line %q", line)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the first event was held back")
	}
	close(release)
}

// A stream whose engine dies migrates once (its events cut whole even when one arrives in
// two reads), unless the request says x-kvrelay-migrate: off.
func TestMigrationOptOut(t *testing.T) {
	dying := func() string {
		return fakeEngine(t, func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
			io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			ev := `data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}` + "\n\n"
			for i := range 3 {
				if i == 1 { // this event arrives in two reads
					fmt.Fprintf(conn, "%x\r\n%s\r\n", 20, ev[:20])
					time.Sleep(20 * time.Millisecond)
					fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev)-20, ev[20:])
				} else {
					fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev), ev)
				}
				time.Sleep(5 * time.Millisecond)
			}
			conn.Close()
		})
	}
	p := startProxy(t, []string{dying(), dying()}, func(cfg *proxy.Config) { cfg.Policy = "round-robin" })
	for _, tc := range []struct {
		header string
		chunks int
	}{{"", 6}, {"off", 3}} {
		req, _ := http.NewRequest("POST", "http://"+p.Addr()+"/v1/chat/completions", strings.NewReader(chatBody("s", "u", 10, true)))
		if tc.header != "" {
			req.Header.Set("x-kvrelay-migrate", tc.header)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if n := bytes.Count(body, []byte(`"content":"hi"`)); n != tc.chunks || !bytes.Contains(body, []byte(`"error"`)) {
			t.Fatalf("x-kvrelay-migrate %q: %d chunks, want %d, then an error event: %s", tc.header, n, tc.chunks, body)
		}
	}
	_, m := get(t, "http://"+p.Addr()+"/metrics")
	if v := metricValue(t, m, `kvrelay_proxy_migrations_total{outcome="continued"}`); v != 1 {
		t.Errorf("continued %v, want 1: the opted-out stream must not migrate", v)
	}
}

// TestFrozenEngineIsLeftSoon: an engine that stops (SIGSTOP: its connections stay open, it
// sends nothing more) is seen frozen once its streams have had nothing for FrozenAfter and
// neither has any connection to it: it is taken out, and requests waiting for its first
// byte try the other worker then, not at the 30 s first-byte timeout.
func TestFrozenEngineIsLeftSoon(t *testing.T) {
	var frozen atomic.Bool
	stream := func(freezable bool) func(net.Conn, *bufio.Reader, *http.Request) {
		return func(conn net.Conn, _ *bufio.Reader, _ *http.Request) {
			for freezable && frozen.Load() {
				time.Sleep(10 * time.Millisecond) // stopped: reads nothing, answers nothing
			}
			io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			ev := `data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"t"},"finish_reason":null}]}` + "\n\n"
			for i := range 150 {
				for freezable && frozen.Load() {
					time.Sleep(10 * time.Millisecond)
				}
				if i == 149 {
					ev += "data: [DONE]\n\n"
				}
				if _, err := fmt.Fprintf(conn, "%x\r\n%s\r\n", len(ev), ev); err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
			io.WriteString(conn, "0\r\n\r\n")
		}
	}
	t.Cleanup(func() { frozen.Store(false) })
	p := startProxy(t, []string{fakeEngine(t, stream(true)), fakeEngine(t, stream(false))}, func(cfg *proxy.Config) {
		cfg.FrozenAfter = time.Second
	})
	base := "http://" + p.Addr()
	// A stream on w0, read as it comes.
	var onW0 *http.Response
	for range 20 {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s", "u", 10, true)))
		if err != nil {
			t.Fatal(err)
		}
		if resp.Header.Get("x-kvrelay-worker") == "w0" {
			onW0 = resp
			break
		}
		go func() { _, _ = io.Copy(io.Discard, resp.Body); resp.Body.Close() }()
	}
	if onW0 == nil {
		t.Fatal("no stream landed on w0 in 20 requests")
	}
	defer onW0.Body.Close()
	go func() { _, _ = io.Copy(io.Discard, onW0.Body) }()
	time.Sleep(200 * time.Millisecond)
	frozen.Store(true)
	// New requests, some of them sent to the frozen worker before it is found out.
	start := time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var slowest time.Duration
	failed := 0
	for i := range 8 {
		wg.Go(func() {
			t0 := time.Now()
			resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("s"+strconv.Itoa(i), "u", 10, true)))
			mu.Lock()
			defer mu.Unlock()
			if err != nil || resp.StatusCode != 200 {
				failed++
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			slowest = max(slowest, time.Since(t0))
		})
	}
	wg.Wait()
	t.Logf("8 requests after the freeze: the slowest took %v (%d failed), all within %v", slowest, failed, time.Since(start).Round(time.Millisecond))
	if failed > 0 || time.Since(start) > 12*time.Second {
		t.Fatalf("%d failed; the last answered %v after the freeze, want within 12 s (FirstByteTimeout is 30 s)", failed, time.Since(start))
	}
	_, m := get(t, base+"/metrics")
	if v := metricValue(t, m, `kvrelay_proxy_worker_ejections_total{worker="w0"}`); v < 1 {
		t.Errorf("w0 ejected %v times, want at least once", v)
	}
}
