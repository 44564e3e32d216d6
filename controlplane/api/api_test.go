package api_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/controlplane/api"
	"github.com/kvrelay/kvrelay/controlplane/api/apitest"
	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

const token = "s3cret-token"

// fleet returns a backend with two workers: w1 from the flags (not removable through the
// API), w2 from the API.
func fleet() *apitest.Backend {
	b := apitest.New(
		&operatorv1.Worker{
			Spec: &operatorv1.WorkerSpec{Id: "w1", Url: "http://127.0.0.1:8001", Model: "m", Engine: "sim", Role: "both", Source: "flag"},
			Status: &operatorv1.WorkerStatus{Healthy: true, Running: 3, Waiting: 1, KvUsage: 0.5,
				Blocks: &operatorv1.BlockCounts{Gpu: 100, Cpu: 20},
				Ingest: &operatorv1.IngestStats{Batches: 7, Events: 120, Gaps: 1}},
		},
		&operatorv1.Worker{
			Spec:   &operatorv1.WorkerSpec{Id: "w2", Url: "http://127.0.0.1:8002", Engine: "vllm", Source: "api"},
			Status: &operatorv1.WorkerStatus{Slot: 1},
		},
	)
	b.SetIndex(&operatorv1.Index{TotalBlocks: 120, JournalEpoch: 9, JournalOffset: 4242, IngestRate: 12.5,
		Workers: []*operatorv1.WorkerBlocks{{Id: "w1", Blocks: &operatorv1.BlockCounts{Gpu: 100, Cpu: 20}}}})
	b.SetProxies(&operatorv1.Proxy{NodeId: "proxy-a", Streams: 1},
		&operatorv1.Proxy{NodeId: "proxy-b", Streams: 2, LastNack: &operatorv1.Nack{TypeUrl: "t", Reason: "bad weight"}})
	b.SetTenants(&operatorv1.Tenant{Name: "acme", Proxies: 2, RequestsPerSecond: 7.5, Admitted: 40, Refused: 3})
	return b
}

// serve starts Mux(gRPC, Handler) on one loopback listener.
func serve(t *testing.T, b api.Backend, opts api.Options) *httptest.Server {
	t.Helper()
	g := grpc.NewServer()
	api.Register(g, b, opts)
	ts := httptest.NewUnstartedServer(api.Mux(g, api.Handler(b, opts)))
	ts.Config.Protocols = api.Protocols()
	ts.Start()
	t.Cleanup(func() {
		ts.Close()
		g.Stop()
	})
	return ts
}

