// Package blockset is the data structure behind the KV index on both sides of xDS: which
// worker slots hold which block (by kvrelay's sequence hash) in which storage tier. The
// control plane's index builds one from engine events; each proxy's replica applies the
// journal of its changes to its own. Match, the router's question, is answered the same way on
// both sides.
//
// Each block is stored once, however many workers hold it: one map from the block to its
// holders, a set of (slot, tier) pairs. Holder sets are interned and shared by every block
// with the same holders: the blocks of a prefix that some workers cache all name one set,
// whether two workers hold it or ten thousand. A longest-prefix query costs one map lookup
// per prompt block, and work in proportion to the holders only where the set changes from
// one block to the next (where a holder's run ends, or a tier changes): not the number of
// workers the Set knows. A Set is not safe for concurrent use; its owners lock around it.
package blockset

import (
	"cmp"
	"math/bits"
	"slices"
	"sync"

	"github.com/kvrelay/kvrelay/internal/u64map"
	"github.com/kvrelay/kvrelay/xds/policy"
)

// Tier is where a worker keeps a block.
type Tier uint8

// Tiers, from the fastest.
const (
	// GPU is the engine's own KV cache.
	GPU Tier = iota
	// Host is CPU memory the worker offloads to (vLLM's CPU tier, SGLang's CPU_PINNED).
	Host
	// Disk is storage of the worker's own (vLLM's STORAGE with locality LOCAL, a local fs
	// tier, SGLang's DISK).
	Disk
	// Shared is storage that several workers mount (vLLM's STORAGE with locality REMOTE, an
	// object store, SGLang's EXTERNAL L3): a block one worker wrote there, each of them can
	// load.
	Shared
	NumTiers
)

// TierOf maps a KV event's medium and locality to a tier. ok is false for a medium kvrelay
// does not know: such a block must not be credited at all (crediting it as GPU memory would
// promise a hit the engine cannot give). An empty medium is GPU memory (engines that predate
// media send none). Locality "REMOTE" makes storage shared; object stores and SGLang's
// external (L3) storage are shared unless the event says "LOCAL".
func TierOf(medium, locality string) (t Tier, ok bool) {
	switch medium {
	case "", "GPU", "gpu", "cuda", "CUDA":
		t = GPU
	case "CPU", "cpu", "CPU_PINNED", "cpu_pinned", "CPU_TIER", "cpu_tier", "host", "HOST":
		t = Host
	case "STORAGE", "storage", "FS", "fs", "DISK", "disk", "LOCAL_DISK", "local_disk", "SSD", "ssd":
		t = Disk
	case "OBJ", "obj", "EXTERNAL", "external", "L3":
		t = Shared
	default:
		return GPU, false
	}
	switch locality {
	case "REMOTE", "remote":
		if t == Disk {
			t = Shared
		}
	case "LOCAL", "local":
		if t == Shared {
			t = Disk
		}
	}
	return t, true
}

// Weights scale a cached block by its tier when overlaps are scored.
type Weights [NumTiers]float64

// DefaultWeights are GPU 1, host 0.75, disk 0.25 (NVIDIA Dynamo's router's defaults) and
// shared storage 0.2 (docs/routing-cost.md).
var DefaultWeights = Weights(policy.DefaultTierWeights())

// Set is a set of (block, slot, tier) entries. The zero Set is empty and ready.
type Set struct {
	// blocks maps each block held anywhere to the id of its holder set.
	blocks u64map.Map
	// sets are the holder sets by id (id 0 is never used: a block without holders is not
	// in blocks); free holds the ids of sets no block names, for reuse.
	sets []holders
	free []uint32
	// intern maps a holder set's content hash to the set of that content that new blocks
	// share (the canonical one). Sets of equal content can exist besides it (ClearSlot
	// edits sets in place, and a hash collision keeps the second set apart): they are
	// correct, only not shared by blocks that reach that content later.
	intern u64map.Map
	// single caches, by slot and tier, the id of the set holding just that pair (a block
	// of one worker's: most blocks), so that storing or dropping one costs no set lookup.
	// An entry is checked before use: the set may since have been freed or reused.
	single [][NumTiers]uint32
	// tmp is where a holder set's next content is built before it is looked up.
	tmp []part
	// last is the last change derive made to a set of several holders, for the next block
	// of a chain, which most likely makes the same one; valid while gen, counting the sets
	// freed and ClearSlot's edits of sets in place, has not moved.
	last transition
	gen  uint64
	// held counts each slot's entries per tier: how many blocks a worker holds in its GPU
	// memory, host memory and so on, as its events said.
	held [][NumTiers]int
	// dead counts blocks whose holder set ClearSlot emptied: still in blocks, holding
	// nothing, until a sweep deletes them (or an Add gives them a holder again).
	dead int
}

