package sglang_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sglang"
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
	f.Add([]byte("sglang:num_running_reqs{tp_rank=\"0\"} 3\nsglang:page_size 16\nsglang:max_total_num_tokens 99\n"))
	f.Add([]byte("sglang:cache_config_info{page_size=\"1\",num_pages=\"5\"} 1\nsglang:token_usage 2\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		got, err := sglang.New().ParseLoad(bytes.NewReader(in))
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
		want, werr := sglang.LoadFrom(fams)
		if errors.Is(werr, engines.ErrNoLoadMetrics) != errors.Is(err, engines.ErrNoLoadMetrics) {
			t.Fatalf("full parse: %v; filtered: %v", werr, err)
		}
		if werr == nil && (err != nil || got != want) {
			t.Fatalf("filtered %+v (%v), full %+v", got, err, want)
		}
	})
}