func grpcClient(t *testing.T, ts *httptest.Server) operatorv1.OperatorClient {
	t.Helper()
	cc, err := grpc.NewClient(strings.TrimPrefix(ts.URL, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return operatorv1.NewOperatorClient(cc)
}

func withToken(ctx context.Context, tok string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
}

type response struct {
	status int
	body   string
	header http.Header
}

func do(t *testing.T, ts *httptest.Server, method, path, body, tok string) response {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, ts.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := ts.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return response{status: resp.StatusCode, body: string(data), header: resp.Header}
}

// errorOf decodes an error body, failing the test if it is not one.
func errorOf(t *testing.T, r response) (message, code string) {
	t.Helper()
	var e struct {
		Error struct{ Message, Code string }
	}
	if err := json.Unmarshal([]byte(r.body), &e); err != nil || e.Error.Code == "" {
		t.Fatalf("status %d: not an error body (%v): %s", r.status, err, r.body)
	}
	return e.Error.Message, e.Error.Code
}

func unmarshal[M proto.Message](t *testing.T, r response, m M) M {
	t.Helper()
	if err := protojson.Unmarshal([]byte(r.body), m); err != nil {
		t.Fatalf("status %d: %v: %s", r.status, err, r.body)
	}
	return m
}

func TestHTTPRoutes(t *testing.T) {
	tests := []struct {
		name, method, path, body string
		tok                      string
		want                     int
		check                    func(t *testing.T, r response, b *apitest.Backend)
	}{
		{name: "list workers", method: "GET", path: "/v1/workers", want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			l := unmarshal(t, r, &operatorv1.ListWorkersResponse{})
			if len(l.Workers) != 2 || l.Workers[0].Spec.Id != "w1" || l.Workers[0].Status.Blocks.Gpu != 100 || l.Workers[0].Status.Ingest.Events != 120 {
				t.Errorf("workers: %v", l)
			}
			// Proto field names, every field written.
			for _, s := range []string{`"kv_usage"`, `"block_size"`, `"kv_events_replay"`, `"last_event_unix_nano"`} {
				if !strings.Contains(r.body, s) {
					t.Errorf("body lacks %s: %s", s, r.body)
				}
			}
		}},
		{name: "get worker", method: "GET", path: "/v1/workers/w1", want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			if w := unmarshal(t, r, &operatorv1.Worker{}); w.Spec.GetUrl() != "http://127.0.0.1:8001" || !w.Status.GetHealthy() {
				t.Errorf("worker: %v", w)
			}
		}},
		{name: "get missing worker", method: "GET", path: "/v1/workers/nope", want: 404},
		{name: "put worker", method: "PUT", path: "/v1/workers/w5", tok: token, want: 200,
			body: `{"url": "http://127.0.0.1:8005", "kv_events": "tcp://127.0.0.1:5565", "engine": "sim", "block_size": 16, "source": "k8s"}`,
			check: func(t *testing.T, r response, b *apitest.Backend) {
				w := unmarshal(t, r, &operatorv1.Worker{})
				if w.Spec.GetId() != "w5" || w.Spec.GetKvEvents() != "tcp://127.0.0.1:5565" || w.Spec.GetBlockSize() != 16 || w.Spec.GetSource() != "api" {
					t.Errorf("worker: %v", w)
				}
				if _, err := b.GetWorker(t.Context(), "w5"); err != nil {
					t.Error(err)
				}
			}},
		{name: "put worker with camelCase names and its id", method: "PUT", path: "/v1/workers/w6", tok: token, want: 200,
			body: `{"id": "w6", "url": "http://127.0.0.1:8006", "kvEventsBind": "tcp://*:5566"}`,
			check: func(t *testing.T, r response, _ *apitest.Backend) {
				if w := unmarshal(t, r, &operatorv1.Worker{}); w.Spec.GetKvEventsBind() != "tcp://*:5566" {
					t.Errorf("worker: %v", w)
				}
			}},
		{name: "put worker, escaped id", method: "PUT", path: "/v1/workers/a%2Fb", tok: token, want: 200,
			body: `{"url": "http://127.0.0.1:8007"}`,
			check: func(t *testing.T, r response, _ *apitest.Backend) {
				if w := unmarshal(t, r, &operatorv1.Worker{}); w.Spec.GetId() != "a/b" {
					t.Errorf("worker: %v", w)
				}
			}},
		{name: "put worker, id mismatch", method: "PUT", path: "/v1/workers/w5", tok: token, want: 400,
			body: `{"id": "w9", "url": "http://127.0.0.1:8005"}`},
		{name: "put worker, invalid", method: "PUT", path: "/v1/workers/w5", tok: token, want: 400, body: `{"url": "ftp://x"}`},
		{name: "put worker, unknown field", method: "PUT", path: "/v1/workers/w5", tok: token, want: 400,
			body: `{"url": "http://127.0.0.1:8005", "kv-events": "tcp://x:1"}`},
		{name: "put worker, no body", method: "PUT", path: "/v1/workers/w5", tok: token, want: 400},
		{name: "delete worker", method: "DELETE", path: "/v1/workers/w2", tok: token, want: 200, check: func(t *testing.T, r response, b *apitest.Backend) {
			if _, err := b.GetWorker(t.Context(), "w2"); !errors.Is(err, api.ErrNotFound) {
				t.Errorf("w2 still there: %v", err)
			}
		}},
		{name: "delete worker from flags", method: "DELETE", path: "/v1/workers/w1", tok: token, want: 409},
		{name: "delete missing worker", method: "DELETE", path: "/v1/workers/nope", tok: token, want: 404},
		{name: "drain", method: "POST", path: "/v1/workers/w1/drain", tok: token, want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			if w := unmarshal(t, r, &operatorv1.Worker{}); !w.Status.GetDraining() {
				t.Errorf("not draining: %v", w)
			}
		}},
		{name: "undrain", method: "POST", path: "/v1/workers/w1/undrain", tok: token, want: 200, check: func(t *testing.T, r response, b *apitest.Backend) {
			if w := unmarshal(t, r, &operatorv1.Worker{}); w.Status.GetDraining() {
				t.Errorf("draining: %v", w)
			}
			if calls := b.Calls(); calls[len(calls)-1] != "SetDraining w1 false" {
				t.Errorf("calls: %v", calls)
			}
		}},
		{name: "drain missing worker", method: "POST", path: "/v1/workers/nope/drain", tok: token, want: 404},
		{name: "get policy", method: "GET", path: "/v1/policy", want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			if p := unmarshal(t, r, &operatorv1.Policy{}); p.Version != 1 || p.Policy != "kv" || len(p.TierWeights) != 4 {
				t.Errorf("policy: %v", p)
			}
			if !strings.Contains(r.body, `"cache_threshold"`) || !strings.Contains(r.body, `"session_ttl_ms"`) {
				t.Errorf("body: %s", r.body)
			}
		}},
		{name: "set policy ignores the version", method: "PUT", path: "/v1/policy", tok: token, want: 200,
			body: `{"version": "77", "policy": "kv", "overlap_weight": 2, "temperature": 0.5, "tier_weights": [1, 0.5, 0.1], "session_ttl_ms": "60000"}`,
			check: func(t *testing.T, r response, _ *apitest.Backend) {
				p := unmarshal(t, r, &operatorv1.Policy{})
				if p.Version != 2 || p.OverlapWeight != 2 || p.Temperature != 0.5 || p.SessionTtlMs != 60000 {
					t.Errorf("policy: %v", p)
				}
			}},
		{name: "set invalid policy", method: "PUT", path: "/v1/policy", tok: token, want: 400, body: `{"policy": "best"}`},
		{name: "rollout before any", method: "GET", path: "/v1/rollout", want: 404},
		{name: "start rollout needs a token", method: "POST", path: "/v1/rollout", want: 401, body: `{"candidate": {"policy": "kv"}}`},
		{name: "start rollout without a candidate", method: "POST", path: "/v1/rollout", tok: token, want: 400, body: `{"spec": {}}`},
		{name: "start rollout with a nested candidate", method: "POST", path: "/v1/rollout", tok: token, want: 400,
			body: `{"candidate": {"policy": "kv", "candidate": {"policy": "kv"}}}`},
		{name: "start rollout", method: "POST", path: "/v1/rollout", tok: token, want: 200,
			body: `{"candidate": {"version": "9", "policy": "kv", "overlap_weight": 0}, "spec": {"steps": [0.25, 1]}}`,
			check: func(t *testing.T, r response, b *apitest.Backend) {
				if x := unmarshal(t, r, &operatorv1.Rollout{}); x.State != "canary" || x.Share != 0.25 || x.Candidate.GetVersion() == 9 {
					t.Errorf("rollout: %v", x)
				}
			}},
		{name: "unknown rollout action", method: "POST", path: "/v1/rollout/rewind", tok: token, want: 400},
		{name: "history, bad limit", method: "GET", path: "/v1/policy/history?limit=-1", want: 400},
		{name: "set policy, wrong type", method: "PUT", path: "/v1/policy", tok: token, want: 400, body: `{"overlap_weight": "heavy"}`},
		{name: "index", method: "GET", path: "/v1/index", want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			x := unmarshal(t, r, &operatorv1.Index{})
			if x.TotalBlocks != 120 || x.JournalOffset != 4242 || x.JournalEpoch != 9 || len(x.Workers) != 1 || x.IngestRate != 12.5 {
				t.Errorf("index: %v", x)
			}
		}},
		{name: "proxies", method: "GET", path: "/v1/proxies", want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			l := unmarshal(t, r, &operatorv1.ListProxiesResponse{})
			if len(l.Proxies) != 2 || l.Proxies[1].LastNack.GetReason() != "bad weight" {
				t.Errorf("proxies: %v", l)
			}
		}},
		{name: "tenants", method: "GET", path: "/v1/tenants", want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			l := unmarshal(t, r, &operatorv1.ListTenantsResponse{})
			if len(l.Tenants) != 1 || l.Tenants[0].GetName() != "acme" || l.Tenants[0].GetRequestsPerSecond() != 7.5 || l.Tenants[0].GetRefused() != 3 {
				t.Errorf("tenants: %v", l)
			}
		}},
		{name: "put key", method: "PUT", path: "/v1/keys/ci", tok: token, want: 200, body: `{"key": "sk-ci", "tenant": "acme", "rps": 5}`,
			check: func(t *testing.T, r response, b *apitest.Backend) {
				k := unmarshal(t, r, &operatorv1.ApiKey{})
				if k.GetId() != "ci" || k.GetKey() != "" || k.GetTenant() != "acme" {
					t.Errorf("stored key: %v", k)
				}
			}},
		{name: "put key, ids differ", method: "PUT", path: "/v1/keys/ci", tok: token, want: 400, body: `{"id": "other", "key": "sk-ci", "tenant": "acme"}`},
		{name: "put key, no key", method: "PUT", path: "/v1/keys/ci", tok: token, want: 400, body: `{"tenant": "acme"}`},
		{name: "put key, no token", method: "PUT", path: "/v1/keys/ci", want: 401, body: `{"key": "sk-ci", "tenant": "acme"}`},
		{name: "delete key, none", method: "DELETE", path: "/v1/keys/nope", tok: token, want: 404},
		{name: "healthz", method: "GET", path: "/healthz", want: 200, check: func(t *testing.T, r response, _ *apitest.Backend) {
			if !strings.Contains(r.body, `"ok"`) {
				t.Errorf("body: %s", r.body)
			}
		}},
		{name: "unknown route", method: "GET", path: "/v2/things", want: 404},
		{name: "method not allowed", method: "POST", path: "/v1/workers", tok: token, want: 405, check: func(t *testing.T, r response, _ *apitest.Backend) {
			if got := r.header.Get("Allow"); got != "GET" {
				t.Errorf("Allow: %q", got)
			}
		}},
		{name: "put on index", method: "PUT", path: "/v1/index", tok: token, want: 405},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := fleet()
			ts := serve(t, b, api.Options{Token: token, OpenReads: true})
			r := do(t, ts, tt.method, tt.path, tt.body, tt.tok)
			if r.status != tt.want {
				t.Fatalf("status %d, want %d: %s", r.status, tt.want, r.body)
			}
			if ct := r.header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q", ct)
			}
			if tt.want >= 400 {
				msg, code := errorOf(t, r)
				if msg == "" || code == "" {
					t.Errorf("error body: %s", r.body)
				}
			} else if !json.Valid([]byte(r.body)) {
				t.Errorf("invalid JSON: %s", r.body)
			}
			if tt.check != nil {
				tt.check(t, r, b)
			}
		})
	}
}

