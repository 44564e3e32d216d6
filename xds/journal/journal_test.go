package journal

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// source is a control plane's side in miniature: a set and a log changed together.
type source struct {
	mu  sync.Mutex
	set blockset.Set
	log *Log
}

func (s *source) Each(fn func(uint64, int, blockset.Tier)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.set.Each(fn)
}

func (s *source) apply(cs ...Change) {
	s.mu.Lock()
	for _, c := range cs {
		switch c.Op {
		case Stored:
			s.set.Add(c.Seq, int(c.Slot), c.Tier)
		case Removed:
			s.set.Remove(c.Seq, int(c.Slot), c.Tier)
		case Cleared:
			s.set.ClearSlot(int(c.Slot), nil)
		}
	}
	s.mu.Unlock()
	s.log.Append(cs...)
}

// mirror is a Sink that keeps a set, for comparison.
type mirror struct {
	mu     sync.Mutex
	set    blockset.Set
	resets int
}

func (m *mirror) Reset() { m.mu.Lock(); m.set = blockset.Set{}; m.resets++; m.mu.Unlock() }
func (m *mirror) Apply(cs []Change) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, c := range cs {
		switch c.Op {
		case Stored:
			m.set.Add(c.Seq, int(c.Slot), c.Tier)
		case Removed:
			m.set.Remove(c.Seq, int(c.Slot), c.Tier)
		case Cleared:
			m.set.ClearSlot(int(c.Slot), nil)
		}
	}
}

func entries(each func(func(uint64, int, blockset.Tier))) map[[3]uint64]bool {
	out := map[[3]uint64]bool{}
	each(func(seq uint64, slot int, t blockset.Tier) { out[[3]uint64{seq, uint64(slot), uint64(t)}] = true })
	return out
}

func (m *mirror) entries() map[[3]uint64]bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return entries(m.set.Each)
}

// serve starts a gRPC server for src on addr ("127.0.0.1:0" for a free port).
func serve(t *testing.T, src *source, addr string) (string, func()) {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	xdsv1.RegisterIndexJournalServer(g, NewServer(src.log, src, ServerOptions{SnapshotBatch: 7}))
	go g.Serve(lis)
	return lis.Addr().String(), g.Stop
}

