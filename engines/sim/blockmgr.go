package sim

import (
	"slices"
	"sort"
	"time"

	"github.com/kvrelay/kvrelay/engines/sim/internal/blockpool"
)

// blockManager owns the engine's KV block memory, as vLLM's KVCacheManager does: the GPU
// tier (G1, a blockpool.Pool), the staging slots through which a peer reads blocks of the
// tiers below, and, when configured, host memory (G2) and disk (G3) below the GPU, with the
// eviction classes and pins of Config.Eviction. It is the only code that allocates, frees,
// caches, references or evicts a block, and the only code that writes a request's block
// table (Request.blocks). The others ask it:
//
//   - the scheduler (scheduler.go) for a prompt's cached prefix (lookup, canAdmit, fitting),
//     for that prefix and room for the next tokens (admit, allocateSlots), to cache the
//     blocks a step computed (cacheBlocks) and to give a request's blocks back (free), each
//     step between beginStep and endStep (which publishes the step's evictions);
//   - the KV connector's side (pd.go, peer.go): a decode leg or peer fetch takes its cached
//     prefix (gpuHits, takeCached) and allocates the blocks it pulls into (allocateSlots); a
//     finished prefill leg's blocks pass to its hold (detach) until the decoder read them
//     (release); a peer export holds a cached prefix (exportPrefix, stage), released alike.
//
// They read Request.blocks, to name block ids to the KV connector, and never write it.
// TestBlockOwnership fails when a file outside blockmgr*.go touches the pool, the staging
// slots or a block table, or calls a blockManager method outside this API; the pool's free
// queues and block table are package blockpool's own, out of the engine's reach.
//
// A block is found by its sequence hash in whichever tier holds it; one found below the GPU
// is brought back (onboarded) into a GPU block at a cost the step model charges. Blocks move
// down as Config.OffloadOn says — copied to host as they are stored, or when the GPU evicts
// them — and from host to disk when host evicts them, if they were reused at least
// Config.DiskAdmitMinHits times (one-shot blocks do not wear the disk). Every move is a KV
// event of its tier (medium GPU, CPU or DISK); a block moving down is stored below before it
// is removed above, so an index that follows the events never loses it in between.
//
// A blockManager is owned by its engine's scheduler goroutine.
type blockManager struct {
	cfg     *Config
	pool    *blockpool.Pool
	host    *lowerTier // nil: no host tier
	disk    *lowerTier // nil: no disk tier
	metrics *Metrics
	// staging are the free staging slots, by block id (Config.NumGPUBlocks on): a host or
	// disk block exported to a peer is read from one (see stage).
	staging []int32

	// meta describes every block some tier holds, when tiers or pins are in use (tiered).
	meta    map[uint64]*blockMeta
	tiered  bool
	now     int64 // scheduler clock, Unix nanoseconds
	events  *[]CacheEvent
	pinList []uint64 // hashes pinned (some lapsed, swept by expirePins)
	through []uint64 // stored on the GPU, to copy to host (writeThrough)
	src     []uint8  // admit's scratch: the tier of each hit block
	pinned  int      // hashes pinned now
	maxPins int
	nextPin int64 // earliest pin expiry, 0 when none

	stats tierCounters
	// writeOnce is what the engine learned of whether generated blocks are resent.
	writeOnce writeOnceEstimate
}

// noBlock stands for a block id not allocated yet.
const noBlock int32 = -1

