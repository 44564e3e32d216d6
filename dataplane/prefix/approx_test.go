package prefix

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/clock"
	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// chain returns the hash chain of n blocks of a prompt identified by seed, sharing the
// first shared blocks with every other chain built with the same shared count and base.
func chain(base, seed uint32, shared, n int) []uint64 {
	toks := make([]uint32, 16*n)
	for i := range toks {
		if i < 16*shared {
			toks[i] = base*1_000_003 + uint32(i)
		} else {
			toks[i] = seed*7_919_111 + uint32(i)
		}
	}
	return blockhash.Seq(toks, 16, nil)
}

func TestMatchCountsSharedLeadingBlocks(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 1024, TTL: time.Minute})
	recorded := chain(1, 1, 10, 10)
	a.Record(2, recorded, 0)
	cases := []struct {
		name   string
		prompt []uint64
		want   float64
	}{
		{"same prompt", recorded, 10},
		{"shares 6 blocks then differs", chain(1, 2, 6, 12), 6},
		{"shares 1 block", chain(1, 3, 1, 4), 1},
		{"longer prompt with the whole chain as prefix", append(append([]uint64{}, recorded...), chain(9, 9, 0, 3)...)[:13], 10},
		{"unrelated", chain(2, 1, 0, 10), 0},
		{"empty", nil, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			overlap := make([]float64, 4)
			best := a.Match(tc.prompt, overlap)
			if overlap[2] != tc.want || best != tc.want {
				t.Fatalf("overlap %v best %v, want worker 2 at %v", overlap, best, tc.want)
			}
			for w, o := range overlap {
				if w != 2 && o != 0 {
					t.Fatalf("worker %d has overlap %v", w, o)
				}
			}
		})
	}
}

func TestMatchPerWorkerRuns(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 1024, TTL: time.Minute})
	full := chain(1, 1, 8, 8)
	a.Record(0, full[:3], 0)
	a.Record(1, full, 0)
	a.Record(3, full[:5], 0)
	// A worker holding a later block without an earlier one gets only its leading run.
	a.Record(2, full[4:], 0)
	overlap := make([]float64, 4)
	if best := a.Match(full, overlap); best != 8 {
		t.Fatalf("best %v", best)
	}
	if want := []float64{3, 8, 0, 5}; !equal(overlap, want) {
		t.Fatalf("overlap %v, want %v", overlap, want)
	}
}

func equal(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// The At variants run at the time the caller gives, a time of day from package clock's Now,
// on the same clock as the variants that read it themselves.
func TestApproxAtTheCallersTime(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 64, TTL: time.Second})
	c := chain(1, 1, 8, 8)
	now := clock.Now()
	r := a.RecordAt(now, 0, c, 0)
	overlap := make([]float64, 2)
	if got := a.Match(c, overlap); got != 8 {
		t.Fatalf("Match right after RecordAt: %v, want 8", got)
	}
	if got := a.MatchAt(c, overlap, now+int64(900*time.Millisecond)); got != 8 {
		t.Fatalf("MatchAt within the TTL: %v, want 8", got)
	}
	if got := a.MatchAt(c, overlap, now+int64(1500*time.Millisecond)); got != 0 {
		t.Fatalf("MatchAt past the TTL: %v, want 0", got)
	}
	// A worker that reports more cached than predicted is recorded at the time given.
	later := now + int64(1200*time.Millisecond)
	a.CorrectAt(later, c, Receipt{worker: 1}, 8)
	if got := a.MatchAt(c, overlap, later+int64(500*time.Millisecond)); got != 8 || overlap[1] != 8 || overlap[0] != 0 {
		t.Fatalf("after CorrectAt on worker 1: best %v, overlap %v; want worker 1 alone at 8", got, overlap)
	}
	if r.worker != 0 {
		t.Fatalf("receipt for worker %d", r.worker)
	}
	// Through an Overlay, the recent index also runs at the caller's time.
	o := NewOverlay(NewApprox(ApproxConfig{}), a)
	if got := MatchAt(o, c, overlap, later+int64(500*time.Millisecond)); got != 8 {
		t.Fatalf("Overlay MatchAt within the TTL: %v, want 8", got)
	}
	if got := MatchAt(o, c, overlap, later+int64(2*time.Second)); got != 0 {
		t.Fatalf("Overlay MatchAt past the TTL: %v, want 0", got)
	}
}

