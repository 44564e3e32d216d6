package bench

import (
	"encoding/json"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// Table renders results side by side as Markdown: one row per figure, one column per run,
// and after the first, each figure's ratio to the first run's.
func Table(rs []*Result) string {
	if len(rs) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString("| metric |")
	for i, r := range rs {
		if i == 0 {
			fmt.Fprintf(&b, " %s |", r.Label)
		} else {
			fmt.Fprintf(&b, " %s | ×%s |", r.Label, rs[0].Label)
		}
	}
	b.WriteString("\n|---|")
	for i := range rs {
		if i == 0 {
			b.WriteString("---:|")
		} else {
			b.WriteString("---:|---:|")
		}
	}
	b.WriteByte('\n')
	type row struct {
		name  string
		value func(s *Summary) float64
		fmt   func(float64) string
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	msf := func(v float64) string { return fmt.Sprintf("%.1f ms", v) }
	num := func(v float64) string { return fmt.Sprintf("%.0f", v) }
	rate := func(v float64) string { return fmt.Sprintf("%.2f", v) }
	pct := func(v float64) string { return fmt.Sprintf("%.1f%%", 100*v) }
	rows := []row{
		{"requests ok", func(s *Summary) float64 { return float64(s.OK) }, num},
		{"failed", func(s *Summary) float64 { return float64(s.Requests - s.OK) }, num},
		{"rejected (429)", func(s *Summary) float64 { return float64(s.Rejected) }, num},
		{"TTFT p50", func(s *Summary) float64 { return ms(s.TTFT.P50) }, msf},
		{"TTFT p90", func(s *Summary) float64 { return ms(s.TTFT.P90) }, msf},
		{"TTFT p99", func(s *Summary) float64 { return ms(s.TTFT.P99) }, msf},
		{"TTFT mean", func(s *Summary) float64 { return ms(s.TTFT.Mean) }, msf},
	}
	if slices.ContainsFunc(rs, func(r *Result) bool { return r.Summary.Breakdown != nil }) {
		// What TTFT is made of (Breakdown): the request's own prefill on an idle engine, the
		// wait beside it, and the p50 that routing can approach.
		part := func(f func(b *Breakdown) time.Duration) func(s *Summary) float64 {
			return func(s *Summary) float64 {
				if s.Breakdown == nil {
					return math.NaN() // not measured: shown as –
				}
				return ms(f(s.Breakdown))
			}
		}
		rows = append(rows, []row{
			{"own prefill p50", part(func(b *Breakdown) time.Duration { return b.Prefill.P50 }), msf},
			{"wait to first token p50", part(func(b *Breakdown) time.Duration { return b.Wait.P50 }), msf},
			{"wait to first token p90", part(func(b *Breakdown) time.Duration { return b.Wait.P90 }), msf},
			{"TTFT floor p50", part(func(b *Breakdown) time.Duration { return b.Floor.P50 }), msf},
		}...)
	}
	rows = append(rows, []row{
		{"ITL p50", func(s *Summary) float64 { return ms(s.ITL.P50) }, msf},
		{"ITL p90", func(s *Summary) float64 { return ms(s.ITL.P90) }, msf},
		{"ITL p99", func(s *Summary) float64 { return ms(s.ITL.P99) }, msf},
		{"ITL mean", func(s *Summary) float64 { return ms(s.ITL.Mean) }, msf},
		{"E2E p50", func(s *Summary) float64 { return ms(s.E2E.P50) }, msf},
		{"E2E p90", func(s *Summary) float64 { return ms(s.E2E.P90) }, msf},
		{"E2E p99", func(s *Summary) float64 { return ms(s.E2E.P99) }, msf},
		{"E2E mean", func(s *Summary) float64 { return ms(s.E2E.Mean) }, msf},
		{"requests/s", func(s *Summary) float64 { return s.ReqPerSec }, rate},
		{"requests/s mid-run", func(s *Summary) float64 { return s.MidRunPerSec }, rate},
		{"output tokens/s", func(s *Summary) float64 { return s.TokPerSec }, num},
		{"goodput (req/s)", func(s *Summary) float64 { return s.GoodputPerSec }, rate},
		{"goodput share", func(s *Summary) float64 { return s.GoodputShare }, pct},
		{"prefix hit rate", func(s *Summary) float64 { return s.HitRate }, pct},
		{"ideal hit rate", func(s *Summary) float64 { return s.IdealHitRate }, pct},
		{"hit rate / ideal", hitShare(func(s *Summary) float64 { return s.IdealHitRate }), pct},
	}...)
	if slices.ContainsFunc(rs, func(r *Result) bool { return r.Summary.CacheBlocks > 0 }) {
		rows = append(rows, []row{
			{"cache (blocks)", func(s *Summary) float64 { return float64(s.CacheBlocks) }, num},
			{"shared-LRU hit rate", func(s *Summary) float64 { return s.LRUHitRate }, pct},
			{"hit rate / shared LRU", hitShare(func(s *Summary) float64 { return s.LRUHitRate }), pct},
		}...)
	}
	if slices.ContainsFunc(rs, func(r *Result) bool { return r.Summary.Prediction != nil }) {
		pred := func(f func(p *PredictionError) float64) func(s *Summary) float64 {
			return func(s *Summary) float64 {
				if s.Prediction == nil {
					return math.NaN()
				}
				return f(s.Prediction)
			}
		}
		rows = append(rows, []row{
			{"TTFT prediction error p50, first tenth", pred(func(p *PredictionError) float64 { return p.Cold }), pct},
			{"TTFT prediction error p50, rest", pred(func(p *PredictionError) float64 { return p.Warm }), pct},
			{"TTFT predicted under measured", pred(func(p *PredictionError) float64 { return p.Under }), pct},
		}...)
	}
	if slices.ContainsFunc(rs, func(r *Result) bool { return r.Summary.Tiers != nil }) {
		tier := func(f func(t *TierSummary) float64) func(s *Summary) float64 {
			return func(s *Summary) float64 {
				if s.Tiers == nil {
					return math.NaN()
				}
				return f(s.Tiers)
			}
		}
		mb := func(v float64) string { return fmt.Sprintf("%.1f MB", v/1e6) }
		rows = append(rows, []row{
			{"hit rate GPU tier", tier(func(t *TierSummary) float64 { return t.HitGPU }), pct},
			{"hit rate host tier", tier(func(t *TierSummary) float64 { return t.HitCPU }), pct},
			{"hit rate disk tier", tier(func(t *TierSummary) float64 { return t.HitDisk }), pct},
			{"pulled from peers", tier(func(t *TierSummary) float64 { return t.HitPeer }), pct},
			{"uncached prefill tokens", tier(func(t *TierSummary) float64 { return float64(t.Uncached) }), num},
			{"disk written", tier(func(t *TierSummary) float64 { return float64(t.DiskWritten) }), mb},
			{"disk read", tier(func(t *TierSummary) float64 { return float64(t.DiskRead) }), mb},
		}...)
	}
	if slices.ContainsFunc(rs, func(r *Result) bool { return r.Summary.Engines > 0 }) {
		rows = append(rows, row{"engine stall", func(s *Summary) float64 { return s.EngineStall }, pct})
	}
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s |", r.name)
		base := r.value(&rs[0].Summary)
		for i, res := range rs {
			v := r.value(&res.Summary)
			if math.IsNaN(v) {
				b.WriteString(" – |")
			} else {
				fmt.Fprintf(&b, " %s |", r.fmt(v))
			}
			if i > 0 {
				if base == 0 || math.IsNaN(base) || math.IsNaN(v) {
					b.WriteString(" – |")
				} else {
					fmt.Fprintf(&b, " %.2f |", v/base)
				}
			}
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// StallWarnings returns one line for each run whose simulated engines lost more than
// StallWarning of their time to a host that could not keep up.
func StallWarnings(rs []*Result) string {
	var b strings.Builder
	for _, r := range rs {
		if r.Summary.EngineStall > StallWarning {
			fmt.Fprintf(&b, "warning: %s: the simulated engines ran behind their modelled step times for %.1f%% of the run: the host is short of CPU for this engine speedup, so latencies are inflated and capacity understated; rerun with a lower --engine-speedup\n",
				r.Label, 100*r.Summary.EngineStall)
		}
	}
	return b.String()
}

// Write stores results.json, results.md and the plots (PNG and SVG) in dir.
func Write(dir string, rs []*Result, header string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("writing results: %w", err)
	}
	type runJSON struct {
		*Result
		Records []*Record `json:"records"`
	}
	out := make([]runJSON, len(rs))
	for i, r := range rs {
		out[i] = runJSON{Result: r, Records: r.Records}
	}
	data, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		return fmt.Errorf("writing results: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), data, 0o644); err != nil {
		return fmt.Errorf("writing results: %w", err)
	}
	md := header + "\n\n" + Table(rs)
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(md), 0o644); err != nil {
		return fmt.Errorf("writing results: %w", err)
	}
	return writePlots(dir, rs)
}

func writePlots(dir string, rs []*Result) error {
	plots := map[string]*plot.Plot{
		"ttft_cdf": cdfPlot("Time to first token", "TTFT (s)", rs, func(r *Record) []time.Duration { return []time.Duration{r.TTFT} }),
		"itl_cdf":  cdfPlot("Inter-token latency", "gap between tokens (s)", rs, func(r *Record) []time.Duration { return r.ITL }),
		"hit_rate": hitPlot(rs),
	}
	for _, r := range rs {
		if p := loadPlot(r); p != nil {
			plots["worker_load_"+safeName(r.Label)] = p
		}
	}
	for name, p := range plots {
		for _, ext := range []string{".png", ".svg"} {
			if err := p.Save(8*vg.Inch, 5*vg.Inch, filepath.Join(dir, name+ext)); err != nil {
				return fmt.Errorf("writing plot %s: %w", name+ext, err)
			}
		}
	}
	return nil
}

func safeName(s string) string {
	return strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' {
			return r
		}
		return '_'
	}, s)
}

