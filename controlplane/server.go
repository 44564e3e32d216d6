package controlplane

import (
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/kvrelay/kvrelay/controlplane/api"
	"github.com/kvrelay/kvrelay/controlplane/ingest"
	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/controlplane/leader"
	"github.com/kvrelay/kvrelay/controlplane/loadview"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/controlplane/ui"
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/trtllm"
	"github.com/kvrelay/kvrelay/engines/vllm"
	loopbackpkg "github.com/kvrelay/kvrelay/internal/loopback"
	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/auth"
	xdsclient "github.com/kvrelay/kvrelay/xds/client"
	"github.com/kvrelay/kvrelay/xds/journal"
	"github.com/kvrelay/kvrelay/xds/policy"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

// Options configure a control plane.
type Options struct {
	// XDSListen serves proxies: delta ADS, the index journal and load reports.
	XDSListen string
	// XDSMaxConnsPerPeer and XDSMaxStreamsPerPeer are the xDS server's caps per source
	// address (0: xds/server's defaults, 32 and 64). Behind a NAT or a sidecar every proxy
	// shares one address: raise them there (the global caps still hold).
	XDSMaxConnsPerPeer, XDSMaxStreamsPerPeer int
	// XDSAuth is what the xDS listener asks of proxies (TLS, client certificates, bearer
	// tokens). Without credentials it must listen on loopback, or set XDSAuth.Insecure.
	XDSAuth auth.ServerConfig
	// APIListen serves the operator API (JSON over HTTP and gRPC) and /metrics.
	APIListen string
	// DataDir holds the registry and policies (bbolt), unless Store is set.
	DataDir string
	// Store, when set, keeps the API workers, drains, the policy and the rollouts instead of
	// a bbolt database in DataDir: a registry.KubeStore shares them between replicas (each
	// replica's registry follows the resources; the leader reconciles a policy edited in
	// Kubernetes and steps rollouts from where the previous leader left them). The server
	// closes it.
	Store registry.Backend
	// Workers come from flags; WorkersFile is a YAML file reloaded when it changes.
	Workers     []registry.Worker
	WorkersFile string
	// APIToken authorises mutating operator calls; empty refuses them. APITokenFile, when
	// set, holds it instead and is read again every tokenReread, so that a rotated token
	// (a Kubernetes Secret updated in place) takes effect without a restart; a read that
	// fails or finds the file empty keeps the token in force, and says so in the log.
	APIToken     string
	APITokenFile string
	// APICertFile and APIKeyFile (PEM), when set, make the operator API (and /metrics, the
	// console) HTTPS; they are read again when they change.
	APICertFile, APIKeyFile string
	// MetricsTokenFile holds a read-only token for /metrics (read again as APITokenFile is):
	// beyond loopback /metrics answers it or the API token, nothing else.
	MetricsTokenFile string
	// APIAdvertise is the address (host:port) other replicas reach this one's operator API
	// at: a follower forwards the changes it gets to the leader's (default: the listener's
	// address, unless it listens on every interface). APIPeerCAFile verifies the leader's
	// certificate when forwarding over HTTPS, for the name APIPeerServerName (default: the
	// address's host).
	APIAdvertise, APIPeerCAFile, APIPeerServerName string
	// ScrapeInterval is how often each worker's metrics are read (default 100 ms).
	ScrapeInterval time.Duration
	// KernelWaiting, when set, adds requests seen waiting in front of each worker from the
	// kernel (the eBPF probes' accept queues) to its load (loadview.Options.KernelWaiting)
	// while the routing policy's KernelLoadSignals is on, or always with
	// KernelWaitingAlways.
	KernelWaiting func(workerID string) (int, bool)
	// KernelLatencyWaiting, when set, raises each worker's waiting count to what its recent
	// kernel-side request-to-first-byte latency implies (the eBPF first_byte probe;
	// loadview.Options.KernelLatencyWaiting), under the same switch as KernelWaiting.
	KernelLatencyWaiting func(workerID string) (int, bool)
	KernelWaitingAlways  bool
	// Adapters read each engine kind's metrics (nil: DefaultAdapters).
	Adapters engines.Adapters
	// JournalRing is how many index changes the journal keeps for proxies that fall behind.
	JournalRing int
	// JournalLinger trades freshness for fewer journal messages (default 2 ms).
	JournalLinger time.Duration
	// JournalSent, when set, also hears each journal batch's freshness (what
	// kvrelay_controlplane_journal_freshness_seconds observes: from its oldest change's KV
	// event arriving here to its send on a proxy's stream), from the streams' goroutines.
	JournalSent func(age time.Duration)
	// PublishInterval bounds how often worker resources are republished when load changes
	// (default 50 ms).
	PublishInterval time.Duration
	// LoadPushBudget, when positive, bounds the bytes a second of loads pushed to a proxy
	// that follows every worker: after a push of B bytes of loads the next waits B ÷
	// LoadPushBudget when that is longer than PublishInterval. Where every engine's load
	// moves on every scrape a push carries about 22 bytes a worker (700 a shard of 32 with
	// its delta framing), so the loads of 10,000 workers, pushed every 50 ms, would take
	// 4.4 MB/s a proxy; a budget of 256 KB/s pushes them about every 0.9 s instead, 1,000
	// workers' every 90 ms.
	// Registry changes are pushed at once whatever the budget; the LoadRefresh push waits
	// for it.
	LoadPushBudget int
	// ValidateProfile, when set, refuses a policy profile the proxies cannot build (the
	// program's plugin registry: route.Registry.Validate) before it is stored and pushed;
	// unset, proxies are left to refuse it.
	ValidateProfile func(policy.Profile) error
	// RolloutInterval is how often a running rollout's step is judged (default 1 s);
	// RolloutSettle how long after a start it waits for every proxy's load report before
	// it judges (default 3 s; a partial sum would look like proxies that restarted).
	RolloutInterval, RolloutSettle time.Duration
	// APIReadTimeout bounds the time to read a request of the operator API, head and body
	// (default DefaultAPIReadTimeout); its answer has twice that, and a change a follower
	// forwards has that long for the leader's answer (else the client gets 504).
	APIReadTimeout time.Duration
	// RolloutClock is the rollout controller's clock (default time.Now): the time a step
	// has run, the settle after a start, and the times a rollout records. Its ticks still
	// come every RolloutInterval of real time. A test that advances a clock of its own ends
	// each step after the requests it waited for, not after however many a loaded machine
	// served in a stretch of wall time.
	RolloutClock func() time.Time
	// LoadRefresh is the longest the workers go unpublished while the control plane runs,
	// and the longest a worker's load that moves within its band (observedLoad.near) is
	// held before its current one is sent (default 1 s). Proxies keep a pushed load while
	// the control plane answers their load reports; once it stops, the load ages away (the
	// proxy's load_stale_after).
	LoadRefresh time.Duration
	// K8s, when set, adds a worker per ready endpoint of the EndpointSlices it selects.
	K8s *K8sSource
	// Leader, when set, elects the replica of several that makes changes: Start campaigns
	// with it, and while this replica follows it refuses the operator API's writes (naming
	// the leader) and holds the rollout controller's steps. It still ingests every event
	// and serves proxies. Nil: this control plane is alone and makes every change.
	Leader *leader.Elector
	// NoReplicaLoadShare keeps each replica's proxies' in-flight load to the proxies of that
	// replica, as before replicas shared it (loadshare.go): for comparing the two.
	NoReplicaLoadShare bool
	// ReplicaPeers are the other replicas' operator API addresses (host:port; HTTPS with
	// APIPeerCAFile) where replicas run without a Lease on Kubernetes: each asks them for
	// their proxies' load and their polls, as elected replicas do at the addresses they
	// share. Every replica needs the operator API's token (APIToken or APITokenFile).
	ReplicaPeers []string
	// ReplicaID names this replica to ReplicaPeers (default: its operator API's address).
	ReplicaID string
	// NoPollShare makes every replica poll every engine itself, as before replicas shared
	// their polls (loadshare.go): for comparing the two.
	NoPollShare bool
	// RemoveDataDir removes DataDir on Close (kvrelay up's temporary one).
	RemoveDataDir bool
	Logger        *slog.Logger
}

// DefaultAdapters reads every engine kind kvrelay knows: vLLM (and the simulated engine,
// which speaks vLLM's metric names), SGLang and TensorRT-LLM.
func DefaultAdapters() engines.Adapters {
	return engines.Adapters{
		engines.KindVLLM:   vllm.New(),
		engines.KindSim:    vllm.NewSim(),
		engines.KindSGLang: sglang.New(),
		engines.KindTRTLLM: trtllm.New(),
	}
}

// K8sSource discovers workers from Kubernetes: the EndpointSlices that Selector picks (see
// registry.Registry.WatchEndpointSlices for how an endpoint becomes a worker) or, with
// InferencePool set, the pods of that Gateway API InferencePool in Namespace
// (registry.Registry.WatchInferencePool; Dynamic reads the pool).
type K8sSource struct {
	Client        kubernetes.Interface
	Dynamic       dynamic.Interface
	Namespace     string
	Selector      string
	InferencePool string
	// Template gives the fields endpoints do not: engine, model, KV event port, ...
	Template registry.Worker
}

// Server is a running control plane: the registry, one KV event subscriber per worker
// feeding the global index and its journal, the load view, and the xDS server that pushes
// workers, policy and the index to proxies.
//
// Lifecycle: New opens the data dir and builds everything without network I/O; Start binds
// the listeners and starts the goroutines; Run waits for the context and stops; Close stops
// at once.
type Server struct {
	opts Options
	log  *slog.Logger
	// apiTok and metricsTok read Options.APITokenFile and MetricsTokenFile again.
	apiTok, metricsTok tokenFile
	store              registry.Backend
	// keysMu serialises the operator API's changes of the API keys.
	keysMu sync.Mutex
	// remote is the other replicas' proxies' in-flight load (loadshare.go).
	remote remoteLoads
	// pollers are the replicas that poll the engines with this one (loadshare.go).
	pollers pollShare
	// stateCh receives when a shared Store's resources changed (coalesced).
	stateCh chan struct{}
	// remoteChanged receives when the other replicas' proxies' loads changed (coalesced):
	// the loop publishes them as it publishes a load change of its own.
	remoteChanged chan struct{}
	// acting is set while this replica leads and has taken over: read the shared state
	// afresh and resumed the rollout (runRollouts). Between winning the Lease and that, it
	// refuses changes as a follower does, or an operator's change could land before the
	// takeover and be undone by it.
	acting  atomic.Bool
	reg     *registry.Registry
	index   *kvindex.Index
	journal *journal.Log
	jserver *journal.Server
	// scopes are the models of each slot's worker, for proxies that follow some models only.
	scopes  *journal.ModelScopes
	ingest  *ingest.Manager
	view    *loadview.View
	xds     *xdsserver.Server
	xdsAuth *auth.Server
	metrics *prometheus.Registry

	xdsLis, apiLis net.Listener
	apiCert        *auth.CertLoader // the operator API's certificate, when it serves HTTPS
	api            *http.Server
	cancel         context.CancelFunc
	wg             sync.WaitGroup
	closeOnce      sync.Once

	mu          sync.Mutex
	published   int64 // unix nanos of the last worker publication
	nextPublish int64 // unix nanos before which a load change is not pushed
	// observed is, per worker, the engine load last published and when it was first read.
	observed map[string]observedLoad

	// ready is closed when ingestion has caught up with the engines after a start.
	ready chan struct{}

	apiGRPC   *grpc.Server
	rateMu    sync.Mutex
	rateAt    time.Time
	rateTotal uint64
	rate      float64

	planner atomic.Pointer[http.Handler] // SetPlanner's, served under /v1/planner/

	rollouts *rollouts
	// console keeps the proxies' sampled decisions for the operator console (console.go).
	console *console
}

// CatchUpTimeout bounds how long a starting control plane holds proxies' index streams while
// its subscribers replay what the engines buffer.
const CatchUpTimeout = 3 * time.Second

// New builds a control plane from opts.
func New(opts Options) (*Server, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.ScrapeInterval <= 0 {
		opts.ScrapeInterval = loadview.DefaultInterval
	}
	if opts.RolloutInterval <= 0 {
		opts.RolloutInterval = time.Second
	}
	if opts.RolloutSettle <= 0 {
		opts.RolloutSettle = 3 * time.Second
	}
	if opts.RolloutClock == nil {
		opts.RolloutClock = time.Now
	}
	if opts.LoadRefresh <= 0 {
		opts.LoadRefresh = time.Second
	}
	if opts.PublishInterval <= 0 {
		opts.PublishInterval = 50 * time.Millisecond
	}
	if opts.Adapters == nil {
		opts.Adapters = DefaultAdapters()
	}
	if opts.DataDir == "" && opts.Store == nil {
		return nil, errors.New("control plane: --data-dir is required")
	}
	xdsAuth, err := auth.NewServer(opts.XDSAuth, opts.XDSListen, opts.Logger)
	if err != nil {
		if opts.Store != nil {
			opts.Store.Close()
		}
		return nil, fmt.Errorf("control plane: %w", err)
	}
	store := opts.Store
	if store == nil {
		bolt, err := registry.Open(opts.DataDir)
		if err != nil {
			return nil, err
		}
		store = bolt
	}
	reg, err := registry.New(store, opts.Workers, opts.Logger)
	if err != nil {
		store.Close()
		return nil, err
	}
	if opts.WorkersFile != "" {
		if err := reg.ReloadFile(opts.WorkersFile); err != nil {
			store.Close()
			return nil, fmt.Errorf("control plane: %w", err)
		}
	}
	s := &Server{opts: opts, log: opts.Logger, store: store, reg: reg, metrics: prometheus.NewRegistry(), xdsAuth: xdsAuth, stateCh: make(chan struct{}, 1),
		remoteChanged: make(chan struct{}, 1)}
	s.apiTok = tokenFile{what: "API token", file: opts.APITokenFile, initial: opts.APIToken, log: opts.Logger}
	s.metricsTok = tokenFile{what: "metrics token", file: opts.MetricsTokenFile, log: opts.Logger}
	s.index = kvindex.New()
	s.journal = journal.NewLog(opts.JournalRing)
	s.ready = make(chan struct{})
	fresh := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "kvrelay_controlplane_journal_freshness_seconds",
		Help:    "Per index journal batch sent to a proxy: from the arrival here of the KV event behind its oldest change to the batch's send on the proxy's stream.",
		Buckets: []float64{.0005, .001, .002, .003, .005, .0075, .01, .015, .02, .03, .05, .075, .1, .2, .5, 1, 2, 5},
	})
	sent := func(age time.Duration) {
		fresh.Observe(age.Seconds())
		if opts.JournalSent != nil {
			opts.JournalSent(age)
		}
	}
	s.scopes = &journal.ModelScopes{}
	s.jserver = journal.NewServer(s.journal, s.index, journal.ServerOptions{Linger: opts.JournalLinger, Ready: s.ready, Sent: sent, Scopes: s.scopes})
	s.ingest = ingest.NewManager(s.index, s.journal, opts.Logger)
	// The kernel's signals count while the routing policy's kernel_load_signals is on, or
	// always with KernelWaitingAlways.
	gate := func(f func(string) (int, bool)) func(string) (int, bool) {
		if f == nil || opts.KernelWaitingAlways {
			return f
		}
		return func(id string) (int, bool) {
			if !s.reg.Policy().KernelLoadSignals {
				return 0, false
			}
			return f(id)
		}
	}
	s.view = loadview.New(loadview.Options{Interval: opts.ScrapeInterval, Adapters: opts.Adapters, Logger: opts.Logger,
		KernelWaiting: gate(opts.KernelWaiting), KernelLatencyWaiting: gate(opts.KernelLatencyWaiting),
		Delegated: s.pollers.delegated})
	// Proxies' streams (ADS, journal, load) live as long as the proxy: a graceful stop would
	// only wait out its grace, and proxies reconnect to the next control plane by themselves.
	s.console = newConsole()
	s.xds = xdsserver.New(xdsserver.Options{ShutdownGrace: 100 * time.Millisecond, GRPCOptions: s.xdsAuth.Options(), OnDecisions: s.console.add,
		MaxConnsPerPeer: s.opts.XDSMaxConnsPerPeer, MaxStreamsPerPeer: s.opts.XDSMaxStreamsPerPeer})
	xdsv1.RegisterIndexJournalServer(s.xds.GRPC(), s.jserver)
	iq := newIndexQuery(s.index, s.ready)
	xdsv1.RegisterIndexQueryServer(s.xds.GRPC(), iq)
	if s.rollouts, err = s.loadRollout(); err != nil {
		store.Close()
		return nil, err
	}
	s.metrics.MustRegister(s.view, newCollector(s), fresh, iq.answers)
	return s, nil
}

