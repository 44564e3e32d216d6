package blockset

import (
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestAddRemoveClearEach(t *testing.T) {
	var s Set
	cases := []struct {
		seq  uint64
		slot int
		tier Tier
	}{{1, 0, GPU}, {1, 70, GPU}, {2, 0, Host}, {3, 5, Disk}, {1, 0, Host}}
	for _, c := range cases {
		if !s.Add(c.seq, c.slot, c.tier) {
			t.Fatalf("add %+v reported no change", c)
		}
	}
	if s.Add(1, 0, GPU) {
		t.Fatal("adding twice must report no change")
	}
	if s.Len() != 3 || s.Entries() != 5 {
		t.Fatalf("len %d entries %d", s.Len(), s.Entries())
	}
	if s.Held(0, GPU) != 1 || s.Held(0, Host) != 2 || s.Held(70, GPU) != 1 || s.Held(5, Disk) != 1 || s.Held(6, GPU) != 0 || s.Held(500, GPU) != 0 {
		t.Fatalf("held per slot and tier: %v", s.held)
	}
	if !s.Has(1, 70, GPU) || s.Has(1, 70, Host) || s.Has(9, 0, GPU) || s.Has(1, 500, GPU) {
		t.Fatal("Has disagrees with what was added")
	}
	if !s.Remove(1, 70, GPU) || s.Remove(1, 70, GPU) || s.Remove(1, 999, GPU) {
		t.Fatal("Remove must report exactly the entries it removed")
	}
	s.ClearSlot(0)
	if s.Entries() != 1 || s.Len() != 1 || s.Has(2, 0, Host) {
		t.Fatalf("%d entries and %d blocks left after clearing slot 0's 3", s.Entries(), s.Len())
	}
	if s.Held(0, GPU) != 0 || s.Held(0, Host) != 0 || s.Held(70, GPU) != 0 || s.Held(5, Disk) != 1 {
		t.Fatalf("held after Remove and ClearSlot: %v", s.held)
	}
	n := 0
	s.Each(func(seq uint64, slot int, tier Tier) {
		n++
		if seq != 3 || slot != 5 || tier != Disk {
			t.Fatalf("left %d %d %d", seq, slot, tier)
		}
	})
	if n != 1 {
		t.Fatalf("Each visited %d", n)
	}
}

func TestMatchRunsAndWeights(t *testing.T) {
	var s Set
	chain := []uint64{10, 11, 12, 13, 14}
	for i, h := range chain {
		s.Add(h, 0, GPU) // slot 0: the whole chain
		if i < 3 {
			s.Add(h, 65, Host) // slot 65 (second shard): three blocks in host memory
		}
		if i != 1 {
			s.Add(h, 2, GPU) // slot 2: a hole at block 1 ends its run at 1
		}
	}
	overlap := make([]float64, 70)
	best := s.Match(chain, overlap, DefaultWeights)
	if best != 5 || overlap[0] != 5 || overlap[2] != 1 || overlap[65] != 3*0.75 {
		t.Fatalf("overlap %v %v %v best %v", overlap[0], overlap[2], overlap[65], best)
	}
	// Slots past len(overlap) are not reported.
	short := make([]float64, 3)
	s.Match(chain, short, DefaultWeights)
	if short[0] != 5 || short[2] != 1 {
		t.Fatalf("short %v", short)
	}
	if a := testing.AllocsPerRun(50, func() { s.Match(chain, overlap, DefaultWeights) }); a != 0 {
		t.Fatalf("Match allocates %.1f", a)
	}
}

// TestTierOf: every medium vLLM and SGLang publish maps to its tier, locality makes storage
// shared or local, and an unknown medium is refused rather than taken for GPU memory.
func TestTierOf(t *testing.T) {
	for _, tc := range []struct {
		medium, locality string
		want             Tier
		ok               bool
	}{
		{"", "", GPU, true},
		{"GPU", "", GPU, true},
		{"CPU", "", Host, true},             // vLLM's CPU offloading tier
		{"CPU_PINNED", "", Host, true},      // SGLang HiCache L2
		{"cpu", "LOCAL", Host, true},        // locality does not move host memory
		{"CPU", "REMOTE", Host, true},       // nor does a REMOTE claim on it
		{"STORAGE", "", Disk, true},         // vLLM v0.27+ secondary tier, locality unsaid
		{"STORAGE", "LOCAL", Disk, true},    // a worker's own fs tier
		{"STORAGE", "REMOTE", Shared, true}, // a volume every worker mounts
		{"FS", "", Disk, true},              // vLLM v0.26's fs tier
		{"FS", "REMOTE", Shared, true},
		{"OBJ", "", Shared, true}, // v0.26's object store: shared unless said otherwise
		{"OBJ", "LOCAL", Disk, true},
		{"DISK", "", Disk, true}, // SGLang L3 on local disk
		{"EXTERNAL", "", Shared, true},
		{"LOCAL_DISK", "", Disk, true},
		{"weird", "", GPU, false},
		{"NVME_OF", "REMOTE", GPU, false},
	} {
		got, ok := TierOf(tc.medium, tc.locality)
		if ok != tc.ok || (ok && got != tc.want) {
			t.Errorf("TierOf(%q, %q) = %d, %v; want %d, %v", tc.medium, tc.locality, got, ok, tc.want, tc.ok)
		}
	}
}

// TestSharedTierExtendsRuns: a block only in shared storage continues a slot's run at the
// shared weight and is reported apart from host and disk blocks.
func TestSharedTierExtendsRuns(t *testing.T) {
	var s Set
	hs := []uint64{1, 2, 3, 4}
	s.Add(1, 0, GPU)
	s.Add(2, 0, Shared)
	s.Add(3, 0, Disk)
	s.Add(3, 0, Shared) // its own disk is the faster copy
	s.Add(4, 0, Shared)
	wt := Weights{1, 0.75, 0.25, 0.2}
	overlap := make([]float64, 1)
	lower := make([]Lower, 1)
	s.MatchTiers(hs, overlap, lower, wt)
	if want := 1 + 0.2 + 0.25 + 0.2; overlap[0] != want {
		t.Fatalf("overlap %v, want %v", overlap[0], want)
	}
	if l := lower[0]; l.Shared != 2 || l.Disk != 1 || l.Host != 0 || overlap[0]+l.Deficit != 4 {
		t.Fatalf("lower %+v", l)
	}
	if s.Len() != 4 {
		t.Fatalf("Len %d, want 4 distinct blocks", s.Len())
	}
}

// TestMatchTiersReportsLowerBlocks: a run's blocks whose fastest copy is below GPU memory are
// counted per tier, beside the weighted overlap, and the run length is overlap + Deficit.
func TestMatchTiersReportsLowerBlocks(t *testing.T) {
	var s Set
	hs := []uint64{10, 11, 12, 13, 14}
	// Slot 0: 10, 11 on GPU, 12 on host, 13 on disk and host (host is faster), 14 on disk.
	s.Add(10, 0, GPU)
	s.Add(11, 0, GPU)
	s.Add(12, 0, Host)
	s.Add(13, 0, Disk)
	s.Add(13, 0, Host)
	s.Add(14, 0, Disk)
	// Slot 70 (second shard): 10 on disk, then nothing.
	s.Add(10, 70, Disk)
	wt := Weights{1, 0.75, 0.25, 0.2}
	overlap := make([]float64, 71)
	lower := make([]Lower, 71)
	best := s.MatchTiers(hs, overlap, lower, wt)
	if want := 2 + 0.75 + 0.75 + 0.25; overlap[0] != want || best != want {
		t.Fatalf("slot 0 overlap %v (best %v), want %v", overlap[0], best, want)
	}
	if l := lower[0]; l.Host != 2 || l.Disk != 1 || overlap[0]+l.Deficit != 5 {
		t.Fatalf("slot 0 lower %+v, want 2 host, 1 disk, a run of 5", l)
	}
	if l := lower[70]; l.Disk != 1 || l.Host != 0 || overlap[70] != 0.25 {
		t.Fatalf("slot 70 lower %+v overlap %v, want 1 disk block at 0.25", l, overlap[70])
	}
	if lower[1] != (Lower{}) {
		t.Fatalf("an empty slot has %+v below GPU", lower[1])
	}
	plain := make([]float64, 71)
	if s.Match(hs, plain, wt); plain[0] != overlap[0] {
		t.Fatalf("Match %v differs from MatchTiers %v", plain[0], overlap[0])
	}
}

// reference is Match by brute force: for each slot, its run over the chain in any tier,
// blocks below GPU memory counted at their tier's weight (the fastest copy's).
func reference(s *Set, hashes []uint64, slots int, wt Weights) []float64 {
	out := make([]float64, slots)
	for slot := range slots {
		run := 0.0
		for _, h := range hashes {
			w, held := 0.0, false
			for t := range NumTiers {
				if s.Has(h, slot, t) {
					w, held = wt[t], true
					break
				}
			}
			if !held {
				break
			}
			run += w
		}
		out[slot] = run
	}
	return out
}

// TestMatchAgainstReference: random sets over several shards, most slots holding a common
// preamble (some only below GPU memory, some losing a block of it, some slots empty), each
// a tail of its own; Match agrees with the brute force after every round of changes.
func TestMatchAgainstReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const slots, preamble = 200, 24
	hashes := make([]uint64, preamble+8)
	for i := range hashes {
		hashes[i] = uint64(i+1) * 0x9E3779B97F4A7C15
	}
	var s Set
	overlap := make([]float64, slots)
	for round := range 40 {
		for range 300 {
			slot := rng.IntN(slots)
			tier := GPU
			if rng.IntN(8) == 0 {
				tier = Tier(1 + rng.IntN(int(NumTiers)-1))
			}
			n := rng.IntN(len(hashes) + 1)
			switch rng.IntN(10) {
			case 0:
				s.Remove(hashes[rng.IntN(len(hashes))], slot, tier)
			case 1:
				if round%4 == 3 {
					s.ClearSlot(slot)
				}
			default:
				for _, h := range hashes[:max(n, preamble)] {
					s.Add(h, slot, tier)
				}
			}
		}
		if round%5 == 4 {
			// Every slot holds the preamble in GPU memory: the shared run.
			for slot := range slots {
				for _, h := range hashes[:preamble] {
					s.Add(h, slot, GPU)
				}
			}
		}
		checkHolders(t, &s)
		for _, n := range []int{slots, 130, 64, 7} {
			got := overlap[:n]
			s.Match(hashes, got, DefaultWeights)
			want := reference(&s, hashes, n, DefaultWeights)
			for i := range want {
				if math.Abs(got[i]-want[i]) > 1e-9 {
					t.Fatalf("round %d, %d slots: slot %d overlap %v, want %v", round, n, i, got[i], want[i])
				}
			}
		}
	}
}

