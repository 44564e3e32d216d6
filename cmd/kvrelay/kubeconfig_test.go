package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestKubeConfigRateLimit: the control plane's client gets kubeQPS and kubeBurst instead of
// client-go's 5 and 10.
func TestKubeConfigRateLimit(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	const kc = `apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {server: "https://127.0.0.1:6443"}
users:
- name: u
  user: {token: t}
contexts:
- name: x
  context: {cluster: c, user: u}
current-context: x
`
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := kubeConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.QPS != kubeQPS || cfg.Burst != kubeBurst {
		t.Fatalf("QPS %v burst %d, want %v and %d", cfg.QPS, cfg.Burst, float32(kubeQPS), kubeBurst)
	}
	if _, err := kubeConfig(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("a missing kubeconfig was accepted")
	}
}
