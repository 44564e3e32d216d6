package journal

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
)

// ServerOptions tune a Server; zero values mean the defaults.
type ServerOptions struct {
	// MaxBatch bounds the changes in one message (default 8192).
	MaxBatch int
	// Linger is how long the server waits for more changes before sending a batch that is
	// not full (default 2 ms): it trades a little freshness for far fewer messages under
	// heavy event rates.
	Linger time.Duration
	// SnapshotBatch bounds the entries in one snapshot message (default 65536).
	SnapshotBatch int
	// Ready, when set, holds every stream until it is closed: a control plane that just
	// started closes it once its index has caught up with the engines (replay), so that
	// proxies resyncing after a restart are not sent a snapshot of an index still empty.
	Ready <-chan struct{}
	// Scopes, when set, gives the models of each slot's worker, so that a proxy that names
	// the models it routes gets their workers' blocks only (scope.go). Without it such a
	// proxy gets every block.
	Scopes *ModelScopes
	// SendTimeout ends a stream whose proxy has not taken a message for this long (its
	// flow-control window full: it does not read); it reconnects and gets a snapshot
	// (default 30 s).
	SendTimeout time.Duration
	// MaxSnapshots bounds the snapshots held at once (default 4), each a copy of the whole
	// index. A snapshot is built once and shared by every stream that needs one while fewer
	// than SnapshotBatch changes have followed it, so proxies resyncing together (a control
	// plane restart) cost one copy, and streams that do not read cannot queue the others
	// behind them.
	MaxSnapshots int
	// MaxUnacked bounds the bytes a stream may have sent that its proxy has not yet
	// acknowledged (default DefaultMaxUnacked): past it the server sends nothing more until
	// acks come. However large the HTTP/2 windows a proxy grants, what sits in buffers between
	// the two (the server's, the kernels', the proxy's) stays within MaxUnacked plus a
	// snapshot. A snapshot counts once sent: changes follow once the proxy has acknowledged
	// enough of it.
	MaxUnacked int
	// SnapshotMinRate is the slowest a proxy may take a snapshot, in bytes per second
	// (default DefaultSnapshotMinRate): one sent slower than that, SendTimeout beyond its
	// size at this rate, is ended, so that a proxy taking one batch just inside every
	// SendTimeout cannot hold a snapshot (and its place among MaxSnapshots) for hours.
	SnapshotMinRate int
	// AckTimeout ends a stream whose proxy has left a batch unacknowledged for this long
	// (default 30 s): it does not read, or reads without applying. It reconnects and resumes,
	// or gets a snapshot.
	AckTimeout time.Duration
	// Sent, when set, hears for each batch of changes a stream has sent how long ago its
	// oldest change arrived at the control plane (Log.AppendAt), once the proxy's connection
	// has taken it: the journal's freshness, event to every proxy's stream. Called from the
	// streams' goroutines; it must not block.
	Sent func(age time.Duration)
}

// DefaultSnapshotMinRate is ServerOptions.SnapshotMinRate's default: 1 MiB/s, a
// hundredth of what a proxy on the same network takes.
const DefaultSnapshotMinRate = 1 << 20

// DefaultMaxUnacked is ServerOptions.MaxUnacked's default: about 400,000 changes, seconds
// of the heaviest event rates, where a proxy that applies as it reads has a few batches in
// flight.
const DefaultMaxUnacked = 4 << 20

// Server streams a Log to proxies: the IndexJournal service. It is safe for concurrent use;
// each stream runs on its own gRPC goroutine plus one that reads the proxy's acks.
type Server struct {
	xdsv1.UnimplementedIndexJournalServer
	log  *Log
	snap Snapshotter
	opts ServerOptions

	mu    sync.Mutex
	nodes map[string]*NodeState

	// snapMu guards the snapshots: cur, the newest (shared while fresh), how many are held
	// (alive, with the one being built), and snapWake, closed and replaced when one is built
	// or let go.
	snapMu   sync.Mutex
	cur      *snapshot
	alive    int
	building bool
	snapWake chan struct{}

	snapshots, built, batches, changes atomic.Uint64
	resumes, resumedSlots              atomic.Uint64
	scopedBuilt                        atomic.Uint64
	slow                               atomic.Uint64 // streams ended for not reading
	unacked                            atomic.Uint64 // streams ended for not acknowledging
}

