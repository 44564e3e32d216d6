package prefix

import (
	"sync"

	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// Replica is a proxy's copy of the control plane's KV index, kept current by the index
// journal (it is the journal client's Sink). The control plane names workers by slot; the
// proxy's router names them by their position in its pool, so the proxy tells the replica
// which slot each pool position has (SetSlots) whenever its pool changes.
//
// Match takes a read lock and allocates nothing; the journal applies under the write lock, a
// batch at a time. Safe for concurrent use.
type Replica struct {
	mu      sync.RWMutex
	set     blockset.Set
	next    *blockset.Set // a snapshot being received, swapped in when complete
	weights blockset.Weights
	slots   []int     // pool position → slot (-1: none)
	pool    sync.Pool // *scratch for concurrent Match calls
}

var (
	_ Index                = (*Replica)(nil)
	_ TierIndex            = (*Replica)(nil)
	_ journal.SnapshotSink = (*Replica)(nil)
	_ HeldIndex            = (*Replica)(nil)
)

// GPUBlocks implements HeldIndex: what the engine's events say the pool's worker w holds in
// GPU memory.
func (r *Replica) GPUBlocks(w int) (int, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if w < 0 || w >= len(r.slots) || r.slots[w] < 0 {
		return 0, false
	}
	return r.set.Held(r.slots[w], blockset.GPU), true
}

// NewReplica returns an empty replica scoring tiers with w.
func NewReplica(w blockset.Weights) *Replica {
	r := &Replica{weights: w}
	r.pool.New = func() any { return &scratch{overlap: make([]float64, 0, 64)} }
	return r
}

// SetWeights changes the tier weights (the routing policy's).
func (r *Replica) SetWeights(w blockset.Weights) {
	r.mu.Lock()
	r.weights = w
	r.mu.Unlock()
}

// SetSlots maps pool positions to index slots: slots[i] is the slot of the pool's worker i,
// or -1 when the control plane gave it none.
func (r *Replica) SetSlots(slots []int) {
	r.mu.Lock()
	r.slots = append(r.slots[:0], slots...)
	r.mu.Unlock()
}

// Reset implements journal.Sink: a snapshot follows. It is built aside while Match keeps
// answering from the current state, and replaces it at SnapshotDone.
func (r *Replica) Reset() {
	r.mu.Lock()
	r.next = &blockset.Set{}
	r.mu.Unlock()
}

// SnapshotDone implements journal.SnapshotSink: the snapshot is complete and takes over.
func (r *Replica) SnapshotDone() {
	r.mu.Lock()
	if r.next != nil {
		r.set, r.next = *r.next, nil
	}
	r.mu.Unlock()
}

// Apply implements journal.Sink.
func (r *Replica) Apply(cs []journal.Change) {
	r.mu.Lock()
	defer r.mu.Unlock()
	set := &r.set
	if r.next != nil {
		set = r.next
	}
	for _, c := range cs {
		switch c.Op {
		case journal.Stored:
			set.Add(c.Seq, int(c.Slot), c.Tier)
		case journal.Removed:
			set.Remove(c.Seq, int(c.Slot), c.Tier)
		case journal.Cleared:
			set.ClearSlot(int(c.Slot))
		}
	}
}

// Len returns the number of distinct blocks in the replica.
func (r *Replica) Len() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.set.Len()
}

// Match implements Index: overlap[i] is the tier-weighted prefix the pool's worker i holds.
func (r *Replica) Match(hashes []uint64, overlap []float64) float64 {
	return r.MatchTiers(hashes, overlap, nil)
}

// MatchTiers implements TierIndex: Match, and lower[i] (when lower is not nil, as long as
// overlap) what worker i's run holds below GPU memory.
func (r *Replica) MatchTiers(hashes []uint64, overlap []float64, lower []blockset.Lower) float64 {
	clear(overlap)
	clear(lower)
	sp := r.pool.Get().(*scratch)
	defer r.pool.Put(sp)
	r.mu.RLock()
	defer r.mu.RUnlock()
	maxSlot := -1
	for _, s := range r.slots {
		maxSlot = max(maxSlot, s)
	}
	if maxSlot < 0 {
		return 0
	}
	if cap(sp.overlap) < maxSlot+1 {
		sp.overlap = make([]float64, maxSlot+1)
	}
	bySlot := sp.overlap[:maxSlot+1]
	var lowerBySlot []blockset.Lower
	if lower != nil {
		if cap(sp.lower) < maxSlot+1 {
			sp.lower = make([]blockset.Lower, maxSlot+1)
		}
		lowerBySlot = sp.lower[:maxSlot+1]
	}
	r.set.MatchTiers(hashes, bySlot, lowerBySlot, r.weights)
	best := 0.0
	for i, s := range r.slots {
		if i < len(overlap) && s >= 0 {
			overlap[i] = bySlot[s]
			if overlap[i] > best { // not the builtin max, slower for its NaN rules
				best = overlap[i]
			}
			if lower != nil && i < len(lower) {
				lower[i] = lowerBySlot[s]
			}
		}
	}
	return best
}

// scratch is one Match call's per-slot space.
type scratch struct {
	overlap []float64
	lower   []blockset.Lower
}
