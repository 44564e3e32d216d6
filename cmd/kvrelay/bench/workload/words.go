package workload

import (
	"errors"
	"fmt"
	"math/bits"
	"reflect"
	"slices"
	"strings"
	"sync"
)

// Vocabulary sizes. vocabWords words of 2 to 6 lowercase letters are taken from the
// tokenizer, most frequent (lowest id) first; o200k has about 27,000 such words.
const (
	vocabWords    = 8192
	minVocabWords = 1024
	minWordLen    = 2
	maxWordLen    = 6
	// idWords is how many leading words of a block spell its id (see vocab.appendID).
	idWords = 3
	// vocabScanLimit bounds the ids scanned when a tokenizer does not report its size.
	vocabScanLimit = 1 << 18
)

// ErrTokenizer is returned (wrapped) when a tokenizer cannot give the workloads text of exact
// token lengths: too few single-token words, or words that merge when concatenated.
var ErrTokenizer = errors.New("tokenizer unsuitable for workload text")

// vocab is the alphabet of workload text: words w such that " "+w is a single token, and such
// that any concatenation of them tokenizes to exactly one token per word. The second property
// holds for byte-level BPE with GPT-style pre-tokenization (o200k, cl100k, Llama 3, Qwen2),
// where a space followed by letters always starts a new pre-token, so BPE never merges across
// words; newVocab checks it on the whole list rather than trusting it.
//
// Text made of these words therefore has a known token count, and a block of them tokenizes
// the same whatever text precedes it, as long as that text ends in a letter, a space-free
// punctuation run or a special token.
type vocab struct {
	words []string // " w", space included
	ids   []uint32
}

// n returns the number of words.
func (v *vocab) n() int { return len(v.words) }

// appendWords appends n words drawn from r.
func (v *vocab) appendWords(b []byte, r *rng, n int) []byte {
	for range n {
		b = append(b, v.words[r.intn(len(v.words))]...)
	}
	return b
}

// text returns n words drawn from r.
func (v *vocab) text(r *rng, n int) string {
	return string(v.appendWords(make([]byte, 0, 6*n), r, n))
}

// appendID appends the idWords words that spell id in base n() (least significant digit
// first), at most n words in all. Distinct ids up to maxID spell distinct words, so two blocks
// that start with their ids differ within their first idWords tokens. Each digit goes through
// an odd multiplier modulo the (power-of-two) vocabulary size, a permutation, so that
// neighbouring ids do not read alike.
func (v *vocab) appendID(b []byte, id uint64, n int) []byte {
	base := uint64(len(v.words))
	for i := 0; i < idWords && i < n; i++ {
		d := id % base
		id /= base
		b = append(b, v.words[(d*2654435761+uint64(i)*40503)%base]...)
	}
	return b
}

// maxID is the largest id appendID spells uniquely.
func (v *vocab) maxID() uint64 {
	m := uint64(1)
	for range idWords {
		m *= uint64(len(v.words))
	}
	return m - 1
}

var vocabCache sync.Map // Tokenizer → *vocab, for comparable tokenizer values

// vocabFor returns the vocabulary of tok, built once per (comparable) tokenizer value.
func vocabFor(tok Tokenizer) (*vocab, error) {
	cacheable := reflect.TypeOf(tok).Comparable()
	if cacheable {
		if v, ok := vocabCache.Load(tok); ok {
			return v.(*vocab), nil
		}
	}
	v, err := newVocab(tok)
	if err != nil {
		return nil, err
	}
	if cacheable {
		vocabCache.Store(tok, v)
	}
	return v, nil
}

// newVocab scans tok's vocabulary for single-token words and checks that they concatenate
// token for token.
func newVocab(tok Tokenizer) (*vocab, error) {
	limit := vocabScanLimit
	if s, ok := tok.(interface{ VocabSize() int }); ok {
		limit = s.VocabSize()
	}
	v := &vocab{}
	one := make([]uint32, 1)
	for id := 0; id < limit && len(v.words) < vocabWords; id++ {
		one[0] = uint32(id)
		w := tok.Decode(one)
		if len(w) < 1+minWordLen || len(w) > 1+maxWordLen || w[0] != ' ' || !lowerASCII(w[1:]) {
			continue
		}
		if ids := tok.Encode(w); len(ids) != 1 || ids[0] != uint32(id) {
			continue
		}
		v.words = append(v.words, w)
		v.ids = append(v.ids, uint32(id))
	}
	if len(v.words) < minVocabWords {
		return nil, fmt.Errorf("building workload vocabulary: %w: %d single-token lowercase words, need %d",
			ErrTokenizer, len(v.words), minVocabWords)
	}
	// A power of two, so that appendID's odd multiplier permutes the digits.
	n := 1 << (bits.Len(uint(len(v.words))) - 1)
	v.words, v.ids = v.words[:n], v.ids[:n]
	// Every word once, in two different orders: each must come back as its own token.
	for _, order := range [][]int{identity(len(v.words)), reversed(len(v.words))} {
		var sb strings.Builder
		want := make([]uint32, 0, len(order))
		for _, i := range order {
			sb.WriteString(v.words[i])
			want = append(want, v.ids[i])
		}
		if got := tok.Encode(sb.String()); !slices.Equal(got, want) {
			return nil, fmt.Errorf("building workload vocabulary: %w: concatenated words do not tokenize one token per word",
				ErrTokenizer)
		}
	}
	return v, nil
}

func lowerASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 'a' || s[i] > 'z' {
			return false
		}
	}
	return true
}

func identity(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

func reversed(n int) []int {
	s := identity(n)
	slices.Reverse(s)
	return s
}
