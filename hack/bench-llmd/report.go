package main

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// stat is a per-run value's median and range over the runs that measured it.
type stat struct {
	med, lo, hi float64
	n           int
}

func statOf(xs []float64) stat {
	var v []float64
	for _, x := range xs {
		if !math.IsNaN(x) && !math.IsInf(x, 0) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return stat{med: math.NaN(), lo: math.NaN(), hi: math.NaN()}
	}
	slices.Sort(v)
	return stat{med: quantile(v, 0.5), lo: v[0], hi: v[len(v)-1], n: len(v)}
}

// num formats a value with three significant digits or so.
func num(v float64) string {
	switch a := math.Abs(v); {
	case math.IsNaN(v):
		return "–"
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3f", v)
	}
}

func pct(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%.1f%%", 100*v)
}

// cell is "median [min–max]", the range left out for a single run.
func (s stat) cell(f func(float64) string) string {
	if s.n == 0 {
		return "–"
	}
	if s.n == 1 || f(s.lo) == f(s.hi) {
		return f(s.med)
	}
	return fmt.Sprintf("%s [%s–%s]", f(s.med), f(s.lo), f(s.hi))
}

func ratio(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("×%.2f", v)
}

// table renders the comparison: per engine kind, one row per router.
func table(cfg *config, results []*runResult) string {
	var b strings.Builder
	byCell := map[[2]string][]*runResult{}
	for _, r := range results {
		k := [2]string{r.Engine, r.Router}
		byCell[k] = append(byCell[k], r)
	}
	for _, engine := range cfg.engines {
		fmt.Fprintf(&b, "### engines: %s — %s\n\nWorkload `%s`.\n\n", engine, engineDescription(cfg, engine), canonicalSpec(cfg.workloadFor(engine), cfg.seed))
		b.WriteString("| router | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | E2E p50 (ms) | prefix hit | requests per engine | pick p50 (ms) | ok |\n")
		b.WriteString("|---|---:|---:|---:|---:|---:|:---:|---:|---:|\n")
		var floors []float64
		for _, router := range cfg.routers {
			rs := byCell[[2]string{engine, router}]
			if len(rs) == 0 {
				continue
			}
			var good []*runResult
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
			col := func(f func(*runResult) float64) stat {
				xs := make([]float64, len(good))
				for i, r := range good {
					xs[i] = f(r)
				}
				return statOf(xs)
			}
			per := make([]string, cfg.numEngines)
			for i := range per {
				per[i] = fmt.Sprintf("%.0f", col(func(r *runResult) float64 {
					if i < len(r.PerEngine) {
						return float64(r.PerEngine[i])
					}
					return math.NaN()
				}).med)
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
				col(func(r *runResult) float64 { return r.TTFTP50 }).cell(num),
				col(func(r *runResult) float64 { return r.TTFTP90 }).cell(num),
				col(func(r *runResult) float64 { return r.TTFTP99 }).cell(num),
				col(func(r *runResult) float64 { return r.E2EP50 }).cell(num),
				col(func(r *runResult) float64 { return r.HitRate }).cell(pct),
				strings.Join(per, "/"),
				col(func(r *runResult) float64 { return r.PickP50 }).cell(num),
				okCell)
			for _, r := range good {
				floors = append(floors, r.FloorP50)
			}
		}
		// kvrelay's latency policy on its exact index (as a proxy, and as an endpoint picker
		// behind the same gateway) against llm-d's precise picker, run by run.
		for _, ours := range []string{routerLatencyExact, routerKEPPExact} {
			var r50, r90, hit, pick []float64
			for _, a := range byCell[[2]string{engine, ours}] {
				for _, e := range byCell[[2]string{engine, routerEPPPrecise}] {
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
					statOf(r50).cell(ratio), statOf(r90).cell(ratio), statOf(hit).cell(ratio), statOf(pick).cell(ratio))
			}
		}
		b.WriteString("\n")
		if f := statOf(floors); f.n > 0 {
			if engine == engineLLMD {
				fmt.Fprintf(&b, "llm-d simulator TTFT floor p50: %s ms — per request 25 ms + 60 µs × the prompt tokens an unbounded prefix cache shared by all engines would not hold (counted in the simulator's own tokens), no queueing, no load factor; median [range] over %s.\n\n",
					f.cell(num), runsPhrase(f.n))
			} else {
				fmt.Fprintf(&b, "kvrelay simulator TTFT floor p50: %s ms — per request the simulator's prefill model (%.3g ms for 6000 tokens at --speedup-ratio %g) on the prompt tokens an unbounded shared prefix cache would not hold, no queueing; median [range] over %s.\n\n",
					f.cell(num), bench6000(cfg), cfg.kvSpeedup, runsPhrase(f.n))
			}
		}
	}
	return b.String()
}

// details is one row per run with the figures behind the table and the extras.
func details(results []*runResult) string {
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
			extra = append(extra, fmt.Sprintf("%s=%s", k, num(r.Extra[k])))
		}
		if r.Routed != "" {
			extra = append(extra, "routed: "+r.Routed)
		}
		fmt.Fprintf(&b, "| %d | %s | %s | %d/%d | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s (%d) | %s | %s |\n",
			r.Run, r.Engine, r.Router, r.OK, r.Requests, r.WallS, num(r.TTFTP50), num(r.TTFTP90), num(r.TTFTP99),
			num(r.E2EP50), pct(r.HitRate), pct(r.IdealHitRate), pct(r.LRUHitRate), strings.Join(per, "/"),
			num(r.PickP50), r.PickSamples, num(r.FloorP50), strings.Join(extra, " "))
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

func engineDescription(cfg *config, engine string) string {
	if engine == engineLLMD {
		return fmt.Sprintf("4 × llm-d-inference-sim (%s, dummy tokenizer, max-num-seqs 4, KV cache 1024 blocks of 16, per-token latency: 25 ms + 60 µs per uncached prompt token, ITL 15 ms, up to ×2 under load)", cfg.model)
	}
	return fmt.Sprintf("4 × kvrelay sim (%s, ChatML + o200k_base, max-num-seqs 4, 1024 blocks of 16, --speedup-ratio %g: 6000 uncached tokens prefill in %.0f ms)", cfg.model, cfg.kvSpeedup, bench6000(cfg))
}
