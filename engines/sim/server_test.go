package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// wordCodec is a test Codec: every space-separated word (with its leading space) is one
// token, and chat messages render as "<role>: content" lines.
type wordCodec struct {
	mu    sync.Mutex
	words map[uint32]string
}

func (c *wordCodec) EncodePrompt(text string) []uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.words == nil {
		c.words = map[uint32]string{}
	}
	var ids []uint32
	for i := 0; i < len(text); {
		j := i + 1
		for j < len(text) && text[j] != ' ' {
			j++
		}
		h := fnv.New32a()
		h.Write([]byte(text[i:j]))
		id := h.Sum32() % 1_000_000
		c.words[id] = text[i:j]
		ids = append(ids, id)
		i = j
	}
	return ids
}

func (c *wordCodec) Decode(ids []uint32) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(c.words[id])
	}
	return b.String()
}

func (c *wordCodec) EncodeChat(msgs []ChatMessage, opts ChatOptions) ([]uint32, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.Role + ": " + m.Content + " \n")
	}
	if opts.AddGenerationPrompt {
		b.WriteString("assistant:")
	}
	return c.EncodePrompt(b.String()), nil
}

// startWorker runs a worker on loopback for the test's lifetime.
func startWorker(t *testing.T, mut func(*WorkerConfig)) *Worker {
	t.Helper()
	cfg := WorkerConfig{Engine: DefaultConfig(), Listen: "127.0.0.1:0", Codec: &wordCodec{}}
	cfg.Engine.NumGPUBlocks = 2048
	cfg.Engine.Timing.Speedup = 50
	if mut != nil {
		mut(&cfg)
	}
	w, err := NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := w.Start(ctx); err != nil {
		cancel()
		w.Close()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker run: %v", err)
		}
		w.Close()
	})
	return w
}

func post(t *testing.T, url, body string) (int, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func longText(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(" w")
		b.WriteString(string(rune('a' + i%26)))
		b.WriteString(string(rune('a' + i/26%26)))
	}
	return b.String()
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func TestChatCompletionCachesPrefix(t *testing.T) {
	w := startWorker(t, nil)
	body := `{"model":"gpt-oss-120b","messages":[{"role":"system","content":"` + longText(300) + `"},{"role":"user","content":"hello"}],"max_tokens":5}`
	var first, second struct {
		Object  string `json:"object"`
		Choices []struct {
			Message      struct{ Role, Content string } `json:"message"`
			FinishReason string                         `json:"finish_reason"`
		} `json:"choices"`
		Usage usage `json:"usage"`
	}
	for _, out := range []any{&first, &second} {
		code, b := post(t, w.URL()+"/v1/chat/completions", body)
		if code != 200 {
			t.Fatalf("status %d: %s", code, b)
		}
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatal(err)
		}
	}
	if first.Object != "chat.completion" || first.Choices[0].FinishReason != "length" || first.Usage.CompletionTokens != 5 {
		t.Fatalf("unexpected first response %+v", first)
	}
	pt := second.Usage.PromptTokens
	if want := pt / 16 * 16; second.Usage.PromptTokensDetails.CachedTokens != want || first.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("cached_tokens %d then %d of %d prompt tokens, want 0 then %d", first.Usage.PromptTokensDetails.CachedTokens, second.Usage.PromptTokensDetails.CachedTokens, pt, want)
	}
	if n := len(strings.Fields(second.Choices[0].Message.Content)); n != 5 {
		t.Fatalf("content %q has %d words, want 5", second.Choices[0].Message.Content, n)
	}
}

