package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestAdminAnswersOnlyLoopbackHosts: the proxy's admin listener on loopback (pprof's
// command line, the decisions, /metrics) refuses a Host that is not localhost or a loopback
// address, which a web page would send through a DNS name rebound to 127.0.0.1.
func TestAdminAnswersOnlyLoopbackHosts(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	addr, err := serveAdmin(ctx, "127.0.0.1:0", h)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		host, path string
		want       int
	}{
		{"evil.example", "/debug/pprof/cmdline", 421},
		{"evil.example:80", "/metrics", 421},
		{"evil.example", "/debug/decisions", 421},
		{addr, "/debug/pprof/cmdline", 200},
		{"localhost", "/metrics", 200},
		{"[::1]", "/debug/decisions", 200},
	} {
		req, _ := http.NewRequest("GET", "http://"+addr+c.path, nil)
		req.Host = c.host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("Host %s %s: %d %s, want %d", c.host, c.path, resp.StatusCode, body, c.want)
		}
		if c.want == 421 && (strings.Contains(string(body), "kvrelay") && strings.Contains(string(body), "test")) {
			t.Errorf("Host %s %s: the refusal leaks the command line: %s", c.host, c.path, body)
		}
	}
}
