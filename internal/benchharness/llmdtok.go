package benchharness

import (
	"hash/fnv"
	"regexp"
	"strings"

	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// llm-d-inference-sim with --force-dummy-tokenizer tokenizes by a regular expression (a
// word, or one punctuation character, with the whitespace after it) and names each piece
// by its FNV-32a hash; a chat renders as "### " + role [+ "(" + tool_call_id + ")"] + ": " +
// content + "[" + name + "(" + arguments + ")]" per tool call + "\n" per message, the
// generation prompt left out (its
// pkg/tokenizer SimpleTokenizer.RenderMessages and api.Message.PlainText). llmdCodec
// reproduces that, so that the ideal cache of a run on llm-d's simulator is counted in the
// tokens that simulator counts (its prompt_tokens and cached_tokens), and the TTFT floor
// from it is in its time.
var llmdTokenRE = regexp.MustCompile(`(\{|\}|:|,|-|\.|\?|\!|;|@|#|\$|%|\^|&|\*|\(|\)|\+|\-|_|~|/|\\|>|<|\[|\]|=|"|'|\w+)(\s*)`)

type llmdTokenizer struct {
	tokenizer.Tokenizer // the rest of the interface (Decode, …), never used by the ideal cache
}

func (llmdTokenizer) Name() string { return "llm-d-inference-sim dummy tokenizer" }

func (llmdTokenizer) AppendEncode(dst []uint32, text string) []uint32 {
	for _, piece := range llmdTokenRE.FindAllString(text, -1) {
		h := fnv.New32a()
		_, _ = h.Write([]byte(piece))
		dst = append(dst, h.Sum32())
	}
	return dst
}

func (t llmdTokenizer) Encode(text string) []uint32 { return t.AppendEncode(nil, text) }

func (llmdTokenizer) Count(text string) int { return len(llmdTokenRE.FindAllStringIndex(text, -1)) }

type llmdTemplate struct{}

func (llmdTemplate) Name() string { return "llm-d-inference-sim dummy render" }

func (llmdTemplate) Render(msgs []tokenizer.Message, _ tokenizer.RenderOptions) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("### ")
		b.WriteString(m.Role)
		if m.ToolCallID != "" {
			b.WriteString("(")
			b.WriteString(m.ToolCallID)
			b.WriteString(")")
		}
		b.WriteString(": ")
		b.WriteString(m.Content)
		for _, tc := range m.ToolCalls {
			if tc.Function.Name != "" {
				b.WriteString("[")
				b.WriteString(tc.Function.Name)
				b.WriteString("(")
				b.WriteString(tc.Function.Arguments)
				b.WriteString(")]")
			}
		}
		b.WriteString("\n")
	}
	return b.String(), nil
}

// newLLMDCodec returns the codec of llm-d-inference-sim's dummy tokenizer; base fills in the
// parts of the tokenizer interface the ideal cache does not use.
func newLLMDCodec(base tokenizer.Tokenizer) *tokenizer.Codec {
	return &tokenizer.Codec{Tokenizer: llmdTokenizer{base}, Template: llmdTemplate{}}
}
