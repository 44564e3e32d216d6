package bench

import (
	"context"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

func TestParseSetups(t *testing.T) {
	got, err := ParseSetups(" agg:4, disagg:2+2 ,conditional:2+2,conditional@1024:1+3,disagg,agg")
	if err != nil {
		t.Fatal(err)
	}
	want := []Setup{
		{Label: "agg:4", Mode: ModeAgg, Workers: 4},
		{Label: "disagg:2+2", Mode: ModeDisagg, PrefillWorkers: 2, DecodeWorkers: 2},
		{Label: "conditional:2+2", Mode: ModeConditional, PrefillWorkers: 2, DecodeWorkers: 2},
		{Label: "conditional@1024:1+3", Mode: ModeConditional, PrefillWorkers: 1, DecodeWorkers: 3, DisaggThreshold: 1024},
		{Label: "disagg", Mode: ModeDisagg},
		{Label: "agg", Mode: ModeAgg},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got  %+v\nwant %+v", got, want)
	}
	for _, bad := range []string{"", " , ", "split:2+2", "agg:2+2", "disagg:4", "disagg:0+2", "disagg:2+x", "agg:0",
		"agg@512:4", "disagg@512:2+2", "conditional@0:2+2", "conditional@lots:2+2", "agg:4,agg:4"} {
		if s, err := ParseSetups(bad); err == nil {
			t.Errorf("%q accepted: %+v", bad, s)
		}
	}
}

func TestSetupPools(t *testing.T) {
	base := DefaultClusterConfig()
	base.Workers = 5
	for _, tc := range []struct {
		setup           string
		both, pre, dec  int
		threshold       int
		describe, dmode string
		dthreshold      int
	}{
		{"agg", 5, 0, 0, 0, "agg 5 workers", "off", 512},
		{"agg:3", 3, 0, 0, 0, "agg 3 workers", "off", 512},
		{"disagg", 0, 2, 3, 0, "disagg 2 prefill + 3 decode", "auto", -1},
		{"disagg:1+2", 0, 1, 2, 0, "disagg 1 prefill + 2 decode", "auto", -1},
		{"conditional:2+2", 0, 2, 2, 0, "conditional (threshold 512 tokens) 2 prefill + 2 decode", "auto", 512},
		{"conditional@64:2+2", 0, 2, 2, 64, "conditional (threshold 64 tokens) 2 prefill + 2 decode", "auto", 64},
	} {
		st, err := ParseSetups(tc.setup)
		if err != nil {
			t.Fatal(err)
		}
		cfg := st[0].Apply(base)
		both, pre, dec, err := cfg.Pools()
		if err != nil || both != tc.both || pre != tc.pre || dec != tc.dec {
			t.Errorf("%s: pools %d/%d/%d %v", tc.setup, both, pre, dec, err)
		}
		if d := cfg.Describe(); d != tc.describe {
			t.Errorf("%s: %q, want %q", tc.setup, d, tc.describe)
		}
		if m, th := cfg.disaggSettings(); m != tc.dmode || th != tc.dthreshold {
			t.Errorf("%s: proxy disagg %q threshold %d, want %q %d", tc.setup, m, th, tc.dmode, tc.dthreshold)
		}
	}
	one := base
	one.Mode, one.Workers = ModeDisagg, 1
	if _, _, _, err := one.Pools(); err == nil {
		t.Error("disagg with one worker accepted")
	}
	one.Mode = "hybrid"
	if _, _, _, err := one.Pools(); err == nil {
		t.Error("unknown mode accepted")
	}
}

func TestCompareRunLabels(t *testing.T) {
	setups, _ := ParseSetups("agg:4,disagg:2+2")
	co := CompareOptions{Cluster: DefaultClusterConfig(), Policies: []string{"kv"}, Setups: setups}
	var labels []string
	for _, r := range co.runs() {
		labels = append(labels, r.label)
	}
	if strings.Join(labels, " ") != "agg:4 disagg:2+2" {
		t.Errorf("one policy: %v", labels)
	}
	co.Policies = []string{"kv", "round-robin"}
	labels = nil
	for _, r := range co.runs() {
		labels = append(labels, r.label)
		if r.cluster.Policy != r.policy {
			t.Errorf("%s runs policy %s", r.label, r.cluster.Policy)
		}
	}
	if strings.Join(labels, " ") != "agg:4/kv agg:4/round-robin disagg:2+2/kv disagg:2+2/round-robin" {
		t.Errorf("two policies: %v", labels)
	}
	co.Setups = nil
	co.Cluster.Mode, co.Cluster.Workers = ModeDisagg, 6
	labels = nil
	for _, r := range co.runs() {
		labels = append(labels, r.label)
		if _, p, d, err := r.cluster.Pools(); r.cluster.Mode != ModeDisagg || p != 3 || d != 3 || err != nil {
			t.Errorf("--mode disagg --workers 6: %s runs %s with %d+%d (%v)", r.label, r.cluster.Mode, p, d, err)
		}
	}
	if strings.Join(labels, " ") != "kv round-robin" {
		t.Errorf("policies only: %v", labels)
	}
}

// TestDisaggCluster starts a disaggregated cluster and checks that each worker has its role,
// a KV transfer agent, and its role in the control plane, and that a request goes through
// both legs.
func TestDisaggCluster(t *testing.T) {
	cc := DefaultClusterConfig()
	cc.Mode, cc.PrefillWorkers, cc.DecodeWorkers, cc.NumGPUBlocks, cc.Speedup = ModeDisagg, 1, 2, 1024, 50
	cl, err := StartCluster(context.Background(), cc)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ws := cl.Workers()
	wantRoles := []sim.Role{sim.RolePrefill, sim.RoleDecode, sim.RoleDecode}
	if len(ws) != 3 {
		t.Fatalf("%d workers", len(ws))
	}
	for i, w := range ws {
		if w.Role != wantRoles[i] || w.KVTransfer == "" || w.EngineID == "" {
			t.Errorf("worker %d: %+v", i, w)
		}
		rw, ok := cl.cp.Registry().Get(w.ID)
		if !ok || rw.Role != string(w.Role) {
			t.Errorf("control plane has %s as %+v", w.ID, rw)
		}
	}
	body := `{"model":"gpt-oss-120b","messages":[{"role":"user","content":"` + strings.Repeat("hello there ", 200) + `"}],"max_tokens":4}`
	resp, err := http.Post(cl.Target()+"/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("x-kvrelay-worker"), "d") {
		t.Fatalf("status %d worker %q: %s", resp.StatusCode, resp.Header.Get("x-kvrelay-worker"), out)
	}
	resp, err = http.Get("http://" + cl.proxy.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(metrics), `kvrelay_proxy_disagg_requests_total{path="remote"} 1`) {
		t.Errorf("the proxy did not prefill remotely:\n%s", grepLines(string(metrics), "disagg"))
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestShortCompareDisagg runs bench compare end to end at high speedup over three setups in
// one run: aggregated, disaggregated (every prompt prefilled on the prefill worker, its KV
// pulled by the decode worker) and conditional with a threshold above every prompt (every
// prompt prefilled on its decode worker). Every request must succeed, and the decode worker
// reports a pulled prompt as cached, as vLLM counts externally computed tokens.
func TestShortCompareDisagg(t *testing.T) {
	tok, err := tokenizer.New("o200k_harmony")
	if err != nil {
		t.Fatal(err)
	}
	setups, err := ParseSetups("agg:2,disagg:1+1,conditional@100000:1+1")
	if err != nil {
		t.Fatal(err)
	}
	cc := DefaultClusterConfig()
	cc.NumGPUBlocks = 2048
	co := CompareOptions{
		Workload: "fixed:isl=600,osl=12,requests=16", Seed: 5, Setups: setups, Cluster: cc,
		Run: Options{Speedup: 20, Rate: 2}, SLO: DefaultSLO,
	}
	rs, err := Compare(context.Background(), co, tok)
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 3 {
		t.Fatalf("%d results", len(rs))
	}
	for i, r := range rs {
		s := r.Summary
		t.Logf("%-22s ok %d TTFT p50 %v ITL p50 %v hit rate %.2f workers %v", r.Label, s.OK, s.TTFT.P50, s.ITL.P50, s.HitRate, s.Workers)
		if s.OK != 16 || r.Setup != setups[i].Label || r.Policy != route.PolicyDefault {
			t.Fatalf("%s: %+v", r.Label, s)
		}
		// TTFT breaks down into one engine's prefill and a wait only where the request
		// prefills where it decodes.
		if (s.Breakdown != nil) != (i == 0) {
			t.Errorf("%s: TTFT breakdown %+v", r.Label, s.Breakdown)
		}
		for id := range s.Workers {
			if i > 0 && !strings.HasPrefix(id, "d") {
				t.Errorf("%s: worker %s answered", r.Label, id)
			}
		}
	}
	if rs[1].Summary.HitRate < 0.9 {
		t.Errorf("disagg: hit rate %.2f, want the pulled prompts reported cached", rs[1].Summary.HitRate)
	}
	if rs[2].Summary.HitRate > 0.5 {
		t.Errorf("conditional above every prompt: hit rate %.2f, want prompts prefilled locally", rs[2].Summary.HitRate)
	}
	if tab := Table(rs); !strings.Contains(tab, "| disagg:1+1 | ×agg:2 |") {
		t.Errorf("table header:\n%s", tab)
	}
}