// Start binds the listeners, publishes the initial state and starts serving.
func (s *Server) Start(ctx context.Context) error {
	var err error
	if s.xdsLis, err = net.Listen("tcp", s.opts.XDSListen); err != nil {
		return fmt.Errorf("control plane: listening for xDS on %s: %w", s.opts.XDSListen, err)
	}
	if s.opts.APIListen != "" && (s.opts.APICertFile != "" || s.opts.APIKeyFile != "") {
		if s.opts.APICertFile == "" || s.opts.APIKeyFile == "" {
			s.xdsLis.Close()
			return errors.New("control plane: the operator API's certificate needs its key and a key its certificate (--api-cert, --api-key)")
		}
		if s.apiCert, err = auth.NewCertLoader(s.opts.APICertFile, s.opts.APIKeyFile, func(err error) {
			s.log.Error("operator API certificate: a changed file does not parse; keeping the previous one", "err", err)
		}); err != nil {
			s.xdsLis.Close()
			return fmt.Errorf("control plane: the operator API's certificate: %w", err)
		}
	}
	if s.opts.APIListen != "" {
		if s.apiLis, err = net.Listen("tcp", s.opts.APIListen); err != nil {
			s.xdsLis.Close()
			return fmt.Errorf("control plane: listening for the operator API on %s: %w", s.opts.APIListen, err)
		}
	}
	fwd, err := s.newForwarder()
	var peerTr *http.Transport // replicas ask each other for their proxies' load (loadshare.go)
	_, kube := s.store.(*registry.KubeStore)
	if (kube && s.opts.Leader != nil || len(s.opts.ReplicaPeers) > 0) && err == nil && (!s.opts.NoReplicaLoadShare || !s.opts.NoPollShare) {
		peerTr, err = s.peerTransport()
	}
	if err != nil {
		s.xdsLis.Close()
		if s.apiLis != nil {
			s.apiLis.Close()
		}
		return err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	if ks, ok := s.store.(*registry.KubeStore); ok && s.opts.Leader != nil {
		// Every write to the shared state checks the Lease first and carries the term: a
		// replica that led once cannot write over what a later leader wrote.
		ks.SetFence(s.opts.Leader.Fence)
	}
	if s.opts.Leader.Leading() {
		s.rollouts.resume()
	}
	s.acting.Store(s.opts.Leader == nil) // an elected replica acts once it has taken over
	s.reconcile()
	s.publish(true)
	s.publishKeys()
	if ks, ok := s.store.(*registry.KubeStore); ok {
		ks.OnChange(s.stateChanged)
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.followState(runCtx, ks) }()
		if s.opts.Leader != nil {
			s.wg.Add(1)
			go func() { defer s.wg.Done(); s.shareArmsLoop(runCtx, ks) }()
			s.wg.Add(1)
			go func() { defer s.wg.Done(); s.shareTenantsLoop(runCtx, ks) }()
			if addr, err := s.advertisedAPI(); err != nil {
				s.log.Error("operator API address not shared: followers answer changes with 503 instead of forwarding them here", "err", err)
			} else if addr != "" {
				s.wg.Add(1)
				go func() { defer s.wg.Done(); s.shareAPILoop(runCtx, ks, addr) }()
			}
		}
	}
	if peerTr != nil {
		// The other replicas: ReplicaPeers, else those that share their address through the
		// Kubernetes store (peerTr is set for one or the other).
		var ks *registry.KubeStore
		if len(s.opts.ReplicaPeers) == 0 {
			ks, _ = s.store.(*registry.KubeStore)
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.shareLoadLoop(runCtx, ks, &http.Client{Transport: peerTr, Timeout: 5 * replicaLoadEvery})
		}()
	}
	s.wg.Add(5)
	go func() { defer s.wg.Done(); s.opts.Leader.Run(runCtx) }()
	go func() { defer s.wg.Done(); s.runRollouts(runCtx) }()
	go func() { defer s.wg.Done(); s.awaitCatchUp(runCtx) }()
	go func() { defer s.wg.Done(); _ = s.xds.Serve(runCtx, s.xdsLis) }()
	go func() { defer s.wg.Done(); s.loop(runCtx) }()
	if k := s.opts.K8s; k != nil {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			var err error
			if k.InferencePool != "" {
				err = s.reg.WatchInferencePool(runCtx, k.Client, k.Dynamic, k.Namespace, k.InferencePool, k.Template)
			} else {
				err = s.reg.WatchEndpointSlices(runCtx, k.Client, k.Namespace, k.Selector, k.Template)
			}
			if err != nil && runCtx.Err() == nil {
				s.log.Error("Kubernetes discovery stopped", "err", err)
			}
		}()
	}
	if s.opts.WorkersFile != "" {
		s.wg.Add(1)
		go func() { defer s.wg.Done(); s.reg.WatchFile(runCtx, s.opts.WorkersFile, time.Second) }()
	}
	if s.apiLis != nil {
		rt := s.opts.APIReadTimeout
		if rt <= 0 {
			rt = DefaultAPIReadTimeout
		}
		// Every request is read within rt (head and body: a client that trickles one holds a
		// connection no longer), answered within twice that (the event stream extends its
		// own deadline at each event), and an idle keep-alive connection is closed after 2 min.
		s.api = &http.Server{Handler: s.apiHandler(fwd), Protocols: api.Protocols(), ReadHeaderTimeout: min(10*time.Second, rt),
			ReadTimeout: rt, WriteTimeout: 2 * rt, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10}
		s.wg.Add(1)
		if s.apiCert != nil {
			s.api.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: s.apiCert.GetCertificate}
			go func() { defer s.wg.Done(); _ = s.api.ServeTLS(s.apiLis, "", "") }()
		} else {
			go func() { defer s.wg.Done(); _ = s.api.Serve(s.apiLis) }()
		}
	}
	s.log.Info("control plane serving", "xds", s.XDSAddr(), "api", s.APIAddr(), "workers", len(s.reg.Workers()))
	return nil
}

