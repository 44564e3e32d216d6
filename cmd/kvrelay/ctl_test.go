package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/controlplane/api"
	"github.com/kvrelay/kvrelay/controlplane/api/apitest"
	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

const ctlTestToken = "ctl-test-token"

// ctlFleet is a backend with w1 (from the flags, healthy, busy) and w2 (from the API).
func ctlFleet() *apitest.Backend {
	b := apitest.New(
		&operatorv1.Worker{
			Spec: &operatorv1.WorkerSpec{Id: "w1", Url: "http://127.0.0.1:8001", Model: "gpt-oss-20b", Engine: "sim", Source: "flag",
				KvBytesPerToken: 73728, HostBandwidth: 25e9, SharedBandwidth: 2e9},
			Status: &operatorv1.WorkerStatus{Healthy: true, Running: 3, Waiting: 2, KvUsage: 0.42,
				Blocks: &operatorv1.BlockCounts{Gpu: 100, Cpu: 20, Disk: 3, Shared: 7},
				Ingest: &operatorv1.IngestStats{Batches: 9, Events: 4321, Gaps: 2}},
		},
		&operatorv1.Worker{
			Spec:   &operatorv1.WorkerSpec{Id: "w2", Url: "http://127.0.0.1:8002", Engine: "vllm", Source: "api"},
			Status: &operatorv1.WorkerStatus{Slot: 1},
		},
	)
	b.SetIndex(&operatorv1.Index{TotalBlocks: 123, JournalEpoch: 7, JournalOffset: 9001, IngestRate: 250,
		Workers: []*operatorv1.WorkerBlocks{{Id: "w1", Blocks: &operatorv1.BlockCounts{Gpu: 100, Cpu: 20, Disk: 3}}, {Id: "w2", Slot: 1}}})
	b.SetProxies(&operatorv1.Proxy{NodeId: "edge-1", Streams: 1},
		&operatorv1.Proxy{NodeId: "edge-2", Streams: 1, LastNack: &operatorv1.Nack{TypeUrl: "type.googleapis.com/kvrelay.xds.v1.RoutingPolicy", Reason: "tier_weights: want 3"}})
	b.SetTenants(&operatorv1.Tenant{Name: "acme", Proxies: 2, RequestsPerSecond: 12.25, PromptTokensPerSecond: 3400, Admitted: 900, Refused: 17})
	return b
}

func ctlServer(t *testing.T, b api.Backend, opts api.Options) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(api.Handler(b, opts))
	t.Cleanup(ts.Close)
	return ts
}

// runCtl runs `kvrelay ctl args... --api ts` and returns what it printed.
func runCtl(t *testing.T, ts *httptest.Server, args ...string) (string, error) {
	t.Helper()
	return runCtlAt(t, ts.URL, args...)
}

// runCtlAt runs kvrelay ctl against the operator API at api.
func runCtlAt(t *testing.T, api string, args ...string) (string, error) {
	t.Helper()
	cmd := newCtlCmd()
	cmd.SilenceErrors = true
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(append(args, "--api", api))
	err := cmd.ExecuteContext(t.Context())
	return out.String(), err
}

