package kvindex

import (
	"math/bits"
	"sync"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// Tier is where a worker keeps a block.
type Tier uint8

// Tiers, from the fastest.
const (
	GPU Tier = iota
	Host
	Disk
	numTiers
)

// TierOf maps an event's medium to a tier; unknown media count as GPU memory.
func TierOf(medium string) Tier {
	switch medium {
	case "CPU", "cpu", "CPU_TIER", "cpu_tier", "host", "HOST":
		return Host
	case "DISK", "disk", "LOCAL_DISK", "local_disk", "SSD", "ssd":
		return Disk
	}
	return GPU
}

// Weights scale a cached block by its tier when overlaps are scored.
type Weights [numTiers]float64

// DefaultWeights are ARCHITECTURE.md's: GPU 1, host 0.75, disk 0.25.
var DefaultWeights = Weights{1, 0.75, 0.25}

// Index is the global KV index. All methods are safe for concurrent use: ingestion takes a
// write lock, queries a read lock.
type Index struct {
	mu      sync.RWMutex
	shards  []*shard // shard k holds worker slots 64k … 64k+63
	workers map[string]*worker
	slots   []*worker // by slot; nil for a free slot
	hasher  blockhash.Hasher
	scratch []byte
	stats   Stats
}

// Stats count what the index did.
type Stats struct {
	Stored, Removed, Cleared uint64 // block events applied (cleared: AllBlocksCleared)
	// Orphans counts stored blocks skipped because their parent was unknown (events were
	// lost before them); Unknown counts removals of blocks the index never had.
	Orphans, Unknown uint64
	// SkippedGroups counts events for KV cache groups other than full attention.
	SkippedGroups uint64
}

// shard holds the blocks of up to 64 worker slots: per block and tier, a bitset of the slots
// holding it. Most blocks live only in GPU memory, so each tier has its own map and the host
// and disk maps stay small (or empty, and are then never consulted); values, not pointers,
// keep the maps out of the garbage collector's way.
type shard struct {
	tiers [numTiers]map[uint64]uint64
}

func newShard() *shard {
	sh := &shard{}
	for t := range sh.tiers {
		sh.tiers[t] = map[uint64]uint64{}
	}
	return sh
}

// held returns the slots holding seq in any tier, and in GPU memory.
func (sh *shard) held(seq uint64) (any, gpu uint64) {
	gpu = sh.tiers[GPU][seq]
	any = gpu
	if len(sh.tiers[Host]) > 0 {
		any |= sh.tiers[Host][seq]
	}
	if len(sh.tiers[Disk]) > 0 {
		any |= sh.tiers[Disk][seq]
	}
	return any, gpu
}

type worker struct {
	id   string
	slot int
	// engine maps the engine's block hash to kvrelay's sequence hash, per tier.
	engine [numTiers]map[uint64]uint64
}

// New returns an empty index.
func New() *Index {
	return &Index{workers: map[string]*worker{}}
}

// Slot returns the worker's slot (its position in query results), adding the worker if it is
// new. Slots are reused after RemoveWorker.
func (x *Index) Slot(id string) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.workerLocked(id).slot
}

func (x *Index) workerLocked(id string) *worker {
	if w, ok := x.workers[id]; ok {
		return w
	}
	slot := len(x.slots)
	for i, w := range x.slots {
		if w == nil {
			slot = i
			break
		}
	}
	w := &worker{id: id, slot: slot}
	for t := range w.engine {
		w.engine[t] = map[uint64]uint64{}
	}
	if slot == len(x.slots) {
		x.slots = append(x.slots, w)
	} else {
		x.slots[slot] = w
	}
	for len(x.shards) <= slot/64 {
		x.shards = append(x.shards, newShard())
	}
	x.workers[id] = w
	return w
}

// Workers returns the worker ids by slot ("" for a free slot).
func (x *Index) Workers() []string {
	x.mu.RLock()
	defer x.mu.RUnlock()
	out := make([]string, len(x.slots))
	for i, w := range x.slots {
		if w != nil {
			out[i] = w.id
		}
	}
	return out
}

// engineKey folds an engine hash into the integer the engine maps are keyed by.
func engineKey(h kvevents.Hash) uint64 {
	if h.B == "" {
		return h.U
	}
	return xxh3.HashString(h.B)
}