// NodeState is what the server knows of one subscribed proxy, kept while it has a stream
// open.
type NodeState struct {
	// Sent and Acked are the offsets after the last change sent and acknowledged.
	Sent, Acked uint64
	Nacks       uint64
	Connected   bool

	streams int
}

// NewServer serves log, taking snapshots from snap.
func NewServer(log *Log, snap Snapshotter, opts ServerOptions) *Server {
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 8192
	}
	if opts.Linger <= 0 {
		opts.Linger = 2 * time.Millisecond
	}
	if opts.SnapshotBatch <= 0 {
		opts.SnapshotBatch = 65536
	}
	if opts.SendTimeout <= 0 {
		opts.SendTimeout = 30 * time.Second
	}
	if opts.SnapshotMinRate <= 0 {
		opts.SnapshotMinRate = DefaultSnapshotMinRate
	}
	if opts.MaxSnapshots <= 0 {
		opts.MaxSnapshots = 4
	}
	if opts.MaxUnacked <= 0 {
		opts.MaxUnacked = DefaultMaxUnacked
	}
	if opts.AckTimeout <= 0 {
		opts.AckTimeout = 30 * time.Second
	}
	return &Server{log: log, snap: snap, opts: opts, nodes: map[string]*NodeState{}, snapWake: make(chan struct{})}
}

// Stats are the server's counters.
type Stats struct {
	// Snapshots counts snapshots sent, SnapshotsBuilt the copies of the index taken for
	// them.
	Snapshots, SnapshotsBuilt, Batches, Changes uint64
	// Resumes counts streams of proxies from another epoch (another replica) that went on
	// from their marks instead of a snapshot; ResumedSlots the slots such resumes cleared and
	// filled again from the index.
	Resumes, ResumedSlots uint64
	// ScopedSnapshotsBuilt counts the snapshots filtered and encoded for a scope (shared
	// by the streams of that scope that send the same snapshot).
	ScopedSnapshotsBuilt uint64
	// SlowStreams counts streams ended because their proxy took nothing for SendTimeout;
	// UnackedStreams those ended because it left a batch unacknowledged for AckTimeout.
	SlowStreams, UnackedStreams uint64
	// Nodes holds the state of each node with a stream open.
	Nodes map[string]NodeState
}

// Stats returns the counters and every connected node's state.
func (s *Server) Stats() Stats {
	st := Stats{
		Snapshots: s.snapshots.Load(), SnapshotsBuilt: s.built.Load(), Batches: s.batches.Load(), Changes: s.changes.Load(),
		Resumes: s.resumes.Load(), ResumedSlots: s.resumedSlots.Load(), ScopedSnapshotsBuilt: s.scopedBuilt.Load(),
		SlowStreams: s.slow.Load(), UnackedStreams: s.unacked.Load(), Nodes: map[string]NodeState{},
	}
	s.mu.Lock()
	for id, n := range s.nodes {
		st.Nodes[id] = *n
	}
	s.mu.Unlock()
	return st
}

// connect returns the state of node id, counting one more stream of it.
func (s *Server) connect(id string) *NodeState {
	s.mu.Lock()
	defer s.mu.Unlock()
	n, ok := s.nodes[id]
	if !ok {
		n = &NodeState{}
		s.nodes[id] = n
	}
	n.streams++
	n.Connected = true
	return n
}

// disconnect counts one stream of node id less, forgetting the node after its last: node ids
// that come and go do not accumulate.
func (s *Server) disconnect(id string, n *NodeState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n.streams--; n.streams <= 0 {
		delete(s.nodes, id)
	}
}

func (s *Server) update(n *NodeState, f func(*NodeState)) {
	s.mu.Lock()
	f(n)
	s.mu.Unlock()
}

