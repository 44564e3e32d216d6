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
