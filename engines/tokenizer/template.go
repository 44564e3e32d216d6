package tokenizer

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"time"
)

// Message is one OpenAI chat message as a chat template sees it.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
	// Name is the optional participant name (or, on tool messages, the function name).
	Name string `json:"name,omitempty"`
	// ToolCalls are an assistant's function calls.
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
	// ToolCallID links a tool message to the call it answers.
	ToolCallID string `json:"tool_call_id,omitempty"`
	// Reasoning is an assistant's chain of thought: reasoning_content for Qwen3-style templates,
	// thinking for gpt-oss. Templates receive it under both names.
	Reasoning string `json:"reasoning_content,omitempty"`
}

// ToolCall is one function call of an assistant message.
type ToolCall struct {
	ID       string           `json:"id,omitempty"`
	Type     string           `json:"type,omitempty"`
	Function ToolCallFunction `json:"function"`
}

// ToolCallFunction names the function and carries its arguments as the raw JSON text an
// OpenAI client sends. Templates see the arguments decoded into an object, as vLLM passes them.
type ToolCallFunction struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// RenderOptions are the per-request inputs of a chat template besides the messages.
type RenderOptions struct {
	// AddGenerationPrompt ends the prompt with the header of an assistant turn.
	AddGenerationPrompt bool
	// Tools is the request's raw OpenAI "tools" array, or nil.
	Tools json.RawMessage
	// ReasoningEffort is gpt-oss's "low" | "medium" | "high" (harmony default "medium").
	ReasoningEffort string
	// EnableThinking, when set to false, asks Qwen3-style templates for a non-thinking answer.
	EnableThinking *bool
	// ModelIdentity replaces harmony's default first system line.
	ModelIdentity string
	// BuiltinTools lists harmony's built-in tools ("browser", "python").
	BuiltinTools []string
	// Date is the current date (YYYY-MM-DD) that templates print; empty means today, local time,
	// as strftime_now does in HuggingFace transformers.
	Date string
	// Kwargs are further chat_template_kwargs for Jinja templates, as decoded JSON values.
	Kwargs map[string]any
}

func (o *RenderOptions) date() string {
	if o.Date != "" {
		return o.Date
	}
	return today()
}

// todayCache holds the formatted current date and the day it is for, so that rendering every
// request does not format (and allocate) a date each time.
var todayCache atomic.Pointer[dayString]

type dayString struct {
	year int
	yday int
	s    string
}

func today() string {
	now := time.Now()
	y, d := now.Year(), now.YearDay()
	if c := todayCache.Load(); c != nil && c.year == y && c.yday == d {
		return c.s
	}
	c := &dayString{year: y, yday: d, s: now.Format("2006-01-02")}
	todayCache.Store(c)
	return c.s
}

// Template renders chat messages into prompt text. Implementations are immutable after
// construction and safe for concurrent use.
type Template interface {
	// Name is the spec the template was built from.
	Name() string
	// Render returns the prompt text for msgs.
	Render(msgs []Message, opts RenderOptions) (string, error)
}

// AppendRenderer is a Template that can render into a caller's buffer, so that a caller
// rendering every request (the proxy) allocates nothing per prompt. The built-in templates
// implement it.
type AppendRenderer interface {
	AppendRender(dst []byte, msgs []Message, opts RenderOptions) ([]byte, error)
}

// Built-in template names.
const (
	TemplateHarmony = "harmony"
	TemplateChatML  = "chatml"
	TemplateLlama3  = "llama3"
)

var builtinTemplates = map[string]Template{
	TemplateHarmony: harmonyTemplate{},
	TemplateChatML:  chatMLTemplate{},
	TemplateLlama3:  llama3Template{bos: "<|begin_of_text|>"},
}

// BuiltinTemplateNames lists the built-in template specs.
func BuiltinTemplateNames() []string {
	names := make([]string, 0, len(builtinTemplates))
	for n := range builtinTemplates {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// NewTemplate returns the template named by spec: a built-in ("harmony", "chatml", "llama3"),
// the path of a tokenizer_config.json (its chat_template and special tokens), or the path of a
// .jinja file (special tokens then come from a tokenizer_config.json in the same folder, if any).
func NewTemplate(spec string) (Template, error) {
	if t, ok := builtinTemplates[spec]; ok {
		return t, nil
	}
	switch {
	case strings.HasSuffix(spec, ".json"):
		data, err := os.ReadFile(spec)
		if err != nil {
			return nil, fmt.Errorf("loading chat template: %w", err)
		}
		return ParseTokenizerConfig(spec, data)
	case strings.HasSuffix(spec, ".jinja") || strings.HasSuffix(spec, ".j2"):
		src, err := os.ReadFile(spec)
		if err != nil {
			return nil, fmt.Errorf("loading chat template: %w", err)
		}
		var cfg tokenizerConfig
		if data, err := os.ReadFile(filepath.Join(filepath.Dir(spec), "tokenizer_config.json")); err == nil {
			_ = json.Unmarshal(data, &cfg) // special tokens are a convenience here
		}
		return NewJinjaTemplate(spec, string(src), cfg.specialTokens())
	}
	return nil, fmt.Errorf("creating chat template %q: not a built-in (%s), tokenizer_config.json or .jinja path",
		spec, strings.Join(BuiltinTemplateNames(), ", "))
}

// tokenizerConfig is the part of tokenizer_config.json templates need.
type tokenizerConfig struct {
	ChatTemplate json.RawMessage `json:"chat_template"`
	BOS          json.RawMessage `json:"bos_token"`
	EOS          json.RawMessage `json:"eos_token"`
	PAD          json.RawMessage `json:"pad_token"`
	UNK          json.RawMessage `json:"unk_token"`
}

// tokenText reads a special token written either as a string or as an AddedToken object.
func tokenText(raw json.RawMessage) (string, bool) {
	if isNull(raw) {
		return "", false
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, true
	}
	var obj struct {
		Content string `json:"content"`
	}
	if json.Unmarshal(raw, &obj) == nil {
		return obj.Content, true
	}
	return "", false
}

func (c *tokenizerConfig) specialTokens() map[string]string {
	out := map[string]string{}
	for name, raw := range map[string]json.RawMessage{"bos_token": c.BOS, "eos_token": c.EOS, "pad_token": c.PAD, "unk_token": c.UNK} {
		if s, ok := tokenText(raw); ok {
			out[name] = s
		}
	}
	return out
}

// ParseTokenizerConfig builds a Jinja template from the contents of a tokenizer_config.json.
// chat_template may be a string or a list of named templates (the one named "default" is used).
func ParseTokenizerConfig(name string, data []byte) (Template, error) {
	var cfg tokenizerConfig
	if err := json.Unmarshal(data, &cfg); err != nil {
		return nil, fmt.Errorf("parsing tokenizer_config.json %s: %w", name, err)
	}
	if isNull(cfg.ChatTemplate) {
		return nil, fmt.Errorf("loading chat template from %s: no chat_template", name)
	}
	var src string
	if err := json.Unmarshal(cfg.ChatTemplate, &src); err != nil {
		var named []struct {
			Name     string `json:"name"`
			Template string `json:"template"`
		}
		if err := json.Unmarshal(cfg.ChatTemplate, &named); err != nil {
			return nil, fmt.Errorf("parsing chat_template of %s: %w", name, err)
		}
		for _, n := range named {
			if n.Name == "default" {
				src = n.Template
			}
		}
		if src == "" {
			return nil, fmt.Errorf("loading chat template from %s: no template named \"default\"", name)
		}
	}
	return NewJinjaTemplate(name, src, cfg.specialTokens())
}
