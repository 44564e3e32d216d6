package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/kubeauth"
	"github.com/kvrelay/kvrelay/controlplane/leader"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/ebpf"
)

func newControlPlaneCmd() *cobra.Command {
	var (
		opts      controlplane.Options
		workers   []string
		tokenFile string
		k8sNS     string
		k8sSel    string
		k8sPool   string
		k8sTmpl   string
		kubeconf  string
		ebpfF     ebpfFlags
		ebpfLoad  bool
		pf        cpPlannerFlags
		lf        leaderFlags
		sf        storeFlags
		// --xds-kube-auth's ServiceAccounts and audience
		xdsKubeSAs      []string
		xdsKubeAudience string
	)
	cmd := &cobra.Command{
		Use:   "controlplane",
		Short: "Run the control plane: KV events from every engine, one global index, pushed to proxies",
		Long: `controlplane subscribes to every worker's KV events, keeps the global prefix index and the
fleet's load, and pushes workers, load, routing policy and the index to proxies
(kvrelay proxy --xds) over delta xDS. Operators manage it with kvrelay ctl.

A --worker is comma-separated key=value pairs: id, url, model, role (both|prefill|decode),
block-size, kv-events (a PUB endpoint to dial), kv-events-bind (an endpoint to bind for
publishers that connect out), kv-events-topic, kv-events-replay, metrics, engine
(vllm|sglang|trtllm|sim), max-num-seqs and max-num-batched-tokens (the engine's scheduler
limits, which the latency policy predicts queueing from; learned from the engine's
running and waiting counts when not given). Model and block size are discovered when not
given.

Several workers may name one kv-events-bind endpoint: the control plane binds it once and
tells the publishers apart by topic, each worker's kv-events-topic or by default
kv@<host:port>@<model> from its url and model (llm-d's convention). Messages whose topic no
worker claims are dropped and counted (kvrelay_controlplane_ingest_unclaimed_total).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			for _, v := range workers {
				w, err := registry.ParseWorker(v)
				if err != nil {
					return fmt.Errorf("--worker: %w", err)
				}
				opts.Workers = append(opts.Workers, w)
			}
			if tokenFile != "" {
				b, err := os.ReadFile(tokenFile)
				if err != nil {
					return fmt.Errorf("reading --api-token-file: %w", err)
				}
				opts.APIToken = strings.TrimSpace(string(b))
				if opts.APIToken == "" {
					return fmt.Errorf("--api-token-file %s is empty", tokenFile)
				}
				opts.APITokenFile = tokenFile // read again: a rotated token takes effect
			}
			if k8sSel != "" && k8sPool != "" {
				return fmt.Errorf("--k8s-selector and --k8s-inference-pool: choose one way to discover workers")
			}
			if k8sSel != "" || k8sPool != "" {
				src, err := k8sSource(kubeconf, k8sNS, k8sSel, k8sPool, k8sTmpl)
				if err != nil {
					return err
				}
				opts.K8s = src
			}
			opts.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
			// client-go (discovery, leader election) logs through klog: into the same log.
			klog.SetSlogLogger(opts.Logger)
			if lf.enabled {
				e, err := lf.build(kubeconf, k8sNS, opts.Logger)
				if err != nil {
					return err
				}
				opts.Leader = e
			}
			if err := sf.build(&opts, kubeconf, k8sNS); err != nil {
				return err
			}
			if len(xdsKubeSAs) > 0 {
				cfg, err := kubeConfig(kubeconf)
				if err != nil {
					return fmt.Errorf("--xds-kube-auth: %w", err)
				}
				cfg.Timeout = kubeTimeout
				client, err := kubernetes.NewForConfig(cfg)
				if err != nil {
					return fmt.Errorf("--xds-kube-auth: kubernetes client: %w", err)
				}
				if opts.XDSAuth.Reviewer, err = kubeauth.New(client, xdsKubeAudience, xdsKubeSAs); err != nil {
					return fmt.Errorf("--xds-kube-auth: %w", err)
				}
			}
			return runControlPlane(cmd.Context(), cmd.OutOrStdout(), opts, ebpfF, ebpfLoad, cpPlanner{flags: &pf, kubeconfig: kubeconf, namespace: k8sNS})
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&opts.XDSListen, "xds-listen", "127.0.0.1:18000", "address proxies connect to (delta ADS, index journal, load reports)")
	fs.StringVar(&opts.XDSAuth.CertFile, "xds-cert", "", "the xDS listener's certificate (PEM, with --xds-key): proxies connect over TLS; read again when it changes")
	fs.StringVar(&opts.XDSAuth.KeyFile, "xds-key", "", "key (PEM) of --xds-cert")
	fs.StringVar(&opts.XDSAuth.ClientCAFile, "xds-client-ca", "", "CA (PEM) that signs proxies' certificates: mutual TLS, and a proxy may claim only a node id its certificate names (common name, DNS or URI SAN)")
	fs.StringVar(&opts.XDSAuth.TokensFile, "xds-tokens-file", "", "proxies' bearer tokens, one \"<node-id> <token>\" a line: a stream without one is refused, and a token's holder may claim only its node id (read again when it changes)")
	fs.BoolVar(&opts.XDSAuth.Insecure, "xds-insecure", false, "serve xDS on an address other than loopback without TLS and proxy credentials")
	fs.StringSliceVar(&xdsKubeSAs, "xds-kube-auth", nil, "admit proxies by their Kubernetes ServiceAccount token (namespace/name, comma-separated): each proxy sends a token projected into its pod for --xds-kube-audience (its --xds-token-file), checked with a TokenReview, and may claim only its pod's name as node id")
	fs.StringVar(&xdsKubeAudience, "xds-kube-audience", kubeauth.DefaultAudience, "the audience the proxies' ServiceAccount tokens are issued for (--xds-kube-auth)")
	fs.IntVar(&opts.XDSMaxConnsPerPeer, "xds-max-conns-per-peer", 0, "xDS connections one source address may hold (0: 32); raise it where proxies reach the control plane through a NAT or a sidecar, sharing an address")
	fs.IntVar(&opts.XDSMaxStreamsPerPeer, "xds-max-streams-per-peer", 0, "xDS streams one source address may hold (0: 64; a proxy opens 3)")
	fs.StringVar(&opts.APIListen, "api-listen", "127.0.0.1:18080", "operator API (JSON over HTTP and gRPC) and /metrics")
	fs.StringVar(&opts.APICertFile, "api-cert", "", "certificate (PEM, with --api-key): the operator API, /metrics and the console serve HTTPS; read again when it changes")
	fs.StringVar(&opts.APIKeyFile, "api-key", "", "key (PEM) of --api-cert")
	fs.StringVar(&opts.MetricsTokenFile, "metrics-token-file", "", "file holding a read-only bearer token for /metrics (read again every 5 s): beyond loopback /metrics answers it or the API token, nothing else")
	fs.StringVar(&opts.APIAdvertise, "api-advertise", "", "address (host:port) the other replicas reach this one's operator API at: a follower forwards the changes it gets to the leader's (--leader-elect with --store kubernetes; default: --api-listen's address unless it is every interface)")
	fs.StringVar(&opts.APIPeerCAFile, "api-peer-ca", "", "CA (PEM) that verifies the leader's operator API certificate when a follower forwards a change over HTTPS")
	fs.StringSliceVar(&opts.ReplicaPeers, "replica-peers", nil, "the other replicas' operator API addresses (host:port, comma-separated) where replicas run without --leader-elect: each shares its proxies' in-flight load and its polls of the engines with them (every replica needs the same --api-token-file)")
	fs.StringVar(&opts.ReplicaID, "replica-id", "", "this replica's name to --replica-peers (default: its operator API's address)")
	fs.StringVar(&opts.APIPeerServerName, "api-peer-server-name", "", "name the leader's operator API certificate must carry when a follower forwards a change (default: the leader's advertised host)")
	fs.StringVar(&opts.DataDir, "data-dir", "", "directory for the registry and policies (required unless --store kubernetes)")
	addEBPFFlags(fs, &ebpfF, ebpfCgroupOwn)
	fs.BoolVar(&ebpfLoad, "ebpf-load-signals", false, "always count connections waiting in a worker's accept queue (eBPF listen_queue probe) and the requests its recent first-byte latency implies (first_byte probe) as waiting requests in its load (otherwise: while the routing policy's kernel_load_signals is on)")
	fs.StringArrayVar(&workers, "worker", nil, "a worker: id=,url=,kv-events=,engine=,... (repeat for each)")
	fs.StringVar(&opts.WorkersFile, "workers-file", "", "YAML file of workers, reloaded when it changes")
	fs.StringVar(&tokenFile, "api-token-file", "", "file holding the bearer token that mutating operator calls need (read again every 5 s: a rotated token takes effect without a restart)")
	fs.DurationVar(&opts.ScrapeInterval, "scrape-interval", 100*time.Millisecond, "how often each worker's metrics are read")
	fs.IntVar(&opts.LoadPushBudget, "load-push-budget", 0, "bytes a second the workers' loads may take on each proxy's stream (0: no bound; loads are then pushed every 50 ms when they move): a push of B bytes waits B / budget for the next, so a large fleet's loads arrive less often instead of taking more")
	fs.StringVar(&k8sSel, "k8s-selector", "", "discover workers from the Kubernetes EndpointSlices with this label selector (e.g. app=vllm)")
	fs.StringVar(&k8sPool, "k8s-inference-pool", "", "discover workers from the pods of this Gateway API InferencePool (inference.networking.k8s.io/v1) in --k8s-namespace: its selector and target ports; a pod's llm-d.ai/role label sets its role and its kvrelay.io/worker annotation (--worker form without id and url) the rest")
	fs.StringVar(&k8sNS, "k8s-namespace", "default", "namespace of the EndpointSlices or the InferencePool")
	fs.StringVar(&k8sTmpl, "k8s-worker", "engine=vllm", "fields of discovered workers, in --worker form without id and url (e.g. engine=vllm,kv-events=tcp://*:5557)")
	fs.StringVar(&kubeconf, "kubeconfig", "", "kubeconfig file (default: in-cluster configuration)")
	pf.register(fs)
	lf.register(fs)
	sf.register(fs)
	return cmd
}

// cpPlanner is the control plane command's planner: its flags and the Kubernetes client's.
type cpPlanner struct {
	flags      *cpPlannerFlags
	kubeconfig string
	namespace  string
}

// runControlPlane starts a control plane (and its planner, with --planner) and serves until
// ctx ends.
func runControlPlane(ctx context.Context, out io.Writer, opts controlplane.Options, ebpfF ebpfFlags, ebpfLoad bool, pl cpPlanner) error {
	// The load view asks the probes once they run (they follow the registry, which New opens).
	var probes atomic.Pointer[ebpf.Collector]
	if ebpfF.mode != "off" {
		opts.KernelWaitingAlways = ebpfLoad
		opts.KernelWaiting = func(id string) (int, bool) {
			if c := probes.Load(); c != nil {
				return c.AcceptQueue(id)
			}
			return 0, false
		}
		opts.KernelLatencyWaiting = func(id string) (int, bool) {
			if c := probes.Load(); c != nil {
				return c.FirstByteWaiting(id)
			}
			return 0, false
		}
	}
	if opts.ValidateProfile == nil {
		opts.ValidateProfile = routingPlugins().Validate
	}
	cp, err := controlplane.New(opts)
	if err != nil {
		return err
	}
	if err := cp.Start(ctx); err != nil {
		_ = cp.Close()
		return err
	}
	// The probes watch the registered workers' connections from this host (its scrapes, and
	// a proxy's when one runs here) and their accept queues, on the operator API's /metrics.
	c, err := startEBPF(ctx, ebpfF, registryEBPFTargets(cp.Registry()), nil)
	if err == nil {
		// (--ebpf-cgroup dial: the xDS and API listeners are open; a failure is logged and
		// leaves the probes on the process's cgroup)
		_ = c.EnterDialScope(0)
		if err = cp.Registerer().Register(c); err != nil {
			_ = c.Close()
		}
	}
	if err != nil {
		_ = cp.Close()
		return err
	}
	probes.Store(c)
	defer c.Close() // (before exit: leaves the dial scope, if any, and removes it)
	fmt.Fprintf(out, "kvrelay control plane: xds %s  api http://%s  %d workers\n", cp.XDSAddr(), cp.APIAddr(), len(cp.Registry().Workers()))
	if pl.flags == nil || !pl.flags.enabled {
		return cp.Run(ctx)
	}
	env := plannerEnv{reg: cp.Registry(), namespace: pl.namespace, log: pl.flags.logger(),
		kube: func() (kubernetes.Interface, error) { return kubeClient(pl.kubeconfig) }}
	if opts.Leader != nil {
		env.leader = opts.Leader.Check
	}
	p, closeAct, err := pl.flags.build(env)
	if err == nil {
		if err = cp.SetPlanner(p.Handler(), p.Collector()); err != nil {
			_ = closeAct()
		}
	}
	if err != nil {
		_ = cp.Close()
		return err
	}
	pl.flags.describe(out, p, cp.APIAddr())
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return cp.Run(gctx) })
	g.Go(func() error { return runPlanner(gctx, p, closeAct) })
	return g.Wait()
}

// kubeClient is a Kubernetes client from a kubeconfig file, or in-cluster without one.
func kubeClient(kubeconfig string) (kubernetes.Interface, error) {
	cfg, err := kubeConfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return client, nil
}

// kubeConfig is the client configuration from a kubeconfig file, or in-cluster without one.
func kubeConfig(kubeconfig string) (*rest.Config, error) {
	var (
		cfg *rest.Config
		err error
	)
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes configuration: %w", err)
	}
	return cfg, nil
}

// k8sSource builds the discovery of `--k8s-selector` (EndpointSlices) or
// `--k8s-inference-pool`.
func k8sSource(kubeconfig, namespace, selector, pool, tmpl string) (*controlplane.K8sSource, error) {
	w, err := registry.ParseTemplate(tmpl)
	if err != nil {
		return nil, fmt.Errorf("--k8s-worker: %w", err)
	}
	cfg, err := kubeConfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	var dyn dynamic.Interface
	if pool != "" {
		if dyn, err = dynamic.NewForConfig(cfg); err != nil {
			return nil, fmt.Errorf("kubernetes client: %w", err)
		}
	}
	return &controlplane.K8sSource{Client: client, Dynamic: dyn, Namespace: namespace, Selector: selector, InferencePool: pool, Template: w}, nil
}

// storeFlags are the control plane's --store flags.
type storeFlags struct {
	kind, namespace, name string
}

func (f *storeFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.kind, "store", "bolt", "where the API workers, drain settings, routing policy and rollouts live: bolt (a database in --data-dir, one process) or kubernetes (kvrelay.io custom resources that every replica watches and the leader writes; the chart's CRDs must be installed)")
	fs.StringVar(&f.namespace, "store-namespace", "", "namespace of the kvrelay.io resources with --store kubernetes (default: $POD_NAMESPACE, else --k8s-namespace)")
	fs.StringVar(&f.name, "store-name", "kvrelay", "name of this control plane's resources with --store kubernetes (its KvrelayPolicy; the others' prefix and kvrelay.io/control-plane label), the same for every replica")
}

// storeTimeout bounds how long a starting control plane waits to list its resources.
const storeTimeout = 30 * time.Second

// build sets opts.Store for --store kubernetes, and checks --data-dir for bolt.
func (f *storeFlags) build(opts *controlplane.Options, kubeconfig, defaultNS string) error {
	switch f.kind {
	case "bolt":
		if opts.DataDir == "" {
			return errors.New("--data-dir is required (or --store kubernetes)")
		}
		return nil
	case "kubernetes":
	default:
		return fmt.Errorf("--store %q: want bolt or kubernetes", f.kind)
	}
	cfg, err := kubeConfig(kubeconfig)
	if err != nil {
		return fmt.Errorf("--store kubernetes: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("--store kubernetes: kubernetes client: %w", err)
	}
	ns := f.namespace
	if ns == "" {
		ns = os.Getenv("POD_NAMESPACE")
	}
	if ns == "" {
		ns = defaultNS
	}
	st, err := registry.OpenKube(dyn, ns, f.name, storeTimeout, opts.Logger)
	if err != nil {
		return fmt.Errorf("--store kubernetes: %w", err)
	}
	// In a pod (the chart gives POD_NAME and POD_UID), what this replica shares with the
	// others goes when the pod does.
	if pod, uid := os.Getenv("POD_NAME"), os.Getenv("POD_UID"); pod != "" && uid != "" {
		st.SetShareOwner(pod, uid)
	}
	opts.Store = st
	return nil
}

// kubeTimeout bounds each Lease call of the leader election.
const kubeTimeout = 10 * time.Second

// leaderFlags are the control plane's --leader-elect flags.
type leaderFlags struct {
	enabled             bool
	namespace, name, id string
	lease, renew, retry time.Duration
}

func (f *leaderFlags) register(fs *pflag.FlagSet) {
	fs.BoolVar(&f.enabled, "leader-elect", false, "run as one of several replicas: only the one holding a coordination.k8s.io Lease makes changes (operator API writes, rollout steps, planner scaling); the others ingest, index and serve proxies, and refuse writes naming the leader")
	fs.StringVar(&f.namespace, "leader-elect-namespace", "", "namespace of the Lease (default: $POD_NAMESPACE, else --k8s-namespace)")
	fs.StringVar(&f.name, "leader-elect-lease", "kvrelay-controlplane", "name of the Lease, the same for every replica of one control plane")
	fs.StringVar(&f.id, "leader-elect-identity", "", "this replica's name in the Lease (default: $POD_NAME, else the host name)")
	fs.DurationVar(&f.lease, "leader-elect-lease-duration", leader.DefaultLeaseDuration, "how long followers wait, after the leader last renewed, before one takes over")
	fs.DurationVar(&f.renew, "leader-elect-renew-deadline", leader.DefaultRenewDeadline, "how long the leader keeps trying to renew before it stops leading (less than the lease duration)")
	fs.DurationVar(&f.retry, "leader-elect-retry-period", leader.DefaultRetryPeriod, "how often replicas try to take or renew the Lease")
}

// build makes the elector from the flags and the Kubernetes client's configuration.
func (f *leaderFlags) build(kubeconfig, defaultNS string, log *slog.Logger) (*leader.Elector, error) {
	if f.renew >= f.lease || f.retry >= f.renew {
		return nil, fmt.Errorf("--leader-elect: want retry period (%s) < renew deadline (%s) < lease duration (%s)", f.retry, f.renew, f.lease)
	}
	cfg, err := kubeConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--leader-elect: %w", err)
	}
	// Every Lease call is short: one to an API server that stopped answering fails in time
	// for the renew deadline, and the release on shutdown does not hang. (Not on the
	// discovery client's config: it would cut its watches.)
	cfg.Timeout = min(kubeTimeout, f.renew/2)
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--leader-elect: kubernetes client: %w", err)
	}
	ns := f.namespace
	if ns == "" {
		ns = os.Getenv("POD_NAMESPACE")
	}
	if ns == "" {
		ns = defaultNS
	}
	id := f.id
	if id == "" {
		id = os.Getenv("POD_NAME")
	}
	return leader.New(leader.Config{Client: client, Namespace: ns, Name: f.name, Identity: id,
		LeaseDuration: f.lease, RenewDeadline: f.renew, RetryPeriod: f.retry, Logger: log})
}
