package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	bh "github.com/kvrelay/kvrelay/internal/benchharness"
)

// Summary is the suite's result: what ran where, and per workload and engine kind every
// router's figures and kvrelay's default against the best other router.
type Summary struct {
	Commit   string            `json:"commit"`
	Date     string            `json:"date"`
	Machine  bh.Machine        `json:"machine"`
	Versions map[string]string `json:"versions"`
	Model    string            `json:"model"`
	Seed     uint64            `json:"seed"`
	// SeedPerRound: round r ran the workloads with seed Seed+r-1 (else every round Seed).
	SeedPerRound bool    `json:"seed_per_round"`
	Rounds       int     `json:"rounds"`
	Quick        bool    `json:"quick,omitempty"`
	WallS        float64 `json:"wall_s"`
	// Runs is the number of finished runs summarized, LoadS the seconds their loads took.
	Runs          int      `json:"runs"`
	LoadS         float64  `json:"load_s"`
	DefaultRouter string   `json:"default_router"`
	Skipped       []string `json:"skipped,omitempty"`
	Cells         []*Cell  `json:"workloads"`
}

// Cell is one workload on one engine kind.
type Cell struct {
	Workload string         `json:"workload"`
	Stresses string         `json:"stresses"`
	Engine   string         `json:"engine"`
	Spec     string         `json:"spec"`
	Speedup  float64        `json:"arrival_speedup,omitempty"`
	Fleet    string         `json:"fleet"`
	Note     string         `json:"note,omitempty"`
	FloorP50 JStat          `json:"ttft_floor_p50_ms"`
	Routers  []*RouterStats `json:"routers"`
	// VsBest compares the default router with the best other router at each figure: TTFT
	// p50, p90, p99 (lowest median) and hit rate (highest median).
	VsBest map[string]*Versus `json:"default_vs_best_other,omitempty"`
}

// RouterStats is one router's figures over the rounds: median, min, max.
type RouterStats struct {
	Router    string `json:"router"`
	Hop       string `json:"hop"`
	PickPoint string `json:"pick_measured_at"`
	TTFTP50   JStat  `json:"ttft_p50_ms"`
	TTFTP90   JStat  `json:"ttft_p90_ms"`
	TTFTP99   JStat  `json:"ttft_p99_ms"`
	E2EP50    JStat  `json:"e2e_p50_ms"`
	HitRate   JStat  `json:"hit_rate"`
	PickP50   JStat  `json:"pick_p50_ms"`
	// PredErrP50 and PredErrP90 are the latency model's |predicted − actual| / actual TTFT,
	// the median and 90th percentile over each run's predicted requests after the first
	// tenth (bh.WarmupShare); absent for routers that predict nothing.
	PredErrP50 JStat `json:"prediction_rel_error_p50"`
	PredErrP90 JStat `json:"prediction_rel_error_p90"`
	OK         int   `json:"ok"`
	Requests   int   `json:"requests"`
	Runs       int   `json:"runs"`
	FailedRuns int   `json:"failed_runs,omitempty"`
}

// Versus is the default router's figure ÷ the best other router's, round by round.
type Versus struct {
	Best  string `json:"best_other"`
	Ratio JStat  `json:"ratio"`
	// Overlap: the default's range over the rounds overlaps the best other's, so the
	// rounds do not separate the two.
	Overlap bool `json:"ranges_overlap"`
}

// JStat is a Stat as JSON (null for no value).
type JStat struct {
	Median *float64 `json:"median"`
	Min    *float64 `json:"min"`
	Max    *float64 `json:"max"`
	N      int      `json:"n"`
}

func jstat(s bh.Stat) JStat {
	f := func(v float64) *float64 {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil
		}
		return &v
	}
	return JStat{Median: f(s.Med), Min: f(s.Lo), Max: f(s.Hi), N: s.N}
}

func (j JStat) stat() bh.Stat {
	if j.N == 0 || j.Median == nil {
		return bh.Stat{Med: math.NaN(), Lo: math.NaN(), Hi: math.NaN()}
	}
	return bh.Stat{Med: *j.Median, Lo: *j.Min, Hi: *j.Max, N: j.N}
}

