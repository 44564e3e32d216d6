package decide

import (
	"fmt"
	"io"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/dataplane/clock"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// Tokenizer modes besides a tokenizer spec (see engines/tokenizer.New).
const (
	// TokenizerRemote posts each prompt to a worker's /tokenize (chat messages as they are,
	// so the engine applies its own template).
	TokenizerRemote = "remote"
	// TokenizerEstimate counts about four bytes per token and hashes the rendered text in
	// fixed byte blocks: approximate, but needs no tokenizer at all.
	TokenizerEstimate = "estimate"
)

// Disaggregation modes.
const (
	// DisaggAuto splits chat and text completions into a prefill leg and a decode leg
	// whenever the pool has prefill-role and decode-role workers for the model.
	DisaggAuto = "auto"
	// DisaggOff never splits: prefill and decode workers take no requests.
	DisaggOff = "off"
)

// SampleEvery is how often a request's decision is sampled: one in SampleEvery has its
// stages timed (kvrelay_proxy_decision_seconds) and its decision recorded (Decisions). A
// carrier counts its own requests (Request.Start's timed).
const SampleEvery = 8

// Config is what the routing core needs of its owner's configuration.
type Config struct {
	// BlockSize is the engines' KV block size in tokens.
	BlockSize int
	// Tokenizer and ChatTemplate pick the prompt pipeline of each model (a spec,
	// TokenizerRemote or TokenizerEstimate; empty: by model). TokenCacheTokens bounds the
	// cache of tokenized prompt segments, and of a remote tokenizer's answers.
	Tokenizer, ChatTemplate string
	TokenCacheTokens        int
	// RemoteTimeout bounds one /tokenize round trip.
	RemoteTimeout time.Duration
	// IndexBlocks and IndexTTL bound the core's own prefix index: where it sent prompts.
	IndexBlocks int
	IndexTTL    time.Duration
	// QueueSize and QueueTimeout bound the admission queue.
	QueueSize    int
	QueueTimeout time.Duration
	// Disagg and DisaggThreshold are the disaggregation settings until a control plane's
	// policy sets them (SetPolicy); DisaggMaxQueue is the prefill tokens past which a
	// prefill worker counts as saturated (0: never).
	Disagg          string
	DisaggThreshold int
	DisaggMaxQueue  int64
	// EjectAfter consecutive failures take a worker out for EjectFor.
	EjectAfter int
	EjectFor   time.Duration
	// ForwardPriority puts a request's priority into the engine's own field of the body a
	// pick hands on (negated: vLLM runs lower values first).
	ForwardPriority bool
	// BusyRequests is the busy filter's requests per worker (0: none), and TenantHeadroom
	// the slots of each worker a tenant running its share or more may not take (SetTenant).
	BusyRequests, TenantHeadroom int64
}

// Core is the routing core: the state every decision reads (the workers and their load,
// the routers and their policies, a rollout's candidate, the prefix index, the tokenizers,
// the admission queue, the sampled decisions) and the metrics they feed. Its owner builds
// it (NewCore, Build), keeps its workers and policies current (SetWorkers, SetPool,
// SetPolicy, ApplyCandidate: one goroutine at a time) and hands it to the carriers of its
// requests: each Request, and each Pick, decides through it. Everything the request path
// reads is an immutable snapshot behind an atomic pointer or a router safe for concurrent
// use, so any number of loops and streams decide at once.
type Core struct {
	cfg   Config
	log   *slog.Logger
	m     *metrics
	index *prefix.Approx
	kv    *route.Router // chat and text completions
	load  *route.Router // embeddings and responses: by load

	workers atomic.Pointer[[]*WorkerState]    // by route.Worker.Index
	codecs  atomic.Pointer[map[string]*codec] // by model; "" is the default
	queue   *admissionQueue
	// decisions keeps sampled routing decisions (explain.go).
	decisions decisionLog
	remote    *remoteTokenizer
	// query, when set, is asked about every prompt before it is routed (SetIndexQuery).
	query atomic.Pointer[IndexQuery]
	// stableArm are the series of the policy routing now; cand a rollout's candidate beside
	// it (rollout.go).
	stableArm atomic.Pointer[armSeries]
	cand      atomic.Pointer[candidate]
	pdSet     atomic.Pointer[disaggSettings]

	// draining refuses new requests; inflight counts those its carriers still carry.
	draining atomic.Bool
	inflight atomic.Int64
	// picks samples the picks whose decisions are timed and recorded.
	picks atomic.Uint64
	// tenantMu guards tenantRunning, each tenant's requests dispatched and not yet settled.
	tenantMu      sync.Mutex
	tenantRunning map[string]int64
}

// disaggSettings are the disaggregation settings in force: the owner's configuration, or
// the routing policy's when a control plane sets them.
type disaggSettings struct {
	mode      string
	threshold int
}

// WorkerState is the core's state of one worker beside the router's Worker: its series.
type WorkerState struct {
	W *route.Worker
	m *workerMetrics
}

// NewCore builds a routing core from cfg, registering its series on reg. It routes nothing
// until Build.
func NewCore(cfg Config, reg prometheus.Registerer, log *slog.Logger) *Core {
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	c := &Core{
		cfg:   cfg,
		log:   log,
		m:     newMetrics(reg),
		index: prefix.NewApprox(prefix.ApproxConfig{MaxBlocks: cfg.IndexBlocks, TTL: cfg.IndexTTL}),
	}
	c.codecs.Store(&map[string]*codec{})
	c.workers.Store(&[]*WorkerState{})
	c.queue = newAdmissionQueue(cfg.QueueSize, c.m)
	c.remote = newRemoteTokenizer(cfg.RemoteTimeout, cfg.TokenCacheTokens)
	for result, n := range map[string]*atomic.Uint64{"hit": &c.remote.hits, "prefix": &c.remote.prefixHits, "miss": &c.remote.misses} {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvrelay_proxy_remote_tokenize_total", ConstLabels: prometheus.Labels{"result": result},
			Help: "Prompts tokenized by an engine's /tokenize, by how the cache served them: hit (the whole request), prefix (routed at once on its conversation's earlier tokens, its own fetched in the background) or miss (routed after the round trip).",
		}, func() float64 { return float64(n.Load()) }))
	}
	c.pdSet.Store(&disaggSettings{mode: cfg.Disagg, threshold: cfg.DisaggThreshold})
	return c
}

