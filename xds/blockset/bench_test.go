package blockset

import (
	"fmt"
	"testing"
)

// BenchmarkMatchWorkers matches a 256-block prompt whose first 192 blocks (a shared
// preamble) every worker holds, each worker holding a different 64-block tail besides,
// against fleets of 64 to 10,240 workers: how the match grows with the workers.
func BenchmarkMatchWorkers(b *testing.B) {
	const prompt, shared = 256, 192
	hashes := make([]uint64, prompt)
	for i := range hashes {
		hashes[i] = uint64(i+1) * 0x9E3779B97F4A7C15
	}
	for _, workers := range []int{64, 1024, 10240} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			var s Set
			for w := range workers {
				holdPrompt(&s, w, hashes, shared)
			}
			overlap := make([]float64, workers)
			b.ReportAllocs()
			for b.Loop() {
				s.Match(hashes, overlap, DefaultWeights)
			}
			if overlap[workers-1] != shared {
				b.Fatalf("overlap %v", overlap[workers-1])
			}
		})
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
