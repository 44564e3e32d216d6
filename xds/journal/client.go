package journal

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// Sink is a replica the client keeps current. Its methods are called from the client's Run
// goroutine only, in stream order.
type Sink interface {
	// Reset empties the replica: a snapshot follows.
	Reset()
	// Apply applies changes in order.
	Apply(cs []Change)
}

// ResumeSink is a Sink that wants to know when the client has resumed its replica on
// another control plane replica without a snapshot: the slots it could not place are filled
// again, and the changes the replica lacks follow.
type ResumeSink interface {
	Sink
	Resumed()
}

// SnapshotSink is a Sink that wants to know when a snapshot is complete: between Reset and
// SnapshotDone it may build the new state aside and keep answering from the old one, so a
// proxy resyncing with a restarted control plane never routes on a half-sent index.
type SnapshotSink interface {
	Sink
	SnapshotDone()
}

// ClientOptions configure a Client.
type ClientOptions struct {
	// NodeID names the proxy to the control plane.
	NodeID string
	// MinBackoff and MaxBackoff bound the jittered exponential wait between reconnects
	// (defaults 100 ms and 5 s).
	MinBackoff, MaxBackoff time.Duration
	// OnError, if set, hears why a stream ended (from the Run goroutine).
	OnError func(error)
	// Models scopes the replica to the workers that serve one of these models (and those
	// whose models the control plane does not know); empty: every worker.
	Models []string
}

// Client follows a control plane's journal into a Sink, reconnecting when the stream breaks
// and resuming from where its replica stands. While disconnected the replica keeps its last
// state: routing goes on with it.
type Client struct {
	conn grpc.ClientConnInterface
	opts ClientOptions

	epoch, next uint64
	// marks is where each slot's worker stands in the replica (positions.go), sent when a
	// stream opens, under mu (Marks reads it from any goroutine); pending are those a
	// snapshot or resume being received brings, in order, taken once it completes.
	mu        sync.Mutex
	marks     map[uint32]Mark
	pending   []Mark
	synced    atomic.Bool
	applied   atomic.Uint64
	batches   atomic.Uint64
	nacks     atomic.Uint64
	streams   atomic.Uint64
	snapshots atomic.Uint64
	resumes   atomic.Uint64
}

// NewClient returns a client on conn.
func NewClient(conn grpc.ClientConnInterface, opts ClientOptions) *Client {
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = 100 * time.Millisecond
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = 5 * time.Second
	}
	return &Client{conn: conn, opts: opts, marks: map[uint32]Mark{}}
}

// Synced reports whether the replica holds a complete snapshot plus changes.
func (c *Client) Synced() bool { return c.synced.Load() }

// ClientStats are a client's counters.
type ClientStats struct {
	Applied, Batches, Nacks, Streams uint64
	// Snapshots counts the snapshots received whole, Resumes the streams that went on
	// without one on another control plane replica.
	Snapshots, Resumes uint64
	// Marks is how many slots the replica holds a worker's mark for: the workers a move to
	// another control plane replica can resume rather than fill again.
	Marks  int
	Synced bool
}

// Stats returns the client's counters; safe from any goroutine.
func (c *Client) Stats() ClientStats {
	c.mu.Lock()
	marks := len(c.marks)
	c.mu.Unlock()
	return ClientStats{Applied: c.applied.Load(), Batches: c.batches.Load(), Nacks: c.nacks.Load(), Streams: c.streams.Load(),
		Snapshots: c.snapshots.Load(), Resumes: c.resumes.Load(), Marks: marks, Synced: c.synced.Load()}
}

// Run follows the journal until ctx ends.
func (c *Client) Run(ctx context.Context, sink Sink) error {
	backoff := c.opts.MinBackoff
	for {
		started := time.Now()
		err := c.stream(ctx, sink)
		if ctx.Err() != nil {
			return nil
		}
		if c.opts.OnError != nil && err != nil {
			c.opts.OnError(err)
		}
		if time.Since(started) > 10*time.Second {
			backoff = c.opts.MinBackoff // the stream was healthy for a while
		}
		wait := backoff/2 + rand.N(backoff/2+1)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		backoff = min(2*backoff, c.opts.MaxBackoff)
	}
}

var errGap = errors.New("journal batch does not follow the replica")

