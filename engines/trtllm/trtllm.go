package trtllm

import (
	"context"
	"fmt"
	"io"
	"net/http"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrelay/kvrelay/engines"
)

// trtllm-serve's Prometheus names (tensorrt_llm/metrics/collector.py, served at
// /prometheus/metrics; the iteration gauges need iteration stats enabled).
const (
	MetricRunning       = "trtllm_num_requests_running"
	MetricWaiting       = "trtllm_num_requests_waiting"
	MetricKVUtilization = "trtllm_kv_cache_utilization"
	MetricTokensPerBlk  = "trtllm_kv_cache_tokens_per_block"
	MetricMaxBlocks     = "trtllm_kv_cache_max_blocks"
	MetricUsedBlocks    = "trtllm_kv_cache_used_blocks"
)

// The Triton TensorRT-LLM backend's families (custom_metrics_reporter.cc, on Triton's
// metrics port), each a gauge told apart by a label.
const (
	// TritonRequests has request_type = active, max, scheduled, context, waiting.
	TritonRequests = "nv_trt_llm_request_metrics"
	// TritonKVBlocks has kv_cache_block_type = max, free, used, tokens_per, reused, fraction.
	TritonKVBlocks = "nv_trt_llm_kv_cache_block_metrics"
)

var families = []string{MetricRunning, MetricWaiting, MetricKVUtilization, MetricTokensPerBlk, MetricMaxBlocks,
	MetricUsedBlocks, TritonRequests, TritonKVBlocks}

// Engine is the TensorRT-LLM adapter, for trtllm-serve and for Triton's TensorRT-LLM backend.
// It is stateless.
type Engine struct{}

// New returns the TensorRT-LLM adapter.
func New() *Engine { return &Engine{} }

// Kind is trtllm.
func (e *Engine) Kind() engines.Kind { return engines.KindTRTLLM }

// MetricsPath is trtllm-serve's /prometheus/metrics (its /metrics answers JSON iteration
// stats). Triton serves metrics on a port of its own: give such workers a metrics URL.
func (e *Engine) MetricsPath() string { return "/prometheus/metrics" }

// HealthPath is /health.
func (e *Engine) HealthPath() string { return "/health" }

// ParseLoad reads trtllm-serve's or Triton's exposition, whichever names it carries.
func (e *Engine) ParseLoad(r io.Reader) (engines.Load, error) {
	fams, err := engines.ParseFamilies(r, families...)
	if err != nil {
		return engines.Load{}, fmt.Errorf("reading trtllm load: %w", err)
	}
	return LoadFrom(fams)
}

// LoadFrom reads a load out of parsed families (ParseFamilies' result).
func LoadFrom(fams map[string]*dto.MetricFamily) (engines.Load, error) {
	var l engines.Load
	serve(fams, &l)
	if l.Found == 0 {
		triton(fams, &l)
	}
	if l.Found&(engines.FieldRunning|engines.FieldWaiting|engines.FieldKVUsage) == 0 {
		return engines.Load{}, fmt.Errorf("reading trtllm load: %w (want %s, %s, %s or Triton's %s, %s)",
			engines.ErrNoLoadMetrics, MetricRunning, MetricWaiting, MetricKVUtilization, TritonRequests, TritonKVBlocks)
	}
	capacityTokens(&l)
	return l, nil
}