func follow(t *testing.T, addr string, m *mirror) (*Client, func()) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(conn, ClientOptions{NodeID: "proxy-1", MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { c.Run(ctx, m); close(done) }()
	return c, func() { cancel(); <-done; conn.Close() }
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func same(a, b map[[3]uint64]bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if !b[k] {
			return false
		}
	}
	return true
}

func TestSnapshotThenChangesInOrder(t *testing.T) {
	src := &source{log: NewLog(1024)}
	for i := range 20 {
		src.apply(Change{Seq: uint64(100 + i), Slot: uint32(i % 3), Op: Stored})
	}
	addr, stop := serve(t, src, "127.0.0.1:0")
	defer stop()
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	eventually(t, "the snapshot", func() bool { return same(m.entries(), entries(src.Each)) })
	// Mixed changes, including a store and removal of the same entry and a cleared slot.
	src.apply(
		Change{Seq: 500, Slot: 1, Tier: blockset.Host, Op: Stored},
		Change{Seq: 100, Slot: 0, Op: Removed},
		Change{Seq: 501, Slot: 2, Op: Stored},
		Change{Seq: 501, Slot: 2, Op: Removed},
		Change{Slot: 1, Op: Cleared},
		Change{Seq: 502, Slot: 1, Tier: blockset.Disk, Op: Stored},
	)
	eventually(t, "the changes", func() bool { return same(m.entries(), entries(src.Each)) })
	if !c.Synced() || m.resets != 1 {
		t.Fatalf("synced %v after %d resets", c.Synced(), m.resets)
	}
}

func TestResumeAfterReconnectWithoutSnapshot(t *testing.T) {
	src := &source{log: NewLog(1024)}
	src.apply(Change{Seq: 1, Op: Stored})
	addr, stop := serve(t, src, "127.0.0.1:0")
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	eventually(t, "sync", c.Synced)
	stop() // the control plane's gRPC server goes away (its log lives on)
	src.apply(Change{Seq: 2, Op: Stored})
	// While it is down, the replica keeps its state.
	if !m.entries()[[3]uint64{1, 0, 0}] {
		t.Fatal("the replica lost its state when the stream broke")
	}
	_, stop2 := serve(t, src, addr)
	defer stop2()
	eventually(t, "the resumed change", func() bool { return same(m.entries(), entries(src.Each)) })
	if m.resets != 1 {
		t.Fatalf("resuming within the ring should not snapshot again: %d resets", m.resets)
	}
}

func TestNewEpochOrLaggingReplicaSnapshots(t *testing.T) {
	src := &source{log: NewLog(4)}
	addr, stop := serve(t, src, "127.0.0.1:0")
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	eventually(t, "sync", c.Synced)
	stop()
	for i := range 10 { // more than the ring holds
		src.apply(Change{Seq: uint64(i + 1), Op: Stored})
	}
	_, stop2 := serve(t, src, addr)
	eventually(t, "catch-up by snapshot", func() bool { return same(m.entries(), entries(src.Each)) })
	stop2()
	if m.resets != 2 {
		t.Fatalf("a replica behind the ring must get a snapshot: %d resets", m.resets)
	}
	// A restarted control plane: a new log (new epoch) with different contents.
	src2 := &source{log: NewLog(1024)}
	src2.apply(Change{Seq: 77, Slot: 5, Op: Stored})
	_, stop3 := serve(t, src2, addr)
	defer stop3()
	eventually(t, "the new control plane's state", func() bool { return same(m.entries(), entries(src2.Each)) })
}

// badServer answers with a change the client cannot read, then with a snapshot once NACKed.
type badServer struct {
	xdsv1.UnimplementedIndexJournalServer
	nacks chan string
}

func (b *badServer) Stream(st xdsv1.IndexJournal_StreamServer) error {
	if _, err := st.Recv(); err != nil {
		return err
	}
	st.Send(&xdsv1.JournalBatch{Epoch: 9, Reset_: true, SnapshotDone: true, Next: 0})
	st.Send(&xdsv1.JournalBatch{Epoch: 9, Offset: 0, Next: 1, Seq: []uint64{5}, At: []uint32{3}}) // op 3: unknown
	for {
		a, err := st.Recv()
		if err != nil {
			return err
		}
		if a.NackReason != "" {
			b.nacks <- a.NackReason
			st.Send(&xdsv1.JournalBatch{Epoch: 9, Reset_: true, SnapshotDone: true, Next: 1, Seq: []uint64{6}, At: []uint32{0}})
		}
	}
}

func TestUnreadableBatchIsNacked(t *testing.T) {
	lis, _ := net.Listen("tcp", "127.0.0.1:0")
	g := grpc.NewServer()
	bs := &badServer{nacks: make(chan string, 4)}
	xdsv1.RegisterIndexJournalServer(g, bs)
	go g.Serve(lis)
	defer g.Stop()
	m := &mirror{}
	c, done := follow(t, lis.Addr().String(), m)
	defer done()
	select {
	case reason := <-bs.nacks:
		if reason == "" {
			t.Fatal("empty nack")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no NACK")
	}
	eventually(t, "the resync", func() bool { return m.entries()[[3]uint64{6, 0, 0}] })
	if c.Stats().Nacks != 1 {
		t.Fatalf("nacks %d", c.Stats().Nacks)
	}
}

// A proxy that opens a journal stream and never reads it is cut off once the server has
// waited SendTimeout to send it anything (its flow-control window full), instead of holding
// the server's memory for as long as it stays connected.
func TestNonReadingStreamIsCutOff(t *testing.T) {
	src := &source{log: NewLog(1 << 20)}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(src.log, src, ServerOptions{SendTimeout: 300 * time.Millisecond})
	g := grpc.NewServer()
	xdsv1.RegisterIndexJournalServer(g, srv)
	go g.Serve(lis)
	defer g.Stop()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, err := xdsv1.NewIndexJournalClient(conn).Stream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&xdsv1.JournalAck{NodeId: "mute", Epoch: src.log.Epoch()}); err != nil {
		t.Fatal(err)
	}
	// Far more changes than the flow-control windows between the two hold.
	for i := range 200 {
		cs := make([]Change, 4096)
		for j := range cs {
			cs[j] = Change{Seq: uint64(i*4096 + j + 1), Slot: 1, Op: Stored}
		}
		src.apply(cs...)
	}
	eventually(t, "the mute stream cut off", func() bool {
		s := srv.Stats()
		return s.SlowStreams > 0 && !s.Nodes["mute"].Connected
	})
}