func ctlTokenFile(t *testing.T, tok string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestCtlWorkersTable(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	ts := ctlServer(t, ctlFleet(), api.Options{Token: ctlTestToken, OpenReads: true})
	out, err := runCtl(t, ts, "workers")
	if err != nil {
		t.Fatal(err, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 {
		t.Fatalf("want a header and 2 rows:\n%s", out)
	}
	for i, want := range [][]string{
		{"ID", "URL", "MODEL", "ENGINE", "HEALTHY", "DRAINING", "RUNNING", "WAITING", "KV%", "BLOCKS", "TIERS", "EVENTS", "GAPS"},
		{"w1", "http://127.0.0.1:8001", "gpt-oss-20b", "sim", "yes", "no", "3", "2", "42", "130", "host=25GB/s,shared=2GB/s", "4321", "2"},
		{"w2", "http://127.0.0.1:8002", "-", "vllm", "no", "no", "0", "0", "0", "0", "-", "0", "0"},
	} {
		if got := strings.Fields(lines[i]); strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("line %d: %q, want %q", i, got, want)
		}
	}

	out, err = runCtl(t, ts, "workers", "get", "w1")
	if err != nil || !strings.Contains(out, "gpt-oss-20b") {
		t.Errorf("workers get: %v\n%s", err, out)
	}
	if out, err := runCtl(t, ts, "workers", "get", "w9"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("workers get w9: %v\n%s", err, out)
	}
}

func TestCtlJSONOutput(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	ts := ctlServer(t, ctlFleet(), api.Options{Token: ctlTestToken, OpenReads: true})
	for _, tc := range []struct {
		args []string
		into proto.Message
	}{
		{[]string{"workers"}, &operatorv1.ListWorkersResponse{}},
		{[]string{"workers", "get", "w2"}, &operatorv1.Worker{}},
		{[]string{"policy"}, &operatorv1.Policy{}},
		{[]string{"index"}, &operatorv1.Index{}},
		{[]string{"proxies"}, &operatorv1.ListProxiesResponse{}},
		{[]string{"tenants"}, &operatorv1.ListTenantsResponse{}},
	} {
		out, err := runCtl(t, ts, append(tc.args, "-o", "json")...)
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if !json.Valid([]byte(out)) {
			t.Fatalf("%v: invalid JSON:\n%s", tc.args, out)
		}
		if err := protojson.Unmarshal([]byte(out), tc.into); err != nil {
			t.Errorf("%v: %v", tc.args, err)
		}
	}
	out, _ := runCtl(t, ts, "workers", "-o", "json")
	var l operatorv1.ListWorkersResponse
	if err := protojson.Unmarshal([]byte(out), &l); err != nil || len(l.Workers) != 2 || l.Workers[0].Status.Ingest.Events != 4321 {
		t.Errorf("workers -o json: %v %v", &l, err)
	}
	// 64-bit counters are JSON numbers (protojson would write strings), in field order.
	out, _ = runCtl(t, ts, "index", "-o", "json")
	var idx map[string]any
	if err := json.Unmarshal([]byte(out), &idx); err != nil {
		t.Fatal(err)
	}
	if n, ok := idx["total_blocks"].(float64); !ok || n != 123 {
		t.Errorf("index -o json: total_blocks %#v, want the number 123:\n%s", idx["total_blocks"], out)
	}
}

func TestCtlMutationsNeedTheToken(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	b := ctlFleet()
	ts := ctlServer(t, b, api.Options{Token: ctlTestToken, OpenReads: true})
	spec := "id=w5,url=http://127.0.0.1:8005,kv-events=tcp://127.0.0.1:5565,engine=sim"
	for _, args := range [][]string{
		{"workers", "add", spec},
		{"workers", "rm", "w2"},
		{"drain", "w1"},
		{"undrain", "w1"},
		{"policy", "set", "--temperature", "1"},
	} {
		out, err := runCtl(t, ts, args...)
		if err == nil || !strings.Contains(err.Error(), "missing bearer token") || !strings.Contains(err.Error(), "401") {
			t.Errorf("%v without token: %v\n%s", args, err, out)
		}
		out, err = runCtl(t, ts, append(args, "--token-file", ctlTokenFile(t, "wrong"))...)
		if err == nil || !strings.Contains(err.Error(), "invalid bearer token") {
			t.Errorf("%v with a wrong token: %v\n%s", args, err, out)
		}
	}
	for _, c := range b.Calls() {
		if !strings.HasPrefix(c, "Get") && !strings.HasPrefix(c, "List") {
			t.Errorf("the backend was changed without a token: %s", c)
		}
	}

	// A control plane without a token refuses, saying how to give it one.
	ts = ctlServer(t, ctlFleet(), api.Options{OpenReads: true})
	_, err := runCtl(t, ts, "drain", "w1", "--token-file", ctlTokenFile(t, ctlTestToken))
	if err == nil || !strings.Contains(err.Error(), "start the control plane with --api-token-file") {
		t.Errorf("drain against a control plane without a token: %v", err)
	}
}

func TestCtlMutations(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	b := ctlFleet()
	ts := ctlServer(t, b, api.Options{Token: ctlTestToken})
	tok := ctlTokenFile(t, ctlTestToken)

	out, err := runCtl(t, ts, "workers", "add", "id=w5, url=http://127.0.0.1:8005, kv-events=tcp://127.0.0.1:5565, engine=sim, block-size=32", "--token-file", tok)
	if err != nil || !strings.Contains(out, "w5") || !strings.Contains(out, "http://127.0.0.1:8005") {
		t.Fatalf("workers add: %v\n%s", err, out)
	}
	w, err := b.GetWorker(t.Context(), "w5")
	if err != nil || w.Spec.KvEvents != "tcp://127.0.0.1:5565" || w.Spec.BlockSize != 32 || w.Spec.Engine != "sim" {
		t.Fatalf("w5: %v %v", w, err)
	}
	// A malformed spec is refused with the control plane's own checks, before any call.
	if _, err := runCtl(t, ts, "workers", "add", "id=w6,url=ftp://x", "--token-file", tok); err == nil || !strings.Contains(err.Error(), "ftp://x") {
		t.Errorf("workers add, bad url: %v", err)
	}
	if calls := b.Calls(); slices.Contains(calls, "UpsertWorker w6") {
		t.Errorf("backend calls: %v", calls)
	}

	// The token may come from the environment.
	t.Setenv(ctlTokenEnv, ctlTestToken)
	if out, err := runCtl(t, ts, "drain", "w1"); err != nil || !strings.Contains(out, "yes") {
		t.Fatalf("drain: %v\n%s", err, out)
	}
	if w, _ := b.GetWorker(t.Context(), "w1"); !w.Status.Draining {
		t.Error("w1 not draining")
	}
	if _, err := runCtl(t, ts, "undrain", "w1", "-o", "json"); err != nil {
		t.Fatal(err)
	}
	if w, _ := b.GetWorker(t.Context(), "w1"); w.Status.Draining {
		t.Error("w1 still draining")
	}
	if _, err := runCtl(t, ts, "drain", "w9"); err == nil || !strings.Contains(err.Error(), "404 not_found") {
		t.Errorf("drain w9: %v", err)
	}

	if out, err := runCtl(t, ts, "workers", "rm", "w5"); err != nil || !strings.Contains(out, "removed w5") {
		t.Fatalf("workers rm: %v\n%s", err, out)
	}
	if _, err := b.GetWorker(t.Context(), "w5"); err == nil {
		t.Error("w5 still there")
	}
	if _, err := runCtl(t, ts, "workers", "rm", "w1"); err == nil || !strings.Contains(err.Error(), "409") {
		t.Errorf("workers rm w1 (from the flags): %v", err)
	}
}

func TestCtlPolicy(t *testing.T) {
	t.Setenv(ctlTokenEnv, ctlTestToken)
	b := ctlFleet()
	ts := ctlServer(t, b, api.Options{Token: ctlTestToken, OpenReads: true})

	out, err := runCtl(t, ts, "policy")
	if err != nil || !strings.Contains(out, "cache_threshold") || !strings.Contains(out, "1,0.75,0.25") {
		t.Fatalf("policy: %v\n%s", err, out)
	}
	before, _ := b.GetPolicy(t.Context())

	out, err = runCtl(t, ts, "policy", "set", "--temperature", "0.5", "--tier-weights", "1,0.5,0", "--session-ttl", "1m", "--busy-decode-blocks", "900")
	if err != nil {
		t.Fatalf("policy set: %v\n%s", err, out)
	}
	p, _ := b.GetPolicy(t.Context())
	if p.Version != before.Version+1 || p.Temperature != 0.5 || len(p.TierWeights) != 3 || p.TierWeights[1] != 0.5 ||
		p.SessionTtlMs != 60000 || p.BusyDecodeBlocks != 900 {
		t.Errorf("policy after set: %v", p)
	}
	// Only the flags given changed.
	if p.Policy != before.Policy || p.OverlapWeight != before.OverlapWeight || p.CacheThreshold != before.CacheThreshold || p.BusyKvFraction != before.BusyKvFraction {
		t.Errorf("policy set changed more than asked: %v → %v", before, p)
	}
	if !strings.Contains(out, "version") || !strings.Contains(out, "1m0s") {
		t.Errorf("policy set output:\n%s", out)
	}

	// Zero is a value like any other once given.
	if _, err := runCtl(t, ts, "policy", "set", "--temperature", "0", "--policy", "least-loaded"); err != nil {
		t.Fatal(err)
	}
	if p, _ := b.GetPolicy(t.Context()); p.Temperature != 0 || p.Policy != "least-loaded" || p.BusyDecodeBlocks != 900 {
		t.Errorf("policy: %v", p)
	}

	if _, err := runCtl(t, ts, "policy", "set"); err == nil || !strings.Contains(err.Error(), "nothing to change") {
		t.Errorf("policy set without flags: %v", err)
	}
	if _, err := runCtl(t, ts, "policy", "set", "--policy", "best"); err == nil || !strings.Contains(err.Error(), "unknown policy") {
		t.Errorf("policy set --policy best: %v", err)
	}
}

func TestCtlIndexAndProxies(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	ts := ctlServer(t, ctlFleet(), api.Options{Token: ctlTestToken, OpenReads: true})
	out, err := runCtl(t, ts, "index")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"blocks: 123", "epoch 7", "offset 9001", "250.0 block events/s"} {
		if !strings.Contains(out, want) {
			t.Errorf("index lacks %q:\n%s", want, out)
		}
	}
	if !strings.Contains(strings.Join(strings.Fields(out), " "), "ID SLOT GPU CPU DISK SHARED w1 0 100 20 3 0 w2 1 0 0 0 0") {
		t.Errorf("index rows:\n%s", out)
	}

	out, err = runCtl(t, ts, "proxies")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "edge-1") || !strings.Contains(out, "RoutingPolicy: tier_weights: want 3") {
		t.Errorf("proxies:\n%s", out)
	}

	out, err = runCtl(t, ts, "tenants")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(strings.Fields(out), " "); got != "TENANT PROXIES REQUESTS/S PROMPT TOKENS/S OUTPUT TOKENS/S ADMITTED REFUSED acme 2 12.2 3400 0 900 17" {
		t.Errorf("tenants:\n%s", out)
	}
}

