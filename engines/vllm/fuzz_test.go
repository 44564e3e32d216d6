package vllm_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/vllm"
)

// FuzzParseLoad: any input parses or fails without panicking; a load is within bounds; and
// when the whole input parses as an exposition, reading only vLLM's families (ParseLoad's
// line filter) gives the same load as reading them from the full parse.
func FuzzParseLoad(f *testing.F) {
	files, _ := filepath.Glob("testdata/*.prom")
	for _, p := range files {
		// The simulated engine's full expositions (11 KB) stall the mutator; the smaller
		// hand-written ones cover the same families.
		if b, err := os.ReadFile(p); err == nil && len(b) < 8<<10 {
			f.Add(b)
		}
	}
	f.Add([]byte("vllm:num_requests_running{engine=\"0\"} 3\nvllm:kv_cache_usage_perc 0.5\n"))
	f.Add([]byte("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2\n"))
	f.Add([]byte("{\"vllm:num_requests_running\",engine=\"0\"} 1\n"))
	f.Add([]byte("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000000000\"} 1\nvllm:num_requests_running 1e300\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		got, err := vllm.New().ParseLoad(bytes.NewReader(in))
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
		want, werr := vllm.LoadFrom(fams)
		if errors.Is(werr, engines.ErrNoLoadMetrics) != errors.Is(err, engines.ErrNoLoadMetrics) {
			t.Fatalf("full parse: %v; filtered: %v", werr, err)
		}
		if werr == nil && (err != nil || got != want) {
			t.Fatalf("filtered %+v (%v), full %+v", got, err, want)
		}
	})
}