// Stream implements xdsv1.IndexJournalServer.
func (s *Server) Stream(stream xdsv1.IndexJournal_StreamServer) error {
	ctx := stream.Context()
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	if first.NodeId == "" {
		return status.Error(codes.InvalidArgument, "journal stream: the first message must carry a node id")
	}
	if s.opts.Ready != nil {
		select {
		case <-s.opts.Ready:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	n := s.connect(first.NodeId)
	defer s.disconnect(first.NodeId, n)
	var sc *scope
	if s.opts.Scopes != nil {
		sc = newScope(first.Models)
		sc.refresh(s.opts.Scopes.load())
	}

	out := newSender(stream)
	defer out.close()
	w := newWindow()
	resync := make(chan struct{}, 1)
	ackErr := make(chan error, 1)
	go func() {
		for {
			a, err := stream.Recv()
			if err != nil {
				ackErr <- err
				return
			}
			if a.NackReason != "" {
				s.update(n, func(n *NodeState) { n.Nacks++ })
				select {
				case resync <- struct{}{}:
				default:
				}
				continue
			}
			w.ack()
			s.update(n, func(n *NodeState) { n.Acked = a.Next })
		}
	}()

	next := first.Next
	if first.Epoch != s.log.Epoch() || !s.inRing(next) || sc != nil {
		resumed := false
		if first.Epoch != s.log.Epoch() || sc != nil {
			if next, resumed, err = s.sendResume(out, w, first, sc); err != nil {
				return err
			}
		}
		if !resumed {
			if next, err = s.sendSnapshot(out, w, sc); err != nil {
				return err
			}
		}
	}
	var buf []Change // grows to the batches this stream sends, at most MaxBatch
	var marks []Mark
	// A scoped stream sends nothing for a read that holds none of its slots' changes or
	// marks, for up to scopedIdle: its next batch then starts where the last one sent ended
	// (batchFrom), covering the offsets skipped.
	batchFrom, lastSend := next, time.Now()
	quiet := time.NewTimer(time.Hour)
	defer quiet.Stop()
	deadline := time.NewTimer(time.Hour)
	defer deadline.Stop()
	linger := time.NewTimer(time.Hour)
	defer linger.Stop()
	for {
		// Wait for changes, or, with MaxUnacked outstanding, for acks; either way for no
		// longer than AckTimeout after the oldest batch the proxy has not acknowledged.
		unacked, oldest, waiting := w.state()
		var overdue <-chan time.Time
		if waiting {
			deadline.Reset(time.Until(oldest.Add(s.opts.AckTimeout)))
			overdue = deadline.C
		}
		var changes, acked <-chan struct{}
		if unacked < uint64(s.opts.MaxUnacked) {
			changes = s.log.Wait(next)
		} else {
			acked = w.acked
		}
		// Reads a scoped stream skipped are told to the proxy within scopedIdle, even if
		// the log goes quiet: its position stays within the ring, and its acks current.
		var flush <-chan time.Time
		if batchFrom < next {
			quiet.Reset(time.Until(lastSend.Add(scopedIdle)))
			flush = quiet.C
		}
		select {
		case <-flush:
			if err := s.sendAcked(out, w, &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: batchFrom, Next: next}); err != nil {
				return err
			}
			batchFrom, lastSend = next, time.Now()
			s.update(n, func(n *NodeState) { n.Sent = next })
			continue
		case <-ctx.Done():
			return nil
		case <-ackErr:
			return nil // the proxy closed its side (or the stream broke): it is over
		case <-resync:
			w.reset() // a proxy that NACKed acknowledges nothing until the next snapshot
			if next, err = s.sendSnapshot(out, w, sc); err != nil {
				return err
			}
			batchFrom = next
			continue
		case <-acked:
			continue
		case <-overdue:
			if _, oldest, waiting := w.state(); waiting && time.Since(oldest) >= s.opts.AckTimeout {
				s.unacked.Add(1)
				return status.Errorf(codes.ResourceExhausted, "journal stream: the proxy acknowledged nothing for %v", s.opts.AckTimeout)
			}
			continue // acks came meanwhile
		case <-changes:
		}
		// Let a burst accumulate into one message, unless it is already full.
		if s.log.Next()-next < uint64(s.opts.MaxBatch) {
			linger.Reset(s.opts.Linger)
			select {
			case <-linger.C:
			case <-ctx.Done():
				return nil
			}
		}
		var ok bool
		var to uint64
		buf, to, ok = s.log.Read(buf[:0], next, s.opts.MaxBatch)
		if !ok {
			if next, err = s.sendSnapshot(out, w, sc); err != nil {
				return err
			}
			batchFrom = next
			continue
		}
		if len(buf) == 0 {
			continue
		}
		if sc != nil {
			if err := s.rescope(out, w, sc, batchFrom); err != nil {
				return err
			}
		}
		buf = sc.filter(buf)
		marks = sc.filterMarks(s.log.Checkpoints(marks[:0], next, to))
		if len(buf) == 0 && len(marks) == 0 && time.Since(lastSend) < scopedIdle {
			next = to
			continue
		}
		b := &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: batchFrom, Next: to}
		appendChanges(b, buf)
		batchColumns(b).put(marks...)
		if err := s.sendAcked(out, w, b); err != nil {
			return err
		}
		if s.opts.Sent != nil {
			if at, ok := s.log.ArrivedAt(next); ok {
				s.opts.Sent(time.Duration(time.Now().UnixNano() - at))
			}
		}
		next, batchFrom, lastSend = to, to, time.Now()
		s.batches.Add(1)
		s.changes.Add(uint64(len(buf)))
		s.update(n, func(n *NodeState) { n.Sent = to })
	}
}

