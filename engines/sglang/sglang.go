package sglang

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// SGLang's metric names (python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector),
// served at /metrics when the server runs with --enable-metrics.
const (
	MetricRunning = "sglang:num_running_reqs"
	MetricWaiting = "sglang:num_queue_reqs"
	// MetricTokenUsage is the fraction of the KV pool's tokens in use.
	MetricTokenUsage = "sglang:token_usage"
	// MetricPageSize and MetricNumPages are the KV pool's page (block) size in tokens and
	// its size in pages, as gauges (SGLang 0.5.11 and later).
	MetricPageSize = "sglang:page_size"
	MetricNumPages = "sglang:num_pages"
	// MetricCacheConfig carries the same as labels page_size and num_pages (earlier
	// versions).
	MetricCacheConfig = "sglang:cache_config_info"
	// MetricMaxTotalTokens is the KV pool's size in tokens.
	MetricMaxTotalTokens = "sglang:max_total_num_tokens"
)

var families = []string{MetricRunning, MetricWaiting, MetricTokenUsage, MetricPageSize, MetricNumPages,
	MetricCacheConfig, MetricMaxTotalTokens}

// Engine is the SGLang adapter. It is stateless.
type Engine struct{}

// New returns the SGLang adapter.
func New() *Engine { return &Engine{} }

// Kind is sglang.
func (e *Engine) Kind() engines.Kind { return engines.KindSGLang }

// MetricsPath is /metrics.
func (e *Engine) MetricsPath() string { return "/metrics" }

// HealthPath is /health.
func (e *Engine) HealthPath() string { return "/health" }

// ParseLoad reads SGLang's exposition.
func (e *Engine) ParseLoad(r io.Reader) (engines.Load, error) {
	fams, err := engines.ParseFamilies(r, families...)
	if err != nil {
		return engines.Load{}, fmt.Errorf("reading sglang load: %w", err)
	}
	return LoadFrom(fams)
}

// primary keeps one scheduler's samples per data-parallel rank: every tensor- and
// pipeline-parallel rank of a scheduler may export the same gauges (labels tp_rank, pp_rank),
// and rank 0 speaks for them. Samples without those labels are kept.
func primary(m *dto.Metric) bool {
	tp, pp := engines.Label(m, "tp_rank"), engines.Label(m, "pp_rank")
	return (tp == "" || tp == "0") && (pp == "" || pp == "0")
}

// LoadFrom reads a load out of parsed families (ParseFamilies' result). Counts and
// capacities add up over data-parallel ranks, usage is their mean.
func LoadFrom(fams map[string]*dto.MetricFamily) (engines.Load, error) {
	var l engines.Load
	if v, n := engines.Sum(fams[MetricRunning], primary); n > 0 {
		l.Running, l.Found = engines.Count(v), l.Found|engines.FieldRunning
	}
	if v, n := engines.Sum(fams[MetricWaiting], primary); n > 0 {
		l.Waiting, l.Found = engines.Count(v), l.Found|engines.FieldWaiting
	}
	if v, ok := engines.Mean(fams[MetricTokenUsage], primary); ok {
		l.KVUsage, l.Found = engines.Fraction(v), l.Found|engines.FieldKVUsage
	}
	if l.Found == 0 {
		return engines.Load{}, fmt.Errorf("reading sglang load: %w (want %s, %s, %s)",
			engines.ErrNoLoadMetrics, MetricRunning, MetricWaiting, MetricTokenUsage)
	}
	capacity(fams, &l)
	return l, nil
}

func capacity(fams map[string]*dto.MetricFamily, l *engines.Load) {
	pageSize, pages := 0, 0
	if v, ok := engines.Mean(fams[MetricPageSize], primary); ok {
		pageSize = engines.Count(v)
	}
	if v, n := engines.Sum(fams[MetricNumPages], primary); n > 0 {
		pages = engines.Count(v)
	}
	for _, m := range fams[MetricCacheConfig].GetMetric() {
		if !primary(m) {
			continue
		}
		if pageSize == 0 {
			pageSize = positive(engines.Label(m, "page_size"))
		}
		if _, ok := fams[MetricNumPages]; !ok {
			pages += positive(engines.Label(m, "num_pages"))
		}
	}
	tokens := 0
	if v, n := engines.Sum(fams[MetricMaxTotalTokens], primary); n > 0 {
		tokens = engines.Count(v)
	}
	if pageSize > 0 && pageSize <= 1<<20 {
		l.BlockSize, l.Found = pageSize, l.Found|engines.FieldBlockSize
	}
	switch {
	case pages > 0:
		l.CapacityBlocks, l.Found = pages, l.Found|engines.FieldCapacityBlocks
	case tokens > 0 && l.BlockSize > 0:
		l.CapacityBlocks, l.Found = tokens/l.BlockSize, l.Found|engines.FieldCapacityBlocks
	}
	switch {
	case tokens > 0:
		l.CapacityTokens, l.Found = tokens, l.Found|engines.FieldCapacityTokens
	case l.CapacityBlocks > 0 && l.BlockSize > 0 && l.CapacityBlocks <= (1<<31-1)/l.BlockSize:
		l.CapacityTokens, l.Found = l.CapacityBlocks*l.BlockSize, l.Found|engines.FieldCapacityTokens
	}
}

func positive(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 || n > 1<<30 {
		return 0
	}
	return n
}

// DiscoverModel reads /v1/models.
func (e *Engine) DiscoverModel(ctx context.Context, client *http.Client, baseURL string) (engines.Model, error) {
	return engines.DiscoverOpenAIModel(ctx, client, baseURL)
}

// KVEvents: SGLang's --kv-events-config follows vLLM's (publisher zmq, endpoint tcp://*:5557
// bound by the engine, topic ""), with events encoded as tagged arrays, and token ids sent
// as bigram pairs under EAGLE speculative decoding.
func (e *Engine) KVEvents() engines.KVEventDefaults {
	return engines.KVEventDefaults{
		Supported:    true,
		Port:         5557,
		EngineBinds:  true,
		Format:       kvevents.FormatArray,
		BigramTokens: true,
	}
}

var _ engines.Engine = (*Engine)(nil)