// holders is one holder set: for each shard of 64 slots that holds the block, a bitset of
// its slots per tier.
type holders struct {
	parts []part // by shard, none empty
	refs  int    // blocks naming this set
	hash  uint64 // the sum of elemHash over the set's (slot, tier) pairs
	// canonical: intern names this set for its hash.
	canonical bool
	// lower: some slot holds the block outside GPU memory only, so a run through it
	// counts at a lower tier's weight.
	lower bool
}

// transition is derive's answer for a set, a (slot, tier) and add or remove.
type transition struct {
	from, to uint32
	slot     int
	tier     Tier
	add      bool
	gen      uint64
}

// part is the slots of one shard (slots 64*shard to 64*shard+63) holding a block, per tier.
type part struct {
	shard uint32
	tiers [NumTiers]uint64
}

// any is the slots of the part holding the block in any tier.
func (p *part) any() uint64 {
	var b uint64
	for _, t := range p.tiers {
		b |= t
	}
	return b
}

// elemHash is one (slot, tier) pair's share of a holder set's hash (splitmix64's
// finalizer): sets are hashed by the sum of their pairs' shares, so that adding or removing
// one pair updates the hash without reading the rest.
func elemHash(slot int, tier Tier) uint64 {
	z := uint64(slot)*uint64(NumTiers) + uint64(tier) + 0x9E3779B97F4A7C15
	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
	z = (z ^ z>>27) * 0x94D049BB133111EB
	return z ^ z>>31
}

// lowerOf tells whether some slot of ps holds the block outside GPU memory only.
func lowerOf(ps []part) bool {
	for i := range ps {
		if ps[i].any()&^ps[i].tiers[GPU] != 0 {
			return true
		}
	}
	return false
}

// search returns where shard's part is, or would be, in ps, and whether it is there.
func search(ps []part, shard uint32) (int, bool) {
	return slices.BinarySearchFunc(ps, shard, func(p part, k uint32) int { return cmp.Compare(p.shard, k) })
}

// find returns the index of shard's part in ps, or -1.
func find(ps []part, shard uint32) int {
	if i, ok := search(ps, shard); ok {
		return i
	}
	return -1
}

// has reports whether set id holds slot in tier.
func (s *Set) has(id uint32, slot int, tier Tier) bool {
	ps := s.sets[id].parts
	i := find(ps, uint32(slot/64))
	return i >= 0 && ps[i].tiers[tier]&(1<<(slot%64)) != 0
}

// Held returns how many blocks slot holds in tier.
func (s *Set) Held(slot int, tier Tier) int {
	if slot < 0 || slot >= len(s.held) || tier >= NumTiers {
		return 0
	}
	return s.held[slot][tier]
}

// count moves slot's count in tier by d.
func (s *Set) count(slot int, tier Tier, d int) {
	if slot >= len(s.held) {
		s.held = append(s.held, make([][NumTiers]int, slot+1-len(s.held))...)
	}
	s.held[slot][tier] += d
}

// isSingle reports whether set id holds exactly (slot, tier).
func (s *Set) isSingle(id uint32, slot int, tier Tier) bool {
	if id == 0 || int(id) >= len(s.sets) {
		return false
	}
	ps := s.sets[id].parts
	if len(ps) != 1 || ps[0].shard != uint32(slot/64) {
		return false
	}
	var want [NumTiers]uint64
	want[tier] = 1 << (slot % 64)
	return ps[0].tiers == want
}

// derive returns the id of the set that is set id (0: the empty set) with (slot, tier)
// added (add) or taken out, holding a reference to it for the caller; 0 when that set is
// empty. A set of that content already interned is shared; otherwise a new one is made.
func (s *Set) derive(id uint32, slot int, tier Tier, add bool) uint32 {
	switch {
	case add && id == 0 && slot < len(s.single):
		// A block of one worker's: its set is most likely cached.
		if c := s.single[slot][tier]; s.isSingle(c, slot, tier) {
			s.sets[c].refs++
			return c
		}
	case !add && s.isSingle(id, slot, tier):
		return 0
	case s.last == transition{id, s.last.to, slot, tier, add, s.gen}:
		if s.last.to != 0 {
			s.sets[s.last.to].refs++
		}
		return s.last.to
	}
	to := s.build(id, slot, tier, add)
	s.last = transition{id, to, slot, tier, add, s.gen}
	return to
}