func (c *Client) stream(ctx context.Context, sink Sink) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := xdsv1.NewIndexJournalClient(c.conn).Stream(ctx)
	if err != nil {
		return fmt.Errorf("opening the index journal: %w", err)
	}
	c.streams.Add(1)
	hello := &xdsv1.JournalAck{NodeId: c.opts.NodeID, Epoch: c.epoch, Next: c.next, Models: c.opts.Models}
	c.mu.Lock()
	ackColumns(hello).put(slices.Collect(maps.Values(c.marks))...)
	c.mu.Unlock()
	if err := st.Send(hello); err != nil {
		return fmt.Errorf("opening the index journal: %w", err)
	}
	var cs []Change
	var ms []Mark
	// A snapshot or a resume in progress: the epoch it comes from, and the marks it brings.
	// The client takes both only once it is complete, so that a stream that breaks halfway
	// starts over instead of going on from a replica it did not finish.
	var (
		inSnapshot, inResume bool
		epoch                uint64
	)
	awaitReset := false // after a NACK: only a snapshot's first batch is applied
	for {
		b, err := st.Recv()
		if err != nil {
			return fmt.Errorf("receiving the index journal: %w", err)
		}
		if awaitReset && !b.Reset_ {
			continue
		}
		awaitReset = false
		var ok, okMarks bool
		cs, ok = decode(cs[:0], b)
		ms, okMarks = batchColumns(b).read(ms[:0])
		switch {
		case !ok || !okMarks:
			err = errors.New("journal batch holds a change this proxy cannot read")
		case b.Reset_:
			sink.Reset()
			c.synced.Store(false)
			inSnapshot, inResume, epoch = true, false, b.Epoch
			c.pending = c.pending[:0]
			// Until it completes, the replica stands nowhere: a stream that breaks
			// halfway asks for a snapshot again.
			c.epoch, c.next = 0, 0
			c.mu.Lock()
			clear(c.marks)
			c.mu.Unlock()
		case b.Resume && inSnapshot:
			err = fmt.Errorf("%w: a resume inside a snapshot", errGap)
		case b.Resume && !inResume:
			// A control plane of another epoch goes on from this replica's marks. Its
			// first batch names the slots it clears and fills again: until the resume
			// completes, those have no mark, and the replica no epoch to go on from
			// without one (a stream that breaks halfway resumes again, and fills them).
			inResume, epoch = true, b.Epoch
			c.pending = c.pending[:0]
			c.mu.Lock()
			for _, m := range ms {
				delete(c.marks, m.Slot)
			}
			c.mu.Unlock()
			c.epoch = 0
		case (inSnapshot || inResume) && b.Epoch != epoch, !inSnapshot && !inResume && b.Epoch != c.epoch:
			err = fmt.Errorf("%w: epoch %d, replica at %d", errGap, b.Epoch, c.epoch)
		case !inSnapshot && !b.Resume && b.Offset != c.next:
			err = fmt.Errorf("%w: batch at offset %d, replica at %d", errGap, b.Offset, c.next)
		}
		if err != nil {
			// Ask for a snapshot; keep routing on what the replica has meanwhile.
			c.nacks.Add(1)
			if err := st.Send(&xdsv1.JournalAck{NodeId: c.opts.NodeID, Epoch: c.epoch, Next: c.next, NackReason: err.Error()}); err != nil {
				return fmt.Errorf("nacking the index journal: %w", err)
			}
			awaitReset, inResume = true, false
			continue
		}
		sink.Apply(cs)
		c.applied.Add(uint64(len(cs)))
		c.batches.Add(1)
		switch {
		case inSnapshot || inResume:
			c.pending = append(c.pending, ms...)
			if !b.SnapshotDone {
				if inSnapshot {
					continue // the server awaits the ack of a snapshot's last batch only
				}
				break
			}
			c.mu.Lock()
			putMarksMap(c.marks, c.pending) // after a snapshot's reset, onto none
			c.mu.Unlock()
			if inSnapshot {
				c.snapshots.Add(1)
				if ss, ok := sink.(SnapshotSink); ok {
					ss.SnapshotDone()
				}
			} else {
				c.resumes.Add(1)
				if rs, ok := sink.(ResumeSink); ok {
					rs.Resumed()
				}
			}
			inSnapshot, inResume, c.pending = false, false, c.pending[:0]
			c.epoch, c.next = epoch, b.Next
			c.synced.Store(true)
		default:
			c.mu.Lock()
			putMarksMap(c.marks, ms)
			// A cleared slot has no mark until a checkpoint after the clear gives one: its
			// worker may have restarted and numbers its batches from the start again. The
			// batch's marks are its checkpoints', which may come before or after a clear it
			// carries (the client cannot tell), so a clear drops them all: the slot is filled
			// again on a move, never resumed from a position before its clear.
			for _, ch := range cs {
				if ch.Op == Cleared {
					delete(c.marks, ch.Slot)
				}
			}
			c.mu.Unlock()
			c.next = b.Next
			c.synced.Store(true)
		}
		if err := st.Send(&xdsv1.JournalAck{NodeId: c.opts.NodeID, Epoch: c.epoch, Next: c.next}); err != nil {
			return fmt.Errorf("acknowledging the index journal: %w", err)
		}
	}
}

// Marks returns where each slot's worker stands in the replica (a copy), as the client
// would send it on its next stream.
func (c *Client) Marks() map[uint32]Mark {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.marks)
}

// putMarksMap records marks by slot; a zero mark says the slot has no worker.
func putMarksMap(dst map[uint32]Mark, ms []Mark) {
	for _, m := range ms {
		if m.Check == 0 && m.Seq == 0 {
			delete(dst, m.Slot)
		} else {
			dst[m.Slot] = m
		}
	}
}
