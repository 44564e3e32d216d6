package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/panjf2000/gnet/v2"
	"github.com/panjf2000/gnet/v2/pkg/netpoll"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/kvrelay/kvrelay/dataplane/http1"
	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
	"github.com/kvrelay/kvrelay/xds"
)

// Server is the edge proxy: a gnet engine whose event loops own client connections and,
// on the same loops, pooled keep-alive connections to the engines, so that a request and its
// response cross no goroutine boundary on the way through.
//
// Lifecycle: New builds it without side effects; Start asks upstreams without a configured
// model which model they serve, binds the listener and starts the loops; Run serves until
// its context ends and then drains (new requests get 503, responses in flight finish, up to
// DrainTimeout) before stopping. Close stops at once and is safe after a failed Start.
type Server struct {
	gnet.BuiltinEventEngine

	cfg    Config
	log    *slog.Logger
	limits http1.Limits
	// loopback: the client listener is on a loopback address, so /metrics answers there too.
	loopback bool
	// responses: which worker served each stored Responses API response.
	responses *respTable
	metrics   *metrics
	index     *prefix.Approx
	kv        *route.Router                     // chat and text completions
	load      *route.Router                     // embeddings and responses: by load
	workers   atomic.Pointer[[]*workerState]    // by route.Worker.Index
	codecs    atomic.Pointer[map[string]*codec] // by model; "" is the default
	models    atomic.Pointer[[]byte]            // the /v1/models body
	queue     *admissionQueue
	// decisions keeps sampled routing decisions of a predicting policy (explain.go).
	decisions decisionLog
	xds       *xdsState // nil without a control plane
	remote    *remoteTokenizer
	// stableArm are the series of the policy routing now; cand a rollout's candidate beside
	// it (rollout.go).
	stableArm atomic.Pointer[armSeries]
	cand      atomic.Pointer[candidate]
	// tokenizeSlots bounds the large prompts tokenized off the event loops at once (and the
	// memory their ids take): half the CPUs, at least one.
	tokenizeSlots chan struct{}
	pdClient      *pdClient // prefill legs of disaggregated requests
	pdSet         atomic.Pointer[disaggSettings]

	eng      gnet.Engine
	addr     string
	boot     chan struct{}
	onListen func() // OnListen
	done     chan error
	loopsMu  sync.Mutex
	loops    map[gnet.EventLoop]*loop
	loopList []*loop
	draining atomic.Bool
	inflight atomic.Int64 // exchanges in flight
	paused   atomic.Int64 // streams paused for slow clients
	stopTick chan struct{}
	tickWG   sync.WaitGroup
	closed   atomic.Bool
}

// workerState is the proxy's per-worker data beside the router's Worker.
type workerState struct {
	w *route.Worker
	m *workerMetrics
}

// New builds a proxy from cfg. It validates the config and loads the tokenizers, but binds
// nothing and dials nothing.
func New(cfg Config, log *slog.Logger) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s := &Server{
		cfg:       cfg,
		log:       log,
		loopback:  loopbackListen(cfg.Listen),
		responses: newRespTable(cfg.ResponseAffinity, cfg.ResponseTTL),
		limits:    http1.Limits{MaxHeadBytes: cfg.MaxHeaderBytes, MaxBodyBytes: cfg.MaxBodyBytes},
		metrics:   newMetrics(),
		index:     prefix.NewApprox(prefix.ApproxConfig{MaxBlocks: cfg.IndexBlocks, TTL: cfg.IndexTTL}),
		boot:      make(chan struct{}),
		done:      make(chan error, 1),
		loops:     map[gnet.EventLoop]*loop{},
	}
	s.codecs.Store(&map[string]*codec{})
	s.workers.Store(&[]*workerState{})
	s.models.Store(new([]byte))
	s.queue = newAdmissionQueue(cfg.QueueSize, s.metrics)
	s.remote = newRemoteTokenizer(cfg.ConnectTimeout+5*time.Second, cfg.TokenCacheTokens)
	s.tokenizeSlots = make(chan struct{}, max(1, runtime.GOMAXPROCS(0)/2))
	for result, c := range map[string]*atomic.Uint64{"hit": &s.remote.hits, "prefix": &s.remote.prefixHits, "miss": &s.remote.misses} {
		s.metrics.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvrelay_proxy_remote_tokenize_total", ConstLabels: prometheus.Labels{"result": result},
			Help: "Prompts tokenized by an engine's /tokenize, by how the cache served them: hit (the whole request), prefix (routed at once on its conversation's earlier tokens, its own fetched in the background) or miss (routed after the round trip).",
		}, func() float64 { return float64(c.Load()) }))
	}
	s.pdClient = newPDClient(cfg.ConnectTimeout)
	s.pdSet.Store(&disaggSettings{mode: cfg.Disagg, threshold: cfg.DisaggThreshold})
	return s, nil
}

