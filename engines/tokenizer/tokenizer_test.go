package tokenizer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"golang.org/x/text/unicode/norm"
)

func TestHarmonySpecialsMatchGptOSS(t *testing.T) {
	var added []struct {
		ID      uint32 `json:"id"`
		Content string `json:"content"`
		Special bool   `json:"special"`
	}
	readJSON(t, "models/gpt-oss/added_tokens.json", &added)
	tok := mustTokenizer(t, O200kHarmony)
	if len(added) != 21 {
		t.Fatalf("gpt-oss has %d added tokens, want 21", len(added))
	}
	for _, a := range added {
		id, ok := tok.SpecialID(a.Content)
		if !ok || id != a.ID {
			t.Errorf("SpecialID(%q) = %d, %v; want %d", a.Content, id, ok, a.ID)
		}
		if got := tok.Encode(a.Content); !slices.Equal(got, []uint32{a.ID}) {
			t.Errorf("Encode(%q) = %v, want [%d]", a.Content, got, a.ID)
		}
		if got := tok.Decode([]uint32{a.ID}); got != a.Content {
			t.Errorf("Decode(%d) = %q, want %q", a.ID, got, a.Content)
		}
	}
	named := map[string]uint32{TokStart: 200006, TokEnd: 200007, TokMessage: 200008, TokChannel: 200005,
		TokReturn: 200002, TokCall: 200012, TokConstrain: 200003, TokStartOfText: 199998, TokEndOfText: 199999}
	for s, want := range named {
		if id, _ := tok.SpecialID(s); id != want {
			t.Errorf("SpecialID(%q) = %d, want %d", s, id, want)
		}
	}
	if tok.VocabSize() != 200019 {
		t.Errorf("VocabSize = %d, want 200019", tok.VocabSize())
	}
}

func TestBuiltinVocabularies(t *testing.T) {
	tests := []struct {
		spec   string
		tokens int
	}{
		{spec: O200kBase, tokens: 199998},
		{spec: O200kHarmony, tokens: 199998},
		{spec: Cl100kBase, tokens: 100256},
	}
	for _, tt := range tests {
		t.Run(tt.spec, func(t *testing.T) {
			tok := mustTokenizer(t, tt.spec).(*bpeTokenizer)
			if n := tok.v.size(); n != tt.tokens {
				t.Fatalf("vocabulary has %d tokens, want %d", n, tt.tokens)
			}
			if tok.Name() != tt.spec {
				t.Fatalf("Name = %q", tok.Name())
			}
		})
	}
}

func TestRoundTrip(t *testing.T) {
	corpus := loadCorpus(t)
	for _, spec := range []string{O200kHarmony, O200kBase, Cl100kBase, qwen3TokenizerFile, llama3TokenizerFile} {
		t.Run(spec, func(t *testing.T) {
			tok := mustTokenizer(t, spec)
			for _, c := range corpus {
				want := c.Text
				if !tok.(*bpeTokenizer).lossless() {
					want = norm.NFC.String(want)
				}
				if got := tok.Decode(tok.Encode(c.Text)); got != want {
					t.Errorf("%s: Decode(Encode) = %q, want %q", c.Name, got, want)
				}
			}
		})
	}
}

func TestNewErrors(t *testing.T) {
	tests := []struct {
		name string
		spec string
	}{
		{name: "unknown builtin", spec: "p50k_base"},
		{name: "missing file", spec: "testdata/nope/tokenizer.json"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := New(tt.spec); err == nil {
				t.Fatal("New succeeded, want an error")
			}
		})
	}
	if _, err := NewTemplate("jinja2-unknown"); err == nil {
		t.Fatal("NewTemplate succeeded for an unknown spec")
	}
}

