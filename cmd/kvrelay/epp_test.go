package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/sim/simtest"
	"github.com/kvrelay/kvrelay/internal/extprocgw"
)

// kvrelay epp over an --upstream engine: it prints where it listens, answers gRPC health,
// picks for a gateway, serves its metrics, refuses a bad --objective, and stops on its
// context.
func TestEPPCommand(t *testing.T) {
	codec, err := sim.NewCodec("gpt-oss-120b", "", "")
	if err != nil {
		t.Fatal(err)
	}
	cfg := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec}
	cfg.Engine.Timing.Speedup = 100
	w := simtest.Start(t, cfg)

	bad := newRootCmd()
	bad.SetArgs([]string{"epp", "--upstream", w.URL(), "--objective", "chat"})
	bad.SetOut(io.Discard)
	bad.SetErr(io.Discard)
	if err := bad.Execute(); err == nil || !strings.Contains(err.Error(), "NAME=PRIORITY") {
		t.Fatalf("--objective chat: %v", err)
	}

	pr, pw := io.Pipe()
	cmd := newRootCmd()
	cmd.SetArgs([]string{"epp", "--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
		"--upstream", "id=w0,url=" + w.URL() + ",model=gpt-oss-120b", "--objective", "batch=-1", "--expose-decision-header"})
	cmd.SetOut(pw)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx); pw.Close() }()
	var extProc, healthAddr, metrics string
	sc := bufio.NewScanner(pr)
	for extProc == "" && sc.Scan() {
		line := sc.Text()
		if m := regexp.MustCompile(`^gRPC health on (\S+)`).FindStringSubmatch(line); m != nil {
			healthAddr = m[1]
		}
		if m := regexp.MustCompile(`^metrics on (http://\S+/metrics)`).FindStringSubmatch(line); m != nil {
			metrics = m[1]
		}
		if m := regexp.MustCompile(`ext_proc on (\S+) `).FindStringSubmatch(line); m != nil {
			extProc = m[1]
		}
	}
	go io.Copy(io.Discard, pr)
	if extProc == "" || healthAddr == "" || metrics == "" {
		t.Fatalf("printed ext_proc %q, health %q, metrics %q", extProc, healthAddr, metrics)
	}
	hc, err := grpc.NewClient(healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := healthpb.NewHealthClient(hc).Check(ctx, &healthpb.HealthCheckRequest{Service: "envoy.service.ext_proc.v3.ExternalProcessor"})
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ext_proc service is not SERVING: %v, %v", r, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	conn, err := grpc.NewClient(extProc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	gw := httptest.NewServer(extprocgw.New(extprocgw.Options{Pickers: []extproc.ExternalProcessorClient{extproc.NewExternalProcessorClient(conn)}}))
	defer gw.Close()
	resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", bytes.NewReader([]byte(`{"model":"gpt-oss-120b","max_tokens":4,"messages":[{"role":"user","content":"hello"}]}`)))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get(extprocgw.WorkerHeader) != strings.TrimPrefix(w.URL(), "http://") || resp.Header.Get("x-kvrelay-worker") == "" {
		t.Fatalf("through the gateway: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	mresp, err := http.Get(metrics)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	if !strings.Contains(string(m), `kvrelay_epp_picks_total{result="picked"} 1`) {
		t.Fatalf("metrics lack the pick:\n%s", m)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("epp returned %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("epp did not stop")
	}
}