// figures the summary compares, each with how to read it from a run and whether lower is
// better.
var figures = []struct {
	key   string
	get   func(*bh.RunResult) float64
	lower bool
}{
	{"ttft_p50", func(r *bh.RunResult) float64 { return r.TTFTP50 }, true},
	{"ttft_p90", func(r *bh.RunResult) float64 { return r.TTFTP90 }, true},
	{"ttft_p99", func(r *bh.RunResult) float64 { return r.TTFTP99 }, true},
	{"hit_rate", func(r *bh.RunResult) float64 { return r.HitRate }, false},
}

// summarize builds the summary of results for the rows, engines and routers run.
func summarize(rows []row, engines, routers []string, results []*bh.RunResult, seed uint64, quick bool) []*Cell {
	type key struct{ w, e, r string }
	by := map[key][]*bh.RunResult{}
	for _, r := range results {
		k := key{r.Workload, r.Engine, r.Router}
		by[k] = append(by[k], r)
	}
	var cells []*Cell
	for _, rw := range rows {
		for _, e := range engines {
			k := rw.kinds[e]
			spec := k.spec
			if quick {
				spec += k.quick
			}
			c := &Cell{Workload: rw.name, Stresses: rw.stresses, Engine: e, Spec: canonical(spec, seed), Speedup: k.speedup,
				Fleet: k.fleet.Describe(e, "Qwen/Qwen3-8B"), Note: k.note}
			good := map[string][]*bh.RunResult{}
			var floors []float64
			for _, router := range routers {
				rs := by[key{rw.name, e, router}]
				if len(rs) == 0 {
					continue
				}
				st := &RouterStats{Router: router, Hop: bh.RouterHop(router), PickPoint: bh.PickPoint(router), Runs: len(rs)}
				for _, r := range rs {
					st.OK += r.OK
					st.Requests += r.Requests
					if r.Err != "" {
						st.FailedRuns++
						continue
					}
					good[router] = append(good[router], r)
					floors = append(floors, r.FloorP50)
				}
				col := func(f func(*bh.RunResult) float64) JStat {
					var xs []float64
					for _, r := range good[router] {
						xs = append(xs, f(r))
					}
					return jstat(bh.StatOf(xs))
				}
				st.TTFTP50 = col(func(r *bh.RunResult) float64 { return r.TTFTP50 })
				st.TTFTP90 = col(func(r *bh.RunResult) float64 { return r.TTFTP90 })
				st.TTFTP99 = col(func(r *bh.RunResult) float64 { return r.TTFTP99 })
				st.E2EP50 = col(func(r *bh.RunResult) float64 { return r.E2EP50 })
				st.HitRate = col(func(r *bh.RunResult) float64 { return r.HitRate })
				st.PickP50 = col(func(r *bh.RunResult) float64 { return r.PickP50 })
				extra := func(k string) func(*bh.RunResult) float64 {
					return func(r *bh.RunResult) float64 {
						if v, ok := r.Extra[k]; ok {
							return v
						}
						return math.NaN()
					}
				}
				st.PredErrP50 = col(extra("ttft_rel_error_p50"))
				st.PredErrP90 = col(extra("ttft_rel_error_p90"))
				c.Routers = append(c.Routers, st)
			}
			c.FloorP50 = jstat(bh.StatOf(floors))
			c.VsBest = versusBest(good)
			if len(c.Routers) > 0 {
				cells = append(cells, c)
			}
		}
	}
	return cells
}