// tinyTokenizerJSON builds a small byte-level BPE tokenizer.json: the 256 byte tokens, a few
// merges, and added tokens. mergesArray selects the [a, b] merges form.
func tinyTokenizerJSON(pre string, mergesArray bool) string {
	var vocab []string
	id := 0
	for b := range 256 {
		vocab = append(vocab, fmt.Sprintf("%q: %d", string(byteLevelRunes[b]), id))
		id++
	}
	merges := [][2]string{{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"Ġw", "o"}}
	var ms []string
	for _, m := range merges {
		vocab = append(vocab, fmt.Sprintf("%q: %d", m[0]+m[1], id))
		id++
		if mergesArray {
			ms = append(ms, fmt.Sprintf("[%q, %q]", m[0], m[1]))
		} else {
			ms = append(ms, fmt.Sprintf("%q", m[0]+" "+m[1]))
		}
	}
	return fmt.Sprintf(`{"version": "1.0", "added_tokens": [
		{"id": %d, "content": "<|eot|>", "special": true, "lstrip": false, "rstrip": false, "normalized": false, "single_word": false},
		{"id": %d, "content": "<sep>", "special": false, "lstrip": true, "rstrip": true, "normalized": false, "single_word": false}],
	"normalizer": null, "pre_tokenizer": %s,
	"model": {"type": "BPE", "dropout": null, "ignore_merges": false, "vocab": {%s}, "merges": [%s]}}`,
		id, id+1, pre, strings.Join(vocab, ", "), strings.Join(ms, ", "))
}

const (
	preSplitByteLevel = `{"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\s?\\w+|\\s+|[^\\s\\w]+"}, "behavior": "Isolated", "invert": false}, {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}`
	preGPT2ByteLevel  = `{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}`
)

func TestLoadJSON(t *testing.T) {
	tests := []struct {
		name string
		json string
		text string
		want []uint32
	}{
		{name: "string merges, regex split", json: tinyTokenizerJSON(preSplitByteLevel, false), text: "hello world<|eot|>", want: []uint32{259, 261, 'r', 'l', 'd', 262}},
		{name: "array merges, regex split", json: tinyTokenizerJSON(preSplitByteLevel, true), text: "hello world<|eot|>", want: []uint32{259, 261, 'r', 'l', 'd', 262}},
		{name: "gpt2 byte-level regex", json: tinyTokenizerJSON(preGPT2ByteLevel, false), text: "hello wo", want: []uint32{259, 261}},
		{name: "added token with lstrip and rstrip", json: tinyTokenizerJSON(preGPT2ByteLevel, false), text: "hello  <sep>  wo", want: []uint32{259, 263, 'w', 'o'}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tok, err := LoadJSON(tt.name, []byte(tt.json))
			if err != nil {
				t.Fatalf("LoadJSON: %v", err)
			}
			if got := tok.Encode(tt.text); !slices.Equal(got, tt.want) {
				t.Fatalf("Encode(%q) = %v, want %v", tt.text, got, tt.want)
			}
		})
	}
}

func TestLoadJSONUnsupported(t *testing.T) {
	base := tinyTokenizerJSON(preGPT2ByteLevel, false)
	tests := []struct {
		name        string
		json        string
		unsupported bool
	}{
		{name: "not json", json: "{", unsupported: false},
		{name: "wordpiece", json: `{"model": {"type": "WordPiece", "vocab": {"a": 0}}}`, unsupported: true},
		{name: "unigram", json: `{"model": {"type": "Unigram", "vocab": [["a", 0.0]]}}`, unsupported: true},
		{name: "sentencepiece bpe", json: strings.Replace(base, preGPT2ByteLevel, `{"type": "Metaspace", "replacement": "▁"}`, 1), unsupported: true},
		{name: "no pre-tokenizer", json: strings.Replace(base, preGPT2ByteLevel, `null`, 1), unsupported: true},
		{name: "lowercase normalizer", json: strings.Replace(base, `"normalizer": null`, `"normalizer": {"type": "Lowercase"}`, 1), unsupported: true},
		{name: "dropout", json: strings.Replace(base, `"dropout": null`, `"dropout": 0.1`, 1), unsupported: true},
		{name: "merge outside vocab", json: strings.Replace(base, `"h e"`, `"q zz"`, 1), unsupported: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadJSON(tt.name, []byte(tt.json))
			if err == nil {
				t.Fatal("LoadJSON succeeded, want an error")
			}
			if errors.Is(err, ErrUnsupported) != tt.unsupported {
				t.Fatalf("errors.Is(%v, ErrUnsupported) = %v, want %v", err, !tt.unsupported, tt.unsupported)
			}
		})
	}
}

