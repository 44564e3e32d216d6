package sglang_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sglang"
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
			load, err := sglang.New().ParseLoad(bytes.NewReader(in))
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
	const all = engines.FieldRunning | engines.FieldWaiting | engines.FieldKVUsage
	cases := []struct {
		name    string
		in      string
		want    engines.Load
		wantErr error
		anyErr  bool
	}{
		{
			name: "one scheduler",
			in:   "sglang:num_running_reqs 5\nsglang:num_queue_reqs 2\nsglang:token_usage 0.4\n",
			want: engines.Load{Running: 5, Waiting: 2, KVUsage: 0.4, Found: all},
		},
		{
			name: "tensor parallel ranks count once",
			in: "sglang:num_running_reqs{tp_rank=\"0\"} 5\nsglang:num_running_reqs{tp_rank=\"1\"} 5\n" +
				"sglang:token_usage{tp_rank=\"0\"} 0.5\nsglang:token_usage{tp_rank=\"1\"} 0.9\n",
			want: engines.Load{Running: 5, KVUsage: 0.5, Found: engines.FieldRunning | engines.FieldKVUsage},
		},
		{
			name: "data parallel ranks add up",
			in: "sglang:num_queue_reqs{dp_rank=\"0\",tp_rank=\"0\"} 1\nsglang:num_queue_reqs{dp_rank=\"1\",tp_rank=\"0\"} 4\n" +
				"sglang:token_usage{dp_rank=\"0\",tp_rank=\"0\"} 0.2\nsglang:token_usage{dp_rank=\"1\",tp_rank=\"0\"} 0.4\n",
			want: engines.Load{Waiting: 5, KVUsage: 0.30000000000000004, Found: engines.FieldWaiting | engines.FieldKVUsage},
		},
		{
			name: "page gauges",
			in:   "sglang:token_usage 0\nsglang:page_size 16\nsglang:num_pages 1000\n",
			want: engines.Load{BlockSize: 16, CapacityBlocks: 1000, CapacityTokens: 16000,
				Found: engines.FieldKVUsage | engines.FieldBlockSize | engines.FieldCapacityBlocks | engines.FieldCapacityTokens},
		},
		{
			name: "cache config labels",
			in:   "sglang:token_usage 0\nsglang:cache_config_info{page_size=\"8\",num_pages=\"10\"} 1\n",
			want: engines.Load{BlockSize: 8, CapacityBlocks: 10, CapacityTokens: 80,
				Found: engines.FieldKVUsage | engines.FieldBlockSize | engines.FieldCapacityBlocks | engines.FieldCapacityTokens},
		},
		{
			name: "pool tokens without a page size",
			in:   "sglang:num_running_reqs 1\nsglang:max_total_num_tokens 161721\n",
			want: engines.Load{Running: 1, CapacityTokens: 161721, Found: engines.FieldRunning | engines.FieldCapacityTokens},
		},
		{
			name: "pool tokens and page size give blocks",
			in:   "sglang:num_running_reqs 1\nsglang:max_total_num_tokens 1000\nsglang:page_size 64\n",
			want: engines.Load{Running: 1, BlockSize: 64, CapacityBlocks: 15, CapacityTokens: 1000,
				Found: engines.FieldRunning | engines.FieldBlockSize | engines.FieldCapacityBlocks | engines.FieldCapacityTokens},
		},
		{name: "vllm exposition", in: "vllm:num_requests_running 3\n", wantErr: engines.ErrNoLoadMetrics},
		{name: "bad value", in: "sglang:num_running_reqs abc\n", anyErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := sglang.New().ParseLoad(strings.NewReader(tc.in))
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
	e := sglang.New()
	if e.Kind() != engines.KindSGLang || e.MetricsPath() != "/metrics" || e.HealthPath() != "/health" {
		t.Errorf("adapter %s %s %s", e.Kind(), e.MetricsPath(), e.HealthPath())
	}
	if d := e.KVEvents(); !d.Supported || d.Port != 5557 || !d.EngineBinds || d.Format != kvevents.FormatArray || !d.BigramTokens {
		t.Errorf("kv event defaults %+v", d)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, `{"object":"list","data":[{"id":"Qwen/Qwen3-32B","object":"model","created":1,"owned_by":"sglang","root":"Qwen/Qwen3-32B","max_model_len":40960}]}`)
	}))
	defer srv.Close()
	m, err := e.DiscoverModel(context.Background(), srv.Client(), srv.URL)
	if err != nil || m.ID != "Qwen/Qwen3-32B" || m.MaxModelLen != 40960 {
		t.Errorf("model %+v, %v", m, err)
	}
}
