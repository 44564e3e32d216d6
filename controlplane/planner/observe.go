package planner

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/engines"
)

// WorkerLister lists the fleet's workers: the control plane's registry.
type WorkerLister interface {
	Workers() []registry.Worker
}

// Metric names the observer reads: vLLM's, which the simulated engine exports too.
const (
	metricRequests = "vllm:request_success_total"
	metricPrompt   = "vllm:prompt_tokens_total"
	metricOutput   = "vllm:generation_tokens_total"
	metricTTFT     = "vllm:time_to_first_token_seconds"
	metricITL      = "vllm:inter_token_latency_seconds"
	metricTPOT     = "vllm:time_per_output_token_seconds" // older vLLM's name for the ITL
	metricRunning  = "vllm:num_requests_running"
	metricWaiting  = "vllm:num_requests_waiting"
	metricKVUsage  = "vllm:kv_cache_usage_perc"
	metricReqISL   = "vllm:request_prompt_tokens"     // histogram of finished requests' prompt lengths
	metricReqOSL   = "vllm:request_generation_tokens" // and of their output lengths
)

// MetricsObserver observes the fleet by scraping every registered worker's Prometheus
// metrics (vLLM's names) and differencing its counters between calls. A worker seen for the
// first time only sets its baseline (but what it holds, and has finished, counts as
// arrived: it is new to the fleet). Arrivals are the finished requests plus the growth of
// the running and waiting gauges. It is safe for one caller at a time.
type MetricsObserver struct {
	Workers WorkerLister
	// Client makes the scrapes (default: a client with a 2 s timeout).
	Client *http.Client
	// Now stamps observations (default time.Now).
	Now func() time.Time

	mu     sync.Mutex
	prev   map[string]workerCounters
	prevAt time.Time
}

type workerCounters struct {
	requests, prompt, output float64
	ttftSum, ttftCount       float64
	itlSum, itlCount         float64
	islSum, oslSum, lenCount float64
	running, waiting         int
	kvUsage                  float64
}

func (c workerCounters) minus(p workerCounters) workerCounters {
	d := func(a, b float64) float64 { return max(0, a-b) } // a restarted engine counts from 0
	return workerCounters{
		requests: d(c.requests, p.requests), prompt: d(c.prompt, p.prompt), output: d(c.output, p.output),
		ttftSum: d(c.ttftSum, p.ttftSum), ttftCount: d(c.ttftCount, p.ttftCount),
		itlSum: d(c.itlSum, p.itlSum), itlCount: d(c.itlCount, p.itlCount),
		islSum: d(c.islSum, p.islSum), oslSum: d(c.oslSum, p.oslSum), lenCount: d(c.lenCount, p.lenCount),
	}
}