// versusBest compares the default router's runs with the best other router's at each
// figure: the other router with the best median, and the ratio default ÷ it taken round by
// round (rounds both completed).
func versusBest(good map[string][]*bh.RunResult) map[string]*Versus {
	mine := good[defaultRouter]
	if len(mine) == 0 {
		return nil
	}
	out := map[string]*Versus{}
	for _, f := range figures {
		best, bestMed := "", math.NaN()
		others := make([]string, 0, len(good))
		for r := range good {
			others = append(others, r)
		}
		slices.Sort(others) // ties go to the first name, the same every time
		for _, r := range others {
			if r == defaultRouter {
				continue
			}
			med := statFor(good[r], f.get).Med
			if math.IsNaN(med) {
				continue
			}
			if math.IsNaN(bestMed) || (f.lower && med < bestMed) || (!f.lower && med > bestMed) {
				best, bestMed = r, med
			}
		}
		if best == "" {
			continue
		}
		var ratios []float64
		for _, a := range mine {
			for _, b := range good[best] {
				if a.Run == b.Run {
					if d := f.get(b); d > 0 {
						ratios = append(ratios, f.get(a)/d)
					}
				}
			}
		}
		out[f.key] = &Versus{Best: best, Ratio: jstat(bh.StatOf(ratios)),
			Overlap: statFor(mine, f.get).Overlaps(statFor(good[best], f.get))}
	}
	return out
}

func statFor(rs []*bh.RunResult, get func(*bh.RunResult) float64) bh.Stat {
	xs := make([]float64, len(rs))
	for i, r := range rs {
		xs[i] = get(r)
	}
	return bh.StatOf(xs)
}

// canonical expands a spec with every default, as kvrelay bench records it.
func canonical(spec string, seed uint64) string {
	if w, err := workload.Parse(spec, seed, nil); err == nil {
		return w.Spec
	}
	return spec
}

// writeSummary writes summary.json and summary.md into dir and returns the Markdown.
func (cfg *config) writeSummary(results []*bh.RunResult, skipped []string, start time.Time, dir string) (string, error) {
	rounds, load := 0, 0.0
	for _, r := range results {
		rounds = max(rounds, r.Run)
		load += r.WallS
	}
	s := &Summary{
		Commit: cfg.Version, Date: time.Now().UTC().Format(time.RFC3339), Machine: bh.ThisMachine(), Versions: cfg.peerVersion,
		Model: cfg.Model, Seed: cfg.Seed, SeedPerRound: !cfg.sameSeed, Rounds: rounds, Quick: cfg.quick, WallS: time.Since(start).Seconds(),
		Runs: len(results), LoadS: load,
		DefaultRouter: defaultRouter, Skipped: skipped,
		Cells: summarize(cfg.rows, cfg.engines, cfg.routers, results, cfg.Seed, cfg.quick),
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, "summary.json"), append(b, '\n'), 0o644); err != nil {
		return "", err
	}
	md := s.Markdown(results)
	return md, os.WriteFile(filepath.Join(dir, "summary.md"), []byte(md), 0o644)
}

