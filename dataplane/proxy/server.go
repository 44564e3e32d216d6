package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
	"golang.org/x/sys/unix"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/http1"
	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/dataplane/tenant"
	"github.com/kvrelay/kvrelay/engines"
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
	// core decides every request (package decide): its input, tokenization, routing,
	// admission, tally, decision record and rollout arm. The proxy carries them.
	core   *decide.Core
	models atomic.Pointer[[]byte] // the /v1/models body
	// keys are the tenants' API keys and budgets (Config.APIKeysFile), nil without.
	keys *tenant.Keys
	xds  *xdsState // nil without a control plane
	// tokenizeSlots bounds the large prompts tokenized off the event loops at once (and the
	// memory their ids take): half the CPUs, at least one.
	tokenizeSlots chan struct{}
	pdClient      *pdClient // prefill legs of disaggregated requests

	eng      gnet.Engine
	addr     string
	boot     chan struct{}
	onListen func() // OnListen
	done     chan error
	loopsMu  sync.Mutex
	loops    map[gnet.EventLoop]*loop
	loopList []*loop
	paused   atomic.Int64 // streams paused for slow clients
	stopTick chan struct{}
	tickWG   sync.WaitGroup
	closed   atomic.Bool
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
		boot:      make(chan struct{}),
		done:      make(chan error, 1),
		loops:     map[gnet.EventLoop]*loop{},
	}
	s.core = decide.NewCore(cfg.decideConfig(), s.metrics.reg, log)
	// Keys come from the file and, following a control plane, from its operator API; with
	// neither, none are checked (Keys.Active).
	k, err := tenant.NewKeys(cfg.APIKeysFile, log)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	s.keys = k
	s.models.Store(new([]byte))
	s.tokenizeSlots = make(chan struct{}, max(1, runtime.GOMAXPROCS(0)/2))
	s.pdClient = newPDClient(cfg.ConnectTimeout)
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
	s.watchKeys()
	return nil
}

// watchKeys reads the API keys file again while the proxy runs, when it changed.
func (s *Server) watchKeys() {
	if s.cfg.APIKeysFile == "" {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	stop := s.stopTick
	s.tickWG.Add(1)
	go func() {
		defer s.tickWG.Done()
		<-stop
		cancel()
	}()
	s.tickWG.Add(1)
	go func() {
		defer s.tickWG.Done()
		s.keys.Watch(ctx, keysReread)
	}()
}

// keysReread is how often the API keys file is looked at for a change.
const keysReread = time.Second

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
				KVBytesPerToken: float64(u.KVBytesPerToken), HostBandwidth: u.HostBandwidth, DiskBandwidth: u.DiskBandwidth, SharedBandwidth: u.SharedBandwidth, PeerBandwidth: u.PeerBandwidth},
			Pins: engines.Kind(u.Engine).Pins(), P2PPort: u.P2PPort}
	}
	pool := route.NewPool(ws)
	// A static proxy's policy has no version: it is "local".
	if err := s.core.Build(pool, s.core.Index(), s.cfg.routeConfig(), "local"); err != nil {
		return err
	}
	states := make([]*decide.WorkerState, len(ws))
	for i, w := range ws {
		states[i] = s.core.NewWorkerState(w)
		s.metrics.forUpstream(w.ID)
	}
	s.core.SetWorkers(states)
	s.setModels(pool)
	return nil
}

// setModels publishes the /v1/models body for pool.
func (s *Server) setModels(pool *route.Pool) {
	b := modelsBody(pool.Models(), time.Now().Unix())
	s.models.Store(&b)
}

// Addr is the address the proxy listens on (the real port when configured with port 0).
func (s *Server) Addr() string { return s.addr }

// Workers returns the workers, in configuration order.
func (s *Server) Workers() []*route.Worker { return s.core.Pool().Workers }

// RoutingPolicy is the policy the proxy routes chat and text completions with now (its
// filters, scorers and picker).
func (s *Server) RoutingPolicy() *route.Policy { return s.core.RoutingPolicy() }

// Core is the proxy's routing core, which decides every request it carries (and every pick
// of an endpoint picker over it).
func (s *Server) Core() *decide.Core { return s.core }

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
	s.core.Drain()
	s.metrics.draining.Set(1)
	s.log.Info("draining", "inflight", s.core.InFlight())
	deadline := time.Now().Add(timeout)
	for s.core.InFlight() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := s.core.InFlight(); n > 0 {
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
		s.core.Expire(route.Now())
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

// Pick decides r without carrying it (an endpoint picker's request, which its gateway
// carries): see decide.Core.Pick.
func (s *Server) Pick(ctx context.Context, r *decide.PickRequest) (*decide.Pick, error) {
	return s.core.Pick(ctx, r)
}

// PickAny picks the least loaded healthy worker for a request without a body (nothing to
// route on), among subset when hasSubset.
func (s *Server) PickAny(subset []string, hasSubset bool) (string, error) {
	return s.core.PickAny(subset, hasSubset)
}

// Draining reports whether the proxy is shutting down (Drain): new requests and picks are
// refused.
func (s *Server) Draining() bool { return s.core.Draining() }

// Ready reports whether the proxy can pick: it has workers and, under a control plane, the
// control plane's state has arrived.
func (s *Server) Ready() bool {
	if s.core.KV() == nil || s.core.Draining() {
		return false
	}
	if x := s.xds; x != nil {
		select {
		case <-x.ads.Synced():
		default:
			return false
		}
	}
	return len(s.core.Pool().Workers) > 0
}