func TestCtlReadsClosed(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	ts := ctlServer(t, ctlFleet(), api.Options{Token: ctlTestToken})
	if _, err := runCtl(t, ts, "workers"); err == nil || !strings.Contains(err.Error(), "401") {
		t.Errorf("workers without token, reads closed: %v", err)
	}
	if out, err := runCtl(t, ts, "workers", "--token-file", ctlTokenFile(t, ctlTestToken)); err != nil || !strings.Contains(out, "w1") {
		t.Errorf("workers with token: %v\n%s", err, out)
	}
}

func TestCtlFlags(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	ts := ctlServer(t, ctlFleet(), api.Options{AllowUnauthenticated: true})
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"bad output", []string{"workers", "-o", "yaml"}, "want table or json"},
		{"missing token file", []string{"drain", "w1", "--token-file", "/nonexistent/token"}, "reading --token-file"},
		{"empty token file", []string{"drain", "w1", "--token-file", ctlTokenFile(t, " ")}, "is empty"},
		{"unknown subcommand", []string{"workers", "frobnicate"}, "unknown command"},
		{"bad spec", []string{"workers", "add", "id=w7"}, "missing url"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := runCtl(t, ts, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want %q", err, tc.want)
			}
		})
	}
	// A scheme-less --api and one with a trailing slash both work.
	cmd := newCtlCmd()
	cmd.SetOut(new(bytes.Buffer))
	cmd.SetArgs([]string{"workers", "--api", strings.TrimPrefix(ts.URL, "http://") + "/"})
	if err := cmd.ExecuteContext(t.Context()); err != nil {
		t.Errorf("--api host:port/: %v", err)
	}
	cmd = newCtlCmd()
	cmd.SilenceErrors = true
	cmd.SetOut(new(bytes.Buffer))
	cmd.SetArgs([]string{"workers", "--api", "ftp://x"})
	if err := cmd.ExecuteContext(t.Context()); err == nil || !strings.Contains(err.Error(), "--api") {
		t.Errorf("--api ftp://x: %v", err)
	}
}

