// Package blockhash computes the prefix-chained block hashes that the proxy, the control plane
// and the simulated engine share (docs/block-hashing.md: the design, and where the seed and
// the block size come from).
//
// Only full blocks are hashed. For block i of a token sequence,
//
//	local[i] = XXH3_64(LE uint32 token ids of block i ‖ extra, seed 1337)
//	seq[0]   = local[0]
//	seq[i]   = XXH3_64(LE64(seq[i-1]) ‖ LE64(local[i]), seed 1337)
//
// so seq[i] names block i together with everything before it, and two sequences share a
// prefix of k blocks exactly when their first k sequence hashes agree. A block's extra keys
// (Keys: the LoRA adapter, multimodal inputs, and on the first block the cache salt, as vLLM
// keys its blocks) are appended in canonical form to the bytes of its local hash, so salted
// or adapter blocks never alias plain ones, and the chain carries the first block's salt.
//
// All functions are safe for concurrent use; a Hasher is not (it owns a scratch buffer) and
// is meant to live in a per-connection or per-worker struct.
package blockhash

import (
	"encoding/binary"
	"math"
	"reflect"
	"slices"

	"github.com/zeebo/xxh3"
)

// Seed is the XXH3 seed of every hash in the chain.
const Seed = 1337

// Hasher hashes token blocks without allocating once its scratch buffer has grown.
// The zero value is ready to use. A Hasher must not be used from two goroutines at once.
type Hasher struct {
	buf   []byte
	extra []byte
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
	return h.chain(dst, parent, hasParent, tokens, blockSize, extra, nil, 0)
}

// chain appends the sequence hashes of tokens' full blocks, each folding extra or, with k,
// its own extra keys (block first+j of its request).
func (h *Hasher) chain(dst []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, extra []byte, k *Keys, first int) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	for i := 0; i+blockSize <= len(tokens); i += blockSize {
		if k != nil {
			h.extra = k.Block(h.extra[:0], first+i/blockSize)
			extra = h.extra
		}
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

// Keys are what a request's blocks are hashed with besides their tokens: vLLM's extra keys.
// vLLM gives block i the tuple (LoRA adapter name, the multimodal inputs in the block, the
// cache salt when i is 0), in that order, or none when all are absent; the cache salt marks
// the first block only because the chain carries it into every later one. Block renders a
// block's tuple in one canonical form (AppendKey's), so the proxy (from the request), the
// simulated engine (from its own requests) and the control plane's index (from the
// extra_keys of engines' KV events) fold identical bytes into the block's local hash.
type Keys struct {
	LoRA string
	// MM are identifiers of the request's multimodal inputs. The proxy cannot tell which
	// blocks an input's placeholder tokens fall in, so it gives every block all of them;
	// such blocks then never alias plain ones (nor match an engine's, which names only the
	// inputs inside each block).
	MM   [][]byte
	Salt []byte
}

// Empty reports whether no block has extra keys.
func (k *Keys) Empty() bool { return k.LoRA == "" && len(k.MM) == 0 && len(k.Salt) == 0 }

// Block appends block i's extra keys to dst in canonical form (nothing when it has none).
func (k *Keys) Block(dst []byte, i int) []byte {
	if k.LoRA != "" {
		dst = appendStr(dst, k.LoRA)
	}
	for _, m := range k.MM {
		dst = appendStr(dst, m)
	}
	if i == 0 && len(k.Salt) > 0 {
		dst = appendStr(dst, k.Salt)
	}
	return dst
}

// AppendKey appends the canonical form of one engine's extra-keys tuple for a block, as
// decoded from msgpack (kvevents.RawValue.Decode): each element in order, strings and bytes
// alike as length-prefixed strings, integers, floats, booleans and nil tagged, nested
// tuples recursively. A ("cache_salt", salt) pair, which later vLLM releases send in place
// of the bare salt, is the salt. nil (Python None) has no keys.
func AppendKey(dst []byte, v any) []byte {
	list, ok := v.([]any)
	if !ok {
		if v == nil {
			return dst
		}
		return appendElem(dst, v)
	}
	for _, e := range list {
		dst = appendElem(dst, e)
	}
	return dst
}

func appendElem(dst []byte, v any) []byte {
	switch x := v.(type) {
	case nil:
		return append(dst, 'n')
	case string:
		return appendStr(dst, x)
	case []byte:
		return appendStr(dst, x)
	case bool:
		if x {
			return append(dst, 'b', 1)
		}
		return append(dst, 'b', 0)
	case float32:
		return appendElem(dst, float64(x))
	case float64:
		return binary.LittleEndian.AppendUint64(append(dst, 'f'), math.Float64bits(x))
	case []any:
		if len(x) == 2 {
			if tag, ok := x[0].(string); ok && tag == "cache_salt" {
				return appendElem(dst, x[1])
			}
		}
		dst = binary.AppendUvarint(append(dst, 't'), uint64(len(x)))
		for _, e := range x {
			dst = appendElem(dst, e)
		}
		return dst
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		dst = binary.AppendUvarint(append(dst, 'm'), uint64(len(x)))
		for _, k := range keys {
			dst = appendElem(appendStr(dst, k), x[k])
		}
		return dst
	}
	// Integers of every width (msgpack decodes each at its own) render alike.
	switch rv := reflect.ValueOf(v); {
	case rv.CanInt():
		return binary.LittleEndian.AppendUint64(append(dst, 'i'), uint64(rv.Int()))
	case rv.CanUint():
		return binary.LittleEndian.AppendUint64(append(dst, 'i'), rv.Uint())
	}
	return append(dst, '?')
}

func appendStr[S string | []byte](dst []byte, s S) []byte {
	dst = binary.AppendUvarint(append(dst, 's'), uint64(len(s)))
	return append(dst, s...)
}

// AppendSeqKeys is AppendSeq with each block's extra keys from k; first is the index of
// tokens' first block in its request (0 unless continuing a chain, as Continue).
func (h *Hasher) AppendSeqKeys(dst []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, k *Keys, first int) []uint64 {
	if k.Empty() {
		k = nil // plain blocks: nothing to render per block
	}
	return h.chain(dst, parent, hasParent, tokens, blockSize, nil, k, first)
}
