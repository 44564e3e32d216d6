package sim

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// ChatMessage is an OpenAI chat message reduced to what chat templates read.
type ChatMessage struct {
	Role       string
	Content    string
	Name       string
	ToolCallID string
	// ToolCalls is the raw OpenAI tool_calls array of an assistant message, if any.
	ToolCalls json.RawMessage
	// Reasoning is an assistant message's reasoning text (reasoning_content), if any.
	Reasoning string
}

// ChatOptions are the template switches of a chat request.
type ChatOptions struct {
	AddGenerationPrompt  bool
	ContinueFinalMessage bool
	// Tools is the raw OpenAI tools array, if any.
	Tools           json.RawMessage
	ReasoningEffort string
}

// Codec is a model's chat template and tokenizer: what turns a request into the token ids
// the engine computes, and output ids back into text. Implementations must be safe for
// concurrent use; HTTP handlers call them from their own goroutines.
type Codec interface {
	EncodeChat(msgs []ChatMessage, opts ChatOptions) ([]uint32, error)
	EncodePrompt(text string) []uint32
	Decode(ids []uint32) string
}

// fillerWords are the words simulated output is made of. Each is kept only if, with its
// leading space, the model's tokenizer encodes it as one token that decodes back unchanged,
// so that output text re-tokenizes to exactly the ids the engine generated (a client that
// appends the answer to its next turn then hits the blocks the engine cached).
var fillerWords = []string{
	"the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
	"on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
	"had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
	"been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "river", "stone",
	"cloud", "market", "engine", "garden", "silver", "window", "planet", "music", "forest",
	"signal", "copper", "light", "water",
}

// fillerTokens picks the output vocabulary of a worker: token ids and the text of each.
func fillerTokens(c Codec) (ids []uint32, text map[uint32]string, err error) {
	text = make(map[uint32]string)
	for _, w := range fillerWords {
		piece := " " + w
		toks := c.EncodePrompt(piece)
		if len(toks) != 1 || c.Decode(toks) != piece {
			continue
		}
		if _, dup := text[toks[0]]; dup {
			continue
		}
		ids = append(ids, toks[0])
		text[toks[0]] = piece
	}
	if len(ids) < 4 {
		return nil, nil, fmt.Errorf("choosing output tokens: only %d of %d filler words are single tokens of this tokenizer", len(ids), len(fillerWords))
	}
	return ids, text, nil
}

// NewCodec returns the codec of a served model: the tokenizer and chat template given by spec
// (see tokenizer.New and tokenizer.NewTemplate), each defaulting by model name when empty, so
// that the proxy, given the same specs, computes the same token ids.
func NewCodec(model, tokenizerSpec, templateSpec string) (Codec, error) {
	defTok, defTmpl := tokenizer.ModelSpecs(model)
	if tokenizerSpec == "" {
		tokenizerSpec = defTok
	}
	if templateSpec == "" {
		templateSpec = defTmpl
	}
	c, err := tokenizer.NewCodec(tokenizerSpec, templateSpec)
	if err != nil {
		return nil, fmt.Errorf("loading the codec of %s: %w", model, err)
	}
	return tokenCodec{c}, nil
}

// tokenCodec adapts a tokenizer.Codec to the engine's Codec.
type tokenCodec struct{ c *tokenizer.Codec }

func (t tokenCodec) EncodePrompt(text string) []uint32 { return t.c.EncodePrompt(text) }
func (t tokenCodec) Decode(ids []uint32) string        { return t.c.Tokenizer.Decode(ids) }

func (t tokenCodec) EncodeChat(msgs []ChatMessage, opts ChatOptions) ([]uint32, error) {
	tm := make([]tokenizer.Message, len(msgs))
	for i, m := range msgs {
		tm[i] = tokenizer.Message{Role: m.Role, Content: m.Content, Name: m.Name, ToolCallID: m.ToolCallID, Reasoning: m.Reasoning}
		if len(m.ToolCalls) > 0 && string(m.ToolCalls) != "null" {
			if err := json.Unmarshal(m.ToolCalls, &tm[i].ToolCalls); err != nil {
				return nil, fmt.Errorf("message %d: tool_calls is not an array of tool calls: %w", i, err)
			}
		}
	}
	ro := tokenizer.RenderOptions{AddGenerationPrompt: opts.AddGenerationPrompt, Tools: opts.Tools, ReasoningEffort: opts.ReasoningEffort}
	text, err := t.c.RenderChat(tm, ro)
	if err != nil {
		return nil, err
	}
	if opts.ContinueFinalMessage && len(msgs) > 0 {
		// As vLLM does: the prompt ends where the final message's content ends, so the model
		// continues that message instead of closing it.
		last := msgs[len(msgs)-1].Content
		if i := strings.LastIndex(text, last); last != "" && i >= 0 {
			text = text[:i+len(last)]
		}
	}
	return t.c.Tokenizer.Encode(text), nil
}
