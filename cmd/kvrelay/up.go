package main

import (
	"context"
	"fmt"
	"io"
	"strconv"

	"github.com/spf13/cobra"

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
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run the embedded local deployment on loopback",
		Long: `up runs kvrelay's embedded default on loopback: the edge proxy on 127.0.0.1:8080 in front
of simulated engine workers, each with its OpenAI API and its KV event publisher, and prints
how to send a request. Ctrl-C stops it.`,
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
				for i, w := range ws {
					pc.Upstreams = append(pc.Upstreams, proxy.Upstream{ID: "w" + strconv.Itoa(i), URL: w.URL(), Model: model, Capacity: gpuBlocks})
				}
				p, err := startProxy(ctx, pc)
				if err != nil {
					return nil, err
				}
				fmt.Fprintf(out, "kvrelay up: proxy and %d simulated %s workers on loopback (Ctrl-C stops them)\n\n", len(ws), model)
				fmt.Fprintf(out, "proxy     openai http://%s/v1  metrics http://%s/metrics  policy %s\n", p.Addr(), p.Addr(), policy)
				printWorkers(out, ws)
				fmt.Fprintf(out, "\nTry:\n  curl -s http://%s/v1/chat/completions -H 'Content-Type: application/json' \\\n"+
					"    -d '{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":16}'\n\n",
					p.Addr(), model)
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
	fs.StringVar(&policy, "policy", route.PolicyKV, "the proxy's routing policy")
	return cmd
}
