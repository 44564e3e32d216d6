// Package ingest feeds the control plane's KV index from every worker's KV events: one
// subscriber per worker (dialling a publisher that binds, as vLLM does, or binding for
// publishers that connect out), sequence tracking with replay through the worker's ROUTER
// endpoint when events were lost, and the journal of index changes that proxies follow.
package ingest

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// Endpoint is where one worker publishes its KV events.
type Endpoint struct {
	WorkerID string
	// Address is the ZMQ endpoint: the publisher's (dial) or a local one to bind.
	Address string
	Bind    bool
	// Replay is the worker's ROUTER replay endpoint, "" when it has none.
	Replay string
}

// Manager runs one subscriber per worker and applies their events to the index and the
// journal. Sync (from the registry's goroutine) starts and stops subscribers; each runs on its
// own goroutine, owned by the Manager and stopped by Close or Sync.
type Manager struct {
	index *kvindex.Index
	log   *journal.Log
	lg    *slog.Logger

	// apply serialises index changes with their journal entries, so that the journal's order
	// is the index's.
	apply sync.Mutex

	mu      sync.Mutex
	running map[string]*subscription
	wg      sync.WaitGroup
	ctx     context.Context
	cancel  context.CancelFunc
}

type subscription struct {
	ep     Endpoint
	cancel context.CancelFunc
	done   chan struct{}
	stats  *Stats
	sub    *kvevents.Subscriber
}

// Stats are one worker's ingestion counters.
type Stats struct {
	Batches, Events   atomic.Uint64
	Gaps, Replays     atomic.Uint64
	ReplayedBatches   atomic.Uint64
	Restarts, Stale   atomic.Uint64
	LastEventUnixNano atomic.Int64
	// CaughtUp is set once the subscriber has asked the engine to replay what it buffers
	// (or has no replay endpoint): the index then holds what the engine has announced.
	CaughtUp atomic.Bool
}

