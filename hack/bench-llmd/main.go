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
// everything. The table has each figure's median over the runs with its range. See
// README.md in this folder.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/engines/sim"
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

type config struct {
	runs           int
	engines        []string
	routers        []string
	workload       string // llmd engines
	workloadKV     string // kvrelay engines
	model          string
	out            string
	root           string // the kvrelay repository
	version        string // its commit, "+dirty" with uncommitted changes (what the kvrelay binary was built from)
	eppBin         string
	simBin         string
	kvrelayBin     string
	gatewayBin     string
	kvSpeedup      float64
	seed           uint64
	portBase       int
	numEngines     int
	lockPath       string
	exactTok       string
	policyArgs     []string // extra policy flags for the kv and latency routers
	proxyArgs      []string // extra kvrelay proxy flags for the kv and latency routers
	approxTok      string
	settle         time.Duration
	runTimeout     time.Duration
	requestTimeout time.Duration
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-llmd:", err)
		os.Exit(1)
	}
}

func run() error {
	cfg := &config{numEngines: 4}
	var engines, routers, policyArgs, proxyArgs string
	flag.IntVar(&cfg.runs, "runs", 3, "rounds; each runs every engine kind with every router, interleaved")
	flag.StringVar(&engines, "engines", strings.Join(allEngines, ","), "engine kinds: llmd (llm-d-inference-sim), kvrelay (kvrelay sim)")
	flag.StringVar(&routers, "routers", strings.Join(allRouters, ","), "routers to compare (ratio row: latency-exact ÷ epp-precise)")
	flag.StringVar(&cfg.workload, "workload", defaultWorkloadLLMD, "kvrelay bench workload spec for the llmd engines, and for the kvrelay engines unless --workload-kvrelay is given")
	flag.StringVar(&cfg.workloadKV, "workload-kvrelay", defaultWorkloadKVRelay, "kvrelay bench workload spec for the kvrelay engines")
	flag.StringVar(&cfg.model, "model", "Qwen/Qwen3-8B", "model both engine kinds serve (kvrelay sim: ChatML + o200k_base for qwen*)")
	flag.StringVar(&cfg.out, "out", "out/bench-llmd", "results, logs and metrics (results.md, results.json, runs/…)")
	flag.StringVar(&cfg.eppBin, "epp", os.Getenv("LLMD_EPP"), "llm-d router's endpoint picker binary (default $LLMD_EPP, else epp on PATH)")
	flag.StringVar(&cfg.simBin, "llmd-sim", os.Getenv("LLMD_SIM"), "llm-d-inference-sim binary (default $LLMD_SIM, else llm-d-inference-sim on PATH)")
	flag.StringVar(&cfg.kvrelayBin, "kvrelay", "", "kvrelay binary (default: built from this checkout into --out/bin)")
	flag.Float64Var(&cfg.kvSpeedup, "kvrelay-speedup", 0.5, "kvrelay sim --speedup-ratio (0.5: 6000 uncached tokens prefill in ~245 ms)")
	flag.Uint64Var(&cfg.seed, "seed", 1, "workload seed")
	flag.IntVar(&cfg.portBase, "port-base", 22000, "loopback ports used: base+1..4 engines, +10 render sidecar, +80/81 router, +90..92 EPP, +100 KV events, +200/201 control plane")
	flag.StringVar(&cfg.lockPath, "lock", "/tmp/kvrelay-bench.lock", "flock(2) held for the whole benchmark (as `flock -o FILE` does), so that no two benchmarks run at once")
	flag.StringVar(&cfg.exactTok, "exact-tokenizer", "remote", "kvrelay proxy --tokenizer on the exact index (kv-exact, latency-exact)")
	flag.StringVar(&cfg.approxTok, "approx-tokenizer", "", "kvrelay proxy --tokenizer on the approximate index (default: by model, o200k_base + ChatML for Qwen)")
	flag.StringVar(&policyArgs, "kvrelay-policy-flags", "", "extra policy flags for the kv-* and latency-* routers (space-separated, e.g. \"--busy-prefill-tokens 4096\"): given to `kvrelay ctl policy set` for the exact ones and to `kvrelay proxy` for the approximate ones; default none: the policies' defaults")
	flag.StringVar(&proxyArgs, "kvrelay-proxy-flags", "", "extra `kvrelay proxy` flags for the kv-* and latency-* routers, exact and approximate alike (space-separated, e.g. \"--batch-weight 0.05\"): proxy-side settings the control plane's policy does not carry")
	flag.DurationVar(&cfg.settle, "settle", 2*time.Second, "wait after the router is ready, before the load starts")
	flag.DurationVar(&cfg.runTimeout, "run-timeout", 8*time.Minute, "longest one benchmark run may take")
	flag.DurationVar(&cfg.requestTimeout, "request-timeout", 2*time.Minute, "longest one request may take")
	flag.Parse()
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if set["workload"] && !set["workload-kvrelay"] {
		cfg.workloadKV = cfg.workload
	}
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	cfg.policyArgs = strings.Fields(policyArgs)
	cfg.proxyArgs = strings.Fields(proxyArgs)
	var err error
	if cfg.engines, err = parseList(engines, allEngines, "--engines"); err != nil {
		return err
	}
	if cfg.routers, err = parseList(routers, allRouters, "--routers"); err != nil {
		return err
	}
	if cfg.runs < 1 {
		return errors.New("--runs must be at least 1")
	}
	if cfg.portBase < 22000 || cfg.portBase+201 > 23999 {
		return fmt.Errorf("--port-base %d: the ports base..base+201 must lie in 22000-23999", cfg.portBase)
	}
	if cfg.kvSpeedup <= 0 {
		return errors.New("--kvrelay-speedup must be > 0")
	}
	if cfg.root, err = repoRoot(); err != nil {
		return err
	}
	if !filepath.IsAbs(cfg.out) {
		cfg.out = filepath.Join(cfg.root, cfg.out)
	}
	if err := os.MkdirAll(filepath.Join(cfg.out, "bin"), 0o755); err != nil {
		return err
	}
	if _, err := workload.Parse(cfg.workload, cfg.seed, nil); err != nil {
		return fmt.Errorf("--workload: %w", err)
	}
	if _, err := workload.Parse(cfg.workloadKV, cfg.seed, nil); err != nil {
		return fmt.Errorf("--workload-kvrelay: %w", err)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	go func() {
		<-ctx.Done()
		stop() // a second Ctrl-C kills the harness outright; its children die with it (Pdeathsig)
	}()
	defer procs.stopAll(10 * time.Second)

	// Peers: without the EPP the epp routers are skipped; without llm-d's simulator the
	// llmd engines are.
	var skipped []string
	if needEPP(cfg) {
		if cfg.eppBin, err = findBinary(cfg.eppBin, "epp"); err != nil {
			skipped = append(skipped, fmt.Sprintf("the epp routers (%v; set --epp or LLMD_EPP to the endpoint picker built from llm-d's router repository)", err))
			cfg.routers = without(cfg.routers, isEPP)
		}
	}
	if slices.Contains(cfg.engines, engineLLMD) {
		if cfg.simBin, err = findBinary(cfg.simBin, "llm-d-inference-sim"); err != nil {
			skipped = append(skipped, fmt.Sprintf("the llmd engines (%v; set --llmd-sim or LLMD_SIM to llm-d-inference-sim built from its repository)", err))
			cfg.engines = without(cfg.engines, func(e string) bool { return e == engineLLMD })
		}
	}
	for _, s := range skipped {
		fmt.Fprintln(os.Stderr, "bench-llmd: skipping", s)
	}
	if len(cfg.engines) == 0 || len(cfg.routers) == 0 {
		return errors.New("nothing left to run")
	}

	// Build kvrelay and the gateway from this checkout once: every run uses the same binaries.
	cfg.version = gitVersion(cfg.root)
	if cfg.kvrelayBin == "" {
		cfg.kvrelayBin = filepath.Join(cfg.out, "bin", "kvrelay")
		if err := goBuild(ctx, cfg.root, cfg.kvrelayBin, "./cmd/kvrelay"); err != nil {
			return err
		}
	}
	if slices.ContainsFunc(cfg.routers, behindGateway) {
		cfg.gatewayBin = filepath.Join(cfg.out, "bin", "llmd-gateway")
		if err := goBuild(ctx, cfg.root, cfg.gatewayBin, "./hack/bench-llmd/gateway"); err != nil {
			return err
		}
	}

	unlock, err := lock(ctx, cfg.lockPath)
	if err != nil {
		return err
	}
	defer unlock()

	logf, err := os.Create(filepath.Join(cfg.out, "progress.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	logw := io.MultiWriter(os.Stderr, logf)

	total := cfg.runs * len(cfg.engines) * len(cfg.routers)
	fmt.Fprintf(logw, "bench-llmd: %d runs (%d rounds × %d engine kinds × %d routers), results in %s\n",
		total, cfg.runs, len(cfg.engines), len(cfg.routers), cfg.out)
	for _, e := range cfg.engines {
		fmt.Fprintf(logw, "  %s engines: workload %s\n", e, cfg.workloadFor(e))
	}
	start := time.Now()
	var results []*runResult
	n := 0
	for run := 1; run <= cfg.runs && ctx.Err() == nil; run++ {
		for _, engine := range cfg.engines {
			for _, router := range cfg.routers {
				if ctx.Err() != nil {
					break
				}
				n++
				t0 := time.Now()
				fmt.Fprintf(logw, "[%d/%d] run %d: %s engines, %s\n", n, total, run, engine, router)
				r := runOne(ctx, cfg, run, engine, router, logw)
				if ctx.Err() != nil && r.Err != "" {
					break // interrupted: not a result
				}
				results = append(results, r)
				if r.Err != "" {
					fmt.Fprintf(logw, "  FAILED: %s\n", r.Err)
				} else {
					fmt.Fprintf(logw, "  %d/%d ok in %.0fs; TTFT p50 %s ms p90 %s ms, hit %s, per engine %v, pick p50 %s ms\n",
						r.OK, r.Requests, r.WallS, num(r.TTFTP50), num(r.TTFTP90), pct(r.HitRate), r.PerEngine, num(r.PickP50))
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
		return fmt.Errorf("interrupted after %d of %d runs (partial results above and in %s)", len(results), total, cfg.out)
	}
	failed := 0
	for _, r := range results {
		if r.Err != "" {
			failed++
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d runs failed (see the notes above and the logs in %s)", failed, len(results), cfg.out)
	}
	return nil
}

func needEPP(cfg *config) bool { return slices.ContainsFunc(cfg.routers, isEPP) }

// render is the printed table: the header, the comparison, the skipped parts and notes.
func render(cfg *config, results []*runResult, skipped []string, start time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "## kvrelay vs llm-d routers (hack/bench-llmd)\n\n")
	rounds := 0
	for _, r := range results {
		rounds = max(rounds, r.Run)
	}
	built := "kvrelay " + cfg.version
	if !strings.HasPrefix(cfg.kvrelayBin, cfg.out) {
		built = "kvrelay binary " + cfg.kvrelayBin + " (checkout " + cfg.version + ")"
	}
	fmt.Fprintf(&b, "%s; model %s, workload seed %d, %d round(s) interleaved (round, engine kind, router), fresh engines and router every run; %s, %s.\n",
		built, cfg.model, cfg.seed, rounds, time.Now().UTC().Format("2006-01-02 15:04 UTC"), time.Since(start).Round(time.Second))
	b.WriteString("Cells: median over rounds [min–max]. TTFT and E2E from the client (kvrelay bench); prefix hit = Σ cached / Σ prompt tokens from usage; requests per engine e1/e2/e3/e4 (medians); pick p50 = the router's decision per request with tokenization: EPP measured by the gateway from opening the ext_proc stream to the routing decision (EPP parse, render call, scoring, gRPC hop), kvrelay from `kvrelay_proxy_decision_seconds{stage=\"total\"}` (histogram, 1 in 8 requests, remote /tokenize round trip included).\n\n")
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
func writeResults(cfg *config, results []*runResult, skipped []string, start time.Time) error {
	md := render(cfg, results, skipped, start) + "### every run\n\n" + details(results) + "\n"
	if err := os.WriteFile(filepath.Join(cfg.out, "results.md"), []byte(md), 0o644); err != nil {
		return err
	}
	b, err := json.MarshalIndent(map[string]any{
		"kvrelay_version": cfg.version, "workload_llmd": cfg.workload, "workload_kvrelay": cfg.workloadKV, "seed": cfg.seed, "model": cfg.model, "kvrelay_speedup": cfg.kvSpeedup,
		"engines": cfg.engines, "routers": cfg.routers, "skipped": skipped, "runs": results,
	}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(cfg.out, "results.json"), b, 0o644)
}

// workloadFor is the workload spec of an engine kind.
func (cfg *config) workloadFor(engine string) string {
	if engine == engineKVRelay {
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

// bench6000 is the kvrelay sim's modelled prefill of 6000 uncached tokens at cfg's speedup, ms.
func bench6000(cfg *config) float64 { return sim.DefaultTiming().PrefillMS(6000) / cfg.kvSpeedup }

// lock takes an exclusive flock(2) on path, as `flock -o path cmd` does (the descriptor is
// close-on-exec, so the engines and routers do not hold it), waiting while another
// benchmark holds it.
func lock(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		// Someone else's lock file: flock(2) works on a read-only descriptor too.
		var rerr error
		if f, rerr = os.Open(path); rerr != nil {
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
	}
	fd := int(f.Fd())
	if err := syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		fmt.Fprintf(os.Stderr, "bench-llmd: waiting for %s (another benchmark is running)\n", path)
		got := make(chan error, 1)
		go func() { got <- syscall.Flock(fd, syscall.LOCK_EX) }()
		select {
		case err := <-got:
			if err != nil {
				f.Close()
				return nil, fmt.Errorf("lock %s: %w", path, err)
			}
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		}
	}
	return func() {
		_ = syscall.Flock(fd, syscall.LOCK_UN)
		f.Close()
	}, nil
}

// gitVersion names the checkout: its commit, with "+dirty" when files outside this folder
// differ from it.
func gitVersion(root string) string {
	out, err := exec.Command("git", "-C", root, "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "(unknown commit)"
	}
	v := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "-C", root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!hack/bench-llmd").Output(); err == nil && len(st) > 0 {
		v += "+dirty"
	}
	return v
}

func goBuild(ctx context.Context, root, out, pkg string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
	}
	return nil
}

// findBinary resolves a peer binary: the path given, or name on PATH.
func findBinary(given, name string) (string, error) {
	if given == "" {
		p, err := exec.LookPath(name)
		if err != nil {
			return "", fmt.Errorf("%s not found on PATH", name)
		}
		return p, nil
	}
	st, err := os.Stat(given)
	if err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return "", fmt.Errorf("%s: %s is not an executable file", name, given)
	}
	return filepath.Abs(given)
}

// repoRoot finds the kvrelay checkout from the working directory.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && strings.HasPrefix(string(b), "module github.com/kvrelay/kvrelay\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run from inside the kvrelay checkout (no go.mod of github.com/kvrelay/kvrelay above the working directory)")
		}
		dir = parent
	}
}

func parseList(s string, known []string, flagName string) ([]string, error) {
	var out []string
	for _, x := range strings.Split(s, ",") {
		x = strings.TrimSpace(x)
		if x == "" {
			continue
		}
		if !slices.Contains(known, x) {
			return nil, fmt.Errorf("%s: unknown %q (known: %s)", flagName, x, strings.Join(known, ", "))
		}
		if !slices.Contains(out, x) {
			out = append(out, x)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: empty", flagName)
	}
	// Keep the canonical order, so that runs interleave the same way whatever the flag's order.
	var ordered []string
	for _, k := range known {
		if slices.Contains(out, k) {
			ordered = append(ordered, k)
		}
	}
	return ordered, nil
}

func without(xs []string, drop func(string) bool) []string {
	var out []string
	for _, x := range xs {
		if !drop(x) {
			out = append(out, x)
		}
	}
	return out
}