// Build builds the router of chat and text completions over pool with cfg, matching
// prompts against match, and the load-only router of the other routes; version names the
// policy in the series (a static proxy's is "local"). It loads the tokenizers of pool's
// models. Call it once, before any request.
func (c *Core) Build(pool *route.Pool, match prefix.Index, cfg route.Config, version string) error {
	var err error
	if c.kv, err = route.NewRouter(cfg, pool, match); err != nil {
		return err
	}
	c.setRegretLabels(cfg.Policy, version)
	if c.load, err = route.NewRouter(loadConfig(cfg), pool, nil); err != nil {
		return err
	}
	return c.BuildCodecs(pool)
}

// loadConfig is the policy of the routes without a prompt to match (embeddings, responses)
// beside the kv router's cfg: least loaded, except that baselines stay baselines on every
// route.
func loadConfig(cfg route.Config) route.Config {
	if cfg.Policy != route.PolicyRoundRobin && cfg.Policy != route.PolicyRandom {
		cfg.Policy = route.PolicyLeastLoaded
	}
	cfg.Profile = nil // a profile's scorers weigh prompts; these requests have none
	return cfg
}

// Index is the core's own prefix index: where it sent prompts (a control plane's replica
// is overlaid on it by the owner).
func (c *Core) Index() *prefix.Approx { return c.index }

// SetIndexQuery makes every request whose prompt the routers match against an index ask q
// about it first (Prepare's and Resume's ErrIndex): for a routers' index that answers from
// what q kept (prefix.Remote). nil stops it.
func (c *Core) SetIndexQuery(q IndexQuery) {
	if q == nil {
		c.query.Store(nil)
		return
	}
	c.query.Store(&q)
}

// KV is the router of chat and text completions; Load that of the other routes.
func (c *Core) KV() *route.Router   { return c.kv }
func (c *Core) Load() *route.Router { return c.load }

// Pool is the pool of workers the core routes over now.
func (c *Core) Pool() *route.Pool { return c.kv.Pool() }

// RoutingPolicy is the policy chat and text completions route with now.
func (c *Core) RoutingPolicy() *route.Policy { return c.kv.Policy() }

