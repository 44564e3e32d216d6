package journal

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// serveWith serves srv on addr until the returned func stops it.
func serveWith(t *testing.T, srv xdsv1.IndexJournalServer, addr string) func() {
	t.Helper()
	_, stop := serveAt(t, srv, addr)
	return stop
}

func (s *source) EachSlots(slots []int, fn func(uint64, int, blockset.Tier)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.set.EachSlots(slots, fn)
}

// applyMarked applies one event batch of a worker, as ingestion does: the index and the
// log change together, with the worker's mark.
func (s *source) applyMarked(m Mark, cs ...Change) {
	s.mu.Lock()
	defer s.mu.Unlock()
	applyTo(&s.set, cs)
	s.log.AppendMarked(time.Now().UnixNano(), m, cs...)
}

// engineBatch is worker w's event batch k: it stores block k, and every third batch removes
// the block stored two batches before. Both replicas derive the same changes from it.
func engineBatch(w, slot uint32, k uint64) []Change {
	cs := []Change{{Seq: uint64(w)<<32 | k, Slot: slot, Op: Stored}}
	if k%3 == 0 {
		cs = append(cs, Change{Seq: uint64(w)<<32 | (k - 2), Slot: slot, Op: Removed})
	}
	return cs
}

// replicaOf is a control plane replica whose log checkpoints every marked append.
func replicaOf() *source {
	l := NewLog(1 << 12)
	l.CheckpointEvery = time.Nanosecond
	return &source{log: l}
}

// feed applies batches from..to (inclusive) of each worker, workers taking turns in the
// order given; slots maps a worker to its slot in this replica.
func feed(src *source, order []uint32, slots map[uint32]uint32, from, to map[uint32]uint64) {
	for k := uint64(1); ; k++ {
		more := false
		for _, w := range order {
			if k < from[w] || k > to[w] {
				more = more || k < from[w]
				continue
			}
			more = true
			src.applyMarked(Mark{Slot: slots[w], Check: 1000 + w, Seq: k}, engineBatch(w, slots[w], k)...)
		}
		if !more {
			return
		}
	}
}

func uniform(ws []uint32, k uint64) map[uint32]uint64 {
	out := map[uint32]uint64{}
	for _, w := range ws {
		out[w] = k
	}
	return out
}

// TestResumeOnAnotherReplica: a proxy whose replica was built from one control plane
// replica moves to another (a different epoch, the same workers' events in another
// interleaving, ahead of the proxy for some workers, level for one and behind for one) and
// goes on without a snapshot: the workers it can place are replayed from its marks, the one
// behind has its slot filled again, and the replica ends equal to the new control plane's
// index.
func TestResumeOnAnotherReplica(t *testing.T) {
	ws := []uint32{0, 1, 2, 3}
	slots := map[uint32]uint32{0: 0, 1: 1, 2: 2, 3: 3}
	a, b := replicaOf(), replicaOf()
	feed(a, ws, slots, uniform(ws, 1), uniform(ws, 10))
	feed(b, []uint32{3, 2, 1, 0}, slots, uniform(ws, 1), map[uint32]uint64{0: 14, 1: 13, 2: 12, 3: 6})

	addr, stopA := serve(t, a, "127.0.0.1:0")
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	eventually(t, "the snapshot of replica A", func() bool { return same(m.entries(), entries(a.Each)) })
	// A's workers move on; the proxy takes their marks with the changes.
	feed(a, ws, slots, uniform(ws, 11), uniform(ws, 12))
	eventually(t, "A's changes", func() bool { return same(m.entries(), entries(a.Each)) })
	// The checkpoints brought the proxy every worker's mark at batch 12.
	eventually(t, "the marks of batch 12", func() bool {
		ms := c.Marks()
		for _, w := range ws {
			if ms[slots[w]] != (Mark{Slot: slots[w], Check: 1000 + w, Seq: 12}) {
				return false
			}
		}
		return len(ms) == len(ws)
	})
	stopA()

	srvB := NewServer(b.log, b, ServerOptions{SnapshotBatch: 7})
	stopB := serveWith(t, srvB, addr)
	defer stopB()
	eventually(t, "the resume on replica B", func() bool { return c.Stats().Resumes == 1 })
	eventually(t, "B's index", func() bool { return same(m.entries(), entries(b.Each)) })
	st := c.Stats()
	if st.Snapshots != 1 || m.resets != 1 {
		t.Fatalf("moving to B took a snapshot: client %+v, %d resets", st, m.resets)
	}
	// Worker 3: B stood behind the proxy's mark, so its slot was filled again. Worker 2:
	// level. Workers 0 and 1: B was ahead and replayed what the proxy lacked.
	if s := srvB.Stats(); s.Resumes != 1 || s.ResumedSlots != 1 || s.Snapshots != 0 {
		t.Fatalf("server B: %+v, want one resume refilling one slot and no snapshot", s)
	}
	// B goes on, and the proxy with it.
	feed(b, ws, slots, map[uint32]uint64{0: 15, 1: 14, 2: 13, 3: 7}, uniform(ws, 20))
	eventually(t, "B's later changes", func() bool { return same(m.entries(), entries(b.Each)) })
}

