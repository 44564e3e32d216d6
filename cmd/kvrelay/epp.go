package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrelay/kvrelay/dataplane/epp"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// eppFlags are kvrelay epp's own settings, beside the routing core's.
type eppFlags struct {
	listen, healthListen, metricsListen string
	fallbacks                           int
	emitScores, exposeDecision          bool
	conformance                         bool
	objectives                          []string
}

func newEPPCmd() *cobra.Command {
	cfg := proxy.DefaultConfig()
	var (
		configPath string
		upstreams  []string
		f          eppFlags
	)
	cmd := &cobra.Command{
		Use:   "epp",
		Short: "Run kvrelay as a Gateway API endpoint picker (Envoy ext_proc) for Envoy-based gateways",
		Long: `epp serves the Gateway API Inference Extension's endpoint picker protocol: Envoy's
external processing service (envoy.service.ext_proc.v3.ExternalProcessor) on --listen. A
gateway (Envoy Gateway, Istio, kgateway, Envoy AI Gateway, GKE Inference Gateway) sends each
request's headers and body; epp picks the worker with kvrelay's routing core, the same as
kvrelay proxy's (its policy, index, load view and latency models, from a control plane with
--xds or on its own index over --upstream engines), and answers with the endpoint in the
header x-gateway-destination-endpoint and in the dynamic metadata envoy.lb. Configure the
gateway's ext_proc filter with request_body_mode BUFFERED or FULL_DUPLEX_STREAMED, and
response_body_mode FULL_DUPLEX_STREAMED (or BUFFERED) so that answers pass through and teach
the picker (time to first token, cached tokens, load); with response processing off it still
picks, but learns nothing from the answers.

The gateway may restrict the candidates with the filter metadata envoy.lb.subset_hint →
x-gateway-destination-endpoint-subset. A request no worker can take gets an immediate
response: 503 (none ready), 429 (shed: priority below zero while every worker is busy; queue
full; latency targets unmet), 400/404/413 (a request kvrelay's proxy would refuse), with an
OpenAI-shaped error body. An inference objective (x-llm-d-inference-objective,
x-gateway-inference-objective) maps to a priority with --objective NAME=PRIORITY, or is one
when it is an integer. In a disaggregated pool the prefill worker goes in
x-prefiller-host-port (llm-d's routing sidecar runs the prefill leg there).

gRPC health (liveness, readiness, envoy.service.ext_proc.v3.ExternalProcessor) is served on
--health-listen, metrics and the decision and latency-model pages on --metrics-listen.
Under a control plane the pushed policy wins over --policy and its weights.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Listen = "" // no client listener: requests come through the gateway
			final, err := proxyConfig(cmd.Flags(), cfg, configPath, upstreams)
			if err != nil {
				return err
			}
			final.PickOnly = true
			objectives, err := parseObjectives(f.objectives)
			if err != nil {
				return err
			}
			return runEPP(cmd.Context(), cmd.OutOrStdout(), final, f, objectives)
		},
	}
	cfg.PickOnly = true
	fs := cmd.Flags()
	fs.StringVar(&configPath, "config", "", "YAML file with the routing settings (kvrelay proxy's keys)")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:9002", "ext_proc gRPC address (9002 by the protocol's convention)")
	fs.StringVar(&f.healthListen, "health-listen", "127.0.0.1:9003", "gRPC health address (empty: off)")
	fs.StringVar(&f.metricsListen, "metrics-listen", "127.0.0.1:9090", "/metrics, /debug/decisions and /debug/latency (empty: off)")
	fs.StringArrayVar(&upstreams, "upstream", nil, "an engine, as kvrelay proxy takes it (without --xds; repeat for each)")
	addRoutingFlags(fs, &cfg)
	fs.IntVar(&f.fallbacks, "fallbacks", 0, "endpoints listed after the picked one, best first, for a gateway that retries down the list")
	fs.BoolVar(&f.emitScores, "emit-scores", false, "add x-gateway-destination-endpoint-scores (each candidate's predicted TTFT in ms, lower is better) to the pick's metadata")
	fs.BoolVar(&f.exposeDecision, "expose-decision-header", false, "add x-kvrelay-worker and x-kvrelay-decision (every candidate's prediction) to answers that pass through")
	fs.BoolVar(&f.conformance, "conformance", false, "for the Gateway API Inference Extension's conformance suite only: honour test-epp-endpoint-selection and answer x-conformance-test-served-endpoint")
	fs.StringArrayVar(&f.objectives, "objective", nil, "an inference objective's priority, NAME=PRIORITY (higher is more urgent; below 0 sheddable; repeat for each)")
	return cmd
}

// parseObjectives reads --objective NAME=PRIORITY values.
func parseObjectives(vs []string) (map[string]int, error) {
	m := map[string]int{}
	for _, v := range vs {
		name, p, ok := strings.Cut(v, "=")
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if !ok || strings.TrimSpace(name) == "" || err != nil {
			return nil, fmt.Errorf("--objective %q: want NAME=PRIORITY (an integer)", v)
		}
		m[strings.TrimSpace(name)] = n
	}
	return m, nil
}

// runEPP starts the routing core without a listener, the ext_proc and health services and
// the metrics page, and serves until ctx ends.
func runEPP(ctx context.Context, out io.Writer, cfg proxy.Config, f eppFlags, objectives map[string]int) error {
	p, err := startProxy(ctx, cfg)
	if err != nil {
		return err
	}
	defer p.Close()
	scrapeEngines(ctx, cfg, p)
	svc := epp.New(p, epp.Options{
		Fallbacks: f.fallbacks, EmitScores: f.emitScores, ExposeDecision: f.exposeDecision,
		Objectives: objectives, Conformance: f.conformance, MaxBodyBytes: int(min(cfg.MaxBodyBytes, 1<<30)), Registerer: p.Registerer(),
		Logger: eppLogger(),
	})
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fmt.Errorf("listening for ext_proc on %s: %w", f.listen, err)
	}
	g := grpc.NewServer(grpc.MaxRecvMsgSize(64<<20), grpc.MaxSendMsgSize(64<<20))
	svc.Register(g)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	h := health.NewServer()
	go svc.RunHealth(runCtx, h, 500*time.Millisecond)
	var hg *grpc.Server
	if f.healthListen != "" {
		hl, err := net.Listen("tcp", f.healthListen)
		if err != nil {
			ln.Close()
			return fmt.Errorf("listening for gRPC health on %s: %w", f.healthListen, err)
		}
		hg = grpc.NewServer()
		healthpb.RegisterHealthServer(hg, h)
		go func() { _ = hg.Serve(hl) }()
		fmt.Fprintf(out, "gRPC health on %s (liveness, readiness, %s)\n", hl.Addr(), epp.HealthExtProc)
	}
	// The ext_proc port answers health checks too, as llm-d's picker does.
	healthpb.RegisterHealthServer(g, h)
	if f.metricsListen != "" {
		addr, err := serveAdmin(runCtx, f.metricsListen, p.DecisionsHandler())
		if err != nil {
			ln.Close()
			return err
		}
		fmt.Fprintf(out, "metrics on http://%s/metrics (and /debug/decisions, /debug/latency)\n", addr)
	}
	if cfg.XDS != "" {
		fmt.Fprintf(out, "kvrelay epp: ext_proc on %s → workers from the control plane at %s (%d now)\n", ln.Addr(), cfg.XDS, len(p.Workers()))
	} else {
		fmt.Fprintf(out, "kvrelay epp: ext_proc on %s (policy %s) → %d upstreams\n", ln.Addr(), cfg.Policy, len(cfg.Upstreams))
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- g.Serve(ln) }()
	select {
	case err = <-serveErr:
	case <-ctx.Done():
		// Drain: readiness turns NOT_SERVING and new picks get 503 while the streams in
		// flight finish (up to --drain-timeout), then everything stops.
		p.Drain(cfg.DrainTimeout)
		stopped := make(chan struct{})
		go func() { g.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(5 * time.Second):
			g.Stop()
		}
	}
	cancel()
	if hg != nil {
		hg.Stop()
	}
	return err
}

func eppLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
}
