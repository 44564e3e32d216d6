// Command bench-llmd runs kvrelay's routers and llm-d's endpoint picker side by side on the
// same simulated engines and prints one table.
//
//	go run ./hack/bench-llmd --runs 3
//
// For run in 1..--runs, for each engine kind (llm-d-inference-sim, kvrelay sim), for each
// router (EPP precise and approximate behind an Envoy stand-in, kvrelay round-robin, kv and
// latency on the control plane's exact index or the proxy's approximate one) it starts four
// fresh engines and the router on loopback, replays kvrelay's agentic workload against the
// router with `kvrelay bench`'s runner, reads the routers' decision times, and stops
// everything. The table has each figure's median over the runs with its range. The
// machinery lives in internal/benchharness, shared with hack/bench-suite. See README.md in
// this folder.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	bh "github.com/kvrelay/kvrelay/internal/benchharness"
)

// The default workloads: agent sessions arrive as a Poisson stream and share a 6000-token
// preamble; each makes 6 calls of growing context (tool rounds) and forks 2 subagents of 3
// calls, 12 calls in all, with no session ids (an OpenAI SDK client). Four running calls and
// the shared preamble just fit one engine's 1024 blocks, so caches churn; the session rate
// keeps the 4 engines × 4 slots busy enough that queueing and placement decide TTFT. The
// kvrelay sim at --kvrelay-speedup 0.5 decodes 2-3× slower than llm-d's simulator (its
// prefill is matched instead), so its sessions arrive more slowly, for a similar load.
const (
	workloadCommon = "preamble=6000,task=200,turns=1,rounds=5,tool=250,subagents=2,sub_task=100,sub_rounds=2," +
		"reasoning=32,osl=32,tool_time=300ms,session_ids=false"
	defaultWorkloadLLMD    = "agentic:sessions=40,rate=0.6," + workloadCommon
	defaultWorkloadKVRelay = "agentic:sessions=22,rate=0.25," + workloadCommon
)

// defaultRouters are the routers a plain run compares (least-request runs when named).
var defaultRouters = []string{bh.RouterEPPPrecise, bh.RouterEPPApprox, bh.RouterRoundRobin, bh.RouterKVExact, bh.RouterKVApprox,
	bh.RouterLatencyExact, bh.RouterLatencyApprox, bh.RouterKEPPExact, bh.RouterKEPPApprox}

type config struct {
	bh.Config
	runs       int
	engines    []string
	routers    []string
	workload   string // llmd engines
	workloadKV string // kvrelay engines
	fleet      bh.Fleet
	lockPath   string
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-llmd:", err)
		os.Exit(1)
	}
}

