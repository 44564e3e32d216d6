package tokenizer

import (
	"fmt"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2/v2"
)

// The split patterns that the hand-written pre-tokenizers implement. A tokenizer.json whose Split
// regex is one of these strings gets the fast splitter; any other pattern runs on regexp2.
const (
	// patternO200k is o200k_base's (and so gpt-oss's) pre-tokenizer regex.
	patternO200k = `[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternCl100k is cl100k_base's and Llama 3's.
	patternCl100k = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternQwen2 is Qwen2's, Qwen2.5's and Qwen3's: cl100k with one digit per piece.
	patternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternGPT2 is the ByteLevel pre-tokenizer's own regex (use_regex: true).
	patternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// splitter cuts text into pre-tokens. next returns the end of the piece that starts at
// text[start:] (start < len(text)); it never returns start. Implementations are stateless and
// safe for concurrent use.
type splitter interface {
	next(text string, start int) int
}

// Character classes of the pre-tokenizer regexes, one bit each.
const (
	clsUpper  = 1 << iota // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
	clsLower              // [\p{Ll}\p{Lm}\p{Lo}\p{M}]
	clsLetter             // \p{L}
	clsNumber             // \p{N}
	clsSpace              // \s: White_Space, as Go's unicode.IsSpace and .NET/Rust \s
	clsCRLF               // [\r\n]
)

var (
	bmpClassOnce sync.Once
	bmpClass     []uint8 // class bits of every rune below 0x10000
)

func classOfRune(r rune) uint8 {
	var c uint8
	switch {
	case unicode.Is(unicode.Lu, r), unicode.Is(unicode.Lt, r):
		c = clsUpper | clsLetter
	case unicode.Is(unicode.Ll, r):
		c = clsLower | clsLetter
	case unicode.Is(unicode.Lm, r), unicode.Is(unicode.Lo, r):
		c = clsUpper | clsLower | clsLetter
	case unicode.Is(unicode.M, r):
		c = clsUpper | clsLower
	case unicode.Is(unicode.N, r):
		c = clsNumber
	case unicode.IsSpace(r):
		c = clsSpace
		if r == '\r' || r == '\n' {
			c |= clsCRLF
		}
	}
	return c
}

func buildBMPClass() {
	t := make([]uint8, 0x10000)
	for r := range rune(0x10000) {
		t[r] = classOfRune(r)
	}
	bmpClass = t
}

// class returns the class bits and byte width of the rune at text[i:]. Invalid UTF-8 bytes read
// as one-byte U+FFFD, a symbol: they fall into the punctuation piece like any other symbol.
func class(text string, i int) (uint8, int) {
	b := text[i]
	if b < utf8.RuneSelf {
		return asciiClass[b], 1
	}
	r, n := utf8.DecodeRuneInString(text[i:])
	if r < 0x10000 {
		bmpClassOnce.Do(buildBMPClass)
		return bmpClass[r], n
	}
	return classOfRune(r), n
}

var asciiClass = func() (t [128]uint8) {
	for r := range rune(128) {
		t[r] = classOfRune(r)
	}
	return t
}()

// contraction reports the length of a (?i:'s|'t|'re|'ve|'m|'ll|'d) match at text[i:], or 0.
// Case folding follows the regex engines: the long s (U+017F) matches 's'.
func contraction(text string, i int) int {
	if i >= len(text) || text[i] != '\'' || i+1 >= len(text) {
		return 0
	}
	switch text[i+1] {
	case 's', 'S', 't', 'T', 'm', 'M', 'd', 'D':
		return 2
	case 'r', 'R':
		if i+2 < len(text) && (text[i+2] == 'e' || text[i+2] == 'E') {
			return 3
		}
	case 'v', 'V':
		if i+2 < len(text) && (text[i+2] == 'e' || text[i+2] == 'E') {
			return 3
		}
	case 'l', 'L':
		if i+2 < len(text) && (text[i+2] == 'l' || text[i+2] == 'L') {
			return 3
		}
	case 0xC5: // U+017F LATIN SMALL LETTER LONG S is C5 BF
		if i+2 < len(text) && text[i+2] == 0xBF {
			return 3
		}
	}
	return 0
}

// isPrefix reports whether a class is in [^\r\n\p{L}\p{N}].
func isPrefix(c uint8) bool { return c&(clsLetter|clsNumber|clsCRLF) == 0 }

// isPunct reports whether a class is in [^\s\p{L}\p{N}].
func isPunct(c uint8) bool { return c&(clsLetter|clsNumber|clsSpace) == 0 }

// spaceEnd implements the three whitespace alternatives shared by all patterns,
// \s*[\r\n]+ | \s+(?!\S) | \s+, at a position holding whitespace.
func spaceEnd(text string, i int) int {
	lastNL := -1
	last := i // start of the last whitespace rune
	j := i
	for j < len(text) {
		c, n := class(text, j)
		if c&clsSpace == 0 {
			break
		}
		if c&clsCRLF != 0 {
			lastNL = j + 1
		}
		last = j
		j += n
	}
	if lastNL >= 0 {
		return lastNL // \s*[\r\n]+ ends after the last line break of the run
	}
	if j == len(text) || last == i {
		return j // \s+(?!\S) at the end of text, or a lone space before a non-space: \s+
	}
	return last // \s+(?!\S): leave the last space to start the next piece
}

// punctEnd implements ` ?[^\s\p{L}\p{N}]+` followed by a greedy tail class at text[i:], where
// text[i] is the first punctuation rune. slash adds '/' to the tail ([\r\n/]* in o200k).
func punctEnd(text string, i int, slash bool) int {
	for i < len(text) {
		c, n := class(text, i)
		if !isPunct(c) {
			break
		}
		i += n
	}
	for i < len(text) && (text[i] == '\r' || text[i] == '\n' || (slash && text[i] == '/')) {
		i++
	}
	return i
}

// o200kSplitter implements patternO200k.
type o200kSplitter struct{}

// o200kLetters returns the end of [U]*[W]+ (alternative 1) and of [U]+[W]* (alternative 2) at
// text[s:], each followed by an optional contraction, or -1 where an alternative does not match.
//
// U* is greedy and gives runes back until W+ matches, so alternative 1 ends after the W run that
// follows the U run, or, when no W rune follows it, after the last W rune inside the U run.
func o200kLetters(text string, s int) (alt1, alt2 int) {
	alt1, alt2 = -1, -1
	lastW := -1
	j := s
	for j < len(text) {
		c, n := class(text, j)
		if c&clsUpper == 0 {
			break
		}
		j += n
		if c&clsLower != 0 {
			lastW = j
		}
	}
	runEnd := j
	// W run after the U run (its first rune can only be Ll).
	for j < len(text) {
		c, n := class(text, j)
		if c&clsLower == 0 {
			break
		}
		j += n
	}
	if j > runEnd {
		alt1 = j
	} else if lastW >= 0 {
		alt1 = lastW
	}
	if alt1 >= 0 {
		alt1 += contraction(text, alt1)
	}
	if runEnd > s {
		alt2 = j + contraction(text, j)
	}
	return alt1, alt2
}

func (o200kSplitter) next(text string, i int) int {
	c, n := class(text, i)
	if c&(clsUpper|clsLower) != 0 || isPrefix(c) {
		// Alternatives 1 and 2, each tried first with and then without the optional prefix.
		var p1, p2 int = -1, -1
		if isPrefix(c) && i+n < len(text) {
			p1, p2 = o200kLetters(text, i+n)
		}
		if p1 >= 0 {
			return p1
		}
		a1, a2 := -1, -1
		if c&(clsUpper|clsLower) != 0 {
			a1, a2 = o200kLetters(text, i)
		}
		if a1 >= 0 {
			return a1
		}
		if p2 >= 0 {
			return p2
		}
		if a2 >= 0 {
			return a2
		}
	}
	return commonTail(text, i, c, n, 3, true)
}

// commonTail implements the alternatives after the letter ones: \p{N}{1,maxDigits},
// ` ?[^\s\p{L}\p{N}]+[\r\n(/)]*` and the whitespace alternatives.
func commonTail(text string, i int, c uint8, n int, maxDigits int, slash bool) int {
	if c&clsNumber != 0 {
		j := i + n
		for k := 1; k < maxDigits && j < len(text); k++ {
			c2, n2 := class(text, j)
			if c2&clsNumber == 0 {
				break
			}
			j += n2
		}
		return j
	}
	if text[i] == ' ' && i+1 < len(text) {
		if c2, _ := class(text, i+1); isPunct(c2) {
			return punctEnd(text, i+1, slash)
		}
	}
	if isPunct(c) {
		return punctEnd(text, i, slash)
	}
	if c&clsSpace != 0 {
		return spaceEnd(text, i)
	}
	return i + n // unreachable: every rune is a letter, mark, number, space or punctuation
}

// cl100kSplitter implements patternCl100k (digits = 3) and patternQwen2 (digits = 1).
type cl100kSplitter struct{ digits int }

func (s cl100kSplitter) next(text string, i int) int {
	if k := contraction(text, i); k > 0 {
		return i + k
	}
	c, n := class(text, i)
	start := -1
	if c&clsLetter != 0 {
		start = i
	} else if isPrefix(c) && i+n < len(text) {
		if c2, _ := class(text, i+n); c2&clsLetter != 0 {
			start = i + n
		}
	}
	if start >= 0 {
		j := start
		for j < len(text) {
			c2, n2 := class(text, j)
			if c2&clsLetter == 0 {
				break
			}
			j += n2
		}
		return j
	}
	return commonTail(text, i, c, n, s.digits, false)
}

// regexSplitter runs an arbitrary pattern on regexp2 (the .NET dialect, which has the lookahead
// that HuggingFace patterns use). Text between matches becomes pieces of its own, as the Split
// pre-tokenizer's "Isolated" behaviour does.
type regexSplitter struct {
	re *regexp2.Regexp
}

func newRegexSplitter(pattern string) (*regexSplitter, error) {
	re, err := regexp2.Compile(pattern, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("compiling split pattern %q: %w", pattern, err)
	}
	// Real pre-tokenizer patterns match in microseconds; a pathological one must not hang a
	// request. On timeout the rest of the text becomes one piece.
	re.MatchTimeout = regexMatchTimeout
	return &regexSplitter{re: re}, nil
}

// regexMatchTimeout bounds one regexSplitter.splitAll call.
const regexMatchTimeout = 2 * time.Second

// splitAll returns the piece boundaries of text: piece k is text[ends[k-1]:ends[k]].
func (s *regexSplitter) splitAll(text string, ends []int) []int {
	idx, err := s.re.FindAllStringIndex(text, -1)
	pos := 0
	if err == nil {
		for _, m := range idx {
			if m[0] < pos || m[1] > len(text) {
				continue
			}
			if m[0] > pos {
				ends = append(ends, m[0])
			}
			if m[1] > m[0] {
				ends = append(ends, m[1])
			}
			pos = max(pos, m[1])
		}
	}
	if pos < len(text) {
		ends = append(ends, len(text))
	}
	return ends
}

// splitterFor returns the hand-written splitter for a known pattern, or nil.
func splitterFor(pattern string) splitter {
	switch pattern {
	case patternO200k:
		return o200kSplitter{}
	case patternCl100k:
		return cl100kSplitter{digits: 3}
	case patternQwen2:
		return cl100kSplitter{digits: 1}
	}
	return nil
}
