package sim

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are a worker's Prometheus metrics under vLLM's names and labels, so that scrapers
// written for vLLM (kvrelay's control plane among them) read a simulated worker unchanged.
// Every method is safe for concurrent use and a nil *Metrics records nothing.
type Metrics struct {
	reg *prometheus.Registry

	running, waiting, usage prometheus.Gauge
	queries, hits           prometheus.Counter
	promptTokens, genTokens prometheus.Counter
	preemptions             prometheus.Counter
	success                 *prometheus.CounterVec
	aborts                  prometheus.Counter
	ttft, itl, e2e          prometheus.Histogram
	reqPrompt, reqGen       prometheus.Histogram
}

// Bucket boundaries as vLLM defines them.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets  = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	e2eBuckets  = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
)

// NewMetrics registers a worker's metrics, labelled with the model name, in a registry of its
// own (so several workers can share a process).
func NewMetrics(cfg Config) *Metrics {
	reg := prometheus.NewRegistry()
	labels := prometheus.Labels{"model_name": cfg.Model, "engine": "0"}
	f := factory{reg: reg, labels: labels}
	m := &Metrics{
		reg:          reg,
		running:      f.gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
		waiting:      f.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
		usage:        f.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
		queries:      f.counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."),
		hits:         f.counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
		promptTokens: f.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
		genTokens:    f.counter("vllm:generation_tokens_total", "Number of generation tokens processed."),
		preemptions:  f.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
		aborts:       f.counter("vllm:request_abort_total", "Number of requests aborted before they finished."),
		ttft:         f.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets),
		itl:          f.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itlBuckets),
		e2e:          f.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e2eBuckets),
		reqPrompt:    f.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokenBuckets(cfg.MaxModelLen)),
		reqGen:       f.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", tokenBuckets(cfg.MaxModelLen)),
	}
	m.success = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm:request_success_total", Help: "Count of successfully processed requests.", ConstLabels: labels,
	}, []string{"finished_reason"})
	reg.MustRegister(m.success)
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "vllm:cache_config_info", Help: "Information of the LLMEngine CacheConfig",
		ConstLabels: prometheus.Labels{
			"block_size":            strconv.Itoa(cfg.BlockSize),
			"num_gpu_blocks":        strconv.Itoa(cfg.NumGPUBlocks),
			"enable_prefix_caching": strconv.FormatBool(cfg.EnablePrefixCaching),
			"cache_dtype":           "auto",
			"engine":                "0",
		},
	})
	info.Set(1)
	reg.MustRegister(info)
	return m
}

// Registry is what /metrics serves.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

type factory struct {
	reg    *prometheus.Registry
	labels prometheus.Labels
}

func (f factory) gauge(name, help string) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: f.labels})
	f.reg.MustRegister(g)
	return g
}

func (f factory) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: f.labels})
	f.reg.MustRegister(c)
	return c
}

func (f factory) histogram(name, help string, buckets []float64) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: f.labels, Buckets: buckets})
	f.reg.MustRegister(h)
	return h
}

// tokenBuckets are vLLM's 1-2-5 series up to the model length.
func tokenBuckets(maxLen int) []float64 {
	var b []float64
	for exp := 1.0; ; exp *= 10 {
		for _, m := range []float64{1, 2, 5} {
			v := m * exp
			if v > float64(maxLen) {
				return b
			}
			b = append(b, v)
		}
	}
}

func (m *Metrics) load(running, waiting int, usage float64) {
	if m == nil {
		return
	}
	m.running.Set(float64(running))
	m.waiting.Set(float64(waiting))
	m.usage.Set(usage)
}

func (m *Metrics) admitted(prompt, cached int) {
	if m == nil {
		return
	}
	m.queries.Add(float64(prompt))
	m.hits.Add(float64(cached))
	m.promptTokens.Add(float64(prompt))
}

func (m *Metrics) step(generated int) {
	if m == nil || generated == 0 {
		return
	}
	m.genTokens.Add(float64(generated))
}

func (m *Metrics) firstToken(d time.Duration) {
	if m != nil {
		m.ttft.Observe(d.Seconds())
	}
}

func (m *Metrics) interToken(d time.Duration) {
	if m != nil {
		m.itl.Observe(d.Seconds())
	}
}

func (m *Metrics) preempted() {
	if m != nil {
		m.preemptions.Inc()
	}
}

func (m *Metrics) aborted() {
	if m != nil {
		m.aborts.Inc()
	}
}

func (m *Metrics) finished(r *Request, now time.Time) {
	if m == nil {
		return
	}
	m.e2e.Observe(now.Sub(r.arrival).Seconds())
	m.reqPrompt.Observe(float64(r.promptLen))
	m.reqGen.Observe(float64(len(r.tokens) - r.promptLen))
	m.success.WithLabelValues(string(r.reason)).Inc()
}
