// Command bench-suite runs kvrelay's routing suite: every workload of the suite's table on
// both engine kinds (llm-d-inference-sim, kvrelay sim), with every router, in interleaved
// rounds on fresh engines, and writes a summary of kvrelay's default router against the best
// other router per workload and engine kind.
//
//	go run ./hack/bench-suite                          # the whole suite, 3 rounds
//	go run ./hack/bench-suite --workloads bursty --routers round-robin,latency-exact --runs 1
//	go run ./hack/bench-suite --resume                 # skip the runs already in --out
//
// The machinery (engines, routers, measurement) is internal/benchharness, shared with
// hack/bench-llmd. See README.md in this folder.
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
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	bh "github.com/kvrelay/kvrelay/internal/benchharness"
)

// defaultRouter is kvrelay's default: the latency policy (xds/policy.Default) on the control
// plane's exact index.
const defaultRouter = bh.RouterLatencyExact

// suiteRouters are the routers a plain run compares: the baselines, kvrelay's kv and latency
// policies (exact and approximate index, as a proxy, and latency as an endpoint picker), and
// llm-d's endpoint picker in its precise and approximate modes.
var suiteRouters = []string{bh.RouterEPPPrecise, bh.RouterEPPApprox, bh.RouterRoundRobin, bh.RouterLeastRequest,
	bh.RouterKVExact, bh.RouterKVApprox, bh.RouterLatencyExact, bh.RouterLatencyApprox, bh.RouterKEPPExact}

type config struct {
	bh.Config
	runs        int
	rows        []row
	engines     []string
	routers     []string
	resume      bool
	quick       bool
	sameSeed    bool
	results     string
	lockPath    string
	peerVersion map[string]string
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-suite:", err)
		os.Exit(1)
	}
}

