package journal

import (
	"time"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// Positions let a proxy move between control plane replicas without a snapshot.
//
// Every replica follows every worker's KV events, so two replicas apply the same event
// batches of each worker, in that worker's order, and journal the same changes for it; only
// the interleaving of the workers differs, and with it the offsets. What is comparable
// across replicas is, per worker, the engine's event sequence number: a Mark says that the
// changes of a worker's events up to its batch Seq are all journalled. The journal server
// sends the proxies the marks that moved about once a CheckpointEvery (and every mark with a
// snapshot); a proxy that moves to another replica sends them back, and that replica finds,
// for each worker, the offset in its own log where the worker passed that mark. Replaying
// its log from the earliest such offset replays every change the proxy lacks, plus some it
// already has: changes are assignments, and a replay of the same worker's changes in the
// same order ends in the same state. A worker the replica cannot place that way (another
// slot, an id check that differs, a mark no longer in its history, a replica behind the
// proxy's mark, a slot cleared within that history, or a replica that covers less of the
// worker's past than the proxy's part does) has its slot cleared and filled again from the
// index; too many of those, or a replay start no longer in the ring, and the proxy gets a
// snapshot as before.
//
// Coverage: a control plane that starts after a worker knows the blocks the worker stored
// since the first batch it could replay (Mark.Since), not those before. It cannot journal the
// removal of a block it never knew, so a proxy whose part of the worker goes back further
// would keep such blocks for good; that slot is filled again instead.
//
// An engine that restarts numbers its batches from the start again, so a mark of the old run
// and one of the new can name the same batch: a slot cleared within the kept history is
// filled again rather than placed by its number, and a proxy drops a slot's mark when it
// applies the slot's clear.
//
// Shared storage is credited to every slot that mounts it, in the order the replica's
// workers wrote to it: a resumed replica may briefly differ there from the new control
// plane's, until those blocks change again. The same holds for a worker whose events one
// replica lost for good and rebuilt while the other did not.

// Mark is where one worker's part of the journal stands: the changes of every event batch the
// worker in Slot (the worker whose id check is Check) published from its batch Since up to
// its batch Seq are in the log.
type Mark struct {
	Slot, Check uint32
	Seq, Since  uint64
}

// DefaultCheckpointEvery is how often, at most, a Log gathers the marks that moved into a
// checkpoint that its streams send.
const DefaultCheckpointEvery = time.Second

// historyMarks is how many marked appends a Log remembers for Resume: about 13 s of
// 10,000 engine batches a second, far more than two replicas drift apart.
const historyMarks = 1 << 17

// maxResetShare bounds the workers a resume may fill again from the index, as a share of the
// slots (plus maxResetExtra): past it a snapshot costs about the same and is built once for
// every proxy that needs one, where each resume fills its slots for its own stream.
const (
	maxResetShare = 4
	maxResetExtra = 2
)

// position is a slot's current mark, and when (in marked appends, Log.nhist) the slot was
// last cleared.
type position struct {
	check      uint32
	seq, since uint64
	ok         bool
	clearedAt  uint64 // nhist+1 at the clear; 0: never
}

// histMark is one marked append: slot's worker passed seq at offset end.
type histMark struct {
	end  uint64
	slot uint32
	seq  uint64
}

// checkpoint is the marks that moved before offset off, since the previous checkpoint.
type checkpoint struct {
	off   uint64
	marks []Mark
}

// logCheckpoints is how many checkpoints a Log keeps for streams that lag (about a minute).
const logCheckpoints = 64

// markLocked records m as journalled up to the log's next offset.
func (l *Log) markLocked(m Mark) {
	l.movedLocked(m.Slot)
	l.pos[m.Slot] = position{check: m.Check, seq: m.Seq, since: m.Since, ok: true, clearedAt: l.pos[m.Slot].clearedAt}
	if l.hist == nil {
		l.hist = make([]histMark, historyMarks)
	}
	l.hist[l.nhist%uint64(len(l.hist))] = histMark{end: l.next, slot: m.Slot, seq: m.Seq}
	l.nhist++
}

// movedLocked makes room for slot's position and counts it among the slots the next
// checkpoint carries.
func (l *Log) movedLocked(slot uint32) {
	if int(slot) >= len(l.pos) {
		l.pos = append(l.pos, make([]position, int(slot)+1-len(l.pos))...)
		l.dirty = append(l.dirty, make([]bool, int(slot)+1-len(l.dirty))...)
	}
	if !l.dirty[slot] {
		l.dirty[slot] = true
		l.moved = append(l.moved, slot)
	}
}

// checkpointLocked gathers the marks that moved into a checkpoint at the next offset, once
// CheckpointEvery has passed since the last. It is called after an append of changes only:
// every stream then sends a batch that ends at or past the checkpoint's offset and starts
// before it, which carries it (Checkpoints).
func (l *Log) checkpointLocked(at int64) {
	every := l.CheckpointEvery
	if every <= 0 {
		every = DefaultCheckpointEvery
	}
	if len(l.moved) == 0 || at-l.ckAt < int64(every) {
		return
	}
	l.ckAt = at
	ck := checkpoint{off: l.next, marks: make([]Mark, 0, len(l.moved))}
	for _, s := range l.moved {
		ck.marks = append(ck.marks, l.pos[s].mark(s)) // zero once forgotten
		l.dirty[s] = false
	}
	l.moved = l.moved[:0]
	if l.ckpts == nil {
		l.ckpts = make([]checkpoint, logCheckpoints)
	}
	l.ckpts[l.nckpts%uint64(len(l.ckpts))] = ck
	l.nckpts++
}

// Forget records that the slot was cleared (by the changes appended with it: its worker
// left, restarted, or lost events for good): it has no mark until its worker's next events
// mark it again, and the next checkpoint says so.
func (l *Log) Forget(slot uint32, cs ...Change) {
	now := time.Now().UnixNano()
	l.mu.Lock()
	l.movedLocked(slot)
	l.pos[slot] = position{clearedAt: l.nhist + 1}
	l.appendLocked(now, cs)
	if len(cs) > 0 {
		l.checkpointLocked(now)
	}
	w := l.wakeLocked()
	l.mu.Unlock()
	if w != nil {
		close(w)
	}
}

// Checkpoints appends to dst the marks of the checkpoints at offsets in (from, to]: what a
// stream that sent the changes up to to, and last sent marks with the changes up to from,
// tells its proxy. A checkpoint that no longer is kept leaves the proxy's marks older than
// they could be, which costs a longer replay (or a slot filled again) at its next move,
// never a wrong replica.
func (l *Log) Checkpoints(dst []Mark, from, to uint64) []Mark {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := min(l.nckpts, uint64(len(l.ckpts)))
	for i := l.nckpts - n; i < l.nckpts; i++ {
		if ck := &l.ckpts[i%uint64(len(l.ckpts))]; ck.off > from && ck.off <= to {
			dst = append(dst, ck.marks...)
		}
	}
	return dst
}

// MarksOf returns the current marks of the given slots that have one.
func (l *Log) MarksOf(slots []uint32) []Mark {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Mark
	for _, s := range slots {
		if int(s) < len(l.pos) && l.pos[s].ok {
			out = append(out, l.pos[s].mark(s))
		}
	}
	return out
}

// Positions returns the next offset with every worker's mark as of it: what a snapshot
// taken now (the index as of that offset, or later) starts from.
func (l *Log) Positions() (next uint64, marks []Mark) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for s, p := range l.pos {
		if p.ok {
			marks = append(marks, p.mark(uint32(s)))
		}
	}
	return l.next, marks
}

