package loadview

import (
	"context"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/engines"
)

// Target is one worker to watch.
type Target struct {
	// ID names the worker; States and Stats are keyed by it.
	ID string
	// URL is the engine's base URL (without /v1): the health probe and model discovery
	// go there.
	URL string
	// MetricsURL is where the engine serves its metrics; "" means URL + the adapter's
	// MetricsPath.
	MetricsURL string
	// Engine picks the adapter that reads the metrics and finds the model.
	Engine engines.Kind
}

// State is what the view knows about one worker.
type State struct {
	ID string
	// Healthy is false until the first successful poll, and after FailAfter consecutive
	// failed ones.
	Healthy bool
	// Load is the last successful scrape's; it is kept (and ObservedAt ages) while scrapes
	// fail.
	Load engines.Load
	// Model is what /v1/models said; zero until discovered.
	Model engines.Model
	// BlockSize and CapacityBlocks come from the load metrics when the engine reports them
	// (vLLM's cache_config_info, SGLang's page size and pages, TRT-LLM's tokens per block
	// and max blocks); once seen they are kept. Zero when never reported.
	BlockSize, CapacityBlocks int
	// ObservedAt is when Load was scraped; zero before the first successful scrape.
	ObservedAt time.Time
	// CheckedAt is when the last poll ended, successful or not.
	CheckedAt time.Time
	// ConsecutiveFailures counts the polls in a row in which neither the scrape nor the
	// health probe succeeded.
	ConsecutiveFailures int
	// LastError is the last poll's error: the scrape's, with the probe's when it failed
	// too. A worker may be Healthy with a LastError (its metrics fail, its /health
	// answers). "" after a successful scrape.
	LastError string
	// From is "" when this view polled the worker itself, else the replica whose reading
	// it took (Options.Delegated, PutRemote).
	From string
	// Seq numbers the publications of what a view polled itself, in order over all its
	// workers (Polled); a reading taken from another replica keeps that replica's number.
	Seq uint64
}

// Defaults for the zero Options.
const (
	DefaultInterval  = 100 * time.Millisecond
	DefaultTimeout   = time.Second
	DefaultFailAfter = 3
)

// Options configure a View. Zero values take the defaults.
type Options struct {
	// Interval is the time between two polls of a worker (DefaultInterval).
	Interval time.Duration
	// Timeout bounds each HTTP request of a poll: scrape, probe, model discovery
	// (DefaultTimeout, or Interval when that is longer).
	Timeout time.Duration
	// FailAfter is how many consecutive failed polls make a worker unhealthy
	// (DefaultFailAfter).
	FailAfter int
	// HTTPClient makes the requests; nil means a client of the View's own, whose idle
	// connections Close releases.
	HTTPClient *http.Client
	// Adapters maps each engine kind to its adapter (cmd/ builds it). A target whose kind
	// has none is only probed for health.
	Adapters engines.Adapters
	// Logger receives health changes and poll errors (slog.Default() when nil).
	Logger *slog.Logger
	// Now stamps ObservedAt and CheckedAt (time.Now when nil).
	Now func() time.Time
	// KernelWaiting, when set, is asked for each worker after a successful scrape: requests
	// seen waiting in front of the engine from the kernel (connections in its listener's
	// accept queue, from the eBPF probes), which the engine's own metrics cannot show yet.
	// They are added to Load.Waiting (after KernelLatencyWaiting's raise), so that routing
	// reacts to a backlog early. Called from
	// the pollers' goroutines; it must be safe for concurrent use and fast.
	KernelWaiting func(workerID string) (int, bool)
	// KernelLatencyWaiting, when set, is asked for each worker after a successful scrape too:
	// requests the worker's recent request-to-first-byte latency, measured in the kernel
	// (eBPF), implies waiting in front of it (a slow or overloaded engine whose own queue
	// metrics lag or do not show it). The engine's waiting count is raised to it, not added
	// to (a queue the engine reports is what makes its first byte late). Called like
	// KernelWaiting.
	KernelLatencyWaiting func(workerID string) (int, bool)
	// Delegated, when set, says which workers another replica polls: the poller of such a
	// worker takes that replica's readings (PutRemote) instead of polling, as long as one
	// no older than RemoteMaxAge is at hand, and polls on its own again when none is (the
	// other replica is gone, or no longer polls it). Called from the pollers' goroutines;
	// it must be safe for concurrent use and fast.
	Delegated func(workerID string) bool
	// RemoteMaxAge is how old another replica's reading may be and still stand for a poll
	// (default 3 × Interval).
	RemoteMaxAge time.Duration
}

