package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/trtllm"
	"github.com/kvrelay/kvrelay/engines/vllm"
)

// engineAdapters is every engine kind kvrelay reads.
func engineAdapters() engines.Adapters {
	return engines.Adapters{
		engines.KindVLLM:   vllm.New(),
		engines.KindSim:    vllm.NewSim(),
		engines.KindSGLang: sglang.New(),
		engines.KindTRTLLM: trtllm.New(),
	}
}

func newControlPlaneCmd() *cobra.Command {
	var (
		opts      controlplane.Options
		workers   []string
		tokenFile string
	)
	cmd := &cobra.Command{
		Use:   "controlplane",
		Short: "Run the control plane: KV events from every engine, one global index, pushed to proxies",
		Long: `controlplane subscribes to every worker's KV events, keeps the global prefix index and the
fleet's load, and pushes workers, load, routing policy and the index to proxies
(kvrelay proxy --xds) over delta xDS. Operators manage it with kvrelay ctl.

A --worker is comma-separated key=value pairs: id, url, model, role (both|prefill|decode),
block-size, kv-events (a PUB endpoint to dial), kv-events-bind (an endpoint to bind for
publishers that connect out), kv-events-replay, metrics, engine (vllm|sglang|trtllm|sim).
Model and block size are discovered when not given.`,
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
			}
			opts.Adapters = engineAdapters()
			opts.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
			return runControlPlane(cmd.Context(), cmd.OutOrStdout(), opts)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&opts.XDSListen, "xds-listen", "127.0.0.1:18000", "address proxies connect to (delta ADS, index journal, load reports)")
	fs.StringVar(&opts.APIListen, "api-listen", "127.0.0.1:18080", "operator API (JSON over HTTP and gRPC) and /metrics")
	fs.StringVar(&opts.DataDir, "data-dir", "", "directory for the registry and policies (required)")
	fs.StringArrayVar(&workers, "worker", nil, "a worker: id=,url=,kv-events=,engine=,... (repeat for each)")
	fs.StringVar(&opts.WorkersFile, "workers-file", "", "YAML file of workers, reloaded when it changes")
	fs.StringVar(&tokenFile, "api-token-file", "", "file holding the bearer token that mutating operator calls need")
	fs.DurationVar(&opts.ScrapeInterval, "scrape-interval", 100*time.Millisecond, "how often each worker's metrics are read")
	_ = cmd.MarkFlagRequired("data-dir")
	return cmd
}

// runControlPlane starts a control plane and serves until ctx ends.
func runControlPlane(ctx context.Context, out io.Writer, opts controlplane.Options) error {
	cp, err := controlplane.New(opts)
	if err != nil {
		return err
	}
	if err := cp.Start(ctx); err != nil {
		_ = cp.Close()
		return err
	}
	fmt.Fprintf(out, "kvrelay control plane: xds %s  api http://%s  %d workers\n", cp.XDSAddr(), cp.APIAddr(), len(cp.Registry().Workers()))
	return cp.Run(ctx)
}