// authCase is one call made with a token (or none) against an API with some options.
type authCase struct {
	name     string
	opts     api.Options
	mutating bool
	tok      string
	want     codes.Code // codes.OK: allowed
}

var authCases = []authCase{
	{name: "open read without token", opts: api.Options{Token: token, OpenReads: true}, want: codes.OK},
	{name: "open read with wrong token", opts: api.Options{Token: token, OpenReads: true}, tok: "nope", want: codes.OK},
	{name: "closed read without token", opts: api.Options{Token: token}, want: codes.Unauthenticated},
	{name: "closed read with wrong token", opts: api.Options{Token: token}, tok: "nope", want: codes.Unauthenticated},
	{name: "closed read with token", opts: api.Options{Token: token}, tok: token, want: codes.OK},
	{name: "mutation without token", opts: api.Options{Token: token, OpenReads: true}, mutating: true, want: codes.Unauthenticated},
	{name: "mutation with wrong token", opts: api.Options{Token: token, OpenReads: true}, mutating: true, tok: "nope", want: codes.Unauthenticated},
	{name: "mutation with token prefix", opts: api.Options{Token: token, OpenReads: true}, mutating: true, tok: token[:4], want: codes.Unauthenticated},
	{name: "mutation with token", opts: api.Options{Token: token, OpenReads: true}, mutating: true, tok: token, want: codes.OK},
	{name: "mutation, no token configured", opts: api.Options{OpenReads: true}, mutating: true, tok: "anything", want: codes.PermissionDenied},
	{name: "closed read, no token configured", opts: api.Options{}, want: codes.PermissionDenied},
	{name: "mutation, unauthenticated allowed", opts: api.Options{AllowUnauthenticated: true}, mutating: true, want: codes.OK},
	{name: "read, unauthenticated allowed", opts: api.Options{AllowUnauthenticated: true}, want: codes.OK},
	{name: "mutation, token and unauthenticated allowed", opts: api.Options{Token: token, AllowUnauthenticated: true}, mutating: true, want: codes.Unauthenticated},
}

