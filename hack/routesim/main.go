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
	"math"
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
		perTok   = flag.Duration("per-token", 60*time.Microsecond, "llmd engines' prefill time per uncached token")
		factor   = flag.Float64("load-factor", 2, "llmd engines' time factor under load")
		tellSeqs = flag.Bool("tell-seqs", false, "tell the router each engine's max-num-seqs")
		extra    = flag.String("extra", "", "route.Config overrides: compute_weight=1,batch_weight=0.05,...")
		verbose  = flag.Bool("v", false, "per-worker counts and prediction errors")
		alone    = flag.Bool("alone", false, "llm-d engines: also print the error of a prediction that knows each engine's state at the decision exactly and nothing of later arrivals (aerr: on llm-d's first-come-first-served engines only their noise and evictions), and the router's prediction's error against it (merr), apart for requests that found a free slot and those that queued")
		caseName = flag.String("case", "", "run one matrix case (name/kind) with the flags' policies and seeds, verbose")
		matrix   = flag.String("matrix", "", "run the case matrix (substring of case/kind to select; 'all' for every case) instead of one fleet")
		save     = flag.String("save", "", "matrix: save every policy's runs to this JSON file")
		against  = flag.String("against", "", "matrix: compare the first policy with the runs saved in this file")
		dump     = flag.Int("dump", 0, "print the N slowest requests of each run")
		classes  = flag.Bool("classes", false, "split each run's TTFTs (after its first fifth) into hits and misses (half the prompt cached or not), each with and without a wait for a slot (llm-d engines)")
	)
	flag.Parse()
	if *matrix != "" {
		var ss []uint64
		for _, x := range strings.Split(*seeds, ",") {
			v, _ := strconv.ParseUint(x, 10, 64)
			ss = append(ss, v)
		}
		only := *matrix
		if only == "all" {
			only = ""
		}
		runMatrix(strings.Split(*policies, ","), ss, only, *extra, *save, *against)
		return
	}
	// The fleet: a matrix case, or the engines the flags describe.
	c := mcase{name: "flags", kind: fleetsim.Kind(*kind), n: *n, spec: *spec, speedup: 1}
	switch {
	case *caseName != "":
		found := false
		for _, mc := range cases() {
			if mc.name+"/"+string(mc.kind) == *caseName {
				c, found = mc, true
			}
		}
		if !found {
			fmt.Fprintf(os.Stderr, "no case %q\n", *caseName)
			os.Exit(2)
		}
	case *kind == "sim":
		if c.spec == "" {
			c.spec = agenticSim
		}
		c.engine = func(int) fleetsim.EngineSpec {
			cfg := sim.DefaultConfig()
			cfg.MaxNumSeqs, cfg.NumGPUBlocks, cfg.MaxModelLen = *seqs, *blocks, 32768
			cfg.Timing.Speedup = *speedup
			return fleetsim.EngineSpec{Kind: fleetsim.KindSim, Sim: cfg}
		}
	default:
		if c.spec == "" {
			c.spec = agenticLLMD
		}
		c.engine = func(int) fleetsim.EngineSpec {
			cfg := fleetsim.BenchLLMD()
			cfg.MaxNumSeqs, cfg.CacheBlocks, cfg.PrefillPerToken, cfg.LoadFactor = *seqs, *blocks, *perTok, *factor
			return fleetsim.EngineSpec{Kind: fleetsim.KindLLMD, LLMD: cfg}
		}
	}
	*spec = c.spec
	fmt.Printf("%s engines ×%d, %s, exact=%v\n", c.kind, c.n, c.spec, *exact)
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
			rc := proxyDefaults(pol)
			cfg := fleetsim.Config{Model: *model, Workload: w, Exact: *exact, Seed: seed, Routing: rc, Explain: *dump > 0 || *verbose || *alone, Alone: *alone}
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
			cfg.Speedup = c.speedup
			for i := range c.n {
				cfg.Engines = append(cfg.Engines, c.engine(i))
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
			if *classes {
				// Each request by whether its engine found at least half its prompt cached
				// and whether it waited there for a slot: where a median falls between modes.
				var hw, hn, mw, mn []float64
				for i, r := range res.Records {
					if r.Err != "" || i < len(res.Records)/5 {
						continue
					}
					t := float64(r.TTFT) / 1e6
					hit := r.Cached*2 >= r.Prompt
					switch {
					case hit && r.Waited > 0:
						hw = append(hw, t)
					case hit:
						hn = append(hn, t)
					case r.Waited > 0:
						mw = append(mw, t)
					default:
						mn = append(mn, t)
					}
				}
				for _, g := range []struct {
					n string
					v []float64
				}{{"hit", hn}, {"hit+wait", hw}, {"miss", mn}, {"miss+wait", mw}} {
					slices.Sort(g.v)
					if len(g.v) > 0 {
						fmt.Printf("    %-10s n=%3d p50 %6.0f p90 %6.0f\n", g.n, len(g.v), g.v[len(g.v)/2], g.v[len(g.v)*9/10])
					}
				}
			}
			if *alone {
				fmt.Printf("%-14s %-5s %35s %6.1f%% %6.1f%%  knowing the engine's state at the decision\n", "", "", "aerr", 100*s.AloneErrP50, 100*s.AloneErrP90)
				fmt.Printf("%-14s %-5s %35s %6.1f%% %6.1f%%  the prediction against that\n", "", "", "merr", 100*s.ModelAloneErrP50, 100*s.ModelAloneErrP90)
				aloneSplit(res, *seqs)
			}
			if *verbose && c.kind == fleetsim.KindLLMD {
				// What each TTFT is made of on llm-d's engines: the idle engine's prefill of
				// what was not cached, and the rest (a slot's wait, the slowdown of a full
				// engine, the proxy's own queue when every worker was busy).
				var base, rest []time.Duration
				requeued := 0
				for i, r := range res.Records {
					if r.Err != "" || i < len(res.Records)/5 {
						continue
					}
					b := 25*time.Millisecond + time.Duration(max(r.Prompt-r.Cached, 0))**perTok
					base, rest = append(base, b), append(rest, max(r.TTFT-b, 0))
					if r.Requeued > 0 {
						requeued++
					}
				}
				slices.Sort(base)
				slices.Sort(rest)
				q := func(v []time.Duration, f float64) string { return ms(v[int(f*float64(len(v)-1))]) }
				fmt.Printf("    idle prefill p50 %s p90 %s; the rest p50 %s p90 %s p99 %s; %d of %d held by the proxy\n",
					q(base, .5), q(base, .9), q(rest, .5), q(rest, .9), q(rest, .99), requeued, len(base))
			}
			if *verbose {
				var dec, tt float64
				var nd int
				for _, r := range res.Records {
					if r.Err == "" {
						dec += (r.E2E - r.TTFT).Seconds()
						tt += r.TTFT.Seconds()
						nd++
					}
				}
				type agg struct {
					n          int
					sumLog, sq float64
				}
				var gq, gf agg
				for i, r := range res.Records {
					if r.Err != "" || r.Predict <= 0 || r.TTFT <= 0 || i < len(res.Records)/5 {
						continue
					}
					l := math.Log(float64(r.TTFT) / float64(r.Predict))
					g := &gf
					if r.PredQ > r.Predict/2 {
						g = &gq
					}
					g.n++
					g.sumLog += l
					g.sq += l * l
				}
				for _, x := range []struct {
					name string
					g    agg
				}{{"queued", gq}, {"fresh", gf}} {
					if x.g.n > 0 {
						m := x.g.sumLog / float64(x.g.n)
						fmt.Printf("    %s: n=%d bias exp(mean log)=%.2f sd(log)=%.2f\n", x.name, x.g.n, math.Exp(m), math.Sqrt(max(x.g.sq/float64(x.g.n)-m*m, 0)))
					}
				}
				hist := map[int64]int{}
				for _, r := range res.Records {
					if len(r.Candidates) == 0 {
						continue
					}
					lo, chosen := int64(1<<40), int64(0)
					for _, c := range r.Candidates {
						lo = min(lo, c.Load)
						if c.Worker == r.Worker {
							chosen = c.Load
						}
					}
					hist[chosen-lo]++
					if chosen-lo >= 3 && *dump < 0 {
						fmt.Printf("    #%d at %.2fs w%d ttft %s pred %s mode %s:", r.Seq, r.Start.Seconds(), r.Worker, ms(r.TTFT), ms(r.Predict), r.Mode)
						for _, c := range r.Candidates {
							fmt.Printf(" [w%d load %d pred %s cost %.0f ov %.0f]", c.Worker, c.Load, ms(c.TTFT), c.Cost*1000, c.Overlap)
						}
						fmt.Println()
					}
				}
				fmt.Printf("    chosen load above the least: %v\n", hist)
				for i, m := range res.Models {
					fmt.Printf("    w%d: seqs %d (low %d) sigma q %.2f f %.2f speed %.2f decode %.2f occ %.2f theta %.2f\n", i, m.MaxNumSeqs, m.SeqsLow, m.SigmaQueued, m.SigmaFresh, m.Speed, m.DecodeSpeed, m.Occupancy, m.Theta)
				}
				fmt.Printf("    mean decode %.0f ms, mean ttft %.0f ms, span %.1fs\n", 1000*dec/float64(nd), 1000*tt/float64(nd), res.Duration.Seconds())
				modes := map[string]int{}
				for _, r := range res.Records {
					modes[r.Mode]++
				}
				fmt.Printf("    modes %v\n", modes)
			}
			if *dump > 0 {
				recs := slices.Clone(res.Records)
				slices.SortFunc(recs, func(a, b fleetsim.Record) int { return int(b.TTFT - a.TTFT) })
				for _, r := range recs[:min(*dump, len(recs))] {
					fmt.Printf("    #%d %-11s at %7.2fs w%d ttft %6s pred %6s prompt %5d cached %5d overlap %4.0f mode %s\n", r.Seq, r.Tag, r.Start.Seconds(), r.Worker, ms(r.TTFT), ms(r.Predict), r.Prompt, r.Cached, r.Overlap, r.Mode)
					for _, c := range r.Candidates {
						fmt.Printf("        w%d pred %6s queue %6s load %d (engine %d+%d) overlap %4.0f cost %5.0f: spread %4.0f slowdown %5.0f busy·compute %4.0f hold·scarcity %4.0f\n",
							c.Worker, ms(c.TTFT), ms(c.Queue), c.Load, c.Running, c.Wait, c.Overlap, c.Cost*1e3, c.Spread*1e3, c.Slowdown*1e3, c.BusyCompute*1e3, c.HoldScarcity*1e3)
					}
				}
			}
		}
		fmt.Printf("%-14s %-5s %8s %8s %8s\n", pol, "med", ms(med(p50s)), ms(med(p90s)), ms(med(p99s)))
	}
}

