package main

import (
	"fmt"
	"math"
	"slices"
	"strings"

	bh "github.com/kvrelay/kvrelay/internal/benchharness"
)

// table renders the comparison: per engine kind, one row per router.
func table(cfg *config, results []*bh.RunResult) string {
	var b strings.Builder
	byCell := map[[2]string][]*bh.RunResult{}
	for _, r := range results {
		k := [2]string{r.Engine, r.Router}
		byCell[k] = append(byCell[k], r)
	}
	for _, engine := range cfg.engines {
		fmt.Fprintf(&b, "### engines: %s — %s\n\nWorkload `%s`.\n\n", engine, cfg.fleet.Describe(engine, cfg.Model), canonicalSpec(cfg.workloadFor(engine), cfg.Seed))
		b.WriteString("| router | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | E2E p50 (ms) | prefix hit | requests per engine | pick p50 (ms) | ok |\n")
		b.WriteString("|---|---:|---:|---:|---:|---:|:---:|---:|---:|\n")
		var floors []float64
		for _, router := range cfg.routers {
			rs := byCell[[2]string{engine, router}]
			if len(rs) == 0 {
				continue
			}
			var good []*bh.RunResult
			var errs []string
			for _, r := range rs {
				if r.Err != "" {
					errs = append(errs, fmt.Sprintf("run %d: %s", r.Run, r.Err))
					continue
				}
				good = append(good, r)
			}
			if len(good) == 0 {
				fmt.Fprintf(&b, "| %s | failed (notes below) | | | | | | | 0 (%d of %d runs failed) |\n", router, len(errs), len(rs))
				continue
			}
			col := func(f func(*bh.RunResult) float64) bh.Stat {
				xs := make([]float64, len(good))
				for i, r := range good {
					xs[i] = f(r)
				}
				return bh.StatOf(xs)
			}
			per := make([]string, cfg.fleet.Engines)
			for i := range per {
				per[i] = fmt.Sprintf("%.0f", col(func(r *bh.RunResult) float64 {
					if i < len(r.PerEngine) {
						return float64(r.PerEngine[i])
					}
					return math.NaN()
				}).Med)
			}
			ok, total := 0, 0
			for _, r := range rs {
				ok += r.OK
				total += max(r.Requests, 1)
			}
			okCell := fmt.Sprintf("%d/%d", ok, total)
			if len(errs) > 0 {
				okCell += fmt.Sprintf(" (%d of %d runs failed)", len(errs), len(rs))
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", router,
				col(func(r *bh.RunResult) float64 { return r.TTFTP50 }).Cell(bh.Num),
				col(func(r *bh.RunResult) float64 { return r.TTFTP90 }).Cell(bh.Num),
				col(func(r *bh.RunResult) float64 { return r.TTFTP99 }).Cell(bh.Num),
				col(func(r *bh.RunResult) float64 { return r.E2EP50 }).Cell(bh.Num),
				col(func(r *bh.RunResult) float64 { return r.HitRate }).Cell(bh.Pct),
				strings.Join(per, "/"),
				col(func(r *bh.RunResult) float64 { return r.PickP50 }).Cell(bh.Num),
				okCell)
			for _, r := range good {
				floors = append(floors, r.FloorP50)
			}
		}
		// kvrelay's latency policy on its exact index (as a proxy, and as an endpoint picker
		// behind the same gateway) against llm-d's precise picker, run by run.
		for _, ours := range []string{bh.RouterLatencyExact, bh.RouterKEPPExact} {
			var r50, r90, hit, pick []float64
			for _, a := range byCell[[2]string{engine, ours}] {
				for _, e := range byCell[[2]string{engine, bh.RouterEPPPrecise}] {
					if a.Run == e.Run && a.Err == "" && e.Err == "" && e.TTFTP50 > 0 && e.TTFTP90 > 0 {
						r50 = append(r50, a.TTFTP50/e.TTFTP50)
						r90 = append(r90, a.TTFTP90/e.TTFTP90)
						if e.HitRate > 0 {
							hit = append(hit, a.HitRate/e.HitRate)
						}
						if e.PickP50 > 0 {
							pick = append(pick, a.PickP50/e.PickP50)
						}
					}
				}
			}
			if len(r50) > 0 {
				fmt.Fprintf(&b, "| **%s ÷ epp-precise** | %s | %s | | | %s | | %s | |\n", ours,
					bh.StatOf(r50).Cell(bh.Ratio), bh.StatOf(r90).Cell(bh.Ratio), bh.StatOf(hit).Cell(bh.Ratio), bh.StatOf(pick).Cell(bh.Ratio))
			}
		}
		b.WriteString("\n")
		if f := bh.StatOf(floors); f.N > 0 {
			if engine == bh.EngineLLMD {
				fmt.Fprintf(&b, "llm-d simulator TTFT floor p50: %s ms — per request 25 ms + 60 µs × the prompt tokens an unbounded prefix cache shared by all engines would not hold (counted in the simulator's own tokens), no queueing, no load factor; median [range] over %s.\n\n",
					f.Cell(bh.Num), runsPhrase(f.N))
			} else {
				fmt.Fprintf(&b, "kvrelay simulator TTFT floor p50: %s ms — per request the simulator's prefill model (%.3g ms for 6000 tokens at --speedup-ratio %g) on the prompt tokens an unbounded shared prefix cache would not hold, no queueing; median [range] over %s.\n\n",
					f.Cell(bh.Num), cfg.fleet.FloorMS(bh.EngineKVRelay, 6000, 0), cfg.fleet.Sim.Speedup, runsPhrase(f.N))
			}
		}
	}
	return b.String()
}