// NewManager returns a manager feeding index and log.
func NewManager(index *kvindex.Index, log *journal.Log, lg *slog.Logger) *Manager {
	if lg == nil {
		lg = slog.Default()
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Manager{index: index, log: log, lg: lg, running: map[string]*subscription{}, ctx: ctx, cancel: cancel}
}

// Sync makes the set of running subscribers match eps: new workers start, gone ones stop and
// lose their blocks, changed endpoints restart.
func (m *Manager) Sync(eps []Endpoint) {
	want := map[string]Endpoint{}
	for _, ep := range eps {
		if ep.Address != "" {
			want[ep.WorkerID] = ep
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, s := range m.running {
		if ep, ok := want[id]; !ok || ep != s.ep {
			m.stopLocked(id, s, !ok)
		}
	}
	for id, ep := range want {
		if _, ok := m.running[id]; !ok {
			m.startLocked(ep)
		}
	}
}

// RemoveWorker stops a worker's subscriber and drops its blocks.
func (m *Manager) RemoveWorker(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.running[id]; ok {
		m.stopLocked(id, s, true)
		return
	}
	m.drop(id, true)
}

func (m *Manager) stopLocked(id string, s *subscription, forget bool) {
	s.cancel()
	<-s.done
	delete(m.running, id)
	m.drop(id, forget)
}

// drop removes a worker's blocks from the index and journals it.
func (m *Manager) drop(id string, forget bool) {
	m.apply.Lock()
	defer m.apply.Unlock()
	slot := m.index.Slot(id)
	if forget {
		m.index.RemoveWorker(id, nil)
	} else {
		m.index.Clear(id, nil)
	}
	m.log.Append(journal.Change{Slot: uint32(slot), Op: journal.Cleared})
}

func (m *Manager) startLocked(ep Endpoint) {
	ctx, cancel := context.WithCancel(m.ctx)
	s := &subscription{ep: ep, cancel: cancel, done: make(chan struct{}), stats: &Stats{}}
	m.running[ep.WorkerID] = s
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer close(s.done)
		m.run(ctx, s)
	}()
}

// Stats returns a worker's counters, nil for a worker without a subscriber.
func (m *Manager) Stats(id string) *Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.running[id]; ok {
		return s.stats
	}
	return nil
}

// Close stops every subscriber.
func (m *Manager) Close() {
	m.cancel()
	m.wg.Wait()
}

// run follows one worker's events until ctx ends.
func (m *Manager) run(ctx context.Context, s *subscription) {
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: s.ep.Address, Bind: s.ep.Bind})
	if err != nil {
		m.lg.Error("kv event subscriber not started", "worker", s.ep.WorkerID, "err", err)
		return
	}
	s.sub = sub
	w := &follower{m: m, s: s}
	// A control plane that starts (or restarts) after its engines rebuilds their part of the
	// index at once from what they buffer for replay, rather than at their next event. It
	// asks once the subscription is up, so that nothing published in between is missed
	// (a worker that then stays idle would never show the gap).
	if s.ep.Replay != "" {
		var caught sync.WaitGroup
		defer caught.Wait() // no replay applies after the subscription stops
		caught.Add(1)
		go func() {
			defer caught.Done()
			select {
			case <-sub.Ready():
			case <-ctx.Done():
				return
			}
			w.mu.Lock()
			w.catchUp(ctx)
			w.mu.Unlock()
			s.stats.CaughtUp.Store(true)
		}()
	} else {
		s.stats.CaughtUp.Store(true)
	}
	for ctx.Err() == nil {
		if err := sub.Run(ctx, w.emit); err != nil {
			m.lg.Warn("kv event subscriber stopped; retrying", "worker", s.ep.WorkerID, "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// follower tracks one worker's sequence numbers. It runs on the subscriber's goroutine.
type follower struct {
	mu      sync.Mutex // emit and the catch-up at start
	m       *Manager
	s       *subscription
	last    uint64
	started bool
	// fresh is true after catchUp until the first live batch: live batches the replay
	// already covered are skipped, not taken for an engine restart.
	fresh   bool
	changed []kvindex.Change
	changes []journal.Change
}

func (f *follower) emit(seq uint64, b *kvevents.Batch) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.s.stats
	st.LastEventUnixNano.Store(time.Now().UnixNano())
	switch {
	case f.fresh && seq <= f.last:
		return // already applied from the replay
	case !f.started:
		// The control plane may have started after the engine: what the engine still
		// buffers for replay rebuilds the index from before this batch.
		f.started = true
		if seq > 0 && f.s.ep.Replay != "" {
			f.replay(0, seq)
		}
	case seq <= f.last:
		// The sequence went back: the engine restarted and its cache is empty.
		st.Restarts.Add(1)
		f.m.drop(f.s.ep.WorkerID, false)
	case seq > f.last+1:
		st.Gaps.Add(1)
		if f.s.ep.Replay == "" || !f.replay(f.last+1, seq) {
			// Lost for good: what the index holds for this worker can no longer be
			// trusted. Start over from the events that come next.
			st.Stale.Add(1)
			f.m.lg.Warn("kv events lost; worker's index rebuilt from new events", "worker", f.s.ep.WorkerID, "from", f.last+1, "to", seq)
			f.m.drop(f.s.ep.WorkerID, false)
		}
	}
	f.fresh = false
	f.apply(b)
	f.last = seq
}

// catchUp applies everything the engine buffers for replay, before any live batch.
func (f *follower) catchUp(ctx context.Context) {
	st := f.s.stats
	st.Replays.Add(1)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	got, err := kvevents.Replay(ctx, f.s.ep.Replay, 0)
	if err != nil {
		f.m.lg.Debug("kv event replay at start failed; the index follows new events", "worker", f.s.ep.WorkerID, "err", err)
	}
	for i := range got {
		if f.started && got[i].Seq <= f.last {
			continue
		}
		f.apply(&got[i].Batch)
		st.ReplayedBatches.Add(1)
		f.last, f.started, f.fresh = got[i].Seq, true, true
	}
}

// replay fetches the batches [from, until) from the worker's replay endpoint and applies
// them; it reports whether it got all of them.
func (f *follower) replay(from, until uint64) bool {
	st := f.s.stats
	st.Replays.Add(1)
	ctx, cancel := context.WithTimeout(f.m.ctx, 2*time.Second)
	defer cancel()
	got, err := kvevents.Replay(ctx, f.s.ep.Replay, from)
	if err != nil {
		f.m.lg.Warn("kv event replay failed", "worker", f.s.ep.WorkerID, "err", err)
	}
	complete := len(got) > 0 && got[0].Seq == from
	for i := range got {
		if got[i].Seq >= until {
			break
		}
		f.apply(&got[i].Batch)
		st.ReplayedBatches.Add(1)
		f.last = got[i].Seq
	}
	return complete || (from == 0 && len(got) > 0)
}

// apply changes the index and journals the changes, under the manager's apply lock.
func (f *follower) apply(b *kvevents.Batch) {
	m := f.m
	m.apply.Lock()
	defer m.apply.Unlock()
	st := f.s.stats
	st.Batches.Add(1)
	st.Events.Add(uint64(len(b.Events)))
	f.changed = m.index.Apply(f.s.ep.WorkerID, b, f.changed[:0])
	if len(f.changed) == 0 {
		return
	}
	slot := uint32(m.index.Slot(f.s.ep.WorkerID))
	f.changes = f.changes[:0]
	for _, c := range f.changed {
		op := journal.Stored
		if c.Removed {
			op = journal.Removed
		}
		f.changes = append(f.changes, journal.Change{Seq: c.Seq, Slot: slot, Tier: c.Tier, Op: op})
	}
	m.log.Append(f.changes...)
}

// String describes the stats for logs.
func (st *Stats) String() string {
	return fmt.Sprintf("batches=%d events=%d gaps=%d replays=%d restarts=%d stale=%d",
		st.Batches.Load(), st.Events.Load(), st.Gaps.Load(), st.Replays.Load(), st.Restarts.Load(), st.Stale.Load())
}
