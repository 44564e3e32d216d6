package auth_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/auth"
	"github.com/kvrelay/kvrelay/xds/auth/authtest"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/client"
	"github.com/kvrelay/kvrelay/xds/journal"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

type emptyIndex struct{}

func (emptyIndex) Each(func(uint64, int, blockset.Tier)) {}

// emptyQuery answers every index query with nothing.
type emptyQuery struct {
	xdsv1.UnimplementedIndexQueryServer
}

func (emptyQuery) Match(context.Context, *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, error) {
	return &xdsv1.IndexMatchResponse{}, nil
}

// serve runs an xDS server (ADS, load reports, index journal, index queries) that checks cfg, with one
// worker published, and returns its address and checker.
func serve(t *testing.T, cfg auth.ServerConfig) (string, *auth.Server) {
	t.Helper()
	a, err := auth.NewServer(cfg, "127.0.0.1:0", quiet())
	if err != nil {
		t.Fatal(err)
	}
	srv := xdsserver.New(xdsserver.Options{ShutdownGrace: 50 * time.Millisecond, GRPCOptions: a.Options()})
	ready := make(chan struct{})
	close(ready)
	xdsv1.RegisterIndexJournalServer(srv.GRPC(), journal.NewServer(journal.NewLog(64), emptyIndex{}, journal.ServerOptions{Ready: ready}))
	xdsv1.RegisterIndexQueryServer(srv.GRPC(), emptyQuery{})
	if err := srv.SetWorkers([]*xdsv1.Worker{{Id: "w0", Url: "http://127.0.0.1:1", Model: "m", BlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ctx, lis) }()
	t.Cleanup(func() { cancel(); <-done })
	return lis.Addr().String(), a
}

func dial(t *testing.T, addr string, cfg auth.ClientConfig) *grpc.ClientConn {
	t.Helper()
	opts, err := cfg.DialOptions(addr, quiet())
	if err != nil {
		t.Fatal(err)
	}
	conn, err := client.Dial(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// ads opens a delta ADS stream claiming node and returns the first answer's error (nil: a
// response with the worker came).
func ads(conn *grpc.ClientConn, node string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		return err
	}
	if err := st.Send(&discovery.DeltaDiscoveryRequest{Node: &core.Node{Id: node}, TypeUrl: xds.WorkerType}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	resp, err := st.Recv()
	if err != nil {
		return err
	}
	if len(resp.GetResources()) != 1 {
		return errors.New("no worker pushed")
	}
	return nil
}

// report sends one load report from node and returns the ack's error.
func report(conn *grpc.ClientConn, node string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := xdsv1.NewLoadReportingClient(conn).Report(ctx)
	if err != nil {
		return err
	}
	if err := st.Send(&xdsv1.LoadReport{NodeId: node, Seq: 1, Workers: []*xdsv1.WorkerLoad{{WorkerId: "w0", Inflight: 3}}}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_, err = st.Recv()
	return err
}

// follow asks the index journal for a snapshot as node and returns the first batch's error.
func follow(conn *grpc.ClientConn, node string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := xdsv1.NewIndexJournalClient(conn).Stream(ctx)
	if err != nil {
		return err
	}
	if err := st.Send(&xdsv1.JournalAck{NodeId: node}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	_, err = st.Recv()
	return err
}

// query asks the index about a prompt as node and returns the call's error.
func query(conn *grpc.ClientConn, node string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := xdsv1.NewIndexQueryClient(conn).Match(ctx, &xdsv1.IndexMatchRequest{NodeId: node, Hashes: []uint64{1}, Slots: []byte{1}})
	return err
}

func wantCode(t *testing.T, what string, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Errorf("%s: got %v, want %s", what, err, code)
	}
}

func writeFile(t *testing.T, path, s string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

const (
	tokenA = "token-of-proxy-a-0123456789"
	tokenB = "token-of-proxy-b-0123456789"
)

// TestTokensBindNodes: without a token, with a wrong one, and claiming another node's id on
// any of the three streams or in an index query, a proxy is refused; with its own token and node id it is served.
func TestTokensBindNodes(t *testing.T) {
	dir := t.TempDir()
	tokens := writeFile(t, filepath.Join(dir, "tokens"), "# node token\nproxy-a "+tokenA+"\nproxy-b "+tokenB+"\n")
	addr, a := serve(t, auth.ServerConfig{TokensFile: tokens})

	none := dial(t, addr, auth.ClientConfig{})
	wantCode(t, "ADS without a token", ads(none, "proxy-a"), codes.Unauthenticated)
	wantCode(t, "load report without a token", report(none, "proxy-a"), codes.Unauthenticated)
	wantCode(t, "journal without a token", follow(none, "proxy-a"), codes.Unauthenticated)
	wantCode(t, "index query without a token", query(none, "proxy-a"), codes.Unauthenticated)

	wrong := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "wrong"), "not-a-token-anyone-was-given\n")})
	wantCode(t, "ADS with a wrong token", ads(wrong, "proxy-a"), codes.Unauthenticated)

	asA := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "a"), tokenA+"\n")})
	wantCode(t, "ADS as proxy-b with proxy-a's token", ads(asA, "proxy-b"), codes.PermissionDenied)
	wantCode(t, "load report as proxy-b with proxy-a's token", report(asA, "proxy-b"), codes.PermissionDenied)
	wantCode(t, "journal as proxy-b with proxy-a's token", follow(asA, "proxy-b"), codes.PermissionDenied)
	wantCode(t, "index query as proxy-b with proxy-a's token", query(asA, "proxy-b"), codes.PermissionDenied)
	wantCode(t, "ADS as proxy-a", ads(asA, "proxy-a"), codes.OK)
	wantCode(t, "load report as proxy-a", report(asA, "proxy-a"), codes.OK)
	wantCode(t, "journal as proxy-a", follow(asA, "proxy-a"), codes.OK)
	wantCode(t, "index query as proxy-a", query(asA, "proxy-a"), codes.OK)

	got := a.Refused()
	if got["no_token"] != 4 || got["bad_token"] != 1 || got["wrong_node"] != 4 {
		t.Errorf("refusals %v, want no_token 4, bad_token 1, wrong_node 4", got)
	}
}

