package workload

import (
	"fmt"
	"math"
	"testing"
)

// seq returns the token ids lo, lo+1, …, hi-1.
func seq(lo, hi uint32) []uint32 {
	s := make([]uint32, 0, hi-lo)
	for t := lo; t < hi; t++ {
		s = append(s, t)
	}
	return s
}

func cat(parts ...[]uint32) []uint32 {
	var s []uint32
	for _, p := range parts {
		s = append(s, p...)
	}
	return s
}

func TestIdeal(t *testing.T) {
	type req struct{ prompt, answer []uint32 }
	for _, tc := range []struct {
		name      string
		block     int
		reqs      []req
		wantHits  []int // hit tokens per request
		wantRate  float64
		wantBlock float64
	}{
		{"nothing", 4, nil, nil, 0, 0},
		{"no sharing", 4, []req{{seq(0, 8), nil}, {seq(100, 108), nil}}, []int{0, 0}, 0, 0},
		{"repeat with a partial tail", 4, []req{{seq(0, 9), nil}, {seq(0, 9), nil}}, []int{0, 8}, 8.0 / 18, 2.0 / 4},
		{"repeat of a block-aligned prompt: last block recomputed", 4, []req{{seq(0, 8), nil}, {seq(0, 8), nil}}, []int{0, 4}, 4.0 / 16, 1.0 / 4},
		{"shared prefix, then diverge", 4,
			[]req{{seq(0, 12), nil}, {cat(seq(0, 8), seq(50, 60)), nil}}, []int{0, 8}, 8.0 / 30, 2.0 / 7},
		{"divergence inside a block", 4,
			[]req{{seq(0, 12), nil}, {cat(seq(0, 6), seq(50, 60)), nil}}, []int{0, 4}, 4.0 / 28, 1.0 / 7},
		{"same block at another position is no hit", 4,
			[]req{{seq(0, 8), nil}, {cat(seq(4, 8), seq(0, 4), seq(90, 91)), nil}}, []int{0, 0}, 0, 0},
		{"hits stop at the first miss", 4,
			[]req{{seq(0, 12), nil}, {cat(seq(0, 4), seq(70, 74), seq(8, 12), seq(90, 91)), nil}}, []int{0, 4}, 4.0 / 25, 1.0 / 6},
		{"a shorter prompt hits inside a longer one", 4,
			[]req{{seq(0, 16), nil}, {seq(0, 10), nil}}, []int{0, 8}, 8.0 / 26, 2.0 / 6},
		{"the answer is cached, less its last token", 4,
			[]req{{seq(0, 6), seq(6, 10)}, {cat(seq(0, 10), seq(60, 63)), nil}}, []int{0, 8}, 8.0 / 19, 2.0 / 4},
		{"an answer's last token has no KV", 4,
			[]req{{seq(0, 6), seq(6, 8)}, {cat(seq(0, 8), seq(60, 63)), nil}}, []int{0, 4}, 4.0 / 17, 1.0 / 3},
		{"prompts shorter than a block", 16, []req{{seq(0, 10), nil}, {seq(0, 10), nil}}, []int{0, 0}, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := NewIdeal(tc.block)
			var prompts [][]uint32
			for i, r := range tc.reqs {
				if got := x.Add(r.prompt, r.answer); got != tc.wantHits[i] {
					t.Errorf("request %d: %d hit tokens, want %d", i, got, tc.wantHits[i])
				}
				prompts = append(prompts, r.prompt)
			}
			if math.Abs(x.HitRate()-tc.wantRate) > 1e-12 || math.Abs(x.BlockHitRate()-tc.wantBlock) > 1e-12 {
				t.Errorf("hit rate %v, block hit rate %v; want %v, %v", x.HitRate(), x.BlockHitRate(), tc.wantRate, tc.wantBlock)
			}
			hasAnswers := false
			for _, r := range tc.reqs {
				hasAnswers = hasAnswers || r.answer != nil
			}
			if !hasAnswers {
				if got := IdealHitRate(prompts, tc.block); math.Abs(got-tc.wantRate) > 1e-12 {
					t.Errorf("IdealHitRate = %v, want %v", got, tc.wantRate)
				}
			}
		})
	}
}