func run() error {
	cfg := &config{fleet: bh.DefaultFleet()}
	cfg.Name = "hack/bench-llmd"
	var engines, routers, policyArgs, proxyArgs string
	flag.IntVar(&cfg.runs, "runs", 3, "rounds; each runs every engine kind with every router, interleaved")
	flag.StringVar(&engines, "engines", strings.Join(bh.AllEngines, ","), "engine kinds: llmd (llm-d-inference-sim), kvrelay (kvrelay sim)")
	flag.StringVar(&routers, "routers", strings.Join(defaultRouters, ","), "routers to compare, of "+strings.Join(bh.AllRouters, ", ")+" (ratio row: latency-exact ÷ epp-precise)")
	flag.StringVar(&cfg.workload, "workload", defaultWorkloadLLMD, "kvrelay bench workload spec for the llmd engines, and for the kvrelay engines unless --workload-kvrelay is given")
	flag.StringVar(&cfg.workloadKV, "workload-kvrelay", defaultWorkloadKVRelay, "kvrelay bench workload spec for the kvrelay engines")
	flag.StringVar(&cfg.Model, "model", "Qwen/Qwen3-8B", "model both engine kinds serve (kvrelay sim: ChatML + o200k_base for qwen*)")
	flag.StringVar(&cfg.Out, "out", "out/bench-llmd", "results, logs and metrics (results.md, results.json, runs/…)")
	flag.StringVar(&cfg.EPPBin, "epp", os.Getenv("LLMD_EPP"), "llm-d router's endpoint picker binary (default $LLMD_EPP, else epp on PATH)")
	flag.StringVar(&cfg.SimBin, "llmd-sim", os.Getenv("LLMD_SIM"), "llm-d-inference-sim binary (default $LLMD_SIM, else llm-d-inference-sim on PATH)")
	flag.StringVar(&cfg.KVRelayBin, "kvrelay", "", "kvrelay binary (default: built from this checkout into --out/bin)")
	flag.Float64Var(&cfg.fleet.Sim.Speedup, "kvrelay-speedup", 0.5, "kvrelay sim --speedup-ratio (0.5: 6000 uncached tokens prefill in ~245 ms)")
	flag.Uint64Var(&cfg.Seed, "seed", 1, "workload seed")
	flag.IntVar(&cfg.PortBase, "port-base", 22000, "loopback ports used: base+1..4 engines, +10 render sidecar, +80/81 router, +90..92 EPP, +100 KV events, +200/201 control plane")
	flag.StringVar(&cfg.lockPath, "lock", "/tmp/kvrelay-bench.lock", "flock(2) held for the whole benchmark (as `flock -o FILE` does), so that no two benchmarks run at once")
	flag.StringVar(&cfg.ExactTok, "exact-tokenizer", "remote", "kvrelay proxy --tokenizer on the exact index (kv-exact, latency-exact)")
	flag.StringVar(&cfg.ApproxTok, "approx-tokenizer", "", "kvrelay proxy --tokenizer on the approximate index (default: by model, o200k_base + ChatML for Qwen)")
	flag.StringVar(&policyArgs, "kvrelay-policy-flags", "", "extra policy flags for the kv-* and latency-* routers (space-separated, e.g. \"--busy-prefill-tokens 4096\"): given to `kvrelay ctl policy set` for the exact ones and to `kvrelay proxy` for the approximate ones; default none: the policies' defaults")
	flag.StringVar(&proxyArgs, "kvrelay-proxy-flags", "", "extra `kvrelay proxy` flags for the kv-* and latency-* routers, exact and approximate alike (space-separated, e.g. \"--batch-weight 0.05\"): proxy-side settings the control plane's policy does not carry")
	flag.DurationVar(&cfg.Settle, "settle", 2*time.Second, "wait after the router is ready, before the load starts")
	flag.DurationVar(&cfg.RunTimeout, "run-timeout", 8*time.Minute, "longest one benchmark run may take")
	flag.DurationVar(&cfg.RequestTimeout, "request-timeout", 2*time.Minute, "longest one request may take")
	flag.Parse()
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if set["workload"] && !set["workload-kvrelay"] {
		cfg.workloadKV = cfg.workload
	}
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	cfg.PolicyArgs = strings.Fields(policyArgs)
	cfg.ProxyArgs = strings.Fields(proxyArgs)
	var err error
	if cfg.engines, err = bh.ParseList(engines, bh.AllEngines, "--engines"); err != nil {
		return err
	}
	if cfg.routers, err = bh.ParseList(routers, bh.AllRouters, "--routers"); err != nil {
		return err
	}
	if cfg.runs < 1 {
		return errors.New("--runs must be at least 1")
	}
	if err := bh.CheckPortBase(cfg.PortBase); err != nil {
		return err
	}
	if err := cfg.fleet.Validate(); err != nil {
		return fmt.Errorf("--kvrelay-speedup: %w", err)
	}
	if cfg.Root, err = bh.RepoRoot(); err != nil {
		return err
	}
	if !filepath.IsAbs(cfg.Out) {
		cfg.Out = filepath.Join(cfg.Root, cfg.Out)
	}
	if _, err := workload.Parse(cfg.workload, cfg.Seed, nil); err != nil {
		return fmt.Errorf("--workload: %w", err)
	}
	if _, err := workload.Parse(cfg.workloadKV, cfg.Seed, nil); err != nil {
		return fmt.Errorf("--workload-kvrelay: %w", err)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	go func() {
		<-ctx.Done()
		stop() // a second Ctrl-C kills the harness outright; its children die with it (Pdeathsig)
	}()
	defer bh.StopAll(10 * time.Second)

	// Peers: without the EPP the epp routers are skipped; without llm-d's simulator the
	// llmd engines are. kvrelay and the gateway are built from this checkout once.
	cfg.Version = bh.GitVersion(cfg.Root, "hack/bench-llmd")
	var skipped []string
	cfg.engines, cfg.routers, skipped, err = cfg.Prepare(ctx, cfg.engines, cfg.routers)
	for _, s := range skipped {
		fmt.Fprintln(os.Stderr, "bench-llmd: skipping", s)
	}
	if err != nil {
		return err
	}

	unlock, err := bh.Lock(ctx, cfg.lockPath, os.Stderr)
	if err != nil {
		return err
	}
	defer unlock()

	logf, err := os.Create(filepath.Join(cfg.Out, "progress.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	logw := io.MultiWriter(os.Stderr, logf)

	total := cfg.runs * len(cfg.engines) * len(cfg.routers)
	fmt.Fprintf(logw, "bench-llmd: %d runs (%d rounds × %d engine kinds × %d routers), results in %s\n",
		total, cfg.runs, len(cfg.engines), len(cfg.routers), cfg.Out)
	for _, e := range cfg.engines {
		fmt.Fprintf(logw, "  %s engines: workload %s\n", e, cfg.workloadFor(e))
	}
	start := time.Now()
	var results []*bh.RunResult
	n := 0
	for round := 1; round <= cfg.runs && ctx.Err() == nil; round++ {
		for _, engine := range cfg.engines {
			for _, router := range cfg.routers {
				if ctx.Err() != nil {
					break
				}
				n++
				t0 := time.Now()
				fmt.Fprintf(logw, "[%d/%d] run %d: %s engines, %s\n", n, total, round, engine, router)
				r := bh.RunOne(ctx, &cfg.Config, bh.Run{
					Round: round, Spec: cfg.workloadFor(engine), Engine: engine, Router: router, Fleet: cfg.fleet,
					Dir: filepath.Join(cfg.Out, "runs", fmt.Sprintf("run%d", round), engine, router),
				}, logw)
				if ctx.Err() != nil && r.Err != "" {
					break // interrupted: not a result
				}
				results = append(results, r)
				if r.Err != "" {
					fmt.Fprintf(logw, "  FAILED: %s\n", r.Err)
				} else {
					fmt.Fprintf(logw, "  %d/%d ok in %.0fs; TTFT p50 %s ms p90 %s ms, hit %s, per engine %v, pick p50 %s ms\n",
						r.OK, r.Requests, r.WallS, bh.Num(r.TTFTP50), bh.Num(r.TTFTP90), bh.Pct(r.HitRate), r.PerEngine, bh.Num(r.PickP50))
					for _, note := range r.Notes {
						fmt.Fprintf(logw, "  note: %s\n", note)
					}
				}
				el := time.Since(start)
				fmt.Fprintf(logw, "  (%.0fs this run; %s elapsed, about %s to go)\n", time.Since(t0).Seconds(),
					el.Round(time.Second), (el / time.Duration(n) * time.Duration(total-n)).Round(time.Minute))
				if err := writeResults(cfg, results, skipped, start); err != nil {
					fmt.Fprintln(logw, "  writing results:", err)
				}
			}
		}
	}
	if len(results) == 0 {
		if ctx.Err() != nil {
			return errors.New("interrupted before any run completed")
		}
		return errors.New("no runs")
	}
	md := render(cfg, results, skipped, start)
	fmt.Print(md)
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted after %d of %d runs (partial results above and in %s)", len(results), total, cfg.Out)
	}
	failed := 0
	for _, r := range results {
		if r.Err != "" {
			failed++
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d runs failed (see the notes above and the logs in %s)", failed, len(results), cfg.Out)
	}
	return nil
}

// render is the printed table: the header, the comparison, the skipped parts and notes.
func render(cfg *config, results []*bh.RunResult, skipped []string, start time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "## kvrelay vs llm-d routers (hack/bench-llmd)\n\n")
	rounds := 0
	for _, r := range results {
		rounds = max(rounds, r.Run)
	}
	built := "kvrelay " + cfg.Version
	if !strings.HasPrefix(cfg.KVRelayBin, cfg.Out) {
		built = "kvrelay binary " + cfg.KVRelayBin + " (checkout " + cfg.Version + ")"
	}
	fmt.Fprintf(&b, "%s; model %s, workload seed %d, %d round(s) interleaved (round, engine kind, router), fresh engines and router every run; %s, %s.\n",
		built, cfg.Model, cfg.Seed, rounds, time.Now().UTC().Format("2006-01-02 15:04 UTC"), time.Since(start).Round(time.Second))
	b.WriteString("Cells: median over rounds [min–max]. TTFT and E2E from the client (kvrelay bench); prefix hit = Σ cached / Σ prompt tokens from usage; requests per engine e1/e2/e3/e4 (medians); pick p50 = the router's decision per request with tokenization, on the client side of the routing hop: EPP measured by the gateway from opening the ext_proc stream to the routing decision (EPP parse, render call, scoring, gRPC hop), kvrelay from `kvrelay_proxy_decision_seconds{stage=\"total\"}` (histogram, 1 in 8 requests, remote /tokenize round trip included). kvrelay's routers are given each engine's address, model and KV cache size, as the EPP reads them from the engines; no scheduler limits.\n\n")
	b.WriteString(table(cfg, results))
	for _, s := range skipped {
		fmt.Fprintf(&b, "Skipped %s.\n\n", s)
	}
	var notes []string
	for _, r := range results {
		for _, n := range r.Notes {
			notes = append(notes, fmt.Sprintf("- run %d %s/%s: %s", r.Run, r.Engine, r.Router, n))
		}
		if r.Err != "" {
			notes = append(notes, fmt.Sprintf("- run %d %s/%s FAILED: %s", r.Run, r.Engine, r.Router, r.Err))
		}
	}
	if len(notes) > 0 {
		b.WriteString("Notes:\n" + strings.Join(notes, "\n") + "\n\n")
	}
	return b.String()
}

// writeResults stores results.md (the table and every run's row) and results.json.
func writeResults(cfg *config, results []*bh.RunResult, skipped []string, start time.Time) error {
	md := render(cfg, results, skipped, start) + "### every run\n\n" + details(results) + "\n"
	if err := os.WriteFile(filepath.Join(cfg.Out, "results.md"), []byte(md), 0o644); err != nil {
		return err
	}
	b, err := json.MarshalIndent(map[string]any{
		"kvrelay_version": cfg.Version, "workload_llmd": cfg.workload, "workload_kvrelay": cfg.workloadKV, "seed": cfg.Seed, "model": cfg.Model, "kvrelay_speedup": cfg.fleet.Sim.Speedup,
		"engines": cfg.engines, "routers": cfg.routers, "skipped": skipped, "runs": results,
	}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(cfg.Out, "results.json"), b, 0o644)
}

// workloadFor is the workload spec of an engine kind.
func (cfg *config) workloadFor(engine string) string {
	if engine == bh.EngineKVRelay {
		return cfg.workloadKV
	}
	return cfg.workload
}

// canonicalSpec expands a spec with every default, as kvrelay bench records it.
func canonicalSpec(spec string, seed uint64) string {
	if w, err := workload.Parse(spec, seed, nil); err == nil {
		return w.Spec
	}
	return spec
}
