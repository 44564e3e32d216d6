package workload

import "github.com/kvrelay/kvrelay/engines/blockhash"

// Ideal accumulates the prefix cache hit rate of a request stream under an unbounded cache
// that every engine shares: the upper bound a router can reach, to set beside the measured
// Σ cached_tokens / Σ prompt tokens.
//
// Requests are added in the order they were sent. Only full blocks of BlockSize tokens count,
// as engines cache nothing smaller. Block i of a prompt is a hit when an earlier request left
// the same chain prefix (blocks 0..i, the engines' sequence hash) in the cache, so hits always
// form a prefix of the prompt. The last block of a prompt whose length is an exact multiple of
// BlockSize is never a hit: engines recompute at least one token to produce logits. A request
// leaves in the cache the full blocks of its prompt followed by its answer, less the answer's
// last token (generated but never fed back, so it has no KV).
//
// The bound ignores time (a block counts as cached as soon as the request holding it was
// added, even if it was still being prefilled) and, unless made with NewLRU, capacity. An
// Ideal is not safe for concurrent use.
type Ideal struct {
	blockSize int
	seen      map[uint64]struct{}
	h         blockhash.Hasher
	hashes    []uint64
	scratch   []uint32
	lru       *lru // nil: unbounded

	// HitTokens and PromptTokens sum hit blocks' tokens and prompt lengths over the requests
	// added; HitBlocks and Blocks count hit and full prompt blocks.
	HitTokens, PromptTokens int64
	HitBlocks, Blocks       int64
}

// NewIdeal returns an empty Ideal for blocks of blockSize (> 0) tokens; vLLM's default is 16.
func NewIdeal(blockSize int) *Ideal {
	return &Ideal{blockSize: max(blockSize, 1), seen: make(map[uint64]struct{})}
}

// NewLRU returns an empty Ideal whose cache holds at most capacity (> 0) blocks and evicts the
// least recently used: one prefix cache the size of a whole cluster's KV cache, shared by all
// its engines: a reference for what a router can reach with engines that evict LRU and that
// much memory in all. It is not a strict bound: per-engine caches behind a router can beat
// one shared LRU on some streams (one-off prompts kept on one engine cannot evict another's
// hot blocks), while engines also pin running requests' blocks, which lowers what they keep.
// A request's blocks become the most recently used, its first block most of all.
func NewLRU(blockSize, capacity int) *Ideal {
	x := NewIdeal(blockSize)
	x.lru = newLRU(max(capacity, 1))
	return x
}

// Add counts one request: prompt as sent (token ids after the chat template) and the answer's
// token ids (nil when unknown). It returns how many of the prompt's tokens were hits.
func (x *Ideal) Add(prompt, answer []uint32) int {
	bs := x.blockSize
	x.hashes = x.h.AppendSeq(x.hashes[:0], prompt, bs, nil)
	usable := len(x.hashes)
	if len(prompt)%bs == 0 && usable > 0 {
		usable-- // the engine recomputes the last block of a block-aligned prompt
	}
	hit := 0
	for hit < usable && x.cached(x.hashes[hit]) {
		hit++
	}
	x.HitBlocks += int64(hit)
	x.Blocks += int64(len(x.hashes))
	x.HitTokens += int64(hit * bs)
	x.PromptTokens += int64(len(prompt))
	x.keep(x.hashes)
	if len(answer) > 1 {
		x.scratch = append(append(x.scratch[:0], prompt...), answer[:len(answer)-1]...)
		x.hashes = x.h.AppendSeq(x.hashes[:0], x.scratch, bs, nil)
		x.keep(x.hashes)
	}
	return hit * bs
}

// cached reports whether the block is in the cache.
func (x *Ideal) cached(h uint64) bool {
	if x.lru != nil {
		return x.lru.has(h)
	}
	_, ok := x.seen[h]
	return ok
}

// keep puts a sequence's blocks in the cache. A bounded cache touches them last block first,
// so that the first block is the most recently used and a sequence is forgotten from its tail,
// as vLLM frees a finished request's blocks (a block is useless once one before it is gone).
func (x *Ideal) keep(hashes []uint64) {
	if x.lru == nil {
		for _, h := range hashes {
			x.seen[h] = struct{}{}
		}
		return
	}
	for i := len(hashes) - 1; i >= 0; i-- {
		x.lru.touch(hashes[i])
	}
}

// lru is a set of block hashes of bounded size that forgets the least recently touched.
type lru struct {
	capacity int
	at       map[uint64]int32 // hash → its node
	nodes    []lruNode        // a ring: nodes[0] is the sentinel
	free     []int32
}

type lruNode struct {
	hash       uint64
	prev, next int32
}

func newLRU(capacity int) *lru {
	return &lru{capacity: capacity, at: map[uint64]int32{}, nodes: []lruNode{{}}}
}

func (l *lru) has(h uint64) bool { _, ok := l.at[h]; return ok }

// touch makes h the most recently used, adding it (and evicting the least recently used past
// the capacity) when missing.
func (l *lru) touch(h uint64) {
	if i, ok := l.at[h]; ok {
		l.unlink(i)
		l.pushFront(i)
		return
	}
	if len(l.at) >= l.capacity {
		old := l.nodes[0].prev
		l.unlink(old)
		delete(l.at, l.nodes[old].hash)
		l.free = append(l.free, old)
	}
	var i int32
	if n := len(l.free); n > 0 {
		i, l.free = l.free[n-1], l.free[:n-1]
	} else {
		i = int32(len(l.nodes))
		l.nodes = append(l.nodes, lruNode{})
	}
	l.nodes[i].hash = h
	l.at[h] = i
	l.pushFront(i)
}

func (l *lru) unlink(i int32) {
	n := l.nodes[i]
	l.nodes[n.prev].next = n.next
	l.nodes[n.next].prev = n.prev
}

func (l *lru) pushFront(i int32) {
	first := l.nodes[0].next
	l.nodes[i].prev, l.nodes[i].next = 0, first
	l.nodes[first].prev = i
	l.nodes[0].next = i
}

// HitRate returns HitTokens / PromptTokens (0 before any request): comparable to the measured
// Σ cached_tokens / Σ prompt tokens.
func (x *Ideal) HitRate() float64 {
	if x.PromptTokens == 0 {
		return 0
	}
	return float64(x.HitTokens) / float64(x.PromptTokens)
}

// BlockHitRate returns HitBlocks / Blocks (0 before any full block): the share of full prompt
// blocks served from cache.
func (x *Ideal) BlockHitRate() float64 {
	if x.Blocks == 0 {
		return 0
	}
	return float64(x.HitBlocks) / float64(x.Blocks)
}

// IdealHitRate returns the Ideal hit rate (hit tokens / prompt tokens) of prompts added in
// order without answers.
func IdealHitRate(prompts [][]uint32, blockSize int) float64 {
	x := NewIdeal(blockSize)
	for _, p := range prompts {
		x.Add(p, nil)
	}
	return x.HitRate()
}
