package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/dataplane/telemetry"
	"github.com/kvrelay/kvrelay/ebpf"
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/internal/loopback"
)

func newProxyCmd() *cobra.Command {
	cfg := proxy.DefaultConfig()
	var (
		configPath string
		upstreams  []string
		adminAddr  string
		ebpfF      ebpfFlags
	)
	cmd := &cobra.Command{
		Use:   "proxy",
		Short: "Run the KV-aware OpenAI edge proxy in front of engines",
		Long: `proxy serves the OpenAI API on --listen and sends each request to the upstream engine
that holds most of its prompt in KV cache without overloading anyone (--policy kv), to the
one predicted to give it its first token soonest (--policy latency: queue wait from the
engine's requests against its max-num-seqs and step budget, plus prefill of what it does not
cache, learned online from what each engine does), or by a baseline policy. Under a control
plane (--xds) the policy the control plane pushes wins over --policy and its weights.
Settings come from flags, or from a YAML file (--config) whose keys are the flag names with
underscores; flags given explicitly override the file.

An --upstream is a URL (http://host:port) or key=value pairs: id=w1,url=http://host:port,
model=NAME,capacity=BLOCKS,role=prefill|decode|both,max-num-seqs=N,max-num-batched-tokens=N.

Under the latency policy, requests may carry latency targets (x-slo-ttft-ms, x-slo-tpot-ms):
they go to the worker predicted to meet them with the most headroom, wait in the admission
queue for one until the TTFT target passes, or get 429. --admin-listen serves the sampled
decisions with every candidate's prediction (/debug/decisions), each worker's latency model
(/debug/latency) and Go's pprof.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			final, err := proxyConfig(cmd.Flags(), cfg, configPath, upstreams)
			if err != nil {
				return err
			}
			return runProxy(cmd.Context(), cmd.OutOrStdout(), final, ebpfF, adminAddr)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&configPath, "config", "", "YAML file with the proxy's settings")
	addEBPFFlags(fs, &ebpfF, ebpfCgroupDial)
	fs.StringVar(&cfg.Listen, "listen", cfg.Listen, "client-facing address")
	fs.StringVar(&cfg.APIKeysFile, "api-keys-file", "", apiKeysFileHelp)
	fs.StringArrayVar(&upstreams, "upstream", nil, "an engine: URL or id=,url=,model=,capacity=,role=,engine=,max-num-seqs=,kv-bytes-per-token=,host-bandwidth=,disk-bandwidth=,shared-bandwidth=,peer-bandwidth=,p2p-port= (repeat for each)")
	addRoutingFlags(fs, &cfg)
	fs.BoolVar(&cfg.ExposeWorkerHeader, "expose-worker-header", false, "add x-kvrelay-worker to responses (reveals topology)")
	fs.BoolVar(&cfg.ExposeDecisionHeader, "expose-decision-header", false, "latency policy: add x-kvrelay-decision (every candidate's predicted TTFT, queue, prefill, cached blocks) to responses")
	fs.IntVar(&cfg.Retries, "retries", cfg.Retries, "other workers tried after a failure before the first byte")
	fs.DurationVar(&cfg.FirstByteTimeout, "first-byte-timeout", cfg.FirstByteTimeout, "an engine that has not started answering within this (or ten times the predicted TTFT, if longer) is taken out and the request tries another")
	fs.DurationVar(&cfg.StreamIdleTimeout, "stream-idle-timeout", cfg.StreamIdleTimeout, "an answer the engine sends nothing more of for this long ends with an error event, and the engine is taken out")
	fs.DurationVar(&cfg.FrozenAfter, "frozen-after", cfg.FrozenAfter, "a worker whose streams and connections all sent nothing for this long is frozen: taken out at once, its requests waiting for a first byte tried elsewhere (0: only the first-byte and stream-idle timeouts)")
	fs.DurationVar(&cfg.ClientStallTimeout, "client-stall-timeout", cfg.ClientStallTimeout, "cut off a client that takes nothing of its streamed answer for this long (counted from the last byte its kernel acknowledged), cancelling the engine request")
	fs.IntVar(&cfg.EventLoops, "event-loops", 0, "gnet event loops, each on its own thread (0: GOMAXPROCS-1, at least one)")
	fs.StringVar(&adminAddr, "admin-listen", "127.0.0.1:0", "serve /metrics, sampled routing decisions (/debug/decisions), latency models (/debug/latency) and Go's pprof on this address (default: a free loopback port, printed at start; empty: off). The client port answers /metrics too while it listens on loopback")
	fs.StringVar(&adminAddr, "debug-addr", "", "deprecated spelling of --admin-listen")
	_ = fs.MarkDeprecated("debug-addr", "use --admin-listen")
	return cmd
}

// addRoutingFlags adds to fs the flags of the routing core that kvrelay proxy and kvrelay
// epp share: where workers come from (a control plane or --upstream, added by each command),
// the policy and its weights, tokenization, disaggregation, the busy thresholds and the
// admission queue.
func addRoutingFlags(fs *pflag.FlagSet, cfg *proxy.Config) {
	fs.StringVar(&cfg.XDS, "xds", "", "control plane's xDS address (host:port): workers, load, policy and KV index come from it (no --upstream)")
	fs.StringSliceVar(&cfg.ServeModels, "serve-models", nil, "with --xds, the models this proxy routes (comma-separated): it takes only their workers and follows only their part of the KV index (default: every model)")
	fs.BoolVar(&cfg.IndexQuery, "index-query", false, "with --xds, keep no replica of the KV index: ask the control plane's index about each prompt before routing it (for a pool whose index is too large to replicate in every proxy)")
	fs.DurationVar(&cfg.IndexQueryTimeout, "index-query-timeout", cfg.IndexQueryTimeout, "with --index-query, how long a prompt waits for the control plane's answer before it routes as uncached")
	fs.StringVar(&cfg.NodeID, "node-id", "", "this proxy's name to the control plane (default hostname-pid; with credentials, the node id its token or certificate was issued for)")
	fs.StringVar(&cfg.XDSAuth.CAFile, "xds-ca", "", "CA certificate (PEM) that verifies the control plane's: the xDS connection is TLS")
	fs.StringVar(&cfg.XDSAuth.CertFile, "xds-cert", "", "this proxy's certificate (PEM) for mutual TLS with the control plane (with --xds-key)")
	fs.StringVar(&cfg.XDSAuth.KeyFile, "xds-key", "", "key (PEM) of --xds-cert")
	fs.StringVar(&cfg.XDSAuth.ServerName, "xds-server-name", "", "name the control plane's certificate must carry (default: the --xds host)")
	fs.StringVar(&cfg.XDSAuth.TokenFile, "xds-token-file", "", "file holding this proxy's bearer token for the control plane (read again when it changes)")
	fs.BoolVar(&cfg.XDSAuth.Insecure, "xds-insecure", false, "allow a plaintext xDS connection to an address other than loopback")
	fs.BoolVar(&cfg.EngineMetrics, "engine-metrics", cfg.EngineMetrics, "without --xds, poll each upstream's /metrics (vLLM's names) every 100 ms for its running and waiting requests and KV usage, which routing counts and learns each engine's concurrency limit from")
	fs.DurationVar(&cfg.LoadStaleAfter, "load-stale-after", cfg.LoadStaleAfter, "under --xds, a worker's pushed load older than this fades to the proxy's own view over as long again")
	fs.StringVar(&cfg.Policy, "policy", cfg.Policy, "routing policy: "+strings.Join(route.PolicyNames(), ", ")+" (under --xds the control plane's policy wins)")
	fs.IntVar(&cfg.BlockSize, "block-size", cfg.BlockSize, "engines' KV block size in tokens")
	fs.StringVar(&cfg.Tokenizer, "tokenizer", "", "o200k_harmony, o200k_base, cl100k_base, a tokenizer.json path, remote or estimate (default: by model)")
	fs.StringVar(&cfg.ChatTemplate, "chat-template", "", "harmony, chatml, llama3, or a tokenizer_config.json / .jinja path (default: by model)")
	fs.BoolVar(&cfg.ForwardPriority, "forward-priority", false, "send priority hints to engines as their own priority field (vLLM needs --scheduling-policy priority)")
	fs.Float64Var(&cfg.OverlapWeight, "overlap-weight", cfg.OverlapWeight, "KV cost of a prompt block the worker must compute (a block held by decodes costs 1)")
	fs.Float64Var(&cfg.QueueWeight, "queue-weight", cfg.QueueWeight, "KV cost of a block of the worker's prefill backlog (uncached tokens it still has to compute)")
	fs.Float64Var(&cfg.Temperature, "temperature", cfg.Temperature, "> 0 samples workers by a softmax over normalised costs")
	fs.Float64Var(&cfg.ComputeWeight, "compute-weight", cfg.ComputeWeight, "latency policy: the request's own prefill time weighed again beside its predicted TTFT (0: the soonest first token alone)")
	fs.Float64Var(&cfg.BackgroundWeight, "background-weight", cfg.BackgroundWeight, "latency policy: a request with a priority below 0 weighs its prefill time once more per interactive request on the worker")
	fs.Float64Var(&cfg.WaitWeight, "wait-weight", cfg.WaitWeight, "latency policy: weight of a request's wait for a sequence slot, again beside its predicted TTFT (0, the default: off; applies under --xds too)")
	fs.Float64Var(&cfg.TailWeight, "tail-weight", cfg.TailWeight, "latency policy: weight of a prediction's spread (one standard deviation of its TTFT) beside its mean (0: route on the mean; applies under --xds too)")
	fs.Float64Var(&cfg.BalanceWeight, "balance-weight", cfg.BalanceWeight, "latency policy: weight of the slot time a request takes from a worker short of free slots (0: off; applies under --xds too)")
	fs.StringVar(&cfg.Onboard, "onboard", cfg.Onboard, "latency policy: blocks a worker caches below GPU memory are weighed (weigh: load or compute, whichever is predicted sooner; the default), always loaded, or never loaded (max_load_tokens 0); applies under --xds too")
	fs.Float64Var(&cfg.Explore, "explore", cfg.Explore, "latency policy: share of decisions that try a worker its model has learned nothing of for 10 s, when one is predicted within a quarter of the best (0: never; applies under --xds too)")
	fs.Float64Var(&cfg.BatchWeight, "batch-weight", cfg.BatchWeight, "latency policy: weight of the decode time a request's joining a worker's running batch adds to that batch and itself (0: off; applies under --xds too)")
	fs.Float64Var(&cfg.CacheThreshold, "cache-threshold", cfg.CacheThreshold, "below this cached share of the prompt, spread by load")
	fs.StringVar(&cfg.Disagg, "disagg", cfg.Disagg, "auto (split requests into prefill and decode legs when the pool has both roles) or off")
	fs.IntVar(&cfg.DisaggThreshold, "disagg-threshold", cfg.DisaggThreshold, "prompts whose part the decode worker does not cache is at most this many tokens prefill on the decode worker (negative: always remotely)")
	fs.Int64Var(&cfg.DisaggMaxQueue, "disagg-max-queue", cfg.DisaggMaxQueue, "conditional disaggregation: past this many prompt tokens queued on the best prefill worker, the decode worker prefills itself (0: never)")
	fs.DurationVar(&cfg.PrefillTimeout, "prefill-timeout", cfg.PrefillTimeout, "how long a prefill leg may take before the decode worker prefills itself")
	fs.Int64Var(&cfg.BusyPrefillTokens, "busy-prefill-tokens", 0, "a worker with more uncached prompt tokens in flight takes no new request (0: off; under --xds the control plane's policy wins)")
	fs.Int64Var(&cfg.BusyDecodeBlocks, "busy-decode-blocks", 0, "a worker holding more KV blocks takes no new request (0: off; under --xds the control plane's policy wins)")
	fs.Int64Var(&cfg.BusyRequests, "busy-requests", 0, "a worker running this many requests takes no new request (its slots, or fewer; 0: off)")
	fs.Int64Var(&cfg.TenantHeadroom, "tenant-headroom", 0, "with --api-keys-file and --busy-requests: slots of each worker a tenant already running its weighted share may not take, kept for the tenants below theirs")
	fs.IntVar(&cfg.QueueSize, "queue-size", cfg.QueueSize, "requests that may wait for a worker under its busy thresholds")
	fs.DurationVar(&cfg.QueueTimeout, "queue-timeout", cfg.QueueTimeout, "how long a request may wait in the queue")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", cfg.MaxBodyBytes, "largest request body (larger gets 413)")
	fs.DurationVar(&cfg.DrainTimeout, "drain-timeout", cfg.DrainTimeout, "how long a stop waits for requests in flight")
}

// proxyConfig layers the YAML file under the flags that were set explicitly.
func proxyConfig(fs *pflag.FlagSet, flags proxy.Config, path string, upstreams []string) (proxy.Config, error) {
	cfg := flags
	if path != "" {
		file := proxy.DefaultConfig()
		data, err := os.ReadFile(path)
		if err != nil {
			return cfg, fmt.Errorf("reading proxy config: %w", err)
		}
		dec := yaml.NewDecoder(strings.NewReader(string(data)))
		dec.KnownFields(true)
		if err := dec.Decode(&file); err != nil {
			return cfg, fmt.Errorf("parsing proxy config %s: %w", path, err)
		}
		// Start from the file; copy over what flags set explicitly.
		set := map[string]bool{}
		fs.Visit(func(f *pflag.Flag) { set[f.Name] = true })
		override := func(name string, apply func()) {
			if set[name] {
				apply()
			}
		}
		override("listen", func() { file.Listen = flags.Listen })
		override("api-keys-file", func() { file.APIKeysFile = flags.APIKeysFile })
		override("xds", func() { file.XDS = flags.XDS })
		override("serve-models", func() { file.ServeModels = flags.ServeModels })
		override("index-query", func() { file.IndexQuery = flags.IndexQuery })
		override("index-query-timeout", func() { file.IndexQueryTimeout = flags.IndexQueryTimeout })
		override("node-id", func() { file.NodeID = flags.NodeID })
		override("xds-ca", func() { file.XDSAuth.CAFile = flags.XDSAuth.CAFile })
		override("xds-cert", func() { file.XDSAuth.CertFile = flags.XDSAuth.CertFile })
		override("xds-key", func() { file.XDSAuth.KeyFile = flags.XDSAuth.KeyFile })
		override("xds-server-name", func() { file.XDSAuth.ServerName = flags.XDSAuth.ServerName })
		override("xds-token-file", func() { file.XDSAuth.TokenFile = flags.XDSAuth.TokenFile })
		override("xds-insecure", func() { file.XDSAuth.Insecure = flags.XDSAuth.Insecure })
		override("load-stale-after", func() { file.LoadStaleAfter = flags.LoadStaleAfter })
		override("policy", func() { file.Policy = flags.Policy })
		override("block-size", func() { file.BlockSize = flags.BlockSize })
		override("tokenizer", func() { file.Tokenizer = flags.Tokenizer })
		override("chat-template", func() { file.ChatTemplate = flags.ChatTemplate })
		override("expose-worker-header", func() { file.ExposeWorkerHeader = flags.ExposeWorkerHeader })
		override("forward-priority", func() { file.ForwardPriority = flags.ForwardPriority })
		override("overlap-weight", func() { file.OverlapWeight = flags.OverlapWeight })
		override("queue-weight", func() { file.QueueWeight = flags.QueueWeight })
		override("temperature", func() { file.Temperature = flags.Temperature })
		override("compute-weight", func() { file.ComputeWeight = flags.ComputeWeight })
		override("background-weight", func() { file.BackgroundWeight = flags.BackgroundWeight })
		override("batch-weight", func() { file.BatchWeight = flags.BatchWeight })
		override("wait-weight", func() { file.WaitWeight = flags.WaitWeight })
		override("tail-weight", func() { file.TailWeight = flags.TailWeight })
		override("balance-weight", func() { file.BalanceWeight = flags.BalanceWeight })
		override("explore", func() { file.Explore = flags.Explore })
		override("onboard", func() { file.Onboard = flags.Onboard })
		override("expose-decision-header", func() { file.ExposeDecisionHeader = flags.ExposeDecisionHeader })
		override("cache-threshold", func() { file.CacheThreshold = flags.CacheThreshold })
		override("disagg", func() { file.Disagg = flags.Disagg })
		override("disagg-threshold", func() { file.DisaggThreshold = flags.DisaggThreshold })
		override("prefill-timeout", func() { file.PrefillTimeout = flags.PrefillTimeout })
		override("disagg-max-queue", func() { file.DisaggMaxQueue = flags.DisaggMaxQueue })
		override("busy-prefill-tokens", func() { file.BusyPrefillTokens = flags.BusyPrefillTokens })
		override("busy-decode-blocks", func() { file.BusyDecodeBlocks = flags.BusyDecodeBlocks })
		override("busy-requests", func() { file.BusyRequests = flags.BusyRequests })
		override("tenant-headroom", func() { file.TenantHeadroom = flags.TenantHeadroom })
		override("queue-size", func() { file.QueueSize = flags.QueueSize })
		override("queue-timeout", func() { file.QueueTimeout = flags.QueueTimeout })
		override("retries", func() { file.Retries = flags.Retries })
		override("max-body-bytes", func() { file.MaxBodyBytes = flags.MaxBodyBytes })
		override("drain-timeout", func() { file.DrainTimeout = flags.DrainTimeout })
		override("first-byte-timeout", func() { file.FirstByteTimeout = flags.FirstByteTimeout })
		override("stream-idle-timeout", func() { file.StreamIdleTimeout = flags.StreamIdleTimeout })
		override("frozen-after", func() { file.FrozenAfter = flags.FrozenAfter })
		override("client-stall-timeout", func() { file.ClientStallTimeout = flags.ClientStallTimeout })
		override("event-loops", func() { file.EventLoops = flags.EventLoops })
		cfg = file
	}
	for _, u := range upstreams {
		up, err := parseUpstream(u)
		if err != nil {
			return cfg, err
		}
		cfg.Upstreams = append(cfg.Upstreams, up)
	}
	return cfg, cfg.Validate()
}

// parseUpstream reads an --upstream value.
func parseUpstream(v string) (proxy.Upstream, error) {
	if !strings.Contains(v, "=") {
		return proxy.Upstream{URL: v}, nil
	}
	var u proxy.Upstream
	for _, kv := range strings.Split(v, ",") {
		k, val, ok := strings.Cut(kv, "=")
		if !ok {
			return u, fmt.Errorf("--upstream %q: %q is not key=value", v, kv)
		}
		switch strings.TrimSpace(k) {
		case "id":
			u.ID = val
		case "url":
			u.URL = val
		case "model":
			u.Model = val
		case "capacity":
			n, err := strconv.Atoi(val)
			if err != nil {
				return u, fmt.Errorf("--upstream %q: capacity %q is not a number", v, val)
			}
			u.Capacity = n
		case "role":
			u.Role = val
		case "engine":
			u.Engine = val
		case "lora-modules":
			for _, a := range strings.Split(val, ";") {
				if a = strings.TrimSpace(a); a != "" {
					u.LoRAModules = append(u.LoRAModules, a)
				}
			}
		case "host-bandwidth", "disk-bandwidth", "shared-bandwidth", "peer-bandwidth":
			bw, err := engines.ParseBandwidth(val)
			if err != nil {
				return u, fmt.Errorf("--upstream %q: %s: %v", v, k, err)
			}
			switch strings.TrimSpace(k) {
			case "host-bandwidth":
				u.HostBandwidth = bw
			case "disk-bandwidth":
				u.DiskBandwidth = bw
			case "shared-bandwidth":
				u.SharedBandwidth = bw
			default:
				u.PeerBandwidth = bw
			}
		case "block-size", "block_size", "max-num-seqs", "max-num-batched-tokens", "max-model-len", "kv-bytes-per-token", "p2p-port":
			n, err := strconv.Atoi(val)
			if err != nil {
				return u, fmt.Errorf("--upstream %q: %s %q is not a number", v, k, val)
			}
			switch strings.TrimSpace(k) {
			case "max-num-seqs":
				u.MaxNumSeqs = n
			case "max-num-batched-tokens":
				u.MaxNumBatchedTokens = n
			case "max-model-len":
				u.MaxModelLen = n
			case "kv-bytes-per-token":
				u.KVBytesPerToken = n
			case "p2p-port":
				u.P2PPort = n
			default:
				u.BlockSize = n
			}
		default:
			return u, fmt.Errorf("--upstream %q: unknown key %q", v, k)
		}
	}
	return u, nil
}

// runProxy starts a proxy and serves until ctx ends; adminAddr, when not empty, serves its
// admin endpoints.
func runProxy(ctx context.Context, out io.Writer, cfg proxy.Config, ebpfF ebpfFlags, adminAddr string) error {
	// The probes watch the proxy's workers (engines are other processes: no run-queue PIDs).
	// They attach first; once the listener is bound, and before any connection is served
	// (so before the first connection to a worker), they learn the workers and the proxy
	// enters its dial scope (--ebpf-cgroup dial): every connection to a worker is then made
	// inside it, and no accepted one is.
	var listening atomic.Pointer[proxy.Server]
	targets := func() []ebpf.Target {
		if p := listening.Load(); p != nil {
			return proxyEBPFTargets(p)()
		}
		return nil
	}
	probes, err := startEBPF(ctx, ebpfF, targets, nil)
	if err != nil {
		return err
	}
	p, err := startProxyWith(ctx, cfg, func(p *proxy.Server) {
		listening.Store(p)
		_ = probes.SetTargets(targets())
		_ = probes.EnterDialScope(0) // (a failure is logged and leaves the probes on the process's cgroup)
	})
	if err == nil {
		if err = p.Registerer().Register(probes); err != nil {
			_ = p.Close()
		}
	}
	if err != nil {
		_ = probes.Close()
		return err
	}
	scrapeEngines(ctx, cfg, p)
	if cfg.XDS != "" {
		fmt.Fprintf(out, "kvrelay proxy on http://%s/v1 → workers from the control plane at %s (%d now)\n", p.Addr(), cfg.XDS, len(p.Workers()))
	} else {
		fmt.Fprintf(out, "kvrelay proxy on http://%s/v1 (policy %s) → %d upstreams\n", p.Addr(), cfg.Policy, len(cfg.Upstreams))
	}
	defer probes.Close() // (before exit: leaves the dial scope and removes it)
	if adminAddr != "" {
		addr, err := serveAdmin(ctx, adminAddr, p.DecisionsHandler())
		if err != nil {
			_ = p.Close()
			return err
		}
		fmt.Fprintf(out, "admin on http://%s (/metrics, /debug/decisions, /debug/latency, /debug/pprof/)\n", addr)
	}
	return p.Run(ctx)
}

// scrapeEngines polls the engines' metrics for p's router until ctx ends, when p runs
// without a control plane and cfg.EngineMetrics asks for it.
func scrapeEngines(ctx context.Context, cfg proxy.Config, p *proxy.Server) {
	if cfg.XDS != "" || !cfg.EngineMetrics {
		return
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	s := &telemetry.Scraper{Workers: p.Workers, Adapter: vllm.New(), Log: log.With("component", "engine-metrics")}
	go func() { _ = s.Run(ctx) }()
}

func startProxy(ctx context.Context, cfg proxy.Config) (*proxy.Server, error) {
	return startProxyWith(ctx, cfg, nil)
}

// startProxyWith starts a proxy; onListen, if not nil, runs with it once its listener is bound
// and before it serves any connection (proxy.Server.OnListen).
func startProxyWith(ctx context.Context, cfg proxy.Config, onListen func(*proxy.Server)) (*proxy.Server, error) {
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if cfg.Plugins == nil {
		cfg.Plugins = routingPlugins()
	}
	p, err := proxy.New(cfg, log)
	if err != nil {
		return nil, err
	}
	if onListen != nil {
		p.OnListen(func() { onListen(p) })
	}
	if err := p.Start(ctx); err != nil {
		_ = p.Close()
		return nil, err
	}
	return p, nil
}

// serveAdmin serves the proxy's admin endpoints (decisions, latency models: h) and
// net/http/pprof on addr until ctx ends.
func serveAdmin(ctx context.Context, addr string, h http.Handler) (string, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("listening for the admin endpoints on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", h)
	mux.Handle("/debug/decisions", h)
	mux.Handle("/debug/latency", h)
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	var handler http.Handler = mux
	if loopback.Addr(ln.Addr()) {
		// pprof's cmdline, the decisions and /metrics must not be readable by a web page
		// through a DNS name rebound to 127.0.0.1.
		handler = loopback.HostOnly(mux, "this admin endpoint", nil)
	}
	// No write timeout: pprof's profile and trace run for as long as they are asked.
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second,
		IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10}
	go func() { _ = srv.Serve(ln) }()
	go func() { <-ctx.Done(); _ = srv.Close() }()
	return ln.Addr().String(), nil
}

// apiKeysFileHelp describes --api-keys-file, which kvrelay proxy and kvrelay up share.
const apiKeysFileHelp = "API keys of the OpenAI API, one a line: \"<key> tenant=<name>[,weight=<w>][,rps=<n>][,prompt_tps=<n>][,output_tpm=<n>][,cache=<region>]\" (<key> may be sha256:<hex>), read again when it changes: a request without a listed key (Authorization: Bearer) gets 401, a tenant past a budget 429 with Retry-After (empty: no keys); tenants naming one cache region share its cache_salt, so prefix caching, each keeping its budgets (a region is a set of tenants, not of prefixes: engines salt a prompt's first block, which every later block's hash carries), and every key of a tenant names the same region"
