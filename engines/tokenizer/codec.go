package tokenizer

import (
	"fmt"
	"strings"
)

// ForModel returns the default tokenizer and chat template for a served model name:
//
//   - gpt-oss-* (any org prefix, e.g. "openai/gpt-oss-20b"): o200k_harmony + harmony
//   - qwen*: ChatML (Qwen3 layout), counted with o200k_base as an approximation
//   - *llama-3* / *llama3*: Llama 3 layout, counted with cl100k_base as an approximation
//   - anything else: ChatML with o200k_base
//
// Only gpt-oss gets exact ids from the built-ins; for other families load the model's
// tokenizer.json and tokenizer_config.json with New and NewTemplate (see NewCodec).
func ForModel(model string) (Tokenizer, Template) {
	tokSpec, tmplSpec := ModelSpecs(model)
	tok, err := New(tokSpec)
	if err != nil {
		// Built-ins only fail if the embedded vocabulary is broken, which tests rule out.
		panic(fmt.Sprintf("tokenizer: built-in %s: %v", tokSpec, err))
	}
	return tok, builtinTemplates[tmplSpec]
}

// ModelSpecs returns the built-in tokenizer and template specs ForModel uses for model.
func ModelSpecs(model string) (tokenizer, template string) {
	m := strings.ToLower(model)
	if i := strings.LastIndexByte(m, '/'); i >= 0 {
		m = m[i+1:]
	}
	switch {
	case strings.HasPrefix(m, "gpt-oss"):
		return O200kHarmony, TemplateHarmony
	case strings.HasPrefix(m, "qwen"):
		return O200kBase, TemplateChatML
	case strings.Contains(m, "llama-3") || strings.Contains(m, "llama3"):
		return Cl100kBase, TemplateLlama3
	}
	return O200kBase, TemplateChatML
}

// Codec pairs a tokenizer with a chat template: the one pipeline both the proxy and the
// simulated engine run, so that they agree on every request's token ids. A Codec is immutable
// and safe for concurrent use.
type Codec struct {
	Tokenizer Tokenizer
	Template  Template
}

// NewCodec builds a codec from a tokenizer spec and a template spec (see New and NewTemplate).
func NewCodec(tokenizerSpec, templateSpec string) (*Codec, error) {
	tok, err := New(tokenizerSpec)
	if err != nil {
		return nil, fmt.Errorf("creating codec: %w", err)
	}
	tmpl, err := NewTemplate(templateSpec)
	if err != nil {
		return nil, fmt.Errorf("creating codec: %w", err)
	}
	return &Codec{Tokenizer: tok, Template: tmpl}, nil
}

// CodecForModel returns the codec of ForModel's defaults.
func CodecForModel(model string) *Codec {
	tok, tmpl := ForModel(model)
	return &Codec{Tokenizer: tok, Template: tmpl}
}

// RenderChat renders msgs to prompt text.
func (c *Codec) RenderChat(msgs []Message, opts RenderOptions) (string, error) {
	return c.Template.Render(msgs, opts)
}

// EncodeChat renders msgs and returns the prompt's token ids.
func (c *Codec) EncodeChat(msgs []Message, opts RenderOptions) ([]uint32, error) {
	return c.AppendEncodeChat(nil, msgs, opts)
}

// AppendEncodeChat renders msgs and appends the prompt's token ids to dst.
func (c *Codec) AppendEncodeChat(dst []uint32, msgs []Message, opts RenderOptions) ([]uint32, error) {
	text, err := c.Template.Render(msgs, opts)
	if err != nil {
		return dst, err
	}
	return c.Tokenizer.AppendEncode(dst, text), nil
}

// EncodePrompt returns the ids of a plain completion prompt.
func (c *Codec) EncodePrompt(prompt string) []uint32 {
	return c.Tokenizer.Encode(prompt)
}