// newBlockManager builds the block memory of cfg: its GPU pool, staging slots and tiers. The
// events it makes are appended to *events.
func newBlockManager(cfg *Config, metrics *Metrics, events *[]CacheEvent) (*blockManager, error) {
	policy := blockpool.LRU
	if cfg.Eviction == EvictWORM {
		policy = blockpool.WORM
	}
	m := &blockManager{
		cfg:     cfg,
		pool:    blockpool.New(cfg.NumGPUBlocks, cfg.EnablePrefixCaching, policy),
		metrics: metrics,
		events:  events,
	}
	for j := cfg.StagingSlots() - 1; j >= 0; j-- {
		m.staging = append(m.staging, int32(cfg.NumGPUBlocks+j))
	}
	if cfg.CPUOffloadBlocks > 0 {
		m.host = newLowerTier(MediumCPU, cfg.CPUOffloadBlocks)
	}
	if cfg.DiskOffloadDir != "" && cfg.DiskOffloadBlocks > 0 {
		d, err := newDiskTier(cfg.DiskOffloadDir, cfg.DiskOffloadBlocks, cfg.SlotBytes(), cfg.DiskFsync, cfg.DiskShared)
		if err != nil {
			return nil, err
		}
		m.disk = d
	}
	m.tiered = m.host != nil || m.disk != nil || cfg.Eviction == EvictWORM
	if m.tiered {
		m.meta = make(map[uint64]*blockMeta, cfg.NumGPUBlocks)
		m.maxPins = int(cfg.MaxPinnedFraction * float64(cfg.NumGPUBlocks))
		m.pool.SetPinned(m.isPinned)
	}
	return m, nil
}

// setClock sets the scheduler clock for the step being planned and lets lapsed pins go.
func (m *blockManager) setClock(now time.Time) {
	m.now = now.UnixNano()
	m.pool.SetClock(m.now)
	if m.nextPin != 0 && m.now >= m.nextPin {
		m.expirePins()
	}
}

// beginStep starts planning a step at now: the clock of pins and eviction ages is set, and
// the step's evictions are collected from here to endStep.
func (m *blockManager) beginStep(now time.Time) {
	m.setClock(now)
	m.pool.ClearEvicted()
}

// endStep moves the blocks the step's allocations evicted from the GPU down where they belong
// (see evicted) and appends their removal from the GPU to the events.
func (m *blockManager) endStep() { m.flushEvicted() }

// flushEvicted appends the removal from the GPU of the blocks evicted since the last flush.
// It runs before every event that stores blocks on the GPU as well as at the end of a step,
// so that events keep the engine's order: a block evicted and cached again in one step is
// removed, then stored, and an index that counts copies (vLLM announces each physical copy
// and each eviction) ends holding it once.
func (m *blockManager) flushEvicted() {
	ev := m.pool.Evicted()
	if len(ev) == 0 {
		return
	}
	removed := m.evicted(slices.Clone(ev))
	m.pool.ClearEvicted()
	if len(removed) > 0 {
		*m.events = append(*m.events, CacheEvent{Kind: BlocksRemoved, Medium: MediumGPU, Hashes: removed})
	}
}

// usage is the fraction of GPU blocks in use, vLLM's kv_cache_usage_perc.
func (m *blockManager) usage() float64 { return m.pool.Usage() }

// numUsed is the number of GPU blocks some request or hold references.
func (m *blockManager) numUsed() int { return m.pool.NumUsed() }

// numFree is the number of GPU blocks nothing references (cached or not).
func (m *blockManager) numFree() int { return m.pool.NumFree() }

// onGPU reports whether the GPU tier caches h.
func (m *blockManager) onGPU(h uint64) bool {
	_, ok := m.pool.Cached(h)
	return ok
}

// lookup counts the leading hashes some tier holds: the blocks a request can reuse, G1's
// referenced, the others onboarded.
func (m *blockManager) lookup(hashes []uint64) int {
	if !m.pool.PrefixCaching() {
		return 0
	}
	if !m.tiered || (m.host == nil && m.disk == nil) {
		return m.pool.Hits(hashes)
	}
	for i, h := range hashes {
		if m.onGPU(h) {
			continue
		}
		if (m.host != nil && m.host.has(h)) || (m.disk != nil && m.disk.has(h)) {
			continue
		}
		return i
	}
	return len(hashes)
}

// capLoad limits a lookup's hit blocks for a request that caps what it loads from host or
// disk (Params.LimitLoad): the GPU's leading hits, then at most MaxLoadTokens worth of
// blocks from below.
func (m *blockManager) capLoad(r *Request, hit int) int {
	if !r.Params.LimitLoad || hit == 0 {
		return hit
	}
	gpu := m.pool.Hits(r.hashes[:hit])
	capped := min(hit, gpu+r.Params.MaxLoadTokens/m.cfg.BlockSize)
	if capped < hit && !r.admitted {
		m.stats.loadCapped.Add(int64(hit - capped))
	}
	return capped
}