// checkHolders checks the Set's bookkeeping against its blocks: each block names a live set
// that holds something (or counts as dead), each set's references are the blocks naming it,
// its hash is its content's, interned sets are named by their hash, no interned content is
// interned twice, the per-slot counts are the entries', and Len counts the blocks holding
// anything.
func checkHolders(t *testing.T, s *Set) {
	t.Helper()
	refs := make([]int, len(s.sets))
	dead, live := 0, 0
	for _, v := range s.blocks.All() {
		if v == 0 || int(v) >= len(s.sets) {
			t.Fatalf("a block names set %d of %d", v, len(s.sets))
		}
		refs[v]++
		if len(s.sets[v].parts) == 0 {
			dead++
		} else {
			live++
		}
	}
	if dead != s.dead || live != s.Len() {
		t.Fatalf("%d dead and %d live blocks, the Set says %d and %d", dead, live, s.dead, s.Len())
	}
	free := map[uint32]bool{}
	for _, id := range s.free {
		free[id] = true
	}
	held := make([][NumTiers]int, len(s.held))
	for id := 1; id < len(s.sets); id++ {
		h := &s.sets[id]
		if free[uint32(id)] {
			if refs[id] != 0 || h.refs != 0 {
				t.Fatalf("free set %d is named by %d blocks", id, refs[id])
			}
			continue
		}
		if h.refs != refs[id] || h.refs == 0 {
			t.Fatalf("set %d counts %d references, %d blocks name it", id, h.refs, refs[id])
		}
		var sum uint64
		for i, p := range h.parts {
			if p.any() == 0 || (i > 0 && h.parts[i-1].shard >= p.shard) {
				t.Fatalf("set %d's parts %v: empty or out of order", id, h.parts)
			}
			for tier, b := range p.tiers {
				for ; b != 0; b &= b - 1 {
					slot := 64*int(p.shard) + bits.TrailingZeros64(b)
					sum += elemHash(slot, Tier(tier))
					held[slot][tier] += h.refs
				}
			}
		}
		if sum != h.hash {
			t.Fatalf("set %d's hash %x, its content's %x", id, h.hash, sum)
		}
		if h.lower != lowerOf(h.parts) {
			t.Fatalf("set %d's lower flag is %v", id, h.lower)
		}
		if v, _ := s.intern.Get(h.hash); h.canonical != (v == uint64(id)) {
			t.Fatalf("set %d canonical %v, interned %d", id, h.canonical, v)
		}
	}
	for hash, id := range s.intern.All() {
		if s.sets[id].hash != hash || !s.sets[id].canonical {
			t.Fatalf("hash %x interns set %d of hash %x", hash, id, s.sets[id].hash)
		}
	}
	for slot := range held {
		if held[slot] != s.held[slot] {
			t.Fatalf("slot %d holds %v, counted %v", slot, held[slot], s.held[slot])
		}
	}
}

