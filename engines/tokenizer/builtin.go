package tokenizer

import (
	"fmt"
	"sort"
	"sync"

	"github.com/tiktoken-go/tokenizer/codec"
)

// Built-in tokenizer names.
const (
	O200kHarmony = "o200k_harmony"
	O200kBase    = "o200k_base"
	Cl100kBase   = "cl100k_base"
)

// builtin constructs one built-in tokenizer on first use and shares it afterwards.
type builtin struct {
	once  sync.Once
	build func() (*bpeTokenizer, error)
	tok   *bpeTokenizer
	err   error
}

func (b *builtin) get() (Tokenizer, error) {
	b.once.Do(func() { b.tok, b.err = b.build() })
	if b.err != nil {
		return nil, b.err
	}
	return b.tok, nil
}

// builtins is the fixed table of built-in tokenizers. The vocabularies are the ones embedded by
// github.com/tiktoken-go/tokenizer; this package runs its own pre-tokenizer and BPE over them
// (several times faster than the regexp2-based codec, with the same ids).
var builtins = map[string]*builtin{
	O200kBase:    {build: func() (*bpeTokenizer, error) { return buildTiktoken(O200kBase, o200kSpecials(false)) }},
	O200kHarmony: {build: func() (*bpeTokenizer, error) { return buildTiktoken(O200kHarmony, o200kSpecials(true)) }},
	Cl100kBase:   {build: func() (*bpeTokenizer, error) { return buildTiktoken(Cl100kBase, cl100kSpecials()) }},
}

// BuiltinNames lists the built-in tokenizer specs.
func BuiltinNames() []string {
	names := make([]string, 0, len(builtins))
	for n := range builtins {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Harmony special tokens of gpt-oss (o200k_harmony), as listed in the added_tokens of the
// gpt-oss tokenizer.json.
const (
	TokStartOfText = "<|startoftext|>" // 199998
	TokEndOfText   = "<|endoftext|>"   // 199999
	TokReturn      = "<|return|>"      // 200002
	TokConstrain   = "<|constrain|>"   // 200003
	TokChannel     = "<|channel|>"     // 200005
	TokStart       = "<|start|>"       // 200006
	TokEnd         = "<|end|>"         // 200007
	TokMessage     = "<|message|>"     // 200008
	TokCall        = "<|call|>"        // 200012
	TokEndOfPrompt = "<|endofprompt|>" // 200018
)

func o200kSpecials(harmony bool) []addedToken {
	if !harmony {
		return []addedToken{
			{content: TokEndOfText, id: 199999, special: true},
			{content: TokEndOfPrompt, id: 200018, special: true},
		}
	}
	named := map[uint32]string{
		199998: TokStartOfText, 199999: TokEndOfText, 200002: TokReturn, 200003: TokConstrain,
		200005: TokChannel, 200006: TokStart, 200007: TokEnd, 200008: TokMessage,
		200012: TokCall, 200018: TokEndOfPrompt,
	}
	var out []addedToken
	for id := uint32(199998); id <= 200018; id++ {
		s, ok := named[id]
		if !ok {
			s = fmt.Sprintf("<|reserved_%d|>", id)
		}
		out = append(out, addedToken{content: s, id: id, special: true})
	}
	return out
}

func cl100kSpecials() []addedToken {
	return []addedToken{
		{content: "<|endoftext|>", id: 100257, special: true},
		{content: "<|fim_prefix|>", id: 100258, special: true},
		{content: "<|fim_middle|>", id: 100259, special: true},
		{content: "<|fim_suffix|>", id: 100260, special: true},
		{content: "<|endofprompt|>", id: 100276, special: true},
	}
}

// buildTiktoken reads a tiktoken vocabulary out of the tiktoken-go codec (token by token through
// its Decode) into this package's arena and rank map.
func buildTiktoken(name string, specials []addedToken) (*bpeTokenizer, error) {
	var c *codec.Codec
	var split splitter
	switch name {
	case O200kBase, O200kHarmony:
		c, split = codec.NewO200kBase(), o200kSplitter{}
	case Cl100kBase:
		c, split = codec.NewCl100kBase(), cl100kSplitter{digits: 3}
	default:
		return nil, fmt.Errorf("building tokenizer %q: %w", name, ErrUnsupported)
	}
	var tokens []string
	one := make([]uint, 1)
	for id := 0; ; id++ {
		one[0] = uint(id)
		s, err := c.Decode(one)
		if err != nil || s == "" {
			break
		}
		tokens = append(tokens, s)
	}
	if len(tokens) < 1000 {
		return nil, fmt.Errorf("building tokenizer %q: vocabulary has only %d tokens", name, len(tokens))
	}
	v := newVocab(tokens)
	if !v.complete() {
		return nil, fmt.Errorf("building tokenizer %q: vocabulary lacks single-byte tokens", name)
	}
	t := &bpeTokenizer{
		name:         name,
		v:            v,
		added:        newAddedMatcher(specials),
		addedText:    map[uint32]string{},
		fast:         split,
		ignoreMerges: true,
		vocabSize:    v.size(),
		cache:        newPieceCache(),
	}
	for _, s := range specials {
		t.addedText[s.id] = s.content
		t.vocabSize = max(t.vocabSize, int(s.id)+1)
	}
	t.maxBytes = longestToken(t) // tiktoken: no normaliser, specials match their text exactly
	return t, nil
}
