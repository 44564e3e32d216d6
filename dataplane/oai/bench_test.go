package oai

import (
	"strconv"
	"strings"
	"testing"
)

const smallChat = `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"What is the capital of France? Answer in one word."}],"max_tokens":64,"temperature":0.7,"stream":true,"stream_options":{"include_usage":true},"nvext":{"agent_hints":{"priority":2,"osl":64}}}`

// longChat builds an agent-style chat body of about n bytes: a system prompt, tools, and
// alternating turns of prose with the escapes real clients send (newlines, quotes, unicode).
func longChat(n int) []byte {
	const para = `The proxy parses each request once, renders the prompt with the model's chat template, ` +
		`hashes full blocks of tokens and routes to the worker that already holds the longest prefix.\n` +
		`It said \"keep the hot path free of allocations\" \u2014 and measured it. Caf\u00e9 na\u00efve r\u00e9sum\u00e9. `
	var b strings.Builder
	b.WriteString(`{"model":"openai/gpt-oss-120b","messages":[{"role":"system","content":"You are a coding agent. Follow the repository's style.\n\n# Tools\nUse them."}`)
	for turn := 0; b.Len() < n-300; turn++ {
		role := "user"
		if turn%2 == 1 {
			role = "assistant"
		}
		b.WriteString(`,{"role":"` + role + `","content":"`)
		for k := 0; k < 8 && b.Len() < n-300; k++ {
			b.WriteString(para)
		}
		b.WriteString(`"}`)
	}
	b.WriteString(`],"tools":[{"type":"function","function":{"name":"read_file","parameters":{"type":"object","properties":{"path":{"type":"string"}}}}}],` +
		`"max_completion_tokens":2048,"stream":true,"stream_options":{"include_usage":true},"cache_salt":"tenant-42",` +
		`"nvext":{"session_id":"sess-1","agent_hints":{"latency_sensitivity":1.0,"osl":512,"speculative_prefill":true}}}`)
	return []byte(b.String())
}

func tokenPrompt(n int) []byte {
	b := []byte(`{"model":"m","prompt":[`)
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(i*7919%200000), 10)
	}
	return append(b, `],"max_tokens":16}`...)
}

var allocBodies = []struct {
	name string
	kind Kind
	body []byte
}{
	{"small chat", ChatCompletions, []byte(smallChat)},
	{"32KB chat", ChatCompletions, longChat(32 << 10)},
	{"content parts", ChatCompletions, []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a\nb"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"c"}]}]}`)},
	{"token prompt", Completions, tokenPrompt(2000)},
	{"responses", Responses, []byte(`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"q\t"}]},{"type":"function_call_output","call_id":"c","output":"o"}],"instructions":"Be brief.","max_output_tokens":9,"reasoning":{"effort":"low"}}`)},
	{"embeddings", Embeddings, []byte(`{"model":"e","input":["a","b","c"]}`)},
}

// TestParseAllocs: once a Parser and Request have seen a body, parsing it again allocates
// nothing.
func TestParseAllocs(t *testing.T) {
	for _, tc := range allocBodies {
		t.Run(tc.name, func(t *testing.T) {
			var p Parser
			var r Request
			if err := p.Parse(tc.body, tc.kind, &r); err != nil {
				t.Fatal(err)
			}
			allocs := testing.AllocsPerRun(50, func() {
				if err := p.Parse(tc.body, tc.kind, &r); err != nil {
					t.Fatal(err)
				}
			})
			if allocs != 0 {
				t.Errorf("Parse allocates %v times, want 0", allocs)
			}
		})
	}
}

func BenchmarkParse(b *testing.B) {
	for _, tc := range []struct {
		name string
		kind Kind
		body []byte
	}{
		{"chat/small", ChatCompletions, []byte(smallChat)},
		{"chat/8k-tokens-32KB", ChatCompletions, longChat(32 << 10)},
		{"chat/32k-tokens-128KB", ChatCompletions, longChat(128 << 10)},
		{"completions/2k-token-ids", Completions, tokenPrompt(2000)},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var p Parser
			var r Request
			b.SetBytes(int64(len(tc.body)))
			b.ReportAllocs()
			for b.Loop() {
				if err := p.Parse(tc.body, tc.kind, &r); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkAppendWithField(b *testing.B) {
	body := longChat(32 << 10)
	dst := make([]byte, 0, len(body)+32)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		dst = AppendWithField(dst[:0], body, "priority", -3)
	}
}
