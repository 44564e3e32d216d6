package journal

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

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
	applyTo(&s.set, cs)
	s.mu.Unlock()
	s.log.Append(cs...)
}

// applyTo applies changes to a set, as a replica does.
func applyTo(set *blockset.Set, cs []Change) {
	for _, c := range cs {
		switch c.Op {
		case Stored:
			set.Add(c.Seq, int(c.Slot), c.Tier)
		case Removed:
			set.Remove(c.Seq, int(c.Slot), c.Tier)
		case Cleared:
			set.ClearSlot(int(c.Slot))
		}
	}
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
	applyTo(&m.set, cs)
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
	return serveAt(t, NewServer(src.log, src, ServerOptions{SnapshotBatch: 7}), addr)
}

// serveAt serves srv on addr and returns the address it listens on and a func that stops it.
func serveAt(t *testing.T, srv xdsv1.IndexJournalServer, addr string) (string, func()) {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	xdsv1.RegisterIndexJournalServer(g, srv)
	go g.Serve(lis)
	return lis.Addr().String(), g.Stop
}

// follow follows addr into m, with a client scoped to models when it names any.
func follow(t *testing.T, addr string, m *mirror, models ...string) (*Client, func()) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(conn, ClientOptions{NodeID: "proxy-1", Models: models, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
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
	// MaxUnacked out of the way: its client's window could take up to it, and Send would
	// not block.
	srv := NewServer(src.log, src, ServerOptions{SendTimeout: 300 * time.Millisecond, MaxUnacked: 1 << 30})
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

// serveServer serves srv on a loopback port until the test ends.
func serveServer(t *testing.T, srv *Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	xdsv1.RegisterIndexJournalServer(g, srv)
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	return lis.Addr().String()
}

// dialWindow connects to addr with the given HTTP/2 windows (static: no BDP growth).
func dialWindow(t *testing.T, addr string, window int32) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(window), grpc.WithInitialConnWindowSize(window))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// fill appends n batches of 8192 stored blocks to src.
func fill(src *source, n int) {
	for i := range n {
		cs := make([]Change, 8192)
		for j := range cs {
			cs[j] = Change{Seq: uint64(i*8192 + j + 1), Slot: uint32(j % 4), Op: Stored}
		}
		src.apply(cs...)
	}
}

// However large a window a proxy grants, the server stops sending once MaxUnacked bytes wait
// for acks, and goes on as they come: a proxy that reads nothing holds that much in flight,
// not the whole ring (8 MB here, all of which its 1 GiB window would take).
func TestUnackedBytesAreBounded(t *testing.T) {
	src := &source{log: NewLog(1 << 20)}
	fill(src, 100)
	const maxUnacked = 64 << 10
	srv := NewServer(src.log, src, ServerOptions{MaxUnacked: maxUnacked})
	conn := dialWindow(t, serveServer(t, srv), 1<<30)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := xdsv1.NewIndexJournalClient(conn).Stream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&xdsv1.JournalAck{NodeId: "lazy", Epoch: src.log.Epoch()}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the first batches", func() bool { return srv.Stats().Changes > 0 })
	time.Sleep(500 * time.Millisecond) // the proxy reads nothing for a while
	// A change takes 9 to 11 bytes; one batch (8192) may go past the bound.
	if sent, most := srv.Stats().Changes, uint64(maxUnacked/8+8192); sent > most {
		t.Fatalf("%d changes sent unacknowledged, want at most %d", sent, most)
	}
	// Once it reads and acknowledges, the rest follows on the same stream.
	for next := uint64(0); next < src.log.Next(); {
		b, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if b.Offset != next {
			t.Fatalf("batch at %d, want %d", b.Offset, next)
		}
		next = b.Next
		if err := st.Send(&xdsv1.JournalAck{NodeId: "lazy", Epoch: b.Epoch, Next: next}); err != nil {
			t.Fatal(err)
		}
	}
}

// A stream whose proxy leaves a batch unacknowledged for AckTimeout is ended, even when its
// window takes all the server sends (Send never blocks, so SendTimeout cannot tell); a proxy
// that applies and acknowledges as it reads, snapshot included, keeps its stream.
func TestUnacknowledgingStreamIsCutOff(t *testing.T) {
	src := &source{log: NewLog(1 << 20)}
	for i := range 50 {
		src.apply(Change{Seq: uint64(i + 1), Slot: 1, Op: Stored})
	}
	srv := NewServer(src.log, src, ServerOptions{AckTimeout: 300 * time.Millisecond, SnapshotBatch: 7})
	addr := serveServer(t, srv)
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	st, err := xdsv1.NewIndexJournalClient(dialWindow(t, addr, 1<<30)).Stream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&xdsv1.JournalAck{NodeId: "mute"}); err != nil { // a snapshot, then changes
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		src.apply(Change{Seq: uint64(1000 + i), Slot: 2, Op: Stored})
		time.Sleep(10 * time.Millisecond)
	}
	eventually(t, "the mute stream cut off", func() bool {
		s := srv.Stats()
		return s.UnackedStreams == 1 && !s.Nodes["mute"].Connected
	})
	eventually(t, "the replica", func() bool { return same(m.entries(), entries(src.Each)) })
	if s := c.Stats(); s.Streams != 1 || srv.Stats().SlowStreams != 0 {
		t.Fatalf("the acknowledging proxy opened %d streams, %d cut off for not reading", s.Streams, srv.Stats().SlowStreams)
	}
}

