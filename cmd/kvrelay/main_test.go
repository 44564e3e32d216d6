package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

func TestOffsets(t *testing.T) {
	cases := []struct {
		name, in string
		i        int
		want     string
		ok       bool
		endpoint bool
	}{
		{"host port", "127.0.0.1:8001", 3, "127.0.0.1:8004", true, false},
		{"port zero stays zero", "127.0.0.1:0", 3, "127.0.0.1:0", true, false},
		{"ipv6", "[::1]:9000", 1, "[::1]:9001", true, false},
		{"past the last port", "127.0.0.1:65535", 1, "", false, false},
		{"no port", "localhost", 1, "", false, false},
		{"tcp endpoint", "tcp://127.0.0.1:5557", 2, "tcp://127.0.0.1:5559", true, true},
		{"wildcard endpoint", "tcp://*:5557", 1, "tcp://*:5558", true, true},
		{"first endpoint unchanged", "tcp://*:5557", 0, "tcp://*:5557", true, true},
		{"ipc endpoint", "ipc:///tmp/kv", 1, "ipc:///tmp/kv-1", true, true},
		{"not an endpoint", "127.0.0.1:5557", 1, "", false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got string
			var err error
			if tc.endpoint {
				got, err = offsetEndpoint(tc.in, tc.i)
			} else {
				got, err = offsetHostPort(tc.in, tc.i)
			}
			if (err == nil) != tc.ok || got != tc.want {
				t.Fatalf("got %q, %v; want %q ok=%v", got, err, tc.want, tc.ok)
			}
		})
	}
}

func TestSimFlagsRejectBadValues(t *testing.T) {
	for _, args := range [][]string{
		{"sim", "--workers", "0"},
		{"sim", "--role", "router"},
		{"sim", "--kv-block-hash", "sha"},
		{"sim", "--kv-events-format", "json", "--kv-events-endpoint", "tcp://127.0.0.1:0"},
		{"sim", "--block-size", "0"},
		{"sim", "--tokenizer", "/no/such/tokenizer.json"},
	} {
		t.Run(strings.Join(args[1:], " "), func(t *testing.T) {
			cmd := newRootCmd()
			cmd.SetArgs(args)
			cmd.SetOut(io.Discard)
			if err := cmd.ExecuteContext(context.Background()); err == nil {
				t.Fatal("accepted")
			}
		})
	}
}

func TestUpRejectsBadModes(t *testing.T) {
	for _, args := range [][]string{
		{"up", "--mode", "split"},
		{"up", "--mode", "disagg", "--prefill-workers", "0"},
		{"up", "--mode", "disagg", "--decode-workers", "0"},
	} {
		t.Run(strings.Join(args[1:], " "), func(t *testing.T) {
			cmd := newRootCmd()
			cmd.SetArgs(args)
			cmd.SetOut(io.Discard)
			if err := cmd.ExecuteContext(context.Background()); err == nil {
				t.Fatal("accepted")
			}
		})
	}
}

// TestUpServesAndStops runs `kvrelay up` on free ports, aggregated and disaggregated, sends
// the request its printed curl line describes (and, disaggregated, one long enough to
// prefill on a prefill worker), and stops it the way Ctrl-C does.
func TestUpServesAndStops(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  []string
		roles map[string]int
	}{
		{"agg", nil, map[string]int{"both": 4}},
		{"disagg", []string{"--mode", "disagg", "--kv-transfer-base-port", "0"}, map[string]int{"prefill": 2, "decode": 2}},
		{"disagg 1+3", []string{"--mode", "disagg", "--prefill-workers", "1", "--decode-workers", "3", "--kv-transfer-base-port", "0", "--disagg-threshold", "-1"}, map[string]int{"prefill": 1, "decode": 3}},
	} {
		t.Run(tc.name, func(t *testing.T) { testUp(t, tc.args, tc.roles) })
	}
}

// startUp runs `kvrelay up` on free loopback ports with args added; what it prints comes
// through the returned reader. stop cancels it and fails the test unless it returns without
// an error within timeout.
func startUp(t *testing.T, args ...string) (out *io.PipeReader, stop func(timeout time.Duration)) {
	t.Helper()
	pr, pw := io.Pipe()
	cmd := newRootCmd()
	cmd.SetArgs(append([]string{"up", "--proxy-listen", "127.0.0.1:0", "--base-port", "0", "--kv-events-base-port", "0", "--kv-events-replay-base-port", "0",
		"--xds-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"}, args...))
	cmd.SetOut(pw)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx); pw.Close() }()
	return pr, func(timeout time.Duration) {
		t.Helper()
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("up returned %v", err)
			}
		case <-time.After(timeout):
			t.Fatal("up did not stop")
		}
	}
}

