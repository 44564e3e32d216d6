package sim

import (
	"bufio"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// TestReasoningModel: with ReasoningTokens, a chat completion's first tokens come back as
// reasoning_content (whole or streamed), a text completion's do not, and the engine marks
// the blocks a reasoning request generated write-once; without it, nothing is marked.
func TestReasoningModel(t *testing.T) {
	for _, think := range []int{0, 24} {
		w := startWorker(t, func(c *WorkerConfig) {
			c.Engine.ReasoningTokens = think
			c.Engine.Eviction = EvictWORM
			c.Engine.NumGPUBlocks = 48
		})
		chat := func(maxTokens string, stream bool) (reasoning, content []string) {
			t.Helper()
			body := `{"messages":[{"role":"user","content":"` + longText(40) + `"}],"max_tokens":` + maxTokens + `,"ignore_eos":true`
			if !stream {
				code, b := post(t, w.URL()+"/v1/chat/completions", body+`}`)
				var resp struct {
					Choices []struct {
						Message struct {
							Content          string  `json:"content"`
							ReasoningContent *string `json:"reasoning_content"`
						} `json:"message"`
					} `json:"choices"`
					Usage usage `json:"usage"`
				}
				if code != 200 || json.Unmarshal(b, &resp) != nil || len(resp.Choices) != 1 {
					t.Fatalf("%d %s", code, b)
				}
				m := resp.Choices[0].Message
				if m.ReasoningContent != nil {
					reasoning = []string{*m.ReasoningContent}
				}
				return reasoning, []string{m.Content}
			}
			resp, err := http.Post(w.URL()+"/v1/chat/completions", "application/json", strings.NewReader(body+`,"stream":true}`))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				data, ok := strings.CutPrefix(sc.Text(), "data: ")
				if !ok || data == "[DONE]" {
					continue
				}
				var chunk struct {
					Choices []struct {
						Delta struct {
							Content          *string `json:"content"`
							ReasoningContent *string `json:"reasoning_content"`
						} `json:"delta"`
					} `json:"choices"`
				}
				if err := json.Unmarshal([]byte(data), &chunk); err != nil {
					t.Fatalf("chunk %q: %v", data, err)
				}
				for _, c := range chunk.Choices {
					if c.Delta.ReasoningContent != nil {
						reasoning = append(reasoning, *c.Delta.ReasoningContent)
					}
					if c.Delta.Content != nil && *c.Delta.Content != "" {
						content = append(content, *c.Delta.Content)
					}
				}
			}
			return reasoning, content
		}
		// Streamed: one delta a token, the first think of them reasoning.
		r, c := chat("40", true)
		if len(r) != think || len(c) != 40-think {
			t.Fatalf("reasoning tokens %d: streamed %d reasoning and %d content deltas", think, len(r), len(c))
		}
		// Whole: reasoning_content only when the model reasons; all of it when max_tokens
		// ends the request within the reasoning.
		r, c = chat("40", false)
		if (len(r) == 1 && r[0] != "") != (think > 0) || c[0] == "" {
			t.Fatalf("reasoning tokens %d: reasoning %q content %q", think, r, c)
		}
		if think > 0 {
			if r, c = chat("5", false); len(r) != 1 || r[0] == "" || c[0] != "" {
				t.Fatalf("5 tokens within 24 of reasoning: reasoning %q content %q", r, c)
			}
		}
		// A text completion has no reasoning.
		code, b := post(t, w.URL()+"/v1/completions", `{"prompt":"once upon a time","max_tokens":7,"ignore_eos":true}`)
		if code != 200 || strings.Contains(string(b), "reasoning") {
			t.Fatalf("text completion: %d %s", code, b)
		}
		// What reasoning requests generate is write-once: in a GPU tier too small for them
		// all, their output blocks are evicted as ephemeral; without reasoning, none is.
		for i := range 12 {
			body := `{"messages":[{"role":"user","content":"` + longText(60+i) + `"}],"max_tokens":64,"ignore_eos":true}`
			if code, b := post(t, w.URL()+"/v1/chat/completions", body); code != 200 {
				t.Fatalf("%d %s", code, b)
			}
		}
		eph := metric(t, w, "kvrelay_sim_kv_gpu_evictions_total", `class="ephemeral"`)
		all := metric(t, w, "kvrelay_sim_kv_gpu_evictions_total", "")
		if all == 0 || (eph > 0) != (think > 0) {
			t.Fatalf("reasoning tokens %d: %v of %v evictions ephemeral", think, eph, all)
		}
	}
}

func TestReasoningTokensValidated(t *testing.T) {
	cfg := DefaultConfig()
	cfg.ReasoningTokens = -1
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "reasoning tokens") {
		t.Fatalf("negative reasoning tokens: %v", err)
	}
}
