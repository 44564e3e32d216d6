package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/ebpf"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/xds/auth"
)

// Deployment modes of `kvrelay up`.
const (
	upModeAgg    = "agg"
	upModeDisagg = "disagg"
)

// upWorker is one simulated worker of `kvrelay up` as the control plane and the proxy know
// it: its id ("w0" in mode agg, "p0" and "d0" in the prefill and decode pools) and role.
type upWorker struct {
	id   string
	role sim.Role
	w    *sim.Worker
}

func newUpCmd() *cobra.Command {
	var (
		mode            string
		workers         int
		prefillWorkers  int
		decodeWorkers   int
		disaggThreshold int
		host            string
		basePort        int
		eventsPort      int
		replayPort      int
		kvPort          int
		speedup         float64
		model           string
		gpuBlocks       int
		proxyListen     string
		policy          string
		xdsListen       string
		xdsInsecure     bool
		apiListen       string
		dataDir         string
		static          bool
		drainTimeout    time.Duration
		tokenFile       string
		adminListen     string
		exposeHeaders   bool
		apiKeysFile     string
		tokenPath       string // where the operator API token is (tokenFile, or one up wrote)
		ebpfF           ebpfFlags
		pf              upPlannerFlags
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run the embedded local deployment on loopback",
		Long: `up runs kvrelay's embedded default on loopback: simulated engine workers, each with its
OpenAI API and its KV event publisher; the control plane, which follows their KV events and
load and pushes them over xDS; and the edge proxy on 127.0.0.1:8080, which takes its workers,
policy and KV index from the control plane. It prints how to send a request. Ctrl-C stops it.
With --static the proxy runs alone with the workers as static upstreams.

With --mode disagg it runs a prefill pool and a decode pool instead (--prefill-workers,
--decode-workers; default 2 + 2), each worker with a nixl KV transfer agent on consecutive
ports from --kv-transfer-base-port. The proxy sends each chat or text completion to a decode
worker, and first, when more than --disagg-threshold of its prompt tokens are not cached
there, a max_tokens=1 leg to a prefill worker whose KV blocks the decode worker then pulls
(vLLM's NixlConnector protocol). Workers listen on consecutive ports, prefill pool first.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d := sim.DefaultConfig()
			f := simFlags{
				engine:           d,
				listen:           host + ":" + strconv.Itoa(basePort),
				workers:          workers,
				eventsEndpoint:   "tcp://" + host + ":" + strconv.Itoa(eventsPort),
				replayEndpoint:   "tcp://" + host + ":" + strconv.Itoa(replayPort),
				eventsFormat:     "map",
				blockHash:        "int",
				role:             string(sim.RoleBoth),
				schedulingPolicy: string(sim.FCFS),
				// The KV transfer settings at the simulator's defaults.
				kvBandwidth: strconv.FormatFloat(d.KVTransferBandwidth/1e9, 'g', -1, 64),
				kvScale:     strconv.FormatFloat(d.KVBytesScale, 'g', -1, 64),
				kvListen:    host + ":" + strconv.Itoa(kvPort),
			}
			f.engine.Model = model
			f.engine.NumGPUBlocks = gpuBlocks
			f.engine.Timing.Speedup = speedup
			var roles []sim.Role
			switch mode {
			case upModeAgg:
				for range workers {
					roles = append(roles, sim.RoleBoth)
				}
			case upModeDisagg:
				if prefillWorkers < 1 || decodeWorkers < 1 {
					return fmt.Errorf("--mode disagg needs at least one prefill and one decode worker, got %d + %d", prefillWorkers, decodeWorkers)
				}
				f.workers = prefillWorkers + decodeWorkers
				f.role = string(sim.RolePrefill)
				for i := range f.workers {
					roles = append(roles, map[bool]sim.Role{true: sim.RolePrefill, false: sim.RoleDecode}[i < prefillWorkers])
				}
			default:
				return fmt.Errorf("--mode must be %s or %s, got %q", upModeAgg, upModeDisagg, mode)
			}
			cfgs, err := f.workerConfigs()
			if err != nil {
				return err
			}
			for i := range cfgs {
				cfgs[i].Engine.Role = roles[i]
			}
			ctx := cmd.Context()
			return portsHint(runWorkers(ctx, cmd.OutOrStdout(), cfgs, func(ctx context.Context, out io.Writer, ws []*sim.Worker) (func() error, error) {
				uws := upWorkers(ws, roles)
				probes, err := startUpEBPF(ctx, ebpfF, uws, mode)
				if err != nil {
					return nil, err
				}
				started := false
				defer func() {
					if !started {
						_ = probes.Close() // (leaves the dial scope, if entered, and removes it)
					}
				}()
				pc := proxy.DefaultConfig()
				pc.Plugins = routingPlugins()
				pc.Listen = proxyListen
				pc.Policy = policy
				pc.ExposeWorkerHeader = exposeHeaders
				pc.APIKeysFile = apiKeysFile
				pc.BlockSize = f.engine.BlockSize
				pc.DisaggThreshold = disaggThreshold
				pc.DrainTimeout = drainTimeout
				// One event loop: the engines and the control plane share this process, and
				// a gnet loop waiting in epoll_wait holds its P, so a loop per P would leave
				// them to run only when sysmon takes one back.
				pc.EventLoops = 1
				var cp *controlplane.Server
				if static {
					for _, w := range uws {
						pc.Upstreams = append(pc.Upstreams, proxy.Upstream{ID: w.id, URL: w.w.URL(), Model: model, Capacity: gpuBlocks, Role: string(w.role), Engine: "sim"})
					}
				} else {
					var err error
					var threshold *int64 // the control plane's policy overrides the proxy's config
					if cmd.Flags().Changed("disagg-threshold") {
						t := int64(disaggThreshold)
						threshold = &t
					}
					if cp, tokenPath, err = startUpControlPlane(ctx, uws, probes, model, f.engine.BlockSize, xdsListen, xdsInsecure, apiListen, dataDir, tokenFile, policy, threshold); err != nil {
						return nil, err
					}
					pc.XDS = cp.XDSAddr()
					pc.XDSAuth.Insecure = xdsInsecure
					pc.NodeID = "up-proxy"
				}
				stopPlanner, err := pf.start(ctx, out, upPlannerEnv{cp: cp, workers: uws, model: model, blockSize: f.engine.BlockSize, gpuBlocks: gpuBlocks, speedup: speedup, host: host})
				if err != nil {
					if cp != nil {
						_ = cp.Close()
					}
					return nil, err
				}
				// Once the proxy's listener is bound, every listener of this process is open
				// (workers, control plane, proxy) and the proxy has not yet served a
				// connection: the process enters its dial scope there (--ebpf-cgroup dial),
				// so that the connections made from then on, the proxy's to the workers
				// among them, run the socket probes, and the accepted ones never do.
				p, err := startProxyWith(ctx, pc, func(*proxy.Server) {
					_ = probes.EnterDialScope(0) // (a failure is logged and leaves the probes on the process's cgroup)
				})
				if err == nil {
					err = p.Registerer().Register(probes) // kvrelay_ebpf_* on the proxy's /metrics
				}
				metricsURL := "http://" + p.Addr() + "/metrics"
				if err == nil && adminListen != "" {
					var admin string
					if admin, err = serveAdmin(ctx, adminListen, p.DecisionsHandler()); err == nil {
						metricsURL = "http://" + admin + "/metrics"
					} else {
						_ = p.Close()
					}
				}
				if err != nil {
					stopPlanner()
					if cp != nil {
						_ = cp.Close()
					}
					return nil, err
				}
				what := fmt.Sprintf("%d simulated %s workers", len(ws), model)
				if mode == upModeDisagg {
					what = fmt.Sprintf("%d prefill and %d decode simulated %s workers", prefillWorkers, decodeWorkers, model)
				}
				if cp != nil {
					fmt.Fprintf(out, "kvrelay up: control plane, proxy and %s on loopback (Ctrl-C stops them)\n\n", what)
				} else {
					fmt.Fprintf(out, "kvrelay up: proxy and %s on loopback (Ctrl-C stops them)\n\n", what)
				}
				fmt.Fprintf(out, "proxy     openai http://%s/v1  metrics %s  policy %s\n", p.Addr(), metricsURL, policy)
				if mode == upModeDisagg {
					how := fmt.Sprintf("prefill on a prefill worker when more than %d prompt tokens are uncached on the decode worker", disaggThreshold)
					if disaggThreshold < 0 {
						how = "every request prefilled on a prefill worker"
					}
					fmt.Fprintf(out, "disagg    %s; KV blocks move over nixl at a modelled %s\n", how, strconv.FormatFloat(d.KVTransferBandwidth/1e9, 'g', -1, 64)+" GB/s")
				}
				if cp != nil {
					fmt.Fprintf(out, "control   xds %s  api http://%s  token %s  (kvrelay ctl --api %s --token-file %s workers)\n", cp.XDSAddr(), cp.APIAddr(), tokenPath, cp.APIAddr(), tokenPath)
					fmt.Fprintf(out, "console   http://%s/ui/\n", cp.APIAddr())
				}
				if mode == upModeDisagg {
					printUpWorkers(out, uws)
				} else {
					printWorkers(out, ws)
				}
				fmt.Fprintf(out, "\nTry:\n  curl -s http://%s/v1/chat/completions -H 'Content-Type: application/json' \\\n"+
					"    -d '{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":16}'\n\n",
					p.Addr(), model)
				started = true
				if cp != nil {
					return func() error {
						err := p.Run(ctx)
						_ = probes.Close() // (before exit: leaves the dial scope and removes it)
						stopPlanner()
						_ = cp.Close()
						return err
					}, nil
				}
				return func() error {
					defer probes.Close()
					return p.Run(ctx)
				}, nil
			}))
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&mode, "mode", upModeAgg, "agg (every worker does both phases) or disagg (prefill and decode pools moving KV over nixl)")
	fs.IntVar(&workers, "workers", 4, "simulated workers to start (mode agg)")
	fs.IntVar(&prefillWorkers, "prefill-workers", 2, "prefill workers (mode disagg)")
	fs.IntVar(&decodeWorkers, "decode-workers", 2, "decode workers (mode disagg)")
	fs.IntVar(&disaggThreshold, "disagg-threshold", proxy.DefaultConfig().DisaggThreshold, "mode disagg: a request prefills on a prefill worker when more of its prompt tokens than this are uncached on its decode worker (negative: always)")
	fs.StringVar(&host, "host", "127.0.0.1", "address every component listens on")
	fs.IntVar(&basePort, "base-port", 8001, "OpenAI API port of the first worker; the others count up")
	fs.IntVar(&eventsPort, "kv-events-base-port", 5557, "KV event port of the first worker; the others count up")
	fs.IntVar(&replayPort, "kv-events-replay-base-port", 5657, "KV event replay port of the first worker; the others count up")
	fs.IntVar(&kvPort, "kv-transfer-base-port", 5757, "mode disagg: nixl KV transfer port of the first worker; the others count up (0: each a free port)")
	fs.Float64Var(&speedup, "speedup-ratio", 1, "divide the simulated step times by this")
	fs.StringVar(&model, "model", "gpt-oss-120b", "model the workers serve")
	fs.IntVar(&gpuBlocks, "num-gpu-blocks", 16384, "KV cache blocks per worker")
	fs.StringVar(&proxyListen, "proxy-listen", "127.0.0.1:8080", "the proxy's address")
	fs.StringVar(&policy, "policy", route.PolicyDefault, "the routing policy")
	fs.StringVar(&xdsListen, "xds-listen", "127.0.0.1:18000", "the control plane's xDS address (beyond loopback only with --xds-insecure: up configures no xDS credentials)")
	fs.BoolVar(&xdsInsecure, "xds-insecure", false, "let --xds-listen be an address other than loopback, plaintext and open to anyone who reaches it")
	fs.StringVar(&apiListen, "api-listen", "127.0.0.1:18080", "the control plane's operator API address")
	fs.StringVar(&dataDir, "data-dir", "", "the control plane's data directory (default: a temporary one, removed on exit)")
	fs.StringVar(&adminListen, "admin-listen", "127.0.0.1:0", "the proxy's admin address: /metrics, /debug/decisions, /debug/latency, pprof (default: a free loopback port, printed)")
	fs.BoolVar(&exposeHeaders, "expose-worker-header", false, "add x-kvrelay-worker and x-kvrelay-route to the proxy's answers (reveals topology)")
	fs.StringVar(&apiKeysFile, "api-keys-file", "", apiKeysFileHelp)
	fs.StringVar(&tokenFile, "api-token-file", "", "file holding the bearer token that changes through the operator API need (default: up generates one into the data directory's api-token and prints where)")
	fs.BoolVar(&static, "static", false, "no control plane: the proxy routes alone over static upstreams")
	fs.DurationVar(&drainTimeout, "drain-timeout", proxy.DefaultConfig().DrainTimeout, "on SIGINT or SIGTERM, how long the proxy lets requests in flight finish before everything stops (a second signal stops at once)")
	pf.register(fs)
	addEBPFFlags(fs, &ebpfF, ebpfCgroupDial)
	return cmd
}

// upWorkers names the workers: w0, w1, … in role both; p0, … and d0, … in the prefill and
// decode pools.
func upWorkers(ws []*sim.Worker, roles []sim.Role) []upWorker {
	out := make([]upWorker, len(ws))
	n := map[sim.Role]int{}
	prefix := map[sim.Role]string{sim.RoleBoth: "w", sim.RolePrefill: "p", sim.RoleDecode: "d"}
	for i, w := range ws {
		r := roles[i]
		out[i] = upWorker{id: prefix[r] + strconv.Itoa(n[r]), role: r, w: w}
		n[r]++
	}
	return out
}

// printUpWorkers lists the workers of a disaggregated deployment with their role and KV
// transfer agent.
func printUpWorkers(out io.Writer, ws []upWorker) {
	for i, u := range ws {
		w := u.w
		line := fmt.Sprintf("worker %d  %-7s %-3s openai %s/v1", i, u.role, u.id, w.URL())
		if a := w.KVTransferAddr(); a != "" {
			line += "  kv-transfer " + a
		}
		if ep := w.EventsEndpoint(); ep != "" {
			line += "  kv-events " + ep
		}
		if ep := w.ReplayEndpoint(); ep != "" {
			line += "  replay " + ep
		}
		if id := w.EngineID(); id != "" {
			line += "  engine-id " + id
		}
		fmt.Fprintln(out, line)
	}
}

// portsHint adds to a port already in use what to do: `kvrelay up` takes fixed ports by
// default, so a second one (or anything else on them) needs its own.
func portsHint(err error) error {
	if !errors.Is(err, syscall.EADDRINUSE) {
		return err
	}
	return fmt.Errorf("%w\n(another kvrelay up, or something else, holds that port: give this one other ports with --base-port, --kv-events-base-port, --kv-events-replay-base-port, --kv-transfer-base-port, --proxy-listen, --xds-listen and --api-listen)", err)
}

// startUpControlPlane starts the control plane of `kvrelay up` over the simulated workers,
// registered with their roles, and sets its routing policy and, when given, its
// disaggregation threshold. With no data dir it uses a temporary one, removed when the
// control plane closes. The probes' accept queues and first-byte latencies feed its load
// view while the policy's kernel_load_signals is on (`kvrelay ctl policy set
// --kernel-load-signals`): up's proxy runs in this process, so the probes time its requests.
func startUpControlPlane(ctx context.Context, ws []upWorker, probes *ebpf.Collector, model string, blockSize int, xdsListen string, xdsInsecure bool, apiListen, dataDir, tokenFile, policy string, disaggThreshold *int64) (cp *controlplane.Server, tokenPath string, err error) {
	opts := controlplane.Options{
		XDSListen: xdsListen,
		XDSAuth:   auth.ServerConfig{Insecure: xdsInsecure},
		APIListen: apiListen,
		DataDir:   dataDir,
		Logger:    slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		// The proxy up starts builds profiles with the same registry.
		ValidateProfile: routingPlugins().Validate,
	}
	if probes != nil {
		opts.KernelWaiting, opts.KernelLatencyWaiting = probes.AcceptQueue, probes.FirstByteWaiting
	}
	if dataDir == "" {
		dir, err := os.MkdirTemp("", "kvrelay-up-")
		if err != nil {
			return nil, "", fmt.Errorf("creating the control plane's data dir: %w", err)
		}
		opts.DataDir = dir
		opts.RemoveDataDir = true
	}
	if opts.APIToken, tokenPath, err = upAPIToken(opts.DataDir, tokenFile); err != nil {
		if opts.RemoveDataDir {
			_ = os.RemoveAll(opts.DataDir)
		}
		return nil, "", err
	}
	for _, u := range ws {
		ec := u.w.Engine().Config()
		kvBytes, host, disk, peer := ec.Tiers()
		opts.Workers = append(opts.Workers, registry.Worker{
			ID: u.id, URL: u.w.URL(), Model: model, Role: string(u.role), BlockSize: blockSize,
			KVEvents: u.w.EventsEndpoint(), KVEventsReplay: u.w.ReplayEndpoint(), Engine: "sim",
			MaxNumSeqs: ec.MaxNumSeqs, MaxNumBatchedTokens: ec.MaxNumBatchedTokens,
			KVBytesPerToken: kvBytes, HostBandwidth: host, DiskBandwidth: disk, SharedBandwidth: ec.SharedTier(), PeerBandwidth: peer,
		})
	}
	cp, err = controlplane.New(opts)
	if err != nil {
		return nil, "", err
	}
	p := cp.Registry().Policy()
	if p.Name != policy || disaggThreshold != nil && (p.DisaggThreshold == nil || *p.DisaggThreshold != *disaggThreshold) {
		p.Name = policy
		if disaggThreshold != nil {
			p.DisaggThreshold = disaggThreshold
		}
		if _, err := cp.Registry().SetPolicy(p); err != nil {
			_ = cp.Close()
			return nil, "", err
		}
	}
	if err := cp.Start(ctx); err != nil {
		_ = cp.Close()
		return nil, "", err
	}
	return cp, tokenPath, nil
}

// upAPIToken returns the operator API token of `kvrelay up` and the file it is in: the one
// --api-token-file names, or a new random token written to dataDir/api-token (mode 0600).
func upAPIToken(dataDir, tokenFile string) (token, path string, err error) {
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return "", "", fmt.Errorf("reading --api-token-file: %w", err)
		}
		if token = strings.TrimSpace(string(b)); token == "" {
			return "", "", fmt.Errorf("--api-token-file %s is empty", tokenFile)
		}
		return token, tokenFile, nil
	}
	var raw [24]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", "", err
	}
	token = hex.EncodeToString(raw[:])
	path = filepath.Join(dataDir, "api-token")
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		return "", "", fmt.Errorf("writing the operator API token: %w", err)
	}
	return token, path, nil
}