// reviewer is a TokenReviewer that knows a table of tokens, and fails to answer for one.
type reviewer struct {
	nodes map[string][]string
	down  string
}

func (r reviewer) Name() string { return "reviewed tokens" }

func (r reviewer) Review(_ context.Context, tok string) ([]string, error) {
	if tok == r.down {
		return nil, errors.New("the issuer does not answer")
	}
	if n, ok := r.nodes[tok]; ok {
		return n, nil
	}
	return nil, fmt.Errorf("%w: not issued here", auth.ErrTokenRefused)
}

// TestReviewedTokensBindNodes: tokens a reviewer accepts (a Kubernetes ServiceAccount token
// of a proxy's pod) admit their holder as the nodes the review names and no other; a token
// the reviewer refuses is Unauthenticated, one it could not check Unavailable (retried by
// the proxy), and a tokens file's tokens still work beside it.
func TestReviewedTokensBindNodes(t *testing.T) {
	dir := t.TempDir()
	tokens := writeFile(t, filepath.Join(dir, "tokens"), "proxy-b "+tokenB+"\n")
	addr, a := serve(t, auth.ServerConfig{TokensFile: tokens, Reviewer: reviewer{nodes: map[string][]string{tokenA: {"proxy-a"}}, down: "down-token-0123456789abcdef"}})
	if !strings.Contains(a.Summary(), "reviewed tokens") {
		t.Errorf("summary %q does not say tokens are reviewed", a.Summary())
	}
	none := dial(t, addr, auth.ClientConfig{})
	wantCode(t, "ADS without a token", ads(none, "proxy-a"), codes.Unauthenticated)
	asA := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "a"), tokenA)})
	wantCode(t, "ADS as proxy-a with its reviewed token", ads(asA, "proxy-a"), codes.OK)
	wantCode(t, "journal as proxy-a with its reviewed token", follow(asA, "proxy-a"), codes.OK)
	wantCode(t, "load report as proxy-a with its reviewed token", report(asA, "proxy-a"), codes.OK)
	wantCode(t, "load report as proxy-b with proxy-a's reviewed token", report(asA, "proxy-b"), codes.PermissionDenied)
	wrong := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "wrong"), "not-a-token-anyone-was-given")})
	wantCode(t, "ADS with a refused token", ads(wrong, "proxy-a"), codes.Unauthenticated)
	down := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "down"), "down-token-0123456789abcdef")})
	wantCode(t, "ADS while the reviewer is down", ads(down, "proxy-a"), codes.Unavailable)
	asB := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "b"), tokenB)})
	wantCode(t, "ADS as proxy-b with its listed token", ads(asB, "proxy-b"), codes.OK)
	got := a.Refused()
	if got["no_token"] != 1 || got["bad_token"] != 1 || got["wrong_node"] != 1 {
		t.Errorf("refusals %v, want no_token 1, bad_token 1, wrong_node 1", got)
	}
}