// entry is one (block, slot, tier) of the model in TestAgainstModel.
type entry struct {
	seq  uint64
	slot int
	tier Tier
}

// TestAgainstModel applies random stores, removals and clears to a Set and to a plain map of entries, over blocks that many slots share in
// several shards, and checks after each step that they agree: what each op reports, Has,
// Held, Len, Entries, Each, EachSlots and Match; and the Set's own bookkeeping.
func TestAgainstModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const slots, blocks = 300, 40
	hashes := make([]uint64, blocks)
	for i := range hashes {
		hashes[i] = uint64(i+1) * 0x9E3779B97F4A7C15
	}
	model := map[entry]bool{}
	var s Set
	for step := range 4000 {
		slot := rng.IntN(slots)
		if rng.IntN(3) > 0 {
			slot = rng.IntN(8) * 37 // a few slots hold most, spread over the shards
		}
		tier := Tier(0)
		if rng.IntN(4) == 0 {
			tier = Tier(rng.IntN(int(NumTiers)))
		}
		e := entry{hashes[rng.IntN(blocks)], slot, tier}
		switch op := rng.IntN(20); {
		case op < 12:
			// A run of the chain, as engines store prefixes.
			for _, h := range hashes[:1+rng.IntN(blocks)] {
				e.seq = h
				if got := s.Add(e.seq, e.slot, e.tier); got == model[e] {
					t.Fatalf("step %d: Add(%+v) reported %v with the entry already %v", step, e, got, model[e])
				}
				model[e] = true
			}
		case op < 18:
			if got := s.Remove(e.seq, e.slot, e.tier); got != model[e] {
				t.Fatalf("step %d: Remove(%+v) reported %v", step, e, got)
			}
			delete(model, e)
		default:
			s.ClearSlot(slot)
			for m := range model {
				if m.slot == slot {
					delete(model, m)
				}
			}
		}
		if step%50 != 0 {
			continue
		}
		checkHolders(t, &s)
		checkModel(t, step, &s, model, hashes, slots)
	}
}

