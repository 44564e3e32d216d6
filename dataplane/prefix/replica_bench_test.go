package prefix

import (
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// BenchmarkReplicaBytesPerBlock fills a replica through its journal Apply with 1M blocks
// over 64 worker slots (one holder each) and reports the live heap per block after GC:
// issue 5's proxy memory target is at most 100 bytes per indexed block.
func BenchmarkReplicaBytesPerBlock(b *testing.B) {
	const blocks, slots = 1 << 20, 64
	for i := 0; i < b.N; i++ {
		runtime.GC()
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		r := NewReplica(blockset.DefaultWeights)
		rng := rand.New(rand.NewPCG(uint64(i), 2))
		cs := make([]journal.Change, 0, 8192)
		for k := range blocks {
			cs = append(cs, journal.Change{Seq: rng.Uint64(), Slot: uint32(k % slots), Op: journal.Stored})
			if len(cs) == cap(cs) {
				r.Apply(cs)
				cs = cs[:0]
			}
		}
		r.Apply(cs)
		cs = nil
		runtime.GC()
		runtime.ReadMemStats(&m1)
		if r.Len() != blocks {
			b.Fatalf("replica has %d blocks, want %d", r.Len(), blocks)
		}
		b.ReportMetric(float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc))/blocks, "B/block")
		runtime.KeepAlive(r)
	}
}

// BenchmarkReplicaApply applies steady-state journal batches (1024 changes: 512 blocks
// stored, 512 removed) to a replica of 1M blocks over 8 slots, as a proxy's journal client
// does, lock included.
func BenchmarkReplicaApply(b *testing.B) {
	const blocks, slots, batch, nb = 1 << 20, 8, 1024, 256
	rng := rand.New(rand.NewPCG(1, 2))
	r := NewReplica(blockset.DefaultWeights)
	pool := nb / 2 * batch / 2
	a := make([]uint64, pool)
	c := make([]uint64, pool)
	first := make([]journal.Change, 0, blocks)
	for k := range blocks {
		seq := rng.Uint64()
		if k < pool {
			a[k] = seq
		}
		first = append(first, journal.Change{Seq: seq, Slot: uint32(k % slots), Op: journal.Stored})
	}
	r.Apply(first)
	first = nil
	for k := range c {
		c[k] = rng.Uint64()
	}
	// The first half of the batches move pool a's blocks out and pool c's in, the second
	// half the reverse: replayed in a cycle, the replica keeps its size.
	batches := make([][]journal.Change, nb)
	for k := range batches {
		from, to, j := a, c, k
		if k >= nb/2 {
			from, to, j = c, a, k-nb/2
		}
		cs := make([]journal.Change, 0, batch)
		for i := j * batch / 2; i < (j+1)*batch/2; i++ {
			cs = append(cs, journal.Change{Seq: from[i], Slot: uint32(i % slots), Op: journal.Removed})
			cs = append(cs, journal.Change{Seq: to[i], Slot: uint32(i % slots), Op: journal.Stored})
		}
		batches[k] = cs
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r.Apply(batches[i%nb])
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/change")
	if r.Len() < blocks-batch || r.Len() > blocks+batch {
		b.Fatalf("replica drifted to %d blocks", r.Len())
	}
}
