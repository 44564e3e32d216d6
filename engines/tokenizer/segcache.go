package tokenizer

import (
	"sync"

	"github.com/zeebo/xxh3"
)

// SegmentCache wraps a tokenizer with a cache of the ids of whole text segments, the runs of
// text between special tokens. Chat templates put special tokens around every message, so a
// system prompt, a tool preamble or a conversation's history that comes back in the next
// request is one or a few segments already encoded: only the new messages are tokenized.
// The ids are exactly the wrapped tokenizer's, because pre-tokenization never joins text
// across a special token.
//
// Segments are keyed by a 128-bit XXH3 of their bytes. The cache holds at most MaxTokens ids
// in total and evicts with the CLOCK algorithm. It is safe for concurrent use; lookups of
// present segments do not allocate.
type SegmentCache struct {
	Tokenizer
	bpe      *bpeTokenizer
	minBytes int
	shards   [segShards]segShard
}

const segShards = 16

type segShard struct {
	mu        sync.Mutex
	m         map[xxh3.Uint128]int // key → index in ents
	ents      []segEntry
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
	c := &SegmentCache{Tokenizer: t, bpe: b, minBytes: max(minBytes, 1)}
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

func (c *SegmentCache) segment(dst []uint32, seg string) []uint32 {
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
	// Reuse a dead slot if the hand just freed one.
	for i := range sh.ents {
		if !sh.ents[i].live {
			sh.ents[i] = segEntry{key: key, ids: cp, live: true}
			sh.m[key] = i
			sh.tokens += len(cp)
			return
		}
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
		return
	}
}