// XDSAddr is the address proxies connect to.
func (s *Server) XDSAddr() string {
	if s.xdsLis == nil {
		return ""
	}
	return s.xdsLis.Addr().String()
}

// APIAddr is the operator API's address ("" when not serving one).
func (s *Server) APIAddr() string {
	if s.apiLis == nil {
		return ""
	}
	return s.apiLis.Addr().String()
}

// Acting reports whether this replica makes changes: it has no elector, or it leads and
// has taken over from the last leader (read the shared state afresh, resumed the rollout).
func (s *Server) Acting() bool { return s.acting.Load() }

// stateChanged notes that the shared store's resources changed (the KubeStore's watch).
func (s *Server) stateChanged() {
	select {
	case s.stateCh <- struct{}{}:
	default:
	}
}

// followState keeps the registry and the rollout controller on the shared store until ctx
// ends: after each change every replica reloads the registry (which pushes what changed to
// its proxies); the leader applies a policy edited in Kubernetes, a follower takes the
// rollout the leader wrote.
func (s *Server) followState(ctx context.Context, ks *registry.KubeStore) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.stateCh:
		}
		if s.opts.Leader.Leading() {
			if _, err := ks.Reconcile("kubernetes", time.Now()); err != nil {
				s.log.Error("policy edited in Kubernetes not applied", "store", ks.Where(), "err", err)
			}
		} else {
			s.rollouts.reload()
		}
		if err := s.reg.Reload(); err != nil {
			s.log.Error("shared state not reloaded", "store", ks.Where(), "err", err)
		}
		s.publishKeys()
	}
}