func TestHTTPAuth(t *testing.T) {
	httpStatus := map[codes.Code]int{codes.OK: 200, codes.Unauthenticated: 401, codes.PermissionDenied: 403}
	for _, tc := range authCases {
		t.Run(tc.name, func(t *testing.T) {
			ts := serve(t, fleet(), tc.opts)
			r := do(t, ts, "GET", "/v1/workers", "", tc.tok)
			if tc.mutating {
				r = do(t, ts, "POST", "/v1/workers/w1/drain", "", tc.tok)
			}
			if r.status != httpStatus[tc.want] {
				t.Fatalf("status %d, want %d: %s", r.status, httpStatus[tc.want], r.body)
			}
			if tc.want == codes.OK {
				return
			}
			msg, code := errorOf(t, r)
			if code != api.CodeName(tc.want) {
				t.Errorf("code %q, want %q", code, api.CodeName(tc.want))
			}
			if tc.want == codes.PermissionDenied && !strings.Contains(msg, "--api-token-file") {
				t.Errorf("message %q does not say how to configure a token", msg)
			}
			if tc.want == codes.Unauthenticated && !strings.HasPrefix(r.header.Get("WWW-Authenticate"), "Bearer") {
				t.Errorf("WWW-Authenticate %q", r.header.Get("WWW-Authenticate"))
			}
			// The health check is never authenticated.
			if r := do(t, ts, "GET", "/healthz", "", ""); r.status != 200 {
				t.Errorf("healthz: %d %s", r.status, r.body)
			}
		})
	}
}

func TestGRPCAuth(t *testing.T) {
	for _, tc := range authCases {
		t.Run(tc.name, func(t *testing.T) {
			c := grpcClient(t, serve(t, fleet(), tc.opts))
			ctx := t.Context()
			if tc.tok != "" {
				ctx = withToken(ctx, tc.tok)
			}
			var err error
			if tc.mutating {
				_, err = c.Drain(ctx, &operatorv1.DrainRequest{Id: "w1"})
			} else {
				_, err = c.ListWorkers(ctx, &operatorv1.ListWorkersRequest{})
			}
			if got := status.Code(err); got != tc.want {
				t.Fatalf("code %v, want %v (%v)", got, tc.want, err)
			}
		})
	}
}

