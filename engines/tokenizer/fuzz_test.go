package tokenizer

import (
	"bytes"
	"slices"
	"testing"
	"unicode/utf8"
)

func addCorpusSeeds(f *testing.F) {
	for _, c := range loadCorpus(f) {
		f.Add(c.Text)
	}
}

// FuzzEncode checks that encoding never panics, that Count agrees with Encode, and that
// Decode(Encode(s)) == s for valid UTF-8 (the built-ins are lossless; invalid UTF-8 survives
// too, byte for byte).
func FuzzEncode(f *testing.F) {
	addCorpusSeeds(f)
	f.Add("\xff\xfe<|start|>\xc3")
	harmony := mustTokenizer(f, O200kHarmony)
	cl100k := mustTokenizer(f, Cl100kBase)
	f.Fuzz(func(t *testing.T, s string) {
		for _, tok := range []Tokenizer{harmony, cl100k} {
			ids := tok.Encode(s)
			if n := tok.Count(s); n != len(ids) {
				t.Fatalf("%s: Count = %d, len(Encode) = %d", tok.Name(), n, len(ids))
			}
			if got := tok.Decode(ids); got != s {
				t.Fatalf("%s: Decode(Encode(%q)) = %q", tok.Name(), s, got)
			}
			for _, id := range ids {
				if int(id) >= tok.VocabSize() {
					t.Fatalf("%s: id %d outside the vocabulary", tok.Name(), id)
				}
			}
		}
	})
}

// FuzzSplitters compares the hand-written pre-tokenizers with the regexes they implement.
func FuzzSplitters(f *testing.F) {
	addCorpusSeeds(f)
	f.Add("ʰAʰB c\u0301'S")
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return // regexp2 reads invalid bytes as U+FFFD runes; offsets then differ
		}
		for _, p := range splitterPatterns {
			got, want := splitWith(splitterFor(p.pattern), s), splitRegex(t, p.pattern, s)
			if !slices.Equal(got, want) {
				t.Fatalf("%s split(%q)\n got  %q\n want %q", p.name, s, got, want)
			}
		}
	})
}

// FuzzBPE compares the heap-based BPE with the scan on pieces short enough for both.
func FuzzBPE(f *testing.F) {
	f.Add("aaaaaaaaab")
	f.Add("supercalifragilistic")
	f.Add("  \n\t  ")
	o200k := mustTokenizer(f, O200kBase).(*bpeTokenizer)
	f.Fuzz(func(t *testing.T, piece string) {
		if piece == "" || len(piece) >= smallPiece {
			return
		}
		if got, want := o200k.v.rankBPEHeap(nil, piece), o200k.v.rankBPE(nil, piece); !slices.Equal(got, want) {
			t.Fatalf("rankBPEHeap(%q) = %v, rankBPE = %v", piece, got, want)
		}
	})
}

// FuzzLoadJSON feeds arbitrary bytes to the tokenizer.json loader and encodes with whatever
// loads.
func FuzzLoadJSON(f *testing.F) {
	f.Add([]byte(tinyTokenizerJSON(preSplitByteLevel, false)), "hello world")
	f.Add([]byte(tinyTokenizerJSON(preGPT2ByteLevel, true)), "<sep> x <|eot|>")
	f.Add([]byte(`{"model": {"type": "BPE", "vocab": {}, "merges": []}}`), "a")
	f.Fuzz(func(t *testing.T, data []byte, text string) {
		if len(text) > 64 || bytes.Contains(data, []byte("{1")) || bytes.Count(data, []byte("*")) > 2 || bytes.Count(data, []byte("+")) > 4 {
			return // keep regex patterns the fuzzer invents from backtracking for seconds
		}
		tok, err := LoadJSON("fuzz", data)
		if err != nil {
			return
		}
		ids := tok.Encode(text)
		_ = tok.Decode(ids)
	})
}

// FuzzTemplates renders random conversations with every template; the ChatML built-in must
// agree with Qwen3's real template, and the Llama 3 built-in with Llama 3's.
func FuzzTemplates(f *testing.F) {
	f.Add("system", "You are helpful.", "user", "Hi <think>x</think>", "assistant", "Hello!\n", true, "")
	f.Add("user", "  padded  ", "assistant", "<think>\nr\n</think>\n\nanswer", "tool", "{\"x\": 1}", false, "plan")
	f.Add("developer", "d", "user", "<|im_start|>", "assistant", "", true, "reason")
	qwen3 := mustTemplateTB(f, "testdata/models/qwen3/tokenizer_config.json")
	llama3 := mustTemplateTB(f, "testdata/models/llama3/tokenizer_config.json")
	roles := map[string]bool{"system": true, "user": true, "assistant": true, "tool": true, "developer": true}
	f.Fuzz(func(t *testing.T, r1, c1, r2, c2, r3, c3 string, addGen bool, reasoning string) {
		msgs := []Message{{Role: r1, Content: c1}, {Role: r2, Content: c2}, {Role: r3, Content: c3, Reasoning: reasoning}}
		opts := RenderOptions{AddGenerationPrompt: addGen, Date: "2025-08-05"}
		for _, tmpl := range []Template{harmonyTemplate{}, chatMLTemplate{}, llama3Template{bos: "<|begin_of_text|>"}, qwen3, llama3} {
			_, _ = tmpl.Render(msgs, opts)
		}
		if !roles[r1] || !roles[r2] || !roles[r3] || !utf8.ValidString(c1+c2+c3+reasoning) {
			return
		}
		got, err1 := chatMLTemplate{}.Render(msgs, opts)
		want, err2 := qwen3.Render(msgs, opts)
		if err1 == nil && err2 == nil && got != want {
			t.Fatalf("chatml built-in differs from Qwen3's template at %d\n got  %q\n want %q", diffAt(got, want), got, want)
		}
		if addGen {
			got, err1 = llama3Template{bos: "<|begin_of_text|>"}.Render(msgs, opts)
			want, err2 = llama3.Render(msgs, opts)
			if err1 == nil && err2 == nil && got != want {
				t.Fatalf("llama3 built-in differs from Llama 3's template\n got  %q\n want %q", got, want)
			}
		}
	})
}

func mustTemplateTB(tb testing.TB, spec string) Template {
	tb.Helper()
	tmpl, err := NewTemplate(spec)
	if err != nil {
		tb.Fatalf("NewTemplate(%q): %v", spec, err)
	}
	return tmpl
}

// FuzzCutAfter checks that every position cutAfter picks is a piece boundary of each pattern
// SegmentCache chunks under, by the reference regexes.
func FuzzCutAfter(f *testing.F) {
	addCorpusSeeds(f)
	f.Add("a\n/b\n c\n\u00a0d\n\u3000e\n!x\n\n\ny\r\nz")
	f.Add("line one.\n<|im_start|>user\nhi<|im_end|>\n  \nend")
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		for _, p := range splitterPatterns {
			bounds := map[int]bool{}
			at := 0
			for _, piece := range splitRegex(t, p.pattern, s) {
				at += len(piece)
				bounds[at] = true
			}
			for from := 1; from <= len(s); from++ {
				if c := cutAfter(s, from); c < len(s) && !bounds[c] {
					t.Fatalf("%s: cutAfter(%q, %d) = %d, inside a piece", p.name, s, from, c)
				}
			}
		}
	})
}