// TestResumeRefillsSlotsThatDiffer: the other replica gave worker 1 another slot and put a
// worker the proxy never saw in worker 1's old slot; a worker the proxy knows is gone
// there. Those slots are cleared and filled again; the rest resumes.
func TestResumeRefillsSlotsThatDiffer(t *testing.T) {
	a, b := replicaOf(), replicaOf()
	feed(a, []uint32{0, 1, 2}, map[uint32]uint32{0: 0, 1: 1, 2: 2}, uniform([]uint32{0, 1, 2}, 1), uniform([]uint32{0, 1, 2}, 9))
	feed(b, []uint32{9, 1, 0}, map[uint32]uint32{0: 0, 1: 5, 9: 1}, uniform([]uint32{0, 1, 9}, 1), uniform([]uint32{0, 1, 9}, 11))

	addr, stopA := serve(t, a, "127.0.0.1:0")
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	eventually(t, "A's snapshot", func() bool { return same(m.entries(), entries(a.Each)) })
	eventually(t, "the marks", func() bool { return c.Stats().Snapshots == 1 })
	stopA()
	// The refill spans several batches, each of which the proxy acknowledges: a short
	// AckTimeout would end the stream if one were not.
	srvB := NewServer(b.log, b, ServerOptions{SnapshotBatch: 5, AckTimeout: 200 * time.Millisecond})
	stopB := serveWith(t, srvB, addr)
	defer stopB()
	eventually(t, "B's index", func() bool { return same(m.entries(), entries(b.Each)) })
	streams := c.Stats().Streams
	time.Sleep(400 * time.Millisecond)
	feed(b, []uint32{0, 1, 9}, map[uint32]uint32{0: 0, 1: 5, 9: 1}, uniform([]uint32{0, 1, 9}, 12), uniform([]uint32{0, 1, 9}, 13))
	eventually(t, "B's later changes", func() bool { return same(m.entries(), entries(b.Each)) })
	if st := c.Stats(); st.Streams != streams || st.Nacks != 0 {
		t.Fatalf("the stream on B ended or was refused after the resume: %+v (streams were %d)", st, streams)
	}
	// Slot 1 (another worker), slot 2 (no worker on B), slot 5 (unknown to the proxy).
	if s := srvB.Stats(); s.Resumes != 1 || s.ResumedSlots != 3 || s.Snapshots != 0 {
		t.Fatalf("server B: %+v, want one resume refilling three slots", s)
	}
	// The proxy now holds B's marks for the refilled slots and none for slot 2: on a
	// third replica level with B it resumes with nothing to refill.
	c3 := replicaOf()
	feed(c3, []uint32{0, 1, 9}, map[uint32]uint32{0: 0, 1: 5, 9: 1}, uniform([]uint32{0, 1, 9}, 1), uniform([]uint32{0, 1, 9}, 13))
	stopB()
	srvC := NewServer(c3.log, c3, ServerOptions{})
	stopC := serveWith(t, srvC, addr)
	defer stopC()
	eventually(t, "the resume on a third replica", func() bool { return c.Stats().Resumes == 2 })
	if s := srvC.Stats(); s.ResumedSlots != 0 || s.Snapshots != 0 {
		t.Fatalf("third replica: %+v, want a resume refilling nothing", s)
	}
	if !same(m.entries(), entries(c3.Each)) {
		t.Fatal("the replica differs from the third replica's index")
	}
}

