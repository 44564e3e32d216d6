package kvindex

import (
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// prompt is n blocks of 16 tokens: the first shared blocks are common to every prompt with
// the same family, the rest unique to seed.
func prompt(family, seed uint32, shared, n int) []uint32 {
	t := make([]uint32, 16*n)
	for i := range t {
		if i < 16*shared {
			t[i] = family*1_000_003 + uint32(i)
		} else {
			t[i] = seed*7_919_111 + uint32(i)
		}
	}
	return t
}

// engineHashes are opaque engine hashes for n blocks starting at offset, distinct per tag.
func engineHashes(tag uint64, from, n int, asBytes bool) []kvevents.Hash {
	hs := make([]kvevents.Hash, n)
	for i := range hs {
		v := tag<<32 | uint64(from+i) | 1<<63
		if asBytes {
			hs[i] = kvevents.HashBytes([]byte("blk-" + strconv.FormatUint(v, 16)))
		} else {
			hs[i] = kvevents.HashU64(v)
		}
	}
	return hs
}

// stored builds a BlockStored event for blocks [from, from+n) of toks.
func stored(toks []uint32, tag uint64, from, n int, medium string, asBytes bool) kvevents.Event {
	ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: 16, Medium: medium,
		BlockHashes: engineHashes(tag, from, n, asBytes), TokenIDs: toks[16*from : 16*(from+n)]}
	if from > 0 {
		ev.Parent, ev.HasParent = engineHashes(tag, from-1, 1, asBytes)[0], true
	}
	return ev
}

func batch(evs ...kvevents.Event) *kvevents.Batch { return &kvevents.Batch{Events: evs} }

func TestStoredChainsMatchTheProxysHashes(t *testing.T) {
	x := New()
	p := prompt(1, 1, 8, 8)
	// The chain arrives in two events, the second naming the first's last block as parent.
	x.Apply("w0", batch(stored(p, 7, 0, 5, "GPU", false)), nil)
	x.Apply("w0", batch(stored(p, 7, 5, 3, "GPU", false)), nil)
	x.Apply("w1", batch(stored(p, 9, 0, 3, "GPU", true)), nil) // bytes hashes
	overlap := make([]float64, 4)
	best := x.Match(blockhash.Seq(p, 16, nil), overlap, DefaultWeights)
	if best != 8 || overlap[x.Slot("w0")] != 8 || overlap[x.Slot("w1")] != 3 {
		t.Fatalf("overlap %v best %v", overlap, best)
	}
	// A prompt sharing 4 blocks of the family.
	q := prompt(1, 2, 4, 10)
	x.Match(blockhash.Seq(q, 16, nil), overlap, DefaultWeights)
	if overlap[0] != 4 || overlap[1] != 3 {
		t.Fatalf("shared-prefix overlap %v", overlap)
	}
}

func TestRemovalsResolveThroughEngineHashes(t *testing.T) {
	for _, asBytes := range []bool{false, true} {
		t.Run(map[bool]string{false: "integer hashes", true: "bytes hashes"}[asBytes], func(t *testing.T) {
			x := New()
			p := prompt(1, 1, 6, 6)
			x.Apply("w", batch(stored(p, 3, 0, 6, "GPU", asBytes)), nil)
			// vLLM evicts a chain's tail first.
			rm := kvevents.Event{Kind: kvevents.BlockRemoved, Medium: "GPU", BlockHashes: engineHashes(3, 4, 2, asBytes)}
			removed := x.Apply("w", batch(rm), nil)
			if len(removed) != 2 {
				t.Fatalf("removed %v", removed)
			}
			overlap := make([]float64, 1)
			if x.Match(blockhash.Seq(p, 16, nil), overlap, DefaultWeights); overlap[0] != 4 {
				t.Fatalf("after removing the tail: %v", overlap)
			}
			unknown := kvevents.Event{Kind: kvevents.BlockRemoved, BlockHashes: engineHashes(99, 0, 1, asBytes)}
			x.Apply("w", batch(unknown), nil)
			if x.Stats().Unknown != 1 {
				t.Fatal("a removal of an unknown block must be counted")
			}
		})
	}
}

func TestOrphansAreSkippedAndCounted(t *testing.T) {
	x := New()
	p := prompt(1, 1, 6, 6)
	// The event of blocks 0-2 was lost; blocks 3-5 name an unknown parent.
	x.Apply("w", batch(stored(p, 3, 3, 3, "GPU", false)), nil)
	if x.Len() != 0 || x.Stats().Orphans != 3 {
		t.Fatalf("len %d stats %+v", x.Len(), x.Stats())
	}
	// A simulator's parent 0 means "first block".
	ev := stored(p, 3, 0, 2, "GPU", false)
	ev.Parent, ev.HasParent = kvevents.HashU64(0), true
	x.Apply("w", batch(ev), nil)
	if x.Len() != 2 {
		t.Fatalf("parent 0 should start a chain: len %d", x.Len())
	}
}