// TestTokenRotation: a tokens file and a proxy's token file are read again when they
// change; a removed token stops working without a restart.
func TestTokenRotation(t *testing.T) {
	dir := t.TempDir()
	tokens := writeFile(t, filepath.Join(dir, "tokens"), "proxy-a "+tokenA+"\n")
	addr, _ := serve(t, auth.ServerConfig{TokensFile: tokens})
	mine := writeFile(t, filepath.Join(dir, "a"), tokenA)
	conn := dial(t, addr, auth.ClientConfig{TokenFile: mine})
	wantCode(t, "ADS with the first token", ads(conn, "proxy-a"), codes.OK)

	// The operator issues a second token, the proxy switches, the first is withdrawn.
	writeFile(t, tokens, "proxy-a "+tokenA+"\nproxy-a "+tokenB+"\n")
	time.Sleep(1100 * time.Millisecond)
	writeFile(t, mine, tokenB)
	writeFile(t, tokens, "proxy-a "+tokenB+"\n")
	time.Sleep(1100 * time.Millisecond)
	wantCode(t, "ADS with the rotated token", ads(conn, "proxy-a"), codes.OK)
	old := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "old"), tokenA)})
	wantCode(t, "ADS with the withdrawn token", ads(old, "proxy-a"), codes.Unauthenticated)
}

// TestMutualTLS: a client without a certificate, with one from another CA, or claiming a
// node its certificate does not name is refused; a renewed server certificate is served
// to new connections without a restart.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := authtest.NewCA(dir, "fleet")
	must(t, err)
	srvPair, err := ca.Issue("cp", "control-plane", "127.0.0.1")
	must(t, err)
	pa, err := ca.Issue("proxy-a", "proxy-a")
	must(t, err)
	otherDir := t.TempDir()
	other, err := authtest.NewCA(otherDir, "other")
	must(t, err)
	forged, err := other.Issue("proxy-a", "proxy-a")
	must(t, err)
	addr, a := serve(t, auth.ServerConfig{CertFile: srvPair.CertFile, KeyFile: srvPair.KeyFile, ClientCAFile: ca.CertFile})

	plain := dial(t, addr, auth.ClientConfig{})
	if err := ads(plain, "proxy-a"); err == nil {
		t.Error("a plaintext client was served by a TLS listener")
	}
	noCert := dial(t, addr, auth.ClientConfig{CAFile: ca.CertFile})
	if err := ads(noCert, "proxy-a"); err == nil {
		t.Error("a client without a certificate was served")
	}
	bad := dial(t, addr, auth.ClientConfig{CAFile: ca.CertFile, CertFile: forged.CertFile, KeyFile: forged.KeyFile})
	if err := ads(bad, "proxy-a"); err == nil {
		t.Error("a client with another CA's certificate was served")
	}
	good := auth.ClientConfig{CAFile: ca.CertFile, CertFile: pa.CertFile, KeyFile: pa.KeyFile}
	asA := dial(t, addr, good)
	wantCode(t, "ADS as proxy-b with proxy-a's certificate", ads(asA, "proxy-b"), codes.PermissionDenied)
	wantCode(t, "load report as proxy-b with proxy-a's certificate", report(asA, "proxy-b"), codes.PermissionDenied)
	wantCode(t, "ADS as proxy-a", ads(asA, "proxy-a"), codes.OK)
	wantCode(t, "load report as proxy-a", report(asA, "proxy-a"), codes.OK)
	if a.Refused()["wrong_node"] != 2 {
		t.Errorf("refusals %v, want wrong_node 2", a.Refused())
	}

	// A client that trusts only the other CA refuses this control plane …
	distrust := dial(t, addr, auth.ClientConfig{CAFile: other.CertFile, CertFile: pa.CertFile, KeyFile: pa.KeyFile})
	if err := ads(distrust, "proxy-a"); err == nil {
		t.Error("a client trusting another CA accepted the control plane's certificate")
	}
	// … until the control plane's certificate is renewed from that CA in place.
	renewed, err := other.Issue("cp", "control-plane", "127.0.0.1")
	must(t, err)
	copyFile(t, renewed.KeyFile, srvPair.KeyFile)
	copyFile(t, renewed.CertFile, srvPair.CertFile)
	time.Sleep(1100 * time.Millisecond)
	fresh := dial(t, addr, auth.ClientConfig{CAFile: other.CertFile, CertFile: pa.CertFile, KeyFile: pa.KeyFile})
	wantCode(t, "ADS after the renewal", ads(fresh, "proxy-a"), codes.OK)
}

