package benchharness

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench"
	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// Run names one run: which round, workload, engines and router, and where its files go.
type Run struct {
	// Round is the round the run belongs to (1…).
	Round int
	// Workload names the workload in the results (a suite row; "" for a harness with one).
	Workload string
	// Spec is the `kvrelay bench` workload spec.
	Spec string
	// Speedup divides the workload's arrival and think times (bench.Options.Speedup; 0 is 1).
	Speedup float64
	// Engine is the engine kind, Router the router.
	Engine, Router string
	// Fleet describes the engines.
	Fleet Fleet
	// Dir holds the run's logs, metrics and raw results.
	Dir string
	// Seed seeds the run's workload (0: Config.Seed).
	Seed uint64
}

// seedOf is the seed run's workload is generated with.
func (cfg *Config) seedOf(run Run) uint64 {
	if run.Seed != 0 {
		return run.Seed
	}
	return cfg.Seed
}

// RunResult is what one run of one router on one engine kind measured. Times in ms.
type RunResult struct {
	Run      int    `json:"run"`
	Seed     uint64 `json:"seed,omitempty"` // the workload's
	Workload string `json:"workload,omitempty"`
	Engine   string `json:"engine"`
	Router   string `json:"router"`
	Err      string `json:"error,omitempty"`

	Requests int            `json:"requests"`
	OK       int            `json:"ok"`
	Failed   map[string]int `json:"failed,omitempty"`
	WallS    float64        `json:"wall_s"`

	TTFTP50 float64 `json:"ttft_p50_ms"`
	TTFTP90 float64 `json:"ttft_p90_ms"`
	TTFTP99 float64 `json:"ttft_p99_ms"`
	E2EP50  float64 `json:"e2e_p50_ms"`

	HitRate      float64 `json:"hit_rate"`       // Σ cached / Σ prompt tokens, from usage
	IdealHitRate float64 `json:"ideal_hit_rate"` // one unbounded cache shared by all engines
	LRUHitRate   float64 `json:"lru_hit_rate"`   // one LRU of the fleet's blocks

	PerEngine []int `json:"per_engine"` // requests answered by each engine, e1, e2, …
	Unknown   int   `json:"unknown_worker,omitempty"`

	// PickP50 is the router's decision time per request, tokenization included, measured on
	// the client side of the routing hop: the gateway's ext_proc request phase (EPP, kvrelay
	// epp), or kvrelay_proxy_decision_seconds{stage="total"} (kvrelay proxy, in process).
	PickP50     float64 `json:"pick_p50_ms"`
	PickSamples int     `json:"pick_samples"`
	PickSource  string  `json:"pick_source"`
	// Hop is the hop the router adds between client and engine.
	Hop string `json:"hop"`

	FloorP50 float64 `json:"ttft_floor_p50_ms"` // the engines' own prefill under ideal caching, no wait

	Routed string             `json:"routed,omitempty"` // kvrelay_proxy_routed_requests_total by mode
	Extra  map[string]float64 `json:"extra,omitempty"`
	Notes  []string           `json:"notes,omitempty"`
}

