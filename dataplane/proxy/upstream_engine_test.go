package proxy_test

import (
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// TestUpstreamEngineKind: an upstream's engine kind is one kvrelay knows or unset, and a
// misspelt one is refused rather than read as an engine that does not pin.
func TestUpstreamEngineKind(t *testing.T) {
	for engine, ok := range map[string]bool{"": true, "sim": true, "vllm": true, "sglang": true, "vLLM": false, "tgi": false} {
		cfg := proxy.DefaultConfig()
		cfg.Upstreams = []proxy.Upstream{{URL: "http://127.0.0.1:8001", Engine: engine}}
		err := cfg.Validate()
		if (err == nil) != ok || (err != nil && !strings.Contains(err.Error(), "engine")) {
			t.Errorf("engine %q: %v", engine, err)
		}
	}
}
