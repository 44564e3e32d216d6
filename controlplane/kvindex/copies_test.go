package kvindex

import (
	"math"
	"testing"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// removed builds a BlockRemoved event for blocks [from, from+n) of tag.
func removed(tag uint64, from, n int, medium, locality, owner string) kvevents.Event {
	return kvevents.Event{Kind: kvevents.BlockRemoved, Medium: medium, Locality: locality, Ownership: owner,
		BlockHashes: engineHashes(tag, from, n, false)}
}

// run is the overlap of p's chain on worker id, tier weights all 1.
func run(x *Index, id string, p []uint32) float64 {
	overlap := make([]float64, len(x.Workers()))
	x.Match(blockhash.Seq(p, 16, nil), overlap, Weights{1, 1, 1, 1})
	return overlap[x.Slot(id)]
}

// TestCopiesAreCountedPerTierAndOwner follows vLLM's offloading: the CPU tier's store is a
// copy (the GPU block stays until its own removal), overlapping offload chunks announce a
// block again, two secondary tiers of one medium hold their own copies, and each copy leaves
// with its own removal.
func TestCopiesAreCountedPerTierAndOwner(t *testing.T) {
	x := New()
	p := prompt(1, 1, 4, 4)
	x.Apply("w", batch(stored(p, 1, 0, 4, "GPU", false)), nil)
	// Offload to CPU: the same engine hashes, a copy.
	x.Apply("w", batch(stored(p, 1, 0, 4, "CPU", false)), nil)
	// An overlapping chunk announces blocks 2-3 on CPU again.
	x.Apply("w", batch(stored(p, 1, 2, 2, "CPU", false)), nil)
	// Two storage tiers (ownership fs and obj, both local) take blocks 0-3.
	for _, owner := range []string{"fs", "obj"} {
		ev := stored(p, 1, 0, 4, "STORAGE", false)
		ev.Locality, ev.Ownership = "LOCAL", owner
		x.Apply("w", batch(ev), nil)
	}
	if b := x.Blocks("w"); b[GPU] != 4 || b[Host] != 4 || b[Disk] != 8 {
		t.Fatalf("blocks %v, want 4 GPU, 4 host, 4+4 disk copies", b)
	}
	if st := x.Stats(); st.Copies != 2 {
		t.Fatalf("copies %d, want the 2 re-announced blocks", st.Copies)
	}
	// GPU evicts everything: the run stays whole, from host memory.
	if ch := x.Apply("w", batch(removed(1, 0, 4, "GPU", "", "")), nil); len(ch) != 4 {
		t.Fatalf("GPU removal changed %v", ch)
	}
	if r := run(x, "w", p); r != 4 {
		t.Fatalf("after the GPU eviction the run is %v, want 4 from the host copies", r)
	}
	// The CPU tier evicts blocks 2-3 once: the second announcement keeps them.
	x.Apply("w", batch(removed(1, 2, 2, "CPU", "", "")), nil)
	if b := x.Blocks("w"); b[Host] != 4 {
		t.Fatalf("host blocks %d after one of two removals, want 4", b[Host])
	}
	x.Apply("w", batch(removed(1, 2, 2, "CPU", "", ""), removed(1, 0, 2, "CPU", "", "")), nil)
	if b := x.Blocks("w"); b[Host] != 0 {
		t.Fatalf("host blocks %d after every copy left", b[Host])
	}
	// The fs tier drops its copies; obj's keep the disk tier's run.
	if ch := x.Apply("w", batch(removed(1, 0, 4, "STORAGE", "LOCAL", "fs")), nil); len(ch) != 0 {
		t.Fatalf("removing fs's copies while obj holds them changed %v", ch)
	}
	if r := run(x, "w", p); r != 4 {
		t.Fatalf("run %v after fs's eviction, want 4 from obj's copies", r)
	}
	if ch := x.Apply("w", batch(removed(1, 0, 4, "STORAGE", "LOCAL", "obj")), nil); len(ch) != 4 {
		t.Fatalf("removing the last copies changed %v", ch)
	}
	if r := run(x, "w", p); r != 0 || x.Len() != 0 {
		t.Fatalf("run %v, %d blocks after every copy left", r, x.Len())
	}
	// A removal of a block nobody announced is ignored and counted.
	before := x.Stats().Unknown
	x.Apply("w", batch(removed(1, 0, 1, "CPU", "", "")), nil)
	if x.Stats().Unknown != before+1 {
		t.Fatal("an unknown removal must be counted")
	}
}

// TestUnknownMediumIsNotCredited: a block in a medium kvrelay does not know is counted and
// left out, not credited as GPU memory.
func TestUnknownMediumIsNotCredited(t *testing.T) {
	x := New()
	p := prompt(1, 1, 4, 4)
	x.Apply("w", batch(stored(p, 1, 0, 4, "NVME_OF", false)), nil)
	if x.Len() != 0 || x.Stats().UnknownMedium != 4 {
		t.Fatalf("len %d, stats %+v", x.Len(), x.Stats())
	}
	x.Apply("w", batch(removed(1, 0, 4, "NVME_OF", "", "")), nil)
	if x.Stats().UnknownMedium != 8 || x.Stats().Unknown != 0 {
		t.Fatalf("stats %+v", x.Stats())
	}
}

// TestPlaceholdersAreNeverTakenForPrefixes: an offload event without tokens (one hash per
// chunk, block_size 0) indexes only blocks the worker announced with their tokens, and
// nothing else.
func TestPlaceholdersAreNeverTakenForPrefixes(t *testing.T) {
	x := New()
	p := prompt(1, 1, 8, 8)
	x.Apply("w", batch(stored(p, 1, 0, 4, "GPU", false)), nil)
	// A chunk of 4 blocks offloaded to CPU, named by its last block's hash; another chunk
	// named by a hash the index never saw.
	known := kvevents.Event{Kind: kvevents.BlockStored, Medium: "CPU", BlockHashes: engineHashes(1, 3, 1, false)}
	unknown := kvevents.Event{Kind: kvevents.BlockStored, Medium: "CPU", BlockHashes: engineHashes(1, 7, 1, false)}
	x.Apply("w", batch(known, unknown), nil)
	st := x.Stats()
	if st.Placeholders != 2 || st.PlaceholdersResolved != 1 || st.Orphans != 0 {
		t.Fatalf("stats %+v", st)
	}
	if b := x.Blocks("w"); b[Host] != 1 {
		t.Fatalf("host blocks %d, want the one resolved placeholder", b[Host])
	}
	// GPU evicts blocks 0-3: the host holds block 3 alone, not a prefix.
	x.Apply("w", batch(removed(1, 0, 4, "GPU", "", "")), nil)
	if r := run(x, "w", p); r != 0 {
		t.Fatalf("run %v: a placeholder was taken for a prefix", r)
	}
}

// remote builds a store of blocks [from, from+n) of p in shared storage owned by owner.
func remote(p []uint32, tag uint64, from, n int, owner string) kvevents.Event {
	ev := stored(p, tag, from, n, "STORAGE", false)
	ev.Locality, ev.Ownership = "REMOTE", owner
	return ev
}

// slotsOf collects the slots changes name for tier t, by whether they add or remove.
func slotsOf(cs []Change, t Tier, removed bool) map[int]int {
	m := map[int]int{}
	for _, c := range cs {
		if c.Tier == t && c.Removed == removed {
			m[c.Slot]++
		}
	}
	return m
}

// TestSharedStorageIsIndexedOnceForEveryMount: blocks one worker writes to storage several
// workers mount (locality REMOTE) are credited to every worker that mounts it, leave all of
// them together, outlive a worker's restart and removal, and stay apart from another owner's
// storage.
func TestSharedStorageIsIndexedOnceForEveryMount(t *testing.T) {
	x := New()
	p := prompt(1, 1, 6, 6)
	q := prompt(2, 2, 4, 4)
	a, b, c := x.Slot("a"), x.Slot("b"), x.Slot("c")
	if ch := x.Apply("a", batch(remote(p, 1, 0, 6, "fs")), nil); len(slotsOf(ch, Shared, false)) != 1 || slotsOf(ch, Shared, false)[a] != 6 {
		t.Fatalf("a's write changed %v", ch)
	}
	// b writes something else to the same storage: it mounts it, and gets a's blocks.
	ch := x.Apply("b", batch(remote(q, 2, 0, 4, "fs")), nil)
	if got := slotsOf(ch, Shared, false); got[b] != 6+4 || got[a] != 4 {
		t.Fatalf("b's first write credited %v, want b 10 blocks and a 4", got)
	}
	// c writes to another owner's storage: it sees neither.
	x.Apply("c", batch(remote(q, 3, 0, 4, "obj")), nil)
	if r := run(x, "b", p); r != 6 {
		t.Fatalf("b's run on a's prompt is %v, want 6 from shared storage", r)
	}
	if r := run(x, "c", p); r != 0 {
		t.Fatalf("c's run on fs's blocks is %v, want 0", r)
	}
	overlap := make([]float64, 3)
	x.Match(blockhash.Seq(p, 16, nil), overlap, DefaultWeights)
	if math.Abs(overlap[a]-6*0.2) > 1e-9 || math.Abs(overlap[b]-6*0.2) > 1e-9 {
		t.Fatalf("weighted overlap %v, want shared blocks at 0.2", overlap)
	}
	if bl := x.Blocks("b"); bl[Shared] != 10 || bl[GPU] != 0 {
		t.Fatalf("b's blocks %v", bl)
	}
	// b's engine restarts: its own blocks go, the storage's stay credited.
	x.Apply("b", batch(stored(q, 2, 0, 4, "GPU", false)), nil)
	ch = x.Clear("b", nil)
	if got := slotsOf(ch, Shared, false); got[b] != 10 {
		t.Fatalf("Clear re-credited %v, want the storage's 10 blocks", got)
	}
	if r := run(x, "b", p); r != 6 {
		t.Fatalf("after b's restart its run is %v, want 6", r)
	}
	// a leaves: the blocks it wrote stay in the storage b mounts.
	x.RemoveWorker("a", nil)
	if r := run(x, "b", p); r != 6 {
		t.Fatalf("after a left b's run is %v, want 6", r)
	}
	// The storage evicting blocks 4-5 (announced by any mounting worker) takes them from b.
	ev := kvevents.Event{Kind: kvevents.BlockRemoved, Medium: "STORAGE", Locality: "REMOTE", Ownership: "fs",
		BlockHashes: engineHashes(1, 4, 2, false)}
	ch = x.Apply("b", batch(ev), nil)
	if got := slotsOf(ch, Shared, true); got[b] != 2 || len(got) != 1 {
		t.Fatalf("the eviction removed %v", got)
	}
	if r := run(x, "b", p); r != 4 {
		t.Fatalf("after the eviction b's run is %v, want 4", r)
	}
	_ = c
}

// TestSharedStorageForgetsOldestPastItsBound: shared tiers announce stores and never
// deletions, so the index keeps at most MaxSharedBlocks per storage, forgetting the oldest,
// and takes a block written again after that as new.
func TestSharedStorageForgetsOldestPastItsBound(t *testing.T) {
	x := New()
	x.MaxSharedBlocks = 4
	p := prompt(1, 1, 6, 6)
	x.Apply("a", batch(remote(p, 1, 0, 6, "fs")), nil)
	if st := x.Stats(); st.SharedExpired != 2 {
		t.Fatalf("expired %d, want 2", st.SharedExpired)
	}
	if bl := x.Blocks("a"); bl[Shared] != 4 {
		t.Fatalf("shared blocks %d, want 4", bl[Shared])
	}
	if r := run(x, "a", p); r != 0 {
		t.Fatalf("run %v: the first blocks were forgotten, so no prefix starts", r)
	}
	// Written again, the first two blocks are new (and push out the next oldest).
	x.Apply("a", batch(remote(p, 1, 0, 2, "fs")), nil)
	if r := run(x, "a", p); r != 2 {
		t.Fatalf("run %v after the rewrite, want 2", r)
	}
}

// TestSharedPlaceholdersResolveThroughTheWriter: a placeholder store in shared storage (vLLM's
// fs tier without self-describing events) names a block the writer announced with tokens on
// its GPU: the block is indexed in the storage for every mount; an unknown hash is dropped.
func TestSharedPlaceholdersResolveThroughTheWriter(t *testing.T) {
	x := New()
	p := prompt(1, 1, 4, 4)
	x.Apply("b", batch(remote(prompt(2, 2, 1, 1), 9, 0, 1, "fs")), nil) // b mounts the storage
	x.Apply("a", batch(stored(p, 1, 0, 4, "GPU", false)), nil)
	ph := kvevents.Event{Kind: kvevents.BlockStored, Medium: "STORAGE", Locality: "REMOTE", Ownership: "fs",
		BlockHashes: append(engineHashes(1, 0, 4, false), engineHashes(77, 0, 1, false)...)}
	x.Apply("a", batch(ph), nil)
	if st := x.Stats(); st.Placeholders != 5 || st.PlaceholdersResolved != 4 {
		t.Fatalf("stats %+v", st)
	}
	if r := run(x, "b", p); r != 4 {
		t.Fatalf("b's run %v, want the 4 blocks a wrote to the shared storage", r)
	}
}
