package tokenizer

import (
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// limitTokenizers are the tokenizers AppendEncodeLimit is checked on: plain and behind a
// segment cache, chunked and not.
func limitTokenizers(t testing.TB) map[string]Tokenizer {
	o := mustTokenizer(t, O200kHarmony)
	return map[string]Tokenizer{
		"o200k_harmony":        o,
		"o200k_harmony cached": NewSegmentCache(o, 32, 1<<20),
		"cl100k_base":          mustTokenizer(t, Cl100kBase),
	}
}

func checkLimit(t *testing.T, tok Tokenizer, text string, limit int) {
	t.Helper()
	want := tok.AppendEncode(nil, text)
	got, ok := AppendEncodeLimit(tok, []uint32{7}, text, limit)
	switch {
	case limit <= 0 || len(want) <= limit:
		if !ok || !slices.Equal(got[1:], want) {
			t.Fatalf("%s, limit %d, %d ids: got ok=%v and %d ids, want all", tok.Name(), limit, len(want), ok, len(got)-1)
		}
	case ok:
		t.Fatalf("%s, limit %d: %d ids, yet it reports the text within the limit", tok.Name(), limit, len(want))
	case got[0] != 7:
		t.Fatal("dst's ids were overwritten")
	}
}

// TestAppendEncodeLimit: within the limit the ids are AppendEncode's; past it the text is
// reported too long having encoded not much more than the limit, or none of it when its
// length alone proves it.
func TestAppendEncodeLimit(t *testing.T) {
	var sb strings.Builder
	for i := range 4000 {
		sb.WriteString("word")
		sb.WriteString(strings.Repeat("x", i%7))
		if i%9 == 8 {
			sb.WriteString(".\n")
		} else {
			sb.WriteByte(' ')
		}
		if i%500 == 499 {
			sb.WriteString("<|end|><|start|>user<|message|>")
		}
	}
	text := sb.String()
	for name, tok := range limitTokenizers(t) {
		t.Run(name, func(t *testing.T) {
			n := len(tok.AppendEncode(nil, text))
			for _, limit := range []int{0, 1, 10, n / 3, n - 1, n, n + 1, 10 * n} {
				checkLimit(t, tok, text, limit)
			}
		})
	}
	// A text far past the limit is refused after about limit ids' work.
	tok := mustTokenizer(t, O200kHarmony)
	huge := strings.Repeat(text, 50)
	ids, ok := AppendEncodeLimit(tok, nil, huge, 1000)
	if ok || len(ids) > 1000+4*chunkBytes {
		t.Fatalf("a text of %d bytes against a limit of 1000: ok=%v after %d ids", len(huge), ok, len(ids))
	}
	// One too long by its length alone costs nothing.
	line := strings.Repeat("a", 2<<20)
	if ids, ok := AppendEncodeLimit(tok, nil, line, 1000); ok || len(ids) != 0 {
		t.Fatalf("a 2 MiB line against a limit of 1000: ok=%v after %d ids", ok, len(ids))
	}
}

func FuzzAppendEncodeLimit(f *testing.F) {
	f.Add("hello world\nand more\n<|start|>x", 3)
	f.Add(strings.Repeat("line of text.\n", 300), 100)
	toks := limitTokenizers(f)
	f.Fuzz(func(t *testing.T, text string, limit int) {
		if !utf8.ValidString(text) || limit > 1<<20 {
			return
		}
		for _, tok := range toks {
			checkLimit(t, tok, text, limit)
		}
	})
}
