//go:build linux

// Package kubetest runs a real kube-apiserver and etcd on loopback for tests of Kubernetes
// behaviour that the fake clientset does not have: Lease-based leader election, watches,
// resourceVersion conflicts, subresources such as scale, RBAC, CRDs.
//
// Start needs the binaries that hack/kube-testenv.sh installs; a test skips without them.
// Each Env is its own cluster (etcd data in t.TempDir, free ports), 3 to 5 s to start, and
// both processes are killed in t.Cleanup.
//
// It is an API server and nothing else: no controller-manager, scheduler or kubelet. So a
// Deployment makes no ReplicaSet and a Namespace never finishes deleting, and no "default"
// ServiceAccount is made: the ServiceAccount admission plugin is off, so Pods can be created.
package kubetest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// adminToken is the static bearer token of the user "admin" in group system:masters.
const adminToken = "kubetest-admin"

// startTimeout bounds how long etcd and then kube-apiserver may take to become ready.
const startTimeout = 60 * time.Second

// Env is one running cluster.
type Env struct {
	host   string
	caPEM  []byte
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	config *rest.Config
}

// BinDir is where Start looks for etcd and kube-apiserver: $KVRELAY_KUBE_BIN if set, else
// the cache hack/kube-testenv.sh fills,
// ${KVRELAY_KUBE_CACHE:-$HOME/.cache/kvrelay/kube}/<Release>/bin.
func BinDir() string {
	if dir := os.Getenv("KVRELAY_KUBE_BIN"); dir != "" {
		return dir
	}
	cache := os.Getenv("KVRELAY_KUBE_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir() // "" then: the binaries are not found and the test skips
		cache = filepath.Join(home, ".cache", "kvrelay", "kube")
	}
	return filepath.Join(cache, Release, "bin")
}