// build is derive without its shortcuts.
func (s *Set) build(id uint32, slot int, tier Tier, add bool) uint32 {
	var hash uint64
	tmp := s.tmp[:0]
	if id != 0 {
		hash = s.sets[id].hash
		tmp = append(tmp, s.sets[id].parts...)
	}
	shard, bit := uint32(slot/64), uint64(1)<<(slot%64)
	i, found := search(tmp, shard)
	if add {
		hash += elemHash(slot, tier)
		if !found {
			tmp = slices.Insert(tmp, i, part{shard: shard})
		}
		tmp[i].tiers[tier] |= bit
	} else {
		hash -= elemHash(slot, tier)
		tmp[i].tiers[tier] &^= bit
		if tmp[i].any() == 0 {
			tmp = slices.Delete(tmp, i, i+1)
		}
	}
	s.tmp = tmp
	if len(tmp) == 0 {
		return 0
	}
	v, taken := s.intern.Get(hash)
	if cid := uint32(v); taken && slices.Equal(s.sets[cid].parts, tmp) {
		s.sets[cid].refs++
		return cid
	}
	var nid uint32
	if n := len(s.free); n > 0 {
		nid, s.free = s.free[n-1], s.free[:n-1]
	} else {
		if len(s.sets) == 0 {
			s.sets = append(s.sets, holders{}) // id 0: never a set
		}
		nid = uint32(len(s.sets))
		s.sets = append(s.sets, holders{})
	}
	ps := slices.Clone(tmp)
	s.sets[nid] = holders{parts: ps, refs: 1, hash: hash, canonical: !taken, lower: lowerOf(ps)}
	if !taken {
		s.intern.Put(hash, uint64(nid))
	}
	if len(ps) == 1 && bits.OnesCount64(ps[0].any()) == 1 {
		for len(s.single) <= slot {
			s.single = append(s.single, [NumTiers]uint32{})
		}
		s.single[slot][tier] = nid
	}
	return nid
}

// release drops a block's reference to set id, freeing the set when no block names it.
func (s *Set) release(id uint32) {
	h := &s.sets[id]
	if h.refs--; h.refs > 0 {
		return
	}
	if h.canonical {
		s.intern.Delete(h.hash)
	}
	*h = holders{}
	s.free = append(s.free, id)
	s.gen++ // last may name it: a shortcut of derive freed it without replacing last
}

// Add records that slot holds seq in tier and reports whether that is new.
func (s *Set) Add(seq uint64, slot int, tier Tier) bool {
	if slot < 0 || tier >= NumTiers {
		return false
	}
	v, ok := s.blocks.Get(seq)
	id := uint32(v)
	if ok && s.has(id, slot, tier) {
		return false
	}
	s.blocks.Put(seq, uint64(s.derive(id, slot, tier, true)))
	if ok {
		if len(s.sets[id].parts) == 0 {
			s.dead-- // a cleared block holds something again
		}
		s.release(id)
	}
	s.count(slot, tier, 1)
	return true
}

// Remove records that slot no longer holds seq in tier and reports whether it did.
func (s *Set) Remove(seq uint64, slot int, tier Tier) bool {
	if slot < 0 || tier >= NumTiers {
		return false
	}
	v, ok := s.blocks.Get(seq)
	id := uint32(v)
	if !ok || !s.has(id, slot, tier) {
		return false
	}
	if nid := s.derive(id, slot, tier, false); nid != 0 {
		s.blocks.Put(seq, uint64(nid))
	} else {
		s.blocks.Delete(seq)
	}
	s.release(id)
	s.count(slot, tier, -1)
	return true
}