func TestTiersAndWeights(t *testing.T) {
	x := New()
	p := prompt(1, 1, 8, 8)
	x.Apply("w", batch(stored(p, 1, 0, 4, "GPU", false), stored(p, 1, 4, 4, "CPU", false)), nil)
	x.Apply("v", batch(stored(p, 2, 0, 8, "DISK", false)), nil)
	overlap := make([]float64, 2)
	x.Match(blockhash.Seq(p, 16, nil), overlap, DefaultWeights)
	if overlap[x.Slot("w")] != 4+4*0.75 || overlap[x.Slot("v")] != 8*0.25 {
		t.Fatalf("weighted overlap %v", overlap)
	}
	// The same block in GPU and host memory counts at GPU weight.
	x.Apply("v", batch(stored(p, 2, 0, 8, "GPU", false)), nil)
	x.Match(blockhash.Seq(p, 16, nil), overlap, DefaultWeights)
	if overlap[x.Slot("v")] != 8 {
		t.Fatalf("fastest tier should count: %v", overlap)
	}
	if b := x.Blocks("v"); b[GPU] != 8 || b[Disk] != 8 {
		t.Fatalf("blocks %v", b)
	}
}

func TestClearRemoveAndSlotReuse(t *testing.T) {
	x := New()
	p := prompt(1, 1, 4, 4)
	x.Apply("a", batch(stored(p, 1, 0, 4, "GPU", false)), nil)
	x.Apply("b", batch(stored(p, 2, 0, 4, "GPU", false)), nil)
	removed := x.Apply("a", batch(kvevents.Event{Kind: kvevents.AllBlocksCleared}), nil)
	if want := (Change{Cleared: true, Slot: x.Slot("a")}); len(removed) != 1 || removed[0] != want || x.Len() != 4 {
		t.Fatalf("cleared %+v, len %d", removed, x.Len())
	}
	if b := x.Blocks("a"); b != [numTiers]int{} {
		t.Fatalf("a holds %v after its clear", b)
	}
	slotB := x.Slot("b")
	if got := x.RemoveWorker("b", nil); len(got) != 1 || !got[0].Cleared || got[0].Slot != slotB || x.Len() != 0 {
		t.Fatalf("removing b changed %+v, len %d", got, x.Len())
	}
	if x.Slot("c") != slotB {
		t.Fatal("a freed slot should be reused")
	}
}

func TestManyWorkersAcrossShards(t *testing.T) {
	x := New()
	p := prompt(1, 1, 4, 4)
	for w := range 150 {
		n := 1 + w%4
		x.Apply("w"+strconv.Itoa(w), batch(stored(p, uint64(w), 0, n, "GPU", false)), nil)
	}
	overlap := make([]float64, 150)
	if best := x.Match(blockhash.Seq(p, 16, nil), overlap, DefaultWeights); best != 4 {
		t.Fatalf("best %v", best)
	}
	for w := range 150 {
		if want := float64(1 + w%4); overlap[x.Slot("w"+strconv.Itoa(w))] != want {
			t.Fatalf("worker %d overlap %v want %v", w, overlap[w], want)
		}
	}
}

func TestHybridGroupsIndexFullAttentionOnly(t *testing.T) {
	x := New()
	p := prompt(1, 1, 4, 4)
	sw := stored(p, 1, 0, 4, "GPU", false)
	sw.KVCacheSpecKind, sw.GroupIdx, sw.HasGroupIdx = "sliding_window", 1, true
	fa := stored(p, 2, 0, 4, "GPU", false)
	fa.KVCacheSpecKind, fa.GroupIdx, fa.HasGroupIdx = "full_attention", 0, true
	x.Apply("w", batch(sw, fa), nil)
	if x.Stats().SkippedGroups != 1 || x.Len() != 4 || x.Blocks("w")[GPU] != 4 {
		t.Fatalf("stats %+v len %d", x.Stats(), x.Len())
	}
}

func TestMatchDoesNotAllocate(t *testing.T) {
	x := New()
	p := prompt(1, 1, 512, 512)
	for w := range 64 {
		x.Apply("w"+strconv.Itoa(w), batch(stored(p, uint64(w), 0, 100+w*6, "GPU", false)), nil)
	}
	hs := blockhash.Seq(p, 16, nil)
	overlap := make([]float64, 64)
	if a := testing.AllocsPerRun(100, func() { x.Match(hs, overlap, DefaultWeights) }); a != 0 {
		t.Fatalf("Match allocates %.1f times", a)
	}
}

