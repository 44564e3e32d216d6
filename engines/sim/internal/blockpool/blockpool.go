// Package blockpool is the GPU tier (G1) of the simulated engine's KV cache, modelled on
// vLLM's BlockPool: a fixed array of blocks, reference-counted while requests hold them, free
// queues ordered for eviction, and a map from sequence hash to the block that caches it.
//
// Its one user is the engine's block manager (package sim's blockManager), as vLLM's
// KVCacheManager is the only user of its BlockPool: the scheduler, the KV connector and the
// peer export ask the block manager for blocks and never hold a Pool. The free queues and the
// block table are this package's own, so that nothing else can change them.
package blockpool

// Pool is the paged KV cache of one worker.
//
// Freed blocks keep their hash and stay findable until they are reused. Allocation takes a
// block from the head of a free queue, evicting what it cached. A holder frees its blocks in
// reverse order, so that the tail of a chain is evicted before its head: a later request that
// shares only the beginning of a prompt still finds it.
//
// Under LRU there is one free queue, least recently freed first (vLLM's policy). Under WORM a
// free block joins the queue of its class, and allocation takes, in order: an ephemeral block
// (generated output nobody will read back); the older of the once-seen and the reused queues'
// heads, a reused block counting as half its age (a block read again outranks one of the same
// age seen once); a pinned block last.
//
// A Pool is owned by its engine's scheduler goroutine and is not safe for concurrent use.
type Pool struct {
	prefixCaching bool
	policy        Policy
	blocks        []kvBlock
	queues        [numQueues]freeQueue
	numFree       int
	cached        map[uint64]int32
	// removed collects the hashes evicted since the last ClearEvicted, in order.
	removed []uint64
	// now is the scheduler's clock (Unix nanoseconds), set before each step's allocations.
	now int64
	// pinned says whether a hash is pinned now; nil: nothing is.
	pinned func(h uint64) bool
}

// Policy is how a Pool picks the cached block an allocation evicts.
type Policy uint8

const (
	// LRU evicts the least recently freed block (vLLM's policy).
	LRU Policy = iota
	// WORM evicts by class: ephemeral first, then once-seen or reused by age (reuse halving
	// it), pinned last.
	WORM
)

// The free queues of a Pool; LRU uses qOnce alone.
const (
	qEphemeral = iota
	qOnce
	qReused
	qPinned
	numQueues
)

type freeQueue struct {
	head, tail int32
	n          int
}

type kvBlock struct {
	ref        int32
	prev, next int32
	queue      int8 // the free queue it is in, -1 when none
	cached     bool
	ephemeral  bool  // holds generated output only (WORM evicts it first)
	hits       int32 // requests that found it cached since it was stored
	freedAt    int64 // when it last joined a free queue (pool clock)
	hash       uint64
}

// noBlock is the id of no block.
const noBlock int32 = -1

// New returns a pool of numBlocks free blocks, caching stored blocks by hash when
// prefixCaching is on, evicting by policy.
func New(numBlocks int, prefixCaching bool, policy Policy) *Pool {
	p := &Pool{
		prefixCaching: prefixCaching,
		policy:        policy,
		blocks:        make([]kvBlock, numBlocks),
		cached:        make(map[uint64]int32, numBlocks),
	}
	for i := range p.queues {
		p.queues[i] = freeQueue{head: noBlock, tail: noBlock}
	}
	for i := range p.blocks {
		p.blocks[i] = kvBlock{prev: noBlock, next: noBlock, queue: -1}
		p.pushTail(int32(i))
	}
	return p
}

// SetPinned tells the pool which hashes are pinned (kept last under WORM); nil: none is.
func (p *Pool) SetPinned(pinned func(h uint64) bool) { p.pinned = pinned }

// SetClock sets the scheduler's clock (Unix nanoseconds), from which free blocks' ages count.
func (p *Pool) SetClock(now int64) { p.now = now }

// PrefixCaching reports whether stored blocks are cached by hash.
func (p *Pool) PrefixCaching() bool { return p.prefixCaching }

// NumFree is the number of blocks no holder references.
func (p *Pool) NumFree() int { return p.numFree }

// Cached returns the block that caches hash h.
func (p *Pool) Cached(h uint64) (int32, bool) {
	id, ok := p.cached[h]
	return id, ok
}

// InUse reports whether some holder references block id (it is in no free queue).
func (p *Pool) InUse(id int32) bool { return p.blocks[id].ref > 0 }

// MarkEphemeral marks block id as holding generated output only (WORM evicts it first).
func (p *Pool) MarkEphemeral(id int32) { p.blocks[id].ephemeral = true }

// Evicted returns the hashes evicted since the last ClearEvicted, in order. The slice is the
// pool's, valid until the next ClearEvicted.
func (p *Pool) Evicted() []uint64 { return p.removed }

// ClearEvicted forgets the hashes Evicted returns.
func (p *Pool) ClearEvicted() { p.removed = p.removed[:0] }

// Each calls fn with every hash the pool caches.
func (p *Pool) Each(fn func(h uint64)) {
	for h := range p.cached {
		fn(h)
	}
}

// NumBlocks is the number of blocks of the pool.
func (p *Pool) NumBlocks() int { return len(p.blocks) }

// NumUsed is the number of blocks some holder references.
func (p *Pool) NumUsed() int { return len(p.blocks) - p.numFree }

// Usage is the fraction of blocks in use, vLLM's kv_cache_usage_perc.
func (p *Pool) Usage() float64 { return float64(p.NumUsed()) / float64(len(p.blocks)) }