// TestGRPC calls every method of the service through a real gRPC client.
func TestGRPC(t *testing.T) {
	b := fleet()
	c := grpcClient(t, serve(t, b, api.Options{Token: token}))
	ctx := withToken(t.Context(), token)

	l, err := c.ListWorkers(ctx, &operatorv1.ListWorkersRequest{})
	if err != nil || len(l.Workers) != 2 || l.Workers[0].Status.GetRunning() != 3 {
		t.Fatalf("ListWorkers: %v %v", l, err)
	}
	w, err := c.GetWorker(ctx, &operatorv1.GetWorkerRequest{Id: "w2"})
	if err != nil || w.Spec.GetUrl() != "http://127.0.0.1:8002" {
		t.Fatalf("GetWorker: %v %v", w, err)
	}
	w, err = c.UpsertWorker(ctx, &operatorv1.UpsertWorkerRequest{Spec: &operatorv1.WorkerSpec{Id: "w3", Url: "http://127.0.0.1:8003", Role: "decode"}})
	if err != nil || w.Spec.GetRole() != "decode" || w.Spec.GetSource() != "api" {
		t.Fatalf("UpsertWorker: %v %v", w, err)
	}
	if w, err = c.Drain(ctx, &operatorv1.DrainRequest{Id: "w3"}); err != nil || !w.Status.GetDraining() {
		t.Fatalf("Drain: %v %v", w, err)
	}
	if w, err = c.Undrain(ctx, &operatorv1.UndrainRequest{Id: "w3"}); err != nil || w.Status.GetDraining() {
		t.Fatalf("Undrain: %v %v", w, err)
	}
	if _, err := c.RemoveWorker(ctx, &operatorv1.RemoveWorkerRequest{Id: "w3"}); err != nil {
		t.Fatalf("RemoveWorker: %v", err)
	}
	p, err := c.GetPolicy(ctx, &operatorv1.GetPolicyRequest{})
	if err != nil || p.Version != 1 {
		t.Fatalf("GetPolicy: %v %v", p, err)
	}
	p.Temperature = 0.2
	p.Version = 999
	if p, err = c.SetPolicy(ctx, &operatorv1.SetPolicyRequest{Policy: p}); err != nil || p.Version != 2 || p.Temperature != 0.2 {
		t.Fatalf("SetPolicy: %v %v", p, err)
	}
	x, err := c.GetIndex(ctx, &operatorv1.GetIndexRequest{})
	if err != nil || x.TotalBlocks != 120 {
		t.Fatalf("GetIndex: %v %v", x, err)
	}
	ps, err := c.ListProxies(ctx, &operatorv1.ListProxiesRequest{})
	if err != nil || len(ps.Proxies) != 2 || ps.Proxies[0].NodeId != "proxy-a" {
		t.Fatalf("ListProxies: %v %v", ps, err)
	}
	ts, err := c.ListTenants(ctx, &operatorv1.ListTenantsRequest{})
	if err != nil || len(ts.Tenants) != 1 || ts.Tenants[0].GetAdmitted() != 40 {
		t.Fatalf("ListTenants: %v %v", ts, err)
	}

	// Errors.
	for _, tc := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"get missing", func() error { _, err := c.GetWorker(ctx, &operatorv1.GetWorkerRequest{Id: "nope"}); return err }, codes.NotFound},
		{"get without id", func() error { _, err := c.GetWorker(ctx, &operatorv1.GetWorkerRequest{}); return err }, codes.InvalidArgument},
		{"upsert without spec", func() error { _, err := c.UpsertWorker(ctx, &operatorv1.UpsertWorkerRequest{}); return err }, codes.InvalidArgument},
		{"upsert without id", func() error {
			_, err := c.UpsertWorker(ctx, &operatorv1.UpsertWorkerRequest{Spec: &operatorv1.WorkerSpec{Url: "http://x:1"}})
			return err
		}, codes.InvalidArgument},
		{"upsert invalid", func() error {
			_, err := c.UpsertWorker(ctx, &operatorv1.UpsertWorkerRequest{Spec: &operatorv1.WorkerSpec{Id: "w9", Url: "nope"}})
			return err
		}, codes.InvalidArgument},
		{"remove from flags", func() error { _, err := c.RemoveWorker(ctx, &operatorv1.RemoveWorkerRequest{Id: "w1"}); return err }, codes.FailedPrecondition},
		{"remove missing", func() error { _, err := c.RemoveWorker(ctx, &operatorv1.RemoveWorkerRequest{Id: "w3"}); return err }, codes.NotFound},
		{"undrain missing", func() error { _, err := c.Undrain(ctx, &operatorv1.UndrainRequest{Id: "w3"}); return err }, codes.NotFound},
		{"set no policy", func() error { _, err := c.SetPolicy(ctx, &operatorv1.SetPolicyRequest{}); return err }, codes.InvalidArgument},
		{"set invalid policy", func() error {
			_, err := c.SetPolicy(ctx, &operatorv1.SetPolicyRequest{Policy: &operatorv1.Policy{Policy: "kv", OverlapWeight: -1}})
			return err
		}, codes.InvalidArgument},
	} {
		if got := status.Code(tc.call()); got != tc.want {
			t.Errorf("%s: code %v, want %v", tc.name, got, tc.want)
		}
	}
}

// errBackend fails every call with err.
type errBackend struct{ err error }

