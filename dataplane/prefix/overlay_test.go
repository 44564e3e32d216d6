package prefix

import (
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

func TestOverlayTakesTheLargerOverlapPerWorker(t *testing.T) {
	rep := NewReplica(blockset.DefaultWeights)
	rep.SetSlots([]int{0, 1, 2})
	// Worker 0 stored blocks 1..3 (the engine said so); worker 2 was just routed 1..2.
	rep.Apply([]journal.Change{{Seq: 1, Slot: 0}, {Seq: 2, Slot: 0}, {Seq: 3, Slot: 0}})
	recent := NewApprox(ApproxConfig{MaxBlocks: 100, TTL: time.Minute})
	recent.Record(2, []uint64{1, 2}, 0)
	o := NewOverlay(rep, recent)
	overlap := make([]float64, 3)
	best := o.Match([]uint64{1, 2, 3, 4}, overlap)
	if best != 3 || overlap[0] != 3 || overlap[1] != 0 || overlap[2] != 2 {
		t.Fatalf("best %v overlap %v, want 3 [3 0 2]", best, overlap)
	}
	// Nothing recent: the replica's answer as it is.
	o = NewOverlay(rep, NewApprox(ApproxConfig{MaxBlocks: 100, TTL: time.Minute}))
	if best := o.Match([]uint64{1, 2}, overlap); best != 2 || overlap[0] != 2 || overlap[2] != 0 {
		t.Fatalf("best %v overlap %v", best, overlap)
	}
}

// TestOverlayTellsTiers: a proxy fed by a control plane routes on an Overlay, so the tiers
// its replica knows must come through it; a worker just sent a longer run than the replica
// knows is credited that run in GPU memory.
func TestOverlayTellsTiers(t *testing.T) {
	rep := NewReplica(blockset.DefaultWeights)
	rep.SetSlots([]int{0, 1, 2})
	// Worker 0: blocks 1..2 in GPU memory, 3..4 on disk. Worker 1: 1..4 on the host.
	// Worker 2: block 1 on disk.
	rep.Apply([]journal.Change{
		{Seq: 1, Slot: 0}, {Seq: 2, Slot: 0}, {Seq: 3, Slot: 0, Tier: blockset.Disk}, {Seq: 4, Slot: 0, Tier: blockset.Disk},
		{Seq: 1, Slot: 1, Tier: blockset.Host}, {Seq: 2, Slot: 1, Tier: blockset.Host}, {Seq: 3, Slot: 1, Tier: blockset.Host}, {Seq: 4, Slot: 1, Tier: blockset.Host},
		{Seq: 1, Slot: 2, Tier: blockset.Disk},
	})
	recent := NewApprox(ApproxConfig{MaxBlocks: 100, TTL: time.Minute})
	recent.Record(1, []uint64{1, 2, 3}, 0) // shorter than worker 1's run: the replica stands
	recent.Record(2, []uint64{1, 2, 3}, 0) // longer than worker 2's: all of it in GPU memory
	o := NewOverlay(rep, recent)
	var ti TierIndex = o
	overlap := make([]float64, 3)
	lower := make([]blockset.Lower, 3)
	want := make([]float64, 3)
	wantLower := make([]blockset.Lower, 3)
	rep.MatchTiers([]uint64{1, 2, 3, 4}, want, wantLower)
	best := ti.MatchTiers([]uint64{1, 2, 3, 4}, overlap, lower)
	if overlap[0] != want[0] || lower[0] != wantLower[0] || lower[0].Disk != 2 {
		t.Fatalf("worker 0: overlap %v lower %+v, want the replica's %v %+v with 2 disk blocks", overlap[0], lower[0], want[0], wantLower[0])
	}
	if overlap[1] != want[1] || lower[1] != wantLower[1] || lower[1].Host != 4 {
		t.Fatalf("worker 1: overlap %v lower %+v, want the replica's %v %+v with 4 host blocks", overlap[1], lower[1], want[1], wantLower[1])
	}
	if overlap[2] != 3 || lower[2] != (blockset.Lower{}) {
		t.Fatalf("worker 2: overlap %v lower %+v, want 3 blocks in GPU memory", overlap[2], lower[2])
	}
	if best != max(overlap[0], overlap[1], 3) {
		t.Fatalf("best %v, overlaps %v", best, overlap)
	}
	// Without lower, the same overlaps as Match.
	m := make([]float64, 3)
	o.Match([]uint64{1, 2, 3, 4}, m)
	o.MatchTiers([]uint64{1, 2, 3, 4}, overlap, nil)
	if m[0] != overlap[0] || m[1] != overlap[1] || m[2] != overlap[2] {
		t.Fatalf("Match %v, MatchTiers %v", m, overlap)
	}
}

func BenchmarkOverlayMatch(b *testing.B) {
	rep := NewReplica(blockset.DefaultWeights)
	slots := make([]int, 64)
	for i := range slots {
		slots[i] = i
	}
	rep.SetSlots(slots)
	hashes := make([]uint64, 512)
	var cs []journal.Change
	for i := range hashes {
		hashes[i] = uint64(i + 1)
		cs = append(cs, journal.Change{Seq: hashes[i], Slot: uint32(i % 64)})
	}
	rep.Apply(cs)
	recent := NewApprox(ApproxConfig{MaxBlocks: 1 << 16, TTL: time.Minute})
	recent.Record(3, hashes[:100], 0)
	o := NewOverlay(rep, recent)
	overlap := make([]float64, 64)
	b.ReportAllocs()
	for b.Loop() {
		o.Match(hashes, overlap)
	}
}