func TestTTLAndBound(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 16, TTL: time.Second})
	c := chain(1, 1, 8, 8)
	a.Record(0, c, 0)
	overlap := make([]float64, 1)
	if a.matchAt(c, overlap, ticks(0)+999) != 8 {
		t.Fatal("blocks forgotten before the TTL")
	}
	if a.matchAt(c, overlap, ticks(0)+1500) != 0 {
		t.Fatal("blocks remembered past the TTL")
	}
	// 16 entries: a second 8-block chain fits, a third evicts the least recently touched.
	c2, c3 := chain(2, 2, 0, 8), chain(3, 3, 0, 8)
	a.Record(0, c2, 0)
	a.Record(0, c, 0) // c is now more recent than c2
	a.Record(0, c3, 0)
	if a.Len() != 16 {
		t.Fatalf("len %d", a.Len())
	}
	if a.Match(c, overlap) != 8 || a.Match(c3, overlap) != 8 || a.Match(c2, overlap) != 0 {
		t.Fatal("the bound must evict the least recently touched chain")
	}
}

func TestSlotsKeepTheMostRecentWorkers(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 64, TTL: time.Minute})
	c := chain(1, 1, 2, 2)
	for w := range slotsPerBlock + 1 {
		a.Record(w, c, 0)
		time.Sleep(2 * time.Millisecond)
	}
	overlap := make([]float64, slotsPerBlock+1)
	a.Match(c, overlap)
	if overlap[0] != 0 || overlap[slotsPerBlock] != 2 {
		t.Fatalf("overlap %v: the oldest worker should be forgotten", overlap)
	}
}

func TestCorrect(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 1024, TTL: time.Minute})
	old, mid, fresh := chain(1, 1, 8, 8), chain(2, 2, 8, 8), chain(3, 3, 8, 8)
	a.Record(0, old, 0)
	time.Sleep(3 * time.Millisecond)
	a.Record(0, mid, 0)
	time.Sleep(3 * time.Millisecond)
	a.Record(0, fresh, 0)
	time.Sleep(3 * time.Millisecond)
	overlap := make([]float64, 1)
	if a.Match(mid, overlap) != 8 {
		t.Fatal("setup")
	}
	// A request for mid was predicted to hit 8 blocks; the engine reports 3: it evicted mid's
	// tail, so (LRU) everything sent to it before mid was last touched is gone too.
	r := a.Record(0, mid, 8)
	a.Correct(mid, r, 3)
	if got := a.Match(old, overlap); got != 0 {
		t.Fatalf("older chain still matches %v blocks", got)
	}
	if got := a.Match(fresh, overlap); got != 8 {
		t.Fatalf("a chain sent after the evicted one must stay, got %v", got)
	}
	if got := a.Match(mid, overlap); got != 8 {
		t.Fatalf("the corrected request itself was just computed and cached, got %v", got)
	}
	// More than predicted: the worker had blocks the index never saw.
	other := chain(4, 4, 6, 6)
	r = a.Record(1, other[:2], 0)
	r.predicted = 0
	a.Correct(other, r, 6)
	o2 := make([]float64, 2)
	if a.Match(other, o2); o2[1] != 6 {
		t.Fatalf("reported hits must be recorded, overlap %v", o2)
	}
	a.Forget(1)
	if a.Match(other, o2); o2[1] != 0 {
		t.Fatal("Forget must drop a worker's blocks")
	}
}

func TestMatchDoesNotAllocate(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 4096, TTL: time.Minute})
	c := chain(1, 1, 512, 512)
	a.Record(5, c, 0)
	overlap := make([]float64, 64)
	if n := testing.AllocsPerRun(100, func() { a.Match(c, overlap) }); n != 0 {
		t.Fatalf("Match allocates %.1f times", n)
	}
	if n := testing.AllocsPerRun(100, func() { a.Record(5, c, 512) }); n != 0 {
		t.Fatalf("Record of known blocks allocates %.1f times", n)
	}
}

// BenchmarkMatch: an 8k-token prompt (512 blocks) against 64 workers with 1M blocks indexed.
func BenchmarkMatch(b *testing.B) {
	a := NewApprox(ApproxConfig{MaxBlocks: 1 << 20, TTL: time.Hour})
	rng := rand.New(rand.NewPCG(1, 2))
	for a.Len() < (1<<20)-512 {
		w := rng.IntN(64)
		a.Record(w, chain(uint32(rng.IntN(1<<30)), uint32(rng.IntN(1<<30)), 0, 256), 0)
	}
	prompt := chain(7, 7, 512, 512)
	a.Record(11, prompt[:400], 0)
	a.Record(12, prompt[:100], 0)
	overlap := make([]float64, 64)
	b.ReportAllocs()
	for b.Loop() {
		a.Match(prompt, overlap)
	}
	if overlap[11] != 400 || overlap[12] != 100 {
		b.Fatalf("overlap %v %v", overlap[11], overlap[12])
	}
}

