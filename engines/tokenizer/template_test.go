package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ardanlabs/jinja"
)

// chatFixture is testdata/chat/<template>.json, written by hack/tokenizer-fixtures.
type chatFixture struct {
	Template string `json:"template"`
	Source   string `json:"source"`
	Date     string `json:"date"`
	Cases    []struct {
		Name                string                     `json:"name"`
		Messages            []json.RawMessage          `json:"messages"`
		Tools               json.RawMessage            `json:"tools"`
		AddGenerationPrompt bool                       `json:"add_generation_prompt"`
		Kwargs              map[string]json.RawMessage `json:"kwargs"`
		Text                string                     `json:"text"`
		IDs                 []uint32                   `json:"ids"`
	} `json:"cases"`
}

// fixtureMessage is the fixture's message shape: arguments are objects, reasoning is carried
// as reasoning_content (and thinking).
type fixtureMessage struct {
	Role       string `json:"role"`
	Content    string `json:"content"`
	Name       string `json:"name"`
	ToolCallID string `json:"tool_call_id"`
	Reasoning  string `json:"reasoning_content"`
	ToolCalls  []struct {
		ID       string `json:"id"`
		Type     string `json:"type"`
		Function struct {
			Name      string          `json:"name"`
			Arguments json.RawMessage `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

func fixtureMessages(t *testing.T, raw []json.RawMessage) []Message {
	t.Helper()
	out := make([]Message, len(raw))
	for i, r := range raw {
		var fm fixtureMessage
		if err := json.Unmarshal(r, &fm); err != nil {
			t.Fatalf("decoding fixture message: %v", err)
		}
		m := Message{Role: fm.Role, Content: fm.Content, Name: fm.Name, ToolCallID: fm.ToolCallID, Reasoning: fm.Reasoning}
		for _, tc := range fm.ToolCalls {
			m.ToolCalls = append(m.ToolCalls, ToolCall{ID: tc.ID, Type: tc.Type,
				Function: ToolCallFunction{Name: tc.Function.Name, Arguments: string(tc.Function.Arguments)}})
		}
		out[i] = m
	}
	return out
}

func fixtureOptions(t *testing.T, fx *chatFixture, i int) RenderOptions {
	t.Helper()
	c := fx.Cases[i]
	opts := RenderOptions{AddGenerationPrompt: c.AddGenerationPrompt, Date: fx.Date}
	if !isNull(c.Tools) {
		opts.Tools = c.Tools
	}
	for k, v := range c.Kwargs {
		switch k {
		case "reasoning_effort":
			_ = json.Unmarshal(v, &opts.ReasoningEffort)
		case "model_identity":
			_ = json.Unmarshal(v, &opts.ModelIdentity)
		case "enable_thinking":
			var b bool
			_ = json.Unmarshal(v, &b)
			opts.EnableThinking = &b
		default:
			t.Fatalf("fixture kwarg %q not mapped", k)
		}
	}
	return opts
}

// gptOSSTemplatePath is where the gpt-oss chat_template.jinja may be placed to test the Jinja
// engine on it (it is not on npm, so it is not committed; see hack/tokenizer-fixtures).
var gptOSSTemplatePath = filepath.Join("..", "..", "hack", "tokenizer-fixtures", "gpt-oss-chat_template.jinja")

func TestTemplatesGolden(t *testing.T) {
	tests := []struct {
		name      string
		fixture   string
		template  func(t *testing.T) Template
		tokenizer string
		// skip names cases the template does not claim to reproduce.
		skip map[string]string
	}{
		{
			name: "jinja qwen3", fixture: "chat/qwen3.json", tokenizer: qwen3TokenizerFile,
			template: func(t *testing.T) Template { return mustTemplate(t, "testdata/models/qwen3/tokenizer_config.json") },
		},
		{
			name: "jinja llama3", fixture: "chat/llama3.json", tokenizer: llama3TokenizerFile,
			template: func(t *testing.T) Template { return mustTemplate(t, "testdata/models/llama3/tokenizer_config.json") },
		},
		{
			name: "jinja gpt-oss", fixture: "chat/gpt-oss.json", tokenizer: O200kHarmony,
			template: func(t *testing.T) Template {
				if _, err := os.Stat(gptOSSTemplatePath); err != nil {
					t.Skipf("no gpt-oss chat_template.jinja at %s (not on npm; see hack/tokenizer-fixtures)", gptOSSTemplatePath)
				}
				return mustTemplate(t, gptOSSTemplatePath)
			},
		},
		{
			name: "builtin harmony", fixture: "chat/gpt-oss.json", tokenizer: O200kHarmony,
			template: func(t *testing.T) Template { return mustTemplate(t, TemplateHarmony) },
		},
		{
			name: "builtin chatml", fixture: "chat/qwen3.json", tokenizer: qwen3TokenizerFile,
			template: func(t *testing.T) Template { return mustTemplate(t, TemplateChatML) },
		},
		{
			name: "builtin llama3", fixture: "chat/llama3.json", tokenizer: llama3TokenizerFile,
			template: func(t *testing.T) Template { return mustTemplate(t, TemplateLlama3) },
			// The Llama 3.0 template in the fixture always appends the assistant header; the
			// built-in honours add_generation_prompt like the later Llama 3 templates.
			skip: map[string]string{"assistant_last_no_prompt": "", "reasoning_last_no_prompt": ""},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var fx chatFixture
			readJSON(t, tt.fixture, &fx)
			tmpl := tt.template(t)
			tok := mustTokenizer(t, tt.tokenizer)
			for i, c := range fx.Cases {
				if _, ok := tt.skip[c.Name]; ok {
					continue
				}
				msgs := fixtureMessages(t, c.Messages)
				got, err := tmpl.Render(msgs, fixtureOptions(t, &fx, i))
				if err != nil {
					t.Errorf("%s: Render: %v", c.Name, err)
					continue
				}
				if got != c.Text {
					t.Errorf("%s: rendered text differs at byte %d\n got  %q\n want %q", c.Name, diffAt(got, c.Text), got, c.Text)
					continue
				}
				if ids := tok.Encode(got); !slices.Equal(ids, c.IDs) {
					t.Errorf("%s: ids of the rendered prompt differ\n got  %v\n want %v", c.Name, ids, c.IDs)
				}
			}
		})
	}
}

func diffAt(a, b string) int {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	return i
}

func mustTemplate(t *testing.T, spec string) Template {
	t.Helper()
	tmpl, err := NewTemplate(spec)
	if err != nil {
		t.Fatalf("NewTemplate(%q): %v", spec, err)
	}
	return tmpl
}

func TestHarmonyRejects(t *testing.T) {
	tests := []struct {
		name string
		msgs []Message
	}{
		{name: "channel tags in content", msgs: []Message{{Role: "user", Content: "x"}, {Role: "assistant", Content: "<|channel|>final<|message|>hi"}}},
		{name: "tool without call", msgs: []Message{{Role: "user", Content: "x"}, {Role: "tool", Content: "{}"}}},
		{name: "content and reasoning with tool call", msgs: []Message{{Role: "assistant", Content: "a", Reasoning: "b",
			ToolCalls: []ToolCall{{Function: ToolCallFunction{Name: "f", Arguments: "{}"}}}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := (harmonyTemplate{}).Render(tt.msgs, RenderOptions{}); err == nil {
				t.Fatal("Render succeeded, want an error")
			}
		})
	}
}

func TestForModel(t *testing.T) {
	tests := []struct {
		model, tok, tmpl string
	}{
		{model: "openai/gpt-oss-20b", tok: O200kHarmony, tmpl: TemplateHarmony},
		{model: "gpt-oss-120b", tok: O200kHarmony, tmpl: TemplateHarmony},
		{model: "Qwen/Qwen3-8B", tok: O200kBase, tmpl: TemplateChatML},
		{model: "meta-llama/Meta-Llama-3-8B-Instruct", tok: Cl100kBase, tmpl: TemplateLlama3},
		{model: "something-else", tok: O200kBase, tmpl: TemplateChatML},
	}
	for _, tt := range tests {
		t.Run(tt.model, func(t *testing.T) {
			tok, tmpl := ForModel(tt.model)
			if tok.Name() != tt.tok || tmpl.Name() != tt.tmpl {
				t.Fatalf("ForModel = %s + %s, want %s + %s", tok.Name(), tmpl.Name(), tt.tok, tt.tmpl)
			}
		})
	}
}

func TestCodecEncodeChat(t *testing.T) {
	c := CodecForModel("openai/gpt-oss-20b")
	msgs := []Message{{Role: "user", Content: "Hello!"}}
	ids, err := c.EncodeChat(msgs, RenderOptions{AddGenerationPrompt: true, Date: "2025-08-05"})
	if err != nil {
		t.Fatal(err)
	}
	// <|start|>system<|message|>… and the generation prompt <|start|>assistant.
	if ids[0] != 200006 || ids[len(ids)-2] != 200006 {
		t.Fatalf("ids = %v, want to start with <|start|> and end with <|start|>assistant", ids)
	}
	text := c.Tokenizer.Decode(ids)
	if !strings.HasSuffix(text, "<|start|>user<|message|>Hello!<|end|><|start|>assistant") {
		t.Fatalf("decoded prompt %q", text)
	}
	if got := c.EncodePrompt("Hello!"); len(got) == 0 {
		t.Fatal("EncodePrompt returned no ids")
	}
}

func TestStrftime(t *testing.T) {
	tests := []struct {
		format, want string
	}{
		{format: "%Y-%m-%d", want: "2025-08-05"},
		{format: "%d %b %Y", want: "05 Aug 2025"},
		{format: "%A, %B %e %%", want: "Tuesday, August  5 %"},
	}
	for _, tt := range tests {
		t.Run(tt.format, func(t *testing.T) {
			if got := strftime("2025-08-05", []jinja.Value{jinja.NewString(tt.format)}); got != tt.want {
				t.Fatalf("strftime(%q) = %q, want %q", tt.format, got, tt.want)
			}
		})
	}
}
