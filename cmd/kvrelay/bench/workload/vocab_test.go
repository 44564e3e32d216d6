package workload

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// TestVocab checks the claims workload text rests on, with the real gpt-oss tokenizer: every
// word is one token and round-trips; and a run of words tokenizes to one token per word
// whatever precedes it, so a block's tokens never depend on the text before it.
func TestVocab(t *testing.T) {
	tok := testTokenizer(t)
	v, err := vocabFor(tok)
	if err != nil {
		t.Fatal(err)
	}
	if v.n() != vocabWords {
		t.Errorf("%d words, want %d", v.n(), vocabWords)
	}
	for i, w := range v.words {
		if ids := tok.Encode(w); len(ids) != 1 || ids[0] != v.ids[i] || tok.Decode(ids) != w {
			t.Fatalf("word %q: ids %v, want [%d]", w, ids, v.ids[i])
		}
	}
	block := v.text(newRNG(1, 2), 512)
	want := tok.Encode(block)
	if len(want) != 512 {
		t.Fatalf("512 words give %d tokens", len(want))
	}
	for _, tc := range []struct{ name, prefix string }{
		{"nothing", ""},
		{"a word", " ready"},
		{"a letter run", "abc"},
		{"punctuation", "end."},
		{"a newline", "line\n"},
		{"a special token", "<|start|>user<|message|>"},
		{"another block", v.text(newRNG(3, 4), 100)},
		{"a digit", "x1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ids := tok.Encode(tc.prefix + block)
			if got := ids[len(ids)-len(want):]; !slices.Equal(got, want) {
				t.Errorf("block tokens change after %q", tc.prefix)
			}
			if len(ids) != len(tok.Encode(tc.prefix))+len(want) {
				t.Errorf("after %q: %d tokens, want %d + %d", tc.prefix, len(ids), len(tok.Encode(tc.prefix)), len(want))
			}
		})
	}
}

func TestAppendID(t *testing.T) {
	v, err := vocabFor(testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]uint64{}
	for _, id := range []uint64{0, 1, 2, 8191, 8192, 8193, 1 << 26, 1<<26 + 1, v.maxID(), 182789} {
		s := string(v.appendID(nil, id, idWords))
		if old, ok := seen[s]; ok {
			t.Errorf("ids %d and %d spell %q", old, id, s)
		}
		seen[s] = id
		if n := strings.Count(s, " "); n != idWords {
			t.Errorf("id %d: %d words", id, n)
		}
	}
	if got := string(v.appendID(nil, 5, 1)); strings.Count(got, " ") != 1 {
		t.Errorf("a one-token block spells %q", got)
	}
}

// byteTokenizer has one token per byte: no multi-letter word is a single token.
type byteTokenizer struct{}

func (byteTokenizer) Encode(s string) []uint32 {
	ids := make([]uint32, len(s))
	for i := range ids {
		ids[i] = uint32(s[i])
	}
	return ids
}

func (byteTokenizer) Decode(ids []uint32) string {
	b := make([]byte, 0, len(ids))
	for _, id := range ids {
		if id < 256 {
			b = append(b, byte(id))
		}
	}
	return string(b)
}

// mergingTokenizer claims every word as one token but merges any two adjacent ones.
type mergingTokenizer struct{ words []string }

func (m mergingTokenizer) Encode(s string) []uint32 {
	if i := slices.Index(m.words, s); i >= 0 {
		return []uint32{uint32(i)}
	}
	return []uint32{0}
}

func (m mergingTokenizer) Decode(ids []uint32) string {
	if len(ids) == 1 && int(ids[0]) < len(m.words) {
		return m.words[ids[0]]
	}
	return ""
}

func TestVocabUnsuitableTokenizer(t *testing.T) {
	words := make([]string, 2048)
	for i := range words {
		words[i] = " " + string(rune('a'+i%26)) + string(rune('a'+i/26%26)) + string(rune('a'+i/676))
	}
	for _, tc := range []struct {
		name string
		tok  Tokenizer
		want string
	}{
		{"no single-token words", byteTokenizer{}, "single-token lowercase words"},
		{"words merge", mergingTokenizer{words}, "one token per word"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse("prefix-groups", 1, tc.tok)
			if !errors.Is(err, ErrTokenizer) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want ErrTokenizer mentioning %q", err, tc.want)
			}
		})
	}
}

func TestExactText(t *testing.T) {
	tok := testTokenizer(t)
	v, _ := vocabFor(tok)
	for _, tc := range []struct {
		name, prefix string
		n            int
	}{
		{"words only", "", 10},
		{"header", "read_file result:\n", 40},
		{"header longer than n", preambleHeader(), 20},
		{"header of zero tokens", "x", 0},
		{"json header", `{"a": [1, 2]}`, 30},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := exactText(tok, v, newRNG(1), tc.prefix, tc.n)
			if err != nil {
				t.Fatal(err)
			}
			if got := len(tok.Encode(s)); got != tc.n {
				t.Errorf("%d tokens, want %d", got, tc.n)
			}
		})
	}
}