// aloneSplit prints the prediction's error against Alone, and its bias, apart for the
// requests that found a free slot on their engine and those that queued for one.
func aloneSplit(res *fleetsim.Result, seqs int) {
	type agg struct {
		errs   []float64
		sumLog float64
	}
	var g [2]agg
	for i, r := range res.Records {
		if r.Err != "" || r.Alone <= 0 || r.Predict <= 0 || i < len(res.Records)/5 {
			continue
		}
		k := 0
		for _, c := range r.Candidates {
			if c.Worker == r.Worker && (c.Wait > 0 || c.Running >= seqs) {
				k = 1
			}
		}
		g[k].errs = append(g[k].errs, math.Abs(float64(r.Predict-r.Alone))/float64(r.TTFT))
		g[k].sumLog += math.Log(float64(r.Predict) / float64(r.Alone))
	}
	for k, name := range []string{"free slot", "queued"} {
		e := g[k].errs
		if len(e) == 0 {
			continue
		}
		slices.Sort(e)
		fmt.Printf("%-14s %-5s %35s n=%d merr p50 %.1f%% p90 %.1f%%, predicted ÷ alone (geometric mean) %.2f\n", "", "", name, len(e), 100*e[len(e)/2], 100*e[len(e)*9/10], math.Exp(g[k].sumLog/float64(len(e))))
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
		case "tail_weight":
			c.TailWeight = f
		case "balance_weight":
			c.BalanceWeight = f
		case "explore":
			c.Explore = f
		case "overlap_weight":
			c.OverlapWeight = f
		default:
			return fmt.Errorf("--extra: unknown %q", k)
		}
	}
	return nil
}
