package controlplane_test

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/xds/auth"
	"github.com/kvrelay/kvrelay/xds/auth/authtest"
)

// TestOperatorAPIOverTLS: with --api-cert and --api-key the operator API (reads, a write
// with the token, HTTP/2 as gRPC needs it) is served over HTTPS to a client that trusts the
// CA, and a plaintext request gets no answer from it.
func TestOperatorAPIOverTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := authtest.NewCA(dir, "operators")
	if err != nil {
		t.Fatal(err)
	}
	pair, err := ca.Issue("api", "control-plane", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, workers: startWorkers(t, 1), dataDir: t.TempDir(), xdsAuth: auth.ServerConfig{}}
	c.specs = append(c.specs, specOf(0, c.workers[0].URL(), c.workers[0].EventsEndpoint(), c.workers[0].ReplayEndpoint()))
	c.cpOpts = func(o *controlplane.Options) { o.APICertFile, o.APIKeyFile = pair.CertFile, pair.KeyFile }
	c.startControlPlane("127.0.0.1:0")

	pem, err := os.ReadFile(ca.CertFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	base := "https://" + c.cp.APIAddr()

	resp, err := client.Get(base + "/v1/workers")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Proto != "HTTP/2.0" {
		t.Fatalf("GET /v1/workers over TLS: %s %s, want 200 over HTTP/2", resp.Proto, resp.Status)
	}
	req, _ := http.NewRequest("PUT", base+"/v1/policy", strings.NewReader(`{"policy": "round-robin"}`))
	req.Header.Set("Authorization", "Bearer secret")
	if resp, err = client.Do(req); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("PUT /v1/policy over TLS: %s", resp.Status)
	}
	if resp, err := http.Get("http://" + c.cp.APIAddr() + "/v1/workers"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Fatal("the HTTPS operator API answered a plaintext request")
		}
	}
	if _, err := (&http.Client{Transport: &http.Transport{}}).Get(base + "/v1/workers"); err == nil {
		t.Fatal("a client that does not trust the CA was answered")
	}
}

// The operator API refuses a certificate without its key, and one that does not load.
func TestOperatorAPICertificateChecked(t *testing.T) {
	for _, o := range []controlplane.Options{
		{APICertFile: "cert.pem"},
		{APICertFile: "/nonexistent/cert.pem", APIKeyFile: "/nonexistent/key.pem"},
	} {
		o.XDSListen, o.APIListen, o.DataDir, o.Logger = "127.0.0.1:0", "127.0.0.1:0", t.TempDir(), quiet()
		cp, err := controlplane.New(o)
		if err != nil {
			continue
		}
		if err := cp.Start(t.Context()); err == nil {
			_ = cp.Close()
			t.Errorf("started with --api-cert %q --api-key %q", o.APICertFile, o.APIKeyFile)
		}
	}
}
