// Package blockhash computes the prefix-chained block hashes that the proxy, the control plane
// and the simulated engine share (ARCHITECTURE.md, "Block hashing").
//
// Only full blocks are hashed. For block i of a token sequence,
//
//	local[i] = XXH3_64(LE uint32 token ids of block i ‖ extra, seed 1337)
//	seq[0]   = local[0]
//	seq[i]   = XXH3_64(LE64(seq[i-1]) ‖ LE64(local[i]), seed 1337)
//
// so seq[i] names block i together with everything before it, and two sequences share a
// prefix of k blocks exactly when their first k sequence hashes agree. Extra keys (a LoRA
// name, a cache salt, multimodal hashes) are appended to the bytes of every block's local
// hash, so salted blocks never alias plain ones.
//
// All functions are safe for concurrent use; a Hasher is not (it owns a scratch buffer) and
// is meant to live in a per-connection or per-worker struct.
package blockhash

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// Seed is the XXH3 seed of every hash in the chain.
const Seed = 1337

// Hasher hashes token blocks without allocating once its scratch buffer has grown.
// The zero value is ready to use. A Hasher must not be used from two goroutines at once.
type Hasher struct {
	buf []byte
}

// Local returns the local hash of one block of tokens with optional extra key bytes.
func (h *Hasher) Local(tokens []uint32, extra []byte) uint64 {
	n := 4*len(tokens) + len(extra)
	if cap(h.buf) < n {
		h.buf = make([]byte, n)
	}
	b := h.buf[:n]
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[4*i:], t)
	}
	copy(b[4*len(tokens):], extra)
	return xxh3.HashSeed(b, Seed)
}

// Chain returns seq[i] given seq[i-1] (parent) and local[i].
func Chain(parent, local uint64) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], parent)
	binary.LittleEndian.PutUint64(b[8:], local)
	return xxh3.HashSeed(b[:], Seed)
}

// AppendSeq appends the sequence hashes of every full block of tokens to dst and returns it.
// A trailing partial block is ignored. extra is folded into each block's local hash.
func (h *Hasher) AppendSeq(dst []uint64, tokens []uint32, blockSize int, extra []byte) []uint64 {
	return h.Continue(dst, 0, false, tokens, blockSize, extra)
}

// Continue appends the sequence hashes of the full blocks in tokens to dst, treating them as
// following a chain whose last hash is parent (hasParent false means tokens start the
// sequence). It lets callers extend a chain block by block as tokens arrive.
func (h *Hasher) Continue(dst []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, extra []byte) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		local := h.Local(tokens[i:i+blockSize], extra)
		seq := local
		if hasParent {
			seq = Chain(parent, local)
		}
		dst = append(dst, seq)
		parent, hasParent = seq, true
	}
	return dst
}

// Seq is a convenience for one-off callers: the sequence hashes of tokens' full blocks.
func Seq(tokens []uint32, blockSize int, extra []byte) []uint64 {
	var h Hasher
	return h.AppendSeq(make([]uint64, 0, len(tokens)/max(blockSize, 1)), tokens, blockSize, extra)
}