// BenchmarkIngest applies BlockStored events of 64 16-token blocks (prepared beforehand, as
// the decoder hands them over) from 8 workers (one shard of slots) and from 128 (two): block
// events per second.
func BenchmarkIngest(b *testing.B) {
	const chain, nev = 64, 2048
	evs := make([]*kvevents.Batch, nev)
	for i := range evs {
		toks := prompt(uint32(i+5), uint32(i+5), 0, chain)
		evs[i] = batch(stored(toks, uint64(i), 0, chain, "GPU", false))
	}
	for _, workers := range []int{8, 128} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			x := New()
			var cs []Change
			i := 0
			b.ReportAllocs()
			for b.Loop() {
				cs = x.Apply("w"+strconv.Itoa(i%workers), evs[i%nev], cs[:0])
				i++
			}
			b.ReportMetric(float64(b.N*chain)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// BenchmarkIngestBesideQueries is BenchmarkIngest's 128 workers with another goroutine
// matching a 64-block prompt without pause (an index query's work): against the same index,
// whose read lock ingest's write lock waits for; against another index of the same blocks,
// the same CPU with no lock shared; or none. The first two apart are what the one lock costs
// ingest beside queries.
func BenchmarkIngestBesideQueries(b *testing.B) {
	const chain, nev, workers = 64, 2048, 128
	evs := make([]*kvevents.Batch, nev)
	for i := range evs {
		toks := prompt(uint32(i+5), uint32(i+5), 0, chain)
		evs[i] = batch(stored(toks, uint64(i), 0, chain, "GPU", false))
	}
	hs := blockhash.Seq(prompt(5, 5, 0, chain), 16, nil)
	for _, mode := range []string{"none", "other-index", "same-index"} {
		b.Run("queries="+mode, func(b *testing.B) {
			x, other := New(), New()
			for i, ev := range evs {
				x.Apply("w"+strconv.Itoa(i%workers), ev, nil)
				other.Apply("w"+strconv.Itoa(i%workers), ev, nil)
			}
			qx := x
			if mode == "other-index" {
				qx = other
			}
			stop, done := make(chan struct{}), make(chan struct{})
			var queries atomic.Int64
			if mode == "none" {
				close(done)
			} else {
				go func() {
					defer close(done)
					overlap := make([]float64, workers)
					lower := make([]blockset.Lower, workers)
					for {
						select {
						case <-stop:
							return
						default:
						}
						qx.MatchTiers(hs, overlap, lower, DefaultWeights)
						queries.Add(1)
					}
				}()
			}
			var cs []Change
			i := 0
			for b.Loop() {
				cs = x.Apply("w"+strconv.Itoa(i%workers), evs[i%nev], cs[:0])
				i++
			}
			close(stop)
			<-done
			secs := b.Elapsed().Seconds()
			b.ReportMetric(float64(b.N*chain)/secs, "blocks/s")
			b.ReportMetric(float64(queries.Load())/secs, "queries/s")
		})
	}
}

// BenchmarkMatch512x64: a 512-block prompt against 64 workers holding parts of it, with 1M
// other blocks indexed.
func BenchmarkMatch512x64(b *testing.B) {
	x := New()
	for g := range 2000 {
		toks := prompt(uint32(g+10), uint32(g+10), 0, 512)
		x.Apply("w"+strconv.Itoa(g%64), batch(stored(toks, uint64(g+1000), 0, 512, "GPU", false)), nil)
	}
	p := prompt(1, 1, 512, 512)
	for w := range 64 {
		x.Apply("w"+strconv.Itoa(w), batch(stored(p, uint64(w), 0, 100+w*6, "GPU", false)), nil)
	}
	hs := blockhash.Seq(p, 16, nil)
	overlap := make([]float64, 64)
	b.ReportAllocs()
	for b.Loop() {
		x.Match(hs, overlap, DefaultWeights)
	}
}

// TestMemoryPerBlock reports (and bounds) the heap the index takes per indexed block.
func TestMemoryPerBlock(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~100 MB")
	}
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	x := New()
	const blocks = 1 << 20
	for g := 0; g < blocks/512; g++ {
		toks := prompt(uint32(g+10), uint32(g+10), 0, 512)
		x.Apply("w"+strconv.Itoa(g%64), batch(stored(toks, uint64(g+1), 0, 512, "GPU", false)), nil)
	}
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(x.Len())
	t.Logf("%d blocks, %.1f bytes per indexed block", x.Len(), per)
	if per > 100 {
		t.Fatalf("%.1f bytes per block, over the 100-byte target", per)
	}
	runtime.KeepAlive(x)
}