// NewWorkerState returns the state of a worker new to the core, with its series.
func (c *Core) NewWorkerState(w *route.Worker) *WorkerState {
	return &WorkerState{W: w, m: c.m.forWorker(w.ID)}
}

// With returns the state of w that keeps st's series: the same worker id with a changed
// identity (address, model, limits).
func (st *WorkerState) With(w *route.Worker) *WorkerState { return &WorkerState{W: w, m: st.m} }

// WorkerStates returns the worker states by route.Worker.Index; the slice must not be
// altered (SetWorkers takes a new one).
func (c *Core) WorkerStates() []*WorkerState { return *c.workers.Load() }

// SetWorkers publishes the worker states, by route.Worker.Index: before the pool that
// holds those workers (SetPool), so that a request that sees the pool finds every state.
func (c *Core) SetWorkers(states []*WorkerState) { c.workers.Store(&states) }

// workerState returns the core's state of worker w.
func (c *Core) workerState(w *route.Worker) *WorkerState {
	return (*c.workers.Load())[w.Index]
}

// SetPool makes every router, a candidate's too, route over pool.
func (c *Core) SetPool(pool *route.Pool) {
	c.kv.SetPool(pool)
	c.load.SetPool(pool)
	if cand := c.cand.Load(); cand != nil {
		cand.router.SetPool(pool)
	}
}

// SetPolicy makes chat and text completions route with cfg, under policy version version
// (its series' label), the other routes by load; disagg and threshold are the
// disaggregation settings that come with it.
func (c *Core) SetPolicy(cfg route.Config, version uint64, disagg string, threshold int) error {
	if err := c.kv.SetPolicy(cfg); err != nil {
		return err
	}
	c.setRegretLabels(cfg.Policy, strconv.FormatUint(version, 10))
	_ = c.load.SetPolicy(loadConfig(cfg))
	c.pdSet.Store(&disaggSettings{mode: disagg, threshold: threshold})
	return nil
}

// Drain makes the core refuse new requests (Draining); those in flight go on.
func (c *Core) Drain() { c.draining.Store(true) }

// Draining reports whether new requests are refused.
func (c *Core) Draining() bool { return c.draining.Load() }

// Enter and Leave count a request its carrier holds (from its dispatch, or any work off the
// carrier's own goroutine, to its end); InFlight is their number, which a graceful stop
// waits for.
func (c *Core) Enter()          { c.inflight.Add(1) }
func (c *Core) Leave()          { c.inflight.Add(-1) }
func (c *Core) InFlight() int64 { return c.inflight.Load() }

// Expire answers the queued requests past their deadline and nudges the queue (the owner's
// ticker calls it).
func (c *Core) Expire(now int64) { c.queue.expire(now) }

// Blame counts a failure of w at now against it: past after in a row it is taken out for
// the configured EjectFor (counted, and logged with why).
func (c *Core) Blame(w *route.Worker, now int64, after int, why string) {
	if w.Failed(now, after, c.cfg.EjectFor) {
		c.workerState(w).m.ejections.Inc()
		c.log.Warn(why, "worker", w.ID, "for", c.cfg.EjectFor)
	}
}

// PeerFetch counts a request sent to a worker told to pull its prefix from a peer.
func (c *Core) PeerFetch() { c.m.peerFetches.Inc() }

// Recompute counts a request sent to a worker told to compute what it caches below GPU
// memory rather than load it back.
func (c *Core) Recompute() { c.m.recomputes.Inc() }

// UnknownResponse counts a request naming a stored response its owner did not see.
func (c *Core) UnknownResponse() { c.m.affinity.WithLabelValues("unknown").Inc() }

// ModelLabel is the metrics label of a requested model: one of the pool's models, so client
// input cannot create series.
func (c *Core) ModelLabel(model []byte) string {
	for _, m := range c.kv.Pool().Models() {
		if string(model) == m {
			return m
		}
	}
	return "other"
}

