package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/ebpf"
	"github.com/kvrelay/kvrelay/ebpf/probes"
)

func TestEBPFPool(t *testing.T) {
	for _, tc := range []struct{ role, want string }{
		{"prefill", "prefill"}, {"decode", "decode"}, {"both", "agg"}, {"", "agg"},
	} {
		if got := ebpfPool(tc.role); got != tc.want {
			t.Errorf("ebpfPool(%q) = %q, want %q", tc.role, got, tc.want)
		}
	}
	for r, want := range map[route.Role]string{route.RolePrefill: "prefill", route.RoleDecode: "decode", route.RoleBoth: "agg"} {
		if got := routeRolePool(r); got != want {
			t.Errorf("routeRolePool(%v) = %q, want %q", r, got, want)
		}
	}
}

func TestStartEBPF(t *testing.T) {
	if _, err := startEBPF(context.Background(), ebpfFlags{mode: "maybe"}, func() []ebpf.Target { return nil }, nil); err == nil {
		t.Error("--ebpf maybe accepted")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c, err := startEBPF(ctx, ebpfFlags{mode: "off", cgroup: ebpfCgroupDial}, func() []ebpf.Target { return []ebpf.Target{{Addr: "127.0.0.1:1", Worker: "w0", Pool: "agg"}} }, nil)
	if err != nil {
		t.Fatal(err)
	}
	for p, on := range c.Active() {
		if on {
			t.Errorf("--ebpf off: probe %s active", p)
		}
	}
}

func TestEBPFFlagsConfig(t *testing.T) {
	for _, tc := range []struct {
		f    ebpfFlags
		dial bool
		path string
		err  bool
	}{
		{ebpfFlags{mode: "on", cgroup: "dial"}, true, "", false},
		{ebpfFlags{mode: "auto", cgroup: "own"}, false, "", false},
		{ebpfFlags{mode: "on", cgroup: "/sys/fs/cgroup/kvrelay"}, false, "/sys/fs/cgroup/kvrelay", false},
		{ebpfFlags{mode: "on", cgroup: "kvrelay"}, false, "", true},
		{ebpfFlags{mode: "sometimes", cgroup: "dial"}, false, "", true},
	} {
		cfg, err := tc.f.config()
		if (err != nil) != tc.err || err == nil && (cfg.DialScope != tc.dial || cfg.CgroupPath != tc.path) {
			t.Errorf("%+v: config %+v, %v", tc.f, cfg, err)
		}
	}
}

// TestProxyDialScope: `kvrelay proxy --ebpf on` (default --ebpf-cgroup dial) enters its dial
// scope once it listens, times each request it sends the engine, and leaves the scope (and
// removes it) when it stops.
func TestProxyDialScope(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("attaching eBPF probes needs root")
	}
	const answer = `{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}`
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		time.Sleep(10 * time.Millisecond)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	}))
	defer engine.Close()
	before := selfCgroup(t)
	pr, pw := io.Pipe()
	cmd := newRootCmd()
	cmd.SetArgs([]string{"proxy", "--listen", "127.0.0.1:0", "--ebpf", "on", "--policy", "round-robin", "--upstream", "id=w1,url=" + engine.URL + ",model=m"})
	cmd.SetOut(pw)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx); pw.Close() }()
	stopped := false
	t.Cleanup(func() { // the process must have left the scope before the next test
		if !stopped {
			cancel()
			<-done
		}
	})
	sc := bufio.NewScanner(pr)
	var base string
	for sc.Scan() {
		if m := regexp.MustCompile(`^kvrelay proxy on (http://\S+)/v1`).FindStringSubmatch(sc.Text()); m != nil {
			base = m[1]
			break
		}
	}
	go io.Copy(io.Discard, pr)
	if base == "" {
		cancel()
		stopped = true
		t.Fatalf("proxy did not start: %v", <-done)
	}
	in := selfCgroup(t)
	scoped := strings.HasPrefix(path.Base(in), "kvrelay-dial.")
	if !scoped {
		t.Logf("no dial scope here (in %s): the probes watch the process's cgroup", in)
	}
	const n = 5
	for range n {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := regexp.MustCompile(`(?m)^kvrelay_ebpf_first_byte_seconds_count\{pool="agg",worker="w1"\} (\d+)$`).FindSubmatch(metrics)
	if m == nil || string(m[1]) != strconv.Itoa(n) {
		t.Errorf("first_byte count %q, want %d (the requests the proxy sent w1)", m, n)
	}
	cancel()
	select {
	case err := <-done:
		stopped = true
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("proxy did not stop")
	}
	if got := selfCgroup(t); got != before {
		t.Errorf("in cgroup %s after the proxy stopped, want %s", got, before)
	}
	if _, err := os.Stat(in); scoped && !os.IsNotExist(err) {
		t.Errorf("dial scope %s still there after the proxy stopped: %v", in, err)
	}
}

// selfCgroup is this process's cgroup v2 directory.
func selfCgroup(t *testing.T) string {
	t.Helper()
	dir, err := probes.OwnCgroupV2()
	if err != nil {
		t.Fatal(err)
	}
	return dir
}