// publishKeys gives the proxies the API keys stored through the operator API.
func (s *Server) publishKeys() {
	keys, err := s.store.APIKeys()
	if err == nil {
		err = s.xds.SetKeys(registry.KeysFile(keys))
	}
	if err != nil {
		s.log.Error("API keys not published; proxies keep those they have", "err", err)
	}
}

// Run serves until ctx ends, then stops.
func (s *Server) Run(ctx context.Context) error {
	<-ctx.Done()
	return s.Close()
}

// Close stops everything; safe to call more than once and after a failed Start.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		if s.cancel != nil {
			s.cancel()
		}
		if s.api != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_ = s.api.Shutdown(ctx)
			cancel()
			s.apiGRPC.Stop()
		}
		s.wg.Wait()
		s.ingest.Close()
		s.view.Close()
		s.store.Close()
		if s.opts.RemoveDataDir && s.opts.DataDir != "" {
			_ = os.RemoveAll(s.opts.DataDir)
		}
	})
	return nil
}

// awaitCatchUp closes ready once every worker's subscriber has replayed what its engine
// buffers, or after CatchUpTimeout.
func (s *Server) awaitCatchUp(ctx context.Context) {
	defer close(s.ready)
	deadline := time.Now().Add(CatchUpTimeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		done := true
		for _, w := range s.reg.Workers() {
			if w.KVEvents == "" && w.KVEventsBind == "" {
				continue
			}
			if st := s.ingest.Stats(w.ID); st == nil || !st.CaughtUp.Load() {
				done = false
				break
			}
		}
		if done {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// loop reacts to the registry, the load view and the proxies' load reports.
func (s *Server) loop(ctx context.Context) {
	tick := time.NewTicker(s.opts.PublishInterval)
	defer tick.Stop()
	dirty := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.reg.Changes():
			s.reconcile()
			s.publish(true)
			dirty = false
		case <-s.view.Changed():
			dirty = true
		case <-s.xds.LoadChanged():
			dirty = true
		case <-s.remoteChanged:
			dirty = true
		case <-tick.C:
			// A change a forced publish left behind stays pending until a tick publishes it.
			if dirty && s.publish(false) {
				dirty = false
			}
			// The refresh waits for the load budget too (publish without force): where a
			// push costs more than a LoadRefresh of it, pushes go as the budget allows.
			if s.sincePublished() >= s.opts.LoadRefresh && s.publish(false) {
				dirty = false
			}
		}
	}
}

// assignSlots gives the workers the index does not hold yet their slots, in the order of
// their models and then ids, each the lowest free. It runs before any event or publish can
// give one (reconcile, workerResources), so that replicas that see the same registry give
// the same slots, and a proxy that moves from one to another resumes its index journal
// instead of resnapshotting it (xds/journal's positions); and a model's workers take
// neighbouring slots, so that the replica of a proxy that routes that model only
// (--serve-models) holds few of the index's 64-slot shards, which its matches walk
// (BenchmarkMatchScope: 1,024 workers of 10,240 in 1.9 µs contiguous, 4.4 µs spread).
func (s *Server) assignSlots(ws []registry.Worker) {
	if !slices.ContainsFunc(ws, func(w registry.Worker) bool { _, ok := s.index.SlotOf(w.ID); return !ok }) {
		return // every worker has its slot: the common case, on each publish
	}
	order := slices.Clone(ws)
	slices.SortFunc(order, func(a, b registry.Worker) int {
		return cmp.Or(cmp.Compare(a.Model, b.Model), cmp.Compare(a.ID, b.ID))
	})
	ids := make([]string, len(order))
	for i, w := range order {
		ids[i] = w.ID
	}
	s.index.AddWorkers(ids)
}

// reconcile makes the subscribers and pollers follow the registry.
func (s *Server) reconcile() {
	ws := s.reg.Workers()
	eps := make([]ingest.Endpoint, 0, len(ws))
	targets := make([]loadview.Target, 0, len(ws))
	for _, w := range ws {
		ep := ingest.Endpoint{WorkerID: w.ID, Address: w.KVEvents, Replay: w.KVEventsReplay,
			Topic: w.KVEventsTopic, TopicGiven: w.KVEventsTopic != ""}
		if w.KVEventsBind != "" {
			ep.Address, ep.Bind = w.KVEventsBind, true
			if ep.Topic == "" {
				ep.Topic = ingest.DefaultTopic(w.URL, w.Model)
			}
		}
		eps = append(eps, ep)
		targets = append(targets, loadview.Target{ID: w.ID, URL: w.URL, MetricsURL: w.Metrics, Engine: engines.Kind(w.Engine)})
	}
	// Workers gone from the registry lose their blocks.
	known := map[string]bool{}
	for _, w := range ws {
		known[w.ID] = true
	}
	for _, id := range s.index.Workers() {
		if id != "" && !known[id] {
			s.ingest.RemoveWorker(id)
		}
	}
	s.assignSlots(ws)
	s.ingest.Sync(eps)
	s.view.Sync(targets)
	pol := s.reg.Policy()
	if err := s.xds.SetPolicy(policyResource(pol)); err != nil {
		s.log.Error("routing policy not published", "version", pol.Version, "err", err)
	}
}

// publish pushes the workers with their current load; force skips the rate limit. It
// reports whether it pushed (false: too soon after the last, by PublishInterval or by
// what the last push's loads cost of LoadPushBudget).
func (s *Server) publish(force bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now().UnixNano()
	if !force && now < s.nextPublish {
		return false
	}
	s.published = now
	if err := s.xds.SetWorkers(s.workerResources()); err != nil {
		s.log.Error("workers not published", "err", err)
	}
	gap := int64(s.opts.PublishInterval)
	if b := s.opts.LoadPushBudget; b > 0 {
		gap = max(gap, int64(float64(s.xds.LoadBytes())/float64(b)*float64(time.Second)))
	}
	s.nextPublish = now + gap
	return true
}

// observedLoad is a worker's load as published: its engine's (and when it was first read
// so), the proxies' in-flight sums with the merge they come from, and when it was sent.
type observedLoad struct {
	running, waiting uint32
	kv               float64
	at               int64
	inflight         uint32
	prefill, decode  uint64
	epoch            uint64
	sent             int64
}

// near reports whether o and n differ by no more than the load band: each count by an
// eighth of the larger or by one (but never between zero and not), the KV usage by less
// than 1/64. A busy engine's readings move on every scrape; within the band the control
// plane keeps publishing the last load until LoadRefresh passes, so that a push carries
// the workers whose load moved, not every busy one.
func (o observedLoad) near(n observedLoad) bool {
	return nearCount(uint64(o.running), uint64(n.running)) && nearCount(uint64(o.waiting), uint64(n.waiting)) &&
		math.Abs(o.kv-n.kv) < 1.0/64 && nearCount(uint64(o.inflight), uint64(n.inflight)) &&
		nearCount(o.prefill, n.prefill) && nearCount(o.decode, n.decode)
}

// banded is the load to publish for a worker whose load now reads cur (cur.sent: now; its
// engine's reading taken at observedAt), given prev, the load last published (ok: there is
// one): prev while cur is near it and prev is younger than refresh; else cur, timed by the
// engine's first reading of what it says now.
func banded(prev observedLoad, ok bool, cur observedLoad, observedAt time.Time, refresh int64) observedLoad {
	switch {
	case ok && prev.near(cur) && cur.sent-prev.sent < refresh:
		// Within the band: the load as last sent (the sums with their own merge's epoch,
		// so that each proxy still takes out its share in that merge).
		return prev
	case ok && prev.running == cur.running && prev.waiting == cur.waiting && prev.kv == cur.kv:
		// A worker whose metrics stay put is not sent again for a fresh timestamp.
		cur.at = prev.at
	case !observedAt.IsZero():
		cur.at = observedAt.UnixNano()
	}
	return cur
}

// nearCount reports whether counts a and b are within the band: equal, or both above zero
// and apart by one or by at most an eighth of the larger.
func nearCount(a, b uint64) bool {
	lo, hi := min(a, b), max(a, b)
	return lo == hi || lo > 0 && (hi-lo == 1 || (hi-lo)*8 <= hi)
}

// sincePublished is the time since the workers were last published.
func (s *Server) sincePublished() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Duration(time.Now().UnixNano() - s.published)
}

