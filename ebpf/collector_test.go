package ebpf

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrelay/kvrelay/ebpf/probes"
)

func TestParseMode(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Mode
		err  bool
	}{{"auto", ModeAuto, false}, {"ON", ModeOn, false}, {"off", ModeOff, false}, {"yes", "", true}} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseMode(tc.in)
			if (err != nil) != tc.err || got != tc.want {
				t.Errorf("ParseMode(%q) = %q, %v", tc.in, got, err)
			}
		})
	}
}

func TestResolve(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"127.0.0.1:8001", "127.0.0.1:8001"},
		{"http://127.0.0.1:8002/v1", "127.0.0.1:8002"},
		{"localhost:9", "127.0.0.1:9"},
		{"[::1]:80", ""},
		{"nope", ""},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := resolve(tc.in)
			if tc.want == "" {
				if err == nil {
					t.Errorf("resolve(%q) = %v, want an error", tc.in, got)
				}
				return
			}
			if err != nil || got.String() != tc.want {
				t.Errorf("resolve(%q) = %v, %v; want %s", tc.in, got, err, tc.want)
			}
		})
	}
}

// gather returns the metric families of c by name.
func gather(t *testing.T, c prometheus.Collector) map[string]*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

func active(mfs map[string]*dto.MetricFamily) map[string]float64 {
	out := map[string]float64{}
	for _, m := range mfs["kvrelay_ebpf_probe_active"].GetMetric() {
		out[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
	}
	return out
}

func TestOffExportsInactiveProbes(t *testing.T) {
	c := New(Config{Mode: ModeOff, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err := c.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.SetTargets([]Target{{Addr: "127.0.0.1:1", Worker: "w0", Pool: "agg"}}); err != nil {
		t.Fatal(err)
	}
	got := active(gather(t, c))
	for _, p := range Probes {
		if v, ok := got[p]; !ok || v != 0 {
			t.Errorf("probe %s active = %v (present %v), want 0", p, v, ok)
		}
	}
}

// TestCollector runs every probe against an HTTP engine that answers after 50 ms and checks
// that each metric has observations attributed to the worker.
func TestCollector(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("attaching eBPF probes needs root")
	}
	const delay = 50 * time.Millisecond
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(delay)
		io.WriteString(w, "ok")
	}))
	defer srv.Close()
	c := New(Config{Mode: ModeOn, SampleInterval: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err := c.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for p, ok := range c.Active() {
		if !ok {
			t.Errorf("probe %s inactive", p)
		}
	}
	if err := c.SetTargets([]Target{{Addr: srv.URL, Worker: "w0", Pool: "decode"}}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetProcesses([]Process{{PID: os.Getpid(), Worker: "w0", Pool: "decode"}}); err != nil {
		t.Fatal(err)
	}
	// New connections (no keep-alive) so connects are seen too.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DialContext: (&net.Dialer{}).DialContext}}
	for range 20 { // a new connection each: its RTT callback is armed for its first sample
		resp, err := client.Post(srv.URL, "application/json", strings.NewReader(`{"prompt":"hi"}`))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	time.Sleep(100 * time.Millisecond) // a few accept-queue samples
	mfs := gather(t, c)
	for _, name := range []string{"kvrelay_ebpf_tcp_srtt_seconds", "kvrelay_ebpf_tcp_connect_seconds",
		"kvrelay_ebpf_first_byte_seconds", "kvrelay_ebpf_runq_latency_seconds", "kvrelay_ebpf_listen_queue_depth"} {
		mf := mfs[name]
		if mf == nil || len(mf.GetMetric()) != 1 {
			t.Errorf("%s: %v", name, mf)
			continue
		}
		m := mf.GetMetric()[0]
		var labels []string
		for _, l := range m.GetLabel() {
			labels = append(labels, l.GetName()+"="+l.GetValue())
		}
		if got := strings.Join(labels, ","); got != "pool=decode,worker=w0" {
			t.Errorf("%s labels %s", name, got)
		}
		if m.GetHistogram().GetSampleCount() == 0 {
			t.Errorf("%s: no observations", name)
		}
	}
	if h := mfs["kvrelay_ebpf_first_byte_seconds"].GetMetric()[0].GetHistogram(); h.GetSampleCount() >= 20 {
		if mean := h.GetSampleSum() / float64(h.GetSampleCount()); mean < delay.Seconds() {
			t.Errorf("mean first byte %.3fs with a %v engine delay", mean, delay)
		}
	} else {
		t.Errorf("first byte observations %d, want ≥ 20", h.GetSampleCount())
	}
	// The recent (windowed) first byte, and the load signal: alone in its pool, w0 has no
	// faster peer to be compared with.
	if mf := mfs["kvrelay_ebpf_first_byte_recent_seconds"]; mf == nil || len(mf.GetMetric()) != 1 || mf.GetMetric()[0].GetGauge().GetValue() < delay.Seconds() {
		t.Errorf("kvrelay_ebpf_first_byte_recent_seconds: %v, want one series ≥ %v", mf, delay)
	}
	if n, ok := c.FirstByteWaiting("w0"); n != 0 || !ok {
		t.Errorf("FirstByteWaiting(w0) = %d, %v; want 0, true", n, ok)
	}
}

// TestPartialAttach: a probe that cannot attach (here the socket probes, given a cgroup that
// does not exist) is inactive while the others run.
func TestPartialAttach(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("attaching eBPF probes needs root")
	}
	c := New(Config{Mode: ModeOn, CgroupPath: t.TempDir() + "/no-such-cgroup", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err := c.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got := active(gather(t, c))
	want := map[string]float64{ProbeTCPRTT: 0, ProbeFirstByte: 0, ProbeTCPState: 1, ProbeListenQueue: 1, ProbeRunQueue: 1}
	for p, v := range want {
		if got[p] != v {
			t.Errorf("probe %s active = %v, want %v", p, got[p], v)
		}
	}
}

// TestAcceptQueueSignal: connections an engine has not accepted show in AcceptQueue (the
// control plane's kernel load signal) and in kvrelay_ebpf_listen_queue_length.
func TestAcceptQueueSignal(t *testing.T) {
	needRoot(t)
	ln := listen4(t)
	c := startCollector(t, Config{Mode: ModeOn, SampleInterval: 10 * time.Millisecond})
	if err := c.SetTargets([]Target{{Addr: ln.Addr().String(), Worker: "w1", Pool: "prefill"}}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		conn, err := net.Dial("tcp4", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		if n, ok := c.AcceptQueue("w1"); ok && n == 3 {
			break
		}
		if time.Now().After(deadline) {
			n, ok := c.AcceptQueue("w1")
			t.Fatalf("AcceptQueue(w1) = %d, %v; want 3", n, ok)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, ok := c.AcceptQueue("nobody"); ok {
		t.Error("AcceptQueue of an unknown worker reported")
	}
	mf := gather(t, c)["kvrelay_ebpf_listen_queue_length"]
	if mf == nil || mf.GetMetric()[0].GetGauge().GetValue() != 3 {
		t.Errorf("kvrelay_ebpf_listen_queue_length: %v", mf)
	}
}

func TestProbeSelection(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("attaching eBPF probes needs root")
	}
	c := New(Config{Mode: ModeOn, Probes: []string{ProbeRunQueue, ProbeFirstByte}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err := c.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	want := map[string]bool{ProbeRunQueue: true, ProbeFirstByte: true, ProbeTCPRTT: false, ProbeTCPState: false, ProbeListenQueue: false}
	for p, on := range c.Active() {
		if on != want[p] {
			t.Errorf("probe %s active = %v, want %v", p, on, want[p])
		}
	}
}

// ownCgroup is the cgroup v2 directory of this process.
func ownCgroup(t *testing.T) string {
	t.Helper()
	dir, err := probes.OwnCgroupV2()
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// postAndAnswer has from send a POST to to, and to answer it after delay.
func postAndAnswer(t *testing.T, from, to net.Conn, delay time.Duration) {
	t.Helper()
	req := "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
	if _, err := io.WriteString(from, req); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(req))
	if _, err := io.ReadFull(to, buf); err != nil {
		t.Fatal(err)
	}
	time.Sleep(delay)
	resp := "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
	if _, err := io.WriteString(to, resp); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(from, make([]byte, len(resp))); err != nil {
		t.Fatal(err)
	}
}

func firstByteCount(t *testing.T, c *Collector, worker string) uint64 {
	t.Helper()
	for _, m := range gather(t, c)["kvrelay_ebpf_first_byte_seconds"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "worker" && l.GetValue() == worker {
				return m.GetHistogram().GetSampleCount()
			}
		}
	}
	return 0
}

// TestDialScope: with the socket probes in the dial scope, a request on a connection dialed
// after EnterDialScope is timed and one sent on a connection accepted from a listener opened
// before is not (without the scope both would be); Close moves the process back and removes
// the scope.
func TestDialScope(t *testing.T) {
	needRoot(t)
	ln := listen4(t) // opened before: a proxy's client listener
	before := ownCgroup(t)
	c := startCollector(t, Config{Mode: ModeOn, DialScope: true, Probes: []string{ProbeFirstByte}})
	scope := dialPrefix + strconv.Itoa(os.Getpid())
	if filepath.Base(c.SocketCgroup()) != scope {
		t.Skipf("no dial scope here (socket probes on %s)", c.SocketCgroup())
	}
	if err := c.EnterDialScope(0); err != nil {
		t.Fatal(err)
	}
	if filepath.Base(c.SocketCgroup()) != scope {
		t.Skipf("this process cannot enter a child cgroup here (the probes fell back to %s)", c.SocketCgroup())
	}
	if got := ownCgroup(t); filepath.Base(got) != scope {
		t.Fatalf("in cgroup %s after EnterDialScope, want %s", got, scope)
	}
	dialed, err := net.Dial("tcp4", ln.Addr().String()) // made inside the scope
	if err != nil {
		t.Fatal(err)
	}
	defer dialed.Close()
	accepted, err := ln.Accept() // a clone of the listener, outside
	if err != nil {
		t.Fatal(err)
	}
	defer accepted.Close()
	// Watch both directions: the listener's port (requests the dialed side sends) and the
	// dialed side's own port (requests the accepted side sends it).
	if err := c.SetTargets([]Target{
		{Addr: ln.Addr().String(), Worker: "dialed", Pool: "agg"},
		{Addr: dialed.LocalAddr().String(), Worker: "accepted", Pool: "agg"},
	}); err != nil {
		t.Fatal(err)
	}
	const delay = 20 * time.Millisecond
	for range 3 {
		postAndAnswer(t, dialed, accepted, delay)
		postAndAnswer(t, accepted, dialed, delay)
	}
	if n := firstByteCount(t, c, "dialed"); n != 3 {
		t.Errorf("requests timed on the dialed connection: %d, want 3", n)
	}
	if n := firstByteCount(t, c, "accepted"); n != 0 {
		t.Errorf("requests timed on the accepted connection: %d, want 0 (it is outside the scope)", n)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if got := ownCgroup(t); got != before {
		t.Errorf("in cgroup %s after Close, want %s", got, before)
	}
	if _, err := os.Stat(filepath.Join(before, scope)); !os.IsNotExist(err) {
		t.Errorf("dial scope still there after Close: %v", err)
	}
}

// TestDialScopeFallback: when the process cannot be moved into the dial scope, the socket
// probes move to its parent and see every connection there.
func TestDialScopeFallback(t *testing.T) {
	needRoot(t)
	ln := listen4(t)
	c := startCollector(t, Config{Mode: ModeOn, DialScope: true, Probes: []string{ProbeFirstByte}})
	inScope := c.SocketCgroup()
	if !strings.HasPrefix(filepath.Base(inScope), dialPrefix) {
		t.Skipf("no dial scope here (socket probes on %s)", inScope)
	}
	// No process has the PID pid_max (PIDs stay below it), and none can be moved.
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	noPID, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnterDialScope(noPID); err != nil {
		t.Fatal(err)
	}
	if got := c.SocketCgroup(); got != filepath.Dir(inScope) {
		t.Fatalf("socket probes on %s after a failed move, want the parent %s", got, filepath.Dir(inScope))
	}
	if _, err := os.Stat(inScope); !os.IsNotExist(err) {
		t.Errorf("dial scope still there after the fallback: %v", err)
	}
	dialed, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer dialed.Close()
	accepted, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer accepted.Close()
	if err := c.SetTargets([]Target{{Addr: ln.Addr().String(), Worker: "w", Pool: "agg"}}); err != nil {
		t.Fatal(err)
	}
	postAndAnswer(t, dialed, accepted, 5*time.Millisecond)
	if n := firstByteCount(t, c, "w"); n != 1 {
		t.Errorf("requests timed after the fallback: %d, want 1", n)
	}
}

// needRoot skips the test where the process may not attach eBPF programs.
func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("attaching eBPF probes needs root")
	}
}

// listen4 opens a loopback listener, closed with the test.
func listen4(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// startCollector starts a collector with cfg (its log discarded), closed with the test.
func startCollector(t *testing.T, cfg Config) *Collector {
	t.Helper()
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	c := New(cfg)
	if err := c.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestDialScopeNotKept: a dial scope that cannot be made (its parent is missing), or one that
// no socket probe could attach to (its parent is a plain directory, not a cgroup), is not
// kept: the socket probes' cgroup is the configured one and nothing is left behind.
func TestDialScopeNotKept(t *testing.T) {
	needRoot(t)
	plain := t.TempDir()
	for _, parent := range []string{filepath.Join(plain, "missing"), plain} {
		c := startCollector(t, Config{Mode: ModeOn, CgroupPath: parent, DialScope: true})
		if got := c.SocketCgroup(); got != parent {
			t.Errorf("socket probes on %s, want %s", got, parent)
		}
		if c.Active()[ProbeFirstByte] || c.Active()[ProbeTCPRTT] {
			t.Errorf("socket probes active on %s: %v", parent, c.Active())
		}
		if err := c.EnterDialScope(0); err != nil {
			t.Errorf("EnterDialScope without a scope: %v", err)
		}
		if _, err := os.Stat(filepath.Join(parent, dialPrefix+strconv.Itoa(os.Getpid()))); !os.IsNotExist(err) {
			t.Errorf("a dial scope was left under %s: %v", parent, err)
		}
		if got := ownCgroup(t); strings.HasPrefix(filepath.Base(got), dialPrefix) {
			t.Errorf("the process entered %s", got)
		}
	}
}
