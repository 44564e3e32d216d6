package tokenizer

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
)

// LoadFile reads a HuggingFace tokenizer.json (gzip-compressed when the name ends in .gz) and
// returns its tokenizer, named after the path.
func LoadFile(path string) (Tokenizer, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("loading tokenizer: %w", err)
	}
	defer f.Close()
	var r io.Reader = f
	if strings.HasSuffix(path, ".gz") {
		zr, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("loading tokenizer %s: %w", path, err)
		}
		defer zr.Close()
		r = zr
	}
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("loading tokenizer %s: %w", path, err)
	}
	tok, err := LoadJSON(path, data)
	if err != nil {
		return nil, err
	}
	return tok, nil
}

// hfFile is the part of tokenizer.json this package reads.
type hfFile struct {
	AddedTokens []struct {
		ID         uint32 `json:"id"`
		Content    string `json:"content"`
		SingleWord bool   `json:"single_word"`
		LStrip     bool   `json:"lstrip"`
		RStrip     bool   `json:"rstrip"`
		Normalized bool   `json:"normalized"`
		Special    bool   `json:"special"`
	} `json:"added_tokens"`
	Normalizer   json.RawMessage `json:"normalizer"`
	PreTokenizer json.RawMessage `json:"pre_tokenizer"`
	Model        struct {
		Type         string          `json:"type"`
		Vocab        json.RawMessage `json:"vocab"`
		Merges       json.RawMessage `json:"merges"`
		IgnoreMerges bool            `json:"ignore_merges"`
		ByteFallback bool            `json:"byte_fallback"`
		Dropout      *float64        `json:"dropout"`
		Prefix       *string         `json:"continuing_subword_prefix"`
		Suffix       *string         `json:"end_of_word_suffix"`
	} `json:"model"`
}

// hfComponent is a normalizer or pre-tokenizer object.
type hfComponent struct {
	Type           string          `json:"type"`
	Normalizers    json.RawMessage `json:"normalizers"`
	Pretokenizers  json.RawMessage `json:"pretokenizers"`
	Pattern        json.RawMessage `json:"pattern"`
	Behavior       string          `json:"behavior"`
	Invert         bool            `json:"invert"`
	AddPrefixSpace bool            `json:"add_prefix_space"`
	UseRegex       *bool           `json:"use_regex"`
}