// setScopes gives the journal the models each slot's worker serves, as the Worker resources
// name them (the registry's model, or the one its engine reported): a proxy that follows some
// models only gets those workers' blocks. A worker with no model serves any (it is in every
// scope).
func (s *Server) setScopes(res []*xdsv1.Worker) {
	var bySlot [][]string
	for _, w := range res {
		slot := int(w.GetSlot())
		for len(bySlot) <= slot {
			bySlot = append(bySlot, nil)
		}
		ms := []string{}
		if w.GetModel() != "" {
			ms = append(append(ms, w.GetModel()), w.GetLoraAdapters()...)
		}
		bySlot[slot] = ms
	}
	s.scopes.Set(bySlot)
}

// workerResources builds the Worker resources from the registry, the load view, the index's
// slots and the proxies' in-flight reports.
func (s *Server) workerResources() []*xdsv1.Worker {
	ws := s.reg.Workers()
	s.assignSlots(ws) // a publish may come before reconcile has seen a new worker
	states := s.view.Snapshot()
	inflight, epochs := s.xds.MergedEpochs()
	remote := s.remote.sums()
	// What the proxies learned of the workers' latency, pooled: a proxy that knows less
	// starts from it. Pooled again at most as often as proxies send it.
	fits := s.xds.PooledFits(xdsclient.DefaultFitsEvery)
	out := make([]*xdsv1.Worker, 0, len(ws))
	if s.observed == nil {
		s.observed = map[string]observedLoad{}
	}
	seen := make(map[string]bool, len(ws))
	now := time.Now().UnixNano()
	for _, w := range ws {
		st := states[w.ID]
		role, _ := xds.ParseRole(w.Role)
		res := &xdsv1.Worker{
			Id:             w.ID,
			Url:            w.URL,
			Model:          w.Model,
			Role:           role,
			BlockSize:      uint32(w.BlockSize),
			CapacityBlocks: uint32(st.CapacityBlocks),
			Engine:         w.Engine,
			Slot:           uint32(s.index.Slot(w.ID)),
			// A worker not polled yet is taken as healthy: the proxies' own ejection covers
			// one that is not, and a fresh control plane does not turn the fleet away.
			Healthy:             st.Healthy || st.CheckedAt.IsZero(),
			Draining:            w.Draining,
			MaxNumSeqs:          uint32(w.MaxNumSeqs),
			MaxNumBatchedTokens: uint32(w.MaxNumBatchedTokens),
			LoraAdapters:        w.LoRAModules,
			KvTiers:             kvTiers(w),
			MaxModelLen:         uint32(min(max(st.Model.MaxModelLen, 0), 1<<31-1)),
		}
		if res.Model == "" {
			res.Model = st.Model.ID
		}
		res.Fit = xdsserver.FitFor(fits, res.Model, role, w.ID)
		if res.BlockSize == 0 {
			res.BlockSize = uint32(st.BlockSize)
		}
		l := &xdsv1.Load{Running: uint32(st.Load.Running), Waiting: uint32(st.Load.Waiting), KvUsage: st.Load.KVUsage, Epoch: epochs[w.ID]}
		seen[w.ID] = true
		in := inflight[w.ID]
		if r, ok := remote[w.ID]; ok {
			// The other replicas' proxies': no proxy here has a share of them to take out.
			in = in.Add(r)
		}
		if in != (xdsserver.WorkerLoad{}) {
			l.Inflight = uint32(min(in.Inflight, 1<<31))
			l.PrefillTokens = in.PrefillTokens
			l.DecodeBlocks = in.DecodeBlocks
		}
		o := observedLoad{running: l.Running, waiting: l.Waiting, kv: l.KvUsage, inflight: l.Inflight,
			prefill: l.PrefillTokens, decode: l.DecodeBlocks, epoch: l.Epoch, sent: now}
		prev, ok := s.observed[w.ID]
		if o = banded(prev, ok, o, st.ObservedAt, int64(s.opts.LoadRefresh)); !ok || o != prev {
			s.observed[w.ID] = o
		}
		l.Running, l.Waiting, l.KvUsage, l.ObservedUnixNano = o.running, o.waiting, o.kv, o.at
		l.Inflight, l.PrefillTokens, l.DecodeBlocks, l.Epoch = o.inflight, o.prefill, o.decode, o.epoch
		res.Load = l
		out = append(out, res)
	}
	for id := range s.observed {
		if !seen[id] {
			delete(s.observed, id)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	s.setScopes(out)
	return out
}

// policyResource turns a stored policy into its xDS resource.
func policyResource(p registry.Policy) *xdsv1.RoutingPolicy {
	r := routingResource(p)
	if p.Candidate != nil {
		r.Candidate = routingResource(*p.Candidate)
		r.CandidateShare, r.Shadow = p.CandidateShare, p.Shadow
	}
	return r
}

// routingResource is the routing part of a stored policy (no candidate).
func routingResource(p registry.Policy) *xdsv1.RoutingPolicy {
	return &xdsv1.RoutingPolicy{
		Version:           p.Version,
		Policy:            p.Name,
		OverlapWeight:     p.OverlapWeight,
		QueueWeight:       p.QueueWeight,
		Disagg:            p.Disagg,
		DisaggThreshold:   p.DisaggThreshold,
		Temperature:       p.Temperature,
		CacheThreshold:    p.CacheThreshold,
		TierWeights:       append([]float64(nil), p.TierWeights...),
		BusyPrefillTokens: p.BusyPrefillTokens,
		BusyDecodeBlocks:  p.BusyDecodeBlocks,
		BusyKvFraction:    p.BusyKVFraction,
		SessionTtlMs:      p.SessionTTL.Milliseconds(),
		ComputeWeight:     p.ComputeWeight,
		BackgroundWeight:  p.BackgroundWeight,
		Profile:           xds.ProfileResource(p.Profile),
	}
}

// apiHandler serves the operator API, JSON over HTTP and gRPC on one port, and /metrics.
// Reads are open when the API listens on loopback; mutations need the bearer token.
func (s *Server) apiHandler(fwd *forwarder) http.Handler {
	rejected := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrelay_controlplane_api_rejected_total", Help: "Operator API requests refused, by reason (host: a Host header that is not this loopback API's; unauthenticated; no_token; not_leader: a change sent to a replica that follows).",
	}, []string{"reason"})
	for _, r := range []string{"host", "unauthenticated", "no_token", "not_leader"} {
		rejected.WithLabelValues(r)
	}
	s.metrics.MustRegister(rejected)
	if fwd != nil {
		fwd.count = prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_controlplane_api_forwarded_total", Help: "Operator API changes this follower forwarded to the leader.",
		})
		s.metrics.MustRegister(fwd.count)
	}
	reject := func(reason string, r *http.Request) {
		rejected.WithLabelValues(reason).Inc()
		s.log.Debug("operator API request refused", "reason", reason, "method", r.Method, "path", r.URL.Path, "host", r.Host, "remote", r.RemoteAddr)
	}
	loopback := loopbackpkg.Addr(s.apiLis.Addr())
	opts := api.Options{Token: s.opts.APIToken, OpenReads: loopback, OnReject: reject}
	if s.opts.APITokenFile != "" {
		opts.TokenFunc = s.apiToken
	}
	if e := s.opts.Leader; e != nil {
		opts.Leader = func() error {
			if err := e.Check(); err != nil {
				return err
			}
			if !s.acting.Load() {
				return fmt.Errorf("%w: control plane replica %s has just taken the lead and is reading the shared state; retry in a moment", leader.ErrNotLeader, e.Identity())
			}
			return nil
		}
	}
	s.apiGRPC = grpc.NewServer()
	api.Register(s.apiGRPC, operator{s}, opts)
	mux := http.NewServeMux()
	var metricsToken func() string
	if s.opts.MetricsTokenFile != "" {
		metricsToken = s.metricsTok.get
	}
	mux.Handle("/metrics", opts.Metrics(promhttp.HandlerFor(s.metrics, promhttp.HandlerOpts{}), metricsToken))
	mux.HandleFunc("GET /readyz", s.readyz)
	if s.opts.Leader != nil || len(s.opts.ReplicaPeers) > 0 {
		mux.HandleFunc("GET "+replicaLoadPath, s.serveReplicaLoad)
	}
	mux.Handle("/v1/planner/", s.plannerRoute(opts))
	s.consoleRoutes(mux, opts)
	// The operator console's page: its data comes from the endpoints above, under their
	// read rule; the page itself holds none.
	mux.Handle("/ui/", ui.Handler("/ui/"))
	mux.Handle("/ui", http.RedirectHandler("/ui/", http.StatusMovedPermanently))
	mux.Handle("/", api.Handler(operator{s}, opts))
	var h http.Handler = api.Mux(s.apiGRPC, fwd.wrap(mux))
	if loopback {
		h = loopbackpkg.HostOnly(h, "this operator API", func(r *http.Request) { reject("host", r) })
	}
	return h
}

