package proxy_test

import (
	"context"
	"io"
	"net/http"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// TestRestartSamePort stops a proxy that has just served a keep-alive client, leaving the
// connection it closed in TIME_WAIT on the listening port, and starts another proxy on the
// same address at once: the listener sets SO_REUSEADDR, so the bind succeeds.
func TestRestartSamePort(t *testing.T) {
	w := startWorker(t, nil)
	first := startProxy(t, []string{w.URL()}, nil)
	addr := first.Addr()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	cl := &http.Client{Transport: tr}
	for range 3 {
		resp, err := cl.Get("http://" + addr + "/health")
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	// The proxy closes the client's connection first, so the TIME_WAIT is on its side.
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	tr.CloseIdleConnections()

	cfg := proxy.DefaultConfig()
	cfg.Listen = addr
	cfg.EventLoops = 2
	cfg.Upstreams = []proxy.Upstream{{ID: "w0", URL: w.URL(), Model: model}}
	second, err := proxy.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := second.Start(context.Background()); err != nil {
		t.Fatalf("restarting on %s at once: %v", addr, err)
	}
	defer second.Close()
	resp, err := http.Get("http://" + addr + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("health after restart: %d", resp.StatusCode)
	}
}
