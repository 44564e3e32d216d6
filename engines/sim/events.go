package sim

import (
	"encoding/binary"
	"time"

	"github.com/zeebo/xxh3"

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

// eventAdapter turns an engine's cache events into vLLM KV event batches, one batch per step,
// with the engine's opaque block hashes. It runs on the engine goroutine and reuses its
// buffers; the publisher copies what it is given.
type eventAdapter struct {
	pub       batchPublisher
	blockSize int
	asBytes   bool
	batch     kvevents.Batch
	hashes    []kvevents.Hash
	extra     []kvevents.RawValue
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
			for len(a.extra) < len(ev.Hashes) {
				a.extra = append(a.extra, nil)
			}
			out.Kind = kvevents.BlockStored
			if ev.HasParent {
				out.Parent, out.HasParent = engineHash(ev.Parent, a.asBytes), true
			}
			out.TokenIDs = ev.Tokens
			out.BlockSize = a.blockSize
			out.Medium = "GPU"
			out.ExtraKeys, out.HasExtraKeys = a.extra[:len(ev.Hashes)], true
			out.GroupIdx, out.HasGroupIdx = 0, true
			out.KVCacheSpecKind = "full_attention"
		case BlocksRemoved:
			out.Kind = kvevents.BlockRemoved
			out.Medium = "GPU"
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