// TestTokenOverTLS: a token and TLS together, the way a proxy beyond loopback runs.
func TestTokenOverTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := authtest.NewCA(dir, "fleet")
	must(t, err)
	srvPair, err := ca.Issue("cp", "control-plane", "127.0.0.1", "cp.example")
	must(t, err)
	tokens := writeFile(t, filepath.Join(dir, "tokens"), "proxy-a "+tokenA+"\n")
	addr, _ := serve(t, auth.ServerConfig{CertFile: srvPair.CertFile, KeyFile: srvPair.KeyFile, TokensFile: tokens})
	tok := writeFile(t, filepath.Join(dir, "a"), tokenA)
	conn := dial(t, addr, auth.ClientConfig{CAFile: ca.CertFile, ServerName: "cp.example", TokenFile: tok})
	wantCode(t, "ADS as proxy-a over TLS", ads(conn, "proxy-a"), codes.OK)
	misnamed := dial(t, addr, auth.ClientConfig{CAFile: ca.CertFile, ServerName: "elsewhere.example", TokenFile: tok})
	if err := ads(misnamed, "proxy-a"); err == nil {
		t.Error("a control plane whose certificate does not carry the server name was trusted")
	}
}

// TestOpenOnlyOnLoopback: a listener or a dial beyond loopback without credentials is
// refused unless asked for with Insecure; on loopback it is allowed.
func TestOpenOnlyOnLoopback(t *testing.T) {
	dir := t.TempDir()
	tokens := writeFile(t, filepath.Join(dir, "tokens"), "proxy-a "+tokenA+"\n")
	ca, err := authtest.NewCA(dir, "fleet")
	must(t, err)
	pair, err := ca.Issue("cp", "cp")
	must(t, err)
	for _, c := range []struct {
		listen string
		cfg    auth.ServerConfig
		ok     bool
	}{
		{"127.0.0.1:18000", auth.ServerConfig{}, true},
		{"[::1]:18000", auth.ServerConfig{}, true},
		{"localhost:18000", auth.ServerConfig{}, true},
		{":18000", auth.ServerConfig{}, false},
		{"0.0.0.0:18000", auth.ServerConfig{}, false},
		{"10.0.0.5:18000", auth.ServerConfig{TokensFile: tokens}, false},                             // tokens in the clear
		{"10.0.0.5:18000", auth.ServerConfig{CertFile: pair.CertFile, KeyFile: pair.KeyFile}, false}, // TLS, but anyone may connect
		{"10.0.0.5:18000", auth.ServerConfig{CertFile: pair.CertFile, KeyFile: pair.KeyFile, TokensFile: tokens}, true},
		{"10.0.0.5:18000", auth.ServerConfig{CertFile: pair.CertFile, KeyFile: pair.KeyFile, ClientCAFile: ca.CertFile}, true},
		{"0.0.0.0:18000", auth.ServerConfig{Insecure: true}, true},
		{"127.0.0.1:18000", auth.ServerConfig{CertFile: pair.CertFile}, false}, // no key
		{"127.0.0.1:18000", auth.ServerConfig{ClientCAFile: ca.CertFile}, false},
		{"127.0.0.1:18000", auth.ServerConfig{TokensFile: filepath.Join(dir, "missing")}, false},
		{"127.0.0.1:18000", auth.ServerConfig{TokensFile: writeFile(t, filepath.Join(dir, "short"), "proxy-a short\n")}, false},
		{"127.0.0.1:18000", auth.ServerConfig{TokensFile: writeFile(t, filepath.Join(dir, "shared"), "proxy-a "+tokenA+"\nproxy-b "+tokenA+"\n")}, false},
	} {
		_, err := auth.NewServer(c.cfg, c.listen, quiet())
		if (err == nil) != c.ok {
			t.Errorf("listener %s %+v: err %v, want ok=%v", c.listen, c.cfg, err, c.ok)
		}
	}
	for _, c := range []struct {
		target string
		cfg    auth.ClientConfig
		ok     bool
	}{
		{"127.0.0.1:18000", auth.ClientConfig{}, true},
		{"cp.example:18000", auth.ClientConfig{}, false},
		{"cp.example:18000", auth.ClientConfig{TokenFile: tokens}, false}, // a token in the clear
		{"cp.example:18000", auth.ClientConfig{CAFile: ca.CertFile}, true},
		{"cp.example:18000", auth.ClientConfig{Insecure: true}, true},
		{"cp.example:18000", auth.ClientConfig{CAFile: ca.CertFile, CertFile: pair.CertFile}, false},
	} {
		_, err := c.cfg.DialOptions(c.target, quiet())
		if (err == nil) != c.ok {
			t.Errorf("dial %s %+v: err %v, want ok=%v", c.target, c.cfg, err, c.ok)
		}
	}
}