// ClearSlot removes every block of slot. It edits the holder sets that name the slot, not
// the blocks: it costs the number of holder sets, not of blocks. Blocks left holding nothing
// stay in the map (counted, and taken for absent) until they are a quarter of its blocks,
// when one walk deletes them.
func (s *Set) ClearSlot(slot int) {
	if slot < 0 || slot >= len(s.held) || s.held[slot] == [NumTiers]int{} {
		return
	}
	shard, bit := uint32(slot/64), uint64(1)<<(slot%64)
	s.gen++
	for id := 1; id < len(s.sets); id++ {
		h := &s.sets[id]
		i := find(h.parts, shard)
		if h.refs == 0 || i < 0 || h.parts[i].any()&bit == 0 {
			continue
		}
		if h.canonical {
			s.intern.Delete(h.hash)
		}
		h.canonical = false
		p := &h.parts[i]
		for t := range p.tiers {
			if p.tiers[t]&bit != 0 {
				p.tiers[t] &^= bit
				h.hash -= elemHash(slot, Tier(t))
			}
		}
		if p.any() == 0 {
			h.parts = slices.Delete(h.parts, i, i+1)
		}
		h.lower = lowerOf(h.parts)
		if len(h.parts) == 0 {
			s.dead += h.refs
		} else if _, taken := s.intern.Get(h.hash); !taken {
			s.intern.Put(h.hash, uint64(id))
			h.canonical = true
		}
	}
	s.held[slot] = [NumTiers]int{}
	if s.dead > 0 && 4*s.dead >= s.blocks.Len() {
		s.sweep()
	}
}

// sweep deletes the blocks that hold nothing.
func (s *Set) sweep() {
	var gone []uint64
	for seq, v := range s.blocks.All() {
		if len(s.sets[v].parts) == 0 {
			gone = append(gone, seq)
		}
	}
	for _, seq := range gone {
		v, _ := s.blocks.Delete(seq)
		s.release(uint32(v))
	}
	s.dead = 0
}

// Has reports whether slot holds seq in tier.
func (s *Set) Has(seq uint64, slot int, tier Tier) bool {
	if slot < 0 || tier >= NumTiers {
		return false
	}
	v, ok := s.blocks.Get(seq)
	return ok && s.has(uint32(v), slot, tier)
}

// each calls fn for every (slot, tier) of the parts ps of block seq whose slot is in mask
// (nil: every slot), mask being by shard.
func each(seq uint64, ps []part, mask map[uint32]uint64, fn func(seq uint64, slot int, tier Tier)) {
	for i := range ps {
		p := &ps[i]
		m := ^uint64(0)
		if mask != nil {
			m = mask[p.shard]
		}
		for t, b := range p.tiers {
			for b &= m; b != 0; b &= b - 1 {
				fn(seq, 64*int(p.shard)+bits.TrailingZeros64(b), Tier(t))
			}
		}
	}
}

// Each calls fn for every entry, block by block. fn must not change the Set.
func (s *Set) Each(fn func(seq uint64, slot int, tier Tier)) {
	for seq, v := range s.blocks.All() {
		each(seq, s.sets[v].parts, nil, fn)
	}
}

// EachSlots calls fn for every entry of the given slots. It walks every block, reading the
// holders only of blocks whose set names one of the slots.
func (s *Set) EachSlots(slots []int, fn func(seq uint64, slot int, tier Tier)) {
	mask := map[uint32]uint64{}
	for _, slot := range slots {
		if slot >= 0 {
			mask[uint32(slot/64)] |= 1 << (slot % 64)
		}
	}
	if len(mask) == 0 {
		return
	}
	names := make([]bool, len(s.sets))
	for id := range s.sets {
		for _, p := range s.sets[id].parts {
			if p.any()&mask[p.shard] != 0 {
				names[id] = true
				break
			}
		}
	}
	for seq, v := range s.blocks.All() {
		if names[v] {
			each(seq, s.sets[v].parts, mask, fn)
		}
	}
}

// Len returns the number of distinct blocks held by any slot.
func (s *Set) Len() int { return s.blocks.Len() - s.dead }

// Entries returns the number of (block, slot, tier) entries.
func (s *Set) Entries() int {
	n := 0
	for _, c := range s.held {
		for _, k := range c {
			n += k
		}
	}
	return n
}

// Match sets overlap[slot] to the tier-weighted number of leading blocks of hashes that the
// slot holds (a block held in several tiers counts at its fastest), for every slot <
// len(overlap), and returns the largest overlap. It allocates nothing while the slots holding
// the prompt's first block lie in at most 32 shards of 64 slots (a pool of 2,048 at most),
// and past that only when its pool of run lists is empty.
func (s *Set) Match(hashes []uint64, overlap []float64, wt Weights) float64 {
	return s.MatchTiers(hashes, overlap, nil, wt)
}

// Lower is what a slot's run holds below GPU memory: its blocks whose fastest copy is in host
// memory, on its own disk and in shared storage. The run is overlap + Deficit blocks long,
// Deficit being what the tier weights took off those blocks.
type Lower struct{ Host, Disk, Shared, Deficit float64 }

// run is the slots of one shard whose run over the prompt is still going.
type run struct {
	shard uint32
	slots uint64
}