func (b errBackend) ListWorkers(context.Context) ([]*operatorv1.Worker, error) { return nil, b.err }
func (b errBackend) GetWorker(context.Context, string) (*operatorv1.Worker, error) {
	return nil, b.err
}
func (b errBackend) UpsertWorker(context.Context, *operatorv1.WorkerSpec) (*operatorv1.Worker, error) {
	return nil, b.err
}
func (b errBackend) RemoveWorker(context.Context, string) error { return b.err }
func (b errBackend) SetDraining(context.Context, string, bool) (*operatorv1.Worker, error) {
	return nil, b.err
}
func (b errBackend) GetPolicy(context.Context) (*operatorv1.Policy, error) { return nil, b.err }
func (b errBackend) SetPolicy(context.Context, *operatorv1.Policy) (*operatorv1.Policy, error) {
	return nil, b.err
}
func (b errBackend) GetIndex(context.Context) (*operatorv1.Index, error)       { return nil, b.err }
func (b errBackend) ListProxies(context.Context) ([]*operatorv1.Proxy, error)  { return nil, b.err }
func (b errBackend) ListTenants(context.Context) ([]*operatorv1.Tenant, error) { return nil, b.err }
func (b errBackend) ListAPIKeys(context.Context) ([]*operatorv1.ApiKey, error) { return nil, b.err }
func (b errBackend) PutAPIKey(context.Context, *operatorv1.ApiKey) (*operatorv1.ApiKey, error) {
	return nil, b.err
}
func (b errBackend) DeleteAPIKey(context.Context, string) error { return b.err }
func (b errBackend) StartRollout(context.Context, *operatorv1.Policy, *operatorv1.RolloutSpec) (*operatorv1.Rollout, error) {
	return nil, b.err
}
func (b errBackend) GetRollout(context.Context) (*operatorv1.Rollout, error) { return nil, b.err }
func (b errBackend) ControlRollout(context.Context, string) (*operatorv1.Rollout, error) {
	return nil, b.err
}
func (b errBackend) PolicyHistory(context.Context, int) ([]*operatorv1.PolicyChange, error) {
	return nil, b.err
}

func TestErrorMapping(t *testing.T) {
	tests := []struct {
		name       string
		err        error
		wantCode   codes.Code
		wantStatus int
		wantName   string
	}{
		{"not found", fmt.Errorf("getting worker: %w: w9", api.ErrNotFound), codes.NotFound, 404, "not_found"},
		{"invalid", fmt.Errorf("%w: url missing", api.ErrInvalid), codes.InvalidArgument, 400, "invalid_argument"},
		{"conflict", fmt.Errorf("%w: comes from the workers file", api.ErrConflict), codes.FailedPrecondition, 409, "failed_precondition"},
		{"grpc status", status.Error(codes.Unavailable, "store closed"), codes.Unavailable, 503, "unavailable"},
		{"deadline", fmt.Errorf("writing store: %w", context.DeadlineExceeded), codes.DeadlineExceeded, 504, "deadline_exceeded"},
		{"other", errors.New("disk on fire"), codes.Internal, 500, "internal"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := serve(t, errBackend{tt.err}, api.Options{Token: token})
			c := grpcClient(t, ts)
			ctx := withToken(t.Context(), token)
			calls := []struct {
				name         string
				grpc         func() error
				method, path string
				body         string
			}{
				{"ListWorkers", func() error { _, err := c.ListWorkers(ctx, &operatorv1.ListWorkersRequest{}); return err }, "GET", "/v1/workers", ""},
				{"GetWorker", func() error { _, err := c.GetWorker(ctx, &operatorv1.GetWorkerRequest{Id: "w"}); return err }, "GET", "/v1/workers/w", ""},
				{"UpsertWorker", func() error {
					_, err := c.UpsertWorker(ctx, &operatorv1.UpsertWorkerRequest{Spec: &operatorv1.WorkerSpec{Id: "w"}})
					return err
				}, "PUT", "/v1/workers/w", `{"url": "http://x:1"}`},
				{"RemoveWorker", func() error { _, err := c.RemoveWorker(ctx, &operatorv1.RemoveWorkerRequest{Id: "w"}); return err }, "DELETE", "/v1/workers/w", ""},
				{"Drain", func() error { _, err := c.Drain(ctx, &operatorv1.DrainRequest{Id: "w"}); return err }, "POST", "/v1/workers/w/drain", ""},
				{"Undrain", func() error { _, err := c.Undrain(ctx, &operatorv1.UndrainRequest{Id: "w"}); return err }, "POST", "/v1/workers/w/undrain", ""},
				{"GetPolicy", func() error { _, err := c.GetPolicy(ctx, &operatorv1.GetPolicyRequest{}); return err }, "GET", "/v1/policy", ""},
				{"SetPolicy", func() error {
					_, err := c.SetPolicy(ctx, &operatorv1.SetPolicyRequest{Policy: &operatorv1.Policy{}})
					return err
				}, "PUT", "/v1/policy", `{"policy": "kv"}`},
				{"GetIndex", func() error { _, err := c.GetIndex(ctx, &operatorv1.GetIndexRequest{}); return err }, "GET", "/v1/index", ""},
				{"ListProxies", func() error { _, err := c.ListProxies(ctx, &operatorv1.ListProxiesRequest{}); return err }, "GET", "/v1/proxies", ""},
				{"ListTenants", func() error { _, err := c.ListTenants(ctx, &operatorv1.ListTenantsRequest{}); return err }, "GET", "/v1/tenants", ""},
				{"ListApiKeys", func() error { _, err := c.ListApiKeys(ctx, &operatorv1.ListApiKeysRequest{}); return err }, "GET", "/v1/keys", ""},
				{"PutApiKey", func() error {
					_, err := c.PutApiKey(ctx, &operatorv1.PutApiKeyRequest{Key: &operatorv1.ApiKey{Id: "k", Key: "sk", Tenant: "t"}})
					return err
				}, "PUT", "/v1/keys/k", `{"key": "sk", "tenant": "t"}`},
				{"DeleteApiKey", func() error { _, err := c.DeleteApiKey(ctx, &operatorv1.DeleteApiKeyRequest{Id: "k"}); return err }, "DELETE", "/v1/keys/k", ""},
				{"StartRollout", func() error {
					_, err := c.StartRollout(ctx, &operatorv1.StartRolloutRequest{Candidate: &operatorv1.Policy{Policy: "kv"}})
					return err
				}, "POST", "/v1/rollout", `{"candidate": {"policy": "kv"}}`},
				{"GetRollout", func() error { _, err := c.GetRollout(ctx, &operatorv1.GetRolloutRequest{}); return err }, "GET", "/v1/rollout", ""},
				{"ControlRollout", func() error {
					_, err := c.ControlRollout(ctx, &operatorv1.ControlRolloutRequest{Action: "pause"})
					return err
				}, "POST", "/v1/rollout/pause", ""},
				{"PolicyHistory", func() error { _, err := c.PolicyHistory(ctx, &operatorv1.PolicyHistoryRequest{}); return err }, "GET", "/v1/policy/history", ""},
			}
			for _, call := range calls {
				err := call.grpc()
				if s := status.Convert(err); s.Code() != tt.wantCode || !strings.Contains(s.Message(), tt.err.Error()) && tt.wantCode != codes.Unavailable {
					t.Errorf("%s over gRPC: %v, want code %v and the backend's message", call.name, err, tt.wantCode)
				}
				r := do(t, ts, call.method, call.path, call.body, token)
				if r.status != tt.wantStatus {
					t.Errorf("%s over HTTP: status %d, want %d: %s", call.name, r.status, tt.wantStatus, r.body)
					continue
				}
				if msg, code := errorOf(t, r); code != tt.wantName || msg == "" {
					t.Errorf("%s over HTTP: error %q %q, want code %q", call.name, msg, code, tt.wantName)
				}
			}
		})
	}
}

