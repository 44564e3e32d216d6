package helm_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kvrelay/kvrelay/internal/testbin"
)

// promtoolVersion is the promtool hack/promtool.sh builds; TestPromtoolScriptVersion keeps
// the two equal.
const promtoolVersion = "v0.316.0"

func TestPromtoolScriptVersion(t *testing.T) {
	script, err := os.ReadFile("../../promtool.sh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^version=(\S+)$`).FindSubmatch(script)
	if m == nil || string(m[1]) != promtoolVersion {
		t.Fatalf("hack/promtool.sh builds %q; the tests look for %s", m, promtoolVersion)
	}
}

// needPromtool returns promtool's path, or skips t without it (fails it where
// KVRELAY_HELM_REQUIRE is set, as the chart's other tests).
func needPromtool(t *testing.T) string {
	t.Helper()
	p := filepath.Join(filepath.Dir(filepath.Dir(helmPath())), "promtool-"+promtoolVersion, "promtool")
	if _, err := os.Stat(p); err != nil {
		msg := fmt.Sprintf("no promtool at %s: run hack/promtool.sh to build promtool %s", p, promtoolVersion)
		if os.Getenv("KVRELAY_HELM_REQUIRE") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return p
}

// TestAlertRules: promtool finds the chart's rules valid and passes their unit tests (each
// alert fires on the series that should make it, and only then).
func TestAlertRules(t *testing.T) {
	promtool := needPromtool(t)
	files := filepath.Join(chart, "files")
	for _, args := range [][]string{{"check", "rules", "kvrelay-rules.yaml"}, {"test", "rules", "kvrelay-rules_test.yaml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = files
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestRulesAndDashboardInTheChart: with prometheusRule and grafanaDashboard enabled the
// chart renders the rules file as a PrometheusRule's spec and the dashboard into a
// ConfigMap, both unchanged.
func TestRulesAndDashboardInTheChart(t *testing.T) {
	needHelm(t)
	o := render(t, "prometheusRule: {enabled: true}\ngrafanaDashboard: {enabled: true}\n")
	var rule map[string]any
	o.must(t, "PrometheusRule", namespace, "r1-kvrelay-alerts", &rule)
	var want map[string]any
	data, err := os.ReadFile(filepath.Join(chart, "files", "kvrelay-rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, &want); err != nil {
		t.Fatal(err)
	}
	if g, w := mustJSON(t, rule["spec"]), mustJSON(t, want); g != w {
		t.Fatalf("the PrometheusRule's spec differs from files/kvrelay-rules.yaml:\n%s\n%s", g, w)
	}
	var cm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name      string            `json:"name"`
			Namespace string            `json:"namespace"`
			Labels    map[string]string `json:"labels"`
		} `json:"metadata"`
		Data map[string]string `json:"data"`
	}
	o.must(t, "ConfigMap", namespace, "r1-kvrelay-dashboard", &cm)
	dash, err := os.ReadFile(filepath.Join(chart, "files", "kvrelay-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	if cm.Data["kvrelay.json"] != strings.TrimRight(string(dash), "\n") || cm.Metadata.Labels["grafana_dashboard"] != "1" {
		t.Fatalf("the dashboard ConfigMap: labels %v, %d bytes against the file's %d", cm.Metadata.Labels, len(cm.Data["kvrelay.json"]), len(dash))
	}
	if off := render(t, ""); len(all[map[string]any](t, off, "PrometheusRule"))+len(all[map[string]any](t, off, "ConfigMap")) != 0 {
		t.Fatal("the rules or the dashboard rendered while disabled")
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestDashboardAndRulesNameExportedSeries: every kvrelay series the dashboard's queries and
// the alert rules name, and every label they group by, is one a running fleet exports. The
// fleet is `kvrelay up` (workers, control plane, proxy, the planner deciding without
// acting) with a rollout in shadow and some requests, scraped on both /metrics. A series
// exported only on an event none of that makes (an upstream error, an ejection, a scaling
// action) must at least be registered under that name in the code.
func TestDashboardAndRulesNameExportedSeries(t *testing.T) {
	if testing.Short() {
		t.Skip("starts kvrelay up")
	}
	bin, err := testbin.Kvrelay()
	if err != nil {
		t.Fatal(err)
	}
	exported := scrapeFleet(t, bin)
	exprs := queries(t)
	metric := regexp.MustCompile(`\bkvrelay_[a-z0-9_]+\b`)
	by := regexp.MustCompile(`\bby \(([^)]*)\)`)
	// Labels Prometheus adds (the scrape's target) or that a histogram has.
	ambient := map[string]bool{"le": true, "namespace": true, "instance": true, "job": true, "pod": true, "service": true}
	src := sourceText(t)
	for _, e := range exprs {
		names := metric.FindAllString(e, -1)
		var labels []string
		for _, m := range by.FindAllStringSubmatch(e, -1) {
			for l := range strings.SplitSeq(m[1], ",") {
				labels = append(labels, strings.TrimSpace(l))
			}
		}
		known := map[string]bool{}
		for _, n := range names {
			if strings.HasPrefix(n, "kvrelay_") && strings.Contains(n, ":") {
				continue
			}
			ls, ok := exported[n]
			if !ok {
				base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_count"), "_sum")
				if !strings.Contains(src, `"`+base+`"`) && !strings.Contains(src, `"`+strings.TrimPrefix(base, "kvrelay_controlplane_")+`"`) {
					t.Errorf("%s: no fleet exports %s, and no code registers it", e, n)
				}
				continue
			}
			for l := range ls {
				known[l] = true
			}
		}
		for _, l := range labels {
			if !ambient[l] && len(known) > 0 && !known[l] {
				t.Errorf("%s: groups by %q, which none of its series has (%v)", e, l, known)
			}
		}
	}
}

// queries are the dashboard's queries and the rules' expressions.
func queries(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(chart, "files", "kvrelay-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	var out []string
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			out = append(out, tg.Expr)
		}
	}
	data, err = os.ReadFile(filepath.Join(chart, "files", "kvrelay-rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Expr string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(data, &rules); err != nil {
		t.Fatal(err)
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			out = append(out, r.Expr)
		}
	}
	if len(out) < 30 {
		t.Fatalf("%d queries in the dashboard and the rules", len(out))
	}
	return out
}

// sourceText is the repository's Go code outside tests, for names registered in it.
func sourceText(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir("../../..", func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "vendor" || d.Name() == "node_modules" || strings.HasPrefix(d.Name(), ".")) && p != "../../.." {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			b.Write(data)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// freePorts reserves n consecutive free loopback ports and returns the first.
func freePorts(t *testing.T, n int) int {
	t.Helper()
	for range 50 {
		base := 20000 + rand.IntN(30000)
		var ls []net.Listener
		ok := true
		for p := base; p < base+n; p++ {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
			if err != nil {
				ok = false
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatalf("no %d consecutive free ports", n)
	return 0
}

// scrapeFleet runs `kvrelay up` with the planner deciding only, sends it requests, starts a
// rollout in shadow, and returns every series name both /metrics export with the labels
// each carries.
func scrapeFleet(t *testing.T, bin string) map[string]map[string]bool {
	t.Helper()
	base := freePorts(t, 40)
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("dashboard-test-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	port := func(off int) string { return "127.0.0.1:" + strconv.Itoa(base+off) }
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, "up", "--workers", "2", "--base-port", strconv.Itoa(base), "--kv-events-base-port", strconv.Itoa(base+10),
		"--kv-events-replay-base-port", strconv.Itoa(base+20), "--api-listen", port(30), "--xds-listen", port(31), "--proxy-listen", port(32),
		"--admin-listen", port(33), "--api-token-file", token, "--data-dir", filepath.Join(dir, "data"), "--ebpf", "off",
		"--planner", "--planner-actuator", "dry-run")
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = cmd.Wait() })
	client := &http.Client{Timeout: 10 * time.Second}
	chat := func(i int) error {
		body := fmt.Sprintf(`{"model":"gpt-oss-120b","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"conversation %d: %s"}]}`, i%5, strings.Repeat("tell me more ", 40))
		resp, err := client.Post("http://"+port(32)+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	deadline := time.Now().Add(60 * time.Second)
	for chat(0) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("kvrelay up did not answer within 60s:\n%s", logs.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
	api := func(method, path, body string) {
		req, _ := http.NewRequest(method, "http://"+port(30)+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer dashboard-test-token")
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s %s: %d %s", method, path, resp.StatusCode, b)
		}
	}
	api("POST", "/v1/rollout", `{"candidate": {"policy": "latency", "overlap_weight": 1, "queue_weight": 8}, "spec": {"shadow_ms": 600000}}`)
	for i := range 40 {
		if err := chat(i); err != nil {
			t.Fatal(err)
		}
	}
	// The planner's series come once it has profiled a worker; the control plane's arm sums
	// with the proxies' next load reports.
	want := []string{"kvrelay_proxy_requests_total", "kvrelay_controlplane_rollout_state", "kvrelay_planner_replicas", "kvrelay_controlplane_policy_requests_total"}
	deadline = time.Now().Add(3 * time.Minute)
	for {
		out := scrape(t, client, "http://"+port(30)+"/metrics", "http://"+port(33)+"/metrics")
		missing := slices.DeleteFunc(slices.Clone(want), func(n string) bool { return out[n] != nil })
		if len(missing) == 0 {
			return out
		}
		if time.Now().After(deadline) {
			names := make([]string, 0, len(out))
			for n := range out {
				names = append(names, n)
			}
			slices.Sort(names)
			t.Fatalf("the fleet exports no %v; it exports %v\n%s", missing, names, logs.String())
		}
		time.Sleep(time.Second)
	}
}

// scrape returns every series name the expositions at urls hold, with the labels each
// carries.
func scrape(t *testing.T, client *http.Client, urls ...string) map[string]map[string]bool {
	t.Helper()
	out := map[string]map[string]bool{}
	for _, url := range urls {
		resp, err := client.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if line == "" || line[0] == '#' {
				continue
			}
			name, rest, _ := strings.Cut(line, "{")
			name, _, _ = strings.Cut(name, " ")
			if out[name] == nil {
				out[name] = map[string]bool{}
			}
			if lbls, _, ok := strings.Cut(rest, "}"); ok {
				for kv := range strings.SplitSeq(lbls, ",") {
					if k, _, ok := strings.Cut(kv, "="); ok {
						out[name][k] = true
					}
				}
			}
		}
		resp.Body.Close()
	}
	return out
}