func TestLogResumeRefusals(t *testing.T) {
	l := NewLog(16)
	l.CheckpointEvery = time.Nanosecond
	if _, _, ok := l.Resume([]Mark{{Slot: 0, Check: 1, Seq: 1}}, nil); ok {
		t.Fatal("a log with no marks resumed a replica")
	}
	for s := range uint32(40) {
		for k := uint64(1); k <= 3; k++ {
			l.AppendMarked(1, Mark{Slot: s, Check: 7, Seq: k}, Change{Seq: uint64(s)<<8 | k, Slot: s, Op: Stored})
		}
	}
	// Every worker at its level: nothing to replay, nothing to refill.
	level := make([]Mark, 40)
	for s := range level {
		level[s] = Mark{Slot: uint32(s), Check: 7, Seq: 3}
	}
	if from, reset, ok := l.Resume(level, nil); !ok || from != l.Next() || len(reset) != 0 {
		t.Fatalf("level: from %d (next %d) reset %v ok %v", from, l.Next(), reset, ok)
	}
	// One worker a batch behind, its change still in the ring: replay from there.
	behind := append([]Mark(nil), level...)
	behind[39].Seq = 2
	if from, reset, ok := l.Resume(behind, nil); !ok || from != l.Next()-1 || len(reset) != 0 {
		t.Fatalf("one behind: from %d (next %d) reset %v ok %v", from, l.Next(), reset, ok)
	}
	// A replay that would start before the ring (16 changes) needs a snapshot.
	old := append([]Mark(nil), level...)
	old[0].Seq = 1
	if _, _, ok := l.Resume(old, nil); ok {
		t.Fatal("resumed from an offset the ring no longer holds")
	}
	// Most workers under other ids: more to refill than a snapshot costs.
	other := append([]Mark(nil), level...)
	for i := range 30 {
		other[i].Check = 8
	}
	if _, _, ok := l.Resume(other, nil); ok {
		t.Fatal("resumed refilling 30 of 40 slots")
	}
	// A worker this log covers from a later batch than the proxy's part does: its removals
	// of blocks it never knew could not come, so it is refilled.
	l.AppendMarked(1, Mark{Slot: 38, Check: 7, Seq: 3, Since: 2})
	if _, reset, ok := l.Resume(level, nil); !ok || len(reset) != 1 || reset[0].Slot != 38 {
		t.Fatalf("covering less: reset %v ok %v", reset, ok)
	}
	l.AppendMarked(1, Mark{Slot: 38, Check: 7, Seq: 3})
	// Within a scope: a mark the proxy holds out of it is named to be cleared (a zero mark)
	// and counts nothing toward the threshold; this log's slots out of it are not named.
	scoped := func(s uint32) bool { return s >= 10 }
	if _, reset, ok := l.Resume(level[5:], scoped); !ok || len(reset) != 5 || reset[0].Check != 0 {
		t.Fatalf("scoped: reset %v ok %v", reset, ok)
	}
	// A forgotten worker is refilled (cleared: it has no mark).
	l.Forget(39, Change{Slot: 39, Op: Cleared})
	if _, reset, ok := l.Resume(level, nil); !ok || len(reset) != 1 || reset[0] != (Mark{Slot: 39}) {
		t.Fatalf("forgotten worker: reset %v ok %v", reset, ok)
	}
	// The worker restarted and its new run passed the proxy's batch number again: the
	// proxy's mark may be of the old run, so the slot is refilled, not replayed from there.
	for k := uint64(1); k <= 4; k++ {
		l.AppendMarked(1, Mark{Slot: 39, Check: 7, Seq: k}, Change{Seq: 900 + k, Slot: 39, Op: Stored})
	}
	if _, reset, ok := l.Resume(level, nil); !ok || len(reset) != 1 || reset[0].Slot != 39 {
		t.Fatalf("restarted worker: reset %v ok %v", reset, ok)
	}
}

// breaker is a control plane that sends the given batches on each stream and then breaks it.
type breaker struct {
	xdsv1.UnimplementedIndexJournalServer
	batches []*xdsv1.JournalBatch
	hellos  chan *xdsv1.JournalAck
}

func (b *breaker) Stream(st xdsv1.IndexJournal_StreamServer) error {
	hello, err := st.Recv()
	if err != nil {
		return err
	}
	b.hellos <- hello
	for _, x := range b.batches {
		if err := st.Send(x); err != nil {
			return err
		}
	}
	time.Sleep(50 * time.Millisecond)
	return status.Error(codes.Unavailable, "the control plane went away")
}

