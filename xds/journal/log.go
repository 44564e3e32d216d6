// Package journal carries the KV index from the control plane to proxies: a Log of block
// changes on the control plane's side, a gRPC server that streams it (the IndexJournal
// service of xds/api/v1), and a client that applies it to a proxy's replica.
//
// A replica starts from a snapshot taken at some offset and then applies every change from
// that offset on, in order. Changes are assignments (block held / not held / slot cleared),
// so a snapshot that already reflects some changes past its offset converges once those are
// replayed: the last change to each entry wins. A replica too far behind for the Log's ring
// starts over from a new snapshot. One that comes from another epoch (another replica, or a
// control plane that restarted and replayed what the engines buffer) resumes from the
// workers' marks it holds when the new log can place them, worker by worker
// (positions.go), and takes a snapshot otherwise.
//
// The server sends a stream at most ServerOptions.MaxUnacked bytes ahead of the proxy's
// acknowledgements and ends a stream that takes nothing (SendTimeout) or acknowledges nothing
// (AckTimeout) for 30 s; the proxy reconnects and resumes, or resnapshots. Snapshots are
// built once and shared by the streams that need one at about the same time.
package journal

import (
	"math/rand/v2"
	"sort"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/xds/blockset"
)

// Op is what a change does.
type Op uint8

// Ops.
const (
	Stored  Op = iota // slot now holds Seq in Tier
	Removed           // slot no longer holds Seq in Tier
	Cleared           // slot holds nothing any more
)

// Change is one entry of the journal.
type Change struct {
	Seq  uint64
	Slot uint32
	Tier blockset.Tier
	Op   Op
}

// Snapshotter lists the current state: every (block, slot, tier) entry. The control plane's
// index implements it.
type Snapshotter interface {
	Each(fn func(seq uint64, slot int, tier blockset.Tier))
}

// Log is the control plane's journal: a ring of the most recent changes with their offsets,
// and the epoch that identifies this control plane's run. It is safe for concurrent use;
// Append is called by ingestion after it changes the index, readers wait on Wait.
type Log struct {
	epoch uint64

	mu    sync.Mutex
	ring  []Change
	first uint64 // offset of the oldest change still in the ring
	next  uint64 // offset the next change gets
	wake  chan struct{}
	// waited is whether Wait gave out wake since it was last closed: an append with no
	// reader waiting keeps it (and allocates nothing).
	waited bool
	// marks are when the most recent appends' changes arrived, oldest first from
	// marks[nmarks%len]: what ArrivedAt answers from.
	marks  []mark
	nmarks uint64

	// CheckpointEvery is how often at most the marks that moved are gathered for the
	// streams (DefaultCheckpointEvery when 0); set it before the first append.
	CheckpointEvery time.Duration
	// pos is each slot's mark; hist the most recent marked appends; moved the slots whose
	// mark moved since the last checkpoint (dirty by slot); ckpts the recent checkpoints
	// (positions.go).
	pos    []position
	hist   []histMark
	nhist  uint64
	moved  []uint32
	dirty  []bool
	ckpts  []checkpoint
	nckpts uint64
	ckAt   int64
}

// mark says that the changes before offset end arrived at unix nanosecond at (and after the
// previous mark's end).
type mark struct {
	end uint64
	at  int64
}

// logMarks is how many appends' arrival times a Log keeps: at the heaviest event rates
// (100,000 events a second in messages of 16, one append each) a second of them, more than
// a stream that keeps up lags.
const logMarks = 8192

// DefaultRing is how many changes a Log keeps for replicas that fall behind.
const DefaultRing = 1 << 20

// NewLog returns an empty log with a random epoch keeping ring changes.
func NewLog(ring int) *Log {
	if ring <= 0 {
		ring = DefaultRing
	}
	return &Log{epoch: rand.Uint64() | 1, ring: make([]Change, ring), wake: make(chan struct{}), marks: make([]mark, logMarks)}
}

// Epoch identifies this log; it changes when the control plane restarts.
func (l *Log) Epoch() uint64 { return l.epoch }

// Append adds changes, in order, arrived now.
func (l *Log) Append(cs ...Change) { l.AppendAt(time.Now().UnixNano(), cs...) }

// AppendAt adds changes, in order, that arrived at the control plane at unix nanosecond at
// (the engine's message that caused them): the journal server measures from it how fresh
// what it sends is.
func (l *Log) AppendAt(at int64, cs ...Change) {
	if len(cs) == 0 {
		return
	}
	l.mu.Lock()
	l.appendLocked(at, cs)
	w := l.wakeLocked()
	l.mu.Unlock()
	if w != nil {
		close(w)
	}
}

// AppendMarked adds the changes of one event batch of a worker, arrived at unix nanosecond
// at, and records that the worker stands at m once they are in (Mark). A batch that changed
// nothing still moves the mark.
func (l *Log) AppendMarked(at int64, m Mark, cs ...Change) {
	l.mu.Lock()
	l.appendLocked(at, cs)
	l.markLocked(m)
	var w chan struct{}
	if len(cs) > 0 {
		l.checkpointLocked(at)
		w = l.wakeLocked()
	}
	l.mu.Unlock()
	if w != nil {
		close(w)
	}
}

func (l *Log) appendLocked(at int64, cs []Change) {
	if len(cs) == 0 {
		return
	}
	for _, c := range cs {
		l.ring[l.next%uint64(len(l.ring))] = c
		l.next++
	}
	if l.next-l.first > uint64(len(l.ring)) {
		l.first = l.next - uint64(len(l.ring))
	}
	l.marks[l.nmarks%uint64(len(l.marks))] = mark{end: l.next, at: at}
	l.nmarks++
}

// wakeLocked returns the channel to close, once the lock is released, to wake the readers:
// nil when none waits.
func (l *Log) wakeLocked() chan struct{} {
	if !l.waited {
		return nil
	}
	w := l.wake
	l.wake, l.waited = make(chan struct{}), false
	return w
}

// Next returns the offset the next change will get.
func (l *Log) Next() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.next
}

// Read appends the changes from offset from on (at most max) to dst and returns them with the
// offset after them. ok is false when from is no longer in the ring (or is in the future): the
// reader needs a snapshot.
func (l *Log) Read(dst []Change, from uint64, max int) (out []Change, next uint64, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if from < l.first || from > l.next {
		return dst, from, false
	}
	n := min(l.next-from, uint64(max))
	for i := uint64(0); i < n; i++ {
		dst = append(dst, l.ring[(from+i)%uint64(len(l.ring))])
	}
	return dst, from + n, true
}

// ArrivedAt returns when the change at offset off arrived at the control plane (unix
// nanoseconds), while the log still remembers it: the last logMarks appends.
func (l *Log) ArrivedAt(off uint64) (int64, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := min(l.nmarks, uint64(len(l.marks)))
	oldest := l.nmarks - n
	at := func(i uint64) mark { return l.marks[(oldest+i)%uint64(len(l.marks))] }
	if n == 0 || off >= l.next {
		return 0, false
	}
	// The first mark whose end is past off; the mark before it must end at or before off
	// (else off is older than what is kept).
	i := uint64(sort.Search(int(n), func(i int) bool { return at(uint64(i)).end > off }))
	if i == 0 && oldest > 0 {
		return 0, false
	}
	return at(i).at, true
}

// Wait returns a channel that is closed when changes after from exist (at once if they
// already do).
func (l *Log) Wait(from uint64) <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.next > from {
		c := make(chan struct{})
		close(c)
		return c
	}
	l.waited = true
	return l.wake
}