// Observe scrapes every worker concurrently; workers that fail to answer are left out of this
// observation (and keep their baseline).
func (m *MetricsObserver) Observe(ctx context.Context) (Observation, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now
	if m.Now != nil {
		now = m.Now
	}
	client := m.Client
	if client == nil {
		client = &http.Client{Timeout: 2 * time.Second}
	}
	ws := m.Workers.Workers()
	got := make([]workerCounters, len(ws))
	errs := make([]error, len(ws))
	var wg sync.WaitGroup
	for i, w := range ws {
		wg.Go(func() { got[i], errs[i] = scrapeWorker(ctx, client, w) })
	}
	wg.Wait()
	at := now()
	o := Observation{At: at}
	if !m.prevAt.IsZero() {
		o.Window = at.Sub(m.prevAt)
	}
	next := map[string]workerCounters{}
	hasPrefill := false
	for _, w := range ws {
		if w.Role == registry.RolePrefill {
			hasPrefill = true
		}
	}
	failed := 0
	for i, w := range ws {
		if errs[i] != nil {
			failed++
			if p, ok := m.prev[w.ID]; ok {
				next[w.ID] = p
			}
			continue
		}
		c := got[i]
		next[w.ID] = c
		wl := WorkerLoad{ID: w.ID, Pool: Pool(w.Role), Draining: w.Draining, Running: c.running, Waiting: c.waiting, KVUsage: c.kvUsage}
		if wl.Pool == "" {
			wl.Pool = PoolBoth
		}
		inflight := float64(c.running + c.waiting)
		p, seen := m.prev[w.ID]
		switch {
		case seen && wl.Pool != PoolPrefill:
			o.Arrivals += max(0, c.requests-p.requests) + inflight - float64(p.running+p.waiting)
		case seen:
			// Prefill workers' finished requests go on to decode: only their queues count.
			o.Arrivals += inflight - float64(p.running+p.waiting)
		case !m.prevAt.IsZero() && wl.Pool != PoolPrefill:
			o.Arrivals += c.requests + inflight
		case !m.prevAt.IsZero():
			o.Arrivals += inflight
		}
		if seen {
			d := c.minus(p)
			if d.ttftCount > 0 {
				wl.TTFT = time.Duration(d.ttftSum / d.ttftCount * float64(time.Second))
			}
			if d.itlCount > 0 {
				wl.ITL = time.Duration(d.itlSum / d.itlCount * float64(time.Second))
			}
			if wl.Pool != PoolPrefill {
				o.Requests += d.requests
				o.PromptTokens += d.prompt
				o.OutputTokens += d.output
				o.PromptLenSum += d.islSum
				o.OutputLenSum += d.oslSum
				o.LenCount += d.lenCount
				o.ITLSum += d.itlSum
				o.ITLCount += d.itlCount
			}
			if !hasPrefill || wl.Pool == PoolPrefill {
				o.TTFTSum += d.ttftSum
				o.TTFTCount += d.ttftCount
			}
		}
		o.Workers = append(o.Workers, wl)
	}
	o.Arrivals = max(0, o.Arrivals)
	m.prev, m.prevAt = next, at
	if failed == len(ws) && failed > 0 {
		return o, fmt.Errorf("observing the fleet: every one of %d workers failed to answer: %w", failed, errs[0])
	}
	return o, nil
}

func scrapeWorker(ctx context.Context, client *http.Client, w registry.Worker) (workerCounters, error) {
	url := w.Metrics
	if url == "" {
		url = strings.TrimSuffix(w.URL, "/") + "/metrics"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return workerCounters{}, fmt.Errorf("scraping %s: %w", w.ID, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return workerCounters{}, fmt.Errorf("scraping %s: %w", w.ID, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return workerCounters{}, fmt.Errorf("scraping %s: %s", w.ID, resp.Status)
	}
	fams, err := engines.ParseFamilies(resp.Body, metricRequests, metricPrompt, metricOutput, metricTTFT, metricITL, metricTPOT, metricRunning, metricWaiting, metricKVUsage, metricReqISL, metricReqOSL)
	if err != nil {
		return workerCounters{}, fmt.Errorf("scraping %s: %w", w.ID, err)
	}
	var c workerCounters
	sum := func(name string) float64 { v, _ := engines.Sum(fams[name], nil); return v }
	c.requests = sum(metricRequests)
	c.prompt = sum(metricPrompt)
	c.output = sum(metricOutput)
	c.running = engines.Count(sum(metricRunning))
	c.waiting = engines.Count(sum(metricWaiting))
	c.kvUsage = engines.Fraction(sum(metricKVUsage))
	c.ttftSum, c.ttftCount = histSum(fams[metricTTFT])
	c.itlSum, c.itlCount = histSum(fams[metricITL])
	c.islSum, c.lenCount = histSum(fams[metricReqISL])
	if c.oslSum, _ = histSum(fams[metricReqOSL]); c.oslSum == 0 {
		c.lenCount = 0 // without both, the token counters stand in
	}
	if c.itlCount == 0 {
		c.itlSum, c.itlCount = histSum(fams[metricTPOT])
	}
	return c, nil
}

func histSum(f *dto.MetricFamily) (sum, count float64) {
	for _, m := range f.GetMetric() {
		if h := m.GetHistogram(); h != nil {
			sum += h.GetSampleSum()
			count += float64(h.GetSampleCount())
		}
	}
	return sum, count
}

var _ Observer = (*MetricsObserver)(nil)
