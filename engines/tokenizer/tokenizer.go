package tokenizer

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Tokenizer turns text into token ids and back. Implementations are immutable after
// construction and safe for concurrent use by any number of goroutines.
type Tokenizer interface {
	// Name is the spec the tokenizer was built from ("o200k_harmony", a file path, …).
	Name() string
	// AppendEncode appends the ids of text to dst and returns the extended slice. Special and
	// added tokens written literally in the text (e.g. "<|start|>") are recognised and encoded as
	// their ids, as vLLM does for rendered chat prompts. It allocates nothing when dst has room.
	AppendEncode(dst []uint32, text string) []uint32
	// Encode returns the ids of text in a new slice.
	Encode(text string) []uint32
	// Count returns len(Encode(text)) without keeping the ids.
	Count(text string) int
	// Decode returns the text of ids. Special tokens decode to their literal text; ids outside
	// the vocabulary are skipped. Decoding is byte-exact, so a sequence that ends inside a
	// multi-byte character yields invalid UTF-8.
	Decode(ids []uint32) string
	// AppendDecode appends the bytes of ids to dst, like Decode.
	AppendDecode(dst []byte, ids []uint32) []byte
	// SpecialID returns the id of a special or added token given its text.
	SpecialID(token string) (uint32, bool)
	// VocabSize is one past the largest token id, special tokens included.
	VocabSize() int
}

// ErrUnsupported is returned (wrapped) for tokenizer files this package cannot run, such as
// WordPiece, Unigram or SentencePiece-style BPE models.
var ErrUnsupported = errors.New("unsupported tokenizer")

// New returns the tokenizer named by spec: one of the built-ins "o200k_harmony", "o200k_base"
// and "cl100k_base", or the path of a HuggingFace tokenizer.json (optionally gzip-compressed,
// named *.gz). Built-ins are constructed once per process and shared.
func New(spec string) (Tokenizer, error) {
	if b, ok := builtins[spec]; ok {
		return b.get()
	}
	if strings.HasSuffix(spec, ".json") || strings.HasSuffix(spec, ".gz") || strings.ContainsRune(spec, os.PathSeparator) {
		return LoadFile(spec)
	}
	return nil, fmt.Errorf("creating tokenizer %q: %w: not a built-in (%s) nor a tokenizer.json path",
		spec, ErrUnsupported, strings.Join(BuiltinNames(), ", "))
}

// bpeTokenizer is a byte-level BPE tokenizer: added tokens are cut out first, the rest is
// normalized (optionally), split into pieces by the pre-tokenizer, and each piece is encoded by
// BPE over its bytes.
type bpeTokenizer struct {
	name  string
	v     *vocab
	added *addedMatcher
	// addedIDs maps added tokens' ids to their text for Decode.
	addedText map[uint32]string
	vocabSize int

	// Pre-tokenization: fast is set for the known patterns; otherwise steps run in order.
	fast  splitter
	steps []preStep
	nfc   bool

	// merges is nil for tiktoken vocabularies (rank = id, merge any adjacent pair whose
	// concatenation is a token); otherwise the HuggingFace merge list.
	merges mergeTable
	// ignoreMerges emits a piece found whole in the vocabulary directly (HuggingFace
	// ignore_merges; always true for tiktoken).
	ignoreMerges bool
	self         *selfMemo
	// cache remembers the BPE of short multi-token pieces.
	cache *pieceCache
	// maxBytes bounds the bytes of text one id stands for (maxTokenBytes; 0: unknown).
	maxBytes int
}

// preStep is one pre-tokenizer of a HuggingFace Sequence.
type preStep struct {
	split       splitter
	re          *regexSplitter
	prefixSpace bool // ByteLevel add_prefix_space
}

func (t *bpeTokenizer) Name() string   { return t.name }
func (t *bpeTokenizer) VocabSize() int { return t.vocabSize }

func (t *bpeTokenizer) SpecialID(token string) (uint32, bool) {
	if a, ok := t.added.byContent[token]; ok {
		return a.id, true
	}
	return 0, false
}

func (t *bpeTokenizer) Encode(text string) []uint32 {
	return t.AppendEncode(make([]uint32, 0, len(text)/4+4), text)
}

// countChunk bounds the scratch buffer Count uses per call.
const countChunk = 512

func (t *bpeTokenizer) Count(text string) int {
	var buf [countChunk]uint32
	n := 0
	ids := t.walk(buf[:0], text, &n)
	return n + len(ids)
}

func (t *bpeTokenizer) AppendEncode(dst []uint32, text string) []uint32 {
	return t.walk(dst, text, nil)
}

