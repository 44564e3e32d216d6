// Package ingest feeds the control plane's KV index from every worker's KV events: a
// subscriber per worker that dials its publisher (vLLM binds by default), or one subscriber per
// bound endpoint for publishers that connect out, shared by every worker that names it and
// told apart by topic; sequence tracking per worker with replay through the worker's ROUTER
// endpoint when events were lost; and the journal of index changes that proxies follow.
package ingest

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/xds"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// Endpoint is where one worker publishes its KV events.
type Endpoint struct {
	WorkerID string
	// Address is the ZMQ endpoint: the publisher's (dial) or a local one to bind.
	Address string
	// Bind binds Address and waits for publishers that connect out. Several workers may
	// name the same bound Address: one subscriber binds it and hands each message to the
	// worker whose Topic it carries.
	Bind bool
	// Topic is the topic frame of the worker's messages. On a bound endpoint it is what
	// tells the worker's messages from those of others sharing it, usually DefaultTopic of
	// its URL and model (llm-d's convention); a Topic ending in "@" (the model not known)
	// matches every model. When dialling, a non-empty Topic is the subscription prefix.
	Topic string
	// TopicGiven says the operator named Topic. A worker alone on its bound endpoint whose
	// topic was derived takes messages of any topic, as publishers that do not follow the
	// convention send them.
	TopicGiven bool
	// Replay is the worker's ROUTER replay endpoint, "" when it has none.
	Replay string
}

// DefaultTopic is the topic of a worker's KV events in llm-d's convention,
// kv@<host:port>@<model>, from its base URL and model ("" when the URL has no host). With
// the model unknown it ends in "@", which Endpoint reads as any model.
func DefaultTopic(baseURL, model string) string {
	u, err := url.Parse(baseURL)
	if err != nil || u.Host == "" {
		return ""
	}
	return "kv@" + u.Host + "@" + model
}

// Manager runs the subscribers and applies their events to the index and the journal. Sync
// (from the registry's goroutine) starts and stops workers' subscriptions; each socket runs
// on its own goroutine, owned by the Manager and stopped by Close, or by Sync once no worker
// uses it.
type Manager struct {
	index *kvindex.Index
	log   *journal.Log
	lg    *slog.Logger

	// apply serialises index changes with their journal entries, so that the journal's order
	// is the index's.
	apply sync.Mutex

	mu      sync.Mutex
	running map[string]*subscription // by worker id
	sockets map[string]*socket       // by socketKey
	wg      sync.WaitGroup
	ctx     context.Context
	cancel  context.CancelFunc
}

// subscription is one worker's share of a socket.
type subscription struct {
	ep     Endpoint
	sock   *socket
	f      *follower
	cancel context.CancelFunc // ends the catch-up at start
	caught sync.WaitGroup
	stats  *Stats
}

// socket is one ZMQ SUB socket and the workers whose messages arrive on it: one worker when
// it dials, any number when it binds. Its goroutine hands each message to a follower.
type socket struct {
	key, address string
	bind         bool
	sub          *kvevents.Subscriber
	cancel       context.CancelFunc
	done         chan struct{}
	ready        chan struct{} // closed once the subscriber is bound or connected

	// followers is swapped whole under the Manager's mu and read by the socket's goroutine.
	followers atomic.Pointer[[]*follower]
	// unclaimed counts messages on a bound endpoint whose topic no worker claims; logged
	// remembers the first few such topics, logged once each.
	unclaimed atomic.Uint64
	logged    map[string]bool
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
	return &Manager{index: index, log: log, lg: lg, running: map[string]*subscription{},
		sockets: map[string]*socket{}, ctx: ctx, cancel: cancel}
}

func socketKey(ep Endpoint) string {
	if ep.Bind {
		return "bind " + ep.Address
	}
	return "dial " + ep.WorkerID + " " + ep.Address
}