// runPool holds run lists for prompts whose first block more than 32 shards hold.
var runPool = sync.Pool{New: func() any { return new([]run) }}

// MatchTiers is Match that also fills lower[slot] (when lower is not nil; it must be as long
// as overlap) with what the slot's run holds below GPU memory, so that a caller can price
// bringing those blocks back instead of weighting them.
//
// The runs still going are kept as a list of shards; each block costs one lookup, and a
// merge of that list with the block's holders only when its holder set differs from the
// previous block's (the runs of the slots it lacks end there) or some holder keeps it below
// GPU memory. While overlap[i]'s run is going it holds minus its deficit; the run's length
// is added when it ends.
func (s *Set) MatchTiers(hashes []uint64, overlap []float64, lower []Lower, wt Weights) float64 {
	clear(overlap)
	clear(lower)
	if len(hashes) == 0 || len(overlap) == 0 {
		return 0
	}
	var buf [32]run
	active := buf[:0]
	var spill *[]run
	best := 0.0
	prev := uint32(0)
	var ps []part // the holders of the previous block
	lowerRun := false
	n := 0
	for ; n < len(hashes); n++ {
		v, ok := s.blocks.Get(hashes[n])
		if !ok {
			break
		}
		if id := uint32(v); n == 0 || id != prev {
			h := &s.sets[id]
			ps, lowerRun, prev = h.parts, h.lower, id
			if n == 0 {
				if len(ps) > len(buf) {
					// Room for every part, so that the appends below never grow it.
					spill = runPool.Get().(*[]run)
					if cap(*spill) < len(ps) {
						*spill = make([]run, 0, len(ps))
					}
					active = (*spill)[:0]
				}
				for i := range ps {
					base := 64 * int(ps[i].shard)
					if base >= len(overlap) {
						break
					}
					b := ps[i].any()
					if left := len(overlap) - base; left < 64 {
						b &= 1<<left - 1
					}
					if b != 0 {
						active = append(active, run{ps[i].shard, b})
					}
				}
			} else {
				kept := active[:0]
				j := 0
				for _, r := range active {
					for j < len(ps) && ps[j].shard < r.shard {
						j++
					}
					var held uint64
					if j < len(ps) && ps[j].shard == r.shard {
						held = r.slots & ps[j].any()
					}
					if left := r.slots &^ held; left != 0 {
						if o := closeRuns(r.shard, left, n, overlap); o > best {
							best = o
						}
					}
					if held != 0 {
						kept = append(kept, run{r.shard, held})
					}
				}
				active = kept
			}
			if len(active) == 0 {
				break
			}
		}
		if lowerRun {
			weigh(active, ps, overlap, lower, wt)
		}
	}
	for _, r := range active {
		if o := closeRuns(r.shard, r.slots, n, overlap); o > best {
			best = o
		}
	}
	if spill != nil {
		runPool.Put(spill)
	}
	return best
}

// weigh takes off the running overlaps what a block costs where its fastest copy is below
// GPU memory, ps being its holders (which hold every slot of active).
func weigh(active []run, ps []part, overlap []float64, lower []Lower, wt Weights) {
	j := 0
	for _, r := range active {
		for ps[j].shard < r.shard {
			j++
		}
		p := &ps[j]
		for b := r.slots &^ p.tiers[GPU]; b != 0; b &= b - 1 {
			k := bits.TrailingZeros64(b)
			i := 64*int(r.shard) + k
			var w float64
			switch bit := uint64(1) << k; {
			case p.tiers[Host]&bit != 0:
				w = wt[Host]
				if lower != nil {
					lower[i].Host++
				}
			case p.tiers[Disk]&bit != 0:
				w = wt[Disk]
				if lower != nil {
					lower[i].Disk++
				}
			default:
				w = wt[Shared]
				if lower != nil {
					lower[i].Shared++
				}
			}
			overlap[i] -= 1 - w
			if lower != nil {
				lower[i].Deficit += 1 - w
			}
		}
	}
}

// closeRuns ends the runs of the slots in set (of shard) at length n and returns the
// longest.
func closeRuns(shard uint32, set uint64, n int, overlap []float64) float64 {
	best := 0.0
	for b := set; b != 0; b &= b - 1 {
		i := 64*int(shard) + bits.TrailingZeros64(b)
		o := float64(n) + overlap[i] // overlap holds minus the run's deficit
		overlap[i] = o
		if o > best { // not the builtin max: its NaN and signed-zero rules cost more than the rest
			best = o
		}
	}
	return best
}