// Apply applies one batch of a worker's events, in order, and returns the sequence hashes of
// the blocks it stored and removed (appended to the given slices), for replicas downstream.
func (x *Index) Apply(id string, b *kvevents.Batch, stored, removed []Change) ([]Change, []Change) {
	x.mu.Lock()
	defer x.mu.Unlock()
	w := x.workerLocked(id)
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case kvevents.BlockStored:
			stored = x.store(w, ev, stored)
		case kvevents.BlockRemoved:
			removed = x.remove(w, ev, removed)
		case kvevents.AllBlocksCleared:
			removed = x.clearLocked(w, removed)
			x.stats.Cleared++
		}
	}
	return stored, removed
}

// Change is one block entering or leaving a worker's tier.
type Change struct {
	Seq  uint64
	Tier Tier
}

// fullAttention reports whether an event belongs to the KV cache group kvrelay indexes.
// Hybrid models (gpt-oss alternates sliding-window layers) publish one group per attention
// kind; only full attention holds whole prefixes.
func fullAttention(ev *kvevents.Event) bool {
	if ev.KVCacheSpecKind != "" {
		return ev.KVCacheSpecKind == "full_attention" || ev.KVCacheSpecKind == "FullAttentionSpec"
	}
	return !ev.HasGroupIdx || ev.GroupIdx == 0
}

func (x *Index) store(w *worker, ev *kvevents.Event, out []Change) []Change {
	if !fullAttention(ev) {
		x.stats.SkippedGroups++
		return out
	}
	bs := ev.BlockSize
	n := len(ev.BlockHashes)
	if bs <= 0 || len(ev.TokenIDs) < n*bs {
		x.stats.Orphans += uint64(n)
		return out
	}
	tier := TierOf(ev.Medium)
	var parent uint64
	hasParent := false
	if ev.HasParent && !(ev.Parent.B == "" && ev.Parent.U == 0) {
		// Some simulators send 0 for "no parent"; a real parent is found in the maps.
		seq, ok := x.lookupParent(w, engineKey(ev.Parent))
		if !ok {
			x.stats.Orphans += uint64(n)
			return out
		}
		parent, hasParent = seq, true
	}
	sh := x.shards[w.slot/64]
	bit := uint64(1) << (w.slot % 64)
	for i := 0; i < n; i++ {
		extra := x.extraKeys(ev, i)
		local := x.hasher.Local(ev.TokenIDs[i*bs:(i+1)*bs], extra)
		seq := local
		if hasParent {
			seq = blockhash.Chain(parent, local)
		}
		if e := sh.tiers[tier][seq]; e&bit == 0 {
			sh.tiers[tier][seq] = e | bit
			out = append(out, Change{Seq: seq, Tier: tier})
		}
		w.engine[tier][engineKey(ev.BlockHashes[i])] = seq
		parent, hasParent = seq, true
		x.stats.Stored++
	}
	return out
}

// lookupParent finds the sequence hash of an engine block in any tier of the worker.
func (x *Index) lookupParent(w *worker, key uint64) (uint64, bool) {
	for t := range w.engine {
		if seq, ok := w.engine[t][key]; ok {
			return seq, true
		}
	}
	return 0, false
}

// extraKeys returns the bytes folded into block i's local hash: the LoRA adapter and the
// block's extra keys (cache salt, multimodal hashes), as the proxy folds them.
func (x *Index) extraKeys(ev *kvevents.Event, i int) []byte {
	x.scratch = x.scratch[:0]
	if ev.LoraName != "" {
		x.scratch = append(x.scratch, ev.LoraName...)
	}
	if ev.HasExtraKeys && i < len(ev.ExtraKeys) && ev.ExtraKeys[i] != nil {
		x.scratch = append(x.scratch, ev.ExtraKeys[i]...)
	}
	if len(x.scratch) == 0 {
		return nil
	}
	return x.scratch
}

func (x *Index) remove(w *worker, ev *kvevents.Event, out []Change) []Change {
	if !fullAttention(ev) {
		x.stats.SkippedGroups++
		return out
	}
	tier := TierOf(ev.Medium)
	sh := x.shards[w.slot/64]
	bit := uint64(1) << (w.slot % 64)
	for _, h := range ev.BlockHashes {
		k := engineKey(h)
		seq, ok := w.engine[tier][k]
		if !ok {
			x.stats.Unknown++
			continue
		}
		delete(w.engine[tier], k)
		if sh.drop(seq, tier, bit) {
			out = append(out, Change{Seq: seq, Tier: tier})
		}
		x.stats.Removed++
	}
	return out
}

func (x *Index) clearLocked(w *worker, out []Change) []Change {
	sh := x.shards[w.slot/64]
	bit := uint64(1) << (w.slot % 64)
	for t := range w.engine {
		for _, seq := range w.engine[t] {
			if sh.drop(seq, Tier(t), bit) {
				out = append(out, Change{Seq: seq, Tier: Tier(t)})
			}
		}
		w.engine[t] = map[uint64]uint64{}
	}
	return out
}