// Sync makes the set of running subscriptions match eps: new workers start, gone ones stop
// and lose their blocks, changed endpoints restart. A bound endpoint stays bound while any
// worker names it, so a worker joining or leaving costs the others no events.
func (m *Manager) Sync(eps []Endpoint) {
	want := map[string]Endpoint{}
	topics := map[[2]string]string{}
	for _, ep := range eps {
		if ep.Address == "" {
			continue
		}
		want[ep.WorkerID] = ep
		if ep.Bind {
			k := [2]string{ep.Address, ep.Topic}
			if other, dup := topics[k]; dup {
				m.lg.Error("two workers share a kv event endpoint and topic; the first takes its messages", "endpoint", ep.Address, "topic", ep.Topic, "workers", []string{other, ep.WorkerID})
			} else {
				topics[k] = ep.WorkerID
			}
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

// RemoveWorker stops a worker's subscription and drops its blocks.
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
	s.caught.Wait()
	delete(m.running, id)
	sock := s.sock
	sock.remove(s.f)
	// No emit reaches the follower from here on: it is out of the socket's table, and one
	// under way finishes before stop takes its lock.
	s.f.stop()
	if len(*sock.followers.Load()) == 0 {
		sock.cancel()
		<-sock.done
		delete(m.sockets, sock.key)
	}
	m.drop(id, forget)
}

// drop removes a worker's blocks from the index and journals it: its slot cleared, then,
// for a worker that stays, the blocks of the shared storage it mounts credited again.
func (m *Manager) drop(id string, forget bool) {
	m.apply.Lock()
	defer m.apply.Unlock()
	slot := m.index.Slot(id)
	var changed []kvindex.Change
	if forget {
		changed = m.index.RemoveWorker(id, nil)
	} else {
		changed = m.index.Clear(id, nil)
	}
	cs := []journal.Change{{Slot: uint32(slot), Op: journal.Cleared}}
	for _, c := range changed {
		if !c.Removed && !c.Cleared {
			cs = append(cs, journal.Change{Seq: c.Seq, Slot: uint32(c.Slot), Tier: c.Tier, Op: journal.Stored})
		}
	}
	// The worker's mark goes with its blocks: a proxy that comes from another replica with
	// a mark from before the clear gets the slot filled again, not a replay that could miss
	// the clear. Its next events mark it again.
	m.log.Forget(uint32(slot), cs...)
}

func (m *Manager) startLocked(ep Endpoint) {
	sock := m.sockets[socketKey(ep)]
	if sock == nil {
		sock = m.startSocketLocked(ep)
	}
	ctx, cancel := context.WithCancel(m.ctx)
	s := &subscription{ep: ep, sock: sock, cancel: cancel, stats: &Stats{}}
	s.f = &follower{m: m, s: s, check: xds.IDCheck(ep.WorkerID), slot: -1}
	m.running[ep.WorkerID] = s
	sock.add(s.f)
	// A control plane that starts (or restarts) after its engines rebuilds their part of the
	// index at once from what they buffer for replay, rather than at their next event. It
	// asks once the socket is up, so that nothing published in between is missed (a worker
	// that then stays idle would never show the gap).
	if ep.Replay == "" {
		s.stats.CaughtUp.Store(true)
		return
	}
	s.caught.Add(1)
	go func() {
		defer s.caught.Done()
		select {
		case <-sock.ready:
		case <-ctx.Done():
			return
		}
		s.f.catchUp(ctx)
		s.stats.CaughtUp.Store(true)
	}()
}

func (m *Manager) startSocketLocked(ep Endpoint) *socket {
	ctx, cancel := context.WithCancel(m.ctx)
	sock := &socket{key: socketKey(ep), address: ep.Address, bind: ep.Bind, cancel: cancel,
		done: make(chan struct{}), ready: make(chan struct{}), logged: map[string]bool{}}
	sock.followers.Store(&[]*follower{})
	m.sockets[sock.key] = sock
	cfg := kvevents.SubscriberConfig{Endpoint: ep.Address, Bind: ep.Bind}
	if !ep.Bind {
		cfg.Topic = ep.Topic
	}
	sub, err := kvevents.NewSubscriber(cfg)
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer close(sock.done)
		if err != nil {
			m.lg.Error("kv event subscriber not started", "endpoint", ep.Address, "worker", ep.WorkerID, "err", err)
			return
		}
		sock.sub = sub
		go func() {
			select {
			case <-sub.Ready():
				close(sock.ready)
			case <-ctx.Done():
			}
		}()
		for ctx.Err() == nil {
			if err := sub.RunTopics(ctx, sock.emit(m)); err != nil {
				m.lg.Warn("kv event subscriber stopped; retrying", "endpoint", ep.Address, "err", err)
				select {
				case <-ctx.Done():
				case <-time.After(time.Second):
				}
			}
		}
	}()
	return sock
}

// add and remove change the socket's followers; the Manager's mu serialises them.
func (sock *socket) add(f *follower) {
	old := *sock.followers.Load()
	next := append(append(make([]*follower, 0, len(old)+1), old...), f)
	sock.followers.Store(&next)
}

func (sock *socket) remove(f *follower) {
	old := *sock.followers.Load()
	next := make([]*follower, 0, len(old))
	for _, x := range old {
		if x != f {
			next = append(next, x)
		}
	}
	sock.followers.Store(&next)
}

// maxLoggedTopics bounds the unclaimed topics a socket logs (each once).
const maxLoggedTopics = 16

// emit returns the socket's handler: it finds the follower a message is for and hands it
// the batch. It runs on the socket's goroutine.
func (sock *socket) emit(m *Manager) func(topic []byte, seq uint64, b *kvevents.Batch) {
	return func(topic []byte, seq uint64, b *kvevents.Batch) {
		f := sock.route(topic)
		if f == nil {
			sock.unclaimed.Add(1)
			if len(sock.logged) < maxLoggedTopics && !sock.logged[string(topic)] {
				sock.logged[string(topic)] = true
				m.lg.Warn("kv events for a topic no worker claims; dropped", "endpoint", sock.address, "topic", string(topic))
			}
			return
		}
		f.emit(seq, b)
	}
}

// route picks the follower for a message's topic: on a dialled socket its only worker; on a
// bound one the worker whose topic it is (exactly, or by its kv@<host:port>@ prefix when
// the worker's model is not known), or the only worker when that worker's topic was not
// given. nil: nobody claims it.
func (sock *socket) route(topic []byte) *follower {
	fs := *sock.followers.Load()
	if !sock.bind {
		if len(fs) == 0 {
			return nil
		}
		return fs[0]
	}
	for _, f := range fs {
		if t := f.s.ep.Topic; t != "" && string(topic) == t {
			return f
		}
	}
	for _, f := range fs {
		if t := f.s.ep.Topic; strings.HasSuffix(t, "@") && strings.HasPrefix(string(topic), t) {
			return f
		}
	}
	if len(fs) == 1 && !fs[0].s.ep.TopicGiven {
		return fs[0]
	}
	return nil
}

// Stats returns a worker's counters, nil for a worker without a subscription.
func (m *Manager) Stats(id string) *Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.running[id]; ok {
		return s.stats
	}
	return nil
}