// Start runs etcd and kube-apiserver for t and returns once the API server's /readyz
// passes. Without the binaries it skips t, or fails it where KVRELAY_KUBE_REQUIRE is set
// (CI, where a skip would hide that the suite did not run).
func Start(t testing.TB) *Env {
	t.Helper()
	bin := BinDir()
	etcdBin, apiBin := filepath.Join(bin, "etcd"), filepath.Join(bin, "kube-apiserver")
	for _, p := range []string{etcdBin, apiBin} {
		if _, err := os.Stat(p); err != nil {
			msg := fmt.Sprintf("kubetest: no %s: run hack/kube-testenv.sh to install etcd and build kube-apiserver %s, or set KVRELAY_KUBE_BIN", p, Release)
			if os.Getenv("KVRELAY_KUBE_REQUIRE") != "" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
	}
	begin := time.Now()
	dir := t.TempDir()
	e := &Env{}
	e.writePKI(t, dir)

	var etcdURL string
	launch(t, "etcd", http.DefaultClient, func(attempt int) (*proc, string) {
		etcdURL = "http://127.0.0.1:" + strconv.Itoa(freePort(t))
		peerURL := "http://127.0.0.1:" + strconv.Itoa(freePort(t))
		etcd := startProc(t, dir, attemptName("etcd", attempt), etcdBin, etcdArgs(dir, attemptName("etcd", attempt), etcdURL, peerURL)...)
		return etcd, etcdURL + "/health"
	})

	e.config = &rest.Config{
		BearerToken:     adminToken,
		TLSClientConfig: rest.TLSClientConfig{CAData: e.caPEM},
	}
	setLimits(e.config)
	hc, err := rest.HTTPClientFor(e.config)
	if err != nil {
		t.Fatalf("kubetest: HTTP client: %v", err)
	}
	launch(t, "kube-apiserver", hc, func(attempt int) (*proc, string) {
		apiPort := freePort(t)
		e.host = "https://127.0.0.1:" + strconv.Itoa(apiPort)
		api := startProc(t, dir, attemptName("kube-apiserver", attempt), apiBin,
			"--etcd-servers="+etcdURL,
			"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(apiPort),
			// The "kubernetes" Service's endpoints would be the advertise address, and loopback
			// is not a valid endpoint: leave them out rather than log an error every few seconds.
			"--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
			"--tls-cert-file="+filepath.Join(dir, "serving.crt"),
			"--tls-private-key-file="+filepath.Join(dir, "serving.key"),
			"--client-ca-file="+filepath.Join(dir, "ca.crt"),
			"--token-auth-file="+filepath.Join(dir, "tokens.csv"),
			"--authorization-mode=RBAC",
			"--service-account-issuer=https://kubernetes.default.svc",
			"--service-account-key-file="+filepath.Join(dir, "sa.key"),
			"--service-account-signing-key-file="+filepath.Join(dir, "sa.key"),
			"--service-cluster-ip-range=10.0.0.0/24",
			"--disable-admission-plugins=ServiceAccount",
			"--profiling=false")
		return api, e.host + "/readyz"
	})
	e.config.Host = e.host
	t.Logf("kubetest: kube-apiserver %s ready at %s in %v", Release, e.host, time.Since(begin).Round(time.Millisecond))
	return e
}

// etcdArgs are the flags of a one-member etcd named name, with its data in dir/name.
func etcdArgs(dir, name, clientURL, peerURL string) []string {
	return []string{
		"--name=kubetest",
		"--data-dir=" + filepath.Join(dir, name),
		"--listen-client-urls=" + clientURL, "--advertise-client-urls=" + clientURL,
		"--listen-peer-urls=" + peerURL, "--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=kubetest=" + peerURL,
		// A single member needs no election timeout against peers: elect itself
		// in tens of milliseconds rather than the default second.
		"--heartbeat-interval=10", "--election-timeout=100",
		// The API server's watch caches move forward on etcd's progress notifications when
		// nothing is written to a resource; at etcd's default of 10 minutes, a list that
		// must be as fresh as a write it knows of (an admission policy's informer starting)
		// waits on them and times out again and again on a loaded machine.
		"--experimental-watch-progress-notify-interval=1s",
		"--logger=zap", "--log-level=warn",
	}
}

// Config returns a new copy of the administrator's client configuration: the user "admin" in
// group system:masters, whom RBAC allows everything.
func (e *Env) Config() *rest.Config { return rest.CopyConfig(e.config) }

// Clientset returns a typed client as the administrator.
func (e *Env) Clientset(t testing.TB) *kubernetes.Clientset {
	t.Helper()
	return clientset(t, e.config)
}

// ConfigFor returns a client configuration that authenticates as user in groups, by a client
// certificate that the cluster's CA signs now: for RBAC tests. Such a user may do nothing
// until a Role or ClusterRole binding allows it (system:authenticated's discovery aside).
func (e *Env) ConfigFor(t testing.TB, user string, groups ...string) *rest.Config {
	t.Helper()
	certPEM, keyPEM := e.issue(t, &x509.Certificate{
		Subject:     pkix.Name{CommonName: user, Organization: groups},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	cfg := &rest.Config{
		Host:            e.host,
		TLSClientConfig: rest.TLSClientConfig{CAData: e.caPEM, CertData: certPEM, KeyData: keyPEM},
	}
	setLimits(cfg)
	return cfg
}

// ClientsetFor returns a typed client authenticated as ConfigFor's user.
func (e *Env) ClientsetFor(t testing.TB, user string, groups ...string) *kubernetes.Clientset {
	t.Helper()
	return clientset(t, e.ConfigFor(t, user, groups...))
}

func clientset(t testing.TB, cfg *rest.Config) *kubernetes.Clientset {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatalf("kubetest: clientset: %v", err)
	}
	return cs
}

// setLimits lifts client-go's default client-side rate limit (5 requests/s, bursts of 10),
// which would pace a test's setup rather than test anything.
func setLimits(cfg *rest.Config) {
	cfg.QPS, cfg.Burst = 1000, 1000
}

// writePKI makes the cluster's CA, the API server's serving certificate, the admin's static
// token and the service-account signing key, as files in dir.
func (e *Env) writePKI(t testing.TB, dir string) {
	t.Helper()
	e.caKey = newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kubetest-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &e.caKey.PublicKey, e.caKey)
	if err != nil {
		t.Fatalf("kubetest: CA certificate: %v", err)
	}
	if e.ca, err = x509.ParseCertificate(der); err != nil {
		t.Fatalf("kubetest: CA certificate: %v", err)
	}
	e.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})

	servingPEM, servingKeyPEM := e.issue(t, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "kube-apiserver"},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	saKey, err := x509.MarshalECPrivateKey(newKey(t))
	if err != nil {
		t.Fatalf("kubetest: service-account key: %v", err)
	}
	files := map[string][]byte{
		"ca.crt":      e.caPEM,
		"serving.crt": servingPEM,
		"serving.key": servingKeyPEM,
		// token,user,uid,"group,..."
		"tokens.csv": []byte(adminToken + ",admin,admin,system:masters\n"),
		"sa.key":     pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: saKey}),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatalf("kubetest: %v", err)
		}
	}
}