// details is one row per run with the figures behind the table and the extras.
func details(results []*bh.RunResult) string {
	var b strings.Builder
	b.WriteString("| run | engines | router | ok | wall (s) | TTFT p50 | p90 | p99 | E2E p50 | hit | ideal hit | shared-LRU hit | per engine | pick p50 (ms, samples) | floor p50 | extra |\n")
	b.WriteString("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---|\n")
	for _, r := range results {
		if r.Err != "" {
			fmt.Fprintf(&b, "| %d | %s | %s | failed: %s | | | | | | | | | | | | |\n", r.Run, r.Engine, r.Router, mdEscape(r.Err))
			continue
		}
		per := make([]string, len(r.PerEngine))
		for i, n := range r.PerEngine {
			per[i] = fmt.Sprint(n)
		}
		var extra []string
		keys := make([]string, 0, len(r.Extra))
		for k := range r.Extra {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			extra = append(extra, fmt.Sprintf("%s=%s", k, bh.Num(r.Extra[k])))
		}
		if r.Routed != "" {
			extra = append(extra, "routed: "+r.Routed)
		}
		fmt.Fprintf(&b, "| %d | %s | %s | %d/%d | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s (%d) | %s | %s |\n",
			r.Run, r.Engine, r.Router, r.OK, r.Requests, r.WallS, bh.Num(r.TTFTP50), bh.Num(r.TTFTP90), bh.Num(r.TTFTP99),
			bh.Num(r.E2EP50), bh.Pct(r.HitRate), bh.Pct(r.IdealHitRate), bh.Pct(r.LRUHitRate), strings.Join(per, "/"),
			bh.Num(r.PickP50), r.PickSamples, bh.Num(r.FloorP50), strings.Join(extra, " "))
	}
	return b.String()
}

func runsPhrase(n int) string {
	if n == 1 {
		return "the one run"
	}
	return fmt.Sprintf("the %d runs (every router, every round)", n)
}

func mdEscape(s string) string {
	s = strings.ReplaceAll(s, "|", `\|`)
	return strings.ReplaceAll(s, "\n", " ")
}
