package bench

import (
	"cmp"
	"encoding/json"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// SLO is what a request must meet to count toward goodput.
type SLO struct {
	// TTFT bounds the time to first token.
	TTFT time.Duration `json:"ttft_ns"`
	// ITL bounds the request's mean gap between tokens (its time per output token after
	// the first).
	ITL time.Duration `json:"itl_ns"`
}

// DefaultSLO is 2 s to first token and 50 ms between tokens.
var DefaultSLO = SLO{TTFT: 2 * time.Second, ITL: 50 * time.Millisecond}

// Dist summarises a latency distribution.
type Dist struct {
	N    int           `json:"n"`
	Mean time.Duration `json:"mean_ns"`
	P50  time.Duration `json:"p50_ns"`
	P90  time.Duration `json:"p90_ns"`
	P99  time.Duration `json:"p99_ns"`
}

func dist(d []time.Duration) Dist {
	if len(d) == 0 {
		return Dist{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	var sum float64
	for _, x := range s {
		sum += float64(x)
	}
	return Dist{N: len(s), Mean: time.Duration(sum / float64(len(s))), P50: quantile(s, .5), P90: quantile(s, .9), P99: quantile(s, .99)}
}

// quantile of sorted values, nearest rank.
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// Summary is a run's figures.
type Summary struct {
	Requests  int            `json:"requests"`
	OK        int            `json:"ok"`
	Failed    map[string]int `json:"failed,omitempty"` // by HTTP status, "error" for no status
	Rejected  int            `json:"rejected"`         // 429: the proxy's admission queue was full
	Wall      time.Duration  `json:"wall_ns"`
	TTFT      Dist           `json:"ttft"`
	ITL       Dist           `json:"itl"`
	E2E       Dist           `json:"e2e"`
	ReqPerSec float64        `json:"requests_per_s"`
	TokPerSec float64        `json:"output_tokens_per_s"`
	// MidRunPerSec is the rate at which requests completed between the first and the last
	// fifth of completions: what the endpoint sustains once warm and before the stream runs
	// dry. ReqPerSec counts the whole run, ramp-up and drain included. It is not the
	// endpoint's capacity when arrivals outrun it: engines busy with prefill chunks then
	// finish decodes in a burst once arrivals stop, and that burst lands mid-run (Mooncake,
	// 131072-block workers: 45.4 requests/s where round-robin's TTFT p50 is already 1.4 s at
	// 23.9 offered). A load sweep (hack/bench-compare.sh capacity) finds capacity.
	MidRunPerSec float64 `json:"mid_run_requests_per_s"`
	// Goodput counts requests that met the SLO; GoodputPerSec is their rate and
	// GoodputShare their share of all requests.
	SLO           SLO     `json:"slo"`
	Goodput       int     `json:"goodput"`
	GoodputPerSec float64 `json:"goodput_per_s"`
	GoodputShare  float64 `json:"goodput_share"`
	// HitRate is Σ cached_tokens / Σ prompt_tokens as the engines reported them;
	// IdealHitRate what an unbounded prefix cache would have reached on the same stream;
	// LRUHitRate, when CacheBlocks (the endpoint's KV cache in blocks, Options.CacheBlocks)
	// is known, what one LRU cache of that size shared by all engines would have reached.
	HitRate      float64 `json:"hit_rate"`
	IdealHitRate float64 `json:"ideal_hit_rate"`
	LRUHitRate   float64 `json:"lru_hit_rate,omitempty"`
	CacheBlocks  int     `json:"cache_blocks,omitempty"`
	// Workers counts requests per worker (x-kvrelay-worker); Share the same per time window.
	Workers map[string]int `json:"workers,omitempty"`
	Share   []Window       `json:"share,omitempty"`
	// Tags splits TTFT by request class (interactive, subagent, …) when the workload tags.
	Tags map[string]Dist `json:"tags,omitempty"`
	// Prediction is how close the proxy's predicted TTFTs (x-kvrelay-route's ttft_ms, under
	// the latency policy) came to the TTFTs measured; nil when no request carried one.
	Prediction *PredictionError `json:"ttft_prediction,omitempty"`
	// Breakdown splits TTFT into each request's own prefill and its wait, with the floor
	// that routing can approach, when the engines' step-time model is known (bench compare
	// in mode agg; see Breakdown).
	Breakdown *Breakdown `json:"ttft_breakdown,omitempty"`
	// Engines is the number of simulated engines `bench compare` ran (0 for `bench run`), and
	// EngineStall the share of their time they lost running behind their modelled step
	// clocks (sim.Engine.Stalled): the host did not give them the CPU that the engine speedup
	// asks for. Every latency of such a run is inflated by it.
	Engines     int     `json:"engines,omitempty"`
	EngineStall float64 `json:"engine_stall,omitempty"`
	// Tiers are the simulated engines' KV totals when they run tiers below the GPU or a
	// non-default eviction (bench compare only).
	Tiers *TierSummary `json:"kv_tiers,omitempty"`
}

// TierSummary is where a run's cached prompt tokens came from and what the disk tier moved,
// from the engines' own counts.
type TierSummary struct {
	// Setup names the tiers ("G1+G2(32768) worm").
	Setup string `json:"setup"`
	// HitGPU, HitCPU and HitDisk are the shares of prompt tokens found cached in each tier,
	// HitPeer those pulled from a peer; Uncached the prompt tokens computed.
	HitGPU   float64 `json:"hit_gpu"`
	HitCPU   float64 `json:"hit_cpu"`
	HitDisk  float64 `json:"hit_disk"`
	HitPeer  float64 `json:"hit_peer,omitempty"`
	Uncached int64   `json:"uncached_tokens"`
	// DiskWritten and DiskRead are the bytes the disk tier's files took and gave back
	// (the modelled bytes × --kv-bytes-scale).
	DiskWritten int64 `json:"disk_written_bytes"`
	DiskRead    int64 `json:"disk_read_bytes"`
	// Peer fetches by outcome: the prefix pulled, its leading blocks pulled and the rest
	// computed for want of free blocks, computed after the holder failed or held nothing,
	// computed for want of free blocks.
	FetchPulled   int64 `json:"peer_fetch_pulled,omitempty"`
	FetchPartial  int64 `json:"peer_fetch_partial,omitempty"`
	FetchFallback int64 `json:"peer_fetch_fallback,omitempty"`
	FetchNoRoom   int64 `json:"peer_fetch_no_room,omitempty"`
	// OnboardSkipped is the host and disk hit blocks computed for want of GPU room.
	OnboardSkipped int64 `json:"onboard_skipped_blocks,omitempty"`
}

// StallWarning is the share of engine time lost past which a run's latencies say more about
// the host than about routing.
const StallWarning = 0.02

// Window is the requests each worker received in one time window.
type Window struct {
	Start   time.Duration  `json:"start_ns"`
	Workers map[string]int `json:"workers"`
}

// Summarize computes a run's figures from its records.
func Summarize(recs []*Record, wall time.Duration, slo SLO) Summary {
	s := Summary{Requests: len(recs), Wall: wall, SLO: slo, Failed: map[string]int{}, Workers: map[string]int{}}
	var ttft, itl, e2e, ends []time.Duration
	tags := map[string][]time.Duration{}
	var out, prompt, cached int64
	for _, r := range recs {
		if !r.OK() {
			key := strconv.Itoa(r.Status)
			if r.Status == 0 || r.Status == 200 {
				key = "error"
			}
			s.Failed[key]++
			if r.Status == 429 {
				s.Rejected++
			}
			continue
		}
		s.OK++
		ends = append(ends, r.Start+r.E2E)
		ttft = append(ttft, r.TTFT)
		itl = append(itl, r.ITL...)
		e2e = append(e2e, r.E2E)
		if r.Tag != "" {
			tags[r.Tag] = append(tags[r.Tag], r.TTFT)
		}
		out += int64(r.CompletionTokens)
		prompt += int64(r.PromptTokens)
		cached += int64(r.CachedTokens)
		if r.Worker != "" {
			s.Workers[r.Worker]++
		}
		if meetsSLO(r, slo) {
			s.Goodput++
		}
	}
	s.TTFT, s.ITL, s.E2E = dist(ttft), dist(itl), dist(e2e)
	s.MidRunPerSec = midRunRate(ends)
	if sec := wall.Seconds(); sec > 0 {
		s.ReqPerSec = float64(s.OK) / sec
		s.TokPerSec = float64(out) / sec
		s.GoodputPerSec = float64(s.Goodput) / sec
	}
	if s.Requests > 0 {
		s.GoodputShare = float64(s.Goodput) / float64(s.Requests)
	}
	if prompt > 0 {
		s.HitRate = float64(cached) / float64(prompt)
	}
	if len(tags) > 1 {
		s.Tags = map[string]Dist{}
		for k, v := range tags {
			s.Tags[k] = dist(v)
		}
	}
	s.Share = shareOverTime(recs, wall)
	s.Prediction = predictionError(recs)
	if len(s.Failed) == 0 {
		s.Failed = nil
	}
	if len(s.Workers) == 0 {
		s.Workers = nil
	}
	return s
}

// PredictionError compares predicted and measured TTFTs: the median relative error
// |measured − predicted| / measured over the first tenth of the requests that carried a
// prediction (Cold: the models still learning) and over the rest (Warm), and the share of
// predictions below the measured TTFT.
type PredictionError struct {
	Requests int     `json:"requests"`
	Cold     float64 `json:"median_relative_error_first_tenth"`
	Warm     float64 `json:"median_relative_error_rest"`
	Under    float64 `json:"share_under"`
}

// predictedTTFT reads the predicted TTFT off an x-kvrelay-route header ("…; ttft_ms=41.2"),
// 0 when it has none.
func predictedTTFT(route string) time.Duration {
	_, v, ok := strings.Cut(route, "ttft_ms=")
	if !ok {
		return 0
	}
	v, _, _ = strings.Cut(v, ";")
	ms, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err != nil || !(ms > 0) || ms > 1e9 {
		return 0
	}
	return time.Duration(ms * float64(time.Millisecond))
}

// predictionError compares each successful request's predicted TTFT with its measured one,
// in send order; nil when none has a prediction. The prediction counts from the proxy's
// dispatch and the measured TTFT from the client's send, so it includes the proxy's own
// time (well under a millisecond with a local tokenizer).
func predictionError(recs []*Record) *PredictionError {
	type pair struct {
		start     time.Duration
		rel       float64
		predUnder bool
	}
	var ps []pair
	for _, r := range recs {
		if !r.OK() || r.TTFT <= 0 || r.PredictedTTFT <= 0 {
			continue
		}
		got, pred := float64(r.TTFT), float64(r.PredictedTTFT)
		ps = append(ps, pair{start: r.Start, rel: math.Abs(got-pred) / got, predUnder: pred < got})
	}
	if len(ps) == 0 {
		return nil
	}
	slices.SortFunc(ps, func(a, b pair) int { return cmp.Compare(a.start, b.start) })
	median := func(p []pair) float64 {
		if len(p) == 0 {
			return math.NaN()
		}
		v := make([]float64, len(p))
		for i := range p {
			v[i] = p[i].rel
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	cut := max(1, len(ps)/10)
	under := 0
	for _, p := range ps {
		if p.predUnder {
			under++
		}
	}
	return &PredictionError{Requests: len(ps), Cold: median(ps[:cut]), Warm: median(ps[cut:]), Under: float64(under) / float64(len(ps))}
}

// midRunRate is the completions per second between the completion times that end the first
// fifth and start the last fifth of ends (unsorted), or 0 with fewer than 10 completions.
func midRunRate(ends []time.Duration) float64 {
	n := len(ends)
	if n < 10 {
		return 0
	}
	slices.Sort(ends)
	lo, hi := n/5, n-1-n/5
	if sec := (ends[hi] - ends[lo]).Seconds(); sec > 0 {
		return float64(hi-lo) / sec
	}
	return 0
}

// meetsSLO: a successful request whose TTFT and mean inter-token gap are within the SLO.
func meetsSLO(r *Record, slo SLO) bool {
	if r.TTFT > slo.TTFT {
		return false
	}
	if len(r.ITL) == 0 {
		return true
	}
	var sum time.Duration
	for _, g := range r.ITL {
		sum += g
	}
	return sum/time.Duration(len(r.ITL)) <= slo.ITL
}

// shareOverTime buckets requests by send time into about 20 windows, counting per worker.
func shareOverTime(recs []*Record, wall time.Duration) []Window {
	if wall <= 0 {
		return nil
	}
	step := max(wall/20, time.Millisecond)
	n := int(wall/step) + 1
	ws := make([]Window, n)
	any := false
	for i := range ws {
		ws[i] = Window{Start: time.Duration(i) * step, Workers: map[string]int{}}
	}
	for _, r := range recs {
		if r.Worker == "" {
			continue
		}
		any = true
		ws[min(int(r.Start/step), n-1)].Workers[r.Worker]++
	}
	if !any {
		return nil
	}
	return ws
}

// IdealHitRate replays the run's prompts and answers, in send order, through an unbounded
// shared prefix cache (workload.Ideal) and returns its hit rate. Like HitBounds, it sets each
// counted record's IdealCached.
func IdealHitRate(recs []*Record, codec *tokenizer.Codec, blockSize int) float64 {
	ideal, _ := HitBounds(recs, codec, blockSize, 0)
	return ideal
}

// HitBounds replays the run's successful prompts and answers, in send order, through an
// unbounded shared prefix cache and, when cacheBlocks > 0, through one LRU cache of
// cacheBlocks blocks (workload.NewLRU), and returns both hit rates (lru is 0 without a size).
// It sets each counted record's IdealCached.
func HitBounds(recs []*Record, codec *tokenizer.Codec, blockSize, cacheBlocks int) (ideal, lru float64) {
	sorted := slices.Clone(recs)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Seq < sorted[j].Seq })
	caches := []*workload.Ideal{workload.NewIdeal(blockSize)}
	if cacheBlocks > 0 {
		caches = append(caches, workload.NewLRU(blockSize, cacheBlocks))
	}
	for _, r := range sorted {
		if r.req == nil || !r.OK() {
			continue
		}
		var prompt []uint32
		if r.req.Chat {
			var err error
			prompt, err = codec.EncodeChat(chatMessages(r.req.Messages), tokenizer.RenderOptions{AddGenerationPrompt: true})
			if err != nil {
				continue
			}
		} else {
			prompt = codec.EncodePrompt(r.req.Prompt)
		}
		answer := codec.Tokenizer.Encode(r.answer)
		r.IdealCached = caches[0].Add(prompt, answer)
		for _, c := range caches[1:] {
			c.Add(prompt, answer)
		}
	}
	ideal = caches[0].HitRate()
	if len(caches) > 1 {
		lru = caches[1].HitRate()
	}
	return ideal, lru
}

// chatMessages converts workload messages for the chat template.
func chatMessages(ms []workload.Message) []tokenizer.Message {
	out := make([]tokenizer.Message, len(ms))
	for i, m := range ms {
		out[i] = tokenizer.Message{Role: m.Role, Content: m.Content, Name: m.Name, ToolCallID: m.ToolCallID}
		for _, tc := range m.ToolCalls {
			b, _ := json.Marshal(tc)
			var call tokenizer.ToolCall
			_ = json.Unmarshal(b, &call)
			out[i].ToolCalls = append(out[i].ToolCalls, call)
		}
	}
	return out
}
