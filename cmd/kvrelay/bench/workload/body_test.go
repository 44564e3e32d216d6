package workload

import (
	"encoding/json"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/oai"
)

func TestBody(t *testing.T) {
	for _, tc := range []struct {
		name   string
		req    Request
		stream bool
		want   string
	}{
		{"text completion", Request{Prompt: " a b", MaxTokens: 3, IgnoreEOS: true}, false,
			`{"model":"m","prompt":" a b","max_tokens":3,"ignore_eos":true}`},
		{"empty prompt is still sent", Request{MaxTokens: 1}, false,
			`{"model":"m","prompt":"","max_tokens":1}`},
		{"streamed chat with usage", Request{Chat: true, Messages: []Message{{Role: "user", Content: "hi"}}, MaxTokens: 2}, true,
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`},
		{"hints and session", Request{Chat: true, Messages: []Message{{Role: "user", Content: "x"}}, Session: "agent-1", Priority: -1, HasPriority: true, OSL: 40}, false,
			`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"session_id":"agent-1","agent_hints":{"priority":-1,"osl":40}}}`},
		{"anonymous session keeps its hints", Request{Chat: true, Messages: []Message{{Role: "user", Content: "x"}}, Session: "agent-1", Anonymous: true, OSL: 40}, false,
			`{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"osl":40}}}`},
		{"anonymous session without hints", Request{Chat: true, Messages: []Message{{Role: "user", Content: "x"}}, Session: "agent-1", Anonymous: true}, false,
			`{"model":"m","messages":[{"role":"user","content":"x"}]}`},
		{"priority zero is sent when set", Request{Prompt: "p", HasPriority: true}, false,
			`{"model":"m","prompt":"p","nvext":{"agent_hints":{"priority":0}}}`},
		{"osl alone", Request{Prompt: "p", OSL: 7}, false,
			`{"model":"m","prompt":"p","nvext":{"agent_hints":{"osl":7}}}`},
		{"tool call and result", Request{Chat: true, Messages: []Message{
			{Role: "assistant", Content: "", ToolCalls: []ToolCall{{ID: "c1", Type: "function", Function: FunctionCall{Name: "grep", Arguments: `{"pattern":"x"}`}}}},
			{Role: "tool", Name: "grep", ToolCallID: "c1", Content: "out"},
		}}, false,
			`{"model":"m","messages":[{"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"grep","arguments":"{\"pattern\":\"x\"}"}}]},{"role":"tool","content":"out","name":"grep","tool_call_id":"c1"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.req.Body("m", tc.stream)
			if string(got) != tc.want {
				t.Errorf("Body:\n got %s\nwant %s", got, tc.want)
			}
			if !json.Valid(got) {
				t.Error("invalid JSON")
			}
		})
	}
}

// TestBodiesParseInProxy parses the body of every request of the golden workloads with the
// proxy's OpenAI parser and checks that it reads back what the request holds.
func TestBodiesParseInProxy(t *testing.T) {
	tok := testTokenizer(t)
	var p oai.Parser
	var got oai.Request
	for _, tc := range goldenCases {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Parse(tc.spec, tc.seed, tok)
			if err != nil {
				t.Fatal(err)
			}
			for i, r := range drive(t, w, wordAnswers(t), true) {
				kind := oai.Completions
				if r.Chat {
					kind = oai.ChatCompletions
				}
				body := r.Body("gpt-oss", true)
				if err := p.Parse(body, kind, &got); err != nil {
					t.Fatalf("request %d: %v\n%s", i, err, body)
				}
				prio, hasPrio := got.Priority()
				switch {
				case got.MaxTokens != r.MaxTokens || got.IgnoreEOS != r.IgnoreEOS || !got.Stream || !got.IncludeUsage:
					t.Errorf("request %d: limits %d/%v, stream %v/%v", i, got.MaxTokens, got.IgnoreEOS, got.Stream, got.IncludeUsage)
				case hasPrio != r.HasPriority || prio != r.Priority:
					t.Errorf("request %d: priority %d/%v, want %d/%v", i, prio, hasPrio, r.Priority, r.HasPriority)
				case got.Hints.OSL != r.OSL || string(got.Hints.SessionID) != wireSession(&r.Request):
					t.Errorf("request %d: osl %d, session %q", i, got.Hints.OSL, got.Hints.SessionID)
				case r.Chat && len(got.Messages) != len(r.Messages):
					t.Errorf("request %d: %d messages, want %d", i, len(got.Messages), len(r.Messages))
				case !r.Chat && string(got.Prompt) != r.Prompt:
					t.Errorf("request %d: prompt differs", i)
				}
				for j, m := range r.Messages {
					gm := got.Messages[j]
					if string(gm.Role) != m.Role || string(gm.Content) != m.Content || string(gm.ToolCallID) != m.ToolCallID ||
						(len(m.ToolCalls) > 0) != (gm.ToolCalls != nil) {
						t.Errorf("request %d message %d: read back %q %q", i, j, gm.Role, gm.Content)
					}
				}
			}
		})
	}
}

// wireSession is the session id a request's body carries: none for an anonymous session.
func wireSession(r *Request) string {
	if r.Anonymous {
		return ""
	}
	return r.Session
}