// RunOne brings up a fresh stack for run, replays the workload against it, and tears it
// down. A failure is recorded in the result's Err, never returned.
func RunOne(ctx context.Context, cfg *Config, run Run, logw io.Writer) *RunResult {
	engine, router := run.Engine, run.Router
	seed := cfg.seedOf(run)
	rr := &RunResult{Run: run.Round, Seed: seed, Workload: run.Workload, Engine: engine, Router: router, Hop: RouterHop(router), Extra: map[string]float64{}}
	if len(cfg.PolicyArgs) > 0 && !isBaseline(router) && !IsEPP(router) {
		rr.Notes = append(rr.Notes, "policy flags: "+strings.Join(cfg.PolicyArgs, " "))
	}
	if len(cfg.ProxyArgs) > 0 && !isBaseline(router) && !IsEPP(router) {
		rr.Notes = append(rr.Notes, "proxy flags: "+strings.Join(cfg.ProxyArgs, " "))
	}
	if err := run.Fleet.Validate(); err != nil {
		rr.Err = err.Error()
		return rr
	}
	dir := run.Dir
	if err := os.MkdirAll(dir, 0o755); err != nil {
		rr.Err = err.Error()
		return rr
	}
	defer procs.stopAll(10 * time.Second)

	p := newPorts(cfg.PortBase, run.Fleet.Engines)
	if err := waitPortsFree(ctx, p.all(), 60*time.Second); err != nil {
		rr.Err = err.Error()
		return rr
	}
	s := &stack{cfg: cfg, fleet: run.Fleet, engine: engine, router: router, dir: dir, p: p}
	if err := s.up(ctx); err != nil {
		rr.Err = "starting: " + err.Error()
		return rr
	}

	tok, err := benchTokenizer(cfg.Model)
	if err != nil {
		rr.Err = err.Error()
		return rr
	}
	w, err := workload.Parse(run.Spec, seed, tok)
	if err != nil {
		rr.Err = err.Error()
		return rr
	}
	label := fmt.Sprintf("run %d %s/%s", run.Round, engine, router)
	if run.Workload != "" {
		label = fmt.Sprintf("run %d %s %s/%s", run.Round, run.Workload, engine, router)
	}
	target := "http://" + addr(p.router) + "/v1"
	opts := bench.Options{
		Target: target, Model: cfg.Model, CacheBlocks: run.Fleet.TotalBlocks(),
		RequestTimeout: cfg.RequestTimeout, Speedup: run.Speedup,
		Progress: bench.NewProgress(logw, label, len(w.Open)),
	}
	rctx, cancel := context.WithTimeout(ctx, cfg.RunTimeout)
	res, err := bench.Measure(rctx, router, opts, w, seed, bench.DefaultSLO, run.Fleet.BlockSize)
	cancel()
	opts.Progress.Stop()
	if err != nil {
		rr.Err = "bench: " + err.Error()
		return rr
	}

	// Scrape the routers before anything stops.
	rr.Notes = append(rr.Notes, procs.dead()...)
	s.collect(rr)
	var engineCPU, routerCPU float64
	for _, p := range procs.stopAll(10 * time.Second) {
		if strings.HasPrefix(p.name, "engine-") {
			engineCPU += p.cpuSeconds()
		} else {
			routerCPU += p.cpuSeconds()
		}
	}
	// The router's CPU time over the whole run: EPP, gateway and render sidecar, or the proxy
	// and control plane. On a small host every process competes with the others.
	rr.Extra["cpu_router_s"] = routerCPU
	rr.Extra["cpu_engines_s"] = engineCPU

	if engine == EngineLLMD {
		// Count the ideal in the simulator's own (dummy) tokens.
		base, _ := tokenizer.New(tokenizer.O200kBase)
		res.Summary.IdealHitRate, res.Summary.LRUHitRate = bench.HitBounds(res.Records, newLLMDCodec(base), run.Fleet.BlockSize, opts.CacheBlocks)
	}
	name := cfg.Name
	if name == "" {
		name = "benchharness"
	}
	header := fmt.Sprintf("kvrelay %s: %s; %s against %s (seed %d)", name, label, w.Spec, target, seed)
	if err := bench.Write(dir, []*bench.Result{res}, header); err != nil {
		rr.Notes = append(rr.Notes, "writing results: "+err.Error())
	}
	summarize(rr, res, s, run.Fleet)
	if b, err := json.MarshalIndent(rr, "", "  "); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "summary.json"), b, 0o644)
	}
	return rr
}

// benchTokenizer is the tokenizer the workload sizes its texts with: kvrelay's default for
// the model (o200k_base for Qwen, as `kvrelay bench run` picks it).
func benchTokenizer(model string) (tokenizer.Tokenizer, error) {
	spec, _ := tokenizer.ModelSpecs(model)
	return tokenizer.New(spec)
}

