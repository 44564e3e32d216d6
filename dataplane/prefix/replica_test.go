package prefix

import (
	"testing"

	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

func TestReplicaMapsSlotsToPoolPositions(t *testing.T) {
	r := NewReplica(blockset.DefaultWeights)
	c := chain(1, 1, 6, 6)
	var cs []journal.Change
	for i, h := range c {
		cs = append(cs, journal.Change{Seq: h, Slot: 9, Op: journal.Stored}) // slot 9 holds all 6
		if i < 2 {
			cs = append(cs, journal.Change{Seq: h, Slot: 3, Tier: blockset.Host, Op: journal.Stored})
		}
	}
	r.Apply(cs)
	// The pool: position 0 is slot 3, position 1 has no slot, position 2 is slot 9.
	r.SetSlots([]int{3, -1, 9})
	overlap := make([]float64, 3)
	if best := r.Match(c, overlap); best != 6 || overlap[0] != 1.5 || overlap[1] != 0 || overlap[2] != 6 {
		t.Fatalf("overlap %v best %v", overlap, best)
	}
	r.Apply([]journal.Change{{Slot: 9, Op: journal.Cleared}, {Seq: c[0], Slot: 3, Tier: blockset.Host, Op: journal.Removed}})
	if r.Match(c, overlap); overlap[2] != 0 || overlap[0] != 0 {
		t.Fatalf("after clear and removal: %v", overlap)
	}
	// A snapshot is built aside: until it is complete, Match answers from the old state.
	r.Apply([]journal.Change{{Seq: c[0], Slot: 3, Tier: blockset.Host, Op: journal.Stored}})
	r.Reset()
	r.Apply([]journal.Change{{Seq: c[0], Slot: 9, Op: journal.Stored}})
	if r.Match(c, overlap); overlap[0] != 1.5 || overlap[2] != 0 {
		t.Fatalf("during a snapshot: %v, want the state before it", overlap)
	}
	r.SnapshotDone()
	if r.Match(c, overlap); overlap[0] != 0 || overlap[2] != 1 || r.Len() != 1 {
		t.Fatalf("after the snapshot: %v (len %d), want only the snapshot's block", overlap, r.Len())
	}
	if a := testing.AllocsPerRun(50, func() { r.Match(c, overlap) }); a != 0 {
		t.Fatalf("Match allocates %.1f", a)
	}
}