// LoadJSON builds a tokenizer from the contents of a HuggingFace tokenizer.json. Supported:
// byte-level BPE models (GPT-2 lineage: gpt-oss, Qwen2/2.5/3, Llama 3, DeepSeek) — model type
// "BPE" with merges in either the "a b" or the ["a", "b"] form, an optional NFC
// normalizer, a ByteLevel pre-tokenizer alone or after Split steps (regex or literal patterns,
// "Isolated" behaviour), and added tokens. The post-processor is ignored: BOS/EOS tokens come
// from chat templates, as in vLLM's chat path. Anything else fails with ErrUnsupported.
func LoadJSON(name string, data []byte) (Tokenizer, error) {
	var f hfFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("parsing tokenizer.json %s: %w", name, err)
	}
	m := &f.Model
	if m.Type == "" && !isNull(m.Vocab) && !isNull(m.Merges) {
		m.Type = "BPE" // old files omit the type
	}
	if m.Type != "BPE" {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w: model type %q (only byte-level BPE is supported)", name, ErrUnsupported, m.Type)
	}
	if m.Dropout != nil && *m.Dropout > 0 {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w: BPE dropout", name, ErrUnsupported)
	}
	if (m.Prefix != nil && *m.Prefix != "") || (m.Suffix != nil && *m.Suffix != "") {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w: continuing_subword_prefix/end_of_word_suffix", name, ErrUnsupported)
	}

	t := &bpeTokenizer{name: name, addedText: map[uint32]string{}, ignoreMerges: m.IgnoreMerges}
	if err := t.setNormalizer(f.Normalizer); err != nil {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w", name, err)
	}
	byteLevel, err := t.setPreTokenizer(f.PreTokenizer)
	if err != nil {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w", name, err)
	}
	if !byteLevel {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w: no ByteLevel pre-tokenizer (SentencePiece-style BPE)", name, ErrUnsupported)
	}

	// Vocabulary: byte-level token strings back to bytes.
	var vocabMap map[string]uint32
	if err := json.Unmarshal(m.Vocab, &vocabMap); err != nil {
		return nil, fmt.Errorf("parsing tokenizer.json %s: vocab: %w", name, err)
	}
	maxID := -1
	for _, id := range vocabMap {
		maxID = max(maxID, int(id))
	}
	// Ids are dense in real files; a sparse one would only waste memory on the id index.
	if maxID < 0 || maxID >= 2*len(vocabMap)+4096 {
		return nil, fmt.Errorf("loading tokenizer.json %s: %d tokens with ids up to %d", name, len(vocabMap), maxID)
	}
	tokens := make([]string, maxID+1)
	for s, id := range vocabMap {
		b, ok := fromByteLevel(s)
		if !ok {
			return nil, fmt.Errorf("loading tokenizer.json %s: %w: token %q is not byte-level", name, ErrUnsupported, s)
		}
		tokens[id] = b
	}
	t.v = newVocab(tokens)
	if !t.v.complete() {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w: vocabulary lacks single-byte tokens", name, ErrUnsupported)
	}
	t.vocabSize = t.v.size()

	merges, err := parseMerges(m.Merges)
	if err != nil {
		return nil, fmt.Errorf("loading tokenizer.json %s: %w", name, err)
	}
	t.merges = make(mergeTable, len(merges))
	for rank, mg := range merges {
		a, aok := vocabMap[mg[0]]
		b, bok := vocabMap[mg[1]]
		c, cok := vocabMap[mg[0]+mg[1]]
		if !aok || !bok || !cok {
			return nil, fmt.Errorf("loading tokenizer.json %s: merge %d (%q %q) uses tokens outside the vocabulary", name, rank, mg[0], mg[1])
		}
		k := pairKey(a, b)
		if _, dup := t.merges[k]; !dup {
			t.merges[k] = uint64(rank)<<32 | uint64(c)
		}
	}
	t.self = newSelfMemo(t.v.size())
	t.cache = newPieceCache()

	added := make([]addedToken, 0, len(f.AddedTokens))
	for _, a := range f.AddedTokens {
		added = append(added, addedToken{
			content: a.Content, id: a.ID, special: a.Special,
			lstrip: a.LStrip, rstrip: a.RStrip, singleWord: a.SingleWord,
		})
		t.addedText[a.ID] = a.Content
		t.vocabSize = max(t.vocabSize, int(a.ID)+1)
	}
	t.added = newAddedMatcher(added)
	return t, nil
}