// scopedIdle is how long a scoped stream may send nothing while the log moves on outside
// its scope: then an empty batch tells the proxy how far the log is, so that a reconnect
// resumes within the ring.
const scopedIdle = time.Second

// rescope brings a scoped stream's scope up to the control plane's latest slot models: at
// the stream's offset, batches (of SnapshotBatch changes at most) clear the slots that left
// it, and clear and fill again from the index those that entered (their earlier changes were
// not sent); a last batch without changes gives the entered slots their marks (read before
// the index: the refill is as new, or newer) and the slots that left none. The changes that
// follow replay onto the refill.
func (s *Server) rescope(out *sender, w *window, sc *scope, at uint64) error {
	entered, left := sc.refresh(s.opts.Scopes.load())
	if len(entered) == 0 && len(left) == 0 {
		return nil
	}
	marks := s.log.MarksOf(entered)
	for _, slot := range left {
		marks = append(marks, Mark{Slot: slot})
	}
	marked := &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: at, Next: at}
	batchColumns(marked).put(marks...)
	for _, b := range append(s.refillBatches(at, s.refill(left, entered)), marked) {
		if err := s.sendAcked(out, w, b); err != nil {
			return err
		}
	}
	return nil
}

// sendAcked sends a batch its proxy acknowledges, counted in the stream's window before it
// goes (the ack may come before Send returns).
func (s *Server) sendAcked(out *sender, w *window, b *xdsv1.JournalBatch) error {
	w.push(proto.Size(b), true)
	if err := s.send(out, b); err != nil {
		return err
	}
	w.sent()
	return nil
}

// refillBatches puts changes that apply at offset at (slots cleared and filled again) into
// batches of SnapshotBatch changes at most, at least one.
func (s *Server) refillBatches(at uint64, cs []Change) []*xdsv1.JournalBatch {
	var bs []*xdsv1.JournalBatch
	for i := 0; i == 0 || i < len(cs); i += s.opts.SnapshotBatch {
		b := &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: at, Next: at}
		appendChanges(b, cs[i:min(i+s.opts.SnapshotBatch, len(cs))])
		bs = append(bs, b)
	}
	return bs
}

// refill lists the clears of the slots of clear, then, for each slot of slots, its clear and
// its entries in the index: each slot is empty only while its own entries follow. Without a
// SlotSnapshotter it lists the clears.
func (s *Server) refill(clear, slots []uint32) []Change {
	var cs []Change
	for _, slot := range clear {
		cs = append(cs, Change{Slot: slot, Op: Cleared})
	}
	if len(slots) == 0 {
		return cs
	}
	ints := make([]int, len(slots))
	for i, slot := range slots {
		ints[i] = int(slot)
	}
	bySlot := make(map[uint32][]Change, len(slots))
	n := 0
	if ss, ok := s.snap.(SlotSnapshotter); ok {
		ss.EachSlots(ints, func(seq uint64, slot int, tier blockset.Tier) {
			bySlot[uint32(slot)] = append(bySlot[uint32(slot)], Change{Seq: seq, Slot: uint32(slot), Tier: tier, Op: Stored})
			n++
		})
	}
	cs = slices.Grow(cs, len(slots)+n)
	for _, slot := range slots {
		cs = append(cs, Change{Slot: slot, Op: Cleared})
		cs = append(cs, bySlot[slot]...)
	}
	return cs
}

