package journal

import (
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// The per-change cost of the index journal on both sides of the wire, for issue 5's push
// cost measurement (hack/bench-xds measures it end to end): the control plane builds and
// marshals one batch per proxy stream, a proxy unmarshals, decodes and applies it to a
// replica holding about a million blocks. Batches are steady state: half new blocks
// stored, half old ones removed, so the set's size stays put.

const (
	benchBlocks = 1 << 20
	benchBatch  = 1024
	benchSlots  = 8
)

// steadyBatches returns a set of benchBlocks blocks and n (even) batches of benchBatch
// changes that cycle over it: the first half of the batches each remove benchBatch/2 blocks
// of a pool A and store as many new ones of a pool B, the second half do the reverse, so
// that after all n the set is back where it started and the batches can be replayed for
// ever at a constant size.
func steadyBatches(n int) (*blockset.Set, [][]Change) {
	rng := rand.New(rand.NewPCG(1, 2))
	half := benchBatch / 2
	pool := n / 2 * half
	a := make([]uint64, pool)
	bs := make([]uint64, pool)
	set := &blockset.Set{}
	for i := range benchBlocks {
		seq := rng.Uint64()
		if i < pool {
			a[i] = seq
		}
		set.Add(seq, i%benchSlots, blockset.GPU)
	}
	for i := range bs {
		bs[i] = rng.Uint64()
	}
	out := make([][]Change, n)
	for k := range out {
		from, to := a, bs
		j := k
		if k >= n/2 {
			from, to, j = bs, a, k-n/2
		}
		cs := make([]Change, 0, benchBatch)
		for i := j * half; i < (j+1)*half; i++ {
			cs = append(cs, Change{Seq: from[i], Slot: uint32(i % benchSlots), Op: Removed})
			cs = append(cs, Change{Seq: to[i], Slot: uint32(i % benchSlots), Op: Stored})
		}
		out[k] = cs
	}
	return set, out
}

// BenchmarkJournalEncode is the control plane's work per proxy stream and batch:
// appendChanges into a fresh JournalBatch and its protobuf marshalling.
func BenchmarkJournalEncode(b *testing.B) {
	_, batches := steadyBatches(64)
	var bytes int
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		jb := &xdsv1.JournalBatch{Epoch: 1, Offset: uint64(i) * benchBatch, Next: uint64(i+1) * benchBatch}
		appendChanges(jb, batches[i%len(batches)])
		data, err := proto.Marshal(jb)
		if err != nil {
			b.Fatal(err)
		}
		bytes += len(data)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBatch), "ns/change")
	b.ReportMetric(float64(bytes)/float64(b.N*benchBatch), "B/change")
}

// BenchmarkJournalDecodeApply is a proxy's work per batch received: unmarshal, decode and
// apply to a set of about a million blocks (what prefix.Replica.Apply does under its lock).
func BenchmarkJournalDecodeApply(b *testing.B) {
	const n = 512
	set, batches := steadyBatches(n)
	wire := make([][]byte, n)
	for i, cs := range batches {
		jb := &xdsv1.JournalBatch{Epoch: 1, Offset: uint64(i) * benchBatch, Next: uint64(i+1) * benchBatch}
		appendChanges(jb, cs)
		wire[i], _ = proto.Marshal(jb)
	}
	var jb xdsv1.JournalBatch
	var cs []Change
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		k := i % n
		jb.Reset()
		if err := proto.Unmarshal(wire[k], &jb); err != nil {
			b.Fatal(err)
		}
		var ok bool
		cs, ok = decode(cs[:0], &jb)
		if !ok {
			b.Fatal("batch not decodable")
		}
		for _, c := range cs {
			switch c.Op {
			case Stored:
				set.Add(c.Seq, int(c.Slot), c.Tier)
			case Removed:
				set.Remove(c.Seq, int(c.Slot), c.Tier)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*benchBatch), "ns/change")
	b.ReportMetric(float64(set.Len()), "blocks")
}