// walk encodes text into dst. With counted set, it counts instead: ids are added to *counted
// and dropped whenever dst holds half a countChunk.
func (t *bpeTokenizer) walk(dst []uint32, text string, counted *int) []uint32 {
	pos := 0
	for pos < len(text) {
		s, e, tok, ok := t.added.find(text, pos)
		if !ok {
			s, e = len(text), len(text)
		}
		if s > pos {
			dst = t.encodeOrdinary(dst, text[pos:s], counted)
		}
		if ok {
			dst = append(dst, tok.id)
		}
		pos = e
	}
	return dst
}

// drain implements counting mode (see walk).
func drain(dst []uint32, counted *int) []uint32 {
	if counted != nil && len(dst) >= countChunk/2 {
		*counted += len(dst)
		return dst[:0]
	}
	return dst
}

// encodeOrdinary encodes text that holds no added token.
func (t *bpeTokenizer) encodeOrdinary(dst []uint32, text string, counted *int) []uint32 {
	if t.nfc && !isASCII(text) && !norm.NFC.IsNormalString(text) {
		text = norm.NFC.String(text)
	}
	if t.fast != nil {
		for i := 0; i < len(text); {
			j := t.fast.next(text, i)
			dst = drain(t.encodePiece(dst, text[i:j]), counted)
			i = j
		}
		return dst
	}
	return t.runSteps(dst, text, 0, counted)
}

// runSteps applies pre-tokenizer steps[k:] to text and encodes the resulting pieces.
func (t *bpeTokenizer) runSteps(dst []uint32, text string, k int, counted *int) []uint32 {
	if k == len(t.steps) {
		return drain(t.encodePiece(dst, text), counted)
	}
	st := &t.steps[k]
	if st.prefixSpace && text != "" && text[0] != ' ' {
		text = " " + text
	}
	switch {
	case st.split != nil:
		for i := 0; i < len(text); {
			j := st.split.next(text, i)
			dst = t.runSteps(dst, text[i:j], k+1, counted)
			i = j
		}
	case st.re != nil:
		var endsBuf [64]int
		prev := 0
		for _, e := range st.re.splitAll(text, endsBuf[:0]) {
			dst = t.runSteps(dst, text[prev:e], k+1, counted)
			prev = e
		}
	default:
		dst = t.runSteps(dst, text, k+1, counted)
	}
	return dst
}

// encodePiece appends the BPE encoding of one pre-token.
func (t *bpeTokenizer) encodePiece(dst []uint32, piece string) []uint32 {
	if piece == "" {
		return dst
	}
	if id, ok := t.v.ids[piece]; ok {
		if t.ignoreMerges {
			return append(dst, id)
		}
		switch t.self.get(id) {
		case 1:
			return append(dst, id)
		case 0:
			n := len(dst)
			dst = t.v.mergeBPE(dst, piece, t.merges)
			if len(dst) == n+1 && dst[n] == id {
				t.self.set(id, 1)
			} else {
				t.self.set(id, 2)
			}
			return dst
		}
	}
	cacheable := t.cache != nil && len(piece) <= cacheMaxPiece
	if cacheable {
		if out, ok := t.cache.get(dst, piece); ok {
			return out
		}
	}
	n := len(dst)
	if t.merges == nil {
		dst = t.v.rankBPE(dst, piece)
	} else {
		dst = t.v.mergeBPE(dst, piece, t.merges)
	}
	if cacheable {
		t.cache.put(piece, dst[n:])
	}
	return dst
}

func (t *bpeTokenizer) Decode(ids []uint32) string {
	return string(t.AppendDecode(make([]byte, 0, len(ids)*4), ids))
}

func (t *bpeTokenizer) AppendDecode(dst []byte, ids []uint32) []byte {
	for _, id := range ids {
		if s := t.v.token(id); s != "" {
			dst = append(dst, s...)
		} else if s, ok := t.addedText[id]; ok {
			dst = append(dst, s...)
		}
	}
	return dst
}

// isASCII reports whether s is pure ASCII (and so already in every normal form).
func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// lossless reports whether Decode(Encode(s)) == s for every valid UTF-8 s.
func (t *bpeTokenizer) lossless() bool { return !t.nfc }

// validUTF8 is a helper for tests and fuzzers.
func validUTF8(s string) bool { return utf8.ValidString(s) }

var _ Tokenizer = (*bpeTokenizer)(nil)

// newlineSafe reports whether the pre-tokenizer is one of the hand-written splitters (o200k,
// cl100k, Qwen2), for which SegmentCache may cut text at the line breaks cutAfter picks.
func (t *bpeTokenizer) newlineSafe() bool {
	switch t.fast.(type) {
	case o200kSplitter, cl100kSplitter:
		return true
	}
	return false
}
