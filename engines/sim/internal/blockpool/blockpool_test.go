package blockpool

import (
	"slices"
	"testing"
)

// alloc allocates n blocks and stores hashes first+i in them.
func alloc(t *testing.T, p *Pool, n int, first uint64) []int32 {
	t.Helper()
	ids := make([]int32, 0, n)
	for i := range n {
		id, ok := p.Allocate()
		if !ok {
			t.Fatalf("allocation %d of %d: no free block", i, n)
		}
		p.Store(id, first+uint64(i))
		ids = append(ids, id)
	}
	return ids
}

// TestLRUEvictsTailFirst: freed blocks stay cached until reused; allocation evicts the least
// recently freed, and a holder's blocks are freed tail first.
func TestLRUEvictsTailFirst(t *testing.T) {
	p := New(6, true, LRU)
	a := alloc(t, p, 3, 10) // hashes 10, 11, 12
	b := alloc(t, p, 3, 20)
	if _, ok := p.Allocate(); ok || p.NumFree() != 0 || p.Usage() != 1 {
		t.Fatalf("allocated past a full pool: %d free", p.NumFree())
	}
	p.Free(a)
	p.Free(b)
	if p.Hits([]uint64{10, 11, 12, 13}) != 3 || p.NumUsed() != 0 {
		t.Fatalf("freed blocks: %d hits, %d used: want 3 still cached, none used", p.Hits([]uint64{10, 11, 12}), p.NumUsed())
	}
	p.ClearEvicted()
	for range 4 {
		if _, ok := p.Allocate(); !ok {
			t.Fatal("no free block")
		}
	}
	if got := p.Evicted(); !slices.Equal(got, []uint64{12, 11, 10, 22}) {
		t.Fatalf("evicted %v, want a's tail first, then b's", got)
	}
}

// TestTakeKeepsAHitFromEviction: a cached free block a holder takes leaves the free queue,
// so no allocation can evict it until it is freed again.
func TestTakeKeepsAHitFromEviction(t *testing.T) {
	p := New(3, true, LRU)
	p.Free(alloc(t, p, 3, 10)) // free queue: 12, 11, 10
	if id := p.Take(12); !p.InUse(id) || p.NumFree() != 2 {
		t.Fatalf("taken block %d in use %v, %d free", id, p.InUse(id), p.NumFree())
	}
	p.ClearEvicted()
	for range 2 {
		p.Allocate()
	}
	if _, ok := p.Allocate(); ok {
		t.Fatal("allocated the taken block")
	}
	if _, ok := p.Cached(12); !ok || !slices.Equal(p.Evicted(), []uint64{11, 10}) {
		t.Fatalf("evicted %v: want 11 and 10, 12 kept", p.Evicted())
	}
}

// TestStoreDuplicateStaysAnonymous: a second block storing a cached hash does not replace
// the cached copy, and evicting it later evicts nothing.
func TestStoreDuplicateStaysAnonymous(t *testing.T) {
	p := New(2, true, LRU)
	a, _ := p.Allocate()
	b, _ := p.Allocate()
	if !p.Store(a, 7) || p.Store(b, 7) {
		t.Fatal("want the first store cached, the duplicate not")
	}
	if id, _ := p.Cached(7); id != a {
		t.Fatalf("hash 7 cached in block %d, want %d", id, a)
	}
	p.Free([]int32{a, b}) // b first, then a
	p.ClearEvicted()
	p.Allocate()
	if len(p.Evicted()) != 0 {
		t.Fatalf("reusing the anonymous block evicted %v", p.Evicted())
	}
}

// TestWORMOrder: under WORM an ephemeral block goes first, a pinned one last, and a reused
// block counts as half its age against a once-seen one.
func TestWORMOrder(t *testing.T) {
	pinned := map[uint64]bool{}
	p := New(4, true, WORM)
	p.SetPinned(func(h uint64) bool { return pinned[h] })
	ids := alloc(t, p, 4, 1) // hashes 1 (pinned), 2 (reused), 3 (once), 4 (ephemeral)
	pinned[1] = true
	p.MarkEphemeral(ids[3])
	p.SetClock(0)
	p.Free(ids[1:2])
	p.Take(2) // a reuse
	p.Free(ids[1:2])
	p.SetClock(10)
	p.Free([]int32{ids[0], ids[2], ids[3]})
	p.SetClock(25) // the reused block is 25 old (counted 12.5), the once-seen one 15
	p.ClearEvicted()
	for range 4 {
		p.Allocate()
	}
	if got := p.Evicted(); !slices.Equal(got, []uint64{4, 3, 2, 1}) {
		t.Fatalf("WORM evicted %v, want ephemeral 4, once 3, reused 2, pinned 1", got)
	}
}

// TestResetRefusesWhileInUse: Reset forgets every cached hash only when no block is held.
func TestResetRefusesWhileInUse(t *testing.T) {
	p := New(2, true, LRU)
	ids := alloc(t, p, 1, 5)
	if p.Reset() {
		t.Fatal("reset while a block is held")
	}
	p.Free(ids)
	if !p.Reset() || p.Hits([]uint64{5}) != 0 {
		t.Fatal("reset of an idle pool kept its hashes")
	}
}

// TestNoPrefixCaching: with prefix caching off nothing is cached or found.
func TestNoPrefixCaching(t *testing.T) {
	p := New(1, false, LRU)
	id, _ := p.Allocate()
	if p.Store(id, 9) || p.Hits([]uint64{9}) != 0 {
		t.Fatal("cached a block with prefix caching off")
	}
}