// splitWith returns the pieces a splitter cuts text into.
func splitWith(s splitter, text string) []string {
	var out []string
	for i := 0; i < len(text); {
		j := s.next(text, i)
		out = append(out, text[i:j])
		i = j
	}
	return out
}

func splitRegex(t testing.TB, pattern, text string) []string {
	re, err := newRegexSplitter(pattern)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	prev := 0
	for _, e := range re.splitAll(text, nil) {
		out = append(out, text[prev:e])
		prev = e
	}
	return out
}

var splitterPatterns = []struct {
	name    string
	pattern string
}{
	{name: "o200k", pattern: patternO200k},
	{name: "cl100k", pattern: patternCl100k},
	{name: "qwen2", pattern: patternQwen2},
}

func TestSplittersMatchRegex(t *testing.T) {
	corpus := loadCorpus(t)
	extra := []string{"ʰAʰB c", "Aʰ", "\u0301abc", "x\u0301\u0301Y", "'S'LL'Re", "a'ſ", "  \n  x", "a\u3000\u3000b", "١٢٣٤٥"}
	for _, p := range splitterPatterns {
		t.Run(p.name, func(t *testing.T) {
			s := splitterFor(p.pattern)
			texts := extra
			for _, c := range corpus {
				texts = append(texts, c.Text)
			}
			for _, text := range texts {
				got, want := splitWith(s, text), splitRegex(t, p.pattern, text)
				if !slices.Equal(got, want) {
					t.Errorf("split(%.40q)\n got  %q\n want %q", text, got, want)
				}
			}
		})
	}
}

// TestLongPieces checks the heap-based BPE against the quadratic scan it replaces for long
// pieces.
func TestLongPieces(t *testing.T) {
	o200k := mustTokenizer(t, O200kBase).(*bpeTokenizer)
	qwen := mustTokenizer(t, qwen3TokenizerFile).(*bpeTokenizer)
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "b", "ab", "the", " ", "ing", "é", "中", "0", "x"}
	for i := range 300 {
		var b strings.Builder
		for b.Len() < 1+i%60 {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		piece := b.String()
		if got, want := o200k.v.rankBPEHeap(nil, piece), o200k.v.rankBPE(nil, piece); !slices.Equal(got, want) && len(piece) < smallPiece {
			t.Fatalf("rankBPEHeap(%q) = %v, rankBPE = %v", piece, got, want)
		}
		if got, want := qwen.v.mergeBPEHeap(nil, piece, qwen.merges), qwen.v.mergeBPE(nil, piece, qwen.merges); !slices.Equal(got, want) && len(piece) < smallPiece {
			t.Fatalf("mergeBPEHeap(%q) = %v, mergeBPE = %v", piece, got, want)
		}
	}
}

func TestAppendEncodeAllocs(t *testing.T) {
	for _, spec := range []string{O200kHarmony, Cl100kBase, llama3TokenizerFile} {
		t.Run(spec, func(t *testing.T) {
			tok := mustTokenizer(t, spec)
			text := benchPrompt(t, tok, 1024)
			dst := make([]uint32, 0, 4096)
			dst = tok.AppendEncode(dst[:0], text)
			allocs := testing.AllocsPerRun(20, func() { dst = tok.AppendEncode(dst[:0], text) })
			if allocs != 0 {
				t.Fatalf("AppendEncode allocated %.1f times per run, want 0", allocs)
			}
			if allocs := testing.AllocsPerRun(20, func() { tok.Count(text) }); allocs != 0 {
				t.Fatalf("Count allocated %.1f times per run, want 0", allocs)
			}
		})
	}
}

func TestConcurrentEncode(t *testing.T) {
	tok := mustTokenizer(t, O200kHarmony)
	corpus := loadCorpus(t)
	want := make([][]uint32, len(corpus))
	for i, c := range corpus {
		want[i] = tok.Encode(c.Text)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range 20 {
				i := (g*7 + r) % len(corpus)
				if got := tok.Encode(corpus[i].Text); !slices.Equal(got, want[i]) {
					errs <- corpus[i].Name
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for name := range errs {
		t.Errorf("concurrent Encode of %s differs", name)
	}
}
