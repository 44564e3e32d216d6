package trtllm_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/trtllm"
)

// FuzzParseLoad: no input panics, loads stay in bounds, and the line filter gives the load a
// full parse gives whenever the whole input parses.
func FuzzParseLoad(f *testing.F) {
	files, _ := filepath.Glob("testdata/*.prom")
	for _, p := range files {
		if b, err := os.ReadFile(p); err == nil && len(b) < 8<<10 {
			f.Add(b)
		}
	}
	f.Add([]byte("trtllm_num_requests_running 3\ntrtllm_kv_cache_used_blocks 5\ntrtllm_kv_cache_max_blocks 10\n"))
	f.Add([]byte("nv_trt_llm_request_metrics{request_type=\"active\"} 4\nnv_trt_llm_request_metrics{request_type=\"scheduled\"} 1\nnv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"tokens_per\"} 64\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		got, err := trtllm.New().ParseLoad(bytes.NewReader(in))
		if err == nil {
			if got.Running < 0 || got.Waiting < 0 || got.KVUsage < 0 || got.KVUsage > 1 ||
				got.BlockSize < 0 || got.CapacityBlocks < 0 || got.CapacityTokens < 0 || got.Found == 0 {
				t.Fatalf("load out of bounds: %+v", got)
			}
		}
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, ferr := p.TextToMetricFamilies(bytes.NewReader(in))
		if ferr != nil {
			return
		}
		want, werr := trtllm.LoadFrom(fams)
		if errors.Is(werr, engines.ErrNoLoadMetrics) != errors.Is(err, engines.ErrNoLoadMetrics) {
			t.Fatalf("full parse: %v; filtered: %v", werr, err)
		}
		if werr == nil && (err != nil || got != want) {
			t.Fatalf("filtered %+v (%v), full %+v", got, err, want)
		}
	})
}
