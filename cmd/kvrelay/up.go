package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
)

func newUpCmd() *cobra.Command {
	var (
		workers     int
		host        string
		basePort    int
		eventsPort  int
		replayPort  int
		speedup     float64
		model       string
		gpuBlocks   int
		proxyListen string
		policy      string
		xdsListen   string
		apiListen   string
		dataDir     string
		static      bool
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run the embedded local deployment on loopback",
		Long: `up runs kvrelay's embedded default on loopback: simulated engine workers, each with its
OpenAI API and its KV event publisher; the control plane, which follows their KV events and
load and pushes them over xDS; and the edge proxy on 127.0.0.1:8080, which takes its workers,
policy and KV index from the control plane. It prints how to send a request. Ctrl-C stops it.
With --static the proxy runs alone with the workers as static upstreams.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f := simFlags{
				engine:           sim.DefaultConfig(),
				listen:           host + ":" + strconv.Itoa(basePort),
				workers:          workers,
				eventsEndpoint:   "tcp://" + host + ":" + strconv.Itoa(eventsPort),
				replayEndpoint:   "tcp://" + host + ":" + strconv.Itoa(replayPort),
				eventsFormat:     "map",
				blockHash:        "int",
				role:             string(sim.RoleBoth),
				schedulingPolicy: string(sim.FCFS),
			}
			f.engine.Model = model
			f.engine.NumGPUBlocks = gpuBlocks
			f.engine.Timing.Speedup = speedup
			cfgs, err := f.workerConfigs()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			return runWorkers(ctx, cmd.OutOrStdout(), cfgs, func(ctx context.Context, out io.Writer, ws []*sim.Worker) (func() error, error) {
				pc := proxy.DefaultConfig()
				pc.Listen = proxyListen
				pc.Policy = policy
				pc.ExposeWorkerHeader = true
				pc.BlockSize = f.engine.BlockSize
				var cp *controlplane.Server
				if static {
					for i, w := range ws {
						pc.Upstreams = append(pc.Upstreams, proxy.Upstream{ID: "w" + strconv.Itoa(i), URL: w.URL(), Model: model, Capacity: gpuBlocks})
					}
				} else {
					var err error
					if cp, err = startUpControlPlane(ctx, ws, model, f.engine.BlockSize, xdsListen, apiListen, dataDir, policy); err != nil {
						return nil, err
					}
					pc.XDS = cp.XDSAddr()
					pc.NodeID = "up-proxy"
				}
				p, err := startProxy(ctx, pc)
				if err != nil {
					if cp != nil {
						_ = cp.Close()
					}
					return nil, err
				}
				if cp != nil {
					fmt.Fprintf(out, "kvrelay up: control plane, proxy and %d simulated %s workers on loopback (Ctrl-C stops them)\n\n", len(ws), model)
				} else {
					fmt.Fprintf(out, "kvrelay up: proxy and %d simulated %s workers on loopback (Ctrl-C stops them)\n\n", len(ws), model)
				}
				fmt.Fprintf(out, "proxy     openai http://%s/v1  metrics http://%s/metrics  policy %s\n", p.Addr(), p.Addr(), policy)
				if cp != nil {
					fmt.Fprintf(out, "control   xds %s  api http://%s  (kvrelay ctl --api %s workers)\n", cp.XDSAddr(), cp.APIAddr(), cp.APIAddr())
				}
				printWorkers(out, ws)
				fmt.Fprintf(out, "\nTry:\n  curl -s http://%s/v1/chat/completions -H 'Content-Type: application/json' \\\n"+
					"    -d '{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":16}'\n\n",
					p.Addr(), model)
				if cp != nil {
					return func() error {
						err := p.Run(ctx)
						_ = cp.Close()
						return err
					}, nil
				}
				return func() error { return p.Run(ctx) }, nil
			})
		},
	}
	fs := cmd.Flags()
	fs.IntVar(&workers, "workers", 4, "simulated workers to start")
	fs.StringVar(&host, "host", "127.0.0.1", "address every component listens on")
	fs.IntVar(&basePort, "base-port", 8001, "OpenAI API port of the first worker; the others count up")
	fs.IntVar(&eventsPort, "kv-events-base-port", 5557, "KV event port of the first worker; the others count up")
	fs.IntVar(&replayPort, "kv-events-replay-base-port", 5657, "KV event replay port of the first worker; the others count up")
	fs.Float64Var(&speedup, "speedup-ratio", 1, "divide the simulated step times by this")
	fs.StringVar(&model, "model", "gpt-oss-120b", "model the workers serve")
	fs.IntVar(&gpuBlocks, "num-gpu-blocks", 16384, "KV cache blocks per worker")
	fs.StringVar(&proxyListen, "proxy-listen", "127.0.0.1:8080", "the proxy's address")
	fs.StringVar(&policy, "policy", route.PolicyKV, "the routing policy")
	fs.StringVar(&xdsListen, "xds-listen", "127.0.0.1:18000", "the control plane's xDS address")
	fs.StringVar(&apiListen, "api-listen", "127.0.0.1:18080", "the control plane's operator API address")
	fs.StringVar(&dataDir, "data-dir", "", "the control plane's data directory (default: a temporary one, removed on exit)")
	fs.BoolVar(&static, "static", false, "no control plane: the proxy routes alone over static upstreams")
	return cmd
}

// startUpControlPlane starts the control plane of `kvrelay up` over the simulated workers.
// With no data dir it uses a temporary one, removed when the control plane closes.
func startUpControlPlane(ctx context.Context, ws []*sim.Worker, model string, blockSize int, xdsListen, apiListen, dataDir, policy string) (*controlplane.Server, error) {
	opts := controlplane.Options{
		XDSListen: xdsListen,
		APIListen: apiListen,
		DataDir:   dataDir,
		Logger:    slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	if dataDir == "" {
		dir, err := os.MkdirTemp("", "kvrelay-up-")
		if err != nil {
			return nil, fmt.Errorf("creating the control plane's data dir: %w", err)
		}
		opts.DataDir = dir
		opts.RemoveDataDir = true
	}
	for i, w := range ws {
		opts.Workers = append(opts.Workers, registry.Worker{
			ID: "w" + strconv.Itoa(i), URL: w.URL(), Model: model, BlockSize: blockSize,
			KVEvents: w.EventsEndpoint(), KVEventsReplay: w.ReplayEndpoint(), Engine: "sim",
		})
	}
	cp, err := controlplane.New(opts)
	if err != nil {
		return nil, err
	}
	if p := cp.Registry().Policy(); p.Name != policy {
		p.Name = policy
		if _, err := cp.Registry().SetPolicy(p); err != nil {
			_ = cp.Close()
			return nil, err
		}
	}
	if err := cp.Start(ctx); err != nil {
		_ = cp.Close()
		return nil, err
	}
	return cp, nil
}
