package journal

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
	// SendTimeout ends a stream whose proxy has not taken a message for this long (its
	// flow-control window full: it does not read); it reconnects and gets a snapshot
	// (default 30 s).
	SendTimeout time.Duration
	// MaxSnapshots bounds the snapshots built at once (default 4): each holds a copy of
	// the whole index until it is sent.
	MaxSnapshots int
}

// Server streams a Log to proxies: the IndexJournal service. It is safe for concurrent use;
// each stream runs on its own gRPC goroutine plus one that reads the proxy's acks.
type Server struct {
	xdsv1.UnimplementedIndexJournalServer
	log  *Log
	snap Snapshotter
	opts ServerOptions

	mu    sync.Mutex
	nodes map[string]*NodeState

	snapshots, batches, changes atomic.Uint64
	slow                        atomic.Uint64 // streams ended for not reading
	snapSem                     chan struct{}
}

// NodeState is what the server knows of one subscribed proxy.
type NodeState struct {
	// Sent and Acked are the offsets after the last change sent and acknowledged.
	Sent, Acked uint64
	Nacks       uint64
	Connected   bool
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
	if opts.MaxSnapshots <= 0 {
		opts.MaxSnapshots = 4
	}
	return &Server{log: log, snap: snap, opts: opts, nodes: map[string]*NodeState{}, snapSem: make(chan struct{}, opts.MaxSnapshots)}
}

// Stats are the server's counters.
type Stats struct {
	Snapshots, Batches, Changes uint64
	// SlowStreams counts streams ended because their proxy stopped reading.
	SlowStreams uint64
	Nodes       map[string]NodeState
}

// Stats returns the counters and every node's state.
func (s *Server) Stats() Stats {
	st := Stats{Snapshots: s.snapshots.Load(), Batches: s.batches.Load(), Changes: s.changes.Load(), SlowStreams: s.slow.Load(), Nodes: map[string]NodeState{}}
	s.mu.Lock()
	for id, n := range s.nodes {
		st.Nodes[id] = *n
	}
	s.mu.Unlock()
	return st
}

func (s *Server) node(id string) *NodeState {
	s.mu.Lock()
	defer s.mu.Unlock()
	n, ok := s.nodes[id]
	if !ok {
		n = &NodeState{}
		s.nodes[id] = n
	}
	return n
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
	n := s.node(first.NodeId)
	s.update(n, func(n *NodeState) { n.Connected = true })
	defer s.update(n, func(n *NodeState) { n.Connected = false })

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
			s.update(n, func(n *NodeState) { n.Acked = a.Next })
		}
	}()

	next := first.Next
	if first.Epoch != s.log.Epoch() || !s.inRing(next) {
		if next, err = s.sendSnapshot(stream); err != nil {
			return err
		}
	}
	buf := make([]Change, 0, s.opts.MaxBatch)
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-ackErr:
			if errors.Is(err, context.Canceled) || status.Code(err) == codes.Canceled {
				return nil
			}
			return nil // the proxy closed its side: the stream is over
		case <-resync:
			if next, err = s.sendSnapshot(stream); err != nil {
				return err
			}
			continue
		case <-s.log.Wait(next):
		}
		// Let a burst accumulate into one message, unless it is already full.
		if s.log.Next()-next < uint64(s.opts.MaxBatch) {
			t := time.NewTimer(s.opts.Linger)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return nil
			}
		}
		var ok bool
		var to uint64
		buf, to, ok = s.log.Read(buf[:0], next, s.opts.MaxBatch)
		if !ok {
			if next, err = s.sendSnapshot(stream); err != nil {
				return err
			}
			continue
		}
		if len(buf) == 0 {
			continue
		}
		b := &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: next, Next: to}
		appendChanges(b, buf)
		if err := s.send(stream, b); err != nil {
			return err
		}
		next = to
		s.batches.Add(1)
		s.changes.Add(uint64(len(buf)))
		s.update(n, func(n *NodeState) { n.Sent = to })
	}
}

// send sends b, or gives up with ResourceExhausted once the proxy has taken nothing for
// SendTimeout: returning from the handler then ends the stream, which releases the send.
func (s *Server) send(stream xdsv1.IndexJournal_StreamServer, b *xdsv1.JournalBatch) error {
	done := make(chan error, 1)
	go func() { done <- stream.Send(b) }()
	t := time.NewTimer(s.opts.SendTimeout)
	defer t.Stop()
	select {
	case err := <-done:
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

// sendSnapshot sends the whole index (reset first, done last) and returns the offset the
// stream continues from.
func (s *Server) sendSnapshot(stream xdsv1.IndexJournal_StreamServer) (uint64, error) {
	select {
	case s.snapSem <- struct{}{}:
		defer func() { <-s.snapSem }()
	case <-stream.Context().Done():
		return 0, stream.Context().Err()
	}
	next := s.log.Next()
	var entries []Change
	s.snap.Each(func(seq uint64, slot int, tier blockset.Tier) {
		entries = append(entries, Change{Seq: seq, Slot: uint32(slot), Tier: tier, Op: Stored})
	})
	s.snapshots.Add(1)
	for i := 0; ; i += s.opts.SnapshotBatch {
		end := min(i+s.opts.SnapshotBatch, len(entries))
		b := &xdsv1.JournalBatch{Epoch: s.log.Epoch(), Offset: next, Next: next, Reset_: i == 0, SnapshotDone: end == len(entries)}
		appendChanges(b, entries[i:end])
		if err := s.send(stream, b); err != nil {
			return next, fmt.Errorf("sending index snapshot: %w", err)
		}
		if end == len(entries) {
			return next, nil
		}
	}
}
