package blockhash

import (
	"encoding/binary"
	"strconv"
	"testing"

	"github.com/zeebo/xxh3"
)

func TestSeqMatchesDefinition(t *testing.T) {
	tokens := make([]uint32, 40)
	for i := range tokens {
		tokens[i] = uint32(i*7919 + 3)
	}
	got := Seq(tokens, 16, nil)
	if len(got) != 2 {
		t.Fatalf("want 2 full blocks, got %d", len(got))
	}
	local := func(ts []uint32) uint64 {
		b := make([]byte, 0, 64)
		for _, t := range ts {
			b = binary.LittleEndian.AppendUint32(b, t)
		}
		return xxh3.HashSeed(b, 1337)
	}
	l0, l1 := local(tokens[:16]), local(tokens[16:32])
	var pair [16]byte
	binary.LittleEndian.PutUint64(pair[:8], l0)
	binary.LittleEndian.PutUint64(pair[8:], l1)
	if got[0] != l0 || got[1] != xxh3.HashSeed(pair[:], 1337) {
		t.Fatalf("chain does not follow the definition: %x", got)
	}
}

func TestPrefixSharingAndExtraKeys(t *testing.T) {
	a := make([]uint32, 64)
	b := make([]uint32, 64)
	for i := range a {
		a[i], b[i] = uint32(i), uint32(i)
	}
	b[40] = 999 // differs in block 2
	ha, hb := Seq(a, 16, nil), Seq(b, 16, nil)
	for i := range 2 {
		if ha[i] != hb[i] {
			t.Fatalf("block %d of a shared prefix differs", i)
		}
	}
	if ha[2] == hb[2] || ha[3] == hb[3] {
		t.Fatal("blocks after a difference must differ")
	}
	salted := Seq(a, 16, []byte("salt"))
	if salted[0] == ha[0] {
		t.Fatal("extra keys must change the hash")
	}
	var h Hasher
	cont := h.Continue(nil, ha[1], true, a[32:], 16, nil)
	if cont[0] != ha[2] || cont[1] != ha[3] {
		t.Fatal("Continue must extend a chain exactly as AppendSeq does")
	}
}

func TestAppendSeqDoesNotAllocate(t *testing.T) {
	tokens := make([]uint32, 8192)
	dst := make([]uint64, 0, 512)
	var h Hasher
	h.AppendSeq(dst, tokens, 16, nil)
	if n := testing.AllocsPerRun(100, func() { dst = h.AppendSeq(dst[:0], tokens, 16, nil) }); n != 0 {
		t.Fatalf("AppendSeq allocates %.1f times per call", n)
	}
}

func BenchmarkAppendSeq(b *testing.B) {
	for _, n := range []int{1024, 8192, 131072} {
		tokens := make([]uint32, n)
		for i := range tokens {
			tokens[i] = uint32(i)
		}
		b.Run(strconv.Itoa(n)+"tok", func(b *testing.B) {
			var h Hasher
			dst := make([]uint64, 0, n/16)
			b.SetBytes(int64(4 * n))
			b.ReportAllocs()
			for b.Loop() {
				dst = h.AppendSeq(dst[:0], tokens, 16, nil)
			}
		})
	}
}
