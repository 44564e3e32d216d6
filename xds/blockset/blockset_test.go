package blockset

import (
	"math"
	"math/bits"
	"math/rand/v2"
	"sort"
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
	var cleared []uint64
	s.ClearSlot(0, func(seq uint64, tier Tier) { cleared = append(cleared, seq<<2|uint64(tier)) })
	sort.Slice(cleared, func(i, j int) bool { return cleared[i] < cleared[j] })
	if len(cleared) != 3 || s.Entries() != 1 {
		t.Fatalf("cleared %v, %d entries left", cleared, s.Entries())
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
					s.ClearSlot(slot, nil)
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
			if n, _ := s.gpuHolders.Get(hashes[preamble-1]); n != uint64(s.nonEmpty) {
				t.Fatalf("the preamble every slot holds is counted %d times for %d slots", n, s.nonEmpty)
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

// checkHolders checks the Set's GPU holder counts against a count of its shards: one for
// each block the first shard holds in GPU memory, and none for any other.
func checkHolders(t *testing.T, s *Set) {
	t.Helper()
	if len(s.shards) < 2 {
		return
	}
	for seq, n := range s.gpuHolders.All() {
		want := 0
		for _, sh := range s.shards {
			e, _ := sh.tiers[GPU].Get(seq)
			want += bits.OnesCount64(e)
		}
		if e, _ := s.shards[0].tiers[GPU].Get(seq); e == 0 {
			t.Fatalf("block %x counted (%d) though the first shard lacks it", seq, n)
		}
		if int(n) != want {
			t.Fatalf("block %x counted %d GPU holders, the shards say %d", seq, n, want)
		}
	}
	if s.gpuHolders.Len() != s.shards[0].tiers[GPU].Len() {
		t.Fatalf("%d counts for the first shard's %d GPU blocks", s.gpuHolders.Len(), s.shards[0].tiers[GPU].Len())
	}
}
