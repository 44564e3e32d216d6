package nixl

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"
)

// State is where a transfer stands.
type State int32

const (
	// StatePending: created, not posted yet.
	StatePending State = iota
	// StateInProgress: posted, bytes are moving.
	StateInProgress
	// StateDone: every byte moved and the notification (if any) was handed to the peer.
	StateDone
	// StateError: the transfer failed; Err says why.
	StateError
)

// String returns the state's name.
func (s State) String() string {
	switch s {
	case StatePending:
		return "Pending"
	case StateInProgress:
		return "InProgress"
	case StateDone:
		return "Done"
	case StateError:
		return "Error"
	}
	return "State(" + strconv.Itoa(int(s)) + ")"
}

// XferOption configures a transfer.
type XferOption func(*xferOpts)

type xferOpts struct {
	notif   []byte
	timeout time.Duration
}

// WithNotif attaches a notification: once the transfer's bytes have moved, msg is
// delivered to the remote agent, which reads it from GetNotifs under this agent's name.
// For a READ it tells the peer its memory has been read (a prefill worker may then free
// the blocks); for a WRITE it arrives after the data has landed.
func WithNotif(msg []byte) XferOption {
	return func(o *xferOpts) { o.notif = msg }
}

// WithTimeout overrides Config.Timeout for this transfer; d <= 0 means no timeout.
func WithTimeout(d time.Duration) XferOption {
	return func(o *xferOpts) { o.timeout = d }
}

// Xfer is a prepared transfer between local descriptors and a remote agent's descriptors
// (NIXL's transfer request handle). CreateXfer validates it; Post starts it, and may be
// called again once it has finished; State polls it; Wait blocks on it; Release ends it.
// An Xfer is safe for concurrent use.
type Xfer struct {
	a       *Agent
	req     Request
	remote  *remote   // the metadata the remote descriptors were checked against
	regions []*Region // distinct local regions
	timeout time.Duration

	mu       sync.Mutex
	state    State
	err      error
	done     chan struct{} // closed when the current post finishes
	cancel   context.CancelFunc
	backend  BackendKind
	released bool
}

// CreateXfer prepares a transfer: op copies between local[i] and the remote agent's
// remote[i] for every i. Every descriptor is checked here, before any byte can move:
// local ones against this agent's regions, remote ones against the loaded metadata of
// remoteAgent, and the two lists pairwise for equal lengths. Rejections are *DescError
// values wrapping ErrUnknownRegion, ErrOutOfRange, ErrLengthMismatch or ErrInvalidDesc;
// an unloaded peer gives ErrUnknownAgent.
func (a *Agent) CreateXfer(op Op, local DescList, remoteAgent string, remote DescList, opts ...XferOption) (*Xfer, error) {
	o := xferOpts{timeout: a.cfg.Timeout}
	for _, opt := range opts {
		opt(&o)
	}
	if op != Read && op != Write {
		return nil, fmt.Errorf("creating transfer: unknown op %d: %w", op, ErrInvalidDesc)
	}
	if a.isClosed() {
		return nil, ErrClosed
	}
	rm := a.remote(remoteAgent)
	if rm == nil {
		return nil, fmt.Errorf("creating %s from agent %q: %w", op, remoteAgent, ErrUnknownAgent)
	}
	if len(local.Descs) == 0 {
		return nil, fmt.Errorf("creating %s: empty descriptor list: %w", op, ErrInvalidDesc)
	}
	if len(local.Descs) != len(remote.Descs) {
		return nil, fmt.Errorf("creating %s: %d local and %d remote descriptors: %w", op, len(local.Descs), len(remote.Descs), ErrLengthMismatch)
	}
	if len(local.Descs) > maxSegs {
		return nil, fmt.Errorf("creating %s: %d descriptors exceed %d: %w", op, len(local.Descs), maxSegs, ErrInvalidDesc)
	}
	if len(o.notif) > maxNotif {
		return nil, fmt.Errorf("creating %s: notification of %d bytes exceeds %d: %w", op, len(o.notif), maxNotif, ErrInvalidDesc)
	}
	if local.Mem == VRAM && !deviceSupport {
		return nil, fmt.Errorf("creating %s: local VRAM descriptors: %w", op, ErrDeviceMemoryUnavailable)
	}
	x := &Xfer{
		a:       a,
		remote:  rm,
		timeout: o.timeout,
		req: Request{
			Op:     op,
			Peer:   remoteAgent,
			PeerMD: rm.md,
			Local:  make([]Segment, len(local.Descs)),
			Remote: make([]RemoteSegment, len(remote.Descs)),
			Notif:  o.notif,
		},
	}
	lt := a.local.Load()
	for i, d := range local.Descs {
		rd := remote.Descs[i]
		if err := checkDesc(d); err != nil {
			return nil, &DescError{Side: LocalSide, Index: i, Desc: d, Err: err}
		}
		if err := checkDesc(rd); err != nil {
			return nil, &DescError{Side: RemoteSide, Index: i, Desc: rd, Err: err}
		}
		if d.Len != rd.Len {
			return nil, &DescError{Side: RemoteSide, Index: i, Desc: rd, Err: fmt.Errorf("length %d, local %d: %w", rd.Len, d.Len, ErrLengthMismatch)}
		}
		j, off, err := lt.set.find(local.Mem, d)
		if err != nil {
			return nil, &DescError{Side: LocalSide, Index: i, Desc: d, Err: err}
		}
		r := lt.regs[j]
		x.req.Local[i] = Segment{Region: r, Off: off, Len: d.Len}
		if !containsRegion(x.regions, r) {
			x.regions = append(x.regions, r)
		}
		k, roff, err := rm.set.find(remote.Mem, rd)
		if err != nil {
			return nil, &DescError{Side: RemoteSide, Index: i, Desc: rd, Err: err}
		}
		x.req.Remote[i] = RemoteSegment{Region: rm.set.regions[k], Off: roff, Len: rd.Len}
		x.req.Total += d.Len
		if x.req.Total > maxTransfer {
			return nil, fmt.Errorf("creating %s: more than %d bytes: %w", op, maxTransfer, ErrInvalidDesc)
		}
	}
	return x, nil
}

