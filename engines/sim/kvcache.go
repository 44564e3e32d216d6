package sim

// blockPool is the paged KV cache of one worker, modelled on vLLM's BlockPool: a fixed array
// of blocks, reference-counted while requests hold them, a free queue ordered for eviction,
// and a map from sequence hash to the block that caches it.
//
// Freed blocks keep their hash and stay findable until they are reused. Allocation takes the
// block at the head of the free queue, evicting what it cached. A finished request frees its
// blocks in reverse order, so that the tail of its chain is evicted before its head: a later
// request that shares only the beginning of the prompt still finds it.
//
// A blockPool is owned by its engine's scheduler goroutine and is not safe for concurrent use.
type blockPool struct {
	blockSize     int
	prefixCaching bool
	blocks        []kvBlock
	head, tail    int32 // free queue: head is evicted first
	numFree       int
	cached        map[uint64]int32
	// removed collects the hashes evicted since the caller last reset it, in order.
	removed []uint64
}

type kvBlock struct {
	ref        int32
	prev, next int32
	inFree     bool
	cached     bool
	hash       uint64
}

const noBlock int32 = -1

func newBlockPool(numBlocks, blockSize int, prefixCaching bool) *blockPool {
	p := &blockPool{
		blockSize:     blockSize,
		prefixCaching: prefixCaching,
		blocks:        make([]kvBlock, numBlocks),
		head:          noBlock,
		tail:          noBlock,
		cached:        make(map[uint64]int32, numBlocks),
	}
	for i := range p.blocks {
		p.blocks[i] = kvBlock{prev: noBlock, next: noBlock}
		p.pushTail(int32(i))
	}
	return p
}

func (p *blockPool) numBlocks() int { return len(p.blocks) }

// numUsed is the number of blocks some request holds.
func (p *blockPool) numUsed() int { return len(p.blocks) - p.numFree }

// usage is the fraction of blocks in use, vLLM's kv_cache_usage_perc.
func (p *blockPool) usage() float64 { return float64(p.numUsed()) / float64(len(p.blocks)) }

func (p *blockPool) pushTail(id int32) {
	b := &p.blocks[id]
	b.prev, b.next, b.inFree = p.tail, noBlock, true
	if p.tail != noBlock {
		p.blocks[p.tail].next = id
	} else {
		p.head = id
	}
	p.tail = id
	p.numFree++
}

func (p *blockPool) unlink(id int32) {
	b := &p.blocks[id]
	if b.prev != noBlock {
		p.blocks[b.prev].next = b.next
	} else {
		p.head = b.next
	}
	if b.next != noBlock {
		p.blocks[b.next].prev = b.prev
	} else {
		p.tail = b.prev
	}
	b.prev, b.next, b.inFree = noBlock, noBlock, false
	p.numFree--
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

// canTake reports whether the first nHit cached blocks of hashes can be taken and nNew more
// allocated: taking a cached block that sits in the free queue removes it from what new
// allocations can use.
func (p *blockPool) canTake(hashes []uint64, nHit, nNew int) bool {
	avail := p.numFree
	for _, h := range hashes[:nHit] {
		if p.blocks[p.cached[h]].ref == 0 {
			avail--
		}
	}
	return nNew <= avail
}

// take references the cached block of hash h and appends its id to dst.
func (p *blockPool) take(dst []int32, h uint64) []int32 {
	id := p.cached[h]
	p.ref(id)
	return append(dst, id)
}

func (p *blockPool) ref(id int32) {
	b := &p.blocks[id]
	if b.ref == 0 && b.inFree {
		p.unlink(id)
	}
	b.ref++
}

// allocate takes the block at the head of the free queue, evicting its cached hash, and
// appends its id to dst. It returns false when no block is free.
func (p *blockPool) allocate(dst []int32) ([]int32, bool) {
	id := p.head
	if id == noBlock {
		return dst, false
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
	b.ref = 1
	return append(dst, id), true
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
	b.cached, b.hash = true, h
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