func TestBodyLimits(t *testing.T) {
	ts := serve(t, fleet(), api.Options{Token: token})
	big := `{"policy": "kv", "tier_weights": [` + strings.Repeat("1, ", api.MaxBodyBytes/3) + `1]}`
	for _, path := range []string{"/v1/policy", "/v1/workers/w9"} {
		r := do(t, ts, "PUT", path, big, token)
		if r.status != http.StatusRequestEntityTooLarge {
			t.Fatalf("%s: status %d for %d bytes: %.200s", path, r.status, len(big), r.body)
		}
		if _, code := errorOf(t, r); code != "request_too_large" {
			t.Errorf("%s: code %q", path, code)
		}
	}
	// Just under the limit is read (and then refused only for what it says).
	fits := `{"policy": "kv", "tier_weights": [1]` + strings.Repeat(" ", api.MaxBodyBytes-40) + `}`
	if r := do(t, ts, "PUT", "/v1/policy", fits, token); r.status != 200 {
		t.Errorf("%d-byte body: status %d: %.200s", len(fits), r.status, r.body)
	}
}

func TestMalformedJSON(t *testing.T) {
	ts := serve(t, fleet(), api.Options{Token: token})
	for _, body := range []string{
		`{`, `[]`, `"kv"`, `null`, `{"policy": 3}`, `{"tier_weights": "1,2"}`, `{"policy": "kv"} {"policy": "kv"}`,
		`{"session_ttl_ms": "soon"}`, "{\"policy\": \"k\xffv\"}", `{"busy_decode_blocks": -1}`, "  \n ",
	} {
		for _, path := range []string{"/v1/policy", "/v1/workers/w9"} {
			r := do(t, ts, "PUT", path, body, token)
			if r.status != 400 {
				t.Errorf("PUT %s %q: status %d: %s", path, body, r.status, r.body)
				continue
			}
			if _, code := errorOf(t, r); code != "invalid_argument" {
				t.Errorf("PUT %s %q: code %q", path, body, code)
			}
		}
	}
}