func checkModel(t *testing.T, step int, s *Set, model map[entry]bool, hashes []uint64, slots int) {
	t.Helper()
	distinct := map[uint64]bool{}
	held := make([][NumTiers]int, slots)
	for m := range model {
		distinct[m.seq] = true
		held[m.slot][m.tier]++
	}
	if s.Len() != len(distinct) || s.Entries() != len(model) {
		t.Fatalf("step %d: Len %d Entries %d, the model has %d blocks, %d entries", step, s.Len(), s.Entries(), len(distinct), len(model))
	}
	for slot := range slots {
		for tier := range NumTiers {
			if s.Held(slot, tier) != held[slot][tier] {
				t.Fatalf("step %d: slot %d holds %d in tier %d, the model %d", step, slot, s.Held(slot, tier), tier, held[slot][tier])
			}
		}
	}
	seen := map[entry]bool{}
	s.Each(func(seq uint64, slot int, tier Tier) { seen[entry{seq, slot, tier}] = true })
	if len(seen) != len(model) {
		t.Fatalf("step %d: Each gave %d entries, the model has %d", step, len(seen), len(model))
	}
	for m := range model {
		if !seen[m] || !s.Has(m.seq, m.slot, m.tier) {
			t.Fatalf("step %d: %+v missing from Each or Has", step, m)
		}
	}
	some := []int{0, 37, 74, 299}
	want := 0
	for m := range model {
		if slices.Contains(some, m.slot) {
			want++
		}
	}
	got := 0
	s.EachSlots(some, func(seq uint64, slot int, tier Tier) {
		if !model[entry{seq, slot, tier}] || !slices.Contains(some, slot) {
			t.Fatalf("step %d: EachSlots gave %d %d %d", step, seq, slot, tier)
		}
		got++
	})
	if got != want {
		t.Fatalf("step %d: EachSlots gave %d entries, want %d", step, got, want)
	}
	wt := Weights{1, 0.75, 0.25, 0.2}
	overlap := make([]float64, slots)
	lower := make([]Lower, slots)
	s.MatchTiers(hashes, overlap, lower, wt)
	for slot := range slots {
		run, deficit := 0.0, 0.0
		for _, h := range hashes {
			w := -1.0
			for tier := range NumTiers {
				if model[entry{h, slot, tier}] {
					w = wt[tier]
					break
				}
			}
			if w < 0 {
				break
			}
			run += w
			deficit += 1 - w
		}
		if math.Abs(overlap[slot]-run) > 1e-9 || math.Abs(lower[slot].Deficit-deficit) > 1e-9 {
			t.Fatalf("step %d: slot %d overlap %v deficit %v, the model %v %v", step, slot, overlap[slot], lower[slot].Deficit, run, deficit)
		}
	}
}

