package journal

import (
	"testing"

	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// FuzzApplyBatch feeds arbitrary bytes as a journal batch to the client's decoding and a
// replica: it never panics, refuses what it cannot read, and what it accepts applies.
func FuzzApplyBatch(f *testing.F) {
	for _, b := range []*xdsv1.JournalBatch{
		{Epoch: 1, Offset: 0, Next: 2, Seq: []uint64{1, 2}, At: []uint32{pack(Change{Slot: 3, Tier: blockset.Host}), pack(Change{Slot: 1, Op: Removed})}},
		{Epoch: 2, Reset_: true, SnapshotDone: true, Seq: []uint64{9}, At: []uint32{pack(Change{Slot: 70, Op: Cleared})}},
		{Seq: []uint64{1}, At: []uint32{0xffffffff}},
	} {
		data, _ := proto.Marshal(b)
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var b xdsv1.JournalBatch
		if proto.Unmarshal(data, &b) != nil {
			return
		}
		cs, ok := decode(nil, &b)
		if !ok {
			return
		}
		var m mirror
		m.Apply(cs)
		for _, c := range cs {
			if c.Slot >= MaxSlots || c.Tier >= blockset.NumTiers || c.Op > Cleared {
				t.Fatalf("accepted %+v", c)
			}
		}
	})
}
