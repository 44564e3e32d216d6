package blockset

import "testing"

// fleet returns a Set of workers slots each holding a 192-block preamble and own blocks of
// its own, and the preamble's hashes.
func fleet(workers, own int) (*Set, []uint64) {
	hashes := make([]uint64, 192+own)
	for i := range hashes {
		hashes[i] = uint64(i+1) * 0x9E3779B97F4A7C15
	}
	s := new(Set)
	for w := range workers {
		holdPrompt(s, w, hashes, 192)
	}
	return s, hashes
}

// BenchmarkClearSlot clears one worker of 4,096 (each holding a shared preamble and 256
// blocks of its own, 1M blocks), as when its engine restarts; the worker's blocks are stored
// again between clears, untimed.
func BenchmarkClearSlot(b *testing.B) {
	const workers = 4096
	s, hashes := fleet(workers, 256)
	w := 0
	for b.Loop() {
		s.ClearSlot(w)
		b.StopTimer()
		holdPrompt(s, w, hashes, 192)
		w = (w + 1) % workers
		b.StartTimer()
	}
}

// BenchmarkEachSlots lists the entries of 64 workers of 4,096 (those of one model, as when
// a proxy that routes it resumes its journal on another replica).
func BenchmarkEachSlots(b *testing.B) {
	s, _ := fleet(4096, 256)
	slots := make([]int, 64)
	for i := range slots {
		slots[i] = 1024 + i
	}
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		s.EachSlots(slots, func(uint64, int, Tier) { n++ })
	}
	if n == 0 {
		b.Fatal("no entries")
	}
}