// Start discovers the models of upstreams that did not name one, builds the worker pool and
// the tokenizers, binds the listener and starts serving.
func (s *Server) Start(ctx context.Context) error {
	if err := s.setup(ctx); err != nil {
		return fmt.Errorf("starting proxy: %w", err)
	}
	if s.cfg.PickOnly {
		// No listener, no event loops: picks run on their callers' goroutines.
		close(s.boot)
		s.stopTick = make(chan struct{})
		s.tickWG.Add(1)
		go s.ticker()
		return nil
	}
	nloops := eventLoops(s.cfg.EventLoops)
	lock := lockLoops()
	if lock {
		// A locked loop yields only after a busy batch (third_party/gnet/KVRELAY.md).
		netpoll.SetYieldMinEvents(2)
	}
	opts := []gnet.Option{
		gnet.WithNumEventLoop(nloops),
		gnet.WithReusePort(false),
		// A proxy restarted on its port binds at once, beside the connections the old one
		// closed that still sit in TIME_WAIT.
		gnet.WithReuseAddr(true),
		gnet.WithTCPNoDelay(gnet.TCPNoDelay),
		gnet.WithReadBufferCap(64 << 10),
		gnet.WithLogger(gnetLogger{s.log}),
		// Each loop keeps its thread where another CPU could take it over: see eventLoops.
		gnet.WithLockOSThread(lock),
		// Edge-triggered epoll, each socket registered once for reads and writes: no
		// epoll_ctl when a write backs up or drains, and no re-poll by the kernel of every
		// socket that was readable at the last wait. A short read ends the event (the
		// socket is drained; third_party/gnet/KVRELAY.md).
		gnet.WithEdgeTriggeredIO(true),
	}
	go func() {
		err := gnet.Run(s, "tcp://"+s.cfg.Listen, opts...)
		s.done <- err
	}()
	select {
	case <-s.boot:
	case err := <-s.done:
		s.done <- err
		return fmt.Errorf("listening on %s: %w", s.cfg.Listen, err)
	case <-ctx.Done():
		return fmt.Errorf("starting proxy: %w", ctx.Err())
	}
	s.addr = s.cfg.Listen
	if fd, err := s.eng.Dup(); err == nil {
		if sa, err := unix.Getsockname(fd); err == nil {
			if in4, ok := sa.(*unix.SockaddrInet4); ok {
				s.addr = net.JoinHostPort(net.IP(in4.Addr[:]).String(), strconv.Itoa(in4.Port))
			} else if in6, ok := sa.(*unix.SockaddrInet6); ok {
				s.addr = net.JoinHostPort(net.IP(in6.Addr[:]).String(), strconv.Itoa(in6.Port))
			}
		}
		unix.Close(fd)
	}
	s.stopTick = make(chan struct{})
	s.tickWG.Add(1)
	go s.ticker()
	return nil
}

// eventLoops returns how many gnet event loops to run for the configured number (0: one
// per P but one), and makes sure a single loop has a second P.
//
// A gnet loop, and gnet's acceptor, wait in a blocking epoll_wait that the runtime counts as
// a system call holding a P. When no P is idle, sysmon takes the P of every wait longer than
// one of its ticks and starts another thread to look for work; the loop then resumes on
// whichever thread has a P, and its CPU spreads over five or six threads with a context
// switch more per request (2 vCPUs, two loops on two Ps: 0.72 to 1.24 of nginx's req/s from
// one 3 s round to the next). Leaving one P free stops the retakes, and locking each loop to
// its thread (Start) stops the hops that gnet's yield after an empty poll otherwise invites:
// one locked loop with a spare P runs on one thread at nginx's CPU per request
// (hack/bench-proxy/README.md). So the default is GOMAXPROCS-1 loops, at least one, locked
// where the process may use more than one CPU (lockLoops).
//
// The count follows GOMAXPROCS rather than the machine's CPUs (gnet's multicore default):
// in a container with a CPU limit the Go runtime sets GOMAXPROCS to the limit, and loops
// beyond the Ps only take turns on them.
//
// Raising GOMAXPROCS is a process-wide change; it happens in Start, and only upwards.
func eventLoops(configured int) int {
	n := configured
	if n <= 0 {
		n = max(1, runtime.GOMAXPROCS(0)-1)
	}
	if n == 1 && runtime.GOMAXPROCS(0) < 2 {
		runtime.GOMAXPROCS(2)
	}
	return n
}