// Unclaimed returns, per bound endpoint, the messages dropped because no worker claims
// their topic.
func (m *Manager) Unclaimed() map[string]uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]uint64{}
	for _, sock := range m.sockets {
		if sock.bind {
			out[sock.address] = sock.unclaimed.Load()
		}
	}
	return out
}

// Close stops every subscription.
func (m *Manager) Close() {
	m.cancel()
	m.mu.Lock()
	for _, s := range m.running {
		s.caught.Wait()
	}
	m.mu.Unlock()
	m.wg.Wait()
}

// follower tracks one worker's sequence numbers. Its emit runs on the socket's goroutine,
// its catch-up at start on the subscription's.
type follower struct {
	mu      sync.Mutex // emit, the catch-up at start and stop
	m       *Manager
	s       *subscription
	stopped bool
	last    uint64
	started bool
	// fresh is true after catchUp until the first live batch: live batches the replay
	// already covered are skipped, not taken for an engine restart.
	fresh   bool
	changed []kvindex.Change
	changes []journal.Change
	// check is the worker id's check and slot its index slot (-1 until its first batch),
	// for the journal's marks; since is the first batch the index holds the worker's blocks
	// from (covered once set: at the first batch applied, and again after a drop).
	check   uint32
	slot    int
	since   uint64
	covered bool
}

// stop makes every later emit and catch-up a no-op.
func (f *follower) stop() {
	f.mu.Lock()
	f.stopped = true
	f.mu.Unlock()
}

func (f *follower) emit(seq uint64, b *kvevents.Batch) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return
	}
	st := f.s.stats
	now := time.Now().UnixNano()
	st.LastEventUnixNano.Store(now)
	switch {
	case f.fresh && seq <= f.last:
		return // already applied from the replay
	case !f.started:
		// The control plane may have started after the engine: what the engine still
		// buffers for replay rebuilds the index from before this batch.
		f.started = true
		if seq > 0 && f.s.ep.Replay != "" {
			f.replay(0, seq, now)
		}
	case seq <= f.last:
		// The sequence went back: the engine restarted and its cache is empty.
		st.Restarts.Add(1)
		f.m.drop(f.s.ep.WorkerID, false)
		f.covered = false
	case seq > f.last+1:
		st.Gaps.Add(1)
		if f.s.ep.Replay == "" || !f.replay(f.last+1, seq, now) {
			// Lost for good: what the index holds for this worker can no longer be
			// trusted. Start over from the events that come next.
			st.Stale.Add(1)
			f.m.lg.Warn("kv events lost; worker's index rebuilt from new events", "worker", f.s.ep.WorkerID, "from", f.last+1, "to", seq)
			f.m.drop(f.s.ep.WorkerID, false)
			f.covered = false
		}
	}
	f.fresh = false
	f.apply(seq, b, now)
	f.last = seq
}

