package proxy

import (
	"errors"
	"strings"
	"testing"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// TestServeModels: a proxy told to serve some models takes the control plane's workers that
// serve one of them (by base model or adapter) and those that name no model, and the setting
// needs a control plane.
func TestServeModels(t *testing.T) {
	ws := []*xdsv1.Worker{
		{Id: "a", Model: "llama"}, {Id: "b", Model: "qwen"}, {Id: "c", Model: "qwen", LoraAdapters: []string{"sql"}},
		{Id: "d"}, {Id: "e", Model: "mistral"},
	}
	s := &Server{cfg: Config{ServeModels: []string{"llama", "sql"}, BlockSize: 16}}
	// Another model's settings do not concern this proxy: its workers are not checked.
	if err := s.checkWorker(&xdsv1.Worker{Id: "e", Model: "mistral", Url: "http://h:1", BlockSize: 64}); err != nil {
		t.Fatalf("an unserved worker was checked: %v", err)
	}
	if err := s.checkWorker(&xdsv1.Worker{Id: "a", Model: "llama", Url: "http://h:1", BlockSize: 64}); err == nil {
		t.Fatal("a served worker's block size was not checked")
	}
	var got []string
	for _, w := range s.servedWorkers(ws) {
		got = append(got, w.GetId())
	}
	if want := "a c d"; strings.Join(got, " ") != want {
		t.Fatalf("served workers %v, want %s", got, want)
	}
	all := &Server{cfg: Config{}}
	if n := len(all.servedWorkers(ws)); n != len(ws) {
		t.Fatalf("without serve_models: %d of %d workers", n, len(ws))
	}

	cfg := DefaultConfig()
	cfg.Upstreams = []Upstream{{URL: "http://127.0.0.1:8000"}}
	cfg.ServeModels = []string{"llama"}
	if err := cfg.Validate(); !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), "serve_models") {
		t.Fatalf("serve_models without a control plane: %v", err)
	}
	cfg.ServeModels = nil
	if err := cfg.Validate(); err != nil {
		t.Fatalf("the same config without serve_models: %v", err)
	}
	cfg.Upstreams, cfg.XDS, cfg.ServeModels = nil, "127.0.0.1:18000", []string{"llama", ""}
	if err := cfg.Validate(); !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), "empty model") {
		t.Fatalf("an empty model in serve_models: %v", err)
	}
	// The control plane refuses a node whose models it cannot take (xds.NodeModels): the
	// proxy refuses them first.
	cfg.ServeModels = []string{"llama", "my model"}
	if err := cfg.Validate(); !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), "space") {
		t.Fatalf("a model with a space in serve_models: %v", err)
	}
}
