package bench

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

func ms(n float64) time.Duration { return time.Duration(n * float64(time.Millisecond)) }

// A synthetic timeline: ten requests with known latencies, two failures.
func syntheticRecords() []*Record {
	var recs []*Record
	for i := range 10 {
		r := &Record{
			Seq: i, Start: time.Duration(i) * 100 * time.Millisecond, Status: 200,
			TTFT: ms(float64(100 * (i + 1))), E2E: ms(float64(1000 + 100*i)),
			PromptTokens: 1000, CachedTokens: 100 * i, CompletionTokens: 50,
			Worker: []string{"w0", "w1"}[i%2], Tag: []string{"interactive", "subagent"}[i%2],
		}
		// Every request streams gaps of 10 ms, except request 9's 100 ms gaps.
		gap := ms(10)
		if i == 9 {
			gap = ms(100)
		}
		for range 4 {
			r.ITL = append(r.ITL, gap)
		}
		recs = append(recs, r)
	}
	recs = append(recs, &Record{Seq: 10, Status: 429, Err: "queue full"}, &Record{Seq: 11, Status: 200, Err: "stream error: engine died"})
	return recs
}

// A run that warms up slowly, completes 10 requests per second for 6 s and drains slowly
// sustains 10 per second, however long its ramps take.
func TestMidRunRate(t *testing.T) {
	var ends []time.Duration
	for i := range 20 { // ramp-up: one completion every 2 s
		ends = append(ends, time.Duration(i)*2*time.Second)
	}
	for i := range 61 { // steady: one every 100 ms from 40 s to 46 s
		ends = append(ends, 40*time.Second+time.Duration(i)*100*time.Millisecond)
	}
	for i := range 20 { // drain: one every 5 s
		ends = append(ends, 50*time.Second+time.Duration(i)*5*time.Second)
	}
	slices.Reverse(ends) // midRunRate sorts
	// 101 completions: the 21st (40 s) to the 81st (46 s), 60 in 6 s.
	if got := midRunRate(ends); math.Abs(got-10) > 1e-9 {
		t.Errorf("midRunRate = %v, want 10", got)
	}
	if got := midRunRate(ends[:9]); got != 0 {
		t.Errorf("midRunRate of 9 completions = %v, want 0", got)
	}
	same := make([]time.Duration, 20) // all at once: no rate to tell
	if got := midRunRate(same); got != 0 {
		t.Errorf("midRunRate of simultaneous completions = %v, want 0", got)
	}
	if got := Summarize(nil, time.Second, SLO{}).MidRunPerSec; got != 0 {
		t.Errorf("empty run: mid-run rate %v", got)
	}
}