// Markdown renders the summary: the headline table of the default against the best other
// router, then per workload and engine kind every router's figures.
func (s *Summary) Markdown(results []*bh.RunResult) string {
	var b strings.Builder
	b.WriteString("# kvrelay routing suite (hack/bench-suite)\n\n")
	vs := make([]string, 0, len(s.Versions))
	for k, v := range s.Versions {
		vs = append(vs, k+" "+v)
	}
	slices.Sort(vs)
	seeds := fmt.Sprintf("seed %d in every round", s.Seed)
	if s.SeedPerRound {
		seeds = fmt.Sprintf("workload seed %d + round − 1 (every router of a round runs the same requests)", s.Seed)
	}
	fmt.Fprintf(&b, "Commit %s; %s; %s; model %s, %s; %d runs in up to %d interleaved round(s) (round, workload, engine kind, router: a figure without a range is one round's), fresh engines and router every run; %s of load.\n",
		s.Commit, s.Machine.String(), strings.Join(vs, ", "), s.Model, seeds, s.Runs, s.Rounds, time.Duration(s.LoadS*float64(time.Second)).Round(time.Second))
	if s.Quick {
		b.WriteString("\n**--quick: every workload shrunk to a few requests. A smoke test of the harness, not a measurement.**\n")
	}
	fmt.Fprintf(&b, "\n## %s ÷ the best other router\n\n", s.DefaultRouter)
	fmt.Fprintf(&b, "Per workload and engine kind: kvrelay's default router (%s: the latency policy on the control plane's index of the engines' KV events) ÷ the other router with the best median at that figure (named), the ratio taken round by round, median [min–max]; below 1 is better for TTFT, above 1 for hit rate. ≈ marks a figure where the two routers' ranges over the rounds overlap: the rounds do not separate them.\n\n", s.DefaultRouter)
	b.WriteString("The last column is the default's latency model against what happened: |predicted − actual| / actual TTFT of the requests it predicted, p50 / p90 over each run after its first tenth (the warm-up), median over the rounds.\n\n")
	b.WriteString("| workload | engines | TTFT p50 | TTFT p90 | TTFT p99 | hit rate | prediction error p50 / p90 |\n|---|---|---|---|---|---|---|\n")
	for _, c := range s.Cells {
		fmt.Fprintf(&b, "| %s | %s |", c.Workload, c.Engine)
		for _, f := range figures {
			v := c.VsBest[f.key]
			if v == nil {
				b.WriteString(" – |")
				continue
			}
			flag := ""
			if v.Overlap {
				flag = " ≈"
			}
			fmt.Fprintf(&b, " %s vs %s%s |", v.Ratio.stat().Cell(bh.Ratio), v.Best, flag)
		}
		pe := " – |"
		for _, r := range c.Routers {
			if r.Router == s.DefaultRouter && r.PredErrP50.N > 0 {
				pe = fmt.Sprintf(" %s / %s |", bh.Pct(*r.PredErrP50.Median), bh.Pct(*r.PredErrP90.Median))
			}
		}
		b.WriteString(pe + "\n")
	}
	b.WriteString(worstCase(s.Cells))
	b.WriteString("\nCells of the tables below: median over the rounds [min–max]. TTFT and E2E from the client (kvrelay bench); hit rate = Σ cached / Σ prompt tokens from the engines' usage; pick p50 = the router's decision per request, tokenization included, measured on the client side of the routing hop (the gateway's clock around the ext_proc request phase for the endpoint pickers, the proxy's own decision total for kvrelay's proxy); hop = what the router adds between client and engine besides an HTTP proxy hop. TTFT floor: per request the engine's own prefill of what one unbounded prefix cache shared by the fleet would not hold, on an idle full-speed engine; no router beats it.\n\n")
	for _, c := range s.Cells {
		fmt.Fprintf(&b, "## %s on %s engines\n\n%s\n\n", c.Workload, c.Engine, c.Stresses)
		fmt.Fprintf(&b, "Workload `%s`", c.Spec)
		if c.Speedup > 0 && c.Speedup != 1 {
			fmt.Fprintf(&b, ", arrivals and think times sped up ×%g", c.Speedup)
		}
		fmt.Fprintf(&b, ". Engines: %s.", c.Fleet)
		if c.Note != "" {
			fmt.Fprintf(&b, " %s.", c.Note)
		}
		fmt.Fprintf(&b, " TTFT floor p50 %s ms.\n\n", c.FloorP50.stat().Cell(bh.Num))
		b.WriteString("| router | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | E2E p50 (ms) | hit rate | pick p50 (ms) | hop | ok |\n")
		b.WriteString("|---|---:|---:|---:|---:|---:|---:|---|---:|\n")
		for _, r := range c.Routers {
			name := r.Router
			if name == s.DefaultRouter {
				name = "**" + name + "**"
			}
			ok := fmt.Sprintf("%d/%d", r.OK, r.Requests)
			if r.FailedRuns > 0 {
				ok += fmt.Sprintf(" (%d of %d runs failed)", r.FailedRuns, r.Runs)
			}
			hop := "none"
			switch {
			case bh.BehindGateway(r.Router):
				hop = "gateway + ext_proc gRPC"
			case r.Router == bh.RouterLatencyQuery:
				hop = "index query gRPC"
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", name,
				r.TTFTP50.stat().Cell(bh.Num), r.TTFTP90.stat().Cell(bh.Num), r.TTFTP99.stat().Cell(bh.Num),
				r.E2EP50.stat().Cell(bh.Num), r.HitRate.stat().Cell(bh.Pct), r.PickP50.stat().Cell(bh.Num), hop, ok)
		}
		b.WriteString("\n")
	}
	for _, sk := range s.Skipped {
		fmt.Fprintf(&b, "Skipped %s.\n\n", sk)
	}
	var notes []string
	for _, r := range results {
		for _, n := range r.Notes {
			notes = append(notes, fmt.Sprintf("- round %d %s %s/%s: %s", r.Run, r.Workload, r.Engine, r.Router, n))
		}
		if r.Err != "" {
			notes = append(notes, fmt.Sprintf("- round %d %s %s/%s FAILED: %s", r.Run, r.Workload, r.Engine, r.Router, strings.ReplaceAll(r.Err, "\n", " ")))
		}
	}
	if len(notes) > 0 {
		b.WriteString("Notes:\n" + strings.Join(notes, "\n") + "\n")
	}
	return b.String()
}

