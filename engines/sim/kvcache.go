package sim

// blockPool is the paged KV cache of one worker (the G1 tier), modelled on vLLM's BlockPool:
// a fixed array of blocks, reference-counted while requests hold them, free queues ordered
// for eviction, and a map from sequence hash to the block that caches it.
//
// Freed blocks keep their hash and stay findable until they are reused. Allocation takes a
// block from the head of a free queue, evicting what it cached. A finished request frees its
// blocks in reverse order, so that the tail of its chain is evicted before its head: a later
// request that shares only the beginning of the prompt still finds it.
//
// Under EvictLRU there is one free queue, least recently freed first (vLLM's policy). Under
// EvictWORM a free block joins the queue of its class, and allocation takes, in order: an
// ephemeral block (generated output nobody will read back); the older of the once-seen and
// the reused queues' heads, a reused block counting as half its age (a block read again
// outranks one of the same age seen once); a pinned block last.
//
// A blockPool is owned by its engine's scheduler goroutine and is not safe for concurrent use.
type blockPool struct {
	blockSize     int
	prefixCaching bool
	eviction      Eviction
	blocks        []kvBlock
	queues        [numQueues]freeQueue
	numFree       int
	cached        map[uint64]int32
	// removed collects the hashes evicted since the caller last reset it, in order.
	removed []uint64
	// now is the scheduler's clock (Unix nanoseconds), set before each step's allocations.
	now int64
	// pinned says whether a hash is pinned now; nil: nothing is.
	pinned func(h uint64) bool
}

// The free queues of a blockPool; EvictLRU uses qOnce alone.
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
	ephemeral  bool  // holds generated output only (EvictWORM evicts it first)
	hits       int32 // requests that found it cached since it was stored
	freedAt    int64 // when it last joined a free queue (pool clock)
	hash       uint64
}

const noBlock int32 = -1

func newBlockPool(numBlocks, blockSize int, prefixCaching bool) *blockPool {
	p := &blockPool{
		blockSize:     blockSize,
		prefixCaching: prefixCaching,
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

func (p *blockPool) numBlocks() int { return len(p.blocks) }

// numUsed is the number of blocks some request holds.
func (p *blockPool) numUsed() int { return len(p.blocks) - p.numFree }

// usage is the fraction of blocks in use, vLLM's kv_cache_usage_perc.
func (p *blockPool) usage() float64 { return float64(p.numUsed()) / float64(len(p.blocks)) }

// queueOf is the free queue block b joins.
func (p *blockPool) queueOf(b *kvBlock) int {
	if p.eviction != EvictWORM || !b.cached {
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

func (p *blockPool) pushTail(id int32) {
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

func (p *blockPool) unlink(id int32) {
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
func (p *blockPool) victim() int32 {
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

// requeue moves the free blocks of the pinned queue whose pins lapsed to their class's queue,
// keeping their order (their age is when they were freed).
func (p *blockPool) requeue() {
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

// repin moves a free block whose hash was just pinned to the pinned queue.
func (p *blockPool) repin(h uint64) {
	id, ok := p.cached[h]
	if !ok || p.eviction != EvictWORM {
		return
	}
	if b := &p.blocks[id]; b.queue >= 0 && b.queue != qPinned {
		at := b.freedAt
		p.unlink(id)
		p.pushTail(id)
		b.freedAt = at
	}
}

// hits returns how many leading hashes are cached: the blocks a request with these sequence
// hashes can reuse.
func (p *blockPool) hits(hashes []uint64) int {
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

// take references the cached block of hash h and appends its id to dst.
func (p *blockPool) take(dst []int32, h uint64) []int32 {
	id := p.cached[h]
	p.ref(id)
	p.blocks[id].hits++
	return append(dst, id)
}

func (p *blockPool) ref(id int32) {
	b := &p.blocks[id]
	if b.ref == 0 && b.queue >= 0 {
		p.unlink(id)
	}
	b.ref++
}

// allocate takes the block at the head of the free queue, evicting its cached hash, and
// appends its id to dst. It returns false when no block is free.
func (p *blockPool) allocate(dst []int32) ([]int32, bool) {
	id, ok := p.allocOne()
	if !ok {
		return dst, false
	}
	return append(dst, id), true
}

// allocOne takes the block at the head of the free queue, evicting its cached hash, and
// returns its id; false when no block is free.
func (p *blockPool) allocOne() (int32, bool) {
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

// free drops one reference from each block, last block first; blocks nobody holds join the
// tail of the free queue in that order.
func (p *blockPool) free(ids []int32) {
	for i := len(ids) - 1; i >= 0; i-- {
		id := ids[i]
		b := &p.blocks[id]
		b.ref--
		if b.ref == 0 {
			p.pushTail(id)
		}
	}
}

// store records that block id now holds the full block with sequence hash h and returns
// true if it became the cached copy of h (false when caching is off or another block already
// caches h; the block then stays anonymous and is simply reused once freed).
func (p *blockPool) store(id int32, h uint64) bool {
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

// reset forgets every cached hash, as vLLM's reset_prefix_cache does. Like vLLM it refuses
// while any block is in use, and returns whether it reset.
func (p *blockPool) reset() bool {
	if p.numUsed() != 0 {
		return false
	}
	for i := range p.blocks {
		p.blocks[i].cached = false
	}
	clear(p.cached)
	return true
}