func TestSummarizeSyntheticTimeline(t *testing.T) {
	s := Summarize(syntheticRecords(), 2*time.Second, SLO{TTFT: 500 * time.Millisecond, ITL: 50 * time.Millisecond})
	check := func(name string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-9 {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	check("requests", float64(s.Requests), 12)
	check("ok", float64(s.OK), 10)
	check("rejected", float64(s.Rejected), 1)
	if s.Failed["429"] != 1 || s.Failed["error"] != 1 {
		t.Errorf("failed %v", s.Failed)
	}
	// TTFTs are 100..1000 ms: nearest-rank p50 is the 5th, p90 the 9th, p99 the 10th.
	check("ttft p50", s.TTFT.P50.Seconds(), 0.5)
	check("ttft p90", s.TTFT.P90.Seconds(), 0.9)
	check("ttft p99", s.TTFT.P99.Seconds(), 1.0)
	check("ttft mean", s.TTFT.Mean.Seconds(), 0.55)
	check("itl p50", s.ITL.P50.Seconds(), 0.010)
	check("itl p99", s.ITL.P99.Seconds(), 0.100)
	check("e2e p50", s.E2E.P50.Seconds(), 1.4)
	// Goodput: TTFT ≤ 500 ms (requests 0-4) and mean gap ≤ 50 ms (all but 9).
	check("goodput", float64(s.Goodput), 5)
	check("goodput share", s.GoodputShare, 5.0/12)
	check("goodput/s", s.GoodputPerSec, 2.5)
	check("req/s", s.ReqPerSec, 5)
	// Completions at 1.0, 1.2, …, 2.8 s: the 3rd (1.4 s) to the 8th (2.4 s) is 5 in 1 s.
	check("mid-run req/s", s.MidRunPerSec, 5)
	check("tok/s", s.TokPerSec, 250)
	// Cached 0+100+…+900 = 4500 of 10000 prompt tokens.
	check("hit rate", s.HitRate, 0.45)
	if s.Workers["w0"] != 5 || s.Workers["w1"] != 5 {
		t.Errorf("workers %v", s.Workers)
	}
	total := 0
	for _, w := range s.Share {
		for _, n := range w.Workers {
			total += n
		}
	}
	if total != 10 || len(s.Share) < 20 {
		t.Errorf("share windows %d with %d requests", len(s.Share), total)
	}
	if s.Tags["interactive"].N != 5 || s.Tags["subagent"].P50 != ms(600) {
		t.Errorf("tags %+v", s.Tags)
	}
}

func TestReadStream(t *testing.T) {
	stream := strings.Join([]string{
		`data: {"choices":[{"delta":{"role":"assistant","content":""}}]}`, ``,
		`data: {"choices":[{"delta":{"reasoning_content":"think"}}]}`, ``,
		`data: {"choices":[{"delta":{"content":" hello"}}]}`, ``,
		`: keep-alive comment`, ``,
		`data: {"choices":[{"delta":{"content":" world"}}]}`, ``,
		`data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}`, ``,
		`data: [DONE]`, ``,
	}, "\n")
	var rec Record
	readStream(strings.NewReader(stream), time.Now(), &rec)
	if rec.Err != "" || rec.TTFT <= 0 || len(rec.ITL) != 2 {
		t.Fatalf("record %+v", rec)
	}
	if rec.PromptTokens != 12 || rec.CachedTokens != 8 || rec.CompletionTokens != 3 || rec.answer != "think hello world" {
		t.Fatalf("usage %+v answer %q", rec, rec.answer)
	}
	var bad Record
	readStream(strings.NewReader("data: {\"error\":{\"message\":\"engine died\"}}\n\ndata: [DONE]\n\n"), time.Now(), &bad)
	if !strings.Contains(bad.Err, "engine died") {
		t.Fatalf("stream error not recorded: %+v", bad)
	}
}

func TestTableRatios(t *testing.T) {
	a := &Result{Label: "kv", Summary: Summary{OK: 10, TTFT: Dist{P50: ms(100)}, HitRate: 0.8, IdealHitRate: 0.9}}
	b := &Result{Label: "round-robin", Summary: Summary{OK: 10, TTFT: Dist{P50: ms(300)}, HitRate: 0.4, IdealHitRate: 0.9}}
	tab := Table([]*Result{a, b})
	for _, want := range []string{"| TTFT p50 | 100.0 ms | 300.0 ms | 3.00 |", "| prefix hit rate | 80.0% | 40.0% | 0.50 |", "| hit rate / ideal | 88.9% | 44.4% | 0.50 |"} {
		if !strings.Contains(tab, want) {
			t.Errorf("table lacks %q:\n%s", want, tab)
		}
	}
	if strings.Contains(tab, "shared-LRU") {
		t.Errorf("LRU bound rows without a cache size:\n%s", tab)
	}
	a.Summary.CacheBlocks, a.Summary.LRUHitRate = 4096, 0.85
	b.Summary.CacheBlocks, b.Summary.LRUHitRate = 4096, 0.85
	tab = Table([]*Result{a, b})
	for _, want := range []string{"| cache (blocks) | 4096 | 4096 | 1.00 |", "| shared-LRU hit rate | 85.0% | 85.0% | 1.00 |", "| hit rate / shared LRU | 94.1% | 47.1% | 0.50 |"} {
		if !strings.Contains(tab, want) {
			t.Errorf("table lacks %q:\n%s", want, tab)
		}
	}
	if strings.Contains(tab, "engine stall") || StallWarnings([]*Result{a, b}) != "" {
		t.Errorf("engine stall without simulated engines:\n%s", tab)
	}
	a.Summary.Engines, a.Summary.EngineStall = 8, 0.001
	b.Summary.Engines, b.Summary.EngineStall = 8, 0.05
	if tab = Table([]*Result{a, b}); !strings.Contains(tab, "| engine stall | 0.1% | 5.0% | 50.00 |") {
		t.Errorf("table lacks the engine stall row:\n%s", tab)
	}
	if w := StallWarnings([]*Result{a, b}); strings.Count(w, "\n") != 1 || !strings.Contains(w, "round-robin") || !strings.Contains(w, "5.0%") {
		t.Errorf("stall warnings %q, want one line for round-robin's 5.0%%", w)
	}
}

func TestPrefillModel(t *testing.T) {
	m := PrefillModel{Timing: sim.DefaultTiming(), ChunkTokens: 8192}
	tm := m.Timing
	for _, c := range []struct {
		tokens int
		want   float64 // ms
	}{
		{0, 0},
		{-3, 0},
		{1, tm.PrefillMS(1)},
		{6400, tm.PrefillMS(6400)},
		{8192, tm.PrefillMS(8192)},
		// Full chunks first, as a chunked-prefill scheduler takes them.
		{10000, tm.PrefillMS(8192) + tm.PrefillMS(1808)},
		{20000, 2*tm.PrefillMS(8192) + tm.PrefillMS(3616)},
	} {
		if got := m.Time(c.tokens); math.Abs(float64(got)-c.want*1e6) > 1 {
			t.Errorf("Time(%d) = %v, want %v", c.tokens, got, ms(c.want))
		}
	}
	if got, want := m.Time(6400), ms(130.9); got < want-ms(0.1) || got > want+ms(0.1) {
		t.Errorf("6400 tokens: %v, want ~%v (16.5 ms + 15.2 µs a token + the quadratic term)", got, want)
	}
	if got := (PrefillModel{Timing: tm}).Time(20000); math.Abs(float64(got)-tm.PrefillMS(20000)*1e6) > 1 {
		t.Errorf("no chunk limit: %v, want one step of %v ms", got, tm.PrefillMS(20000))
	}
}

// TestBreakdown splits synthetic TTFTs into own prefill and wait under a linear model (1 ms a
// token, no constant), so the figures are exact.
func TestBreakdown(t *testing.T) {
	m := PrefillModel{Timing: sim.Timing{PrefillB: 1}, ChunkTokens: 1000}
	recs := []*Record{
		// 100 uncached tokens, 150 ms: 100 own, 50 waiting; the ideal cache held 20 more.
		{Status: 200, PromptTokens: 300, CachedTokens: 200, IdealCached: 220, TTFT: ms(150)},
		// 300 uncached, 320 ms: 20 waiting; the ideal cache held nothing more.
		{Status: 200, PromptTokens: 300, CachedTokens: 0, IdealCached: 0, TTFT: ms(320)},
		// 250 uncached but the engine ran ahead of its model: no wait, not a negative one.
		{Status: 200, PromptTokens: 250, CachedTokens: 0, IdealCached: 240, TTFT: ms(240)},
		// Not counted by the ideal replay: its floor takes the engine's hits.
		{Status: 200, PromptTokens: 500, CachedTokens: 300, TTFT: ms(1000)},
		// Block-aligned and all cached by the ideal (block size 16): its last block is left.
		{Status: 200, PromptTokens: 64, CachedTokens: 0, IdealCached: 48, TTFT: ms(100)},
		// The engine held more than the ideal replay (it took the requests in another
		// order): the floor takes the engine's hits.
		{Status: 200, PromptTokens: 400, CachedTokens: 380, IdealCached: 300, TTFT: ms(50)},
		// Failures do not count.
		{Status: 500, PromptTokens: 9000, TTFT: ms(1)},
		{Status: 200, Err: "stream error", PromptTokens: 9000, TTFT: ms(1)},
	}
	b := NewBreakdown(recs, m)
	if b == nil {
		t.Fatal("no breakdown")
	}
	sorted := func(d Dist) []time.Duration { return []time.Duration{d.P50, d.P90} }
	// own: 100, 300, 250, 200, 64, 20; wait: 50, 20, 0, 800, 36, 30;
	// floor: 80, 300, 10, 200, 16, 20.
	for _, c := range []struct {
		name string
		got  Dist
		n    int
		mean time.Duration
		want []time.Duration
	}{
		{"prefill", b.Prefill, 6, ms(934.0 / 6), []time.Duration{ms(100), ms(300)}},
		{"wait", b.Wait, 6, ms(936.0 / 6), []time.Duration{ms(30), ms(800)}},
		{"floor", b.Floor, 6, ms(626.0 / 6), []time.Duration{ms(20), ms(300)}},
	} {
		if c.got.N != c.n || !slices.Equal(sorted(c.got), c.want) || (c.got.Mean-c.mean).Abs() > time.Microsecond {
			t.Errorf("%s: %+v, want n %d mean %v p50/p90 %v", c.name, c.got, c.n, c.mean, c.want)
		}
	}
	if NewBreakdown(recs[6:], m) != nil {
		t.Error("a breakdown of failures alone")
	}
	tab := Table([]*Result{{Label: "kv", Summary: Summary{Breakdown: b}}, {Label: "round-robin"}})
	// A run without a breakdown (another cluster mode) shows none, rather than zeros.
	for _, want := range []string{"| own prefill p50 | 100.0 ms | – | – |", "| wait to first token p50 | 30.0 ms |", "| TTFT floor p50 | 20.0 ms |"} {
		if !strings.Contains(tab, want) {
			t.Errorf("table lacks %q:\n%s", want, tab)
		}
	}
	if strings.Contains(Table([]*Result{{Label: "kv"}}), "own prefill") {
		t.Error("breakdown rows without a breakdown")
	}
	tab = Table([]*Result{{Label: "disagg"}, {Label: "agg", Summary: Summary{Breakdown: b}}})
	if want := "| own prefill p50 | – | 100.0 ms | – |"; !strings.Contains(tab, want) {
		t.Errorf("table lacks %q:\n%s", want, tab)
	}
}

// TestShortCompare runs bench compare end to end at high speedup: two policies, a fresh
// local cluster each, the identical stream, results written. One client sends the stream
// (concurrency 1), so that which worker a request finds idle or busy, and so where a
// load-aware policy sends it, does not depend on how fast a loaded machine serves the ones
// before it.
func TestShortCompare(t *testing.T) {
	tok, err := tokenizer.New("o200k_harmony")
	if err != nil {
		t.Fatal(err)
	}
	cc := DefaultClusterConfig()
	cc.Workers, cc.NumGPUBlocks = 2, 2048
	co := CompareOptions{
		Workload: "prefix-groups:groups=3,prompt=256,user=16,requests=24,rate=10,osl=8",
		Seed:     3, Policies: []string{"kv", "round-robin"}, Cluster: cc,
		Run: Options{Speedup: 10, Concurrency: 1}, SLO: DefaultSLO,
	}
	rs, err := Compare(context.Background(), co, tok)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 {
		t.Fatalf("%d results", len(rs))
	}
	for _, r := range rs {
		s := r.Summary
		if s.OK != 24 || s.HitRate <= 0 || s.IdealHitRate < s.HitRate || len(s.Workers) == 0 ||
			s.CacheBlocks != 2*2048 || s.LRUHitRate <= 0 || s.LRUHitRate > s.IdealHitRate ||
			s.Engines != 2 || s.EngineStall < 0 || s.EngineStall >= 1 {
			t.Fatalf("%s: %+v", r.Label, s)
		}
	}
	for _, r := range rs {
		b := r.Summary.Breakdown
		if b == nil || b.Prefill.N != 24 || b.Floor.P50 > b.Prefill.P50 || b.Floor.Mean > b.Prefill.Mean {
			t.Fatalf("%s: TTFT breakdown %+v", r.Label, b)
		}
		ideal := 0
		for _, rec := range r.Records {
			ideal += rec.IdealCached
		}
		if ideal == 0 {
			t.Errorf("%s: no request has ideal cached tokens", r.Label)
		}
	}
	// Three prefix groups on two workers: kv keeps each group on the worker the proxy placed
	// its first request on (its own record of the placement, before any KV event), where
	// round-robin computes each group's prefix once on each worker.
	t.Logf("hit rate kv %.2f round-robin %.2f", rs[0].Summary.HitRate, rs[1].Summary.HitRate)
	if rs[0].Summary.HitRate <= rs[1].Summary.HitRate {
		t.Errorf("kv hit rate %.2f below round-robin's %.2f", rs[0].Summary.HitRate, rs[1].Summary.HitRate)
	}
	dir := t.TempDir()
	if err := Write(dir, rs, "test"); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"results.json", "results.md", "ttft_cdf.png", "ttft_cdf.svg", "itl_cdf.png", "hit_rate.svg", "worker_load_kv.png"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s missing: %v", f, err)
		}
	}
}

