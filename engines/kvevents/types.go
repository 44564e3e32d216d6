package kvevents

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
)

// ErrMalformed is wrapped by every error that DecodeBatch returns for bytes that are not a KV
// event batch. Check it with errors.Is.
var ErrMalformed = errors.New("malformed kv event batch")

// Hash is an engine's opaque block hash. Engines send either a 64-bit integer (vLLM's default;
// unsigned, often above 2^63, or signed in some engines, kept here as its uint64 bit pattern)
// or raw bytes (vLLM with a bytes-valued hash function). Exactly one form is set: B != "" means
// the bytes form and U is then zero. Hash is comparable and is meant to be used as a map key.
//
// An empty bytes hash cannot be told apart from the integer 0; no engine sends one.
type Hash struct {
	U uint64
	B string
}

// HashU64 returns the integer form of a block hash.
func HashU64(v uint64) Hash { return Hash{U: v} }

// HashBytes returns the bytes form of a block hash. An empty b yields the integer 0.
func HashBytes(b []byte) Hash { return Hash{B: string(b)} }

// IsBytes reports whether h is in bytes form.
func (h Hash) IsBytes() bool { return h.B != "" }

// String formats h as a decimal integer or as "0x" followed by the hex of its bytes.
func (h Hash) String() string {
	if h.B != "" {
		return "0x" + hex.EncodeToString([]byte(h.B))
	}
	return strconv.FormatUint(h.U, 10)
}

// Kind is the type of a KV cache event.
type Kind uint8

// The event kinds vLLM, SGLang and the simulated engine publish. The zero Kind is invalid.
const (
	// BlockStored: full blocks entered the cache (carries hashes, parent, token ids).
	BlockStored Kind = iota + 1
	// BlockRemoved: blocks left the cache (carries hashes only).
	BlockRemoved
	// AllBlocksCleared: the engine dropped its whole prefix cache.
	AllBlocksCleared
)