// fitting returns the longest prefix of r's first hit blocks (found by lookup, which
// canAdmit refused) that canAdmit takes with the next chunk of at most budget tokens after
// it, counting the lower-tier blocks it leaves to be computed; -1 when none does, or when
// all hit blocks are on the GPU (then the request waits for blocks, as vLLM's does).
func (m *blockManager) fitting(r *Request, hit, budget int) int {
	if m.host == nil && m.disk == nil {
		return -1
	}
	bs := m.cfg.BlockSize
	fits := func(h int) bool {
		n := min(len(r.tokens)-h*bs, budget)
		return m.canAdmit(r.hashes, h, (h*bs+n+bs-1)/bs-h)
	}
	gpu := m.pool.Hits(r.hashes[:hit])
	if gpu == hit || !fits(gpu) {
		return -1
	}
	// The last that fits: fits(gpu) holds, fits(hit) does not, and fits is monotone.
	lo := gpu + sort.Search(hit-gpu, func(i int) bool { return !fits(gpu + i) }) - 1
	m.stats.onboardSkipped.Add(int64(hit - lo))
	m.metrics.onboardSkipped(hit - lo)
	return lo
}

// canAdmit reports whether the first hit blocks of hashes (found by lookup) and nNew more can
// be had: GPU hits sitting in a free queue leave it, and each block onboarded from below
// takes a free one, as each new block does.
func (m *blockManager) canAdmit(hashes []uint64, hit, nNew int) bool {
	avail, need := m.pool.NumFree(), nNew
	for _, h := range hashes[:hit] {
		id, ok := m.pool.Cached(h)
		switch {
		case !ok:
			need++
		case !m.pool.InUse(id):
			avail--
		}
	}
	return need <= avail
}

// admit gives r its first hit blocks (found by lookup, which canAdmit accepted): the GPU's
// referenced, the others allocated and loaded from host or disk (and stored in the GPU tier,
// with their events). It returns how many it gave, fewer than hit when a disk block could not
// be read back (the request computes the rest), and adds the onboarding time to *onboard.
// Pins are renewed on every block hit, and a request asking for a pin pins what it found.
//
// As vLLM's allocate_slots touches a request's computed blocks before it allocates any new
// one, admit first finds every hit block's tier (reading disk blocks back), then references
// the GPU hits, and only then allocates for the blocks it brings back: an allocation evicts
// the block at the head of the free queue, which may be a GPU hit later in the prefix.
func (m *blockManager) admit(r *Request, hit int, onboard *time.Duration) int {
	if !r.admitted && (m.host != nil || m.disk != nil) {
		m.metrics.externalQuery(r.promptLen)
	}
	// Where each block is: tierGPU, tierHost or tierDisk (indices of TierStats.CachedByTier).
	src := m.src[:0]
	var diskRead time.Duration
	got := hit
	for i, h := range r.hashes[:hit] {
		if m.onGPU(h) {
			src = append(src, tierGPU)
			continue
		}
		if m.host != nil && m.host.has(h) {
			src = append(src, tierHost)
			continue
		}
		if m.disk == nil || !m.disk.has(h) {
			got = i // lookup found it: cannot happen, as nothing evicts between the two
			break
		}
		start := time.Now()
		n, err := m.disk.read(h)
		diskRead += time.Since(start)
		m.metrics.diskRead(n)
		m.stats.diskRead.Add(int64(n))
		if err != nil {
			m.diskFailed(h, err)
			got = i
			break
		}
		src = append(src, tierDisk)
	}
	m.src = src
	for i, h := range r.hashes[:got] {
		if src[i] == tierGPU {
			r.blocks = append(r.blocks, m.pool.Take(h))
		} else {
			r.blocks = append(r.blocks, noBlock) // allocated below
		}
	}
	base := len(r.blocks) - got
	for i, h := range r.hashes[:got] {
		if src[i] == tierGPU {
			continue
		}
		id, ok := m.pool.Allocate()
		if !ok {
			// canAdmit counted this block: cannot happen. Compute from here, returning the
			// GPU hits taken after it.
			m.pool.Free(slices.DeleteFunc(r.blocks[base+i+1:], func(id int32) bool { return id == noBlock }))
			r.blocks = r.blocks[:base+i]
			got = i
			break
		}
		r.blocks[base+i] = id
		m.pool.Store(id, h)
	}
	var blocks [3]int
	evStart := -1
	for i := range got {
		blocks[src[i]]++
		switch {
		case src[i] != tierGPU && evStart < 0:
			evStart = i
		case src[i] == tierGPU && evStart >= 0:
			m.storedEvent(r, evStart, i, MediumGPU)
			evStart = -1
		}
	}
	if evStart >= 0 {
		m.storedEvent(r, evStart, got, MediumGPU)
	}
	// Every block is on the GPU now: a hit that writes a block through to disk, evicting
	// another there, cannot make this prefix lose one.
	for _, h := range r.hashes[:got] {
		m.hit(h)
	}
	if !r.admitted {
		// Counted once per request, as its cached tokens are: not again when a preempted
		// request comes back.
		m.countHits(blocks)
	}
	*onboard += m.onboardTime(blocks[tierHost], blocks[tierDisk], diskRead)
	if r.Params.PinTTL > 0 {
		for _, h := range r.hashes[:got] {
			m.pin(h, r.Params.PinTTL)
		}
	}
	return got
}