// TestBrokenSnapshotOrResumeStartsOver: a stream that breaks within a snapshot or a resume
// leaves the client claiming neither the new epoch nor the marks of the slots it was
// filling: on its next stream it asks for a snapshot (after a broken snapshot) or resumes
// with those slots unknown (after a broken resume), and ends equal to the control plane.
func TestBrokenSnapshotOrResumeStartsOver(t *testing.T) {
	ws := []uint32{0, 1, 2, 3}
	slots := map[uint32]uint32{0: 0, 1: 1, 2: 2, 3: 3}
	a := replicaOf()
	feed(a, ws, slots, uniform(ws, 1), uniform(ws, 6))
	addr, stopA := serve(t, a, "127.0.0.1:0")
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	eventually(t, "A's snapshot", func() bool { return same(m.entries(), entries(a.Each)) && len(c.Marks()) == 4 })
	stopA()

	// A resume that clears slot 3, fills it in part and breaks.
	br := &breaker{hellos: make(chan *xdsv1.JournalAck, 16), batches: []*xdsv1.JournalBatch{{
		Epoch: 77, Offset: 5, Next: 5, Resume: true,
		Seq: []uint64{0, 3<<32 | 1}, At: []uint32{pack(Change{Slot: 3, Op: Cleared}), pack(Change{Seq: 3<<32 | 1, Slot: 3, Op: Stored})},
		PosSlot: []uint32{3}, PosCheck: []uint32{1003}, PosSeq: []uint64{9}, PosSince: []uint64{0},
	}}}
	stopBr := serveWith(t, br, addr)
	<-br.hellos
	second := <-br.hellos // the stream after the break
	stopBr()
	got, _ := ackColumns(second).read(nil)
	if second.Epoch != 0 || len(got) != 3 {
		t.Fatalf("after a broken resume the client came back with epoch %d and marks %v, want no epoch and slot 3 unknown", second.Epoch, got)
	}
	for _, mk := range got {
		if mk.Slot == 3 {
			t.Fatalf("slot 3, half filled, kept a mark: %v", got)
		}
	}

	// A snapshot that breaks halfway.
	br2 := &breaker{hellos: make(chan *xdsv1.JournalAck, 16), batches: []*xdsv1.JournalBatch{{
		Epoch: 78, Offset: 9, Next: 9, Reset_: true,
		Seq: []uint64{5}, At: []uint32{pack(Change{Seq: 5, Slot: 0, Op: Stored})},
		PosSlot: []uint32{0}, PosCheck: []uint32{1000}, PosSeq: []uint64{6}, PosSince: []uint64{0},
	}}}
	stopBr2 := serveWith(t, br2, addr)
	<-br2.hellos
	third := <-br2.hellos
	stopBr2()
	if third.Epoch != 0 || len(third.PosSlot) != 0 {
		t.Fatalf("after a broken snapshot the client came back with epoch %d and %d marks, want a clean start", third.Epoch, len(third.PosSlot))
	}

	// A real replica then brings it level again.
	_, stopA2 := serve(t, a, addr)
	defer stopA2()
	eventually(t, "A's index again", func() bool { return same(m.entries(), entries(a.Each)) })
}

func TestCheckpointsCarryMovedMarks(t *testing.T) {
	l := NewLog(64)
	l.CheckpointEvery = time.Hour
	h := int64(time.Hour)
	l.AppendMarked(h, Mark{Slot: 0, Check: 1, Seq: 1}, Change{Seq: 1, Op: Stored}) // a checkpoint at offset 1
	l.AppendMarked(h+1, Mark{Slot: 1, Check: 2, Seq: 5}, Change{Seq: 2, Slot: 1, Op: Stored})
	l.AppendMarked(h+2, Mark{Slot: 1, Check: 2, Seq: 6}, Change{Seq: 3, Slot: 1, Op: Stored})
	if got := l.Checkpoints(nil, 0, l.Next()); len(got) != 1 || got[0] != (Mark{Slot: 0, Check: 1, Seq: 1}) {
		t.Fatalf("checkpoints within the hour: %v", got)
	}
	l.AppendMarked(2*h+10, Mark{Slot: 2, Check: 3, Seq: 9}, Change{Seq: 4, Slot: 2, Op: Stored})
	got := l.Checkpoints(nil, 1, l.Next())
	want := map[Mark]bool{{Slot: 1, Check: 2, Seq: 6}: true, {Slot: 2, Check: 3, Seq: 9}: true}
	if len(got) != 2 || !want[got[0]] || !want[got[1]] {
		t.Fatalf("second checkpoint: %v, want the latest marks of slots 1 and 2", got)
	}
	if got := l.Checkpoints(nil, l.Next(), l.Next()+5); len(got) != 0 {
		t.Fatalf("no checkpoint after the last: %v", got)
	}
	next, marks := l.Positions()
	if next != 4 || len(marks) != 3 {
		t.Fatalf("positions: %d %v", next, marks)
	}
}