func serve(fams map[string]*dto.MetricFamily, l *engines.Load) {
	if v, n := engines.Sum(fams[MetricRunning], nil); n > 0 {
		l.Running, l.Found = engines.Count(v), l.Found|engines.FieldRunning
	}
	if v, n := engines.Sum(fams[MetricWaiting], nil); n > 0 {
		l.Waiting, l.Found = engines.Count(v), l.Found|engines.FieldWaiting
	}
	maxBlocks, nMax := engines.Sum(fams[MetricMaxBlocks], nil)
	if v, ok := engines.Mean(fams[MetricKVUtilization], nil); ok {
		l.KVUsage, l.Found = engines.Fraction(v), l.Found|engines.FieldKVUsage
	} else if used, n := engines.Sum(fams[MetricUsedBlocks], nil); n > 0 && nMax > 0 && maxBlocks > 0 {
		l.KVUsage, l.Found = engines.Fraction(used/maxBlocks), l.Found|engines.FieldKVUsage
	}
	if l.Found == 0 {
		return
	}
	if v, ok := engines.Mean(fams[MetricTokensPerBlk], nil); ok && engines.Count(v) > 0 && engines.Count(v) <= 1<<20 {
		l.BlockSize, l.Found = engines.Count(v), l.Found|engines.FieldBlockSize
	}
	if nMax > 0 && engines.Count(maxBlocks) > 0 {
		l.CapacityBlocks, l.Found = engines.Count(maxBlocks), l.Found|engines.FieldCapacityBlocks
	}
}

func triton(fams map[string]*dto.MetricFamily, l *engines.Load) {
	req := fams[TritonRequests]
	reqType := func(t string) engines.Match { return engines.LabelIs("request_type", t) }
	scheduled, nSched := engines.Sum(req, reqType("scheduled"))
	if nSched > 0 {
		l.Running, l.Found = engines.Count(scheduled), l.Found|engines.FieldRunning
	}
	if v, n := engines.Sum(req, reqType("waiting")); n > 0 {
		l.Waiting, l.Found = engines.Count(v), l.Found|engines.FieldWaiting
	} else if active, n := engines.Sum(req, reqType("active")); n > 0 && nSched > 0 {
		// Backends without the waiting gauge: what is active but not scheduled waits.
		l.Waiting, l.Found = engines.Count(active-scheduled), l.Found|engines.FieldWaiting
	}
	kv := fams[TritonKVBlocks]
	blockType := func(t string) engines.Match { return engines.LabelIs("kv_cache_block_type", t) }
	maxBlocks, nMax := engines.Sum(kv, blockType("max"))
	if v, ok := engines.Mean(kv, blockType("fraction")); ok {
		l.KVUsage, l.Found = engines.Fraction(v), l.Found|engines.FieldKVUsage
	} else if used, n := engines.Sum(kv, blockType("used")); n > 0 && nMax > 0 && maxBlocks > 0 {
		l.KVUsage, l.Found = engines.Fraction(used/maxBlocks), l.Found|engines.FieldKVUsage
	}
	if l.Found == 0 {
		return
	}
	if v, ok := engines.Mean(kv, blockType("tokens_per")); ok && engines.Count(v) > 0 && engines.Count(v) <= 1<<20 {
		l.BlockSize, l.Found = engines.Count(v), l.Found|engines.FieldBlockSize
	}
	if nMax > 0 && engines.Count(maxBlocks) > 0 {
		l.CapacityBlocks, l.Found = engines.Count(maxBlocks), l.Found|engines.FieldCapacityBlocks
	}
}

func capacityTokens(l *engines.Load) {
	if l.CapacityBlocks > 0 && l.BlockSize > 0 && l.CapacityBlocks <= (1<<31-1)/l.BlockSize {
		l.CapacityTokens, l.Found = l.CapacityBlocks*l.BlockSize, l.Found|engines.FieldCapacityTokens
	}
}

// DiscoverModel reads /v1/models (trtllm-serve and Triton's OpenAI frontend both serve it).
func (e *Engine) DiscoverModel(ctx context.Context, client *http.Client, baseURL string) (engines.Model, error) {
	return engines.DiscoverOpenAIModel(ctx, client, baseURL)
}

// KVEvents: TensorRT-LLM reports KV cache events through its executor API, not on a ZMQ
// socket in vLLM's format; a worker can still name an endpoint where a relay republishes them.
func (e *Engine) KVEvents() engines.KVEventDefaults {
	return engines.KVEventDefaults{}
}

var _ engines.Engine = (*Engine)(nil)