func TestBlocksPerWorker(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 8, TTL: time.Minute})
	a.Record(0, chain(1, 1, 4, 4), 0)
	a.Record(1, chain(1, 1, 4, 4)[:2], 0)
	if a.Blocks(0) != 4 || a.Blocks(1) != 2 || a.Blocks(7) != 0 {
		t.Fatalf("blocks %d %d", a.Blocks(0), a.Blocks(1))
	}
	a.Record(2, chain(2, 2, 0, 6), 0) // evicts the 2 least recent entries
	if a.Blocks(2) != 6 || a.Blocks(0)+a.Blocks(1) != 4 {
		t.Fatalf("after eviction: %d %d %d", a.Blocks(0), a.Blocks(1), a.Blocks(2))
	}
	a.Forget(2)
	if a.Blocks(2) != 0 {
		t.Fatal("Forget must zero the count")
	}
}

// A system prompt every worker caches fills its blocks' slots, which then forget some of the
// workers holding it; a worker that holds a conversation past that prompt must still score
// its whole run (the index once dropped such workers at the first block, so a fleet-wide
// prefix hid every conversation's worker).
func TestMatchPastASharedPrefix(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 1 << 12, TTL: time.Minute})
	conv := chain(7, 7, 10, 10) // blocks 0..1: the shared prompt; 2..9: worker 0's conversation
	a.Record(0, conv, 0)
	for w := 1; w <= 5; w++ { // later requests sharing only the prompt touch it on 5 others
		a.Record(w, chain(7, uint32(100+w), 2, 5), 0)
	}
	overlap := make([]float64, 6)
	if best := a.Match(conv, overlap); best != 10 || overlap[0] != 10 {
		t.Fatalf("best %v overlap %v, want worker 0 at 10", best, overlap)
	}
	for w := 1; w <= 5; w++ {
		if overlap[w] > 2 {
			t.Fatalf("worker %d overlap %v, want at most the shared 2", w, overlap[w])
		}
	}
}

// TestPinOutlivesTTL: a pinned prompt stays matched past the index's TTL until its pin
// lapses, and past the evictions a smaller cached_tokens on that worker implies; a worker
// reporting it lost pinned blocks unpins them.
func TestPinOutlivesTTL(t *testing.T) {
	a := NewApprox(ApproxConfig{MaxBlocks: 1024, TTL: time.Second})
	pinned, other := chain(1, 1, 8, 8), chain(2, 2, 8, 8)
	now := clock.Now()
	a.RecordAt(now, 0, pinned, 0)
	a.PinAt(now, 0, pinned, 5*time.Second)
	a.RecordAt(now, 0, other, 0)
	overlap := make([]float64, 1)
	at := func(d time.Duration) int64 { return now + int64(d) }
	if got := a.MatchAt(pinned, overlap, at(3*time.Second)); got != 8 {
		t.Fatalf("pinned prompt 3 s on (TTL 1 s, pin 5 s): %v blocks", got)
	}
	if got := a.MatchAt(other, overlap, at(3*time.Second)); got != 0 {
		t.Fatalf("unpinned prompt past the TTL: %v blocks", got)
	}
	if got := a.MatchAt(pinned, overlap, at(6500*time.Millisecond)); got != 0 {
		t.Fatalf("pinned prompt after its pin lapsed: %v blocks", got)
	}
	// A later plain hit does not shorten the pin.
	a.RecordAt(at(time.Second), 0, pinned, 8)
	if got := a.MatchAt(pinned, overlap, at(4*time.Second)); got != 8 {
		t.Fatalf("a plain hit shortened the pin: %v blocks", got)
	}
	// The worker says it kept 2 of 8: the rest is no longer pinned (only cached from now).
	r := a.RecordAt(at(2*time.Second), 0, pinned, 8)
	a.CorrectAt(at(2*time.Second), pinned, r, 2)
	if got := a.MatchAt(pinned, overlap, at(2500*time.Millisecond)); got != 8 {
		t.Fatalf("just computed again, the prompt is cached: %v blocks", got)
	}
	if got := a.MatchAt(pinned, overlap, at(4*time.Second)); got != 2 {
		t.Fatalf("after the engine lost 6 pinned blocks they expire by the TTL: %v blocks, want the 2 it kept", got)
	}
}
