package tokenizer

import (
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is a token matched in text before pre-tokenization: a special token such as
// "<|start|>", or a HuggingFace added token such as Qwen's "<think>".
type addedToken struct {
	content string
	id      uint32
	special bool
	// HuggingFace AddedToken flags.
	lstrip, rstrip, singleWord bool
}

// addedMatcher finds added tokens in text, leftmost first and longest at a position, as the
// HuggingFace AddedVocabulary (an Aho-Corasick leftmost-longest automaton) does. Immutable and
// safe for concurrent use.
type addedMatcher struct {
	byContent map[string]*addedToken
	lengths   []int       // distinct content lengths, longest first
	last      [][256]bool // last[j][c]: a token of length lengths[j] ends in byte c
	first     [256]bool
	oneFirst  int // the only first byte when all tokens share it, else -1
	anyStrip  bool
}

func newAddedMatcher(tokens []addedToken) *addedMatcher {
	m := &addedMatcher{byContent: make(map[string]*addedToken, len(tokens)), oneFirst: -1}
	seen := map[int]bool{}
	firsts := map[byte]bool{}
	for i := range tokens {
		t := &tokens[i]
		if t.content == "" {
			continue
		}
		if _, dup := m.byContent[t.content]; dup {
			continue
		}
		m.byContent[t.content] = t
		if !seen[len(t.content)] {
			seen[len(t.content)] = true
			m.lengths = append(m.lengths, len(t.content))
		}
		m.first[t.content[0]] = true
		firsts[t.content[0]] = true
		m.anyStrip = m.anyStrip || t.lstrip || t.rstrip
	}
	sort.Sort(sort.Reverse(sort.IntSlice(m.lengths)))
	m.last = make([][256]bool, len(m.lengths))
	for j, l := range m.lengths {
		for c := range m.byContent {
			if len(c) == l {
				m.last[j][c[l-1]] = true
			}
		}
	}
	if len(firsts) == 1 {
		for b := range firsts {
			m.oneFirst = int(b)
		}
	}
	return m
}

// find returns the next added token in text at or after from: the span [start, end) it covers
// (including whitespace taken by lstrip/rstrip) and the token. ok is false when there is none.
func (m *addedMatcher) find(text string, from int) (start, end int, tok *addedToken, ok bool) {
	if m == nil || len(m.byContent) == 0 {
		return 0, 0, nil, false
	}
	for i := from; i < len(text); i++ {
		if m.oneFirst >= 0 {
			k := strings.IndexByte(text[i:], byte(m.oneFirst))
			if k < 0 {
				return 0, 0, nil, false
			}
			i += k
		} else if !m.first[text[i]] {
			continue
		}
		for j, l := range m.lengths {
			// A candidate's last byte rules out most lengths before the map is asked.
			if i+l > len(text) || !m.last[j][text[i+l-1]] {
				continue
			}
			t, hit := m.byContent[text[i:i+l]]
			if !hit {
				continue
			}
			if t.singleWord && !isWordBoundary(text, i, i+l) {
				continue
			}
			start, end = i, i+l
			if t.lstrip {
				for start > from {
					r, n := utf8.DecodeLastRuneInString(text[from:start])
					if !unicode.IsSpace(r) {
						break
					}
					start -= n
				}
			}
			if t.rstrip {
				for end < len(text) {
					r, n := utf8.DecodeRuneInString(text[end:])
					if !unicode.IsSpace(r) {
						break
					}
					end += n
				}
			}
			return start, end, t, true
		}
	}
	return 0, 0, nil, false
}

func isWordRune(r rune) bool {
	return unicode.IsLetter(r) || unicode.IsDigit(r) || r == '_'
}

// isWordBoundary reports whether text[i:j] is not glued to word characters on either side.
func isWordBoundary(text string, i, j int) bool {
	if i > 0 {
		if r, _ := utf8.DecodeLastRuneInString(text[:i]); isWordRune(r) {
			return false
		}
	}
	if j < len(text) {
		if r, _ := utf8.DecodeRuneInString(text[j:]); isWordRune(r) {
			return false
		}
	}
	return true
}