func TestSessionsAndConcurrency(t *testing.T) {
	tok, _ := tokenizer.New("o200k_harmony")
	cc := DefaultClusterConfig()
	cc.Workers, cc.NumGPUBlocks, cc.Speedup = 2, 4096, 100
	cl, err := StartCluster(context.Background(), cc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	w, err := workload.Parse("multi-turn:sessions=3,turns=3,system=128,user=16,osl=8,think=10ms", 1, tok)
	if err != nil {
		t.Fatal(err)
	}
	recs, _, err := Run(context.Background(), Options{Target: cl.Target(), Speedup: 100, Concurrency: 2}, w)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 9 {
		t.Fatalf("%d requests, want 3 sessions × 3 turns", len(recs))
	}
	for _, r := range recs {
		if !r.OK() || r.Session == "" {
			t.Fatalf("record %+v", r)
		}
	}
	// Later turns extend the session's history: the engine finds it cached.
	cachedLater := 0
	for _, r := range recs {
		if r.CachedTokens > 0 {
			cachedLater++
		}
	}
	if cachedLater < 6 {
		t.Errorf("only %d of 9 turns found their history cached", cachedLater)
	}
}

func TestScaleTimes(t *testing.T) {
	recs := []*Record{{Start: time.Second, TTFT: 100 * time.Millisecond, E2E: time.Second, ITL: []time.Duration{10 * time.Millisecond, 20 * time.Millisecond}}}
	if wall := scaleTimes(recs, 3*time.Second, 2); wall != 6*time.Second {
		t.Fatalf("wall = %v", wall)
	}
	r := recs[0]
	if r.Start != 2*time.Second || r.TTFT != 200*time.Millisecond || r.E2E != 2*time.Second || r.ITL[0] != 20*time.Millisecond || r.ITL[1] != 40*time.Millisecond {
		t.Fatalf("scaled %+v", r)
	}
	// A request meeting a 150 ms TTFT SLO in compressed time misses it in the engines' own.
	s := Summarize(recs, 6*time.Second, SLO{TTFT: 150 * time.Millisecond, ITL: 50 * time.Millisecond})
	if s.Goodput != 0 {
		t.Fatalf("goodput %d after scaling, want 0", s.Goodput)
	}
}

func TestPredictionError(t *testing.T) {
	ms := time.Millisecond
	var recs []*Record
	for i := range 20 {
		// The first two predictions are 3x off, the rest 10% under the measured 100 ms.
		route := "cost; overlap=3; best=3; ttft_ms=90.0"
		if i < 2 {
			route = "cost; overlap=0; best=0; ttft_ms=300"
		}
		recs = append(recs, &Record{Status: 200, Start: time.Duration(i) * ms, TTFT: 100 * ms, PredictedTTFT: predictedTTFT(route)})
	}
	recs = append(recs, &Record{Status: 200, TTFT: 50 * ms, PredictedTTFT: predictedTTFT("cost; overlap=0; best=0")},
		&Record{Status: 500, PredictedTTFT: predictedTTFT("x; ttft_ms=1")})
	// Times scaled to the engines' own clock scale the prediction alike.
	scaleTimes(recs, time.Second, 0.5)
	p := predictionError(recs)
	if p == nil || p.Requests != 20 || math.Abs(p.Cold-2) > 1e-9 || math.Abs(p.Warm-0.1) > 1e-9 || p.Under != 0.9 {
		t.Fatalf("prediction error %+v", p)
	}
	if predictionError(recs[20:21]) != nil {
		t.Fatal("records without predictions gave a prediction error")
	}
}