func run() error {
	cfg := &config{}
	cfg.Name = "hack/bench-suite"
	all := suite()
	var workloads, engines, routers, policyArgs, proxyArgs string
	var list, summarizeOnly bool
	flag.IntVar(&cfg.runs, "runs", 3, "rounds; each runs every workload on every engine kind with every router, interleaved")
	flag.StringVar(&workloads, "workloads", strings.Join(rowNames(all), ","), "workloads of the suite to run")
	flag.StringVar(&engines, "engines", strings.Join(bh.AllEngines, ","), "engine kinds: llmd (llm-d-inference-sim), kvrelay (kvrelay sim)")
	flag.StringVar(&routers, "routers", strings.Join(suiteRouters, ","), "routers, of "+strings.Join(bh.AllRouters, ", ")+" (the summary compares "+defaultRouter+" with the best of the others)")
	flag.BoolVar(&cfg.resume, "resume", false, "skip the runs whose results --out already holds for the same workload, engines and kvrelay commit")
	flag.BoolVar(&cfg.quick, "quick", false, "shrink every workload to a few requests (a smoke test of the harness, not a measurement; no summary under --results unless given)")
	flag.BoolVar(&list, "list", false, "print the suite's workloads and settings, and exit")
	flag.BoolVar(&summarizeOnly, "summarize", false, "run nothing: rebuild the summary from the completed runs --out holds (of one kvrelay commit), into --out and --results")
	flag.StringVar(&cfg.Model, "model", "Qwen/Qwen3-8B", "model every engine serves")
	flag.StringVar(&cfg.Out, "out", "out/bench-suite", "raw results, logs and metrics of every run (runs/<workload>/<engine>/<router>/round<N>/)")
	flag.StringVar(&cfg.results, "results", "hack/bench-suite/results", "where the summary is written, in <date>-<commit>/ (empty: only --out)")
	flag.StringVar(&cfg.EPPBin, "epp", os.Getenv("LLMD_EPP"), "llm-d router's endpoint picker binary (default $LLMD_EPP, else epp on PATH)")
	flag.StringVar(&cfg.SimBin, "llmd-sim", os.Getenv("LLMD_SIM"), "llm-d-inference-sim binary (default $LLMD_SIM, else llm-d-inference-sim on PATH)")
	flag.StringVar(&cfg.KVRelayBin, "kvrelay", "", "kvrelay binary (default: built from this checkout into --out/bin)")
	flag.Uint64Var(&cfg.Seed, "seed", 1, "workload seed of the first round; round r has seed+r-1 (see --same-seed)")
	flag.BoolVar(&cfg.sameSeed, "same-seed", false, "every round replays the workloads of --seed: the rounds then sample the engines' and the routers' randomness, not the workload's")
	flag.IntVar(&cfg.PortBase, "port-base", 23000, "loopback ports used: base+1..9 engines, +10 render sidecar, +80/81 router, +90..92 pickers, +100 KV events, +200/201 control plane")
	flag.StringVar(&cfg.lockPath, "lock", "/tmp/kvrelay-bench.lock", "flock(2) held for the whole suite (as `flock -o FILE` does), so that no two benchmarks run at once")
	flag.StringVar(&cfg.ExactTok, "exact-tokenizer", "remote", "kvrelay --tokenizer on the exact index")
	flag.StringVar(&cfg.ApproxTok, "approx-tokenizer", "", "kvrelay --tokenizer on the approximate index (default: by model)")
	flag.StringVar(&policyArgs, "kvrelay-policy-flags", "", "extra policy flags for the kv and latency routers (space-separated); default none: the policies' defaults")
	flag.StringVar(&proxyArgs, "kvrelay-proxy-flags", "", "extra `kvrelay proxy` / `kvrelay epp` flags for the kv and latency routers (space-separated)")
	flag.DurationVar(&cfg.Settle, "settle", 2*time.Second, "wait after the router is ready, before the load starts")
	flag.DurationVar(&cfg.RunTimeout, "run-timeout", 5*time.Minute, "longest one run's load may take")
	flag.DurationVar(&cfg.RequestTimeout, "request-timeout", 2*time.Minute, "longest one request may take")
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if cfg.quick && !set["results"] {
		cfg.results = ""
	}
	cfg.PolicyArgs = strings.Fields(policyArgs)
	cfg.ProxyArgs = strings.Fields(proxyArgs)
	names, err := bh.ParseList(workloads, rowNames(all), "--workloads")
	if err != nil {
		return err
	}
	for _, r := range all {
		if slices.Contains(names, r.name) {
			cfg.rows = append(cfg.rows, r)
		}
	}
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
	if cfg.Root, err = bh.RepoRoot(); err != nil {
		return err
	}
	// Workload paths (the Mooncake trace) are relative to the repository's root.
	if err := os.Chdir(cfg.Root); err != nil {
		return err
	}
	for _, p := range []*string{&cfg.Out, &cfg.results} {
		if *p != "" && !filepath.IsAbs(*p) {
			*p = filepath.Join(cfg.Root, *p)
		}
	}
	if err := checkRows(cfg.rows, cfg.Seed); err != nil {
		return err
	}
	if list {
		fmt.Print(describeSuite(cfg.rows))
		return nil
	}
	if summarizeOnly {
		return cfg.resummarize()
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()
	go func() {
		<-ctx.Done()
		stop() // a second Ctrl-C kills the harness outright; its children die with it (Pdeathsig)
	}()
	defer bh.StopAll(10 * time.Second)

	cfg.Version = bh.GitVersion(cfg.Root, "hack/bench-suite/results")
	var skipped []string
	cfg.engines, cfg.routers, skipped, err = cfg.Prepare(ctx, cfg.engines, cfg.routers)
	for _, s := range skipped {
		fmt.Fprintln(os.Stderr, "bench-suite: skipping", s)
	}
	if err != nil {
		return err
	}
	cfg.peerVersion = map[string]string{"kvrelay": cfg.Version}
	if slices.Contains(cfg.engines, bh.EngineLLMD) {
		cfg.peerVersion["llm-d-inference-sim"] = bh.BinaryVersion(cfg.SimBin)
	}
	if slices.ContainsFunc(cfg.routers, bh.IsEPP) {
		cfg.peerVersion["epp"] = bh.BinaryVersion(cfg.EPPBin)
	}

	unlock, err := bh.Lock(ctx, cfg.lockPath, os.Stderr)
	if err != nil {
		return err
	}
	defer unlock()

	logf, err := os.OpenFile(filepath.Join(cfg.Out, "progress.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	logw := io.MultiWriter(os.Stderr, logf)

	total := cfg.runs * len(cfg.rows) * len(cfg.engines) * len(cfg.routers)
	fmt.Fprintf(logw, "bench-suite %s: %d runs (%d rounds × %d workloads × %d engine kinds × %d routers), raw results in %s\n",
		cfg.Version, total, cfg.runs, len(cfg.rows), len(cfg.engines), len(cfg.routers), cfg.Out)
	start := time.Now()
	var results []*bh.RunResult
	n, ran := 0, 0
	var ranFor time.Duration
	for round := 1; round <= cfg.runs && ctx.Err() == nil; round++ {
		for _, rw := range cfg.rows {
			for _, engine := range cfg.engines {
				k := rw.kinds[engine]
				for _, router := range cfg.routers {
					if ctx.Err() != nil {
						break
					}
					n++
					r := cfg.runFor(round, rw, engine, router)
					if cfg.resume {
						if prev, why := loadDone(r, cfg.Version); prev != nil {
							results = append(results, prev)
							fmt.Fprintf(logw, "[%d/%d] round %d %s %s/%s: kept from %s\n", n, total, round, rw.name, engine, router, r.Dir)
							continue
						} else if why != "" {
							fmt.Fprintf(logw, "[%d/%d] round %d %s %s/%s: running again (%s)\n", n, total, round, rw.name, engine, router, why)
						}
					}
					t0 := time.Now()
					fmt.Fprintf(logw, "[%d/%d] round %d %s %s/%s\n", n, total, round, rw.name, engine, router)
					if err := writeRunSpec(r, k, cfg.Version); err != nil {
						return err
					}
					res := bh.RunOne(ctx, &cfg.Config, r, logw)
					if ctx.Err() != nil && res.Err != "" {
						break // interrupted: not a result
					}
					results = append(results, res)
					if res.Err != "" {
						fmt.Fprintf(logw, "  FAILED: %s\n", res.Err)
					} else {
						fmt.Fprintf(logw, "  %d/%d ok in %.0fs; TTFT p50 %s ms p90 %s ms p99 %s ms (floor p50 %s), hit %s, per engine %v, pick p50 %s ms\n",
							res.OK, res.Requests, res.WallS, bh.Num(res.TTFTP50), bh.Num(res.TTFTP90), bh.Num(res.TTFTP99), bh.Num(res.FloorP50),
							bh.Pct(res.HitRate), res.PerEngine, bh.Num(res.PickP50))
						for _, note := range res.Notes {
							fmt.Fprintf(logw, "  note: %s\n", note)
						}
					}
					ran++
					ranFor += time.Since(t0)
					fmt.Fprintf(logw, "  (%.0fs this run; %s elapsed, about %s to go)\n", time.Since(t0).Seconds(),
						time.Since(start).Round(time.Second), (ranFor / time.Duration(ran) * time.Duration(total-n)).Round(time.Minute))
					if _, err := cfg.writeSummary(results, skipped, start, cfg.Out); err != nil {
						fmt.Fprintln(logw, "  writing the summary:", err)
					}
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
	md, err := cfg.writeSummary(results, skipped, start, cfg.Out)
	if err != nil {
		return err
	}
	fmt.Print(md)
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted after %d of %d runs (partial summary above and in %s)", len(results), total, cfg.Out)
	}
	if cfg.results != "" {
		dir := filepath.Join(cfg.results, time.Now().UTC().Format("2006-01-02")+"-"+cfg.Version)
		if _, err := cfg.writeSummary(results, skipped, start, dir); err != nil {
			return err
		}
		fmt.Fprintf(logw, "summary in %s\n", dir)
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

// runFor is one run of the suite.
func (cfg *config) runFor(round int, rw row, engine, router string) bh.Run {
	k := rw.kinds[engine]
	spec := k.spec
	if cfg.quick {
		spec += k.quick
	}
	return bh.Run{
		Round: round, Workload: rw.name, Spec: spec, Speedup: k.speedup, Engine: engine, Router: router, Fleet: k.fleet,
		Dir:  filepath.Join(cfg.Out, "runs", rw.name, engine, router, fmt.Sprintf("round%d", round)),
		Seed: cfg.seedFor(round),
	}
}

// seedFor is the workload seed of a round: a seed of its own, so that the rounds sample the
// workloads' randomness (one seed's arrivals can favour one router, another seed's another),
// unless --same-seed. Every router of a round runs the same workload, so the ratios are
// still taken on equal terms.
func (cfg *config) seedFor(round int) uint64 {
	if cfg.sameSeed {
		return cfg.Seed
	}
	return cfg.Seed + uint64(round) - 1
}

// runSpec is what a run's directory records of what ran, so that --resume keeps only the
// runs of the same workload, engines and kvrelay commit.
type runSpec struct {
	Spec    string  `json:"spec"`
	Seed    uint64  `json:"seed"`
	Speedup float64 `json:"speedup"`
	Fleet   string  `json:"fleet"`
	Version string  `json:"kvrelay_version"`
}

func specOf(r bh.Run, version string) runSpec {
	return runSpec{Spec: r.Spec, Seed: r.Seed, Speedup: r.Speedup, Fleet: fmt.Sprintf("%+v", r.Fleet), Version: version}
}

func writeRunSpec(r bh.Run, _ kind, version string) error {
	if err := os.MkdirAll(r.Dir, 0o755); err != nil {
		return err
	}
	// A stale summary must not outlive the run that replaces it.
	_ = os.Remove(filepath.Join(r.Dir, "summary.json"))
	b, _ := json.MarshalIndent(specOf(r, version), "", "  ")
	return os.WriteFile(filepath.Join(r.Dir, "run.json"), b, 0o644)
}

// loadDone returns the result a previous run left in r.Dir when it completed without error
// for the same spec, fleet and kvrelay commit; otherwise nil and why it does not count ("" when
// there is nothing there).
func loadDone(r bh.Run, version string) (*bh.RunResult, string) {
	was, res, why := readRun(r.Dir)
	if was == nil {
		return nil, why
	}
	if want := specOf(r, version); *was != want {
		return nil, fmt.Sprintf("it ran %q (seed %d) at speed-up %g on kvrelay %s with other engines or settings", was.Spec, was.Seed, was.Speedup, was.Version)
	}
	if res == nil {
		return nil, why
	}
	if res.Err != "" || res.OK == 0 {
		return nil, "it failed"
	}
	res.Notes = append(res.Notes, "kept from an earlier invocation (--resume)")
	return res, ""
}

// readRun reads what a run left in dir: what ran (run.json) and, once it finished, its result
// (summary.json). was is nil when run.json is missing (why "") or unreadable; res is nil, with
// why, when the run did not finish or its result is unreadable.
func readRun(dir string) (was *runSpec, res *bh.RunResult, why string) {
	b, err := os.ReadFile(filepath.Join(dir, "run.json"))
	if err != nil {
		return nil, nil, ""
	}
	was = &runSpec{}
	if json.Unmarshal(b, was) != nil {
		return nil, nil, "unreadable run.json"
	}
	b, err = os.ReadFile(filepath.Join(dir, "summary.json"))
	if err != nil {
		return was, nil, "no summary.json: the run did not finish"
	}
	res = &bh.RunResult{}
	if err := json.Unmarshal(b, res); err != nil {
		return was, nil, "unreadable summary.json"
	}
	return was, res, ""
}

// checkRows parses every workload spec of the rows (full and quick) and validates the fleets.
func checkRows(rows []row, seed uint64) error {
	for _, r := range rows {
		for _, e := range bh.AllEngines {
			k, ok := r.kinds[e]
			if !ok {
				return fmt.Errorf("workload %s has no settings for %s engines", r.name, e)
			}
			if err := k.fleet.Validate(); err != nil {
				return fmt.Errorf("workload %s, %s engines: %w", r.name, e, err)
			}
			for _, spec := range []string{k.spec, k.spec + k.quick} {
				if _, err := workload.Parse(spec, seed, nil); err != nil {
					return fmt.Errorf("workload %s, %s engines: %w", r.name, e, err)
				}
			}
		}
	}
	return nil
}

// resummarize rebuilds the summary from the completed runs in cfg.Out, as the suite would
// have written it at their end: the kvrelay commit is the one the runs recorded, the peers'
// versions and the wall time those of the summary the runs left in cfg.Out. Figures the
// harness measures on a run's saved requests (the latency model's prediction error) are
// measured again, so runs collected before the harness measured them get them too.
func (cfg *config) resummarize() error {
	var prev Summary
	b, err := os.ReadFile(filepath.Join(cfg.Out, "summary.json"))
	if err != nil {
		return fmt.Errorf("--summarize: %w (it names the peers' versions)", err)
	}
	if err := json.Unmarshal(b, &prev); err != nil {
		return fmt.Errorf("--summarize: %s: %w", filepath.Join(cfg.Out, "summary.json"), err)
	}
	var results []*bh.RunResult
	versions := map[string]bool{}
	for _, rw := range cfg.rows {
		for _, engine := range cfg.engines {
			for _, router := range cfg.routers {
				for round := 1; ; round++ {
					r := cfg.runFor(round, rw, engine, router)
					was, res, why := readRun(r.Dir)
					if was == nil && why == "" {
						break
					}
					if was == nil || *was != specOf(r, was.Version) {
						fmt.Fprintf(os.Stderr, "bench-suite: %s ran another spec or fleet; left out\n", r.Dir)
						continue
					}
					if res == nil {
						continue // did not finish
					}
					if res.Extra == nil {
						res.Extra = map[string]float64{}
					}
					if _, ok := res.Extra["ttft_rel_error_p50"]; !ok {
						bh.PredictionErrorOf(r.Dir, res.Extra)
					}
					versions[was.Version] = true
					results = append(results, res)
				}
			}
		}
	}
	if len(versions) != 1 {
		return fmt.Errorf("--summarize: %d completed runs of %d kvrelay commits in %s; want one", len(results), len(versions), cfg.Out)
	}
	for v := range versions {
		cfg.Version = v
	}
	cfg.peerVersion = prev.Versions
	start := time.Now().Add(-time.Duration(prev.WallS * float64(time.Second)))
	md, err := cfg.writeSummary(results, prev.Skipped, start, cfg.Out)
	if err != nil {
		return err
	}
	fmt.Print(md)
	if cfg.results != "" {
		dir := filepath.Join(cfg.results, time.Now().UTC().Format("2006-01-02")+"-"+cfg.Version)
		if _, err := cfg.writeSummary(results, prev.Skipped, start, dir); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "summary in %s\n", dir)
	}
	return nil
}