// TestMuxOneListener serves a gRPC client and a plain HTTP/1.1 JSON client on one listener.
func TestMuxOneListener(t *testing.T) {
	ts := serve(t, fleet(), api.Options{Token: token, OpenReads: true})

	// HTTP/1.1, the way curl and kvrelay ctl talk.
	resp, err := ts.Client().Get(ts.URL + "/v1/workers")
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.ProtoMajor != 1 {
		t.Fatalf("HTTP: %s %s: %s", resp.Proto, resp.Status, data)
	}
	var l operatorv1.ListWorkersResponse
	if err := protojson.Unmarshal(data, &l); err != nil || len(l.Workers) != 2 {
		t.Fatalf("HTTP: %v %v", &l, err)
	}

	// gRPC, over unencrypted HTTP/2 on the same port.
	c := grpcClient(t, ts)
	w, err := c.Drain(withToken(t.Context(), token), &operatorv1.DrainRequest{Id: "w1"})
	if err != nil || !w.Status.GetDraining() {
		t.Fatalf("gRPC: %v %v", w, err)
	}

	// The change made over gRPC is seen over HTTP.
	r := do(t, ts, "GET", "/v1/workers/w1", "", "")
	if got := unmarshal(t, r, &operatorv1.Worker{}); !got.Status.GetDraining() {
		t.Errorf("HTTP after gRPC drain: %v", got)
	}

	// An HTTP/2 client sending JSON (not gRPC) still gets the JSON handler.
	tr := &http.Transport{Protocols: api.Protocols()}
	tr.Protocols.SetHTTP1(false)
	defer tr.CloseIdleConnections()
	resp, err = (&http.Client{Transport: tr}).Get(ts.URL + "/v1/policy")
	if err != nil {
		t.Fatal(err)
	}
	data, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.ProtoMajor != 2 || resp.StatusCode != 200 || !json.Valid(data) {
		t.Fatalf("h2c JSON: %s %s: %s", resp.Proto, resp.Status, data)
	}
}

// TestNilResults: a Backend returning nil messages without an error still gets valid
// responses on both transports.
func TestNilResults(t *testing.T) {
	ts := serve(t, errBackend{nil}, api.Options{AllowUnauthenticated: true})
	for _, path := range []string{"/v1/workers", "/v1/workers/w", "/v1/policy", "/v1/index", "/v1/proxies"} {
		if r := do(t, ts, "GET", path, "", ""); r.status != 200 || !json.Valid([]byte(r.body)) {
			t.Errorf("GET %s: %d %s", path, r.status, r.body)
		}
	}
	c := grpcClient(t, ts)
	if _, err := c.GetPolicy(t.Context(), &operatorv1.GetPolicyRequest{}); err != nil {
		t.Error(err)
	}
	if _, err := c.Drain(t.Context(), &operatorv1.DrainRequest{Id: "w"}); err != nil {
		t.Error(err)
	}
}

// A replica that follows serves reads and refuses changes, over both transports, naming the
// leader; a wrong token is refused as before, without saying who leads.
func TestFollowerRefusesChanges(t *testing.T) {
	leading := false
	var rejected []string
	opts := api.Options{Token: token, OpenReads: true, OnReject: func(reason string, _ *http.Request) { rejected = append(rejected, reason) },
		Leader: func() error {
			if leading {
				return nil
			}
			return errors.New("not the leader: control plane replica cp-1 follows cp-0, which makes every change")
		}}
	b := fleet()
	ts := serve(t, b, opts)
	if r := do(t, ts, "GET", "/v1/workers", "", ""); r.status != 200 {
		t.Fatalf("read on a follower: %d %s", r.status, r.body)
	}
	r := do(t, ts, "POST", "/v1/workers/w1/drain", "", token)
	if r.status != http.StatusServiceUnavailable {
		t.Fatalf("change on a follower: %d %s", r.status, r.body)
	}
	if msg, code := errorOf(t, r); code != "unavailable" || !strings.Contains(msg, "cp-0") {
		t.Fatalf("refusal %q (%s) does not name the leader", msg, code)
	}
	if r := do(t, ts, "POST", "/v1/workers/w1/drain", "", "wrong"); r.status != 401 || strings.Contains(r.body, "cp-0") {
		t.Fatalf("wrong token on a follower: %d %s", r.status, r.body)
	}
	if !slices.Equal(rejected, []string{"not_leader", "unauthenticated"}) {
		t.Fatalf("rejections %v", rejected)
	}
	c := grpcClient(t, ts)
	_, err := c.Drain(withToken(t.Context(), token), &operatorv1.DrainRequest{Id: "w1"})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "cp-0") {
		t.Fatalf("gRPC change on a follower: %v", err)
	}
	if w, _ := b.GetWorker(t.Context(), "w1"); w.Status.GetDraining() {
		t.Fatal("a follower drained the worker")
	}
	leading = true
	if r := do(t, ts, "POST", "/v1/workers/w1/drain", "", token); r.status != 200 {
		t.Fatalf("change once leading: %d %s", r.status, r.body)
	}
}

// TestTokenFunc: an API whose token comes from TokenFunc takes the token in force at each
// call: after a rotation the new one is accepted and the old one refused.
func TestTokenFunc(t *testing.T) {
	var mu sync.Mutex
	current := "old-token"
	ts := serve(t, fleet(), api.Options{TokenFunc: func() string { mu.Lock(); defer mu.Unlock(); return current }})
	if r := do(t, ts, "GET", "/v1/workers", "", "old-token"); r.status != 200 {
		t.Fatalf("the token in force: %d %s", r.status, r.body)
	}
	mu.Lock()
	current = "new-token"
	mu.Unlock()
	if r := do(t, ts, "GET", "/v1/workers", "", "old-token"); r.status != 401 {
		t.Fatalf("the rotated-out token: %d, want 401", r.status)
	}
	if r := do(t, ts, "GET", "/v1/workers", "", "new-token"); r.status != 200 {
		t.Fatalf("the new token: %d %s", r.status, r.body)
	}
}