// worstCase renders, for each router that ran on every workload and engine kind, its worst
// median TTFT p50, p90 and p99 over the cells as a multiple of the best router's there (1
// where it was the best): what choosing it as the default risks on a workload like the
// suite's. Empty when fewer than two routers ran everywhere.
func worstCase(cells []*Cell) string {
	type worst struct {
		ratio [3]float64
		where [3]string
		cells int
	}
	by := map[string]*worst{}
	var order []string
	for _, c := range cells {
		for k, get := range []func(*RouterStats) JStat{
			func(r *RouterStats) JStat { return r.TTFTP50 },
			func(r *RouterStats) JStat { return r.TTFTP90 },
			func(r *RouterStats) JStat { return r.TTFTP99 },
		} {
			best := math.Inf(1)
			for _, r := range c.Routers {
				if v := get(r); v.N > 0 && *v.Median > 0 {
					best = min(best, *v.Median)
				}
			}
			for _, r := range c.Routers {
				v := get(r)
				if v.N == 0 || math.IsInf(best, 1) {
					continue
				}
				w := by[r.Router]
				if w == nil {
					w = &worst{}
					by[r.Router] = w
					order = append(order, r.Router)
				}
				if k == 0 {
					w.cells++
				}
				if ratio := *v.Median / best; ratio > w.ratio[k] {
					w.ratio[k], w.where[k] = ratio, c.Workload+"/"+c.Engine
				}
			}
		}
	}
	var rows []string
	for _, name := range order {
		if w := by[name]; w.cells == len(cells) {
			rows = append(rows, fmt.Sprintf("| %s | ×%.2f (%s) | ×%.2f (%s) | ×%.2f (%s) |", name, w.ratio[0], w.where[0], w.ratio[1], w.where[1], w.ratio[2], w.where[2]))
		}
	}
	if len(rows) < 2 {
		return ""
	}
	return "\nEach router's worst case over the workloads and engine kinds above: its median TTFT ÷ the best router's there (×1.00 where it was the best), and where.\n\n" +
		"| router | worst TTFT p50 | worst TTFT p90 | worst TTFT p99 |\n|---|---|---|---|\n" + strings.Join(rows, "\n") + "\n"
}

// describeSuite is --list: each workload, what it stresses and its settings per kind.
func describeSuite(rows []row) string {
	var b strings.Builder
	for _, r := range rows {
		fmt.Fprintf(&b, "%s\n  %s\n", r.name, r.stresses)
		for _, e := range bh.AllEngines {
			k := r.kinds[e]
			fmt.Fprintf(&b, "  %s: %s", e, k.spec)
			if k.speedup > 0 {
				fmt.Fprintf(&b, " (arrivals ×%g)", k.speedup)
			}
			fmt.Fprintf(&b, "\n    %s\n", k.fleet.Describe(e, "Qwen/Qwen3-8B"))
			if k.note != "" {
				fmt.Fprintf(&b, "    %s\n", k.note)
			}
		}
	}
	return b.String()
}
