package main

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
	"github.com/kvrelay/kvrelay/internal/fleetsim"
)

// A matrix case: one workload on one fleet.
type mcase struct {
	name    string
	kind    fleetsim.Kind
	n       int
	spec    string
	speedup float64 // the workload's replay speedup
	engine  func(i int) fleetsim.EngineSpec
}

func llmdEngine(perTok time.Duration, blocks int, mod func(i int, c *fleetsim.LLMDConfig)) func(int) fleetsim.EngineSpec {
	return func(i int) fleetsim.EngineSpec {
		c := fleetsim.BenchLLMD()
		c.PrefillPerToken, c.CacheBlocks = perTok, blocks
		if mod != nil {
			mod(i, &c)
		}
		return fleetsim.EngineSpec{Kind: fleetsim.KindLLMD, LLMD: c}
	}
}

func simEngine(seqs, blocks int, speedup float64, mod func(i int, c *sim.Config)) func(int) fleetsim.EngineSpec {
	return func(i int) fleetsim.EngineSpec {
		c := sim.DefaultConfig()
		c.MaxNumSeqs, c.NumGPUBlocks, c.MaxModelLen = seqs, blocks, 131072
		c.Timing.Speedup = speedup
		if mod != nil {
			mod(i, &c)
		}
		return fleetsim.EngineSpec{Kind: fleetsim.KindSim, Sim: c}
	}
}

const agentic1 = "agentic:preamble=6000,task=200,turns=1,rounds=5,tool=250,subagents=2,sub_task=100,sub_rounds=2,reasoning=32,osl=32,tool_time=300ms,session_ids=false"