// drop clears bit from a block's tier and reports whether it was set.
func (sh *shard) drop(seq uint64, tier Tier, bit uint64) bool {
	m := sh.tiers[tier]
	e, ok := m[seq]
	if !ok || e&bit == 0 {
		return false
	}
	if e &^= bit; e == 0 {
		delete(m, seq)
	} else {
		m[seq] = e
	}
	return true
}

// Clear drops every block of a worker (its engine restarted, or its events were lost and
// cannot be replayed) and returns what it dropped.
func (x *Index) Clear(id string, removed []Change) []Change {
	x.mu.Lock()
	defer x.mu.Unlock()
	w, ok := x.workers[id]
	if !ok {
		return removed
	}
	return x.clearLocked(w, removed)
}

// RemoveWorker drops a worker and its blocks and frees its slot.
func (x *Index) RemoveWorker(id string, removed []Change) []Change {
	x.mu.Lock()
	defer x.mu.Unlock()
	w, ok := x.workers[id]
	if !ok {
		return removed
	}
	removed = x.clearLocked(w, removed)
	delete(x.workers, id)
	x.slots[w.slot] = nil
	return removed
}

// Blocks returns how many blocks the worker holds in each tier.
func (x *Index) Blocks(id string) [numTiers]int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	var n [numTiers]int
	if w, ok := x.workers[id]; ok {
		for t := range w.engine {
			n[t] = len(w.engine[t])
		}
	}
	return n
}

// Len returns the number of distinct blocks indexed.
func (x *Index) Len() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	n := 0
	for _, sh := range x.shards {
		n += len(sh.tiers[GPU])
		for seq := range sh.tiers[Host] {
			if _, ok := sh.tiers[GPU][seq]; !ok {
				n++
			}
		}
		for seq := range sh.tiers[Disk] {
			_, g := sh.tiers[GPU][seq]
			_, h := sh.tiers[Host][seq]
			if !g && !h {
				n++
			}
		}
	}
	return n
}

// Stats returns the counters.
func (x *Index) Stats() Stats {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.stats
}

// Match sets overlap[slot] to the tier-weighted number of leading blocks of hashes that the
// worker in that slot holds (a block held in several tiers counts at its fastest), for every
// slot < len(overlap), and returns the largest overlap. It allocates nothing.
func (x *Index) Match(hashes []uint64, overlap []float64, wt Weights) float64 {
	clear(overlap)
	x.mu.RLock()
	defer x.mu.RUnlock()
	best := 0.0
	for k, sh := range x.shards {
		base := 64 * k
		if base >= len(overlap) {
			break
		}
		if b := sh.match(hashes, overlap[base:min(base+64, len(overlap))], wt); b > best {
			best = b
		}
	}
	return best
}

// match walks the chain for one shard's 64 slots. A worker's run lasts while it holds each
// next block in any tier; within the run, blocks outside GPU memory count at their tier's
// weight, which costs work only for the rare blocks that are not in GPU memory.
func (sh *shard) match(hashes []uint64, overlap []float64, wt Weights) float64 {
	var active uint64 = ^uint64(0)
	if len(overlap) < 64 {
		active = uint64(1)<<len(overlap) - 1
	}
	var deficit [64]float64
	n := 0
	for n < len(hashes) && active != 0 {
		h := hashes[n]
		held, gpu := sh.held(h)
		held &= active
		if held == 0 {
			break
		}
		if left := active &^ held; left != 0 {
			sh.close(left, n, overlap, &deficit)
		}
		active = held
		if slow := active &^ gpu; slow != 0 {
			host := sh.tiers[Host][h]
			for s := slow; s != 0; s &= s - 1 {
				i := bits.TrailingZeros64(s)
				w := wt[Disk]
				if host&(1<<i) != 0 {
					w = wt[Host]
				}
				deficit[i] += 1 - w
			}
		}
		n++
	}
	if active != 0 {
		sh.close(active, n, overlap, &deficit)
	}
	best := 0.0
	for _, o := range overlap {
		best = max(best, o)
	}
	return best
}

// close ends the runs of the slots in set at length n.
func (sh *shard) close(set uint64, n int, overlap []float64, deficit *[64]float64) {
	for s := set; s != 0; s &= s - 1 {
		i := bits.TrailingZeros64(s)
		if i < len(overlap) {
			overlap[i] = float64(n) - deficit[i]
		}
	}
}