// issue signs tmpl (subject, names and usages set) with the cluster's CA for a fresh key and
// returns the certificate and key as PEM.
func (e *Env) issue(t testing.TB, tmpl *x509.Certificate) (certPEM, keyPEM []byte) {
	t.Helper()
	key := newKey(t)
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatalf("kubetest: serial: %v", err)
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore, tmpl.NotAfter = e.ca.NotBefore, e.ca.NotAfter
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, e.ca, &key.PublicKey, e.caKey)
	if err != nil {
		t.Fatalf("kubetest: certificate for %s: %v", tmpl.Subject.CommonName, err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatalf("kubetest: key for %s: %v", tmpl.Subject.CommonName, err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("kubetest: key: %v", err)
	}
	return key
}

// bindAttempts is how many times launch starts a process that lost one of its ports.
const bindAttempts = 5

// launch starts a process with start, which picks its ports, and waits until the URL it
// returns answers 200. freePort's ports are free when picked, not reserved: a process of
// another test may bind one first, and the new process then exits. launch starts it again on
// fresh ports when its log says so, and fails t on any other exit or after bindAttempts.
func launch(t testing.TB, name string, hc *http.Client, start func(attempt int) (*proc, string)) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		p, url := start(attempt)
		err := waitFor(p, hc, url)
		if err == nil {
			return
		}
		if attempt < bindAttempts && p.lostPort() {
			t.Logf("kubetest: %s lost a port to another process (attempt %d); starting it on others", name, attempt)
			continue
		}
		t.Fatal(err)
	}
}

// attemptName names the log (and data directory) of a process's attempt-th start.
func attemptName(name string, attempt int) string {
	if attempt == 1 {
		return name
	}
	return name + "." + strconv.Itoa(attempt)
}

// freePort returns a loopback TCP port that nothing listens on now, picked outside the
// kernel's ephemeral range (ip_local_port_range) where it can: the ports that outgoing
// connections and the suite's many ":0" listeners are given come from that range, and taking
// one of those between the pick and the bind is what makes a process lose its port.
func freePort(t testing.TB) int {
	t.Helper()
	if lo, ok := ephemeralLow(); ok && lo > 2048 {
		for range 32 {
			port := 1024 + mrand.IntN(lo-1024)
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
			if err == nil {
				l.Close()
				return port
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("kubetest: free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// ephemeralLow returns the first port of the kernel's ephemeral range, where Linux says.
func ephemeralLow() (int, bool) {
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(data))
	if len(f) != 2 {
		return 0, false
	}
	lo, err := strconv.Atoi(f[0])
	return lo, err == nil
}

// proc is a started etcd or kube-apiserver.
type proc struct {
	name string
	log  string        // its stdout and stderr
	done chan struct{} // closed when it has exited
	err  error         // how it exited, once done is closed
}

// startProc runs bin with args, its output in dir/<name>.log, in a process group of its own
// that the kernel kills should the test binary die (Pdeathsig). t.Cleanup kills the group and
// waits for it, and when t failed logs the end of the output.
func startProc(t testing.TB, dir, name, bin string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, log: filepath.Join(dir, name+".log"), done: make(chan struct{})}
	f, err := os.Create(p.log)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("kubetest: starting %s: %v", name, err)
	}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		// SIGKILL, not SIGTERM: the data dies with the test, and a graceful API server
		// shutdown takes seconds. Registered after t.TempDir, so it runs before the removal.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			t.Logf("kubetest: %s output (end):\n%s", name, tail(p.log, 40))
		}
	})
	return p
}

// waitFor polls url with hc until it answers 200. It returns why not if p exits first or
// startTimeout passes.
func waitFor(p *proc, hc *http.Client, url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		// Each poll is bounded so that an exit is seen: the port may belong to another
		// process that accepts the connection and never answers.
		pollCtx, pollCancel := context.WithTimeout(ctx, 2*time.Second)
		last = get(pollCtx, hc, url)
		pollCancel()
		if last == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("kubetest: %s exited before %s answered (%v)", p.name, url, p.err)
		case <-ctx.Done():
			return fmt.Errorf("kubetest: %s not ready after %v: %v", p.name, startTimeout, last)
		case <-tick.C:
		}
	}
}

// lostPort reports whether p has exited because a port it was to listen on was taken.
func (p *proc) lostPort() bool {
	select {
	case <-p.done:
	default:
		return false
	}
	return strings.Contains(tail(p.log, 40), "address already in use")
}

// get returns nil when url answers 200, else why not.
func get(ctx context.Context, hc *http.Client, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		// /readyz lists the checks that fail ("[-]poststarthook/... failed").
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		return fmt.Errorf("%s: %s", resp.Status, body)
	}
	return nil
}

// tail returns the last n lines of the file at path.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