// inSlots is the source's entries of the given slots.
func inSlots(src *source, slots ...int) map[[3]uint64]bool {
	out := map[[3]uint64]bool{}
	for k := range entries(src.Each) {
		for _, s := range slots {
			if k[1] == uint64(s) {
				out[k] = true
			}
		}
	}
	return out
}

// TestScopedStream: a proxy that names a model gets the blocks of the workers serving it
// (and of a worker whose model is not known) in its snapshot, its changes and its marks, and
// nothing of the others'. When the slots' models change, the slots that enter its scope are
// filled from the index and those that leave it are cleared. Moved to another replica, it
// resumes within its scope.
func TestScopedStream(t *testing.T) {
	ws := []uint32{0, 1, 2, 3}
	slots := map[uint32]uint32{0: 0, 1: 1, 2: 2, 3: 3}
	scopes := &ModelScopes{}
	scopes.Set([][]string{{"m1"}, {"m1", "lora-a"}, {"m2"}, {}})
	a := replicaOf()
	feed(a, ws, slots, uniform(ws, 1), uniform(ws, 6))
	srvA := NewServer(a.log, a, ServerOptions{SnapshotBatch: 3, Scopes: scopes})
	addr, stopA := serveAt(t, srvA, "127.0.0.1:0")
	m := &mirror{}
	c, done := follow(t, addr, m, "m1")
	defer done()
	eventually(t, "the scoped snapshot", func() bool { return same(m.entries(), inSlots(a, 0, 1, 3)) })
	feed(a, ws, slots, uniform(ws, 7), uniform(ws, 9))
	eventually(t, "the scoped changes", func() bool { return same(m.entries(), inSlots(a, 0, 1, 3)) })
	eventually(t, "the scoped marks", func() bool {
		ms := c.Marks()
		_, two := ms[2]
		return len(ms) == 3 && !two && ms[0].Seq == 9
	})
	// Only worker 2, out of scope, moves for a while: reads the stream does not send; then
	// worker 0's next batch covers the offsets skipped.
	feed(a, []uint32{2}, slots, uniform(ws, 10), uniform(ws, 30))
	// The log goes quiet: within a second or so an empty batch tells the proxy how far it
	// is, and its acknowledgement reaches the log's end.
	eventually(t, "the skipped reads told", func() bool { return srvA.Stats().Nodes["proxy-1"].Acked == a.log.Next() })
	feed(a, []uint32{0}, slots, uniform(ws, 10), uniform(ws, 10))
	eventually(t, "the change after the skipped reads", func() bool { return same(m.entries(), inSlots(a, 0, 1, 3)) })
	// Worker 2 now serves m1 too, worker 1 only m2: slot 2 is filled (in batches of 3) with
	// its mark, slot 1 cleared.
	scopes.Set([][]string{{"m1"}, {"m2"}, {"m2", "m1"}, {}})
	feed(a, []uint32{3}, slots, uniform(ws, 10), uniform(ws, 10))
	eventually(t, "the new scope", func() bool { return same(m.entries(), inSlots(a, 0, 2, 3)) })
	eventually(t, "worker 2's mark, none for worker 1", func() bool {
		ms := c.Marks()
		_, one := ms[1]
		return ms[2].Seq == 30 && !one
	})
	feed(a, ws, slots, map[uint32]uint64{0: 11, 1: 10, 2: 31, 3: 11}, uniform(ws, 32))
	eventually(t, "changes in the new scope", func() bool { return same(m.entries(), inSlots(a, 0, 2, 3)) })
	if st, sa := c.Stats(), srvA.Stats(); st.Nacks != 0 || sa.Snapshots != 1 {
		t.Fatalf("the scoped stream was refused or resnapshotted: client %+v, server %+v", st, sa)
	}
	// The same replica's stream breaks, and the scope changes meanwhile (worker 1 serves m1
	// again): the reconnecting stream resumes from the proxy's marks within the new scope.
	stopA()
	scopes.Set([][]string{{"m1"}, {"m1"}, {"m2", "m1"}, {}})
	feed(a, ws, slots, uniform(ws, 33), uniform(ws, 34))
	srvA2 := NewServer(a.log, a, ServerOptions{SnapshotBatch: 3, Scopes: scopes})
	stopA2 := serveWith(t, srvA2, addr)
	eventually(t, "the scope changed while away", func() bool { return same(m.entries(), inSlots(a, 0, 1, 2, 3)) })
	if st := srvA2.Stats(); st.Resumes != 1 || st.ResumedSlots != 1 || st.Snapshots != 0 {
		t.Fatalf("reconnect on the same replica: %+v, want a resume filling slot 1", st)
	}
	scopes.Set([][]string{{"m1"}, {"m2"}, {"m2", "m1"}, {}})
	feed(a, ws, slots, uniform(ws, 35), uniform(ws, 35))
	eventually(t, "slot 1 out again", func() bool { return same(m.entries(), inSlots(a, 0, 2, 3)) })
	stopA2()

	// Another replica with the same workers, further on: a resume within the scope.
	b := replicaOf()
	feed(b, []uint32{3, 2, 1, 0}, slots, uniform(ws, 1), uniform(ws, 40))
	srvB := NewServer(b.log, b, ServerOptions{Scopes: scopes})
	stopB := serveWith(t, srvB, addr)
	defer stopB()
	eventually(t, "B's index in scope", func() bool { return same(m.entries(), inSlots(b, 0, 2, 3)) })
	if st := srvB.Stats(); st.Resumes != 1 || st.Snapshots != 0 || st.ResumedSlots != 0 {
		t.Fatalf("server B: %+v, want a resume that fills nothing", st)
	}
}

