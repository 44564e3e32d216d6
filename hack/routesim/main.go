// Command routesim compares routing policies on a modelled fleet in virtual time
// (internal/fleetsim): seconds per run instead of minutes, the same figures for the same
// seed whatever else the host is doing. It is the quick loop for routing changes; the
// side-by-side benchmarks (hack/bench-llmd, hack/bench-suite) measure the real thing.
//
//	go run ./hack/routesim --engines llmd --policies latency,round-robin,power-of-two
package main

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
	"github.com/kvrelay/kvrelay/internal/fleetsim"
)

const (
	agenticLLMD = "agentic:sessions=40,rate=0.6,preamble=6000,task=200,turns=1,rounds=5,tool=250,subagents=2,sub_task=100,sub_rounds=2,reasoning=32,osl=32,tool_time=300ms,session_ids=false"
	agenticSim  = "agentic:sessions=22,rate=0.25,preamble=6000,task=200,turns=1,rounds=5,tool=250,subagents=2,sub_task=100,sub_rounds=2,reasoning=32,osl=32,tool_time=300ms,session_ids=false"
)

func main() {
	var (
		kind     = flag.String("engines", "llmd", "engine kind: llmd or sim")
		n        = flag.Int("n", 4, "engines")
		spec     = flag.String("workload", "", "kvrelay bench workload spec (default: bench-llmd's agentic for the kind)")
		policies = flag.String("policies", "latency,round-robin,power-of-two,kv", "routing policies")
		exact    = flag.Bool("exact", true, "route on the engines' caches and load reports (a control plane); false: the proxy's own view")
		report   = flag.Duration("report", 100*time.Millisecond, "load report interval under --exact")
		seeds    = flag.String("seeds", "1,2,3", "workload seeds, one run each")
		model    = flag.String("model", "Qwen/Qwen3-8B", "served model")
		seqs     = flag.Int("max-num-seqs", 4, "each engine's request slots")
		blocks   = flag.Int("blocks", 1024, "each engine's KV cache in blocks")
		speedup  = flag.Float64("sim-speedup", 0.5, "sim engines' --speedup-ratio")
		tellSeqs = flag.Bool("tell-seqs", false, "tell the router each engine's max-num-seqs")
		extra    = flag.String("extra", "", "route.Config overrides: compute_weight=1,batch_weight=0.05,...")
		verbose  = flag.Bool("v", false, "per-worker counts and prediction errors")
	)
	flag.Parse()
	if *spec == "" {
		*spec = agenticLLMD
		if *kind == "sim" {
			*spec = agenticSim
		}
	}
	fmt.Printf("%s engines ×%d, %s, exact=%v\n", *kind, *n, *spec, *exact)
	fmt.Printf("%-14s %-5s %8s %8s %8s %8s %6s %7s %7s  %s\n", "policy", "seed", "p50", "p90", "p99", "e2e50", "hit", "err50", "err90", "per worker")
	for _, pol := range strings.Split(*policies, ",") {
		var p50s, p90s, p99s []time.Duration
		for _, ss := range strings.Split(*seeds, ",") {
			seed, _ := strconv.ParseUint(ss, 10, 64)
			tok, _ := tokenizer.ForModel(*model)
			w, err := workload.Parse(*spec, seed, tok)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			// The proxy's defaults (dataplane/proxy.DefaultConfig).
			rc := route.Config{Policy: pol, Explicit: true, OverlapWeight: route.DefaultOverlapWeight, QueueWeight: route.DefaultQueueWeight,
				CacheThreshold: route.DefaultCacheThreshold, ComputeWeight: route.DefaultComputeWeight, BackgroundWeight: route.DefaultBackgroundWeight,
				BatchWeight: route.DefaultBatchWeight, WaitWeight: route.DefaultWaitWeight}
			cfg := fleetsim.Config{Model: *model, Workload: w, Exact: *exact, Seed: seed, Routing: rc}
			if err := applyExtra(&cfg.Routing, *extra); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(2)
			}
			if *exact {
				cfg.ReportEvery = *report
			}
			if *tellSeqs {
				cfg.Workers = func(_ int, w *route.Worker) { w.Engine.MaxNumSeqs = *seqs }
			}
			for range *n {
				switch *kind {
				case "llmd":
					c := fleetsim.BenchLLMD()
					c.MaxNumSeqs, c.CacheBlocks = *seqs, *blocks
					cfg.Engines = append(cfg.Engines, fleetsim.EngineSpec{Kind: fleetsim.KindLLMD, LLMD: c})
				case "sim":
					c := sim.DefaultConfig()
					c.MaxNumSeqs, c.NumGPUBlocks, c.MaxModelLen = *seqs, *blocks, 32768
					c.Timing.Speedup = *speedup
					cfg.Engines = append(cfg.Engines, fleetsim.EngineSpec{Kind: fleetsim.KindSim, Sim: c})
				}
			}
			t0 := time.Now()
			res, err := fleetsim.Run(cfg)
			if err != nil {
				fmt.Fprintln(os.Stderr, pol, err)
				os.Exit(1)
			}
			s := fleetsim.Summarize(res, len(res.Records)/5)
			p50s, p90s, p99s = append(p50s, s.TTFTP50), append(p90s, s.TTFTP90), append(p99s, s.TTFTP99)
			fmt.Printf("%-14s %-5d %8s %8s %8s %8s %5.1f%% %6.1f%% %6.1f%%  %v (%d req, %v wall)\n", pol, seed, ms(s.TTFTP50), ms(s.TTFTP90), ms(s.TTFTP99), ms(s.E2EP50),
				100*s.HitRate, 100*s.PredErrP50, 100*s.PredErrP90, s.PerWorker, s.Requests, time.Since(t0).Round(time.Millisecond))
			if *verbose {
				modes := map[string]int{}
				for _, r := range res.Records {
					modes[r.Mode]++
				}
				fmt.Printf("    modes %v\n", modes)
			}
		}
		fmt.Printf("%-14s %-5s %8s %8s %8s\n", pol, "med", ms(med(p50s)), ms(med(p90s)), ms(med(p99s)))
	}
}

func ms(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 0, 64) }

func med(v []time.Duration) time.Duration {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func applyExtra(c *route.Config, extra string) error {
	if extra == "" {
		return nil
	}
	for _, kv := range strings.Split(extra, ",") {
		k, v, _ := strings.Cut(kv, "=")
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return fmt.Errorf("--extra %s: %w", kv, err)
		}
		switch k {
		case "compute_weight":
			c.ComputeWeight = f
		case "batch_weight":
			c.BatchWeight = f
		case "wait_weight":
			c.WaitWeight = f
		case "background_weight":
			c.BackgroundWeight = f
		case "cache_threshold":
			c.CacheThreshold = f
		case "overlap_weight":
			c.OverlapWeight = f
		default:
			return fmt.Errorf("--extra: unknown %q", k)
		}
	}
	return nil
}
