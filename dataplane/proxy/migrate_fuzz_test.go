package proxy

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/oai"
)

// FuzzMigration: rebuilding a request to continue an answer, and rewriting a continuation's
// events, never panic; a rebuilt request is JSON whose output limit shrank by the tokens
// sent, and a rewritten event is one whole event.
func FuzzMigration(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":100,"stream":true}`), "so far", 20,
		[]byte(`data: {"id":"x","created":5,"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":40,"completion_tokens":3}}`+"\n\n"), true)
	f.Add([]byte(`{"model":"m","prompt":"once","max_tokens":"7","min_tokens":3}`), "upon", 2, []byte("data: [DONE]\n\n"), false)
	f.Add([]byte(`{"messages":{}}`), "", 0, []byte(`data: {"choices":[{"delta":{"role":"assistant","content":""}}]}`+"\n\n"), true)
	f.Fuzz(func(t *testing.T, body []byte, text string, tokens int, ev []byte, chat bool) {
		kind := oai.Completions
		if chat {
			kind = oai.ChatCompletions
		}
		if out, ok := continuation(body, kind, []byte(text), tokens); ok {
			var m map[string]json.RawMessage
			if err := json.Unmarshal(out, &m); err != nil {
				t.Fatalf("continuation %q is not JSON: %v", out, err)
			}
			var before, after map[string]any
			_ = json.Unmarshal(body, &before)
			_ = json.Unmarshal(out, &after)
			if n, ok := after["max_tokens"].(float64); ok && n < 1 {
				t.Fatalf("continuation asks for %v tokens", n)
			}
		}
		m := migration{id: []byte(`"chatcmpl-1"`), created: []byte("7"), sent: max(tokens, 0)}
		if out, keep := m.rewrite(ev); keep && bytes.HasPrefix(out, []byte("data: ")) && !bytes.Equal(out, ev) && !bytes.HasSuffix(out, []byte("\n\n")) {
			t.Fatalf("rewritten event %q is not whole", out)
		}
	})
}
