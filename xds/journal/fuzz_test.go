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
		if ms, ok := batchColumns(&b).read(nil); ok {
			for _, m := range ms {
				if m.Slot >= MaxSlots {
					t.Fatalf("accepted the mark %+v", m)
				}
			}
			putMarksMap(map[uint32]Mark{}, ms)
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

// FuzzResumeMarks feeds arbitrary bytes as a proxy's first journal message, whose marks a
// control plane of another epoch resumes it from: reading them and Log.Resume never panic,
// and what Resume accepts replays from within the ring and names only slots that the proxy
// or the log holds.
func FuzzResumeMarks(f *testing.F) {
	for _, a := range []*xdsv1.JournalAck{
		{NodeId: "p", Epoch: 9, PosSlot: []uint32{0, 1}, PosCheck: []uint32{7, 7}, PosSeq: []uint64{3, 2}, PosSince: []uint64{0, 0}},
		{NodeId: "p", PosSlot: []uint32{MaxSlots - 1}, PosCheck: []uint32{8}, PosSeq: []uint64{1 << 60}, PosSince: []uint64{1 << 62}},
		{NodeId: "p", PosSlot: []uint32{5}, PosCheck: []uint32{7}, PosSeq: []uint64{3}},
	} {
		data, _ := proto.Marshal(a)
		f.Add(data)
	}
	l := NewLog(64)
	for s := range uint32(20) {
		for k := uint64(1); k <= 3; k++ {
			l.AppendMarked(1, Mark{Slot: s, Check: 7, Seq: k}, Change{Seq: uint64(s)<<8 | k, Slot: s, Op: Stored})
		}
	}
	l.Forget(19, Change{Slot: 19, Op: Cleared})
	f.Fuzz(func(t *testing.T, data []byte) {
		var a xdsv1.JournalAck
		if proto.Unmarshal(data, &a) != nil {
			return
		}
		theirs, ok := ackColumns(&a).read(nil)
		if !ok {
			return
		}
		held := map[uint32]bool{}
		for _, m := range theirs {
			held[m.Slot] = true
		}
		for _, in := range []func(uint32) bool{nil, func(s uint32) bool { return s%2 == 0 }} {
			from, reset, ok := l.Resume(theirs, in)
			if !ok {
				continue
			}
			if _, _, inRing := l.Read(nil, from, 0); !inRing {
				t.Fatalf("resume from %d, outside the ring", from)
			}
			for _, m := range reset {
				if !held[m.Slot] && int(m.Slot) >= 20 {
					t.Fatalf("resume names slot %d, which neither side holds", m.Slot)
				}
			}
		}
	})
}
