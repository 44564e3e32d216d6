package blockset

import (
	"fmt"
	"runtime"
	"testing"
)

// BenchmarkMatchWorkers matches a 256-block prompt whose first 192 blocks (a shared
// preamble) every worker holds, each worker holding a different 64-block tail besides,
// against fleets of 64 to 10,240 workers: how the match grows with the workers.
func BenchmarkMatchWorkers(b *testing.B) { benchMatchPreamble(b, 1) }

// BenchmarkMatchPartlyShared matches the same prompt when only every other worker holds the
// preamble (a system prompt half the fleet has cached): no run is common to every worker, so
// each holder's run must be followed, however the holders are stored.
func BenchmarkMatchPartlyShared(b *testing.B) { benchMatchPreamble(b, 2) }

// benchMatchPreamble matches the prompt against fleets where one worker in every (0, every,
// 2·every, …) holds the preamble and its tail, the others their tails only.
func benchMatchPreamble(b *testing.B, every int) {
	const prompt, shared = 256, 192
	hashes := make([]uint64, prompt)
	for i := range hashes {
		hashes[i] = uint64(i+1) * 0x9E3779B97F4A7C15
	}
	for _, workers := range []int{64, 1024, 10240} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			var s Set
			for w := range workers {
				n := shared
				if w%every != 0 {
					n = 0
				}
				holdPrompt(&s, w, hashes, n)
			}
			overlap := make([]float64, workers)
			b.ReportAllocs()
			for b.Loop() {
				s.Match(hashes, overlap, DefaultWeights)
			}
			for _, w := range []int{0, workers - 1} {
				want := 0.0
				if w%every == 0 {
					want = shared
				}
				if overlap[w] != want {
					b.Fatalf("worker %d overlap %v, want %v", w, overlap[w], want)
				}
			}
		})
	}
}

// BenchmarkSetMemory reports the live heap a Set takes per worker and per distinct block
// when every worker holds one 192-block preamble (a shared system prompt) and blocks of its
// own (its conversations): few of its own (own=64, the preamble most of what it holds) or
// many (own=1024).
func BenchmarkSetMemory(b *testing.B) {
	const shared = 192
	for _, own := range []int{64, 1024} {
		hashes := make([]uint64, shared+own)
		for i := range hashes {
			hashes[i] = uint64(i+1) * 0x9E3779B97F4A7C15
		}
		for _, workers := range []int{64, 1024, 4096} {
			b.Run(fmt.Sprintf("own=%d/workers=%d", own, workers), func(b *testing.B) {
				var perWorker, perBlock float64
				for b.Loop() {
					var before, after runtime.MemStats
					runtime.GC()
					runtime.ReadMemStats(&before)
					s := new(Set)
					for w := range workers {
						holdPrompt(s, w, hashes, shared)
					}
					runtime.GC()
					runtime.ReadMemStats(&after)
					live := float64(after.HeapAlloc) - float64(before.HeapAlloc)
					perWorker = live / float64(workers)
					perBlock = live / float64(s.Len())
					runtime.KeepAlive(s)
				}
				b.ReportMetric(perWorker, "B/worker")
				b.ReportMetric(perBlock, "B/block")
			})
		}
	}
}

// BenchmarkMatchScope matches the same prompt against a proxy's replica that holds 1,024
// workers of a 10,240-worker fleet (the workers of the model it routes, its journal
// scoped to them), their slots either contiguous (slots given in the order of the workers'
// models) or spread over the fleet's (every tenth): the match walks the shards that hold
// any of them.
func BenchmarkMatchScope(b *testing.B) {
	const prompt, shared, fleet, scope = 256, 192, 10240, 1024
	hashes := make([]uint64, prompt)
	for i := range hashes {
		hashes[i] = uint64(i+1) * 0x9E3779B97F4A7C15
	}
	for _, layout := range []string{"contiguous", "spread"} {
		b.Run(layout, func(b *testing.B) {
			var s Set
			for i := range scope {
				w := i
				if layout == "spread" {
					w = i * (fleet / scope)
				}
				holdPrompt(&s, w, hashes, shared)
			}
			overlap := make([]float64, fleet)
			b.ReportAllocs()
			for b.Loop() {
				s.Match(hashes, overlap, DefaultWeights)
			}
		})
	}
}

// holdPrompt gives slot w the prompt's first shared blocks and a tail of its own as long as
// the rest of the prompt.
func holdPrompt(s *Set, w int, hashes []uint64, shared int) {
	for _, h := range hashes[:shared] {
		s.Add(h, w, GPU)
	}
	for i := range len(hashes) - shared {
		s.Add(uint64(w+1)<<32|uint64(i), w, GPU)
	}
}