// cdfPlot draws, per run, the empirical CDF of the values pick takes from successful
// requests.
func cdfPlot(title, xlabel string, rs []*Result, pick func(*Record) []time.Duration) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = xlabel
	p.Y.Label.Text = "fraction of samples"
	p.Y.Min, p.Y.Max = 0, 1
	p.Legend.Top = false
	for i, r := range rs {
		var v []float64
		for _, rec := range r.Records {
			if rec.OK() {
				for _, d := range pick(rec) {
					v = append(v, d.Seconds())
				}
			}
		}
		if len(v) == 0 {
			continue
		}
		slices.Sort(v)
		step := max(1, len(v)/2000) // at most ~2000 points per line
		var pts plotter.XYs
		for j := 0; j < len(v); j += step {
			pts = append(pts, plotter.XY{X: v[j], Y: float64(j+1) / float64(len(v))})
		}
		pts = append(pts, plotter.XY{X: v[len(v)-1], Y: 1})
		l, err := plotter.NewLine(pts)
		if err != nil {
			continue
		}
		l.Color = plotutil.Color(i)
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(r.Label, l)
	}
	p.Add(plotter.NewGrid())
	return p
}

// hitPlot draws the measured and the ideal prefix hit rate of each run.
func hitPlot(rs []*Result) *plot.Plot {
	p := plot.New()
	p.Title.Text = "Prefix cache hit rate"
	p.Y.Label.Text = "cached prompt tokens / prompt tokens"
	p.Y.Min, p.Y.Max = 0, 1
	measured, ideal := make(plotter.Values, len(rs)), make(plotter.Values, len(rs))
	names := make([]string, len(rs))
	for i, r := range rs {
		measured[i], ideal[i], names[i] = r.Summary.HitRate, r.Summary.IdealHitRate, r.Label
	}
	w := vg.Points(18)
	if b, err := plotter.NewBarChart(measured, w); err == nil {
		b.Color = plotutil.Color(0)
		b.Offset = -w / 2
		p.Add(b)
		p.Legend.Add("measured", b)
	}
	if b, err := plotter.NewBarChart(ideal, w); err == nil {
		b.Color = color.Gray{Y: 170}
		b.Offset = w / 2
		p.Add(b)
		p.Legend.Add("ideal (unbounded cache)", b)
	}
	p.Legend.Top = true
	p.NominalX(names...)
	return p
}