func (o Options) withDefaults() Options {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Timeout <= 0 {
		o.Timeout = max(DefaultTimeout, o.Interval)
	}
	if o.FailAfter <= 0 {
		o.FailAfter = DefaultFailAfter
	}
	if o.RemoteMaxAge <= 0 {
		o.RemoteMaxAge = 3 * o.Interval
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// View holds the load and health of every worker Sync was given. New starts nothing; Sync
// starts one poller goroutine per target, owned by the View and stopped by Sync (when the
// target goes away or changes) or Close.
type View struct {
	opts      Options
	client    *http.Client
	transport *http.Transport // the View's own, when opts.HTTPClient was nil
	ctx       context.Context
	cancel    context.CancelFunc

	// syncMu serialises Sync and Close and guards pollers and closed. It is never taken by
	// a poller, so Sync may wait for one to stop while holding it.
	syncMu  sync.Mutex
	pollers map[string]*poller
	closed  bool

	// mu guards what pollers publish: states, stats and the changed channel's closing;
	// and the other replicas' readings (remote, by worker id) with the pollers' kicks.
	mu      sync.RWMutex
	states  map[string]State
	stats   map[string]*counters
	changed chan struct{}
	done    bool
	remote  map[string]State
	kicks   map[string]chan struct{}
	seq     uint64 // the last Seq given to a state this view polled
}

// New returns a View with no targets.
func New(opts Options) *View {
	opts = opts.withDefaults()
	v := &View{
		opts:    opts,
		client:  opts.HTTPClient,
		pollers: map[string]*poller{},
		states:  map[string]State{},
		stats:   map[string]*counters{},
		changed: make(chan struct{}, 1),
		remote:  map[string]State{},
		kicks:   map[string]chan struct{}{},
	}
	if v.client == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		// A poll may hold a scrape, a probe and a discovery to one host in turn; two idle
		// connections per worker spare redials.
		t.MaxIdleConnsPerHost = 2
		// and none is bounded across the fleet: at the default transport's 100 idle
		// connections in all, a view of 1,000 workers redialled most of them on every poll
		// (a tenth of a replica's CPU in connects at 1 s scrapes).
		t.MaxIdleConns = 0
		// Expositions are small next to the links they cross, and a gzip answer costs the
		// engine a compression and the view a decompression every Interval: on a
		// simulated worker on loopback, asking for gzip doubled the cost of a scrape
		// (BenchmarkScrape/http).
		t.DisableCompression = true
		v.transport = t
		v.client = &http.Client{Transport: t}
	}
	v.ctx, v.cancel = context.WithCancel(context.Background())
	return v
}

// Sync makes the pollers match targets: new targets start, targets gone stop (and leave the
// snapshot), changed ones restart with a fresh state (their counters carry on). Targets
// without an ID are ignored and logged; of several with one ID the last wins. Sync waits for
// the pollers it stops to exit. After Close it does nothing.
func (v *View) Sync(targets []Target) {
	want := make(map[string]Target, len(targets))
	for _, t := range targets {
		if t.ID == "" {
			v.opts.Logger.Error("load view: ignoring a target without an id", "url", t.URL)
			continue
		}
		want[t.ID] = t
	}
	v.syncMu.Lock()
	defer v.syncMu.Unlock()
	if v.closed {
		return
	}
	changed := false
	for id, p := range v.pollers {
		if t, ok := want[id]; ok && t == p.target {
			continue
		}
		p.stop()
		delete(v.pollers, id)
		v.mu.Lock()
		delete(v.states, id)
		delete(v.kicks, id)
		if _, ok := want[id]; !ok {
			delete(v.remote, id)
		}
		if _, ok := want[id]; !ok {
			delete(v.stats, id)
		}
		v.mu.Unlock()
		changed = true
	}
	for id, t := range want {
		if _, ok := v.pollers[id]; ok {
			continue
		}
		p := v.newPoller(t)
		v.pollers[id] = p
		v.mu.Lock()
		v.states[id] = p.st
		if v.stats[id] == nil {
			v.stats[id] = &counters{}
		}
		p.stats = v.stats[id]
		v.kicks[id] = p.kick
		v.mu.Unlock()
		p.start(v.ctx)
		changed = true
	}
	if changed {
		v.mu.Lock()
		v.notifyLocked()
		v.mu.Unlock()
	}
}

// Snapshot returns a copy of every worker's state, keyed by ID. The map and the states are
// the caller's.
func (v *View) Snapshot() map[string]State {
	v.mu.RLock()
	defer v.mu.RUnlock()
	out := make(map[string]State, len(v.states))
	for id, s := range v.states {
		out[id] = s.clone()
	}
	return out
}

// Get returns one worker's state (a copy), false when the view has no such target.
func (v *View) Get(id string) (State, bool) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	s, ok := v.states[id]
	return s.clone(), ok
}