func testUp(t *testing.T, extra []string, roles map[string]int) {
	pr, stop := startUp(t, append([]string{"--speedup-ratio", "100", "--num-gpu-blocks", "2048", "--expose-worker-header"}, extra...)...)

	sc := bufio.NewScanner(pr)
	got := map[string]int{}
	var url, body, metrics string
	curl := regexp.MustCompile(`curl -s (\S+) `)
	data := regexp.MustCompile(`-d '(.*)'`)
	metricsURL := regexp.MustCompile(`^proxy .* metrics (\S+)`)
	disaggWorker := regexp.MustCompile(`^worker \d+  (prefill|decode) +[pd]\d+ +openai http://127\.0\.0\.1:\d+/v1  kv-transfer 127\.0\.0\.1:[1-9]\d*  kv-events tcp://127\.0\.0\.1:`)
	for sc.Scan() {
		line := sc.Text()
		if m := disaggWorker.FindStringSubmatch(line); m != nil {
			got[m[1]]++
		} else if strings.HasPrefix(line, "worker ") && strings.Contains(line, "kv-events tcp://127.0.0.1:") {
			if strings.Contains(line, "kv-transfer") {
				t.Errorf("a worker of role both has a KV transfer agent: %s", line)
			}
			got["both"]++
		}
		if m := metricsURL.FindStringSubmatch(line); m != nil {
			metrics = m[1]
		}
		if m := curl.FindStringSubmatch(line); m != nil {
			url = m[1]
		}
		if m := data.FindStringSubmatch(line); m != nil {
			body = m[1]
			break
		}
	}
	if !maps.Equal(got, roles) || url == "" || body == "" || metrics == "" {
		t.Fatalf("up printed workers %v (want %v), url %q, body %q, metrics %q", got, roles, url, body, metrics)
	}
	go io.Copy(io.Discard, pr)
	post := func(body string) (string, string) {
		t.Helper()
		resp, err := http.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(out), `"completion_tokens":16`) {
			t.Fatalf("request got %d: %s", resp.StatusCode, out)
		}
		return resp.Header.Get("x-kvrelay-worker"), string(out)
	}
	worker, _ := post(body)
	if roles["decode"] > 0 {
		if !strings.HasPrefix(worker, "d") {
			t.Errorf("the printed request was answered by %q, not a decode worker", worker)
		}
		long := strings.Replace(body, "Hello!", strings.Repeat("hello there ", 400), 1)
		if worker, _ = post(long); !strings.HasPrefix(worker, "d") {
			t.Errorf("a long prompt was answered by %q, not a decode worker", worker)
		}
		resp, err := http.Get(metrics)
		if err != nil {
			t.Fatal(err)
		}
		m, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		// The greeting is far below the threshold (local prefill) unless it is negative.
		want := `kvrelay_proxy_disagg_requests_total{path="remote"} 1`
		if roles["prefill"] == 1 { // --disagg-threshold -1: the greeting too
			want = `kvrelay_proxy_disagg_requests_total{path="remote"} 2`
		}
		if !strings.Contains(string(m), want) {
			t.Errorf("proxy metrics lack %s", want)
		}
	}
	stop(10 * time.Second)
}

