package kvindex

import (
	"slices"
	"sync"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/internal/u64map"
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
	Shared   = blockset.Shared
	numTiers = blockset.NumTiers
)

// TierOf maps an event's medium and locality to a tier; ok is false for an unknown medium.
func TierOf(medium, locality string) (Tier, bool) { return blockset.TierOf(medium, locality) }

// DefaultWeights are GPU 1, host 0.75, disk 0.25, shared storage 0.2.
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
	// domains is the storage several workers share, by medium and owner; MaxSharedBlocks
	// bounds the blocks each keeps (0: DefaultMaxSharedBlocks).
	domains         map[string]*domain
	MaxSharedBlocks int
}

// DefaultMaxSharedBlocks bounds the blocks the index keeps for one shared storage: vLLM's
// fs and object tiers announce what they store and never what they delete, so the index
// forgets the oldest first past this many (1M blocks of 16 tokens: 16M tokens, about 2 TB
// of KV for an 8B-class model).
const DefaultMaxSharedBlocks = 1 << 20

// domain is one storage several workers mount (locality REMOTE): a block any of them wrote
// there, every one of them can load, so the index keeps it once and credits it to each
// worker that mounts it. A worker mounts a domain when it first writes to it.
type domain struct {
	copies *copies
	refs   map[uint64]uint32 // kvrelay's seq → engine blocks naming it
	order  []uint64          // seqs in the order they arrived, for MaxSharedBlocks
	mounts []*worker
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
	// UnknownMedium counts blocks stored or removed in a medium kvrelay does not know: not
	// indexed (crediting them as GPU memory would promise hits the engine cannot give).
	UnknownMedium uint64
	// Copies counts stores of a block the same tier (and owner) already held: another
	// physical copy, or an offload chunk announcing it again. Each needs its own removal.
	Copies uint64
	// Placeholders counts blocks announced without their tokens (an offload event naming
	// one hash per chunk, block_size 0): Resolved when the worker had announced the same
	// engine hash with its tokens in another tier, so the block is known; otherwise dropped
	// (a hash alone cannot be matched to a prompt, and is never taken for a prefix).
	Placeholders, PlaceholdersResolved uint64
	// SharedExpired counts blocks of shared storage the index forgot past MaxSharedBlocks.
	SharedExpired uint64
}

// store is where a worker keeps copies of blocks: a tier, and in it the secondary tier that
// owns them (vLLM's ownership: two offloading tiers of one medium evict independently).
type store struct {
	tier  Tier
	owner string
}

// copies maps the engine's block hash to kvrelay's sequence hash for one store. extra counts
// the copies of a block beyond the first (most blocks have one, so it stays small).
type copies struct {
	seq   u64map.Map
	extra map[uint64]uint32
}

func newCopies() *copies { return &copies{} }

// addExtra counts one more copy of an engine block the store already holds.
func (c *copies) addExtra(key uint64) {
	if c.extra == nil {
		c.extra = map[uint64]uint32{}
	}
	c.extra[key]++
}

// take drops one copy of the engine block key: its seq, and whether it was the last (the
// store no longer holds the block); ok is false when the store does not hold it.
func (c *copies) take(key uint64) (seq uint64, last, ok bool) {
	if seq, ok = c.seq.Get(key); !ok {
		return 0, false, false
	}
	if n := c.extra[key]; n > 0 {
		// Another copy of the block stays.
		if n == 1 {
			delete(c.extra, key)
		} else {
			c.extra[key] = n - 1
		}
		return seq, false, true
	}
	c.seq.Delete(key)
	return seq, true, true
}

type worker struct {
	id   string
	slot int
	// engine holds the worker's stores with no owner by tier, and owned ones in owned.
	engine  [numTiers]*copies
	owned   map[store]*copies
	domains []*domain // the shared storage it mounts
}

// copiesOf returns the store's copies, creating them when create is set (nil otherwise).
func (w *worker) copiesOf(st store, create bool) *copies {
	if st.owner == "" {
		return w.engine[st.tier]
	}
	c := w.owned[st]
	if c == nil && create {
		if w.owned == nil {
			w.owned = map[store]*copies{}
		}
		c = newCopies()
		w.owned[st] = c
	}
	return c
}