// gpuHits counts the leading hashes the GPU tier caches: the prefix takeCached takes.
func (m *blockManager) gpuHits(hashes []uint64) int { return m.pool.Hits(hashes) }

// takeCached gives r, which holds no block, its first hit blocks, cached on the GPU (counted
// by gpuHits): each referenced, its reuse counted and its pin renewed.
func (m *blockManager) takeCached(r *Request, hit int) {
	for _, h := range r.hashes[:hit] {
		r.blocks = append(r.blocks, m.pool.Take(h))
		m.hit(h)
	}
}

// allocateSlots makes r hold at least want blocks, allocating new ones from the free queues,
// as vLLM's allocate_slots does; false when the pool runs out first (r keeps those it got).
// An allocation evicts what the block cached: endStep publishes it.
func (m *blockManager) allocateSlots(r *Request, want int) bool {
	for len(r.blocks) < want {
		id, ok := m.pool.Allocate()
		if !ok {
			return false
		}
		r.blocks = append(r.blocks, id)
	}
	return true
}

// cacheBlocks caches r's newly computed full blocks, as vLLM's cache_full_blocks does: each
// becomes the GPU's cached copy of its hash unless another block already is one (then it
// stays anonymous), announced in BlockStored events, and, offloading on store, is copied to
// host after.
func (m *blockManager) cacheBlocks(r *Request) {
	bs := m.cfg.BlockSize
	full := min(r.numComputed/bs, len(r.hashes))
	start := -1
	for b := r.numStored; b < full; b++ {
		if m.pool.Store(r.blocks[b], r.hashes[b]) {
			m.stored(r, b, r.blocks[b])
			if start < 0 {
				start = b
			}
			continue
		}
		if start >= 0 {
			m.storedEvent(r, start, b, MediumGPU)
			start = -1
		}
	}
	if start >= 0 {
		m.storedEvent(r, start, full, MediumGPU)
	}
	r.numStored = max(r.numStored, full)
	if len(m.through) > 0 {
		m.writeThrough()
	}
}

// free gives back every block r holds, GPU blocks last first (the tail of a chain is evicted
// before its head; the cached ones stay findable until then), staging slots to the free
// ones, and empties r's block table.
func (m *blockManager) free(r *Request) {
	m.release(r.blocks)
	r.blocks = r.blocks[:0]
}

// detach hands r's blocks, still referenced, to the caller and empties r's block table: a
// finished prefill leg's blocks held for its decoder, or a prefix held for a peer. The caller
// gives them back with release.
func (m *blockManager) detach(r *Request) []int32 {
	ids := slices.Clone(r.blocks)
	r.blocks = r.blocks[:0]
	return ids
}

// release gives back blocks held apart from a request (see detach): GPU blocks to the pool,
// last first, staging slots to the free ones.
func (m *blockManager) release(ids []int32) {
	n := int32(m.cfg.NumGPUBlocks)
	staged := func(id int32) bool { return id >= n }
	if !slices.ContainsFunc(ids, staged) {
		m.pool.Free(ids) // a request's, a prefill leg's, or an export of GPU blocks alone
		return
	}
	gpu := make([]int32, 0, len(ids))
	for _, id := range ids {
		if staged(id) {
			m.staging = append(m.staging, id)
		} else {
			gpu = append(gpu, id)
		}
	}
	m.pool.Free(gpu)
}