func TestProxyConfigFileAndFlags(t *testing.T) {
	dir := t.TempDir()
	path := dir + "/proxy.yaml"
	yamlText := `listen: 127.0.0.1:9999
policy: least-loaded
block_size: 32
queue_timeout: 5s
upstreams:
  - id: a
    url: http://127.0.0.1:8001
    model: m
  - url: http://127.0.0.1:8002
`
	if err := os.WriteFile(path, []byte(yamlText), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := newProxyCmd()
	if err := cmd.ParseFlags([]string{"--config", path, "--policy", "kv", "--upstream", "id=c,url=http://127.0.0.1:8003,capacity=100"}); err != nil {
		t.Fatal(err)
	}
	// Re-run the flag layering the command does.
	var cfgPath string
	var ups []string
	cfgPath, _ = cmd.Flags().GetString("config")
	ups, _ = cmd.Flags().GetStringArray("upstream")
	base := proxy.DefaultConfig()
	base.Policy = "kv"
	cfg, err := proxyConfig(cmd.Flags(), base, cfgPath, ups)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != "127.0.0.1:9999" || cfg.Policy != "kv" || cfg.BlockSize != 32 || cfg.QueueTimeout != 5*time.Second {
		t.Fatalf("layered config %+v", cfg)
	}
	if len(cfg.Upstreams) != 3 || cfg.Upstreams[0].ID != "a" || cfg.Upstreams[2].Capacity != 100 {
		t.Fatalf("upstreams %+v", cfg.Upstreams)
	}
	if err := os.WriteFile(path, []byte("listen: x\nunknown_key: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := proxyConfig(cmd.Flags(), base, path, nil); err == nil {
		t.Fatal("an unknown key must be an error")
	}
	for _, bad := range []string{"url=http://h:1,capacity=lots", "url=http://h:1,colour=red", "url"} {
		if _, err := parseUpstream(bad); err == nil && strings.Contains(bad, "=") {
			t.Fatalf("%q accepted", bad)
		}
	}
}

// Stopping `kvrelay up` (as Ctrl-C does) with a stream in flight lets it finish: the proxy
// drains before the engines behind it stop, and up returns once the stream is done.
func TestUpStopKeepsStreamsInFlight(t *testing.T) {
	pr, stop := startUp(t, "--static", "--workers", "1", "--speedup-ratio", "1", "--drain-timeout", "20s")
	url := upURL(t, pr)
	br := startStream(t, url, 60)
	stopped := make(chan struct{})
	go func() { stop(30 * time.Second); close(stopped) }()
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("the stream broke after the stop: %v", err)
	}
	if bytes.Contains(rest, []byte(`"error"`)) || !bytes.HasSuffix(rest, []byte("data: [DONE]\n\n")) || bytes.Count(rest, []byte(`"content":`)) < 55 {
		t.Fatalf("the stream in flight did not finish whole: %s", rest)
	}
	<-stopped
}

// The first SIGINT drains (new requests get 503, the stream in flight goes on); a second
// one stops the process at once.
func TestUpSecondSignalStopsAtOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	cmd := exec.Command(os.Args[0], "up", "--static", "--workers", "1", "--speedup-ratio", "0.2", "--proxy-listen", "127.0.0.1:0",
		"--base-port", "0", "--kv-events-base-port", "0", "--kv-events-replay-base-port", "0", "--drain-timeout", "2m", "--ebpf", "off")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	url := upURL(t, stdout)
	br := startStream(t, url, 5000)
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	r2, err := http.Post(url, "application/json", strings.NewReader(`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`))
	if err != nil || r2.StatusCode != 503 {
		t.Fatalf("a request while draining: %v %v, want 503", err, r2)
	}
	r2.Body.Close()
	for range 5 { // the stream goes on
		if line, err := br.ReadString('\n'); err != nil || strings.Contains(line, `"error"`) {
			t.Fatalf("the stream in flight broke at the first signal: %q %v", line, err)
		}
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		t.Fatalf("up exited at the first signal with the stream in flight: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		t.Fatal("up did not stop at the second signal")
	}
}

// `kvrelay up` writes an operator API token and prints where; ctl with that file may change
// the policy, ctl without it may not. --api-token-file takes a token of the operator's own.
func TestUpOperatorToken(t *testing.T) {
	for _, own := range []bool{false, true} {
		t.Run(fmt.Sprintf("own=%v", own), func(t *testing.T) {
			var args []string
			if own {
				f := ctlTokenFile(t, "operator-secret-token")
				args = append(args, "--api-token-file", f)
			}
			pr, stop := startUp(t, args...)
			defer stop(30 * time.Second)
			line := regexp.MustCompile(`^control +xds \S+  api (http://\S+)  token (\S+)  \(kvrelay ctl --api \S+ --token-file (\S+) workers\)`)
			sc := bufio.NewScanner(pr)
			var api, tokenPath string
			for sc.Scan() {
				if m := line.FindStringSubmatch(sc.Text()); m != nil {
					api, tokenPath = m[1], m[2]
					if m[3] != tokenPath {
						t.Fatalf("the ctl line names %s, the token is in %s", m[3], tokenPath)
					}
					break
				}
			}
			go io.Copy(io.Discard, pr)
			if api == "" {
				t.Fatal("up printed no control line with a token")
			}
			if b, err := os.ReadFile(tokenPath); err != nil || len(strings.TrimSpace(string(b))) < 16 {
				t.Fatalf("token file %s: %q %v", tokenPath, b, err)
			} else if own && strings.TrimSpace(string(b)) != "operator-secret-token" {
				t.Fatalf("up used %q, not the operator's token", b)
			}
			ctl := func(args ...string) error {
				cmd := newRootCmd()
				cmd.SetOut(io.Discard)
				cmd.SetArgs(append([]string{"ctl", "--api", api}, args...))
				return cmd.ExecuteContext(t.Context())
			}
			t.Setenv(ctlTokenEnv, "")
			if err := ctl("policy", "set", "--temperature", "0.5"); err == nil {
				t.Fatal("a change without the token was accepted")
			}
			if err := ctl("--token-file", tokenPath, "policy", "set", "--temperature", "0.5"); err != nil {
				t.Fatalf("a change with up's token: %v", err)
			}
		})
	}
}

// `kvrelay up` keeps debug headers off unless asked, and prints its metrics on the admin
// listener, apart from the OpenAI port.
func TestUpHeadersOptInAndAdminMetrics(t *testing.T) {
	pr, stop := startUp(t, "--static", "--workers", "1", "--speedup-ratio", "100")
	defer stop(30 * time.Second)
	sc := bufio.NewScanner(pr)
	proxyLine := regexp.MustCompile(`^proxy +openai (http://\S+)/v1  metrics (http://\S+)  `)
	var base, metrics string
	for sc.Scan() {
		if m := proxyLine.FindStringSubmatch(sc.Text()); m != nil {
			base, metrics = m[1], m[2]
			break
		}
	}
	go io.Copy(io.Discard, pr)
	if base == "" || strings.HasPrefix(metrics, base) {
		t.Fatalf("proxy %q, metrics %q: want metrics on the admin listener", base, metrics)
	}
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("x-kvrelay-worker") != "" || resp.Header.Get("x-kvrelay-route") != "" {
		t.Fatalf("answer %d with worker %q route %q: debug headers must be opt-in", resp.StatusCode, resp.Header.Get("x-kvrelay-worker"), resp.Header.Get("x-kvrelay-route"))
	}
	mr, err := http.Get(metrics)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(mr.Body)
	mr.Body.Close()
	if mr.StatusCode != 200 || !strings.Contains(string(m), `kvrelay_proxy_requests_total{code="200"`) {
		t.Fatalf("admin metrics: %d %.300s", mr.StatusCode, m)
	}
}

// upURL reads what `kvrelay up` prints up to its curl line and returns the URL there; the
// rest of the output is drained in the background.
func upURL(t *testing.T, out io.Reader) string {
	t.Helper()
	sc := bufio.NewScanner(out)
	curl := regexp.MustCompile(`curl -s (\S+) `)
	for sc.Scan() {
		if m := curl.FindStringSubmatch(sc.Text()); m != nil {
			go io.Copy(io.Discard, out)
			return m[1]
		}
	}
	t.Fatal("up printed no curl line")
	return ""
}

// startStream posts a streamed chat completion of maxTokens tokens (ignore_eos) to url and
// returns its body once the first line has arrived; the body closes with the test.
func startStream(t *testing.T, url string, maxTokens int) *bufio.Reader {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(fmt.Sprintf(
		`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"count"}],"max_tokens":%d,"ignore_eos":true,"stream":true}`, maxTokens)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	return br
}

// FuzzParseUpstream: whatever --upstream says, parsing it never panics, and an engine it
// accepts is one the proxy's configuration check either takes or refuses with an error.
func FuzzParseUpstream(f *testing.F) {
	for _, s := range []string{"http://h:1", "id=a,url=http://h:1,model=m,capacity=100,role=prefill,max-num-seqs=4",
		"url=http://h:1,p2p-port=5710,peer-bandwidth=50GB/s,kv-bytes-per-token=73728", "url=http://h:1,p2p-port=70000",
		"url=http://h:1,host-bandwidth=x", "url=http://h:1,lora-modules=a;b", "url", "=,=", "url=http://h:1,,"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		u, err := parseUpstream(s)
		if err != nil {
			return
		}
		cfg := proxy.DefaultConfig()
		cfg.Upstreams = []proxy.Upstream{u}
		_ = cfg.Validate()
	})
}