// window is one stream's acknowledgement accounting. The proxy acknowledges every change
// batch and the last batch of each snapshot, in order; these are the points, and each ack
// pops the oldest one. The Stream goroutine pushes, the ack goroutine pops.
type window struct {
	mu     sync.Mutex
	total  uint64  // bytes sent (or being sent) on the stream
	done   uint64  // bytes up to the last acknowledged point
	points []point // not yet acknowledged, oldest first
	// acked is signalled (a buffer of one, so signals coalesce) after each ack.
	acked chan struct{}
}

type point struct {
	end uint64    // total at this point
	at  time.Time // when its batch was sent
}

func newWindow() *window { return &window{acked: make(chan struct{}, 1)} }

// push counts a batch of n bytes about to be sent; acked says the proxy acknowledges it.
func (w *window) push(n int, acked bool) {
	w.mu.Lock()
	w.total += uint64(n)
	if acked {
		w.points = append(w.points, point{end: w.total, at: time.Now()})
	}
	w.mu.Unlock()
}

// sent dates the newest point, if not yet acknowledged, from now: its Send has returned.
func (w *window) sent() {
	w.mu.Lock()
	if len(w.points) > 0 && w.points[len(w.points)-1].end == w.total {
		w.points[len(w.points)-1].at = time.Now()
	}
	w.mu.Unlock()
}

// ack pops the oldest point; an ack for nothing is ignored.
func (w *window) ack() {
	w.mu.Lock()
	if len(w.points) > 0 {
		w.done = w.points[0].end
		w.points = w.points[1:]
	}
	w.mu.Unlock()
	select {
	case w.acked <- struct{}{}:
	default:
	}
}

// reset forgets the points: the proxy will not acknowledge them.
func (w *window) reset() {
	w.mu.Lock()
	w.done = w.total
	w.points = nil
	w.mu.Unlock()
}

// state returns the bytes not yet acknowledged and, if a point is waiting, when the oldest
// was sent.
func (w *window) state() (unacked uint64, oldest time.Time, waiting bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.points) == 0 {
		return w.total - w.done, time.Time{}, false
	}
	return w.total - w.done, w.points[0].at, true
}

// sender sends a stream's messages on a goroutine of its own, one for the life of the
// stream, so that a send can be given up on without starting a goroutine per message.
type sender struct {
	stream xdsv1.IndexJournal_StreamServer
	in     chan any
	done   chan error
}

func newSender(stream xdsv1.IndexJournal_StreamServer) *sender {
	sd := &sender{stream: stream, in: make(chan any), done: make(chan error, 1)}
	go func() {
		for b := range sd.in {
			sd.done <- stream.SendMsg(b)
		}
	}()
	return sd
}

// close ends the goroutine once its send in progress, if any, returns (the stream's end
// releases it).
func (sd *sender) close() { close(sd.in) }

// send sends b (a *xdsv1.JournalBatch, or a snapshot's *encodedBatch), or gives up with
// ResourceExhausted once the proxy has taken nothing for SendTimeout: returning from the
// handler then ends the stream, which releases the send. After it gives up, out takes no
// more messages.
func (s *Server) send(out *sender, b any) error {
	out.in <- b
	t := time.NewTimer(s.opts.SendTimeout)
	defer t.Stop()
	select {
	case err := <-out.done:
		return err
	case <-t.C:
		s.slow.Add(1)
		return status.Errorf(codes.ResourceExhausted, "journal stream: the proxy took nothing for %v", s.opts.SendTimeout)
	}
}

func (s *Server) inRing(off uint64) bool {
	_, _, ok := s.log.Read(nil, off, 0)
	return ok
}

// snapshot is the whole index as of offset next, in batches (reset on the first, done on
// the last) that every stream sending it shares and none modifies.
type snapshot struct {
	next    uint64
	batches []*encodedBatch
	refs    int // streams sending it, under Server.snapMu

	// scoped are its batches for each scope (its models and the slot models' version),
	// filtered and encoded once for every stream of that scope that sends it (under mu).
	mu     sync.Mutex
	scoped map[scopeKey][]*encodedBatch
}

type scopeKey struct {
	models string
	table  *modelTable
}