// readyz answers 200 once ingestion has caught up with the engines after a start (the
// replica's index is whole: a proxy may take its snapshot), 503 before, and 503 again while
// its watch of the shared state in Kubernetes keeps failing (it may serve a stale policy). It is open, as
// /healthz is: a kubelet's readiness probe carries no token. The body says whether this
// replica leads.
func (s *Server) readyz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	role := "leader"
	if !s.opts.Leader.Leading() {
		role = "follower"
	}
	if ks, ok := s.store.(*registry.KubeStore); ok {
		if err := ks.WatchFailing(); err != nil {
			// Its watch of the shared state keeps failing: what it serves may be stale.
			w.WriteHeader(http.StatusServiceUnavailable)
			b, _ := json.Marshal(err.Error())
			fmt.Fprintf(w, "{\"status\":\"watch_failing\",\"role\":%q,\"error\":%s}\n", role, b)
			return
		}
	}
	select {
	case <-s.ready:
		fmt.Fprintf(w, "{\"status\":\"ready\",\"role\":%q,\"leader\":%q}\n", role, s.opts.Leader.Leader())
	default:
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "{\"status\":\"catching_up\",\"role\":%q}\n", role)
	}
}

// ingestRate is the KV events per second ingested from every worker, over the last second
// or more.
func (s *Server) ingestRate() float64 {
	var total uint64
	for _, w := range s.reg.Workers() {
		if st := s.ingest.Stats(w.ID); st != nil {
			total += st.Events.Load()
		}
	}
	s.rateMu.Lock()
	defer s.rateMu.Unlock()
	now := time.Now()
	if d := now.Sub(s.rateAt); d >= time.Second || s.rateAt.IsZero() {
		if !s.rateAt.IsZero() && total >= s.rateTotal {
			s.rate = float64(total-s.rateTotal) / d.Seconds()
		}
		s.rateAt, s.rateTotal = now, total
	}
	return s.rate
}