// holds reports whether any store of the tier other than except holds the engine block.
func (w *worker) holds(tier Tier, key uint64, except *copies) bool {
	if c := w.engine[tier]; c != except {
		if _, ok := c.seq.Get(key); ok {
			return true
		}
	}
	for st, c := range w.owned {
		if st.tier == tier && c != except {
			if _, ok := c.seq.Get(key); ok {
				return true
			}
		}
	}
	return false
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

// AddWorkers adds the workers of ids the index does not hold yet, in that order, each in the
// lowest free slot, under one lock: callers that race add them in the same order.
func (x *Index) AddWorkers(ids []string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, id := range ids {
		x.workerLocked(id)
	}
}

// SlotOf returns the worker's slot, without adding it: ok is false for a worker the index
// does not hold.
func (x *Index) SlotOf(id string) (slot int, ok bool) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	w, ok := x.workers[id]
	if !ok {
		return 0, false
	}
	return w.slot, true
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
		w.engine[t] = newCopies()
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

// Change is one block entering (or, Removed, leaving) the tier of the worker in Slot, or
// (Cleared) the worker in Slot losing every block it held (Seq and Tier unset). A worker's
// events change its own slot, and for shared storage every slot that mounts it.
type Change struct {
	Seq     uint64
	Tier    Tier
	Removed bool
	Cleared bool
	Slot    int
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
	n := len(ev.BlockHashes)
	tier, ok := TierOf(ev.Medium, ev.Locality)
	if !ok {
		x.stats.UnknownMedium += uint64(n)
		return out
	}
	var cs *copies
	var d *domain
	if tier == Shared {
		d = x.domainOf(ev.Medium, ev.Ownership)
		out = x.mount(w, d, out)
		cs = d.copies
	} else {
		cs = w.copiesOf(store{tier, ev.Ownership}, true)
	}
	bs := ev.BlockSize
	if bs <= 0 || len(ev.TokenIDs) < n*bs {
		if bs <= 0 || len(ev.TokenIDs) == 0 {
			return x.placeholders(w, ev, tier, cs, d, out)
		}
		x.stats.Orphans += uint64(n)
		return out
	}
	var parent uint64
	hasParent := false
	if ev.HasParent && !(ev.Parent.B == "" && ev.Parent.U == 0) {
		// Some simulators send 0 for "no parent"; a real parent is found in the maps.
		seq, ok := x.lookupParent(w, cs, engineKey(ev.Parent))
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
		if d != nil {
			out = x.addShared(d, engineKey(ev.BlockHashes[i]), seq, out)
		} else {
			out = x.addCopy(w, tier, cs, engineKey(ev.BlockHashes[i]), seq, out)
		}
		parent, hasParent = seq, true
		x.stats.Stored++
	}
	return out
}

// addCopy records one more copy of the engine block key (kvrelay's seq) in the store.
func (x *Index) addCopy(w *worker, tier Tier, cs *copies, key, seq uint64, out []Change) []Change {
	if _, ok := cs.seq.Get(key); ok {
		cs.addExtra(key)
		x.stats.Copies++
		return out
	}
	cs.seq.Put(key, seq)
	if x.set.Add(seq, w.slot, tier) {
		out = append(out, Change{Seq: seq, Tier: tier, Slot: w.slot})
	}
	return out
}

// domainKey names the shared storage of a medium and owner in Index.domains.
func domainKey(medium, owner string) string { return medium + "\x00" + owner }

// domainOf returns the shared storage of a medium and owner, creating it.
func (x *Index) domainOf(medium, owner string) *domain {
	k := domainKey(medium, owner)
	d := x.domains[k]
	if d == nil {
		if x.domains == nil {
			x.domains = map[string]*domain{}
		}
		d = &domain{copies: newCopies(), refs: map[uint64]uint32{}}
		x.domains[k] = d
	}
	return d
}

// mount makes w one of d's workers: every block d holds is credited to it.
func (x *Index) mount(w *worker, d *domain, out []Change) []Change {
	if slices.Contains(w.domains, d) {
		return out
	}
	w.domains = append(w.domains, d)
	d.mounts = append(d.mounts, w)
	return x.creditDomain(w, d, out)
}

// creditDomain adds d's blocks to w's slot.
func (x *Index) creditDomain(w *worker, d *domain, out []Change) []Change {
	for seq := range d.refs {
		if x.set.Add(seq, w.slot, Shared) {
			out = append(out, Change{Seq: seq, Tier: Shared, Slot: w.slot})
		}
	}
	return out
}

// addShared records one more engine block naming seq in shared storage d.
func (x *Index) addShared(d *domain, key, seq uint64, out []Change) []Change {
	cs := d.copies
	if old, ok := cs.seq.Get(key); ok && d.refs[old] > 0 {
		cs.addExtra(key)
		x.stats.Copies++
		return out
	}
	cs.seq.Put(key, seq)
	if d.refs[seq]++; d.refs[seq] > 1 {
		return out
	}
	d.order = append(d.order, seq)
	for _, m := range d.mounts {
		if x.set.Add(seq, m.slot, Shared) {
			out = append(out, Change{Seq: seq, Tier: Shared, Slot: m.slot})
		}
	}
	limit := x.MaxSharedBlocks
	if limit <= 0 {
		limit = DefaultMaxSharedBlocks
	}
	for len(d.refs) > limit && len(d.order) > 0 {
		old := d.order[0]
		d.order = d.order[1:]
		if _, ok := d.refs[old]; !ok {
			continue // removed since
		}
		delete(d.refs, old)
		x.stats.SharedExpired++
		out = x.uncreditShared(d, old, out)
	}
	if len(d.order) > 2*limit {
		// Removals left stale entries behind: keep the live ones, in order.
		d.order = slices.DeleteFunc(d.order, func(s uint64) bool { _, ok := d.refs[s]; return !ok })
	}
	return out
}

// uncreditShared takes seq out of the shared tier of every worker mounting d.
func (x *Index) uncreditShared(d *domain, seq uint64, out []Change) []Change {
	for _, m := range d.mounts {
		if x.set.Remove(seq, m.slot, Shared) {
			out = append(out, Change{Seq: seq, Tier: Shared, Removed: true, Slot: m.slot})
		}
	}
	return out
}

// removeShared applies the removal of engine block key from shared storage d.
func (x *Index) removeShared(d *domain, key uint64, out []Change) []Change {
	seq, last, ok := d.copies.take(key)
	if !ok {
		x.stats.Unknown++
		return out
	}
	x.stats.Removed++
	if !last {
		return out
	}
	n, live := d.refs[seq]
	if !live {
		return out // forgotten past MaxSharedBlocks already
	}
	if n > 1 {
		d.refs[seq] = n - 1
		return out
	}
	delete(d.refs, seq)
	return x.uncreditShared(d, seq, out)
}

// placeholders indexes the blocks of a store event that carries hashes but no tokens: those
// the worker announced with their tokens in another store are the same blocks, copied (into
// shared storage d when not nil); the rest cannot be matched to any prompt and are dropped.
func (x *Index) placeholders(w *worker, ev *kvevents.Event, tier Tier, cs *copies, d *domain, out []Change) []Change {
	for _, h := range ev.BlockHashes {
		x.stats.Placeholders++
		key := engineKey(h)
		seq, ok := x.lookupParent(w, nil, key)
		if !ok {
			continue
		}
		x.stats.PlaceholdersResolved++
		if d != nil {
			out = x.addShared(d, key, seq, out)
		} else {
			out = x.addCopy(w, tier, cs, key, seq, out)
		}
	}
	return out
}

// lookupParent finds the sequence hash of an engine block: in the store the event is for
// first (first may be nil), then in any store of the worker.
func (x *Index) lookupParent(w *worker, first *copies, key uint64) (uint64, bool) {
	if first != nil {
		if seq, ok := first.seq.Get(key); ok {
			return seq, true
		}
	}
	for _, c := range w.engine {
		if seq, ok := c.seq.Get(key); ok {
			return seq, true
		}
	}
	for _, c := range w.owned {
		if seq, ok := c.seq.Get(key); ok {
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
	tier, ok := TierOf(ev.Medium, ev.Locality)
	if !ok {
		x.stats.UnknownMedium += uint64(len(ev.BlockHashes))
		return out
	}
	if tier == Shared {
		d := x.domains[domainKey(ev.Medium, ev.Ownership)]
		for _, h := range ev.BlockHashes {
			if d == nil {
				x.stats.Unknown++
				continue
			}
			out = x.removeShared(d, engineKey(h), out)
		}
		return out
	}
	cs := w.copiesOf(store{tier, ev.Ownership}, false)
	for _, h := range ev.BlockHashes {
		k := engineKey(h)
		if cs == nil {
			x.stats.Unknown++
			continue
		}
		seq, last, ok := cs.take(k)
		if !ok {
			x.stats.Unknown++
			continue
		}
		x.stats.Removed++
		if !last || w.holds(tier, k, cs) {
			continue
		}
		if x.set.Remove(seq, w.slot, tier) {
			out = append(out, Change{Seq: seq, Tier: tier, Removed: true, Slot: w.slot})
		}
	}
	if ev.Ownership != "" && cs != nil && cs.seq.Len() == 0 {
		delete(w.owned, store{tier, ev.Ownership})
	}
	return out
}

// clearLocked drops the worker's own blocks: one Cleared change, not a removal per block.
// What the shared storage it mounts holds outlives its engine: those blocks are credited to
// it again (Changes after the clear).
func (x *Index) clearLocked(w *worker, out []Change) []Change {
	x.set.ClearSlot(w.slot)
	out = append(out, Change{Cleared: true, Slot: w.slot})
	for t := range w.engine {
		w.engine[t] = newCopies()
	}
	w.owned = nil
	for _, d := range w.domains {
		out = x.creditDomain(w, d, out)
	}
	return out
}

// Clear drops every block of a worker (its engine restarted, or its events were lost and
// cannot be replayed) and returns its Cleared change, then the blocks of the shared storage
// it mounts, credited again.
func (x *Index) Clear(id string, removed []Change) []Change {
	x.mu.Lock()
	defer x.mu.Unlock()
	w, ok := x.workers[id]
	if !ok {
		return removed
	}
	return x.clearLocked(w, removed)
}

// RemoveWorker drops a worker and its blocks, unmounts its shared storage (whose blocks stay
// for the other workers) and frees its slot.
func (x *Index) RemoveWorker(id string, removed []Change) []Change {
	x.mu.Lock()
	defer x.mu.Unlock()
	w, ok := x.workers[id]
	if !ok {
		return removed
	}
	for _, d := range w.domains {
		d.mounts = slices.DeleteFunc(d.mounts, func(m *worker) bool { return m == w })
	}
	w.domains = nil
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
		for t, c := range w.engine {
			n[t] = c.seq.Len()
		}
		for st, c := range w.owned {
			n[st.tier] += c.seq.Len()
		}
		for _, d := range w.domains {
			n[Shared] += len(d.refs)
		}
	}
	return n
}

// Slots returns one past the highest slot the index has given a worker (0: none).
func (x *Index) Slots() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.slots)
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
// It allocates nothing while the prompt's first block is held in at most 32 shards of 64
// slots (blockset.Set.Match).
func (x *Index) Match(hashes []uint64, overlap []float64, wt Weights) float64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.set.Match(hashes, overlap, wt)
}

// MatchTiers is Match that also fills lower[slot] (when lower is not nil, as long as overlap)
// with what the slot's run holds below GPU memory.
func (x *Index) MatchTiers(hashes []uint64, overlap []float64, lower []blockset.Lower, wt Weights) float64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.set.MatchTiers(hashes, overlap, lower, wt)
}

// Each calls fn for every (block, slot, tier) entry, under the read lock: fn must not call
// back into the index.
func (x *Index) Each(fn func(seq uint64, slot int, tier Tier)) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	x.set.Each(fn)
}

// EachSlots calls fn for every entry of the given slots (the journal's resume of a proxy
// that comes from another replica), under the read lock.
func (x *Index) EachSlots(slots []int, fn func(seq uint64, slot int, tier Tier)) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	x.set.EachSlots(slots, fn)
}