// Post starts the transfer and returns at once; State, Wait and Err follow it. ctx bounds
// the transfer (cancelling it aborts the transfer), as does the transfer's timeout. Post
// fails with ErrBusy while a previous post is in progress and ErrReleased after Release.
func (x *Xfer) Post(ctx context.Context) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	switch {
	case x.released:
		return ErrReleased
	case x.state == StateInProgress:
		return ErrBusy
	}
	if !x.a.track() {
		x.state, x.err = StateError, ErrClosed
		return ErrClosed
	}
	var cancel context.CancelFunc
	if x.timeout > 0 {
		cause := fmt.Errorf("%w after %v: %w", ErrTimeout, x.timeout, context.DeadlineExceeded)
		ctx, cancel = context.WithTimeoutCause(ctx, x.timeout, cause)
	} else {
		ctx, cancel = context.WithCancel(ctx)
	}
	x.state, x.err, x.backend = StateInProgress, nil, ""
	x.done = make(chan struct{})
	x.cancel = cancel
	go x.run(ctx, cancel, x.done)
	return nil
}

// run executes one post and records its outcome.
func (x *Xfer) run(ctx context.Context, cancel context.CancelFunc, done chan struct{}) {
	defer x.a.wg.Done()
	defer cancel()
	kind, err := x.execute(ctx)
	if err != nil && x.a.isClosed() && !errors.Is(err, ErrClosed) {
		err = fmt.Errorf("%w: %w", ErrClosed, err)
	}
	x.mu.Lock()
	x.backend = kind
	if err != nil {
		x.state, x.err = StateError, fmt.Errorf("%s with %q: %w", x.req.Op, x.req.Peer, err)
	} else {
		x.state, x.err = StateDone, nil
	}
	close(done)
	x.mu.Unlock()
}

func (x *Xfer) execute(ctx context.Context) (BackendKind, error) {
	a := x.a
	req := &x.req
	if rm := a.remote(req.Peer); rm != x.remote {
		if rm == nil {
			return "", fmt.Errorf("agent %q: %w", req.Peer, ErrUnknownAgent)
		}
		// The metadata was reloaded: the remote regions must still be there, unchanged.
		for i, s := range req.Remote {
			if cur, ok := rm.byID[s.Region.ID]; !ok || cur != s.Region {
				return "", &DescError{Side: RemoteSide, Index: i, Desc: Desc{Addr: s.Region.Addr + s.Off, Len: s.Len, DevID: s.Region.DevID}, Err: ErrUnknownRegion}
			}
		}
		x.remote = rm
		req.PeerMD = rm.md
	}
	for i, r := range x.regions {
		if !r.acquire() {
			releaseAll(x.regions[:i])
			return "", fmt.Errorf("local region %d deregistered: %w", r.desc.ID, ErrUnknownRegion)
		}
	}
	defer releaseAll(x.regions)
	for _, b := range a.backends {
		if !b.CanCarry(req) {
			continue
		}
		err := b.Transfer(ctx, req)
		if errors.Is(err, ErrBackendUnavailable) {
			continue
		}
		return b.Kind(), err
	}
	return "", ErrNoBackend
}

// State reports where the transfer stands (NIXL's checkXferState).
func (x *Xfer) State() State {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.state
}

// Err returns why the transfer failed, or nil.
func (x *Xfer) Err() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.err
}

// Backend returns the backend that carried the last post ("" before one finished).
func (x *Xfer) Backend() BackendKind {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.backend
}

// Total is the number of bytes the transfer moves.
func (x *Xfer) Total() uint64 { return x.req.Total }

// Wait blocks until the current post finishes and returns its error, or until ctx ends,
// returning ctx.Err() and leaving the transfer running (Release aborts it).
func (x *Xfer) Wait(ctx context.Context) error {
	x.mu.Lock()
	done, state := x.done, x.state
	x.mu.Unlock()
	if done == nil {
		if state == StateError {
			return x.Err()
		}
		return ErrNotPosted
	}
	select {
	case <-done:
		return x.Err()
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Release aborts the transfer if it is in progress, waits until it no longer touches
// memory, and retires it: later Posts fail with ErrReleased.
func (x *Xfer) Release() {
	x.mu.Lock()
	x.released = true
	done, cancel := x.done, x.cancel
	x.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	if done != nil {
		<-done
	}
}

// Transfer creates, posts and waits for one transfer: the one-call form of
// CreateXfer + Post + Wait. Cancelling ctx aborts the transfer; Transfer returns only once
// the transfer no longer touches local memory.
func (a *Agent) Transfer(ctx context.Context, op Op, local DescList, remoteAgent string, remote DescList, opts ...XferOption) error {
	x, err := a.CreateXfer(op, local, remoteAgent, remote, opts...)
	if err != nil {
		return err
	}
	if err := x.Post(ctx); err != nil {
		return err
	}
	x.mu.Lock()
	done := x.done
	x.mu.Unlock()
	<-done
	return x.Err()
}