func (t *bpeTokenizer) setNormalizer(raw json.RawMessage) error {
	if isNull(raw) {
		return nil
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return fmt.Errorf("parsing normalizer: %w", err)
	}
	switch c.Type {
	case "NFC":
		t.nfc = true
		return nil
	case "Sequence":
		var list []json.RawMessage
		if err := json.Unmarshal(c.Normalizers, &list); err != nil {
			return fmt.Errorf("parsing normalizer sequence: %w", err)
		}
		for _, n := range list {
			if err := t.setNormalizer(n); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("%w: normalizer %q", ErrUnsupported, c.Type)
}

// setPreTokenizer installs the pre-tokenizer and reports whether it is byte-level.
func (t *bpeTokenizer) setPreTokenizer(raw json.RawMessage) (bool, error) {
	if isNull(raw) {
		return false, nil
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return false, fmt.Errorf("parsing pre_tokenizer: %w", err)
	}
	var list []hfComponent
	if c.Type == "Sequence" {
		if err := json.Unmarshal(c.Pretokenizers, &list); err != nil {
			return false, fmt.Errorf("parsing pre_tokenizer sequence: %w", err)
		}
	} else {
		list = []hfComponent{c}
	}
	byteLevel := false
	for _, p := range list {
		switch p.Type {
		case "Split":
			if p.Invert {
				return false, fmt.Errorf("%w: inverted Split pre-tokenizer", ErrUnsupported)
			}
			if p.Behavior != "Isolated" {
				return false, fmt.Errorf("%w: Split behaviour %q", ErrUnsupported, p.Behavior)
			}
			var pat struct {
				Regex  *string `json:"Regex"`
				String *string `json:"String"`
			}
			if err := json.Unmarshal(p.Pattern, &pat); err != nil {
				return false, fmt.Errorf("parsing Split pattern: %w", err)
			}
			var expr string
			switch {
			case pat.Regex != nil:
				expr = *pat.Regex
			case pat.String != nil && *pat.String != "":
				expr = regexpQuote(*pat.String)
			default:
				return false, fmt.Errorf("%w: Split without a pattern", ErrUnsupported)
			}
			st, err := stepFor(expr)
			if err != nil {
				return false, err
			}
			t.steps = append(t.steps, st)
		case "ByteLevel":
			byteLevel = true
			st := preStep{prefixSpace: p.AddPrefixSpace}
			if p.UseRegex == nil || *p.UseRegex {
				re, err := newRegexSplitter(patternGPT2)
				if err != nil {
					return false, err
				}
				st.re = re
			}
			t.steps = append(t.steps, st)
		default:
			return false, fmt.Errorf("%w: pre-tokenizer %q", ErrUnsupported, p.Type)
		}
	}
	// The common shape, Split(known pattern) then a plain ByteLevel, runs on the fast path.
	if len(t.steps) == 2 && t.steps[0].split != nil && t.steps[1].split == nil && t.steps[1].re == nil && !t.steps[1].prefixSpace {
		t.fast = t.steps[0].split
		t.steps = nil
	}
	return byteLevel, nil
}

func stepFor(expr string) (preStep, error) {
	if s := splitterFor(expr); s != nil {
		return preStep{split: s}, nil
	}
	re, err := newRegexSplitter(expr)
	if err != nil {
		return preStep{}, fmt.Errorf("%w: %w", ErrUnsupported, err)
	}
	return preStep{re: re}, nil
}

func regexpQuote(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`\.+*?()|[]{}^$#&-~ `, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

// parseMerges reads merges in either the "a b" string form or the ["a", "b"] pair form.
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return nil, nil
	}
	if len(raw) < 2 || raw[0] != '[' {
		return nil, fmt.Errorf("parsing merges: not a list")
	}
	rest := bytes.TrimSpace(raw[1:])
	if len(rest) > 0 && rest[0] == '[' {
		var pairs [][2]string
		if err := json.Unmarshal(raw, &pairs); err != nil {
			return nil, fmt.Errorf("parsing merges: %w", err)
		}
		return pairs, nil
	}
	var lines []string
	if err := json.Unmarshal(raw, &lines); err != nil {
		return nil, fmt.Errorf("parsing merges: %w", err)
	}
	pairs := make([][2]string, len(lines))
	for i, l := range lines {
		a, b, ok := strings.Cut(l, " ")
		if !ok || a == "" || b == "" {
			return nil, fmt.Errorf("parsing merges: entry %d %q is not \"a b\"", i, l)
		}
		pairs[i] = [2]string{a, b}
	}
	return pairs, nil
}

// byteLevelRunes maps each byte to the printable rune GPT-2's byte-level alphabet gives it, and
// runeToByte is its inverse.
var byteLevelRunes, runeToByte = func() (enc [256]rune, dec map[rune]byte) {
	dec = make(map[rune]byte, 256)
	n := rune(0)
	for b := range 256 {
		r := rune(b)
		if !(b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE && b <= 0xFF) {
			r = 256 + n
			n++
		}
		enc[b] = r
		dec[r] = byte(b)
	}
	return enc, dec
}()

// fromByteLevel converts a byte-level token string back to its bytes.
func fromByteLevel(s string) (string, bool) {
	out := make([]byte, 0, len(s))
	for _, r := range s {
		b, ok := runeToByte[r]
		if !ok {
			return "", false
		}
		out = append(out, b)
	}
	return string(out), true
}

// toByteLevel converts bytes to the byte-level alphabet (for tests and diagnostics).
func toByteLevel(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		b.WriteRune(byteLevelRunes[s[i]])
	}
	return b.String()
}