// retryAfterNoWorker is the Retry-After, in seconds, of a request of model no worker can
// take now: until the first ejected worker of the model may be probed again, or a second
// when none is ejected (health comes back with the next check or report).
func (c *Core) retryAfterNoWorker(model string, now int64) int {
	soonest := time.Duration(0)
	for _, w := range c.kv.Pool().Workers {
		if w.Model != model {
			continue
		}
		if d := w.EjectedFor(now); d > 0 && (soonest == 0 || d < soonest) {
			soonest = d
		}
	}
	return clampRetryAfter(int(math.Ceil(soonest.Seconds())))
}

// codec is one model's prompt pipeline.
type codec struct {
	mode string // "" (in-process), TokenizerRemote or TokenizerEstimate
	tok  tokenizer.Tokenizer
	tmpl tokenizer.Template
}

func newCodec(model, tokSpec, tmplSpec string, cacheTokens int) (*codec, error) {
	if tokSpec == TokenizerRemote || tokSpec == TokenizerEstimate {
		// The template renders text to estimate from (remote mode falls back to estimating
		// when an engine cannot tokenize).
		c := &codec{mode: tokSpec}
		_, defTmpl := tokenizer.ModelSpecs(model)
		if tmplSpec == "" {
			tmplSpec = defTmpl
		}
		t, err := tokenizer.NewTemplate(tmplSpec)
		if err != nil {
			return nil, fmt.Errorf("loading the chat template of %q: %w", model, err)
		}
		c.tmpl = t
		return c, nil
	}
	defTok, defTmpl := tokenizer.ModelSpecs(model)
	if tokSpec == "" {
		tokSpec = defTok
	}
	if tmplSpec == "" {
		tmplSpec = defTmpl
	}
	cd, err := tokenizer.NewCodec(tokSpec, tmplSpec)
	if err != nil {
		return nil, fmt.Errorf("loading the codec of %q: %w", model, err)
	}
	return &codec{tok: tokenizer.NewSegmentCache(cd.Tokenizer, cacheTokens, 64), tmpl: cd.Template}, nil
}

// BuildCodecs loads the tokenizer and chat template of every model the pool serves that has
// none yet, and publishes the codecs (copy on write: requests read them without a lock).
// Only one goroutine at a time builds: Build, or the owner's updates.
func (c *Core) BuildCodecs(pool *route.Pool) error {
	old := *c.codecs.Load()
	next := make(map[string]*codec, len(old)+len(pool.Models())+1)
	for m, cd := range old {
		next[m] = cd
	}
	models := append([]string{""}, pool.Models()...)
	for _, m := range models {
		if _, adapter := pool.Adapter(m); next[m] != nil || adapter {
			continue
		}
		cd, err := newCodec(m, c.cfg.Tokenizer, c.cfg.ChatTemplate, c.cfg.TokenCacheTokens)
		if err != nil {
			return err
		}
		next[m] = cd
	}
	// A LoRA adapter tokenizes as its base model.
	for _, m := range models {
		if base, ok := pool.Adapter(m); ok && next[base] != nil {
			next[m] = next[base]
		}
	}
	c.codecs.Store(&next)
	return nil
}

// codecFor returns the codec of model, or the default one.
func (c *Core) codecFor(model []byte) *codec {
	codecs := *c.codecs.Load()
	if cd, ok := codecs[string(model)]; ok {
		return cd
	}
	return codecs[""]
}

// PickAny picks the least loaded healthy worker for a request without a body (nothing to
// route on), among subset when hasSubset (entries as a pick's subset hint takes them).
func (c *Core) PickAny(subset []string, hasSubset bool) (string, error) {
	now := nanotime()
	var best *route.Worker
	for _, w := range c.kv.Pool().Workers {
		if !w.Healthy(now) || w.Role == route.RolePrefill || (hasSubset && !inSubset(subset, w.Addr)) {
			continue
		}
		if best == nil || w.Load() < best.Load() {
			best = w
		}
	}
	if best == nil {
		msg := "no healthy worker"
		if hasSubset {
			msg = "no healthy worker in the gateway's endpoint subset"
		}
		return "", &Refusal{Status: 503, Message: msg, Code: "no_worker", RetryAfter: 1}
	}
	return best.Addr, nil
}

func seconds(ns int64) float64 { return float64(ns) / 1e9 }

// nanotime is the core's clock: package clock's Now, the data plane's time of day from the
// monotonic clock, which the router's ejection and session times and the carriers' times
// all read.
func nanotime() int64 { return clock.Now() }
