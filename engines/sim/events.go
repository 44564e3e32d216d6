package sim

import (
	"encoding/binary"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// Seeds of the engine's own block hashes. They are deliberately not kvrelay's chain: a real
// engine's hashes are opaque to the router, which must recompute its own from token ids.
const (
	engineHashSeedLo = 0x5eed_c0de_0000_0001
	engineHashSeedHi = 0x5eed_c0de_0000_0002
)

// engineHash is the opaque hash the engine reports for the block with kvrelay sequence hash
// seq: a 64-bit integer spanning the whole unsigned range, or 32 bytes.
func engineHash(seq uint64, asBytes bool) kvevents.Hash {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], seq)
	if !asBytes {
		return kvevents.HashU64(xxh3.HashSeed(b[:], engineHashSeedLo))
	}
	var out [32]byte
	lo, hi := xxh3.Hash128Seed(b[:], engineHashSeedLo), xxh3.Hash128Seed(b[:], engineHashSeedHi)
	binary.BigEndian.PutUint64(out[0:], lo.Hi)
	binary.BigEndian.PutUint64(out[8:], lo.Lo)
	binary.BigEndian.PutUint64(out[16:], hi.Hi)
	binary.BigEndian.PutUint64(out[24:], hi.Lo)
	return kvevents.HashBytes(out[:])
}

// batchPublisher is what eventAdapter publishes through: a *kvevents.Publisher.
type batchPublisher interface {
	Publish(b *kvevents.Batch) error
}

// PublishFunc publishes a batch of KV events; it must copy what it keeps.
type PublishFunc func(b *kvevents.Batch) error

// Publish implements the adapter's publisher.
func (f PublishFunc) Publish(b *kvevents.Batch) error { return f(b) }

// NewEventSink returns the EventSink a Worker gives its engine: each step's cache events as
// one vLLM KV event batch (the engine's opaque block hashes, 32-byte ones when asBytes),
// handed to publish on the engine goroutine. The tiers are published as vLLM's offloading
// connector publishes them: GPU, CPU with locality LOCAL, and the disk tier as STORAGE with
// locality LOCAL, each store a copy with its own removal.
// With placeholders, the host and disk tiers' stores carry the block's hash alone
// (Config.OffloadPlaceholders).
func NewEventSink(publish PublishFunc, blockSize int, asBytes bool, placeholders ...bool) EventSink {
	return &eventAdapter{pub: publish, blockSize: blockSize, asBytes: asBytes, placeholders: len(placeholders) > 0 && placeholders[0]}
}

// eventAdapter turns an engine's cache events into vLLM KV event batches, one batch per step,
// with the engine's opaque block hashes. It runs on the engine goroutine and reuses its
// buffers; the publisher copies what it is given.
type eventAdapter struct {
	pub       batchPublisher
	blockSize int
	asBytes   bool
	// placeholders publishes lower tiers' stores without tokens (Config.OffloadPlaceholders).
	placeholders bool
	batch        kvevents.Batch
	hashes       []kvevents.Hash
	extra        []kvevents.RawValue
}

var _ EventSink = (*eventAdapter)(nil)

func (a *eventAdapter) CacheEvents(at time.Time, evs []CacheEvent) {
	n := 0
	for _, ev := range evs {
		n += len(ev.Hashes)
	}
	if cap(a.hashes) < n {
		a.hashes = make([]kvevents.Hash, 0, n)
	}
	hashes := a.hashes[:0]
	a.batch.Events = a.batch.Events[:0]
	for _, ev := range evs {
		start := len(hashes)
		for _, h := range ev.Hashes {
			hashes = append(hashes, engineHash(h, a.asBytes))
		}
		out := kvevents.Event{BlockHashes: hashes[start:len(hashes):len(hashes)]}
		switch ev.Kind {
		case BlocksStored:
			extra := a.plain(len(ev.Hashes))
			if k := ev.Keys; k != nil {
				// As vLLM: one tuple per block, (adapter, multimodal inputs, the cache salt on
				// the request's first block), and the adapter's name in lora_name.
				extra = make([]kvevents.RawValue, len(ev.Hashes))
				for j := range extra {
					extra[j] = vllmExtraKeys(k, ev.First+j)
				}
				out.LoraName = k.LoRA
			}
			out.Kind = kvevents.BlockStored
			if ev.HasParent {
				out.Parent, out.HasParent = engineHash(ev.Parent, a.asBytes), true
			}
			out.TokenIDs = ev.Tokens
			out.BlockSize = a.blockSize
			out.Medium, out.Locality, out.Ownership = wireMedium(ev.Medium)
			out.ExtraKeys, out.HasExtraKeys = extra, true
			out.GroupIdx, out.HasGroupIdx = 0, true
			out.KVCacheSpecKind = "full_attention"
			if a.placeholders && out.Locality != "" {
				// vLLM's _placeholder_stored: the hash, its group and locality.
				out = kvevents.Event{Kind: kvevents.BlockStored, BlockHashes: out.BlockHashes, Medium: out.Medium,
					Locality: out.Locality, Ownership: out.Ownership, GroupIdx: 0, HasGroupIdx: true}
			}
		case BlocksRemoved:
			out.Kind = kvevents.BlockRemoved
			out.Medium, out.Locality, out.Ownership = wireMedium(ev.Medium)
			out.GroupIdx, out.HasGroupIdx = 0, true
		case AllBlocksCleared:
			out = kvevents.Event{Kind: kvevents.AllBlocksCleared}
		default:
			continue
		}
		a.batch.Events = append(a.batch.Events, out)
	}
	a.hashes = hashes
	a.batch.TS = float64(at.UnixNano()) / 1e9
	// A full queue drops the batch; the publisher counts it and the gap in seq tells
	// subscribers to replay.
	_ = a.pub.Publish(&a.batch)
}

// wireMedium is the medium, locality and ownership vLLM's offloading connector publishes for
// a tier: GPU; CPU, local; the disk tier as STORAGE, local (v0.27's name for its fs tier); a
// shared disk tier as STORAGE, remote, owned by SharedOwner.
func wireMedium(m string) (medium, locality, ownership string) {
	switch m {
	case "", MediumGPU:
		return MediumGPU, "", ""
	case MediumDISK:
		return "STORAGE", "LOCAL", ""
	case MediumShared:
		return "STORAGE", "REMOTE", SharedOwner
	}
	return m, "LOCAL", ""
}

// SharedOwner is the ownership a shared disk tier's events carry: vLLM's name for its
// filesystem tier.
const SharedOwner = "fs"

// plain returns n nil extra-keys entries (blocks without keys), reused across batches.
func (a *eventAdapter) plain(n int) []kvevents.RawValue {
	for len(a.extra) < n {
		a.extra = append(a.extra, nil)
	}
	return a.extra[:n]
}

// vllmExtraKeys is block i's extra_keys entry as vLLM publishes it: a tuple (msgpack array)
// of the adapter's name, the multimodal identifiers and, on block 0, the cache salt; nil
// when the block has none of them.
func vllmExtraKeys(k *blockhash.Keys, i int) kvevents.RawValue {
	var keys []string
	if k.LoRA != "" {
		keys = append(keys, k.LoRA)
	}
	for _, m := range k.MM {
		keys = append(keys, string(m))
	}
	if i == 0 && len(k.Salt) > 0 {
		keys = append(keys, string(k.Salt))
	}
	if len(keys) == 0 {
		return nil
	}
	b, err := msgpack.Marshal(keys)
	if err != nil {
		return nil
	}
	return b
}