// summarize fills rr from the bench result.
func summarize(rr *RunResult, res *bench.Result, s *stack, fleet Fleet) {
	sum := res.Summary
	rr.Requests, rr.OK, rr.Failed = sum.Requests, sum.OK, sum.Failed
	rr.WallS = sum.Wall.Seconds()
	rr.TTFTP50, rr.TTFTP90, rr.TTFTP99 = ms(sum.TTFT.P50), ms(sum.TTFT.P90), ms(sum.TTFT.P99)
	rr.E2EP50 = ms(sum.E2E.P50)
	rr.HitRate, rr.IdealHitRate, rr.LRUHitRate = sum.HitRate, sum.IdealHitRate, sum.LRUHitRate
	rr.PerEngine = make([]int, fleet.Engines)
	for _, r := range res.Records {
		if !r.OK() {
			continue
		}
		if i := s.engineIndex(r.Worker); i >= 0 {
			rr.PerEngine[i]++
		} else {
			rr.Unknown++
		}
	}
	predictionError(res.Records, rr.Extra)
	if rr.Unknown > 0 {
		rr.Notes = append(rr.Notes, fmt.Sprintf("%d successful requests without a known x-kvrelay-worker", rr.Unknown))
	}
	if sum.Rejected > 0 {
		rr.Notes = append(rr.Notes, fmt.Sprintf("%d requests rejected with 429", sum.Rejected))
	}

	// TTFT floor: each successful request's own prefill on an idle full-speed engine with
	// what the ideal cache (or, where more, the engine) held, no queue, no load factor.
	var floor []float64
	for _, r := range res.Records {
		if !r.OK() {
			continue
		}
		cached := min(max(r.CachedTokens, r.IdealCached), r.PromptTokens)
		floor = append(floor, fleet.FloorMS(rr.Engine, r.PromptTokens-cached, cached))
	}
	// Nearest rank, as kvrelay bench takes the TTFT percentiles: each request's floor is at
	// most its TTFT, so the floor's p50 is at most the TTFT p50 on any number of requests.
	rr.FloorP50 = NearestRank(floor, 0.5)
}

// engineIndex maps an x-kvrelay-worker value (a kvrelay worker id, or the gateway's
// ip:port) to the engine's index.
func (s *stack) engineIndex(worker string) int {
	for i, port := range s.p.engines {
		if worker == s.engineID(i) || worker == addr(port) || strings.HasSuffix(worker, fmt.Sprintf(":%d", port)) {
			return i
		}
	}
	return -1
}

