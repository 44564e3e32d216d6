package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bh "github.com/kvrelay/kvrelay/internal/benchharness"
)

// TestSuiteTable: every workload runs on both kinds with a valid fleet and specs that parse
// (full and --quick), says what it stresses, and the suite holds the rows the issue names.
func TestSuiteTable(t *testing.T) {
	rows := suite()
	t.Chdir(filepath.Join("..", "..")) // the Mooncake trace's path is relative to the repository's root
	if err := checkRows(rows, 1); err != nil {
		t.Fatal(err)
	}
	want := []string{"agentic-shared", "agentic-preambles", "mooncake-load6", "mooncake-load7", "long-context", "bursty", "mixed", "hetero"}
	if got := rowNames(rows); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("rows %v, want %v", got, want)
	}
	for _, r := range rows {
		if len(r.stresses) < 80 {
			t.Errorf("%s: says too little about what it stresses: %q", r.name, r.stresses)
		}
	}
	// The heterogeneous fleet has one engine at half speed and one with half the cache.
	h := rows[7].kinds[bh.EngineKVRelay].fleet
	if h.Overrides[1].Slowdown != 2 || h.Overrides[2].KVScale != 0.5 {
		t.Errorf("hetero overrides %+v", h.Overrides)
	}
	// Mooncake LOAD 6 and 7 keep hack/bench-compare.sh's per-engine load on 4 engines.
	if s := rows[2].kinds[bh.EngineLLMD].speedup; s != 1.5 {
		t.Errorf("LOAD 6 arrival speed-up %g, want 1.5", s)
	}
	if s := rows[3].kinds[bh.EngineKVRelay].speedup; s != 1.75 {
		t.Errorf("LOAD 7 arrival speed-up %g, want 1.75", s)
	}
	// Long contexts feel attention on the kvrelay sim.
	if l := rows[4].kinds[bh.EngineKVRelay].fleet; l.Sim.PrefillAttention <= 0 || l.Sim.DecodeAttention <= 0 {
		t.Errorf("long-context kvrelay fleet without attention terms: %+v", l.Sim)
	}
}

func res(round int, router string, p50, p90, p99, hit float64) *bh.RunResult {
	return &bh.RunResult{Run: round, Workload: "w", Engine: bh.EngineKVRelay, Router: router, OK: 10, Requests: 10,
		TTFTP50: p50, TTFTP90: p90, TTFTP99: p99, HitRate: hit, PickP50: math.NaN()}
}

func TestVersusBest(t *testing.T) {
	rows := []row{{name: "w", stresses: "s", kinds: map[string]kind{bh.EngineKVRelay: {spec: "fixed:requests=2", fleet: bh.DefaultFleet()}}}}
	results := []*bh.RunResult{
		res(1, defaultRouter, 100, 200, 400, 0.9), res(2, defaultRouter, 110, 220, 380, 0.9), res(3, defaultRouter, 90, 210, 390, 0.88),
		// round-robin: worse at p50, best other at p99 and far apart there.
		res(1, bh.RouterRoundRobin, 300, 500, 300, 0.5), res(2, bh.RouterRoundRobin, 330, 520, 310, 0.5), res(3, bh.RouterRoundRobin, 310, 480, 305, 0.5),
		// epp-precise: best other at p50 (overlapping the default's range) and p90, hit rate.
		res(1, bh.RouterEPPPrecise, 120, 240, 500, 0.95), res(2, bh.RouterEPPPrecise, 105, 250, 520, 0.94), res(3, bh.RouterEPPPrecise, 130, 260, 510, 0.96),
	}
	results = append(results, &bh.RunResult{Run: 1, Workload: "w", Engine: bh.EngineKVRelay, Router: bh.RouterLeastRequest, Err: "boom"})
	cells := summarize(rows, []string{bh.EngineKVRelay}, []string{bh.RouterEPPPrecise, bh.RouterRoundRobin, bh.RouterLeastRequest, defaultRouter}, results, 1, false)
	if len(cells) != 1 {
		t.Fatalf("%d cells", len(cells))
	}
	v := cells[0].VsBest
	check := func(key, best string, ratio float64, overlap bool) {
		t.Helper()
		got := v[key]
		if got == nil || got.Best != best || got.Overlap != overlap || got.Ratio.Median == nil || math.Abs(*got.Ratio.Median-ratio) > 1e-9 {
			t.Errorf("%s: %+v, want best %s ratio %v overlap %v", key, got, best, ratio, overlap)
		}
	}
	check("ttft_p50", bh.RouterEPPPrecise, 100.0/120, true)  // rounds: 100/120, 110/105, 90/130 → median 0.833
	check("ttft_p90", bh.RouterEPPPrecise, 200.0/240, false) // 200/240, 220/250, 210/260: 0.833, 0.88, 0.808
	check("ttft_p99", bh.RouterRoundRobin, 390.0/305, false)
	check("hit_rate", bh.RouterEPPPrecise, 0.9/0.95, false) // 0.947, 0.957, 0.917 → median 0.947
	var lr *RouterStats
	for _, r := range cells[0].Routers {
		if r.Router == bh.RouterLeastRequest {
			lr = r
		}
	}
	if lr == nil || lr.FailedRuns != 1 || lr.TTFTP50.N != 0 {
		t.Errorf("least-request's failed run: %+v", lr)
	}
	// NaN figures (no pick samples) marshal as null, not as an error.
	if _, err := json.Marshal(cells); err != nil {
		t.Fatal(err)
	}
	md := (&Summary{DefaultRouter: defaultRouter, Cells: cells}).Markdown(results)
	for _, want := range []string{"vs epp-precise ≈", "vs round-robin |", "FAILED: boom", "**latency-exact**"} {
		if !strings.Contains(md, want) {
			t.Errorf("summary.md lacks %q:\n%s", want, md)
		}
	}
}