// forScope returns the snapshot's batches for scope sc: the entries and marks of its slots,
// the first and last batch always there (reset, done), built and encoded on the first call
// for that scope and shared by the streams that follow.
func (snap *snapshot) forScope(sc *scope) (bs []*encodedBatch, built bool, err error) {
	k := scopeKey{sc.key, sc.table}
	snap.mu.Lock()
	defer snap.mu.Unlock()
	if bs, ok := snap.scoped[k]; ok {
		return bs, false, nil
	}
	var out []*encodedBatch
	var cs []Change
	var ms []Mark
	for i, b := range snap.batches {
		cs, _ = decode(cs[:0], b.JournalBatch)
		cs = sc.filter(cs)
		ms, _ = batchColumns(b.JournalBatch).read(ms[:0])
		ms = sc.filterMarks(ms)
		if len(cs) == 0 && len(ms) == 0 && !b.Reset_ && i != len(snap.batches)-1 {
			continue
		}
		sb := &xdsv1.JournalBatch{Epoch: b.Epoch, Offset: b.Offset, Next: b.Next, Reset_: b.Reset_, SnapshotDone: b.SnapshotDone}
		appendChanges(sb, cs)
		batchColumns(sb).put(ms...)
		raw, err := proto.Marshal(sb)
		if err != nil {
			return nil, false, fmt.Errorf("encoding a scoped index snapshot: %w", err)
		}
		out = append(out, &encodedBatch{JournalBatch: sb, raw: raw})
	}
	if snap.scoped == nil {
		snap.scoped = map[scopeKey][]*encodedBatch{}
	}
	snap.scoped[k] = out
	return out, true, nil
}

// encodedBatch is a snapshot batch with its encoding. A gRPC codec that honours EncodedProto
// (the xDS port's, xds/server.Encoded) sends those bytes to every stream as they are; any
// other marshals the batch.
type encodedBatch struct {
	*xdsv1.JournalBatch
	raw []byte
}

// EncodedProto returns the batch's protobuf encoding.
func (b *encodedBatch) EncodedProto() []byte { return b.raw }

// sendSnapshot sends a snapshot and returns the offset the stream continues from.
// A scoped stream (sc not nil) sends the entries and marks of its slots only, filtered and
// encoded once per scope (snapshot.forScope).
func (s *Server) sendSnapshot(out *sender, w *window, sc *scope) (uint64, error) {
	snap, err := s.acquireSnapshot(out.stream.Context())
	if err != nil {
		return 0, err
	}
	defer s.releaseSnapshot(snap)
	s.snapshots.Add(1)
	batches := snap.batches
	if sc != nil {
		sc.refresh(s.opts.Scopes.load())
		built := false
		if batches, built, err = snap.forScope(sc); err != nil {
			return snap.next, err
		}
		if built {
			s.scopedBuilt.Add(1)
		}
	}
	size := 0
	for _, b := range batches {
		size += len(b.raw)
	}
	deadline := time.Now().Add(s.opts.SendTimeout + time.Duration(float64(size)/float64(s.opts.SnapshotMinRate)*float64(time.Second)))
	for i, b := range batches {
		if time.Now().After(deadline) {
			s.slow.Add(1)
			return snap.next, status.Errorf(codes.ResourceExhausted, "journal stream: the proxy took the %d-byte snapshot slower than %d bytes/s", size, s.opts.SnapshotMinRate)
		}
		w.push(len(b.raw), i == len(batches)-1)
		if err := s.send(out, b); err != nil {
			return snap.next, fmt.Errorf("sending index snapshot: %w", err)
		}
	}
	w.sent()
	return snap.next, nil
}