// Streams that need a snapshot at about the same time share one copy of the index, and
// streams that take theirs slowly (they do not read) hold up no one: with MaxSnapshots 1, a
// proxy that connects after four that never read still syncs at once.
func TestSnapshotsAreShared(t *testing.T) {
	src := &source{log: NewLog(1024)}
	cs := make([]Change, 20000) // about 200 KB: more than the mute streams' windows
	for i := range cs {
		cs[i] = Change{Seq: uint64(i + 1), Slot: uint32(i % 3), Op: Stored}
	}
	src.apply(cs...)
	srv := NewServer(src.log, src, ServerOptions{SnapshotBatch: 500, MaxSnapshots: 1, SendTimeout: time.Minute})
	addr := serveServer(t, srv)
	conn := dialWindow(t, addr, 64<<10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := range 4 {
		st, err := xdsv1.NewIndexJournalClient(conn).Stream(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(&xdsv1.JournalAck{NodeId: fmt.Sprintf("mute-%d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "four snapshots under way", func() bool { return srv.Stats().Snapshots == 4 })
	m := &mirror{}
	c, done := follow(t, addr, m)
	defer done()
	eventually(t, "the late proxy's sync", c.Synced)
	if !same(m.entries(), entries(src.Each)) {
		t.Fatal("the late proxy's replica differs")
	}
	if s := srv.Stats(); s.Snapshots != 5 || s.SnapshotsBuilt != 1 {
		t.Fatalf("%d snapshots sent from %d copies of the index, want 5 from 1", s.Snapshots, s.SnapshotsBuilt)
	}
}

// The server keeps a node's state while it has a stream open, so node ids that come and go
// do not accumulate.
func TestNodesAreForgotten(t *testing.T) {
	src := &source{log: NewLog(1024)}
	src.apply(Change{Seq: 1, Op: Stored})
	srv := NewServer(src.log, src, ServerOptions{})
	conn := dialWindow(t, serveServer(t, srv), 1<<20)
	for i := range 50 {
		ctx, cancel := context.WithCancel(context.Background())
		st, err := xdsv1.NewIndexJournalClient(conn).Stream(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(&xdsv1.JournalAck{NodeId: fmt.Sprintf("n%d", i)}); err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	eventually(t, "no node left", func() bool { return len(srv.Stats().Nodes) == 0 })
}

// TestSlowSnapshotReaderIsCutOff: a proxy that takes each snapshot batch just inside the
// send timeout, but the snapshot as a whole far slower than SnapshotMinRate, is cut off.
func TestSlowSnapshotReaderIsCutOff(t *testing.T) {
	src := &source{log: NewLog(1 << 20)}
	fill(src, 50)
	srv := NewServer(src.log, src, ServerOptions{SendTimeout: 400 * time.Millisecond, MaxUnacked: 1 << 30, SnapshotMinRate: 16 << 20})
	conn := dialWindow(t, serveServer(t, srv), 64<<10)
	st, err := xdsv1.NewIndexJournalClient(conn).Stream(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&xdsv1.JournalAck{NodeId: "slow"}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var got int
	for {
		if _, err := st.Recv(); err != nil {
			if status.Code(err) != codes.ResourceExhausted {
				t.Fatalf("after %d batches: %v, want ResourceExhausted", got, err)
			}
			if testing.Verbose() {
				t.Logf("cut off after %d batches, %v: %v", got, time.Since(start), err)
			}
			break
		}
		got++
		if time.Since(start) > 30*time.Second {
			t.Fatalf("a reader taking %d batches in %v was never cut off", got, time.Since(start))
		}
		time.Sleep(250 * time.Millisecond) // inside SendTimeout each time
	}
	if srv.Stats().SlowStreams == 0 {
		t.Fatal("the slow snapshot reader was not counted")
	}
}

// The log remembers when each append's changes arrived, for its last logMarks appends, and
// answers for any offset among them; older offsets and offsets not yet written are unknown.
func TestLogArrivedAt(t *testing.T) {
	l := NewLog(1 << 16)
	if _, ok := l.ArrivedAt(0); ok {
		t.Fatal("an empty log knows an arrival")
	}
	l.AppendAt(100, Change{Seq: 1}, Change{Seq: 2}, Change{Seq: 3}) // offsets 0-2
	l.AppendAt(200, Change{Seq: 4})                                 // 3
	l.AppendAt(300, Change{Seq: 5}, Change{Seq: 6})                 // 4-5
	for off, want := range []int64{100, 100, 100, 200, 300, 300} {
		if at, ok := l.ArrivedAt(uint64(off)); !ok || at != want {
			t.Errorf("offset %d: arrived %d, %v; want %d", off, at, ok, want)
		}
	}
	if _, ok := l.ArrivedAt(6); ok {
		t.Error("an offset not yet written has an arrival")
	}
	for i := range logMarks {
		l.AppendAt(int64(1000+i), Change{Seq: uint64(10 + i)}) // offsets 6 … 6+logMarks-1
	}
	if _, ok := l.ArrivedAt(5); ok {
		t.Error("an offset older than the kept marks has an arrival")
	}
	if at, ok := l.ArrivedAt(6); ok {
		t.Errorf("offset 6 is the oldest mark's, whose start is forgotten: arrived %d", at)
	}
	if at, ok := l.ArrivedAt(7); !ok || at != 1001 {
		t.Errorf("offset 7: arrived %d, %v; want 1001", at, ok)
	}
	last := uint64(6 + logMarks - 1)
	if at, ok := l.ArrivedAt(last); !ok || at != int64(1000+logMarks-1) {
		t.Errorf("offset %d: arrived %d, %v", last, at, ok)
	}
}

// Each change batch a stream sends reports how long ago its oldest change arrived.
func TestServerReportsFreshness(t *testing.T) {
	src := &source{log: NewLog(1024)}
	var mu sync.Mutex
	var ages []time.Duration
	srv := NewServer(src.log, src, ServerOptions{Sent: func(age time.Duration) {
		mu.Lock()
		ages = append(ages, age)
		mu.Unlock()
	}})
	addr := serveServer(t, srv)
	m := &mirror{}
	c, stop := follow(t, addr, m)
	defer stop()
	eventually(t, "the first snapshot", c.Synced)
	src.set.Add(1, 0, 0)
	src.log.AppendAt(time.Now().Add(-40*time.Millisecond).UnixNano(), Change{Seq: 1, Op: Stored})
	eventually(t, "the change applied", func() bool { return len(m.entries()) == 1 })
	mu.Lock()
	defer mu.Unlock()
	if len(ages) != 1 {
		t.Fatalf("%d freshness reports for one batch (snapshots report none): %v", len(ages), ages)
	}
	if ages[0] < 40*time.Millisecond || ages[0] > 5*time.Second {
		t.Errorf("a change that arrived 40 ms before it was appended is reported %v old", ages[0])
	}
}