// TestIdealMooncake compares the ideal hit rate of Mooncake prompts, computed on token ids,
// with the same bound computed on the trace's hash_ids alone: the text preserves the trace's
// reuse.
func TestIdealMooncake(t *testing.T) {
	path := tracePath(t)
	tok := testTokenizer(t)
	const n, block = 1000, 64
	w, err := Parse(fmt.Sprintf("mooncake:path=%s,requests=%d,block=%d", path, n, block), 1, tok)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := readTraceFile(path, n, 512)
	if err != nil {
		t.Fatal(err)
	}
	x := NewIdeal(16)
	seen := map[int64]bool{}
	var hitTokens, promptTokens int
	for i, r := range w.Open {
		x.Add(tok.Encode(r.Prompt), nil)
		rec := &recs[i]
		scaled := ScaledLength(rec.InputLength, block, 512)
		promptTokens += scaled
		// Leading ids seen before, as blocks of `block` tokens; a block that ends the prompt
		// exactly is recomputed. A partial block seen before (the same request again) counts
		// its full 16-token pieces.
		full := rec.InputLength / 512
		h := 0
		for h < len(rec.HashIDs) && seen[rec.HashIDs[h]] {
			h++
		}
		hit := h * block
		if h > full { // the whole request was seen: its partial block too
			hit = scaled / 16 * 16
		}
		if hit == scaled { // a block-aligned prompt fully cached: its last block is recomputed
			hit -= 16
		}
		hitTokens += max(hit, 0)
		for _, id := range rec.HashIDs {
			seen[id] = true
		}
	}
	want := float64(hitTokens) / float64(promptTokens)
	if math.Abs(x.HitRate()-want) > 1e-9 {
		t.Errorf("ideal hit rate over tokens %.6f, over hash_ids %.6f", x.HitRate(), want)
	}
	t.Logf("first %d requests, block=%d: ideal hit rate %.4f (blocks %.4f)", n, block, x.HitRate(), x.BlockHitRate())
}

func BenchmarkIdeal(b *testing.B) {
	prompts := make([][]uint32, 64)
	for i := range prompts {
		prompts[i] = cat(seq(0, 2048), seq(uint32(10000*(i+1)), uint32(10000*(i+1)+512)))
	}
	b.ReportAllocs()
	for b.Loop() {
		IdealHitRate(prompts, 16)
	}
}

// A bounded cache forgets a sequence from its tail: the prefix of an evicted request still
// hits, and what an unbounded cache keeps, an LRU as large as the stream keeps too.
func TestIdealLRU(t *testing.T) {
	p1, p2 := seq(1, 10), seq(100, 109) // 2 full blocks of 4 and a partial one each
	x := NewLRU(4, 3)
	steps := []struct {
		prompt []uint32
		want   int
	}{
		{p1, 0},
		{p1, 8}, // both full blocks
		{p2, 0}, // its 2 blocks push p1's second block out (capacity 3), not its first
		{p1, 4}, // the first block still hits
	}
	for i, s := range steps {
		if got := x.Add(s.prompt, nil); got != s.want {
			t.Fatalf("step %d: %d tokens hit, want %d", i, got, s.want)
		}
	}
	// An answer's blocks count too, and evict like the prompt's.
	y := NewLRU(4, 2)
	y.Add(seq(1, 5), seq(5, 10)) // prompt 1 block + answer: the sequence 1..8 is 2 blocks
	if got := y.Add(seq(1, 10), nil); got != 8 {
		t.Fatalf("after an answer: %d tokens hit, want 8", got)
	}

	big, unbounded := NewLRU(16, 1<<20), NewIdeal(16)
	for i := range 200 {
		lo := uint32(1000 * (i%7 + 1))
		p := cat(seq(0, 64), seq(lo, lo+uint32(16*(i%5)+9)))
		a, b := big.Add(p, nil), unbounded.Add(p, nil)
		if a != b {
			t.Fatalf("request %d: a large LRU hit %d tokens, the unbounded cache %d", i, a, b)
		}
	}
	if big.HitRate() != unbounded.HitRate() || big.HitRate() == 0 {
		t.Fatalf("hit rates %v (LRU) and %v (unbounded)", big.HitRate(), unbounded.HitRate())
	}
}
