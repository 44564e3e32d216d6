// Package blockset is the data structure behind the KV index on both sides of xDS: which
// worker slots hold which block (by kvrelay's sequence hash) in which storage tier. The
// control plane's index builds one from engine events; each proxy's replica applies the
// journal of its changes to its own. Match, the router's question, is answered the same way on
// both sides.
//
// Holders are bitsets of 64 worker slots per shard, one map per tier: a longest-prefix query
// costs a map lookup per prompt block in each shard whose slots still hold the prefix. Past
// one shard the Set also counts each block's holders in GPU memory, so that the leading
// blocks every worker holds (a system prompt the whole fleet caches) cost one lookup each
// however many shards there are. A Set is not safe for concurrent use; its owners lock
// around it.
package blockset

import (
	"math/bits"

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

// Set is a set of (block, slot, tier) entries.
type Set struct {
	shards []*shard
	// held counts each slot's entries per tier: how many blocks a worker holds in its GPU
	// memory, host memory and so on, as its events said.
	held [][NumTiers]int
	// nonEmpty is the number of slots holding any entry.
	nonEmpty int
	// gpuHolders counts, once the Set has more than one shard (nil before), the slots
	// holding in GPU memory each block that a slot of the first shard holds there: a block
	// whose count is nonEmpty is held by every slot that holds anything, in every shard, and
	// Match takes the leading run of such blocks from this one map. Blocks the first shard
	// lacks cannot be such (while it has a live slot), and are not counted: most blocks are
	// one worker's, and past a few shards most are not the first shard's.
	gpuHolders *u64map.Map
}

// Held returns how many blocks slot holds in tier.
func (s *Set) Held(slot int, tier Tier) int {
	if slot < 0 || slot >= len(s.held) || tier >= NumTiers {
		return 0
	}
	return s.held[slot][tier]
}

// count moves slot's count in tier by d, and keeps nonEmpty and the shard's live slots.
func (s *Set) count(slot int, tier Tier, d int) {
	if slot >= len(s.held) {
		s.held = append(s.held, make([][NumTiers]int, slot+1-len(s.held))...)
	}
	before := 0
	for _, c := range s.held[slot] {
		before += c
	}
	s.held[slot][tier] += d
	switch after := before + d; {
	case before == 0 && after > 0:
		s.nonEmpty++
		s.shards[slot/64].live |= 1 << (slot % 64)
	case before > 0 && after == 0:
		s.nonEmpty--
		s.shards[slot/64].live &^= 1 << (slot % 64)
	}
}

// shard holds the blocks of up to 64 slots: per block and tier, a bitset of the slots holding
// it. Most blocks live only in GPU memory, so each tier has its own map and the host and disk
// maps stay small (or empty, and are then never consulted); values, not pointers, keep the
// maps out of the garbage collector's way.
type shard struct {
	tiers [NumTiers]u64map.Map
	// live is the slots of the shard that hold any entry.
	live uint64
}

func (s *Set) shard(slot int) *shard {
	for len(s.shards) <= slot/64 {
		s.shards = append(s.shards, &shard{})
		if len(s.shards) == 2 {
			// Past one shard: count the GPU holders of what the first holds.
			first := &s.shards[0].tiers[GPU]
			s.gpuHolders = u64map.New(first.Len())
			for seq, e := range first.All() {
				s.gpuHolders.Put(seq, uint64(bits.OnesCount64(e)))
			}
		}
	}
	return s.shards[slot/64]
}

// holderAdded counts slot's new GPU copy of seq, first0 telling that slot is of the first
// shard and the first of it to hold seq there (whose count then starts from the other
// shards' holders: once per block the first shard takes).
func (s *Set) holderAdded(seq uint64, slot int, first0 bool) {
	switch {
	case first0:
		n := uint64(1)
		for _, sh := range s.shards[1:] {
			e, _ := sh.tiers[GPU].Get(seq)
			n += uint64(bits.OnesCount64(e))
		}
		s.gpuHolders.Put(seq, n)
	case slot < 64:
		n, _ := s.gpuHolders.Get(seq)
		s.gpuHolders.Put(seq, n+1)
	default:
		if n, ok := s.gpuHolders.Get(seq); ok {
			s.gpuHolders.Put(seq, n+1)
		}
	}
}

// holderGone takes slot's GPU copy off seq's count, and the count away when the first
// shard holds seq no more (left0).
func (s *Set) holderGone(seq uint64, left0 bool) {
	if left0 {
		s.gpuHolders.Delete(seq)
		return
	}
	if n, ok := s.gpuHolders.Get(seq); ok {
		s.gpuHolders.Put(seq, n-1)
	}
}

// Add records that slot holds seq in tier and reports whether that is new.
func (s *Set) Add(seq uint64, slot int, tier Tier) bool {
	if slot < 0 || tier >= NumTiers {
		return false
	}
	m := &s.shard(slot).tiers[tier]
	bit := uint64(1) << (slot % 64)
	e, _ := m.Get(seq)
	if e&bit != 0 {
		return false
	}
	m.Put(seq, e|bit)
	if tier == GPU && s.gpuHolders != nil {
		s.holderAdded(seq, slot, slot < 64 && e == 0)
	}
	s.count(slot, tier, 1)
	return true
}

// Remove records that slot no longer holds seq in tier and reports whether it did.
func (s *Set) Remove(seq uint64, slot int, tier Tier) bool {
	if slot < 0 || slot/64 >= len(s.shards) || tier >= NumTiers {
		return false
	}
	m := &s.shards[slot/64].tiers[tier]
	bit := uint64(1) << (slot % 64)
	e, ok := m.Get(seq)
	if !ok || e&bit == 0 {
		return false
	}
	s.unset(m, seq, slot, tier, e)
	return true
}

// unset takes slot out of entry e of seq in tier's map m of slot's shard (e holding slot).
func (s *Set) unset(m *u64map.Map, seq uint64, slot int, tier Tier, e uint64) {
	if e &^= 1 << (slot % 64); e == 0 {
		m.Delete(seq)
	} else {
		m.Put(seq, e)
	}
	if tier == GPU && s.gpuHolders != nil {
		s.holderGone(seq, slot < 64 && e == 0)
	}
	s.count(slot, tier, -1)
}

// ClearSlot removes every block of slot, calling fn (if not nil) for each entry removed. It
// walks the slot's shard: meant for rare events (a worker restarting or leaving).
func (s *Set) ClearSlot(slot int, fn func(seq uint64, tier Tier)) {
	if slot < 0 || slot/64 >= len(s.shards) {
		return
	}
	bit := uint64(1) << (slot % 64)
	sh := s.shards[slot/64]
	type held struct{ seq, e uint64 }
	var hs []held
	for t := range sh.tiers {
		m := &sh.tiers[t]
		hs = hs[:0]
		for seq, e := range m.All() {
			if e&bit != 0 {
				hs = append(hs, held{seq, e}) // unset after the walk: the map must not change during it
			}
		}
		for _, h := range hs {
			s.unset(m, h.seq, slot, Tier(t), h.e)
			if fn != nil {
				fn(h.seq, Tier(t))
			}
		}
	}
}

// Has reports whether slot holds seq in tier.
func (s *Set) Has(seq uint64, slot int, tier Tier) bool {
	if slot < 0 || slot/64 >= len(s.shards) || tier >= NumTiers {
		return false
	}
	e, _ := s.shards[slot/64].tiers[tier].Get(seq)
	return e&(1<<(slot%64)) != 0
}

// Each calls fn for every entry, shard by shard.
func (s *Set) Each(fn func(seq uint64, slot int, tier Tier)) {
	for k, sh := range s.shards {
		for t := range sh.tiers {
			for seq, e := range sh.tiers[t].All() {
				for b := e; b != 0; b &= b - 1 {
					fn(seq, 64*k+bits.TrailingZeros64(b), Tier(t))
				}
			}
		}
	}
}

// EachSlots calls fn for every entry of the given slots, walking each of their shards once.
func (s *Set) EachSlots(slots []int, fn func(seq uint64, slot int, tier Tier)) {
	masks := map[int]uint64{}
	for _, slot := range slots {
		if slot >= 0 && slot/64 < len(s.shards) {
			masks[slot/64] |= 1 << (slot % 64)
		}
	}
	for k, mask := range masks {
		for t := range s.shards[k].tiers {
			for seq, e := range s.shards[k].tiers[t].All() {
				for b := e & mask; b != 0; b &= b - 1 {
					fn(seq, 64*k+bits.TrailingZeros64(b), Tier(t))
				}
			}
		}
	}
}

// Len returns the number of distinct blocks held by any slot. With more than 64 slots it
// builds a set of the blocks: it is meant for statistics, not for the request path.
func (s *Set) Len() int {
	if len(s.shards) == 1 {
		return s.shards[0].distinct()
	}
	seen := map[uint64]struct{}{}
	for _, sh := range s.shards {
		for t := range sh.tiers {
			for seq := range sh.tiers[t].All() {
				seen[seq] = struct{}{}
			}
		}
	}
	return len(seen)
}

// distinct counts the blocks of one shard.
func (sh *shard) distinct() int {
	n := sh.tiers[GPU].Len()
	// A block counts in the fastest tier that holds it.
	for t := Host; t < NumTiers; t++ {
	next:
		for seq := range sh.tiers[t].All() {
			for faster := GPU; faster < t; faster++ {
				if _, ok := sh.tiers[faster].Get(seq); ok {
					continue next
				}
			}
			n++
		}
	}
	return n
}

// Entries returns the number of (block, slot, tier) entries.
func (s *Set) Entries() int {
	n := 0
	for _, sh := range s.shards {
		for t := range sh.tiers {
			for _, e := range sh.tiers[t].All() {
				n += bits.OnesCount64(e)
			}
		}
	}
	return n
}

// Match sets overlap[slot] to the tier-weighted number of leading blocks of hashes that the
// slot holds (a block held in several tiers counts at its fastest), for every slot <
// len(overlap), and returns the largest overlap. It allocates nothing.
func (s *Set) Match(hashes []uint64, overlap []float64, wt Weights) float64 {
	return s.MatchTiers(hashes, overlap, nil, wt)
}

// Lower is what a slot's run holds below GPU memory: its blocks whose fastest copy is in host
// memory, on its own disk and in shared storage. The run is overlap + Deficit blocks long,
// Deficit being what the tier weights took off those blocks.
type Lower struct{ Host, Disk, Shared, Deficit float64 }

// MatchTiers is Match that also fills lower[slot] (when lower is not nil; it must be as long
// as overlap) with what the slot's run holds below GPU memory, so that a caller can price
// bringing those blocks back instead of weighting them.
func (s *Set) MatchTiers(hashes []uint64, overlap []float64, lower []Lower, wt Weights) float64 {
	clear(overlap)
	clear(lower)
	// The leading blocks every slot holding anything holds in GPU memory: one lookup each,
	// not one per shard.
	common := 0
	if s.gpuHolders != nil && s.shards[0].live != 0 {
		for common < len(hashes) {
			if n, _ := s.gpuHolders.Get(hashes[common]); n != uint64(s.nonEmpty) {
				break
			}
			common++
		}
	}
	best := 0.0
	for k, sh := range s.shards {
		base := 64 * k
		if base >= len(overlap) {
			break
		}
		var lw []Lower
		if lower != nil {
			lw = lower[base:min(base+64, len(overlap))]
		}
		best = max(best, sh.match(hashes, common, overlap[base:min(base+64, len(overlap))], lw, wt))
	}
	return best
}

// match walks the chain for one shard from block common, the blocks before it being held
// in GPU memory by every live slot. A slot's run lasts while it holds each next block in any
// tier; within the run, blocks outside GPU memory count at their tier's weight, which costs
// work only for the rare blocks that are not in GPU memory.
func (sh *shard) match(hashes []uint64, common int, overlap []float64, lower []Lower, wt Weights) float64 {
	best := 0.0
	active := sh.live
	if len(overlap) < 64 {
		active &= uint64(1)<<len(overlap) - 1
	}
	var deficit [64]float64
	var slow *[64]Lower // host and disk blocks of each run, only when lower is wanted
	if lower != nil {
		slow = new([64]Lower)
	}
	n := common
	for n < len(hashes) && active != 0 {
		h := hashes[n]
		gpu, _ := sh.tiers[GPU].Get(h)
		held := gpu
		for t := Host; t < NumTiers; t++ {
			e, _ := sh.tiers[t].Get(h) // an empty tier answers at once
			held |= e
		}
		held &= active
		if held == 0 {
			break
		}
		if left := active &^ held; left != 0 {
			if o := closeRuns(left, n, overlap, &deficit, lower, slow); o > best {
				best = o
			}
		}
		active = held
		if below := active &^ gpu; below != 0 {
			host, _ := sh.tiers[Host].Get(h)
			disk, _ := sh.tiers[Disk].Get(h)
			for b := below; b != 0; b &= b - 1 {
				i := bits.TrailingZeros64(b)
				var w float64
				switch {
				case host&(1<<i) != 0:
					w = wt[Host]
					if slow != nil {
						slow[i].Host++
					}
				case disk&(1<<i) != 0:
					w = wt[Disk]
					if slow != nil {
						slow[i].Disk++
					}
				default:
					w = wt[Shared]
					if slow != nil {
						slow[i].Shared++
					}
				}
				deficit[i] += 1 - w
			}
		}
		n++
	}
	if active != 0 {
		if o := closeRuns(active, n, overlap, &deficit, lower, slow); o > best {
			best = o
		}
	}
	return best
}

// closeRuns ends the runs of the slots in set at length n and returns the longest.
func closeRuns(set uint64, n int, overlap []float64, deficit *[64]float64, lower []Lower, slow *[64]Lower) float64 {
	best := 0.0
	for b := set; b != 0; b &= b - 1 {
		if i := bits.TrailingZeros64(b); i < len(overlap) {
			o := float64(n) - deficit[i]
			overlap[i] = o
			if o > best { // not the builtin max: its NaN and signed-zero rules cost more than the rest
				best = o
			}
			if lower != nil {
				lower[i] = Lower{Host: slow[i].Host, Disk: slow[i].Disk, Shared: slow[i].Shared, Deficit: deficit[i]}
			}
		}
	}
	return best
}