// Resume finds where a replica that stands at marks (built from another log) continues in
// this one: from, the offset to replay from, and reset, the slots to clear and fill again
// from the index, each with its mark in this log (a zero Check and Seq for a slot with no
// worker here). in, when not nil, is the replica's scope: slots out of it are named only
// where the replica holds a mark (to be cleared). ok is false when a snapshot is needed
// instead.
func (l *Log) Resume(marks []Mark, in func(slot uint32) bool) (from uint64, reset []Mark, ok bool) {
	if in == nil {
		in = func(uint32) bool { return true }
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(marks) == 0 || l.nhist == 0 {
		return 0, nil, false
	}
	theirs := map[uint32]Mark{}
	for _, m := range marks {
		theirs[m.Slot] = m
	}
	from = l.next
	// want is, per slot to place by its history, the seq the proxy stands at.
	want := map[uint32]uint64{}
	kept := min(l.nhist, uint64(len(l.hist)))
	filled := 0 // slots of the scope to fill again: what the threshold counts
	for s, m := range theirs {
		var p position
		if int(s) < len(l.pos) {
			p = l.pos[s]
		}
		// A clear within the kept history may lie between the proxy's mark and this log's
		// (an engine that restarted numbers its batches from the start again).
		clearedLately := p.clearedAt != 0 && l.nhist-(p.clearedAt-1) <= kept
		switch {
		case !in(s):
			reset = append(reset, Mark{Slot: s})
		case !p.ok || p.check != m.Check || p.seq < m.Seq || p.since > m.Since || clearedLately:
			reset = append(reset, p.mark(s))
			filled++
		case p.seq > m.Seq:
			want[s] = m.Seq
		}
	}
	scoped := 0
	for s, p := range l.pos {
		if !in(uint32(s)) {
			continue
		}
		scoped++
		if _, known := theirs[uint32(s)]; p.ok && !known {
			reset = append(reset, p.mark(uint32(s)))
			filled++
		}
	}
	// Walk the history from the newest: the end of the newest append of each slot at the
	// proxy's seq is where the changes it lacks start.
	for i := uint64(0); i < kept && len(want) > 0; i++ {
		h := l.hist[(l.nhist-1-i)%uint64(len(l.hist))]
		if seq, ok := want[h.slot]; ok && h.seq == seq {
			from = min(from, h.end)
			delete(want, h.slot)
		}
	}
	for s := range want {
		reset = append(reset, l.pos[s].mark(s))
		filled++
	}
	if from < l.first || filled > max(scoped, len(theirs))/maxResetShare+maxResetExtra {
		return 0, nil, false
	}
	return from, reset, true
}

// mark is the position as the Mark of slot s (zero when the slot has none).
func (p position) mark(s uint32) Mark {
	if !p.ok {
		return Mark{Slot: s}
	}
	return Mark{Slot: s, Check: p.check, Seq: p.seq, Since: p.since}
}

// markColumns are a message's position arrays.
type markColumns struct {
	slot, check *[]uint32
	seq, since  *[]uint64
}

func batchColumns(b *xdsv1.JournalBatch) markColumns {
	return markColumns{&b.PosSlot, &b.PosCheck, &b.PosSeq, &b.PosSince}
}

func ackColumns(a *xdsv1.JournalAck) markColumns {
	return markColumns{&a.PosSlot, &a.PosCheck, &a.PosSeq, &a.PosSince}
}

// put appends marks to the columns.
func (c markColumns) put(ms ...Mark) {
	for _, m := range ms {
		*c.slot = append(*c.slot, m.Slot)
		*c.check = append(*c.check, m.Check)
		*c.seq = append(*c.seq, m.Seq)
		*c.since = append(*c.since, m.Since)
	}
}

// read appends the columns' marks to dst; ok is false when the arrays differ in length or
// name a slot past MaxSlots.
func (c markColumns) read(dst []Mark) ([]Mark, bool) {
	slot, check, seq, since := *c.slot, *c.check, *c.seq, *c.since
	if len(slot) != len(check) || len(slot) != len(seq) || len(slot) != len(since) {
		return dst, false
	}
	for i := range slot {
		if slot[i] >= MaxSlots {
			return dst, false
		}
		dst = append(dst, Mark{Slot: slot[i], Check: check[i], Seq: seq[i], Since: since[i]})
	}
	return dst, true
}