// Registry returns the worker registry (for the operator API and tests).
func (s *Server) Registry() *registry.Registry { return s.reg }

// Index returns the global KV index.
func (s *Server) Index() *kvindex.Index { return s.index }

// XDS returns the xDS server.
func (s *Server) XDS() *xdsserver.Server { return s.xds }

// Journal returns the index journal and its server.
func (s *Server) Journal() (*journal.Log, *journal.Server) { return s.journal, s.jserver }

// Ingest returns the KV event ingestion manager.
func (s *Server) Ingest() *ingest.Manager { return s.ingest }

// View returns the load view.
func (s *Server) View() *loadview.View { return s.view }

// Registerer is the registry behind the operator API's /metrics: callers register extra
// collectors on it (the eBPF probes' metrics, for one). Safe for concurrent use.
func (s *Server) Registerer() prometheus.Registerer { return s.metrics }

// kvTiers is a worker's offloading tiers as xDS says them, nil when it advertises none.
func kvTiers(w registry.Worker) *xdsv1.KVTiers {
	if w.KVBytesPerToken <= 0 && w.HostBandwidth <= 0 && w.DiskBandwidth <= 0 && w.SharedBandwidth <= 0 && w.PeerBandwidth <= 0 && w.P2PPort <= 0 {
		return nil
	}
	return &xdsv1.KVTiers{KvBytesPerToken: uint64(w.KVBytesPerToken), HostBandwidth: w.HostBandwidth, DiskBandwidth: w.DiskBandwidth, SharedBandwidth: w.SharedBandwidth,
		PeerBandwidth: w.PeerBandwidth, P2PPort: uint32(w.P2PPort)}
}