// TestScopedSnapshotShared: streams of the same scope that send the same snapshot share its
// filtered encoding; another scope, or a new version of the slots' models, gets its own.
func TestScopedSnapshotShared(t *testing.T) {
	ws := []uint32{0, 1, 2}
	slots := map[uint32]uint32{0: 0, 1: 1, 2: 2}
	scopes := &ModelScopes{}
	scopes.Set([][]string{{"m1"}, {"m2"}, {"m1"}})
	a := replicaOf()
	feed(a, ws, slots, uniform(ws, 1), uniform(ws, 5))
	srv := NewServer(a.log, a, ServerOptions{Scopes: scopes, SnapshotBatch: 4})
	snap, err := srv.build()
	if err != nil {
		t.Fatal(err)
	}
	scoped := func(models ...string) ([]*encodedBatch, bool) {
		t.Helper()
		sc := newScope(models)
		sc.refresh(scopes.load())
		bs, built, err := snap.forScope(sc)
		if err != nil {
			t.Fatal(err)
		}
		return bs, built
	}
	m1, built := scoped("m1")
	if !built {
		t.Fatal("the first stream of a scope built nothing")
	}
	if again, built := scoped("m1"); built || &again[0] != &m1[0] {
		t.Fatal("a second stream of the scope built its own")
	}
	// What m1's batches hold: slots 0 and 2 only, reset first and done last.
	m := &mirror{}
	var cs []Change
	for _, b := range m1 {
		cs, _ = decode(cs[:0], b.JournalBatch)
		m.Apply(cs)
	}
	if !m1[0].Reset_ || !m1[len(m1)-1].SnapshotDone || !same(m.entries(), inSlots(a, 0, 2)) {
		t.Fatalf("m1's snapshot: %d batches, entries %v", len(m1), m.entries())
	}
	if _, built := scoped("m2"); !built {
		t.Fatal("another scope shared m1's batches")
	}
	scopes.Set([][]string{{"m1"}, {"m1"}, {"m1"}})
	if _, built := scoped("m1"); !built {
		t.Fatal("a new version of the slots' models shared the old one's batches")
	}
}