func TestCtlParseWorkerSpec(t *testing.T) {
	tests := []struct {
		name, in string
		want     *operatorv1.WorkerSpec
		err      string
	}{
		{name: "minimal", in: "id=w1,url=http://127.0.0.1:8001",
			want: &operatorv1.WorkerSpec{Id: "w1", Url: "http://127.0.0.1:8001", Role: "both", Engine: "vllm", Metrics: "http://127.0.0.1:8001/metrics"}},
		{name: "every key, spaces, empty pairs", in: " id = w1 ,url=http://h:1,, model=m,role=prefill,block-size=16,kv-events=tcp://h:5557,kv-events-replay=tcp://h:5559,metrics=http://h:1/m,engine=sglang,",
			want: &operatorv1.WorkerSpec{Id: "w1", Url: "http://h:1", Model: "m", Role: "prefill", BlockSize: 16, KvEvents: "tcp://h:5557",
				KvEventsReplay: "tcp://h:5559", Metrics: "http://h:1/m", Engine: "sglang"}},
		{name: "value with =", in: "id=w1,url=http://h:1,metrics=http://h:1/m?a=b",
			want: &operatorv1.WorkerSpec{Id: "w1", Url: "http://h:1", Role: "both", Engine: "vllm", Metrics: "http://h:1/m?a=b"}},
		{name: "bind", in: "id=w1,url=http://h:1,kv-events-bind=tcp://*:5558,engine=sim",
			want: &operatorv1.WorkerSpec{Id: "w1", Url: "http://h:1", Role: "both", Engine: "sim", Metrics: "http://h:1/metrics", KvEventsBind: "tcp://*:5558"}},
		{name: "dial and bind", in: "id=w1,url=http://h:1,kv-events=tcp://h:1,kv-events-bind=tcp://*:5558", err: "choose one"},
		{name: "bad url", in: "id=w1,url=ftp://h:1", err: "url"},
		{name: "bad engine", in: "id=w1,url=http://h:1,engine=tgi", err: "engine"},
		{name: "unknown key", in: "id=w1,url=http://h:1,capacity=3", err: `unknown key "capacity"`},
		{name: "underscore key", in: "id=w1,url=http://h:1,kv_events=tcp://h:1", err: `unknown key "kv_events"`},
		{name: "twice", in: "id=w1,url=http://h:1,id=w2", err: "given twice"},
		{name: "not a pair", in: "id=w1,url=http://h:1,sim", err: "not key=value"},
		{name: "bad block size", in: "id=w1,url=http://h:1,block-size=-16", err: "block-size"},
		{name: "no id", in: "url=http://h:1", err: "missing id"},
		{name: "no url", in: "id=w1", err: "missing url"},
		{name: "empty", in: "", err: "missing id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseCtlWorkerSpec(tt.in)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("error %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, tt.want) {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

// TestCandidateFromFile: a candidate file changes only the fields it names, a zero
// included, and may not carry rollout fields of its own.
func TestCandidateFromFile(t *testing.T) {
	stable := &operatorv1.Policy{Version: 4, Policy: "kv", OverlapWeight: 64, QueueWeight: 8, CacheThreshold: 0.1, TierWeights: []float64{1, 0.75, 0.25}}
	c, err := candidateFrom(stable, []byte("overlap_weight: 0\ntemperature: 0.5\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.OverlapWeight != 0 || c.Temperature != 0.5 || c.QueueWeight != 8 || c.Policy != "kv" || len(c.TierWeights) != 3 || c.Version != 0 ||
		c.ComputeWeight != nil || c.DisaggThreshold != nil { // unset in the stable policy, unset in the candidate
		t.Fatalf("candidate %v", c)
	}
	if _, err := candidateFrom(stable, []byte(`{"policy": "round-robin"}`)); err != nil {
		t.Fatalf("a JSON candidate: %v", err)
	}
	for _, bad := range []string{"candidate_share: 0.5", "shadow: true", "overlap_weight: [1", "no_such_field: 1"} {
		if _, err := candidateFrom(stable, []byte(bad)); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// FuzzCandidateFrom: any candidate file is read or refused without panicking, and what is
// read carries no rollout of its own.
func FuzzCandidateFrom(f *testing.F) {
	f.Add([]byte("overlap_weight: 0\n"))
	f.Add([]byte(`{"policy": "kv", "tier_weights": [1, 0.5]}`))
	f.Add([]byte("candidate: {}\n"))
	stable := &operatorv1.Policy{Version: 2, Policy: "kv", OverlapWeight: 64}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := candidateFrom(stable, data)
		if err == nil && (c.Candidate != nil || c.CandidateShare != 0 || c.Shadow || c.Version != 0) {
			t.Fatalf("candidate %v", c)
		}
	})
}

// TestCtlRollout: start sends the candidate (the stable policy with the file's fields) and
// the spec, percentages as shares and unset thresholds left to the control plane; status
// prints the state and -o json a top-level state; the actions reach the backend; history
// lists the changes, the latest first.
func TestCtlRollout(t *testing.T) {
	b := ctlFleet()
	ts := ctlServer(t, b, api.Options{Token: ctlTestToken})
	tok := ctlTokenFile(t, ctlTestToken)
	cand := filepath.Join(t.TempDir(), "candidate.yaml")
	if err := os.WriteFile(cand, []byte("overlap_weight: 0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := runCtl(t, ts, "policy", "rollout", "status", "--token-file", tok); err == nil || !strings.Contains(err.Error(), "no rollout has run") {
		t.Fatalf("status before any rollout: %v\n%s", err, out)
	}
	if out, err := runCtl(t, ts, "policy", "rollout", "start", "--candidate-file", cand, "--steps", "25,50,150", "--token-file", tok); err == nil || !strings.Contains(err.Error(), "--steps") {
		t.Fatalf("a step past 100%%: %v\n%s", err, out)
	}
	out, err := runCtl(t, ts, "policy", "rollout", "start", "--candidate-file", cand, "--steps", "25,50,100",
		"--step-duration", "20s", "--min-requests", "40", "--max-hit-rate-drop", "0", "-o", "json", "--token-file", tok)
	if err != nil {
		t.Fatal(err, out)
	}
	var r operatorv1.Rollout
	if err := protojson.Unmarshal([]byte(out), &r); err != nil {
		t.Fatal(err, out)
	}
	sp := r.GetSpec()
	if r.State != "canary" || r.Candidate.GetOverlapWeight() != 0 || r.Candidate.GetPolicy() != "kv" || r.Candidate.GetQueueWeight() == 0 ||
		!slices.Equal(sp.GetSteps(), []float64{0.25, 0.5, 1}) || sp.GetStepDurationMs() != 20000 || sp.GetMinRequests() != 40 ||
		sp.MaxHitRateDrop == nil || *sp.MaxHitRateDrop != 0 || sp.MaxTtftP90Ratio != nil {
		t.Fatalf("started %v", &r)
	}
	out, err = runCtl(t, ts, "policy", "rollout", "status", "-o", "json", "--token-file", tok)
	var st map[string]any
	if err != nil || json.Unmarshal([]byte(out), &st) != nil || st["state"] != "canary" {
		t.Fatalf("status -o json: %v\n%s", err, out)
	}
	if out, err = runCtl(t, ts, "policy", "rollout", "pause", "--token-file", tok); err != nil || !strings.Contains(out, "rollout 1: paused") {
		t.Fatalf("pause: %v\n%s", err, out)
	}
	if out, err = runCtl(t, ts, "policy", "rollout", "abort", "--token-file", tok); err != nil || !strings.Contains(out, "aborted") {
		t.Fatalf("abort: %v\n%s", err, out)
	}
	if out, err = runCtl(t, ts, "policy", "rollout", "resume", "--token-file", tok); err == nil || !strings.Contains(err.Error(), "409") {
		t.Fatalf("resume after abort: %v\n%s", err, out)
	}
	if !slices.Contains(b.Calls(), "ControlRollout pause") || !slices.Contains(b.Calls(), "ControlRollout abort") {
		t.Fatalf("calls %v", b.Calls())
	}
	for _, temp := range []string{"0.25", "0.5"} {
		if out, err := runCtl(t, ts, "policy", "set", "--temperature", temp, "--token-file", tok); err != nil {
			t.Fatal(err, out)
		}
	}
	out, err = runCtl(t, ts, "policy", "history", "--limit", "1", "--token-file", tok)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if err != nil || len(lines) != 2 || !strings.HasPrefix(lines[0], "TIME") || !strings.Contains(lines[1], " 3 ") || !strings.HasSuffix(lines[1], "api") {
		t.Fatalf("history: %v\n%s", err, out)
	}
}

// TestCtlPolicyProfile: --profile-file sets a custom policy from YAML, the table shows its
// plugins, and --policy with a built-in name drops the profile again.
func TestCtlPolicyProfile(t *testing.T) {
	ts := ctlServer(t, ctlFleet(), api.Options{Token: ctlTestToken})
	tok := ctlTokenFile(t, ctlTestToken)
	f := filepath.Join(t.TempDir(), "profile.yaml")
	if err := os.WriteFile(f, []byte("filters: [{name: model}, {name: health}]\nscorers:\n  - {name: prefill, weight: 1, params: {overlap_weight: 32}}\n  - {name: load, weight: 4}\npicker: {name: min-cost}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := runCtl(t, ts, "policy", "set", "--profile-file", f, "--token-file", tok)
	if err != nil || !strings.Contains(out, "custom") || !strings.Contains(out, "prefill×1(overlap_weight=32) load×4") {
		t.Fatalf("set --profile-file: %v\n%s", err, out)
	}
	out, err = runCtl(t, ts, "policy", "set", "--policy", "kv", "-o", "json", "--token-file", tok)
	var p map[string]any
	if err != nil || json.Unmarshal([]byte(out), &p) != nil || p["policy"] != "kv" || p["profile"] != nil {
		t.Fatalf("back to kv: %v\n%s", err, out)
	}
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	_ = os.WriteFile(bad, []byte("scorer: [{name: load}]\n"), 0o600)
	if out, err := runCtl(t, ts, "policy", "set", "--profile-file", bad, "--token-file", tok); err == nil {
		t.Fatalf("a misspelt field was taken:\n%s", out)
	}
}

// FuzzParseProfile: any profile file is read or refused without panicking, and what is
// read marshals back.
func FuzzParseProfile(f *testing.F) {
	f.Add([]byte("filters: [{name: model}]\nscorers: [{name: load, weight: 2, params: {x: 1}}]\npicker: {name: min-cost}\n"))
	f.Add([]byte(`{"picker": {"name": "random"}, "spread": {"name": "least-prefill"}}`))
	f.Add([]byte("scorers: {a: 1}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := parseProfile(data)
		if err != nil {
			return
		}
		if _, err := protojson.Marshal(p); err != nil {
			t.Fatalf("%q read as %v, which does not marshal: %v", data, p, err)
		}
	})
}

// TestCtlOverTLS: --api-ca verifies an HTTPS operator API (host:port then means https);
// without it the API's certificate is not trusted.
func TestCtlOverTLS(t *testing.T) {
	t.Setenv(ctlTokenEnv, "")
	ts := httptest.NewTLSServer(api.Handler(ctlFleet(), api.Options{AllowUnauthenticated: true}))
	t.Cleanup(ts.Close)
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	hostPort := strings.TrimPrefix(ts.URL, "https://")
	if out, err := runCtlAt(t, hostPort, "workers", "--api-ca", caFile); err != nil || !strings.Contains(out, "w1") {
		t.Fatalf("ctl --api-ca over TLS: %v\n%s", err, out)
	}
	if _, err := runCtlAt(t, ts.URL, "workers"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("ctl without --api-ca against an untrusted certificate: %v", err)
	}
	if _, err := runCtlAt(t, hostPort, "workers", "--api-ca", ctlTokenFile(t, "not a certificate")); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Fatalf("ctl --api-ca with a file that holds no certificate: %v", err)
	}
}

// kvrelay ctl keys: add reads the key from a file (never the command line) and the API keeps
// its SHA-256; the list shows ids, SHA-256 prefixes and tenants; rm takes a key away.
func TestCtlKeys(t *testing.T) {
	t.Setenv(ctlTokenEnv, ctlTestToken)
	b := ctlFleet()
	ts := ctlServer(t, b, api.Options{Token: ctlTestToken})
	keyFile := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(keyFile, []byte("sk-ci-key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := runCtl(t, ts, "keys", "add", "ci", "--tenant", "acme", "--rps", "20", "--key-file", keyFile); err != nil {
		t.Fatalf("keys add: %v\n%s", err, out)
	}
	if out, err := runCtl(t, ts, "keys", "add", "laptop", "--tenant", "acme", "--rps", "20", "--sha256", strings.Repeat("ab", 32)); err != nil {
		t.Fatalf("keys add --sha256: %v\n%s", err, out)
	}
	for _, bad := range [][]string{
		{"keys", "add", "x", "--tenant", "acme"},                                          // neither
		{"keys", "add", "x", "--tenant", "acme", "--key-file", keyFile, "--sha256", "ab"}, // both
		{"keys", "add", "x", "--key-file", keyFile},                                       // no tenant
	} {
		if out, err := runCtl(t, ts, bad...); err == nil {
			t.Errorf("%v: no error\n%s", bad, out)
		}
	}
	out, err := runCtl(t, ts, "keys", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	// What reached the API is the key's SHA-256, not the key.
	sum := sha256.Sum256([]byte("sk-ci-key"))
	if !strings.Contains(out, hex.EncodeToString(sum[:])) {
		t.Errorf("the stored key has not the key's SHA-256:\n%s", out)
	}
	if out, err = runCtl(t, ts, "keys"); err != nil {
		t.Fatal(err)
	}
	fields := strings.Join(strings.Fields(out), " ")
	if !strings.Contains(fields, "ID SHA256 TENANT WEIGHT RPS PROMPT TPS OUTPUT TPM CACHE") || !strings.Contains(fields, "laptop abababababab… acme - 20 - - -") ||
		!strings.Contains(fields, "ci ") || strings.Contains(out, "sk-ci-key") {
		t.Errorf("keys:\n%s", out)
	}
	if out, err := runCtl(t, ts, "keys", "rm", "ci"); err != nil || !strings.Contains(out, "removed key ci") {
		t.Fatalf("keys rm: %v\n%s", err, out)
	}
	if out, err := runCtl(t, ts, "keys", "rm", "ci"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("keys rm of a removed key: %v\n%s", err, out)
	}
}

// A 503 (a replica that does not lead and does not know the leader yet, in a failover)
// changed nothing: ctl asks again and gets the leader's answer; one 503 after another ends
// after ctlTries calls with the API's error.
func TestCtlRetriesUnavailable(t *testing.T) {
	t.Setenv(ctlTokenEnv, ctlTestToken)
	b := ctlFleet()
	h := api.Handler(b, api.Options{Token: ctlTestToken})
	var calls, refuse atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if refuse.Add(-1) >= 0 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"error":{"message":"this replica does not lead (leader unknown)","code":"unavailable"}}`))
			return
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(ts.Close)

	refuse.Store(2)
	if out, err := runCtl(t, ts, "drain", "w1"); err != nil || !strings.Contains(out, "yes") {
		t.Fatalf("drain after two 503s: %v\n%s", err, out)
	}
	if n := calls.Load(); n != 3 {
		t.Fatalf("%d calls, want 3 (two refused, one answered)", n)
	}
	if w, _ := b.GetWorker(t.Context(), "w1"); !w.Status.Draining {
		t.Error("w1 not draining")
	}

	calls.Store(0)
	refuse.Store(100)
	if _, err := runCtl(t, ts, "workers"); err == nil || !strings.Contains(err.Error(), "503 unavailable") {
		t.Fatalf("workers while every call is refused: %v", err)
	}
	if n := calls.Load(); n != ctlTries {
		t.Fatalf("%d calls, want %d", n, ctlTries)
	}
}
