package journal

import (
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// pack is a change's at field: slot << 4 | tier << 2 | op.
func pack(c Change) uint32 { return c.Slot<<4 | uint32(c.Tier)<<2 | uint32(c.Op) }

// MaxSlots bounds the worker slots a journal may name, so that a corrupt or hostile batch
// cannot make a replica allocate without bound.
const MaxSlots = 1 << 14

// unpack is the inverse of pack; ok is false for an op, tier or slot the client refuses.
func unpack(seq uint64, at uint32) (Change, bool) {
	c := Change{Seq: seq, Slot: at >> 4, Tier: blockset.Tier(at >> 2 & 3), Op: Op(at & 3)}
	return c, c.Op <= Cleared && c.Tier < blockset.NumTiers && c.Slot < MaxSlots
}

// decode appends a batch's changes to dst; ok is false when any is unreadable.
func decode(dst []Change, b *xdsv1.JournalBatch) ([]Change, bool) {
	if len(b.Seq) != len(b.At) {
		return dst, false
	}
	for i := range b.Seq {
		c, ok := unpack(b.Seq[i], b.At[i])
		if !ok {
			return dst, false
		}
		dst = append(dst, c)
	}
	return dst, true
}

// appendChanges fills a batch's arrays.
func appendChanges(b *xdsv1.JournalBatch, cs []Change) {
	for _, c := range cs {
		b.Seq = append(b.Seq, c.Seq)
		b.At = append(b.At, pack(c))
	}
}