// String returns the wire tag of k ("BlockStored", ...), or "Kind(n)" for an invalid kind.
func (k Kind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// Valid reports whether k is one of the three known kinds.
func (k Kind) Valid() bool { return k >= BlockStored && k <= AllBlocksCleared }

// RawValue is one msgpack-encoded value kept as bytes. It carries the per-block entries of
// extra_keys (tuples of multimodal hashes, LoRA names, cache salts, ...), whose shape varies by
// engine and version. A nil RawValue stands for msgpack nil (Python None). A non-nil RawValue
// handed to AppendBatch must hold exactly one well-formed msgpack value; DecodeBatch only ever
// produces such values.
type RawValue []byte

// Decode unpacks v into generic Go values (nil, bool, int64/uint64, float, string, []byte,
// []any, map[string]any) using a general msgpack decoder. It allocates; it is meant for the
// control plane's slow path, not for per-event work.
func (v RawValue) Decode() (any, error) {
	if v == nil {
		return nil, nil
	}
	// Walk it with the bounded reader first: msgpack's own decoder preallocates what a
	// length prefix claims, so a few bytes claiming a huge array would exhaust memory.
	r := reader{b: v}
	if err := r.skip(1); err != nil || r.off != len(v) {
		return nil, fmt.Errorf("%w: extra_keys entry is not one well-formed msgpack value", ErrMalformed)
	}
	var out any
	if err := msgpack.Unmarshal(v, &out); err != nil {
		return nil, errors.Join(ErrMalformed, err)
	}
	return out, nil
}

// Event is one KV cache event. Which fields are meaningful depends on Kind:
//
//   - BlockStored: BlockHashes, Parent/HasParent, TokenIDs, BlockSize, LoraID/HasLoraID,
//     Medium, LoraName, ExtraKeys/HasExtraKeys, GroupIdx/HasGroupIdx, KVCacheSpecKind,
//     SlidingWindow/HasSlidingWindow, BigramTokens, Locality, Ownership, SessionID.
//   - BlockRemoved: BlockHashes, Medium, GroupIdx/HasGroupIdx, Locality, Ownership.
//   - AllBlocksCleared: nothing.
//
// Optional wire fields that may be nil (Python None) have a Has flag; strings use "" for nil.
// An Event owns its slices; nothing in it aliases the bytes it was decoded from.
type Event struct {
	Kind Kind

	// BlockHashes are the engine's hashes of the stored or removed blocks, in prefix order.
	BlockHashes []Hash
	// Parent is the hash of the block before BlockHashes[0]. HasParent is false when the
	// engine sent nil (vLLM, for a first block); some simulators send 0 instead, which
	// decodes as HasParent with the integer hash 0.
	Parent    Hash
	HasParent bool

	// TokenIDs are the tokens of all stored blocks, concatenated.
	TokenIDs []uint32
	// BigramTokens records that the engine sent token_ids as SGLang's EAGLE bigram pairs
	// [[t0,t1],[t1,t2],...]; TokenIDs then holds the unrolled sequence t0,t1,t2,... (one
	// token more than the pairs). AppendBatch writes pairs again when it is set.
	BigramTokens bool
	// BlockSize is the number of tokens per block.
	BlockSize int

	// LoraID is vLLM's deprecated numeric adapter id; LoraName names the adapter.
	LoraID    int
	HasLoraID bool
	LoraName  string

	// Medium is the storage tier ("GPU", "CPU", "DISK", ...); "" when nil.
	Medium string

	// ExtraKeys holds, when HasExtraKeys, one entry per block hash: the extra inputs the
	// engine folded into that block's hash, or nil for a plain block (vLLM sends [None]).
	ExtraKeys    []RawValue
	HasExtraKeys bool

	// GroupIdx is the KV cache group of hybrid models (several groups, e.g. full attention
	// and sliding window); HasGroupIdx is false for engines that send none.
	GroupIdx    int
	HasGroupIdx bool
	// KVCacheSpecKind names the group's attention kind ("full_attention", ...); "" when nil.
	KVCacheSpecKind string
	// SlidingWindow is the group's window in tokens, for sliding-window groups.
	SlidingWindow    int
	HasSlidingWindow bool

	// Locality, Ownership and SessionID exist only in map events (engines added them after
	// they left the positional layout); FormatArray does not write them.
	//
	// Locality says who can read an offloaded block: "LOCAL" (this worker) or "REMOTE"
	// (storage every worker that mounts it shares); "" when nil.
	Locality string
	// Ownership names the secondary tier that holds the block (vLLM's offloading tiers each
	// evict their own copies); "" when nil.
	Ownership string
	// SessionID is the session the engine stored the block for, when it says; "" when nil.
	SessionID string
}

// Batch is one published message: the events of one engine step.
type Batch struct {
	// TS is the engine's wall-clock time in seconds since the Unix epoch.
	TS     float64
	Events []Event
	// DPRank is the data-parallel rank of the engine core that produced the batch.
	DPRank    int
	HasDPRank bool
	// Skipped counts events DecodeBatch left out because their type tag is unknown to this
	// package (newer engines add event types; a batch is not rejected for them). AppendBatch
	// ignores it.
	Skipped int
}

// Format selects how AppendBatch lays out events. Decoding accepts both.
type Format uint8

const (
	// FormatMap writes each event as a map keyed by field name with the tag under "type",
	// as vLLM does since it dropped array_like from its event structs (vLLM PR #42892,
	// vLLM 0.2x). The batch itself stays a positional array. This is the default.
	FormatMap Format = iota
	// FormatArray writes each event as a tagged positional array
	// ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
	// ...] with trailing nil fields left out, as older vLLM and most other engines and
	// simulators do.
	FormatArray
)

// String returns "map" or "array".
func (f Format) String() string {
	switch f {
	case FormatMap:
		return "map"
	case FormatArray:
		return "array"
	}
	return "Format(" + strconv.Itoa(int(f)) + ")"
}

// ParseFormat maps "map" and "array" (and "" to the default, map) to a Format.
func ParseFormat(s string) (Format, error) {
	switch s {
	case "", "map":
		return FormatMap, nil
	case "array":
		return FormatArray, nil
	}
	return 0, errors.New("unknown kv event format " + strconv.Quote(s) + " (want map or array)")
}