// TestResume: a finished run of the same spec, fleet and commit is kept; any difference, a
// failure or a missing summary runs it again.
func TestResume(t *testing.T) {
	dir := t.TempDir()
	r := bh.Run{Round: 1, Workload: "w", Spec: "fixed:requests=2", Engine: bh.EngineKVRelay, Router: bh.RouterRoundRobin,
		Fleet: bh.DefaultFleet(), Dir: filepath.Join(dir, "run")}
	if got, why := loadDone(r, "abc"); got != nil || why != "" {
		t.Fatalf("empty dir: %v, %q", got, why)
	}
	if err := writeRunSpec(r, kind{}, "abc"); err != nil {
		t.Fatal(err)
	}
	if got, why := loadDone(r, "abc"); got != nil || !strings.Contains(why, "did not finish") {
		t.Fatalf("no summary: %v, %q", got, why)
	}
	write := func(rr *bh.RunResult) {
		b, _ := json.Marshal(rr)
		if err := os.WriteFile(filepath.Join(r.Dir, "summary.json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(&bh.RunResult{Run: 1, Router: r.Router, OK: 2, Requests: 2, TTFTP50: 12})
	if got, _ := loadDone(r, "abc"); got == nil || got.TTFTP50 != 12 {
		t.Fatalf("finished run not kept: %+v", got)
	}
	if got, why := loadDone(r, "def"); got != nil || why == "" {
		t.Fatal("a run of another commit was kept")
	}
	other := r
	other.Fleet.Blocks = 2048
	if got, _ := loadDone(other, "abc"); got != nil {
		t.Fatal("a run on other engines was kept")
	}
	other = r
	other.Spec += ",requests=3"
	if got, _ := loadDone(other, "abc"); got != nil {
		t.Fatal("a run of another workload was kept")
	}
	other = r
	other.Seed = 2
	if got, _ := loadDone(other, "abc"); got != nil {
		t.Fatal("a run of another seed was kept")
	}
	write(&bh.RunResult{Run: 1, Router: r.Router, Err: "boom"})
	if got, why := loadDone(r, "abc"); got != nil || why != "it failed" {
		t.Fatalf("failed run: %v, %q", got, why)
	}
	// Running again removes the old summary first.
	write(&bh.RunResult{Run: 1, Router: r.Router, OK: 2, Requests: 2})
	if err := writeRunSpec(r, kind{}, "abc"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(r.Dir, "summary.json")); !os.IsNotExist(err) {
		t.Fatal("a rerun kept the previous summary.json")
	}
}

// TestSeedPerRound: each round has a workload seed of its own, the same for every router and
// workload in it; --same-seed gives every round --seed's.
func TestSeedPerRound(t *testing.T) {
	cfg := &config{rows: suite()}
	cfg.Seed, cfg.Out = 5, t.TempDir()
	rw := cfg.rows[0]
	for round, want := range map[int]uint64{1: 5, 2: 6, 3: 7} {
		for _, router := range []string{bh.RouterRoundRobin, defaultRouter} {
			if got := cfg.runFor(round, rw, bh.EngineKVRelay, router).Seed; got != want {
				t.Errorf("round %d, %s: seed %d, want %d", round, router, got, want)
			}
		}
	}
	cfg.sameSeed = true
	if got := cfg.runFor(3, rw, bh.EngineKVRelay, bh.RouterRoundRobin).Seed; got != 5 {
		t.Errorf("--same-seed, round 3: seed %d, want 5", got)
	}
}

// TestResummarize: --summarize rebuilds the summary from the finished runs of one commit,
// measures the latency model's prediction error after the warm-up on a run's saved
// requests, leaves out unfinished runs, and refuses runs of two commits.
func TestResummarize(t *testing.T) {
	out := t.TempDir()
	rows := suite()[:1]
	cfg := &config{rows: rows, engines: []string{bh.EngineLLMD}, routers: []string{bh.RouterRoundRobin, defaultRouter}, runs: 1}
	cfg.Out, cfg.Seed = out, 1
	prev, _ := json.Marshal(Summary{Versions: map[string]string{"epp": "v9"}, WallS: 60})
	if err := os.WriteFile(filepath.Join(out, "summary.json"), prev, 0o644); err != nil {
		t.Fatal(err)
	}
	finish := func(router string, round int, version string, res *bh.RunResult, requests string) {
		r := cfg.runFor(round, rows[0], bh.EngineLLMD, router)
		if err := writeRunSpec(r, kind{}, version); err != nil {
			t.Fatal(err)
		}
		if res != nil {
			b, _ := json.Marshal(res)
			if err := os.WriteFile(filepath.Join(r.Dir, "summary.json"), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if requests != "" {
			if err := os.WriteFile(filepath.Join(r.Dir, "results.json"), []byte(requests), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	// 20 predicted requests, sent in order: the first two (the warm-up) 10× off, then
	// errors of 0%, 10%, …, 170% (one each).
	var recs []map[string]any
	for i := range 20 {
		pred := 100.0 * float64(1+max(i-2, 0)) / 10
		if i < 2 {
			pred = 1000
		}
		recs = append(recs, map[string]any{"seq": i, "status": 200, "ttft_ns": 100e6, "predicted_ttft_ns": int64(100e6 + pred*1e6 - 10e6)})
	}
	rj, _ := json.Marshal([]map[string]any{{"label": "latency", "records": recs}})
	metrics := string(rj)
	finish(bh.RouterRoundRobin, 1, "abc", &bh.RunResult{Run: 1, Workload: rows[0].name, Engine: bh.EngineLLMD, Router: bh.RouterRoundRobin, OK: 2, Requests: 2, TTFTP50: 100, TTFTP90: 200, TTFTP99: 300, HitRate: 0.5}, "")
	finish(defaultRouter, 1, "abc", &bh.RunResult{Run: 1, Workload: rows[0].name, Engine: bh.EngineLLMD, Router: defaultRouter, OK: 2, Requests: 2, TTFTP50: 90, TTFTP90: 150, TTFTP99: 330, HitRate: 0.6}, metrics)
	finish(defaultRouter, 2, "abc", nil, "") // did not finish
	cfg.results = ""
	if err := cfg.resummarize(); err != nil {
		t.Fatal(err)
	}
	var s Summary
	b, _ := os.ReadFile(filepath.Join(out, "summary.json"))
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	if s.Commit != "abc" || s.Versions["epp"] != "v9" || len(s.Cells) != 1 {
		t.Fatalf("summary %+v", s)
	}
	c := s.Cells[0]
	if v := c.VsBest["ttft_p90"]; v == nil || v.Best != bh.RouterRoundRobin || math.Abs(*v.Ratio.Median-0.75) > 1e-9 {
		t.Fatalf("p90 against the best other: %+v", v)
	}
	for _, r := range c.Routers {
		if r.Router == defaultRouter && (r.Runs != 1 || r.PredErrP50.N != 1 || math.Abs(*r.PredErrP50.Median-0.85) > 1e-9 || math.Abs(*r.PredErrP90.Median-1.53) > 1e-9) {
			t.Fatalf("default router's prediction error: %+v %+v (runs %d)", r.PredErrP50, r.PredErrP90, r.Runs)
		}
	}
	if md, _ := os.ReadFile(filepath.Join(out, "summary.md")); !strings.Contains(string(md), "85.0% / 153.0%") {
		t.Fatalf("summary.md lacks the prediction error:\n%s", md)
	}
	// A finished run of another commit makes the summary ambiguous.
	finish(defaultRouter, 2, "def", &bh.RunResult{Run: 2, Workload: rows[0].name, Engine: bh.EngineLLMD, Router: defaultRouter, OK: 2, Requests: 2}, "")
	if err := cfg.resummarize(); err == nil || !strings.Contains(err.Error(), "2 kvrelay commits") {
		t.Fatalf("runs of two commits: %v", err)
	}
}

// TestWorstCase: each router's worst median against the best router of each cell, and
// where; a router missing from a cell is left out.
func TestWorstCase(t *testing.T) {
	st := func(v float64) JStat { return jstat(bh.Stat{Med: v, Lo: v, Hi: v, N: 1}) }
	r := func(name string, p50, p90, p99 float64) *RouterStats {
		return &RouterStats{Router: name, TTFTP50: st(p50), TTFTP90: st(p90), TTFTP99: st(p99)}
	}
	cells := []*Cell{
		{Workload: "a", Engine: "llmd", Routers: []*RouterStats{r("x", 100, 200, 300), r("y", 150, 180, 600), r("z", 90, 500, 900)}},
		{Workload: "b", Engine: "kvrelay", Routers: []*RouterStats{r("x", 100, 400, 300), r("y", 100, 200, 300)}},
	}
	got := worstCase(cells)
	for _, want := range []string{
		"| x | ×1.11 (a/llmd) | ×2.00 (b/kvrelay) | ×1.00 (a/llmd) |",
		"| y | ×1.67 (a/llmd) | ×1.00 (a/llmd) | ×2.00 (a/llmd) |",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in\n%s", want, got)
		}
	}
	if strings.Contains(got, "| z |") {
		t.Errorf("z ran on one cell of two:\n%s", got)
	}
}
