package kvindex

import (
	"sync"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// Tier, the tiers and their weights are those of package blockset.
type (
	Tier    = blockset.Tier
	Weights = blockset.Weights
)

// Tiers, from the fastest.
const (
	GPU      = blockset.GPU
	Host     = blockset.Host
	Disk     = blockset.Disk
	numTiers = blockset.NumTiers
)

// TierOf maps an event's medium to a tier.
func TierOf(medium string) Tier { return blockset.TierOf(medium) }

// DefaultWeights are GPU 1, host 0.75, disk 0.25.
var DefaultWeights = blockset.DefaultWeights

// Index is the global KV index. All methods are safe for concurrent use: ingestion takes a
// write lock, queries a read lock.
type Index struct {
	mu      sync.RWMutex
	set     blockset.Set
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
	// BadExtraKeys counts blocks whose extra_keys entry did not decode (keyed so that they
	// match no request).
	BadExtraKeys uint64
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

// Apply applies one batch of a worker's events, in order, and appends to out the changes it
// made to the index, in the order it made them, for replicas downstream.
func (x *Index) Apply(id string, b *kvevents.Batch, out []Change) []Change {
	x.mu.Lock()
	defer x.mu.Unlock()
	w := x.workerLocked(id)
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case kvevents.BlockStored:
			out = x.store(w, ev, out)
		case kvevents.BlockRemoved:
			out = x.remove(w, ev, out)
		case kvevents.AllBlocksCleared:
			out = x.clearLocked(w, out)
			x.stats.Cleared++
		}
	}
	return out
}

// Change is one block entering (or, Removed, leaving) a worker's tier.
type Change struct {
	Seq     uint64
	Tier    Tier
	Removed bool
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
	for i := 0; i < n; i++ {
		extra := x.extraKeys(ev, i)
		local := x.hasher.Local(ev.TokenIDs[i*bs:(i+1)*bs], extra)
		seq := local
		if hasParent {
			seq = blockhash.Chain(parent, local)
		}
		if x.set.Add(seq, w.slot, tier) {
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

// extraKeys returns the bytes folded into block i's local hash, by blockhash's one rule:
// the block's extra_keys entry (adapter, multimodal inputs, the first block's cache salt) in
// canonical form; an engine that sends no extra_keys but names a LoRA adapter keys every
// block with the adapter alone. An entry that does not decode gets a key no request has.
func (x *Index) extraKeys(ev *kvevents.Event, i int) []byte {
	x.scratch = x.scratch[:0]
	switch {
	case ev.HasExtraKeys && i < len(ev.ExtraKeys) && ev.ExtraKeys[i] != nil:
		v, err := ev.ExtraKeys[i].Decode()
		if err != nil {
			x.stats.BadExtraKeys++
			return append(x.scratch, '?')
		}
		x.scratch = blockhash.AppendKey(x.scratch, v)
	case !ev.HasExtraKeys && ev.LoraName != "":
		k := blockhash.Keys{LoRA: ev.LoraName}
		x.scratch = k.Block(x.scratch, 0)
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
	for _, h := range ev.BlockHashes {
		k := engineKey(h)
		seq, ok := w.engine[tier][k]
		if !ok {
			x.stats.Unknown++
			continue
		}
		delete(w.engine[tier], k)
		if x.set.Remove(seq, w.slot, tier) {
			out = append(out, Change{Seq: seq, Tier: tier, Removed: true})
		}
		x.stats.Removed++
	}
	return out
}

func (x *Index) clearLocked(w *worker, out []Change) []Change {
	for t := range w.engine {
		for _, seq := range w.engine[t] {
			if x.set.Remove(seq, w.slot, Tier(t)) {
				out = append(out, Change{Seq: seq, Tier: Tier(t), Removed: true})
			}
		}
		w.engine[t] = map[uint64]uint64{}
	}
	return out
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
	return x.set.Len()
}

// Stats returns the counters.
func (x *Index) Stats() Stats {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.stats
}

// Match sets overlap[slot] to the tier-weighted number of leading blocks of hashes that the
// worker in that slot holds, for every slot < len(overlap), and returns the largest overlap.
// It allocates nothing.
func (x *Index) Match(hashes []uint64, overlap []float64, wt Weights) float64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.set.Match(hashes, overlap, wt)
}

// Each calls fn for every (block, slot, tier) entry, under the read lock: fn must not call
// back into the index.
func (x *Index) Each(fn func(seq uint64, slot int, tier Tier)) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	x.set.Each(fn)
}