// catchUp applies everything the engine buffers for replay. It fetches without holding the
// follower's lock, so that a socket shared with other workers keeps delivering theirs; live
// batches that arrive meanwhile apply first and the replay skips what they covered.
func (f *follower) catchUp(ctx context.Context) {
	st := f.s.stats
	st.Replays.Add(1)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	got, err := kvevents.Replay(ctx, f.s.ep.Replay, 0)
	now := time.Now().UnixNano()
	if err != nil {
		f.m.lg.Debug("kv event replay at start failed; the index follows new events", "worker", f.s.ep.WorkerID, "err", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return
	}
	for i := range got {
		if f.started && got[i].Seq <= f.last {
			continue
		}
		f.apply(got[i].Seq, &got[i].Batch, now)
		st.ReplayedBatches.Add(1)
		f.last, f.started, f.fresh = got[i].Seq, true, true
	}
}

// replay fetches the batches [from, until) from the worker's replay endpoint and applies
// them, all or none, as arrived with the live batch at (unix nanoseconds) that showed them
// missing: it reports whether the engine still held every one of them, in order
// (a batch it never buffered, or dropped, leaves a hole no later batch makes good). From 0
// (the control plane started after the engine) the engine's buffer may begin later, but
// must run unbroken from there to until.
func (f *follower) replay(from, until uint64, at int64) bool {
	st := f.s.stats
	st.Replays.Add(1)
	ctx, cancel := context.WithTimeout(f.m.ctx, 2*time.Second)
	defer cancel()
	got, err := kvevents.Replay(ctx, f.s.ep.Replay, from)
	if err != nil {
		f.m.lg.Warn("kv event replay failed", "worker", f.s.ep.WorkerID, "err", err)
	}
	n := 0
	for n < len(got) && got[n].Seq < until {
		n++
	}
	if n == 0 {
		return false
	}
	want := from
	if from == 0 {
		want = got[0].Seq
	}
	for i := range n {
		if got[i].Seq != want {
			return false
		}
		want++
	}
	if want != until {
		return false
	}
	for i := range n {
		f.apply(got[i].Seq, &got[i].Batch, at)
		st.ReplayedBatches.Add(1)
		f.last = got[i].Seq
	}
	return true
}

// apply changes the index and journals the changes of the worker's batch seq, arrived at
// unix nanosecond at, with the worker's mark, under the manager's apply lock.
func (f *follower) apply(seq uint64, b *kvevents.Batch, at int64) {
	m := f.m
	m.apply.Lock()
	defer m.apply.Unlock()
	st := f.s.stats
	st.Batches.Add(1)
	st.Events.Add(uint64(len(b.Events)))
	f.changed = m.index.Apply(f.s.ep.WorkerID, b, f.changed[:0])
	if f.slot < 0 {
		// A follower's worker keeps its slot: it leaves the index only once the follower
		// has stopped.
		f.slot = m.index.Slot(f.s.ep.WorkerID)
	}
	if !f.covered {
		f.since, f.covered = seq, true
	}
	f.changes = f.changes[:0]
	for _, c := range f.changed {
		op := journal.Stored
		switch {
		case c.Cleared:
			op = journal.Cleared
		case c.Removed:
			op = journal.Removed
		}
		f.changes = append(f.changes, journal.Change{Seq: c.Seq, Slot: uint32(c.Slot), Tier: c.Tier, Op: op})
	}
	m.log.AppendMarked(at, journal.Mark{Slot: uint32(f.slot), Check: f.check, Seq: seq, Since: f.since}, f.changes...)
}

// String describes the stats for logs.
func (st *Stats) String() string {
	return fmt.Sprintf("batches=%d events=%d gaps=%d replays=%d restarts=%d stale=%d",
		st.Batches.Load(), st.Events.Load(), st.Gaps.Load(), st.Replays.Load(), st.Restarts.Load(), st.Stale.Load())
}