// IDs returns the targets' IDs, sorted.
func (v *View) IDs() []string {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return slices.Sorted(maps.Keys(v.states))
}

// PutRemote takes other replicas' readings of workers (each with From naming the replica
// and its times in this host's clock): the poller of a worker that Options.Delegated names
// takes the newest at once, and at each poll while it is no older than RemoteMaxAge. Readings
// of workers the view does not watch are dropped.
func (v *View) PutRemote(states []State) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, s := range states {
		kick, ok := v.kicks[s.ID]
		if !ok || s.From == "" {
			continue
		}
		if cur, ok := v.remote[s.ID]; ok && (cur.From == s.From && cur.Seq == s.Seq || cur.CheckedAt.After(s.CheckedAt)) {
			continue // the reading at hand, or one older (a replica that restarted numbers from 1 again)
		}
		v.remote[s.ID] = s.clone()
		select {
		case kick <- struct{}{}:
		default:
		}
	}
}

// Polled returns the states of the workers this view polled itself (From "") published
// after Seq after and polled within RemoteMaxAge, and the last Seq given: what it shares
// with the other replicas, each asking for what came after the last Seq it was given.
func (v *View) Polled(after uint64) ([]State, uint64) {
	now := v.opts.Now()
	v.mu.RLock()
	defer v.mu.RUnlock()
	var out []State
	for _, s := range v.states {
		if s.From == "" && s.Seq > after && !s.CheckedAt.IsZero() && now.Sub(s.CheckedAt) <= v.opts.RemoteMaxAge {
			out = append(out, s.clone())
		}
	}
	return out, v.seq
}

// remoteFor returns the newest other replica's reading of worker id.
func (v *View) remoteFor(id string) (State, bool) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	s, ok := v.remote[id]
	return s, ok
}

// Changed returns a channel that receives a value (coalesced: it holds at most one) after a
// worker's state changed in a way that matters for routing: its health flipped, its running
// or waiting count changed, its KV usage moved by more than a percentage point since the
// last signal, its model, block size or capacity was discovered or changed, or the target
// was added or removed. Read Snapshot after receiving. The channel is closed by Close.
func (v *View) Changed() <-chan struct{} { return v.changed }

// Close stops every poller and waits for them; the View keeps its last states. Changed's
// channel is closed. Close is safe to call more than once.
func (v *View) Close() {
	v.syncMu.Lock()
	defer v.syncMu.Unlock()
	if v.closed {
		return
	}
	v.closed = true
	v.cancel()
	for _, p := range v.pollers {
		<-p.done
	}
	v.mu.Lock()
	v.done = true
	close(v.changed)
	v.mu.Unlock()
	if v.transport != nil {
		v.transport.CloseIdleConnections()
	}
}

// notifyLocked raises the Changed signal. v.mu must be held (for writing).
func (v *View) notifyLocked() {
	if v.done {
		return
	}
	select {
	case v.changed <- struct{}{}:
	default:
	}
}

// publish stores a poller's state and raises the signal when it matters.
func (v *View) publish(s State, signal bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if s.From == "" {
		v.seq++
		s.Seq = v.seq
	}
	v.states[s.ID] = s
	if signal {
		v.notifyLocked()
	}
}

func (s State) clone() State {
	s.Model.IDs = slices.Clone(s.Model.IDs)
	return s
}