// loadPlot draws each worker's requests per time window over the run.
func loadPlot(r *Result) *plot.Plot {
	share := r.Summary.Share
	if len(share) == 0 {
		return nil
	}
	workers := map[string]bool{}
	for _, w := range share {
		for id := range w.Workers {
			workers[id] = true
		}
	}
	ids := make([]string, 0, len(workers))
	for id := range workers {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	p := plot.New()
	p.Title.Text = "Requests per worker over time (" + r.Label + ")"
	p.X.Label.Text = "time since start (s)"
	p.Y.Label.Text = "requests sent in the window"
	for i, id := range ids {
		pts := make(plotter.XYs, len(share))
		for j, w := range share {
			pts[j] = plotter.XY{X: w.Start.Seconds(), Y: float64(w.Workers[id])}
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			continue
		}
		l.Color = plotutil.Color(i)
		l.Dashes = plotutil.Dashes(i / 7)
		p.Add(l)
		p.Legend.Add(id, l)
	}
	p.Add(plotter.NewGrid())
	return p
}

// hitShare is the row value of the measured hit rate over a reference hit rate (0 without one).
func hitShare(ref func(*Summary) float64) func(*Summary) float64 {
	return func(s *Summary) float64 {
		if r := ref(s); r != 0 {
			return s.HitRate / r
		}
		return 0
	}
}