// lockLoops reports whether event loops are locked to their threads: only when the process
// may run on more than one CPU. There a thread woken by gnet's yield runs alongside the loop's
// and can take the loop over; on a single CPU it cannot, and a locked loop only pays for the
// yield with a hand-off to another thread and back (pinned to one CPU: 0.95 of nginx's req/s
// locked, 1.05 not).
func lockLoops() bool { return runtime.NumCPU() > 1 }

// setup builds the worker pool, the routers and the codecs.
func (s *Server) setup(ctx context.Context) error {
	if s.cfg.XDS != "" {
		return s.setupXDS(ctx)
	}
	ws := make([]*route.Worker, len(s.cfg.Upstreams))
	for i, u := range s.cfg.Upstreams {
		host := upstreamHost(u.URL)
		id := u.ID
		if id == "" {
			id = host
		}
		model, loras, maxLen := u.Model, u.LoRAModules, u.MaxModelLen
		if model == "" {
			m, l, n, err := discoverModel(ctx, u.URL, s.cfg.ConnectTimeout)
			if err != nil {
				s.log.Warn("upstream model unknown; it will be offered every model", "worker", id, "err", err)
			}
			model = m
			if len(loras) == 0 {
				loras = l
			}
			if maxLen == 0 {
				maxLen = n
			}
		}
		bs := u.BlockSize
		if bs == 0 {
			bs = s.cfg.BlockSize
		}
		role, _ := ParseRole(u.Role) // Validate checked it
		ws[i] = &route.Worker{ID: id, URL: "http://" + host, Addr: host, Model: model, LoRAs: loras, MaxModelLen: maxLen, BlockSize: bs, Capacity: u.Capacity, Role: role,
			Engine: latency.Engine{MaxNumSeqs: u.MaxNumSeqs, MaxBatchedTokens: u.MaxNumBatchedTokens,
				KVBytesPerToken: float64(u.KVBytesPerToken), HostBandwidth: u.HostBandwidth, DiskBandwidth: u.DiskBandwidth, PeerBandwidth: u.PeerBandwidth}}
	}
	pool := route.NewPool(ws)
	if err := s.buildRouters(pool, s.index); err != nil {
		return err
	}
	states := make([]*workerState, len(ws))
	for i, w := range ws {
		states[i] = &workerState{w: w, m: s.metrics.forWorker(w.ID)}
	}
	s.workers.Store(&states)
	if err := s.buildCodecs(pool); err != nil {
		return err
	}
	s.setModels(pool)
	return nil
}