// TestChangedFileThatDoesNotParseKeepsThePrevious: a tokens file rewritten with garbage
// keeps serving the tokens it had.
func TestChangedFileThatDoesNotParseKeepsThePrevious(t *testing.T) {
	dir := t.TempDir()
	tokens := writeFile(t, filepath.Join(dir, "tokens"), "proxy-a "+tokenA+"\n")
	addr, _ := serve(t, auth.ServerConfig{TokensFile: tokens})
	writeFile(t, tokens, "this line has three words\n")
	time.Sleep(1100 * time.Millisecond)
	conn := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "a"), tokenA)})
	wantCode(t, "ADS after a broken tokens file", ads(conn, "proxy-a"), codes.OK)
}

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:1": true, "127.1.2.3:1": true, "[::1]:1": true, "localhost:1": true, "LOCALHOST": true,
		":1": false, "0.0.0.0:1": false, "[::]:1": false, "10.0.0.1:1": false, "localhost.example:1": false,
	} {
		if got := auth.IsLoopback(addr); got != want {
			t.Errorf("IsLoopback(%q) = %v", addr, got)
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	must(t, err)
	if strings.HasSuffix(to, ".pem") {
		must(t, os.WriteFile(to+".tmp", b, 0o600))
		must(t, os.Rename(to+".tmp", to))
	}
}

// TestWithdrawnTokenEndsOpenStreams: a stream opened with a token that is then removed from
// the tokens file is refused at its next message.
func TestWithdrawnTokenEndsOpenStreams(t *testing.T) {
	dir := t.TempDir()
	tokens := writeFile(t, filepath.Join(dir, "tokens"), "proxy-a "+tokenA+"\nproxy-b "+tokenB+"\n")
	addr, a := serve(t, auth.ServerConfig{TokensFile: tokens})
	conn := dial(t, addr, auth.ClientConfig{TokenFile: writeFile(t, filepath.Join(dir, "a"), tokenA)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := xdsv1.NewLoadReportingClient(conn).Report(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&xdsv1.LoadReport{NodeId: "proxy-a", Seq: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	writeFile(t, tokens, "proxy-b "+tokenB+"\n")
	time.Sleep(1100 * time.Millisecond)
	_ = st.Send(&xdsv1.LoadReport{NodeId: "proxy-a", Seq: 2})
	_, err = st.Recv()
	for err == nil {
		_, err = st.Recv()
	}
	wantCode(t, "a load report after the token was withdrawn", err, codes.Unauthenticated)
	if a.Refused()["revoked"] != 1 {
		t.Errorf("refusals %v, want revoked 1", a.Refused())
	}
}