// acquireSnapshot returns a snapshot to send, counted in its refs: the newest if fewer than
// SnapshotBatch changes have followed it (replaying them costs less than one more snapshot
// message), else a new one once fewer than MaxSnapshots are held, else the newest if the
// ring still holds its offset (more to replay, but correct), else it waits for one to be
// let go.
func (s *Server) acquireSnapshot(ctx context.Context) (*snapshot, error) {
	for {
		s.snapMu.Lock()
		cur := s.cur
		fresh := cur != nil && s.inRing(cur.next) && s.log.Next()-cur.next <= uint64(s.opts.SnapshotBatch)
		switch {
		case fresh, !s.building && s.alive >= s.opts.MaxSnapshots && cur != nil && s.inRing(cur.next):
			cur.refs++
			s.snapMu.Unlock()
			return cur, nil
		case !s.building && s.alive < s.opts.MaxSnapshots:
			s.building = true
			s.alive++
			s.snapMu.Unlock()
			snap, err := s.build()
			s.snapMu.Lock()
			s.building = false
			if err != nil {
				s.alive--
			} else {
				snap.refs = 1
				s.cur = snap
			}
			s.wakeLocked()
			s.snapMu.Unlock()
			return snap, err
		}
		wake := s.snapWake // a build under way, or MaxSnapshots held
		s.snapMu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// releaseSnapshot lets go of snap; the last stream to let go frees it.
func (s *Server) releaseSnapshot(snap *snapshot) {
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	if snap.refs--; snap.refs > 0 {
		return
	}
	s.alive--
	if s.cur == snap {
		s.cur = nil
	}
	s.wakeLocked()
}

func (s *Server) wakeLocked() {
	close(s.snapWake)
	s.snapWake = make(chan struct{})
}

// SlotSnapshotter lists the entries of some slots only. A Snapshotter that implements it
// lets the server resume proxies that come from another replica (Log.Resume).
type SlotSnapshotter interface {
	EachSlots(slots []int, fn func(seq uint64, slot int, tier blockset.Tier))
}

// sendResume resumes a stream whose proxy comes from another epoch at the marks it sent:
// the slots Log.Resume could not place are cleared and filled again from the index, in
// batches marked resume (the last also snapshot_done), and the stream goes on from the
// offset it returns. resumed is false, with nothing sent, when the proxy sent no marks or
// needs a snapshot.
func (s *Server) sendResume(out *sender, w *window, first *xdsv1.JournalAck, sc *scope) (next uint64, resumed bool, err error) {
	if _, ok := s.snap.(SlotSnapshotter); !ok {
		return 0, false, nil
	}
	theirs, ok := ackColumns(first).read(nil)
	if !ok || len(theirs) == 0 {
		return 0, false, nil
	}
	from, reset, ok := s.log.Resume(theirs, sc.in)
	if !ok {
		return 0, false, nil
	}
	if first.Epoch == s.log.Epoch() && first.Next < from && s.inRing(first.Next) {
		// The same log (a scoped stream reconnecting): the proxy stands at first.Next,
		// which may be before the marks it holds say.
		from = first.Next
	}
	// Slots out of the stream's scope are only cleared, with no mark (Log.Resume names them
	// when the proxy holds a mark there).
	var fill, clear []uint32
	for i, m := range reset {
		if sc.in(m.Slot) {
			fill = append(fill, m.Slot)
		} else {
			clear = append(clear, m.Slot)
			reset[i] = Mark{Slot: m.Slot}
		}
	}
	bs := s.refillBatches(from, s.refill(clear, fill))
	batchColumns(bs[0]).put(reset...)
	bs[len(bs)-1].SnapshotDone = true
	for _, b := range bs {
		b.Resume = true
		if err := s.sendAcked(out, w, b); err != nil {
			return from, false, fmt.Errorf("resuming the index journal: %w", err)
		}
	}
	s.resumes.Add(1)
	s.resumedSlots.Add(uint64(len(fill)))
	return from, true, nil
}

// build copies the index into snapshot batches of SnapshotBatch entries and encodes them.
// The first carries every worker's mark as of the offset the snapshot starts from.
func (s *Server) build() (*snapshot, error) {
	next, marks := s.log.Positions()
	var bs []*xdsv1.JournalBatch
	var b *xdsv1.JournalBatch
	s.snap.Each(func(seq uint64, slot int, tier blockset.Tier) {
		if b == nil || len(b.Seq) == s.opts.SnapshotBatch {
			b = &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: next, Next: next}
			bs = append(bs, b)
		}
		b.Seq = append(b.Seq, seq)
		b.At = append(b.At, pack(Change{Seq: seq, Slot: uint32(slot), Tier: tier, Op: Stored}))
	})
	if len(bs) == 0 {
		bs = append(bs, &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: next, Next: next})
	}
	bs[0].Reset_ = true
	batchColumns(bs[0]).put(marks...)
	bs[len(bs)-1].SnapshotDone = true
	snap := &snapshot{next: next, batches: make([]*encodedBatch, len(bs))}
	for i, b := range bs {
		raw, err := proto.Marshal(b)
		if err != nil {
			return nil, fmt.Errorf("encoding an index snapshot: %w", err)
		}
		snap.batches[i] = &encodedBatch{JournalBatch: b, raw: raw}
	}
	s.built.Add(1)
	return snap, nil
}
