package ingest

import (
	"testing"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// TestSharedStorageJournalsEveryMount: a block written to storage two workers mount reaches
// the journal for both slots, and a worker's restart clears its slot and credits the storage
// again, so that a replica replaying the journal holds exactly the index's entries.
func TestSharedStorageJournalsEveryMount(t *testing.T) {
	idx := kvindex.New()
	log := journal.NewLog(1024)
	m := NewManager(idx, log, nil)
	defer m.Close()
	follow := func(id string) *follower {
		return &follower{m: m, s: &subscription{ep: Endpoint{WorkerID: id}, stats: &Stats{}}}
	}
	a, b := follow("a"), follow("b")
	remote := func(first uint32, n int, tag uint64) *kvevents.Batch {
		ev, _ := stored(first, n, 0, false, tag)
		ev.Medium, ev.Locality, ev.Ownership = "STORAGE", "REMOTE", "fs"
		return &kvevents.Batch{Events: []kvevents.Event{ev}}
	}
	a.emit(0, remote(100, 3, 1))
	gpu, _ := stored(500, 2, 0, false, 2)
	b.emit(0, &kvevents.Batch{Events: []kvevents.Event{gpu}})
	b.emit(1, remote(900, 2, 3)) // b mounts the storage: a's 3 blocks are credited to it
	if got := idx.Blocks("b"); got[kvindex.Shared] != 5 || got[kvindex.GPU] != 2 {
		t.Fatalf("b's blocks %v", got)
	}
	m.drop("b", false) // b's engine restarted
	if got := idx.Blocks("b"); got[kvindex.Shared] != 5 || got[kvindex.GPU] != 0 {
		t.Fatalf("b's blocks after its restart %v", got)
	}
	if n := checkJournalReplays(t, log, idx); n != 10 {
		t.Fatalf("the index holds %d entries, want 10", n)
	}
}

// checkJournalReplays replays log as a proxy's replica does, entry by (block, slot, tier), and
// fails unless it holds exactly idx's entries; it returns how many there are.
func checkJournalReplays(t *testing.T, log *journal.Log, idx *kvindex.Index) int {
	t.Helper()
	type entry struct {
		seq  uint64
		slot uint32
		tier kvindex.Tier
	}
	cs, _, ok := log.Read(nil, 0, 1<<20)
	if !ok {
		t.Fatal("journal read")
	}
	replica := map[entry]bool{}
	for _, c := range cs {
		switch c.Op {
		case journal.Stored:
			replica[entry{c.Seq, c.Slot, c.Tier}] = true
		case journal.Removed:
			delete(replica, entry{c.Seq, c.Slot, c.Tier})
		case journal.Cleared:
			for e := range replica {
				if e.slot == c.Slot {
					delete(replica, e)
				}
			}
		}
	}
	want := map[entry]bool{}
	idx.Each(func(seq uint64, slot int, tier kvindex.Tier) { want[entry{seq, uint32(slot), tier}] = true })
	if len(replica) != len(want) {
		t.Fatalf("journal replays to %d entries, the index holds %d", len(replica), len(want))
	}
	for e := range want {
		if !replica[e] {
			t.Fatalf("the index holds %+v, the journal does not", e)
		}
	}
	return len(want)
}

// TestAllBlocksClearedIsOneChange: an engine's AllBlocksCleared in the middle of a batch
// reaches the journal as one Cleared change of its slot, between the stores before and after
// it, not as a removal per block; replayed, the journal holds what the index holds.
func TestAllBlocksClearedIsOneChange(t *testing.T) {
	idx := kvindex.New()
	log := journal.NewLog(1024)
	m := NewManager(idx, log, nil)
	defer m.Close()
	f := &follower{m: m, s: &subscription{ep: Endpoint{WorkerID: "w"}, stats: &Stats{}}}
	before, _ := stored(100, 40, 0, false, 1)
	after, _ := stored(9000, 2, 0, false, 2)
	f.emit(0, &kvevents.Batch{Events: []kvevents.Event{before, {Kind: kvevents.AllBlocksCleared}, after}})
	cs, _, ok := log.Read(nil, 0, 1<<20)
	if !ok || len(cs) != 43 {
		t.Fatalf("journal of %d changes, want 40 stores, a clear and 2 stores", len(cs))
	}
	if c := cs[40]; c.Op != journal.Cleared || int(c.Slot) != idx.Slot("w") {
		t.Fatalf("change 40 is %+v, want the slot's clear", c)
	}
	if idx.Blocks("w")[kvindex.GPU] != 2 {
		t.Fatalf("blocks %v after the clear", idx.Blocks("w"))
	}
	if n := checkJournalReplays(t, log, idx); n != 2 {
		t.Fatalf("the journal replays to %d entries, want 2", n)
	}
}