// queueOf is the free queue block b joins.
func (p *Pool) queueOf(b *kvBlock) int {
	if p.policy != WORM || !b.cached {
		return qOnce
	}
	switch {
	case b.ephemeral:
		return qEphemeral
	case p.pinned != nil && p.pinned(b.hash):
		return qPinned
	case b.hits > 0:
		return qReused
	}
	return qOnce
}

func (p *Pool) pushTail(id int32) {
	b := &p.blocks[id]
	qi := p.queueOf(b)
	q := &p.queues[qi]
	b.prev, b.next, b.queue, b.freedAt = q.tail, noBlock, int8(qi), p.now
	if q.tail != noBlock {
		p.blocks[q.tail].next = id
	} else {
		q.head = id
	}
	q.tail = id
	q.n++
	p.numFree++
}

func (p *Pool) unlink(id int32) {
	b := &p.blocks[id]
	q := &p.queues[b.queue]
	if b.prev != noBlock {
		p.blocks[b.prev].next = b.next
	} else {
		q.head = b.next
	}
	if b.next != noBlock {
		p.blocks[b.next].prev = b.prev
	} else {
		q.tail = b.prev
	}
	b.prev, b.next, b.queue = noBlock, noBlock, -1
	q.n--
	p.numFree--
}

// victim is the free block allocation takes next, noBlock when none is free.
func (p *Pool) victim() int32 {
	q := &p.queues
	if q[qEphemeral].n > 0 {
		return q[qEphemeral].head
	}
	once, reused := q[qOnce].head, q[qReused].head
	switch {
	case once != noBlock && reused != noBlock:
		// A reused block counts as half its age.
		if p.now-p.blocks[reused].freedAt > 2*(p.now-p.blocks[once].freedAt) {
			return reused
		}
		return once
	case once != noBlock:
		return once
	case reused != noBlock:
		return reused
	}
	return q[qPinned].head
}

// Requeue moves the free blocks of the pinned queue whose pins lapsed to their class's queue,
// keeping their order (their age is when they were freed).
func (p *Pool) Requeue() {
	q := &p.queues[qPinned]
	for id := q.head; id != noBlock; {
		next := p.blocks[id].next
		if b := &p.blocks[id]; p.pinned == nil || !p.pinned(b.hash) {
			at := b.freedAt
			p.unlink(id)
			p.pushTail(id)
			b.freedAt = at
		}
		id = next
	}
}

// Repin moves the free block caching h, just pinned, to the pinned queue (under WORM).
func (p *Pool) Repin(h uint64) {
	id, ok := p.cached[h]
	if !ok || p.policy != WORM {
		return
	}
	if b := &p.blocks[id]; b.queue >= 0 && b.queue != qPinned {
		at := b.freedAt
		p.unlink(id)
		p.pushTail(id)
		b.freedAt = at
	}
}

// Hits returns how many leading hashes are cached: the blocks a request with these sequence
// hashes can reuse.
func (p *Pool) Hits(hashes []uint64) int {
	if !p.prefixCaching {
		return 0
	}
	for i, h := range hashes {
		if _, ok := p.cached[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// Take references the block caching h, which must be cached, for a request that found it
// (a reuse, which WORM counts), and returns its id.
func (p *Pool) Take(h uint64) int32 {
	id := p.cached[h]
	p.Ref(id)
	p.blocks[id].hits++
	return id
}

// Ref adds a reference to block id, taking it out of its free queue if it was free.
func (p *Pool) Ref(id int32) {
	b := &p.blocks[id]
	if b.ref == 0 && b.queue >= 0 {
		p.unlink(id)
	}
	b.ref++
}

// Allocate takes the block at the head of the free queue, evicting the hash it cached (see
// Evicted), and returns its id, referenced once; false when no block is free.
func (p *Pool) Allocate() (int32, bool) {
	id := p.victim()
	if id == noBlock {
		return noBlock, false
	}
	p.unlink(id)
	b := &p.blocks[id]
	if b.cached {
		if p.cached[b.hash] == id {
			delete(p.cached, b.hash)
		}
		b.cached = false
		p.removed = append(p.removed, b.hash)
	}
	b.ref, b.ephemeral, b.hits = 1, false, 0
	return id, true
}

// Free drops one reference from each block, last block first; blocks nobody holds join the
// tail of their free queue in that order.
func (p *Pool) Free(ids []int32) {
	for i := len(ids) - 1; i >= 0; i-- {
		id := ids[i]
		b := &p.blocks[id]
		b.ref--
		if b.ref == 0 {
			p.pushTail(id)
		}
	}
}

// Store records that block id now holds the full block with sequence hash h and returns
// true if it became the cached copy of h (false when caching is off or another block already
// caches h; the block then stays anonymous and is simply reused once freed).
func (p *Pool) Store(id int32, h uint64) bool {
	if !p.prefixCaching {
		return false
	}
	if _, dup := p.cached[h]; dup {
		return false
	}
	b := &p.blocks[id]
	b.cached, b.hash, b.hits = true, h, 0
	p.cached[h] = id
	return true
}

// Reset forgets every cached hash, as vLLM's reset_prefix_cache does. Like vLLM it refuses
// while any block is in use, and returns whether it reset.
func (p *Pool) Reset() bool {
	if p.NumUsed() != 0 {
		return false
	}
	for i := range p.blocks {
		p.blocks[i].cached = false
	}
	clear(p.cached)
	return true
}