// buildRouters builds the router of chat and text completions over pool, matching prompts
// against index, and the load-only router of the other routes.
func (s *Server) buildRouters(pool *route.Pool, index prefix.Index) error {
	var err error
	if s.kv, err = route.NewRouter(s.cfg.routeConfig(), pool, index); err != nil {
		return err
	}
	// A static proxy's policy has no version: it is "local". Under a control plane the
	// pushed version replaces it (applyXDS).
	s.setRegretLabels(s.cfg.routeConfig().Policy, "local")
	if s.load, err = route.NewRouter(loadConfig(s.cfg.routeConfig()), pool, nil); err != nil {
		return err
	}
	return nil
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

// setModels publishes the /v1/models body for pool.
func (s *Server) setModels(pool *route.Pool) {
	b := modelsBody(pool.Models(), time.Now().Unix())
	s.models.Store(&b)
}

// workerState returns the proxy's state of worker w.
func (s *Server) workerState(w *route.Worker) *workerState {
	return (*s.workers.Load())[w.Index]
}

// Addr is the address the proxy listens on (the real port when configured with port 0).
func (s *Server) Addr() string { return s.addr }

// Workers returns the workers, in configuration order.
func (s *Server) Workers() []*route.Worker { return s.kv.Pool().Workers }

// RoutingPolicy is the policy the proxy routes chat and text completions with now (its
// filters, scorers and picker).
func (s *Server) RoutingPolicy() *route.Policy { return s.kv.Policy() }

// Run serves until ctx ends, then drains and stops. It returns what stopped the engine.
func (s *Server) Run(ctx context.Context) error {
	if s.cfg.PickOnly {
		<-ctx.Done()
		s.Drain(s.cfg.DrainTimeout)
		return s.Close()
	}
	select {
	case err := <-s.done:
		s.stopTicker()
		return err
	case <-ctx.Done():
	}
	s.Drain(s.cfg.DrainTimeout)
	return s.Close()
}

// Drain stops taking requests (new ones get 503 with Connection: close, /health turns 503)
// and waits up to timeout for those in flight to finish.
func (s *Server) Drain(timeout time.Duration) {
	s.draining.Store(true)
	s.metrics.draining.Set(1)
	s.log.Info("draining", "inflight", s.inflight.Load())
	deadline := time.Now().Add(timeout)
	for s.inflight.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := s.inflight.Load(); n > 0 {
		s.log.Warn("drain timed out; closing requests still in flight", "inflight", n)
	}
}

// Close stops the engine and every connection at once.
func (s *Server) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	s.stopXDS()
	s.stopTicker()
	select {
	case <-s.boot:
	default:
		return nil // never started
	}
	if s.cfg.PickOnly {
		return nil
	}
	// gnet's Stop polls for the end every 500 ms; gnet.Run returning says it sooner.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stopErr := make(chan error, 1)
	go func() { stopErr <- s.eng.Stop(ctx) }()
	select {
	case err := <-s.done:
		if err != nil {
			return fmt.Errorf("stopping proxy: %w", err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stopping proxy: %w", ctx.Err())
	case err := <-stopErr:
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("stopping proxy: %w", err)
		}
		if err := <-s.done; err != nil {
			return fmt.Errorf("stopping proxy: %w", err)
		}
		return nil
	}
}

func (s *Server) stopTicker() {
	if s.stopTick != nil {
		select {
		case <-s.stopTick:
		default:
			close(s.stopTick)
		}
		s.tickWG.Wait()
	}
}

// OnBoot implements gnet.EventHandler.
func (s *Server) OnBoot(eng gnet.Engine) gnet.Action {
	s.eng = eng
	if s.onListen != nil {
		s.onListen()
	}
	close(s.boot)
	return gnet.None
}

// OnListen sets f to run once the listener is bound and before any connection is served (and
// so before the first connection to a worker): the moment to enter a cgroup that the
// connections accepted from the listener must stay out of (ebpf.Collector.EnterDialScope).
// Call it before Start.
func (s *Server) OnListen(f func()) { s.onListen = f }

// loopOf returns the state of the event loop c belongs to, creating it on first sight.
func (s *Server) loopOf(c gnet.Conn) *loop {
	el := c.EventLoop()
	s.loopsMu.Lock()
	defer s.loopsMu.Unlock()
	lp, ok := s.loops[el]
	if !ok {
		lp = newLoop(s, el)
		s.loops[el] = lp
		s.loopList = append(s.loopList, lp)
	}
	return lp
}

// OnOpen implements gnet.EventHandler for accepted client connections and for upstream
// connections registered on a loop.
func (s *Server) OnOpen(c gnet.Conn) ([]byte, gnet.Action) {
	if up, ok := c.Context().(*upstream); ok {
		up.lp.now = nanotime()
		up.opened(c)
		return nil, gnet.None
	}
	lp := s.loopOf(c)
	lp.now = nanotime()
	cc := lp.newClient(c)
	c.SetContext(cc)
	return nil, gnet.None
}

// OnTraffic implements gnet.EventHandler.
func (s *Server) OnTraffic(c gnet.Conn) gnet.Action {
	switch x := c.Context().(type) {
	case *clientConn:
		x.lp.now = nanotime()
		return x.traffic()
	case *upstream:
		x.lp.now = nanotime()
		return x.traffic()
	}
	return gnet.Close
}

// OnClose implements gnet.EventHandler.
func (s *Server) OnClose(c gnet.Conn, err error) gnet.Action {
	switch x := c.Context().(type) {
	case *clientConn:
		x.lp.now = nanotime()
		x.closed()
	case *upstream:
		x.lp.now = nanotime()
		x.closed(err)
	}
	return gnet.None
}

// ticker runs each loop's housekeeping (timeouts, resuming streams paused for slow clients)
// on that loop: every 10 ms while a stream is paused, else every 250 ms.
func (s *Server) ticker() {
	defer s.tickWG.Done()
	for {
		d := 250 * time.Millisecond
		if s.paused.Load() > 0 {
			d = 10 * time.Millisecond
		}
		select {
		case <-s.stopTick:
			return
		case <-time.After(d):
		}
		s.loopsMu.Lock()
		loops := append([]*loop(nil), s.loopList...)
		s.loopsMu.Unlock()
		for _, lp := range loops {
			_ = lp.el.Execute(context.Background(), gnet.RunnableFunc(lp.housekeeping))
		}
		s.queue.expire(route.Now())
		s.ageLoads(nanotime())
	}
}

// discoverModel asks an engine which model it serves.
func discoverModel(ctx context.Context, base string, timeout time.Duration) (model string, loras []string, maxLen int, err error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/models", nil)
	if err != nil {
		return "", nil, 0, fmt.Errorf("asking %s for its model: %w", base, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", nil, 0, fmt.Errorf("asking %s for its model: %w", base, err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID          string  `json:"id"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list); err != nil || len(list.Data) == 0 {
		return "", nil, 0, fmt.Errorf("asking %s for its model: no model in the answer (status %d)", base, resp.StatusCode)
	}
	// vLLM lists the base model first, then each LoRA adapter with the base as its parent.
	model, maxLen = list.Data[0].ID, min(max(list.Data[0].MaxModelLen, 0), 1<<30)
	for _, m := range list.Data[1:] {
		if m.Parent != nil && *m.Parent == model && m.ID != model && !slices.Contains(loras, m.ID) && len(loras) < xds.MaxLoRAAdapters {
			loras = append(loras, m.ID)
		}
	}
	return model, loras, maxLen, nil
}

// modelsBody is the /v1/models answer listing the models the pool serves.
func modelsBody(models []string, created int64) []byte {
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	list := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: []model{}}
	for _, m := range models {
		list.Data = append(list.Data, model{ID: m, Object: "model", Created: created, OwnedBy: "kvrelay"})
	}
	b, _ := json.Marshal(list)
	return b
}

// buildCodecs loads the tokenizer and chat template of every model the pool serves that has
// none yet, and publishes the codecs (copy on write: loops read them without a lock). Only
// one goroutine at a time builds: Start, or the control plane's updates.
func (s *Server) buildCodecs(pool *route.Pool) error {
	old := *s.codecs.Load()
	next := make(map[string]*codec, len(old)+len(pool.Models())+1)
	for m, c := range old {
		next[m] = c
	}
	models := append([]string{""}, pool.Models()...)
	for _, m := range models {
		if _, adapter := pool.Adapter(m); next[m] != nil || adapter {
			continue
		}
		c, err := newCodec(m, s.cfg.Tokenizer, s.cfg.ChatTemplate, s.cfg.TokenCacheTokens)
		if err != nil {
			return err
		}
		next[m] = c
	}
	// A LoRA adapter tokenizes as its base model.
	for _, m := range models {
		if base, ok := pool.Adapter(m); ok && next[base] != nil {
			next[m] = next[base]
		}
	}
	s.codecs.Store(&next)
	return nil
}

// regretObs are a policy version's routing regret histograms.
type regretObs struct{ blocks, gap prometheus.Observer }

// setRegretLabels points the stable policy's series at policy and version.
func (s *Server) setRegretLabels(policy, version string) {
	old := s.stableArm.Swap(s.newArmSeries(policy, version))
	var cand *armSeries
	if c := s.cand.Load(); c != nil {
		cand = c.arm
	}
	s.retire(old, s.stableArm.Load(), cand)
}

// observeRegret records what the decision d gave up, under the arm that made it.
func (s *Server) observeRegret(a *armSeries, d *route.Decision) {
	if a == nil {
		return
	}
	r := max(d.Achievable-d.Overlap, 0)
	a.regret.blocks.Observe(r)
	a.decisions.Add(1)
	a.regretSum.Add(uint64(math.Round(r)))
	if d.HasCost {
		a.regret.gap.Observe(max(d.CostGap, 0))
	}
}

// codecFor returns the codec of model, or the default one.
func (s *Server) codecFor(model []byte) *codec {
	codecs := *s.codecs.Load()
	if c, ok := codecs[string(model)]; ok {
		return c
	}
	return codecs[""]
}

// gnetLogger routes gnet's own logging into slog.
type gnetLogger struct{ l *slog.Logger }

func (g gnetLogger) Debugf(format string, args ...any) {}
func (g gnetLogger) Infof(format string, args ...any)  {}
func (g gnetLogger) Warnf(format string, args ...any) {
	g.l.Warn(fmt.Sprintf(format, args...), "component", "gnet")
}
func (g gnetLogger) Errorf(format string, args ...any) {
	g.l.Error(fmt.Sprintf(format, args...), "component", "gnet")
}
func (g gnetLogger) Fatalf(format string, args ...any) {
	g.l.Error(fmt.Sprintf(format, args...), "component", "gnet")
}

// codec is one model's prompt pipeline in the proxy.
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

// loopbackListen reports whether a listen address binds only loopback: localhost or a
// loopback IP, not a wildcard.
func loopbackListen(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