func cases() []mcase {
	half := func(i int, c *fleetsim.LLMDConfig) {
		switch i {
		case 0: // half as fast
			c.PrefillOverhead, c.PrefillPerToken, c.InterToken = 2*c.PrefillOverhead, 2*c.PrefillPerToken, 2*c.InterToken
		case 1: // half the cache
			c.CacheBlocks /= 2
		}
	}
	halfSim := func(i int, c *sim.Config) {
		switch i {
		case 0:
			c.Timing.Speedup /= 2
		case 1:
			c.NumGPUBlocks /= 2
		}
	}
	llmdWith := func(perTok time.Duration, blocks, seqs int, mod func(i int, c *fleetsim.LLMDConfig)) func(int) fleetsim.EngineSpec {
		return llmdEngine(perTok, blocks, func(i int, c *fleetsim.LLMDConfig) {
			c.MaxNumSeqs = seqs
			if mod != nil {
				mod(i, c)
			}
		})
	}
	suiteHalf := func(i int, c *fleetsim.LLMDConfig) {
		switch i {
		case 1:
			c.PrefillOverhead, c.PrefillPerToken, c.InterToken = 2*c.PrefillOverhead, 2*c.PrefillPerToken, 2*c.InterToken
		case 2:
			c.CacheBlocks /= 2
		}
	}
	suiteHalfSim := func(i int, c *sim.Config) {
		switch i {
		case 1:
			c.Timing.Speedup /= 2
		case 2:
			c.NumGPUBlocks /= 2
		}
	}
	attn := func(_ int, c *sim.Config) { c.Timing.PrefillAttention, c.Timing.DecodeAttention = 0.0012, 0.05 }
	const suiteAgentic = "agentic:preamble=6000,task=200,turns=1,rounds=5,tool=250,subagents=2,sub_task=100,sub_rounds=2,reasoning=32,osl=32,tool_time=300ms,session_ids=false"
	const suitePreambles = "agentic:preambles=8,preamble=6000,task=200,turns=1,rounds=3,tool=250,subagents=1,sub_task=100,sub_rounds=1,reasoning=0,osl=32,tool_time=300ms,session_ids=false"
	const suiteLong = "multi-turn:sessions=10,rate=0.4,system=32000,systems=10,user=12000,turns=5,osl=32,think=1s,session_ids=false"
	const suiteBursty = "prefix-groups:groups=16,prompt=3000,user=200,osl=64,zipf=1,burst=3,burst_period=15s"
	const suiteMixed = "mixed:turns=3,think=2s,docs=16,doc=6000,zipf=1"
	return []mcase{
		// The routing suite's rows (hack/bench-suite), as its --list gives them.
		{"s-agentic-shared", fleetsim.KindLLMD, 4, suiteAgentic + ",sessions=24,rate=0.6", 1, llmdEngine(60*time.Microsecond, 1024, nil)},
		{"s-agentic-shared", fleetsim.KindSim, 4, suiteAgentic + ",sessions=9,rate=0.3", 1, simEngine(4, 1024, 0.5, nil)},
		{"s-agentic-preambles", fleetsim.KindLLMD, 4, suitePreambles + ",sessions=20,rate=0.45", 1, llmdEngine(150*time.Microsecond, 2048, nil)},
		{"s-agentic-preambles", fleetsim.KindSim, 4, suitePreambles + ",sessions=12,rate=0.3", 1, simEngine(4, 2048, 0.25, nil)},
		{"s-mooncake-load6", fleetsim.KindLLMD, 4, "mooncake:requests=220,block=512", 1.5, llmdWith(60*time.Microsecond, 131072, 16, nil)},
		{"s-mooncake-load6", fleetsim.KindSim, 4, "mooncake:requests=220,block=512", 1.5, simEngine(256, 131072, 0.5, nil)},
		{"s-mooncake-load7", fleetsim.KindLLMD, 4, "mooncake:requests=220,block=512", 1.75, llmdWith(60*time.Microsecond, 131072, 16, nil)},
		{"s-mooncake-load7", fleetsim.KindSim, 4, "mooncake:requests=220,block=512", 1.75, simEngine(256, 131072, 0.5, nil)},
		{"s-long-context", fleetsim.KindLLMD, 4, suiteLong, 1, llmdWith(60*time.Microsecond, 16384, 8, nil)},
		{"s-long-context", fleetsim.KindSim, 4, suiteLong, 1, simEngine(8, 16384, 1, attn)},
		{"s-bursty", fleetsim.KindLLMD, 4, suiteBursty + ",requests=130,rate=2.5", 1, llmdEngine(60*time.Microsecond, 1024, nil)},
		{"s-bursty", fleetsim.KindSim, 4, suiteBursty + ",requests=80,rate=1.5", 1, simEngine(4, 1024, 0.5, nil)},
		{"s-mixed", fleetsim.KindLLMD, 4, suiteMixed + ",users=70,user_rate=1.4,rag=35,rag_rate=0.7", 1, llmdEngine(60*time.Microsecond, 2048, nil)},
		{"s-mixed", fleetsim.KindSim, 4, suiteMixed + ",users=50,user_rate=1,rag=22,rag_rate=0.45", 1, simEngine(4, 2048, 0.5, nil)},
		{"s-hetero", fleetsim.KindLLMD, 4, suiteAgentic + ",sessions=16,rate=0.5", 1, llmdEngine(60*time.Microsecond, 1536, suiteHalf)},
		{"s-hetero", fleetsim.KindSim, 4, suiteAgentic + ",sessions=7,rate=0.3", 1, simEngine(4, 1536, 0.5, suiteHalfSim)},
		// Harder variants of the agentic rows, and the 8-engine Mooncake of bench-compare.
		{"shared-cheap", fleetsim.KindLLMD, 4, agentic1 + ",sessions=40,rate=0.6", 1, llmdEngine(60*time.Microsecond, 1024, nil)},
		{"shared-cheap", fleetsim.KindSim, 4, agentic1 + ",sessions=22,rate=0.25", 1, simEngine(4, 1024, 0.5, nil)},
		{"preambles-dear", fleetsim.KindLLMD, 4, agentic1 + ",preambles=6,sessions=40,rate=0.3", 1, llmdEngine(300*time.Microsecond, 1024, nil)},
		{"preambles-dear", fleetsim.KindSim, 4, agentic1 + ",preambles=6,sessions=22,rate=0.05", 1, simEngine(4, 1024, 0.25, nil)},
		{"hetero", fleetsim.KindLLMD, 4, agentic1 + ",sessions=40,rate=0.45", 1, llmdEngine(60*time.Microsecond, 1024, half)},
		{"hetero", fleetsim.KindSim, 4, agentic1 + ",sessions=22,rate=0.2", 1, simEngine(4, 1536, 0.5, halfSim)},
		{"mooncake6", fleetsim.KindSim, 8, "mooncake:requests=1000", 3, simEngine(256, 131072, 0.5, nil)},
		{"mooncake7", fleetsim.KindSim, 8, "mooncake:requests=1000", 3.5, simEngine(256, 131072, 0.5, nil)},
	}
}