// TestFreedSetIsNotTakenForAnother: a holder set freed and reused for other holders is not
// handed to a block as the set it was.
func TestFreedSetIsNotTakenForAnother(t *testing.T) {
	var s Set
	s.Add(1, 5, GPU) // the set {5 GPU}
	s.Remove(1, 5, GPU)
	s.Add(2, 6, GPU) // its id, reused for {6 GPU}
	s.Add(3, 5, GPU)
	if !s.Has(3, 5, GPU) || s.Has(3, 6, GPU) || !s.Has(2, 6, GPU) || s.Has(2, 5, GPU) {
		t.Fatal("a block took the holders of a reused set")
	}
	checkHolders(t, &s)
}

// TestClearedSetIsNotTakenForItsPast: after ClearSlot edits a holder set in place, the next
// block making the change that led to that set gets the holders it asks for, not the set as
// edited.
func TestClearedSetIsNotTakenForItsPast(t *testing.T) {
	var s Set
	for _, seq := range []uint64{10, 11} {
		s.Add(seq, 1, GPU)
		s.Add(seq, 2, GPU) // both blocks: {1, 2}
	}
	s.Add(10, 3, GPU) // {1, 2} → {1, 2, 3}
	s.ClearSlot(3)    // that set, edited in place: {1, 2}
	s.Add(11, 3, GPU) // the same change again
	if !s.Has(11, 3, GPU) || s.Has(10, 3, GPU) {
		t.Fatal("a block took a cleared set for the change that had made it")
	}
	checkHolders(t, &s)
}

// TestFreedSetLeavesNoMemo: a holder set that a derive's shortcut frees (the last holder of
// a block removed, no set built) is not handed out again by the memo of the change that had
// made it.
func TestFreedSetLeavesNoMemo(t *testing.T) {
	var s Set
	for _, seq := range []uint64{1, 2} {
		s.Add(seq, 1, GPU)
		s.Add(seq, 2, GPU) // both blocks: {1, 2}
	}
	s.Remove(1, 2, GPU) // {1, 2} → {1}, built and remembered
	s.Remove(1, 1, GPU) // {1} → nothing, a shortcut: {1} freed
	s.Remove(2, 2, GPU) // {1, 2} → {1} again
	if !s.Has(2, 1, GPU) || s.Len() != 1 || s.Held(1, GPU) != 1 {
		t.Fatalf("block 2 names a freed set: has %v, len %d, held %d", s.Has(2, 1, GPU), s.Len(), s.Held(1, GPU))
	}
	checkHolders(t, &s)
}