// DefaultAPIReadTimeout is Options.APIReadTimeout's default.
const DefaultAPIReadTimeout = 30 * time.Second

// tokenReread is how often the control plane reads a token file again.
const tokenReread = 5 * time.Second

// tokenFile is a token read from a file again when the last read is tokenReread old, so that
// a rotated token (a Kubernetes Secret updated in place) takes effect without a restart; a
// read that fails or finds the file empty keeps the token in force, and says so in the log.
type tokenFile struct {
	what, file, initial string
	log                 *slog.Logger

	mu    sync.Mutex
	token string
	read  time.Time
}

// get is the token in force.
func (f *tokenFile) get() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if now := time.Now(); now.Sub(f.read) >= tokenReread {
		f.read = now
		b, err := os.ReadFile(f.file)
		switch t := strings.TrimSpace(string(b)); {
		case err != nil:
			f.log.Warn(f.what+" file not read again; the token in force stays", "file", f.file, "err", err)
		case t == "":
			f.log.Warn(f.what+" file is empty; the token in force stays", "file", f.file)
		case t != f.token:
			if f.token != "" {
				f.log.Info(f.what+" changed", "file", f.file)
			}
			f.token = t
		}
		if f.token == "" {
			f.token = f.initial
		}
	}
	return f.token
}

// apiToken is the operator API's token from Options.APITokenFile.
func (s *Server) apiToken() string { return s.apiTok.get() }