// runMatrix runs every case with every policy over seeds and prints each case's medians and
// the first policy's ratio to the best of the others.
func runMatrix(policies []string, seeds []uint64, only, extra, save, against string) {
	model := "Qwen/Qwen3-8B"
	tok, _ := tokenizer.ForModel(model)
	type key struct {
		c, p string
	}
	type res struct{ P50, P90, P99, Hit, Err50, Err90 []float64 }
	pairedOut := map[string][3][]float64{}
	out := map[key]*res{}
	// others holds, per case name, the runs of the policies to compare the first one with:
	// this run's other policies, or those saved by an earlier run (--against).
	var others []map[string]*res
	if against != "" {
		b, err := os.ReadFile(against)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		var saved map[string]map[string]*res // policy → case → runs
		if err := json.Unmarshal(b, &saved); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		for _, m := range saved {
			others = append(others, m)
		}
	}
	defer func() {
		if save == "" {
			return
		}
		saved := map[string]map[string]*res{}
		for k, v := range out {
			if saved[k.p] == nil {
				saved[k.p] = map[string]*res{}
			}
			saved[k.p][k.c] = v
		}
		b, _ := json.MarshalIndent(saved, "", " ")
		_ = os.WriteFile(save, b, 0o644)
	}()
	var mu sync.Mutex
	for _, c := range cases() {
		name := c.name + "/" + string(c.kind)
		if only != "" && !slices.ContainsFunc(strings.Split(only, "+"), func(o string) bool { return strings.Contains(name, o) }) {
			continue
		}
		for _, seed := range seeds {
			for _, pol := range policies {
				// Sessions keep their state: every run replays a freshly generated workload.
				w, err := workload.Parse(c.spec, seed, tok)
				if err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(1)
				}
				rc := proxyDefaults(pol)
				if err := applyExtra(&rc, extra); err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(2)
				}
				cfg := fleetsim.Config{Model: model, Workload: w, Exact: true, ReportEvery: 100 * time.Millisecond, Seed: seed, Speedup: c.speedup, Routing: rc}
				for i := range c.n {
					cfg.Engines = append(cfg.Engines, c.engine(i))
				}
				r, err := fleetsim.Run(cfg)
				if err != nil {
					fmt.Fprintln(os.Stderr, name, pol, err)
					os.Exit(1)
				}
				s := fleetsim.Summarize(r, len(r.Records)/5)
				mu.Lock()
				k := key{name, pol}
				if out[k] == nil {
					out[k] = &res{}
				}
				o := out[k]
				o.P50, o.P90, o.P99, o.Hit = append(o.P50, ms1(s.TTFTP50)), append(o.P90, ms1(s.TTFTP90)), append(o.P99, ms1(s.TTFTP99)), append(o.Hit, s.HitRate)
				o.Err50, o.Err90 = append(o.Err50, s.PredErrP50), append(o.Err90, s.PredErrP90)
				mu.Unlock()
			}
		}
		fmt.Printf("%-22s", name)
		for _, pol := range policies {
			o := out[key{name, pol}]
			fmt.Printf(" | %s %5.0f/%5.0f/%5.0f %4.1f%%", short(pol), median(o.P50), median(o.P90), median(o.P99), 100*median(o.Hit))
		}
		if against == "" {
			others = others[:0]
			for _, pol := range policies[1:] {
				others = append(others, map[string]*res{name: out[key{name, pol}]})
			}
		}
		// The first policy against the best of the others, quantile by quantile.
		first := out[key{name, policies[0]}]
		best := func(f func(*res) []float64) float64 {
			b := 0.0
			for _, o := range others {
				if o[name] == nil {
					continue
				}
				v := median(f(o[name]))
				if b == 0 || v < b {
					b = v
				}
			}
			return b
		}
		r50 := median(first.P50) / best(func(r *res) []float64 { return r.P50 })
		r90 := median(first.P90) / best(func(r *res) []float64 { return r.P90 })
		r99 := median(first.P99) / best(func(r *res) []float64 { return r.P99 })
		fmt.Printf(" || ×%.2f ×%.2f ×%.2f", r50, r90, r99)
		if len(first.Err50) > 0 && median(first.Err50) > 0 {
			fmt.Printf(" | err %.0f%%/%.0f%%", 100*median(first.Err50), 100*median(first.Err90))
		}
		if others != nil {
			// Paired: seed by seed against the best of the others' runs of that seed.
			var q [3][]float64
			for i := range seeds {
				for j, f := range []func(*res) []float64{func(r *res) []float64 { return r.P50 }, func(r *res) []float64 { return r.P90 }, func(r *res) []float64 { return r.P99 }} {
					b := 0.0
					for _, o := range others {
						if o[name] == nil {
							continue
						}
						if v := f(o[name]); i < len(v) && (b == 0 || v[i] < b) {
							b = v[i]
						}
					}
					if v := f(first); i < len(v) && b > 0 {
						q[j] = append(q[j], v[i]/b)
					}
				}
			}
			pairedOut[name] = q
			fmt.Printf(" | paired ×%.2f ×%.2f ×%.2f", median(q[0]), median(q[1]), median(q[2]))
		}
		fmt.Println()
	}
}

func short(p string) string {
	switch p {
	case "round-robin":
		return "rr"
	case "power-of-two":
		return "p2c"
	case "least-loaded":
		return "ll"
	case "latency":
		return "lat"
	}
	return p
}

func ms1(d time.Duration) float64 { return float64(d) / 1e6 }

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

// proxyDefaults is the route.Config of `kvrelay proxy --policy pol` (dataplane/proxy.DefaultConfig).
func proxyDefaults(pol string) route.Config {
	return route.Config{Policy: pol, Explicit: true, OverlapWeight: route.DefaultOverlapWeight, QueueWeight: route.DefaultQueueWeight,
		CacheThreshold: route.DefaultCacheThreshold, ComputeWeight: route.DefaultComputeWeight, BackgroundWeight: route.DefaultBackgroundWeight,
		BatchWeight: route.DefaultBatchWeight, WaitWeight: route.DefaultWaitWeight, TailWeight: route.DefaultTailWeight, BalanceWeight: route.DefaultBalanceWeight, Explore: route.DefaultExplore}
}
