package prefix

import (
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/clock"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// Index answers the router's one question: how much of a prompt's block chain each worker
// already holds. Implementations are safe for concurrent use by every event loop.
type Index interface {
	// Match sets overlap[w] to the number of leading blocks of hashes that worker w holds,
	// each block weighted by its storage tier (1 for GPU memory), for every w < len(overlap).
	// It returns the largest overlap. It must not retain hashes or overlap.
	Match(hashes []uint64, overlap []float64) float64
}

// TierIndex is an Index that also tells what each worker's matched run holds below GPU memory
// (host memory and disk), so that a caller can price onboarding those blocks instead of
// weighting them. lower, when not nil, is as long as overlap.
type TierIndex interface {
	Index
	MatchTiers(hashes []uint64, overlap []float64, lower []blockset.Lower) float64
}

// HeldIndex is an Index that counts what each worker holds in GPU memory, whatever prompt
// it belongs to: the blocks a worker would evict to take in more.
type HeldIndex interface {
	Index
	// GPUBlocks returns how many blocks the pool's worker w holds in GPU memory, and false
	// when the index cannot tell.
	GPUBlocks(w int) (int, bool)
}

// TimedTierIndex is a TierIndex whose answer depends on the time, as TimedIndex.
type TimedTierIndex interface {
	TierIndex
	MatchTiersAt(hashes []uint64, overlap []float64, lower []blockset.Lower, now int64) float64
}

// MatchTiersAt is x.MatchTiers at now: x's MatchTiersAt when it has one.
func MatchTiersAt(x TierIndex, hashes []uint64, overlap []float64, lower []blockset.Lower, now int64) float64 {
	if t, ok := x.(TimedTierIndex); ok {
		return t.MatchTiersAt(hashes, overlap, lower, now)
	}
	return x.MatchTiers(hashes, overlap, lower)
}

// TimedIndex is an Index whose answer depends on the time (entries expire): MatchAt is Match
// at now, a time of day from package clock's Now that the caller has read already (0: read
// the clock).
type TimedIndex interface {
	Index
	MatchAt(hashes []uint64, overlap []float64, now int64) float64
}

// MatchAt is x.Match at now: x's MatchAt when it has one.
func MatchAt(x Index, hashes []uint64, overlap []float64, now int64) float64 {
	if t, ok := x.(TimedIndex); ok {
		return t.MatchAt(hashes, overlap, now)
	}
	return x.Match(hashes, overlap)
}

// ApproxConfig sizes an approximate index.
type ApproxConfig struct {
	// MaxBlocks bounds the distinct blocks remembered; the least recently touched go first.
	MaxBlocks int
	// TTL is how long a block recorded on a worker is believed cached without a new touch.
	TTL time.Duration
}

// DefaultApproxConfig is 1M blocks for 120 s.
func DefaultApproxConfig() ApproxConfig {
	return ApproxConfig{MaxBlocks: 1 << 20, TTL: 120 * time.Second}
}

// slotsPerBlock is how many workers one block remembers. A block shared by more workers
// forgets the one touched longest ago: the approximate index cares about where a prefix
// was sent recently, and a request routed by it goes to one of those few.
const slotsPerBlock = 4

const none = ^uint32(0)

// Approx is the approximate KV index of a proxy without a control plane. It records the
// blocks of every request as probably cached on its worker (Record; the proxy records once
// the worker has computed them, at the first token), forgets
// them after the TTL or when the bound on blocks is reached (least recently touched first),
// and corrects itself from the cached_tokens the engine reports (Correct): a worker that
// reports fewer cached blocks than predicted evicted them, and because engines evict least
// recently used blocks first, everything recorded on that worker before those blocks were
// last touched is presumed evicted too.
//
// Memory is a slab of entries that grows to MaxBlocks, plus a map; once grown, nothing
// allocates per request.
// Approx is safe for concurrent use: lookups share a read lock, updates take the write lock.
type Approx struct {
	ttl int64 // in ticks

	mu    sync.RWMutex
	max   int
	slots map[uint64]uint32 // block hash → entry index
	ents  []entry           // grows to max entries, then entries are reused
	head  uint32            // most recently touched
	tail  uint32            // least recently touched
	// horizon[w]: touches at or before it are presumed evicted on worker w.
	horizon []uint32
	// blocks[w]: blocks recorded on worker w and not yet dropped (an upper bound: it counts
	// blocks past their TTL or horizon until their entries are reused).
	blocks []int64
}

type entry struct {
	hash       uint64
	prev, next uint32
	n          uint8
	slot       [slotsPerBlock]slot
}

type slot struct {
	worker uint16
	touch  uint32 // ticks since the clock's origin
}

// tick is the index's clock unit: 1 ms, counted from package clock's origin (process start),
// so uint32 ticks last 49 days of the process's uptime.
const tick = time.Millisecond

// NewApprox returns an empty index.
func NewApprox(cfg ApproxConfig) *Approx {
	if cfg.MaxBlocks <= 0 {
		cfg.MaxBlocks = DefaultApproxConfig().MaxBlocks
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultApproxConfig().TTL
	}
	return &Approx{
		ttl:   int64(cfg.TTL / tick),
		max:   cfg.MaxBlocks,
		slots: make(map[uint64]uint32),
		head:  none,
		tail:  none,
	}
}

var _ TimedIndex = (*Approx)(nil)

// ticks is the index's time at now, a time of day from package clock's Now (0: read the
// clock): ticks since the clock's origin.
func ticks(now int64) uint32 {
	var d int64
	if now == 0 {
		d = clock.Mono() / int64(tick)
	} else {
		d = clock.MonoAt(now) / int64(tick)
	}
	if d < 1 {
		return 1 // 0 means never touched
	}
	return uint32(d)
}

// live reports whether a slot still counts at time now.
func (a *Approx) live(s slot, now uint32) bool {
	if int64(now)-int64(s.touch) > a.ttl {
		return false
	}
	return int(s.worker) >= len(a.horizon) || s.touch > a.horizon[s.worker]
}

// Match implements Index. Overlaps are whole blocks (the approximate index knows only GPU
// memory, tier weight 1).
func (a *Approx) Match(hashes []uint64, overlap []float64) float64 {
	return a.matchAt(hashes, overlap, ticks(0))
}

// MatchAt is Match at now, a time of day from package clock's Now (0: read the clock).
func (a *Approx) MatchAt(hashes []uint64, overlap []float64, now int64) float64 {
	return a.matchAt(hashes, overlap, ticks(now))
}

func (a *Approx) matchAt(hashes []uint64, overlap []float64, now uint32) float64 {
	clear(overlap)
	if len(hashes) == 0 || len(overlap) == 0 {
		return 0
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	// Walk the chain once; overlap[w] is how far worker w's run of leading blocks reaches.
	// A worker's run ends at a block the index knows it lacks. A block remembers at most
	// slotsPerBlock workers, so one shared more widely (a common system prompt) forgets some
	// that hold it: past a full block, a worker named later may still be running, and block
	// hashes are chained, so a worker named at block i holds the blocks before it. A worker
	// named at block i therefore extends its run to i+1 if every block since its run ended
	// was full. One map lookup per block.
	best := 0.0
	lastNonFull := -1 // the last block whose slots were not all taken
	for i, h := range hashes {
		idx, ok := a.slots[h]
		if !ok {
			break
		}
		e := &a.ents[idx]
		advanced := false
		for _, s := range e.slot[:e.n] {
			w := int(s.worker)
			if w >= len(overlap) || !a.live(s, now) {
				continue
			}
			if run := int(overlap[w]); run == i || lastNonFull < run {
				overlap[w] = float64(i + 1)
				best = float64(i + 1)
				advanced = true
			}
		}
		if int(e.n) < slotsPerBlock {
			lastNonFull = i
			if !advanced {
				break // no run reaches past this block, and none can resume after it
			}
		}
	}
	return best
}

// Receipt remembers what the index believed when a request was recorded, for Correct.
type Receipt struct {
	worker    int
	predicted int
	// prevTouch is when the last predicted block had been touched on the worker before
	// this request re-recorded it.
	prevTouch uint32
}

// Record notes that worker w now probably caches the blocks of hashes (it was just sent a
// request with this prompt, for which the index had predicted predicted cached blocks on w).
// The receipt lets Correct learn from what the engine then reports.
func (a *Approx) Record(w int, hashes []uint64, predicted int) Receipt {
	return a.RecordAt(0, w, hashes, predicted)
}

// RecordAt is Record at now, a time of day from package clock's Now (0: read the clock).
func (a *Approx) RecordAt(now int64, w int, hashes []uint64, predicted int) Receipt {
	r := Receipt{worker: w, predicted: min(predicted, len(hashes))}
	if w < 0 || w > 0xffff {
		return r
	}
	t := ticks(now)
	a.mu.Lock()
	defer a.mu.Unlock()
	if r.predicted > 0 {
		if idx, ok := a.slots[hashes[r.predicted-1]]; ok {
			e := &a.ents[idx]
			for _, s := range e.slot[:e.n] {
				if int(s.worker) == w {
					r.prevTouch = s.touch
				}
			}
		}
	}
	for _, h := range hashes {
		a.touch(h, uint16(w), t)
	}
	return r
}

func (a *Approx) touch(h uint64, w uint16, now uint32) {
	idx, ok := a.slots[h]
	if !ok {
		idx = a.alloc()
		e := &a.ents[idx]
		*e = entry{hash: h, prev: none, next: none}
		a.slots[h] = idx
		a.pushFront(idx)
	} else {
		a.unlink(idx)
		a.pushFront(idx)
	}
	e := &a.ents[idx]
	oldest := -1
	for i := range e.slot[:e.n] {
		if e.slot[i].worker == w {
			e.slot[i].touch = max(e.slot[i].touch, now) // a pin's later touch stays
			return
		}
		if oldest < 0 || e.slot[i].touch < e.slot[oldest].touch {
			oldest = i
		}
	}
	a.count(w, 1)
	if int(e.n) < slotsPerBlock {
		e.slot[e.n] = slot{worker: w, touch: now}
		e.n++
		return
	}
	a.count(e.slot[oldest].worker, -1)
	e.slot[oldest] = slot{worker: w, touch: now}
}

func (a *Approx) count(w uint16, d int64) {
	for len(a.blocks) <= int(w) {
		a.blocks = append(a.blocks, 0)
	}
	a.blocks[w] = max(a.blocks[w]+d, 0)
}

// Blocks returns how many blocks the index holds for worker w (an upper bound on what it
// believes cached there).
func (a *Approx) Blocks(w int) int64 {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if w < 0 || w >= len(a.blocks) {
		return 0
	}
	return a.blocks[w]
}

// alloc takes a new entry, evicting the least recently touched block once the index holds
// its maximum.
func (a *Approx) alloc() uint32 {
	if len(a.ents) < a.max {
		a.ents = append(a.ents, entry{})
		return uint32(len(a.ents) - 1)
	}
	idx := a.tail
	a.unlink(idx)
	e := &a.ents[idx]
	for _, s := range e.slot[:e.n] {
		a.count(s.worker, -1)
	}
	delete(a.slots, e.hash)
	return idx
}

func (a *Approx) pushFront(idx uint32) {
	e := &a.ents[idx]
	e.prev, e.next = none, a.head
	if a.head != none {
		a.ents[a.head].prev = idx
	} else {
		a.tail = idx
	}
	a.head = idx
}

func (a *Approx) unlink(idx uint32) {
	e := &a.ents[idx]
	if e.prev != none {
		a.ents[e.prev].next = e.next
	} else {
		a.head = e.next
	}
	if e.next != none {
		a.ents[e.next].prev = e.prev
	} else {
		a.tail = e.prev
	}
	e.prev, e.next = none, none
}

// Correct feeds back what the worker of receipt r reported for the request with prompt
// chain hashes: it found cachedBlocks cached (cached_tokens / block size).
//
// Fewer than predicted means the worker had evicted the last predicted block (engines evict
// a chain's tail before its head, so the missing blocks form a suffix). Engines evict least
// recently used blocks first, so everything recorded on that worker no later than that
// block's previous touch is presumed evicted too: the worker's horizon moves there. More than
// predicted means the worker holds blocks this index had not seen (sent by another proxy, or
// before this one started); they are recorded.
func (a *Approx) Correct(hashes []uint64, r Receipt, cachedBlocks int) {
	a.CorrectAt(0, hashes, r, cachedBlocks)
}

// CorrectAt is Correct at now, a time of day from package clock's Now (0: read the clock).
func (a *Approx) CorrectAt(now int64, hashes []uint64, r Receipt, cachedBlocks int) {
	w := r.worker
	if w < 0 || w > 0xffff || cachedBlocks == r.predicted {
		return
	}
	cachedBlocks = min(cachedBlocks, len(hashes))
	a.mu.Lock()
	defer a.mu.Unlock()
	if cachedBlocks > r.predicted {
		t := ticks(now)
		for _, h := range hashes[:cachedBlocks] {
			a.touch(h, uint16(w), t)
		}
		return
	}
	for len(a.horizon) <= w {
		a.horizon = append(a.horizon, 0)
	}
	// A pin's touch lies ahead; the horizon never does (it would bury what is recorded
	// next). The blocks the engine had lost, computed again now, are cached but no longer
	// pinned.
	t := ticks(now)
	if hz := min(r.prevTouch, t-1); hz > a.horizon[w] {
		a.horizon[w] = hz
	}
	for _, h := range hashes[cachedBlocks:r.predicted] {
		if idx, ok := a.slots[h]; ok {
			e := &a.ents[idx]
			for i := range e.slot[:e.n] {
				if int(e.slot[i].worker) == w {
					e.slot[i].touch = min(e.slot[i].touch, t)
				}
			}
		}
	}
}

// PinAt records that worker w keeps the blocks of hashes (recorded there already) for ttl
// after now, a time of day from package clock's Now (0: read the clock), as an engine keeps
// a prompt pinned by nvext.cache_control: they stay matched past the index's TTL, and past
// the evictions a smaller cached_tokens implies, until the pin lapses.
func (a *Approx) PinAt(now int64, w int, hashes []uint64, ttl time.Duration) {
	extra := int64(ttl/tick) - a.ttl
	if w < 0 || w > 0xffff || extra <= 0 {
		return
	}
	until := uint32(min(int64(ticks(now))+extra, 1<<32-1))
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, h := range hashes {
		idx, ok := a.slots[h]
		if !ok {
			continue
		}
		e := &a.ents[idx]
		for i := range e.slot[:e.n] {
			if int(e.slot[i].worker) == w {
				e.slot[i].touch = max(e.slot[i].touch, until)
			}
		}
	}
}

// Forget drops everything recorded on worker w (it restarted, or left the fleet).
func (a *Approx) Forget(w int) {
	if w < 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for len(a.horizon) <= w {
		a.horizon = append(a.horizon, 0)
	}
	a.horizon[w] = ticks(0)
	if w < len(a.blocks) {
		a.blocks[w] = 0
	}
}

// Len returns the number of distinct blocks remembered.
func (a *Approx) Len() int {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return len(a.slots)
}
