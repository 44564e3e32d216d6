package tokenizer

import (
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"github.com/zeebo/xxh3"
)

// SegmentCache wraps a tokenizer with a cache of the ids of whole text segments, the runs of
// text between special tokens. Chat templates put special tokens around every message, so a
// system prompt, a tool preamble or a conversation's history that comes back in the next
// request is one or a few segments already encoded: only the new messages are tokenized.
// The ids are exactly the wrapped tokenizer's, because pre-tokenization never joins text
// across a special token.
//
// A long segment is cached in chunks of about chunkBytes, each ending at a line break that no
// pre-token spans (see cutAfter), so that templates whose message markers are plain text to
// the tokenizer (ChatML rendered for o200k_base, say), where the whole prompt is one segment,
// still find a conversation's earlier turns cached: chunking runs from the segment's start,
// so the chunks of an unchanged prefix are the same in every request, and only the chunk
// the new text extends and the new text itself are encoded.
//
// Segments are keyed by a 128-bit XXH3 of their bytes. The cache holds at most MaxTokens ids
// in total and evicts with the CLOCK algorithm. It is safe for concurrent use; lookups of
// present segments do not allocate.
type SegmentCache struct {
	Tokenizer
	bpe      *bpeTokenizer
	minBytes int
	chunk    bool // the pre-tokenizer never spans a line break cutAfter accepts
	shards   [segShards]segShard
}

const segShards = 16

type segShard struct {
	mu        sync.Mutex
	m         map[xxh3.Uint128]int // key → index in ents
	ents      []segEntry
	free      []int // indexes of dead entries
	hand      int
	tokens    int
	maxTokens int
}

type segEntry struct {
	key  xxh3.Uint128
	ids  []uint32
	used bool
	live bool
}

// NewSegmentCache caches the segments of t of at least minBytes bytes (shorter ones are
// cheaper to encode than to look up), holding up to maxTokens ids. Tokenizers this package
// did not build are returned unwrapped.
func NewSegmentCache(t Tokenizer, maxTokens, minBytes int) Tokenizer {
	if c, ok := t.(*SegmentCache); ok {
		t = c.Tokenizer
	}
	b, ok := t.(*bpeTokenizer)
	if !ok {
		return t
	}
	c := &SegmentCache{Tokenizer: t, bpe: b, minBytes: max(minBytes, 1), chunk: b.newlineSafe()}
	for i := range c.shards {
		c.shards[i].m = make(map[xxh3.Uint128]int)
		c.shards[i].maxTokens = max(maxTokens/segShards, 1)
	}
	return c
}

// Encode implements Tokenizer.
func (c *SegmentCache) Encode(text string) []uint32 {
	return c.AppendEncode(make([]uint32, 0, len(text)/4+4), text)
}

// AppendEncode implements Tokenizer, serving whole segments from the cache.
func (c *SegmentCache) AppendEncode(dst []uint32, text string) []uint32 {
	pos := 0
	for pos < len(text) {
		s, e, tok, ok := c.bpe.added.find(text, pos)
		if !ok {
			s, e = len(text), len(text)
		}
		if s > pos {
			dst = c.segment(dst, text[pos:s])
		}
		if ok {
			dst = append(dst, tok.id)
		}
		pos = e
	}
	return dst
}

// chunkBytes is the size a long segment's chunks reach before the next safe line break ends
// them: large enough that a hit saves far more than its hash and lookup cost, small enough
// that the chunk a new turn extends is cheap to encode again.
const chunkBytes = 1024

func (c *SegmentCache) segment(dst []uint32, seg string) []uint32 {
	if !c.chunk || len(seg) < 2*chunkBytes {
		return c.cached(dst, seg)
	}
	for start := 0; start < len(seg); {
		end := cutAfter(seg, start+chunkBytes)
		dst = c.cached(dst, seg[start:end])
		start = end
	}
	return dst
}

// cutAfter returns the first position p ≥ from where text[p-1] is '\n' and text[p] is
// neither white space nor '/', or len(text). Under the o200k, cl100k and Qwen2 patterns no
// pre-token crosses such a p: a piece that holds a line break is white space (which text[p]
// would have to continue) or punctuation whose trailing line breaks (and, in o200k, slashes)
// end it, and no other alternative matches a line break; so the pieces of text[:p] and
// text[p:] are those of text.
func cutAfter(text string, from int) int {
	for from < len(text) {
		i := strings.IndexByte(text[from-1:], '\n')
		if i < 0 {
			break
		}
		p := from + i
		if p >= len(text) {
			break
		}
		if b := text[p]; b != '/' && b != ' ' && b != '\t' && b != '\n' && b != '\r' && b != '\v' && b != '\f' && !spaceAt(text, p) {
			return p
		}
		from = p + 1
	}
	return len(text)
}

// spaceAt reports whether the rune at text[i] is white space beyond ASCII (NEL, NBSP and the
// Unicode spaces), which \s also matches.
func spaceAt(text string, i int) bool {
	if text[i] < utf8.RuneSelf {
		return false
	}
	r, _ := utf8.DecodeRuneInString(text[i:])
	return unicode.IsSpace(r)
}

func (c *SegmentCache) cached(dst []uint32, seg string) []uint32 {
	if len(seg) < c.minBytes {
		return c.bpe.encodeOrdinary(dst, seg, nil)
	}
	key := xxh3.HashString128(seg)
	sh := &c.shards[key.Lo%segShards]
	sh.mu.Lock()
	if i, ok := sh.m[key]; ok {
		e := &sh.ents[i]
		e.used = true
		dst = append(dst, e.ids...)
		sh.mu.Unlock()
		return dst
	}
	sh.mu.Unlock()
	n := len(dst)
	dst = c.bpe.encodeOrdinary(dst, seg, nil)
	sh.put(key, dst[n:])
	return dst
}

func (sh *segShard) put(key xxh3.Uint128, ids []uint32) {
	if len(ids) > sh.maxTokens {
		return
	}
	cp := make([]uint32, len(ids))
	copy(cp, ids)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if _, ok := sh.m[key]; ok {
		return
	}
	for sh.tokens+len(cp) > sh.maxTokens && len(sh.ents) > 0 {
		sh.evictOne()
	}
	if n := len(sh.free); n > 0 {
		i := sh.free[n-1]
		sh.free = sh.free[:n-1]
		sh.ents[i] = segEntry{key: key, ids: cp, live: true}
		sh.m[key] = i
		sh.tokens += len(cp)
		return
	}
	sh.ents = append(sh.ents, segEntry{key: key, ids: cp, live: true})
	sh.m[key] = len(sh.ents) - 1
	sh.tokens += len(cp)
}

// evictOne advances the CLOCK hand to the first entry not used since the last pass and frees
// it.
func (sh *segShard) evictOne() {
	for range 2*len(sh.ents) + 1 {
		if sh.hand >= len(sh.ents) {
			sh.hand = 0
		}
		e := &sh.ents[sh.hand]
		sh.hand++
		if !e.live {
			continue
		}
		if e.used {
			e.used = false
			continue
		}
		delete(sh.m, e.key)
		sh.tokens -= len(e.ids)
		*e = segEntry{}
		sh.free = append(sh.free, sh.hand-1)
		return
	}
}
