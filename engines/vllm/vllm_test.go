package vllm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/vllm"
	"github.com/kvrelay/kvrelay/engines/vllm/vllmtest"
)

var (
	update  = flag.Bool("update", false, "rewrite testdata/*.load.json from the parsed expositions")
	capture = flag.Bool("capture", false, "recapture testdata/sim_*.prom from live simulated workers")
)

// TestGolden parses every exposition under testdata/ and compares the load with the
// .load.json beside it.
func TestGolden(t *testing.T) {
	if *capture {
		captureSim(t)
	}
	files, err := filepath.Glob("testdata/*.prom")
	if err != nil || len(files) == 0 {
		t.Fatalf("no expositions under testdata: %v", err)
	}
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".prom")
		t.Run(name, func(t *testing.T) {
			in, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			load, err := vllm.New().ParseLoad(bytes.NewReader(in))
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

// captureSim records the real /metrics of simulated workers: one idle and one with requests
// running and queued.
func captureSim(t *testing.T) {
	idle := vllmtest.StartSim(t, nil)
	writeScrape(t, idle.URL(), "testdata/sim_idle.prom")

	busy := vllmtest.StartSim(t, func(c *sim.WorkerConfig) {
		c.Engine.MaxNumSeqs = 4
		c.Engine.Timing.Speedup = 1
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Go(func() {
			body := fmt.Sprintf(`{"model":"sim-model","prompt":"request %d %s","max_tokens":400}`, i, strings.Repeat(" word", 64))
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, busy.URL()+"/v1/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		load, err := vllm.New().ParseLoad(bytes.NewReader(scrape(t, busy.URL())))
		if err == nil && load.Running == 4 && load.Waiting == 2 && load.KVUsage > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("simulated worker never reached 4 running and 2 waiting: %+v, %v", load, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	writeScrape(t, busy.URL(), "testdata/sim_busy.prom")
	cancel()
	wg.Wait()
}

func scrape(t *testing.T, base string) []byte {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeScrape(t *testing.T, base, path string) {
	t.Helper()
	if err := os.WriteFile(path, scrape(t, base), 0o644); err != nil {
		t.Fatal(err)
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
			name: "current names",
			in: "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3\n" +
				"vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1\n" +
				"vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n",
			want: engines.Load{Running: 3, Waiting: 1, KVUsage: 0.25,
				Found: engines.FieldRunning | engines.FieldWaiting | engines.FieldKVUsage},
		},
		{
			name: "legacy usage name",
			in:   "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\n",
			want: engines.Load{KVUsage: 0.5, Found: engines.FieldKVUsage},
		},
		{
			name: "current usage wins over legacy",
			in:   "vllm:gpu_cache_usage_perc 0.5\nvllm:kv_cache_usage_perc 0.125\n",
			want: engines.Load{KVUsage: 0.125, Found: engines.FieldKVUsage},
		},
		{
			name: "data parallel engines sum counts and average usage",
			in: "vllm:num_requests_running{engine=\"0\"} 3\nvllm:num_requests_running{engine=\"1\"} 5\n" +
				"vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.4\n" +
				"vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1\n" +
				"vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"100\"} 1\n",
			want: engines.Load{Running: 8, KVUsage: 0.30000000000000004, BlockSize: 16, CapacityBlocks: 200, CapacityTokens: 3200,
				Found: engines.FieldRunning | engines.FieldKVUsage | engines.FieldBlockSize | engines.FieldCapacityBlocks | engines.FieldCapacityTokens},
		},
		{
			name: "cache config with bad labels is ignored",
			in:   "vllm:num_requests_running 1\nvllm:cache_config_info{block_size=\"x\",num_gpu_blocks=\"-3\"} 1\n",
			want: engines.Load{Running: 1, Found: engines.FieldRunning},
		},
		{
			name: "usage clamped, negative counts zero",
			in:   "vllm:num_requests_running -2\nvllm:kv_cache_usage_perc 1.5\n",
			want: engines.Load{KVUsage: 1, Found: engines.FieldRunning | engines.FieldKVUsage},
		},
		{
			name: "typed families among others",
			in: "# HELP vllm:num_requests_waiting Number of requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n" +
				"vllm:num_requests_waiting{model_name=\"m\"} 7.0\n# TYPE other_bucket histogram\nbroken line {{{\n",
			want: engines.Load{Waiting: 7, Found: engines.FieldWaiting},
		},
		{name: "empty", in: "", wantErr: engines.ErrNoLoadMetrics},
		{name: "other engine", in: "sglang:num_running_reqs 3\n", wantErr: engines.ErrNoLoadMetrics},
		{name: "malformed sample", in: "vllm:num_requests_running{engine=\"0\" 3\n", anyErr: true},
		{name: "two TYPE lines", in: "# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_running counter\n", anyErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := vllm.New().ParseLoad(strings.NewReader(tc.in))
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
	for _, e := range []*vllm.Engine{vllm.New(), vllm.NewSim()} {
		if e.MetricsPath() != "/metrics" || e.HealthPath() != "/health" {
			t.Errorf("%s: paths %q %q", e.Kind(), e.MetricsPath(), e.HealthPath())
		}
		if d := e.KVEvents(); !d.Supported || d.Port != 5557 || !d.EngineBinds {
			t.Errorf("%s: kv event defaults %+v", e.Kind(), d)
		}
	}
	if vllm.New().Kind() != engines.KindVLLM || vllm.NewSim().Kind() != engines.KindSim {
		t.Error("kinds")
	}
}

// TestAgainstSim reads a live simulated worker: its model and its cache configuration.
func TestAgainstSim(t *testing.T) {
	w := vllmtest.StartSim(t, func(c *sim.WorkerConfig) {
		c.Engine.Model = "tiny-model"
		c.Engine.BlockSize = 32
		c.Engine.NumGPUBlocks = 512
	})
	ctx := context.Background()
	e := vllm.NewSim()
	m, err := e.DiscoverModel(ctx, http.DefaultClient, w.URL())
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "tiny-model" || len(m.IDs) != 1 || m.MaxModelLen <= 0 {
		t.Errorf("model %+v", m)
	}
	resp, err := http.Get(w.URL() + e.MetricsPath())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	l, err := e.ParseLoad(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	want := engines.Load{BlockSize: 32, CapacityBlocks: 512, CapacityTokens: 512 * 32,
		Found: engines.FieldRunning | engines.FieldWaiting | engines.FieldKVUsage | engines.FieldBlockSize | engines.FieldCapacityBlocks | engines.FieldCapacityTokens}
	if l != want {
		t.Errorf("load %+v\nwant %+v", l, want)
	}
}

func TestDiscoverModelErrors(t *testing.T) {
	cases := []struct {
		name    string
		status  int
		body    string
		wantErr error
	}{
		{name: "empty list", status: 200, body: `{"object":"list","data":[]}`, wantErr: engines.ErrNoModel},
		{name: "not json", status: 200, body: `<html>`},
		{name: "server error", status: 500, body: `{}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.WriteHeader(tc.status)
				io.WriteString(w, tc.body)
			}))
			defer srv.Close()
			_, err := vllm.New().DiscoverModel(context.Background(), srv.Client(), srv.URL)
			if err == nil || (tc.wantErr != nil && !errors.Is(err, tc.wantErr)) {
				t.Fatalf("err = %v, want %v", err, tc.wantErr)
			}
		})
	}
}