// exportPrefix holds for a peer the longest prefix of hashes that some tier of this engine
// holds, as the blocks of r (which holds none): GPU blocks referenced, host and disk blocks
// each through a staging slot (see stage). It returns the prefix's length in blocks.
func (m *blockManager) exportPrefix(r *Request, hashes []uint64) int {
	for n, h := range hashes {
		id, ok := m.pool.Cached(h)
		if ok {
			m.pool.Ref(id)
		} else if id, ok = m.stage(h); !ok {
			return n
		}
		r.blocks = append(r.blocks, id)
	}
	return len(hashes)
}

// stage gives block h, held by the host or disk tier, a staging slot to be read from and
// returns the slot's block id (see kvConnector.slot); false when neither tier holds it, its
// file cannot be read back or fails its checksum (then it is dropped from the disk tier),
// or every staging slot is taken. A block below the GPU thus reaches a peer without taking
// one of this worker's GPU blocks, which a busy worker, the usual holder, has none of.
func (m *blockManager) stage(h uint64) (int32, bool) {
	if len(m.staging) == 0 || !m.readable(h) {
		return 0, false
	}
	id := m.staging[len(m.staging)-1]
	m.staging = m.staging[:len(m.staging)-1]
	return id, true
}

// reset forgets every block of every tier, as ResetPrefixCache does; false (and nothing
// done) while requests hold GPU blocks.
func (m *blockManager) reset() bool {
	if !m.pool.Reset() {
		return false
	}
	if m.host != nil {
		m.host.clear()
	}
	if m.disk != nil {
		m.disk.clear()
	}
	if m.tiered {
		clear(m.meta)
		m.pinList, m.pinned, m.nextPin = m.pinList[:0], 0, 0
	}
	return true
}

// storedEvent appends the BlockStored event of r's blocks [from, to) in medium.
func (m *blockManager) storedEvent(r *Request, from, to int, medium string) {
	if medium == MediumGPU {
		m.flushEvicted()
	}
	bs := m.cfg.BlockSize
	ev := CacheEvent{Kind: BlocksStored, Medium: medium, Hashes: r.hashes[from:to], Tokens: r.tokens[from*bs : to*bs], First: from}
	if !r.keys.Empty() {
		ev.Keys = &r.keys
	}
	if from > 0 {
		ev.Parent, ev.HasParent = r.hashes[from-1], true
	}
	*m.events = append(*m.events, ev)
}

// metaEvent appends the BlockStored event of one block in medium, from its metadata.
func (m *blockManager) metaEvent(h uint64, b *blockMeta, medium string) {
	*m.events = append(*m.events, CacheEvent{
		Kind: BlocksStored, Medium: medium, Hashes: []uint64{h}, Tokens: b.tokens,
		Parent: b.parent, HasParent: b.hasParent, Keys: b.keys, First: b.first,
	})
}

func (m *blockManager) removedEvent(h uint64, medium string) {
	evs := *m.events
	if n := len(evs); n > 0 && evs[n-1].Kind == BlocksRemoved && evs[n-1].Medium == medium {
		evs[n-1].Hashes = append(evs[n-1].Hashes, h)
		return
	}
	*m.events = append(evs, CacheEvent{Kind: BlocksRemoved, Medium: medium, Hashes: []uint64{h}})
}

// EachBlock calls fn for every block some tier of the engine holds, by its sequence hash
// (package blockhash) and medium. It reads the scheduler's state: call it only from the
// goroutine that drives StepAt, between steps, never while Run runs.
func (e *Engine) EachBlock(fn func(seq uint64, medium string)) {
	e.kvm.pool.Each(func(h uint64) { fn(h, MediumGPU) })
	for _, t := range []*lowerTier{e.kvm.host, e.kvm.disk} {
		if t != nil {
			for h := range t.entries {
				fn(h, t.medium)
			}
		}
	}
}
