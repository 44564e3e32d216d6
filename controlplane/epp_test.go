package controlplane_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvrelay/kvrelay/dataplane/epp"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/internal/extprocgw"
)

// An endpoint picker fed by the control plane picks with its index replica: each prompt
// family warmed on a worker goes there through a gateway, served from that worker's cache.
func TestEndpointPickerFollowsTheControlPlane(t *testing.T) {
	c := newCluster(t, 4)
	core := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.PickOnly = true })
	waitWorkers(t, core, 4)
	c.warm(4)
	c.waitBlocks(4 * 150)

	g := grpc.NewServer()
	epp.New(core, epp.Options{}).Register(g)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	gw := httptest.NewServer(extprocgw.New(extprocgw.Options{Pickers: []extproc.ExternalProcessorClient{extproc.NewExternalProcessorClient(conn)}}))
	t.Cleanup(gw.Close)

	for f := range 4 {
		body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4,
			"messages": []map[string]string{{"role": "system", "content": family(f)}, {"role": "user", "content": "through the gateway"}}})
		resp, err := http.Post(gw.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		want := strings.TrimPrefix(c.workers[f].URL(), "http://")
		if got := resp.Header.Get(extprocgw.WorkerHeader); resp.StatusCode != 200 || got != want {
			t.Fatalf("family %d: status %d served by %q, want %s (%s)", f, resp.StatusCode, got, want, b)
		}
		var out struct {
			Usage struct {
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(b, &out); err != nil || out.Usage.PromptTokensDetails.CachedTokens < 150*16 {
			t.Fatalf("family %d: %d tokens cached (%v)", f, out.Usage.PromptTokensDetails.CachedTokens, err)
		}
	}
}
