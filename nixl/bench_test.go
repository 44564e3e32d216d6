package nixl

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

const benchBatch = 64 // blocks per transfer

// benchPair starts an initiator and a target, each with a shareable region of
// benchBatch*blockSize bytes, and prepares a transfer of all blocks in a shuffled order
// (as a KV cache's free slots come).
func benchPair(b *testing.B, backend BackendKind, op Op, blockSize int, opts ...XferOption) *Xfer {
	cfg := Config{}
	if backend == BackendTCP {
		cfg = tcpOnly()
	}
	ini := newAgent(b, "ini", cfg)
	tgt := newAgent(b, "tgt", Config{})
	lr := hostRegion(b, ini, benchBatch*blockSize)
	rr := hostRegion(b, tgt, benchBatch*blockSize)
	fillRandom(lr.Bytes(), 1)
	fillRandom(rr.Bytes(), 2)
	loadMD(b, ini, tgt)
	ids := make([]int, benchBatch)
	for i := range ids {
		ids[i] = i
	}
	remoteIDs := slices.Clone(ids)
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(remoteIDs), func(i, j int) { remoteIDs[i], remoteIDs[j] = remoteIDs[j], remoteIDs[i] })
	local, _ := lr.Blocks(uint64(blockSize), ids)
	remote, _ := rr.Desc().Blocks(uint64(blockSize), remoteIDs)
	x, err := ini.CreateXfer(op, local, "tgt", remote, opts...)
	if err != nil {
		b.Fatal(err)
	}
	// Warm up: connection, mappings, page faults.
	runXfer(b, x)
	if got := x.Backend(); got != backend {
		b.Fatalf("carried by %q, want %q", got, backend)
	}
	return x
}

func runXfer(b *testing.B, x *Xfer) {
	ctx := context.Background()
	if err := x.Post(ctx); err != nil {
		b.Fatal(err)
	}
	if err := x.Wait(ctx); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkThroughput moves batches of 64 blocks per transfer; MB/s is the payload rate
// and ns/op the time of one 64-block transfer.
func BenchmarkThroughput(b *testing.B) {
	for _, backend := range testBackends() {
		for _, op := range []Op{Read, Write} {
			for _, bs := range []int{16 << 10, 256 << 10, 1 << 20, 4 << 20} {
				b.Run(fmt.Sprintf("%s/%s/block=%s", backend, op, sizeName(bs)), func(b *testing.B) {
					x := benchPair(b, backend, op, bs)
					b.SetBytes(int64(benchBatch * bs))
					b.ReportAllocs()
					for b.Loop() {
						runXfer(b, x)
					}
				})
			}
		}
	}
}

// BenchmarkBatchLatency times single 64-block READs with a notification (the decode
// side's fetch of one request's KV blocks) and reports the median and 99th percentile.
func BenchmarkBatchLatency(b *testing.B) {
	for _, backend := range testBackends() {
		for _, bs := range []int{1 << 10, 16 << 10} {
			b.Run(fmt.Sprintf("%s/block=%s", backend, sizeName(bs)), func(b *testing.B) {
				x := benchPair(b, backend, Read, bs, WithNotif([]byte("free")))
				var samples []time.Duration
				b.ReportAllocs()
				for b.Loop() {
					start := time.Now()
					runXfer(b, x)
					samples = append(samples, time.Since(start))
				}
				slices.Sort(samples)
				b.ReportMetric(float64(samples[len(samples)/2].Nanoseconds()), "p50-ns")
				b.ReportMetric(float64(samples[len(samples)*99/100].Nanoseconds()), "p99-ns")
			})
		}
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}