// collect reads the routers' decision times and counters after the run, and keeps their
// metrics in the run's directory.
func (s *stack) collect(rr *RunResult) {
	if BehindGateway(s.router) {
		var picks struct {
			PickNS []int64 `json:"pick_ns"`
		}
		if resp, err := httpClient.Get(s.gatewayPicks); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			_ = os.WriteFile(filepath.Join(s.dir, "gateway-picks.json"), b, 0o644)
			_ = json.Unmarshal(b, &picks)
		}
		ds := make([]float64, len(picks.PickNS))
		for i, ns := range picks.PickNS {
			ds[i] = float64(ns) / 1e6
		}
		rr.PickP50, rr.PickSamples = Quantile(ds, 0.5), len(ds)
		if len(ds) > 0 {
			var sum float64
			for _, d := range ds {
				sum += d
			}
			rr.Extra["pick_mean_ms"] = sum / float64(len(ds))
		}
		rr.PickSource = PickPoint(s.router)
		fams := saveScrape(s.routerMetrics, filepath.Join(s.dir, "epp-metrics.txt"))
		if IsKEPP(s.router) {
			saveGet("http://"+addr(s.p.eppMetrics)+"/debug/latency", filepath.Join(s.dir, "proxy-latency-model.json"))
			if sum, n := histSumCount(fams, "kvrelay_epp_pick_seconds", nil); n > 0 {
				rr.Extra["kvrelay_epp_pick_mean_ms"] = sum / float64(n) * 1e3
			}
			rr.Routed = routedByMode(fams)
			return
		}
		// Means (sum / count): these histograms' lowest buckets (0.1 ms, 5 ms) hold nearly
		// every observation, so their interpolated quantiles say little.
		if n := findFamily(fams, "llm_d_epp_scheduler_e2e_duration_seconds", "scheduler_e2e_duration_seconds"); n != "" {
			if sum, c := histSumCount(fams, n, nil); c > 0 {
				rr.Extra["epp_scheduler_e2e_mean_ms"] = sum / float64(c) * 1e3
			}
		}
		if n := findFamily(fams, "llm_d_epp_kv_cache_index_lookup_latency_seconds", "kv_cache_index_lookup_latency_seconds"); n != "" {
			if sum, c := histSumCount(fams, n, nil); c > 0 {
				rr.Extra["epp_index_lookup_mean_ms"] = sum / float64(c) * 1e3
			}
		}
		if n := findFamily(fams, "llm_d_epp_kv_cache_events_messages_received_total", "kv_cache_events_messages_received_total"); n != "" {
			v, _ := gaugeSum(fams, n)
			rr.Extra["epp_kv_event_messages"] = v
		}
		if n := findFamily(fams, "llm_d_epp_kv_cache_index_admissions_total", "kv_cache_index_admissions_total"); n != "" {
			v, _ := gaugeSum(fams, n)
			rr.Extra["epp_index_admissions"] = v
		}
		return
	}
	fams := saveScrape(s.routerMetrics, filepath.Join(s.dir, "proxy-metrics.txt"))
	saveGet("http://"+addr(s.p.gatewayAdmin)+"/debug/latency", filepath.Join(s.dir, "proxy-latency-model.json"))
	const dec = "kvrelay_proxy_decision_seconds"
	q, c := histQuantile(fams, dec, map[string]string{"stage": "total"}, 0.5)
	rr.PickP50, rr.PickSamples = q*1e3, int(c)
	rr.PickSource = PickPoint(s.router)
	if sum, n := histSumCount(fams, dec, map[string]string{"stage": "total"}); n > 0 {
		rr.Extra["pick_mean_ms"] = sum / float64(n) * 1e3
	}
	if q, c := histQuantile(fams, dec, map[string]string{"stage": "tokenize"}, 0.5); c > 0 {
		rr.Extra["proxy_tokenize_p50_ms"] = q * 1e3
	}
	if q, c := histQuantile(fams, dec, map[string]string{"stage": "index"}, 0.5); c > 0 {
		rr.Extra["proxy_index_query_p50_ms"] = q * 1e3
	}
	if v, ok := gaugeSum(fams, "kvrelay_proxy_remote_tokenize_failures_total"); ok && v > 0 {
		rr.Extra["proxy_remote_tokenize_failures"] = v
		rr.Notes = append(rr.Notes, fmt.Sprintf("%.0f prompts the engines' /tokenize could not tokenize (routed on a text estimate)", v))
	}
	if v, ok := gaugeSum(fams, "kvrelay_proxy_xds_replica_blocks"); ok {
		rr.Extra["proxy_replica_blocks"] = v
	}
	for name, key := range map[string]string{"kvrelay_proxy_xds_index_queries_total": "proxy_index_queries",
		"kvrelay_proxy_xds_index_query_failures_total": "proxy_index_query_failures",
		"kvrelay_proxy_xds_index_unasked_total":        "proxy_index_unasked",
		"kvrelay_proxy_xds_index_query_bytes_total":    "proxy_index_query_bytes"} {
		if v, ok := gaugeSum(fams, name); ok {
			rr.Extra[key] = v
		}
	}
	if v := rr.Extra["proxy_index_query_failures"]; v > 0 {
		rr.Notes = append(rr.Notes, fmt.Sprintf("%.0f index queries failed or came late (their prompts routed as uncached)", v))
	}
	if s.cpMetrics != "" {
		cf := saveScrape(s.cpMetrics, filepath.Join(s.dir, "controlplane-metrics.txt"))
		if v, ok := gaugeSum(cf, "kvrelay_controlplane_ingest_unclaimed_total"); ok && v > 0 {
			rr.Extra["cp_unclaimed_kv_event_messages"] = v
			rr.Notes = append(rr.Notes, fmt.Sprintf("control plane dropped %.0f KV event messages of unclaimed topics", v))
		}
	}
	rr.Routed = routedByMode(fams)
}

// routedByMode summarises kvrelay_proxy_routed_requests_total by mode.
func routedByMode(fams map[string]*dto.MetricFamily) string {
	f, ok := fams["kvrelay_proxy_routed_requests_total"]
	if !ok {
		return ""
	}
	by := map[string]float64{}
	for _, m := range f.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "mode" {
				by[l.GetValue()] += m.GetCounter().GetValue()
			}
		}
	}
	var parts []string
	for k, v := range by {
		parts = append(parts, fmt.Sprintf("%s=%.0f", k, v))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// NearestRank is the q-quantile of xs by nearest rank (kvrelay bench's definition); NaN
// for none.
func NearestRank(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// Quantile is the q-quantile of xs by linear interpolation; NaN for none.
func Quantile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	pos := q * float64(len(s)-1)
	lo := int(math.Floor(pos))
	hi := min(lo+1, len(s)-1)
	return s[lo] + (s[hi]-s[lo])*(pos-float64(lo))
}
