package trtllm_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/trtllm"
)

var update = flag.Bool("update", false, "rewrite testdata/*.load.json from the parsed expositions")

func TestGolden(t *testing.T) {
	files, err := filepath.Glob("testdata/*.prom")
	if err != nil || len(files) == 0 {
		t.Fatalf("no expositions under testdata: %v", err)
	}
	for _, f := range files {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".prom"), func(t *testing.T) {
			in, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			load, err := trtllm.New().ParseLoad(bytes.NewReader(in))
			if err != nil {
				t.Fatalf("ParseLoad: %v", err)
			}
			got, _ := json.MarshalIndent(load, "", "  ")
			got = append(got, '\n')
			golden := strings.TrimSuffix(f, ".prom") + ".load.json"
			if *update {
				if err := os.WriteFile(golden, got, 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("load of %s:\ngot  %s\nwant %s", f, got, want)
			}
		})
	}
}

func TestParseLoad(t *testing.T) {
	cases := []struct {
		name    string
		in      string
		want    engines.Load
		wantErr error
		anyErr  bool
	}{
		{
			name: "trtllm-serve",
			in:   "trtllm_num_requests_running 4\ntrtllm_num_requests_waiting 1\ntrtllm_kv_cache_utilization 0.5\ntrtllm_kv_cache_tokens_per_block 32\ntrtllm_kv_cache_max_blocks 100\n",
			want: engines.Load{Running: 4, Waiting: 1, KVUsage: 0.5, BlockSize: 32, CapacityBlocks: 100, CapacityTokens: 3200,
				Found: engines.FieldRunning | engines.FieldWaiting | engines.FieldKVUsage | engines.FieldBlockSize | engines.FieldCapacityBlocks | engines.FieldCapacityTokens},
		},
		{
			name: "trtllm-serve usage from blocks",
			in:   "trtllm_kv_cache_used_blocks 25\ntrtllm_kv_cache_max_blocks 100\n",
			want: engines.Load{KVUsage: 0.25, CapacityBlocks: 100, Found: engines.FieldKVUsage | engines.FieldCapacityBlocks},
		},
		{
			name: "triton",
			in: "nv_trt_llm_request_metrics{request_type=\"scheduled\"} 3\nnv_trt_llm_request_metrics{request_type=\"waiting\"} 2\n" +
				"nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"fraction\"} 0.75\n",
			want: engines.Load{Running: 3, Waiting: 2, KVUsage: 0.75, Found: engines.FieldRunning | engines.FieldWaiting | engines.FieldKVUsage},
		},
		{
			name: "triton waiting from active",
			in:   "nv_trt_llm_request_metrics{request_type=\"scheduled\"} 3\nnv_trt_llm_request_metrics{request_type=\"active\"} 7\n",
			want: engines.Load{Running: 3, Waiting: 4, Found: engines.FieldRunning | engines.FieldWaiting},
		},
		{
			name: "trtllm-serve wins over triton",
			in:   "trtllm_num_requests_running 1\nnv_trt_llm_request_metrics{request_type=\"scheduled\"} 9\n",
			want: engines.Load{Running: 1, Found: engines.FieldRunning},
		},
		{
			name:    "capacity alone is no load",
			in:      "trtllm_kv_cache_max_blocks 100\n",
			wantErr: engines.ErrNoLoadMetrics,
		},
		{name: "sglang exposition", in: "sglang:num_running_reqs 2\n", wantErr: engines.ErrNoLoadMetrics},
		{name: "bad labels", in: "nv_trt_llm_request_metrics{request_type=scheduled} 3\n", anyErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := trtllm.New().ParseLoad(strings.NewReader(tc.in))
			switch {
			case tc.wantErr != nil || tc.anyErr:
				if err == nil || (tc.wantErr != nil && !errors.Is(err, tc.wantErr)) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
			case err != nil:
				t.Fatal(err)
			case got != tc.want:
				t.Errorf("got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestAdapter(t *testing.T) {
	e := trtllm.New()
	if e.Kind() != engines.KindTRTLLM || e.MetricsPath() != "/prometheus/metrics" || e.HealthPath() != "/health" {
		t.Errorf("adapter %s %s %s", e.Kind(), e.MetricsPath(), e.HealthPath())
	}
	if e.KVEvents().Supported {
		t.Error("TensorRT-LLM publishes no vLLM-format KV events")
	}
}
