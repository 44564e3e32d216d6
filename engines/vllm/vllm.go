package vllm

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

// vLLM's metric names (vllm/v1/metrics/loggers.py). Every sample carries model_name and, since
// V1, engine (the data-parallel rank); counts are summed over engines, usage averaged.
const (
	MetricRunning = "vllm:num_requests_running"
	MetricWaiting = "vllm:num_requests_waiting"
	// MetricKVUsage is the fraction (not a percentage, despite the name) of KV cache blocks
	// in use; vLLM before V1 called it MetricGPUCacheUsage.
	MetricKVUsage       = "vllm:kv_cache_usage_perc"
	MetricGPUCacheUsage = "vllm:gpu_cache_usage_perc"
	// MetricCacheConfig is an info gauge whose labels carry the cache configuration:
	// block_size and num_gpu_blocks (per engine).
	MetricCacheConfig = "vllm:cache_config_info"
)

var families = []string{MetricRunning, MetricWaiting, MetricKVUsage, MetricGPUCacheUsage, MetricCacheConfig}

// Engine is the adapter for vLLM and for kvrelay's simulated engine. It is stateless.
type Engine struct{ kind engines.Kind }

// New returns the vLLM adapter.
func New() *Engine { return &Engine{kind: engines.KindVLLM} }

// NewSim returns the adapter for kvrelay's simulated engine: vLLM's, under the sim kind.
func NewSim() *Engine { return &Engine{kind: engines.KindSim} }

// Kind is vllm or sim.
func (e *Engine) Kind() engines.Kind { return e.kind }

// MetricsPath is /metrics.
func (e *Engine) MetricsPath() string { return "/metrics" }

// HealthPath is /health.
func (e *Engine) HealthPath() string { return "/health" }

// ParseLoad reads vLLM's exposition.
func (e *Engine) ParseLoad(r io.Reader) (engines.Load, error) {
	fams, err := engines.ParseFamilies(r, families...)
	if err != nil {
		return engines.Load{}, fmt.Errorf("reading vllm load: %w", err)
	}
	return LoadFrom(fams)
}

// LoadFrom reads a load out of parsed families (ParseFamilies' result).
func LoadFrom(fams map[string]*dto.MetricFamily) (engines.Load, error) {
	var l engines.Load
	if v, n := engines.Sum(fams[MetricRunning], nil); n > 0 {
		l.Running, l.Found = engines.Count(v), l.Found|engines.FieldRunning
	}
	if v, n := engines.Sum(fams[MetricWaiting], nil); n > 0 {
		l.Waiting, l.Found = engines.Count(v), l.Found|engines.FieldWaiting
	}
	usage, ok := engines.Mean(fams[MetricKVUsage], nil)
	if !ok {
		usage, ok = engines.Mean(fams[MetricGPUCacheUsage], nil)
	}
	if ok {
		l.KVUsage, l.Found = engines.Fraction(usage), l.Found|engines.FieldKVUsage
	}
	if l.Found == 0 {
		return engines.Load{}, fmt.Errorf("reading vllm load: %w (want %s, %s, %s)",
			engines.ErrNoLoadMetrics, MetricRunning, MetricWaiting, MetricKVUsage)
	}
	cacheConfig(fams[MetricCacheConfig], &l)
	return l, nil
}

// cacheConfig reads block_size (the first engine's) and num_gpu_blocks (summed over engines)
// off the cache config info gauge.
func cacheConfig(f *dto.MetricFamily, l *engines.Load) {
	blocks := 0
	for _, m := range f.GetMetric() {
		if bs := positive(engines.Label(m, "block_size")); bs > 0 && l.BlockSize == 0 {
			l.BlockSize, l.Found = bs, l.Found|engines.FieldBlockSize
		}
		if n := positive(engines.Label(m, "num_gpu_blocks")); n > 0 {
			blocks += n
			l.Found |= engines.FieldCapacityBlocks
		}
	}
	if blocks > 0 {
		l.CapacityBlocks = blocks
		if l.BlockSize > 0 && blocks <= (1<<31-1)/l.BlockSize {
			l.CapacityTokens, l.Found = blocks*l.BlockSize, l.Found|engines.FieldCapacityTokens
		}
	}
}

// positive parses a label value as a positive int; 0 when it is not one.
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

// KVEvents: vLLM binds tcp://*:5557 by default (--kv-events-config endpoint) with topic "",
// and encodes events as maps since vLLM 0.2x (arrays before; both decode).
func (e *Engine) KVEvents() engines.KVEventDefaults {
	return engines.KVEventDefaults{
		Supported:   true,
		Port:        5557,
		EngineBinds: true,
		Format:      kvevents.FormatMap,
	}
}

var _ engines.Engine = (*Engine)(nil)