func TestStreamingChunksAndUsage(t *testing.T) {
	w := startWorker(t, nil)
	for _, tc := range []struct {
		name, path, body string
	}{
		{"chat", "/v1/chat/completions", `{"messages":[{"role":"user","content":"tell me"}],"max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}`},
		{"completion", "/v1/completions", `{"prompt":"once upon a time","max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := http.Post(w.URL()+tc.path, "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
				t.Fatalf("content type %q", ct)
			}
			sc := bufio.NewScanner(resp.Body)
			var tokens, finish int
			var sawDone bool
			var u *usage
			for sc.Scan() {
				line := sc.Text()
				if line == "" {
					continue
				}
				data, ok := strings.CutPrefix(line, "data: ")
				if !ok {
					t.Fatalf("not an SSE data line: %q", line)
				}
				if data == "[DONE]" {
					sawDone = true
					continue
				}
				var chunk struct {
					Choices []struct {
						Text         *string `json:"text"`
						Delta        struct{ Content *string }
						FinishReason *string `json:"finish_reason"`
					} `json:"choices"`
					Usage *usage `json:"usage"`
				}
				if err := json.Unmarshal([]byte(data), &chunk); err != nil {
					t.Fatalf("chunk %q: %v", data, err)
				}
				if chunk.Usage != nil {
					u = chunk.Usage
				}
				for _, c := range chunk.Choices {
					if (c.Text != nil && *c.Text != "") || (c.Delta.Content != nil && *c.Delta.Content != "") {
						tokens++
					}
					if c.FinishReason != nil {
						finish++
					}
				}
			}
			if tokens != 7 || finish != 1 || !sawDone || u == nil || u.CompletionTokens != 7 {
				t.Fatalf("tokens=%d finish=%d done=%v usage=%+v", tokens, finish, sawDone, u)
			}
		})
	}
}

func TestBadInput(t *testing.T) {
	w := startWorker(t, func(c *WorkerConfig) {
		c.Engine.MaxModelLen = 2000
		c.Engine.MaxRequestBytes = 64 << 10
	})
	cases := []struct {
		name, path, body string
		status           int
	}{
		{"malformed json", "/v1/chat/completions", `{not json`, 400},
		{"trailing data", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]} {}`, 400},
		{"no messages", "/v1/chat/completions", `{"model":"gpt-oss-120b"}`, 400},
		{"unknown model", "/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, 404},
		{"n above one", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"n":2}`, 400},
		{"image part", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, 400},
		{"negative max tokens", "/v1/completions", `{"prompt":"x","max_tokens":-3}`, 400},
		{"prompt over max model len", "/v1/completions", `{"prompt":"` + longText(2100) + `"}`, 400},
		{"no prompt", "/v1/completions", `{"max_tokens":3}`, 400},
		{"batched prompts", "/v1/completions", `{"prompt":["a","b"]}`, 400},
		{"body over the limit", "/v1/completions", `{"prompt":"` + strings.Repeat("x", 70<<10) + `"}`, 413},
		{"wrong method", "/v1/models", ``, 405},
		{"unknown route", "/v2/anything", `{}`, 404},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, b := post(t, w.URL()+tc.path, tc.body)
			if code != tc.status {
				t.Fatalf("status %d, want %d: %s", code, tc.status, b)
			}
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(b, &e); err != nil || e.Error.Message == "" || e.Error.Code != tc.status {
				t.Fatalf("not an OpenAI error object: %s (%v)", b, err)
			}
		})
	}
	// The worker still serves after all that.
	if code, b := post(t, w.URL()+"/v1/completions", `{"prompt":"still alive","max_tokens":2}`); code != 200 {
		t.Fatalf("status %d after bad input: %s", code, b)
	}
}

func TestClientDisconnectFreesBlocks(t *testing.T) {
	w := startWorker(t, func(c *WorkerConfig) { c.Engine.Timing.Speedup = 1 })
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", w.URL()+"/v1/completions",
		strings.NewReader(`{"prompt":"`+longText(500)+`","max_tokens":5000,"ignore_eos":true,"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(resp.Body)
	if _, err := r.ReadString('\n'); err != nil { // the first token is out: the request holds blocks
		t.Fatal(err)
	}
	if l := w.Engine().Load(); l.Running != 1 || l.KVUsage == 0 {
		t.Fatalf("load while streaming: %+v", l)
	}
	cancel()
	resp.Body.Close()
	deadline := time.Now().Add(5 * time.Second)
	for w.Engine().Load() != (Load{}) {
		if time.Now().After(deadline) {
			t.Fatalf("blocks not freed after the client left: %+v", w.Engine().Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestModelsTokenizeMetrics(t *testing.T) {
	w := startWorker(t, nil)
	resp, err := http.Get(w.URL() + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Data []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	json.NewDecoder(resp.Body).Decode(&models)
	resp.Body.Close()
	if len(models.Data) != 1 || models.Data[0].ID != "gpt-oss-120b" || models.Data[0].MaxModelLen != 131072 {
		t.Fatalf("models: %+v", models)
	}
	code, b := post(t, w.URL()+"/tokenize", `{"prompt":"a b c"}`)
	var tok struct {
		Count  int      `json:"count"`
		Tokens []uint32 `json:"tokens"`
	}
	if code != 200 || json.Unmarshal(b, &tok) != nil || tok.Count != 3 || len(tok.Tokens) != 3 {
		t.Fatalf("tokenize: %d %s", code, b)
	}
	// The render endpoints give what /tokenize gives: the prompt as the engine computes it.
	code, b = post(t, w.URL()+"/v1/completions/render", `{"prompt":"a b c"}`)
	var rendered []struct {
		TokenIDs []uint32 `json:"token_ids"`
	}
	if code != 200 || json.Unmarshal(b, &rendered) != nil || len(rendered) != 1 || !slices.Equal(rendered[0].TokenIDs, tok.Tokens) {
		t.Fatalf("completions render: %d %s, want %v", code, b, tok.Tokens)
	}
	chatMsgs := `"messages":[{"role":"user","content":"hello"}]`
	_, tb := post(t, w.URL()+"/tokenize", `{`+chatMsgs+`}`)
	code, b = post(t, w.URL()+"/v1/chat/completions/render", `{"model":"gpt-oss-120b",`+chatMsgs+`}`)
	var chatTok struct{ Tokens []uint32 }
	var chatRendered struct {
		TokenIDs []uint32 `json:"token_ids"`
	}
	if json.Unmarshal(tb, &chatTok) != nil || code != 200 || json.Unmarshal(b, &chatRendered) != nil ||
		len(chatTok.Tokens) == 0 || !slices.Equal(chatRendered.TokenIDs, chatTok.Tokens) {
		t.Fatalf("chat render: %d %s, want %v", code, b, chatTok.Tokens)
	}
	if code, _ = post(t, w.URL()+"/v1/chat/completions/render", `{"model":"nope",`+chatMsgs+`}`); code != 404 {
		t.Fatalf("chat render of an unknown model: %d, want 404", code)
	}
	post(t, w.URL()+"/v1/completions", `{"prompt":"x y z","max_tokens":3}`)
	resp, err = http.Get(w.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`vllm:num_requests_running{engine="0",model_name="gpt-oss-120b"} 0`,
		`vllm:num_requests_waiting{engine="0",model_name="gpt-oss-120b"} 0`,
		`vllm:kv_cache_usage_perc{`, `vllm:prefix_cache_queries_total{`, `vllm:prefix_cache_hits_total{`,
		`vllm:prompt_tokens_total{engine="0",model_name="gpt-oss-120b"} 3`,
		`vllm:generation_tokens_total{engine="0",model_name="gpt-oss-120b"} 3`,
		`vllm:time_to_first_token_seconds_bucket{`, `vllm:inter_token_latency_seconds_bucket{`,
		`vllm:e2e_request_latency_seconds_count{engine="0",model_name="gpt-oss-120b"} 1`,
		`vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="true",engine="0",num_gpu_blocks="2048"} 1`,
	} {
		if !bytes.Contains(m, []byte(want)) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if code, _ := post(t, w.URL()+"/reset_prefix_cache", ``); code != 200 {
		t.Fatalf("reset_prefix_cache: %d", code)
	}
}

func TestWorkerPublishesEvents(t *testing.T) {
	w := startWorker(t, func(c *WorkerConfig) {
		c.Events = kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}
	})
	if w.EventsEndpoint() == "" || strings.HasSuffix(w.EventsEndpoint(), ":0") {
		t.Fatalf("events endpoint %q", w.EventsEndpoint())
	}
}

// TestCreatedIsTheRequestsTime: a completion's created is when its request came, not when
// the server started.
func TestCreatedIsTheRequestsTime(t *testing.T) {
	w := startWorker(t, nil)
	w.srv.created -= 3600 // as if it had served for an hour
	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"model":"gpt-oss-120b","max_tokens":2,"stream":%v,"messages":[{"role":"user","content":"hi"}]}`, stream)
		_, b := post(t, w.URL()+"/v1/chat/completions", body)
		i := bytes.Index(b, []byte(`"created":`))
		if i < 0 {
			t.Fatalf("no created in %s", b)
		}
		var created int64
		fmt.Sscanf(string(b[i+len(`"created":`):]), "%d", &created)
		if d := time.Now().Unix() - created; d < 0 || d > 2 {
			t.Errorf("stream %v: created is %d s old", stream, d)
		}
	}
}
