package loadview

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/engines"
)

// vllmBody is a minimal vLLM exposition.
const vllmBody = `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="512"} 1
`

const modelsBody = `{"object":"list","data":[{"id":"m","object":"model","max_model_len":8192},{"id":"m-lora","object":"model"}]}`

// fakeEngine is an httptest server whose /metrics, /health and /v1/models answers the test
// sets.
type fakeEngine struct {
	*httptest.Server
	metrics  atomic.Pointer[func(http.ResponseWriter)]
	health   atomic.Int32 // status; 0 means 200
	models   atomic.Int32 // status; 0 means 200
	inFlight atomic.Int32
	maxIn    atomic.Int32
	modelReq atomic.Int32
	peers    sync.Map // the client addresses seen: one per connection
}

func newFakeEngine(t *testing.T, metrics func(http.ResponseWriter)) *fakeEngine {
	t.Helper()
	f := &fakeEngine{}
	f.setMetrics(metrics)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		f.peers.Store(r.RemoteAddr, true)
		n := f.inFlight.Add(1)
		defer f.inFlight.Add(-1)
		for m := f.maxIn.Load(); n > m && !f.maxIn.CompareAndSwap(m, n); m = f.maxIn.Load() {
		}
		(*f.metrics.Load())(w)
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		if s := f.health.Load(); s != 0 {
			w.WriteHeader(int(s))
		}
	})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		f.modelReq.Add(1)
		if s := f.models.Load(); s != 0 {
			w.WriteHeader(int(s))
			return
		}
		_, _ = w.Write([]byte(modelsBody))
	})
	f.Server = httptest.NewServer(mux)
	t.Cleanup(f.Close)
	return f
}

func (f *fakeEngine) setMetrics(h func(http.ResponseWriter)) { f.metrics.Store(&h) }

func body(s string) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) { _, _ = w.Write([]byte(s)) }
}

func status(code int) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) { w.WriteHeader(code) }
}

// TestBadMetrics serves metrics that cannot be read: every scrape must count as a failure,
// the health probe must decide the worker's health, and nothing may crash.
func TestBadMetrics(t *testing.T) {
	bin := make([]byte, 4096)
	for i := range bin {
		bin[i] = byte(i * 131)
	}
	cases := []struct {
		name    string
		metrics func(http.ResponseWriter)
		health  int // 0: 200
		healthy bool
		errHas  string
	}{
		{"text garbage", body("hello world\nthis is { not prometheus\n"), 0, true, "no load metrics"},
		{"binary garbage", body(string(bin)), 0, true, "scraping metrics"},
		{"broken wanted line", body("vllm:num_requests_running{engine=\"0\" 3 }}}\n"), 0, true, "parsing metrics"},
		{"another engine's names", body("sglang:num_running_reqs 3\n"), 0, true, "no load metrics"},
		{"status 500", status(http.StatusInternalServerError), 0, true, "status 500"},
		{"empty body", body(""), 0, true, "no load metrics"},
		{"garbage and health down", body("garbage\n"), http.StatusServiceUnavailable, false, "status 503"},
		{"timeout and health down", func(w http.ResponseWriter) { time.Sleep(300 * time.Millisecond) },
			http.StatusServiceUnavailable, false, "deadline exceeded"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeEngine(t, tc.metrics)
			f.health.Store(int32(tc.health))
			opts := testOptions()
			opts.Timeout = 100 * time.Millisecond
			v := newView(t, opts)
			v.Sync([]Target{{ID: "w", URL: f.URL, Engine: engines.KindVLLM}})
			eventually(t, 5*time.Second, "5 failed scrapes", func() bool {
				return v.Stats()["w"].ScrapeFailures >= 5
			})
			s, _ := v.Get("w")
			st := v.Stats()["w"]
			if s.Healthy != tc.healthy || st.Healthy != tc.healthy {
				t.Errorf("healthy %v (stats %v), want %v", s.Healthy, st.Healthy, tc.healthy)
			}
			if !strings.Contains(s.LastError, tc.errHas) {
				t.Errorf("LastError %q, want it to mention %q", s.LastError, tc.errHas)
			}
			if st.ScrapeFailures != st.Scrapes || st.Probes < st.ScrapeFailures-1 {
				t.Errorf("stats %+v: every scrape should fail and be followed by a probe", st)
			}
			if tc.healthy {
				if st.ProbeFailures != 0 || s.ConsecutiveFailures != 0 {
					t.Errorf("probe failures %d, consecutive %d", st.ProbeFailures, s.ConsecutiveFailures)
				}
				if s.Model.ID != "m" {
					t.Errorf("a worker healthy by its probe still gets its model: %+v", s.Model)
				}
			} else if s.ConsecutiveFailures < opts.FailAfter || st.BecameHealthy != 0 {
				t.Errorf("consecutive %d, stats %+v", s.ConsecutiveFailures, st)
			}
			if !s.ObservedAt.IsZero() || s.Load != (engines.Load{}) {
				t.Errorf("no load was ever read, state says %v at %v", s.Load, s.ObservedAt)
			}

			// When the metrics come good the error clears and the load shows.
			f.health.Store(0)
			f.setMetrics(body(vllmBody))
			eventually(t, 5*time.Second, "recovered", func() bool {
				s, _ := v.Get("w")
				return s.Healthy && s.LastError == "" && s.Load.Running == 3
			})
		})
	}
}

// TestOtherEngineKinds reads SGLang's and TRT-LLM's names through their adapters, and probes
// the health of a target whose kind has no adapter.
func TestOtherEngineKinds(t *testing.T) {
	const sglangBody = `sglang:num_running_reqs{model_name="m",tp_rank="0"} 7
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
sglang:page_size{model_name="m",tp_rank="0"} 64
sglang:num_pages{model_name="m",tp_rank="0"} 300
`
	sg := newFakeEngine(t, body(sglangBody))
	unknown := newFakeEngine(t, body(vllmBody))
	v := newView(t, testOptions())
	v.Sync([]Target{
		{ID: "sg", URL: sg.URL, Engine: engines.KindSGLang},
		{ID: "unknown", URL: unknown.URL, Engine: "nope"},
	})
	eventually(t, 5*time.Second, "sglang worker read", func() bool {
		s, _ := v.Get("sg")
		return s.Healthy && s.Model.ID == "m" && s.BlockSize != 0
	})
	s, _ := v.Get("sg")
	if s.Load.Running != 7 || s.Load.Waiting != 2 || s.Load.KVUsage != 0.5 || s.BlockSize != 64 || s.CapacityBlocks != 300 {
		t.Errorf("sglang state %+v", s)
	}
	if s.Model.MaxModelLen != 8192 || len(s.Model.IDs) != 2 {
		t.Errorf("model %+v", s.Model)
	}
	eventually(t, 5*time.Second, "unknown kind healthy by its probe", func() bool {
		s, _ := v.Get("unknown")
		return s.Healthy
	})
	s, _ = v.Get("unknown")
	if !strings.Contains(s.LastError, "unknown engine kind") || s.Model.ID != "" || unknown.modelReq.Load() != 0 {
		t.Errorf("unknown kind: %+v (model requests %d)", s, unknown.modelReq.Load())
	}
}

// TestModelDiscoveryRetries fails /v1/models a few times: discovery must be retried and then
// succeed, and not be asked again once it has.
func TestModelDiscoveryRetries(t *testing.T) {
	f := newFakeEngine(t, body(vllmBody))
	f.models.Store(http.StatusServiceUnavailable)
	v := newView(t, testOptions())
	v.Sync([]Target{{ID: "w", URL: f.URL, Engine: engines.KindVLLM}})
	eventually(t, 5*time.Second, "two failed discoveries", func() bool {
		return v.Stats()["w"].DiscoveryFailures >= 2
	})
	if s, _ := v.Get("w"); !s.Healthy || s.Model.ID != "" || s.BlockSize != 16 || s.CapacityBlocks != 512 {
		t.Errorf("healthy, geometry known, model not yet: %+v", s)
	}
	drain(v.Changed())
	f.models.Store(0)
	eventually(t, 5*time.Second, "model discovered", func() bool {
		s, _ := v.Get("w")
		return s.Model.ID == "m"
	})
	select {
	case <-v.Changed():
	default:
		t.Error("discovery not signalled")
	}
	n := f.modelReq.Load()
	scrapes := v.Stats()["w"].Scrapes
	eventually(t, 5*time.Second, "more polls", func() bool { return v.Stats()["w"].Scrapes >= scrapes+5 })
	if f.modelReq.Load() != n {
		t.Errorf("model asked again after discovery: %d then %d requests", n, f.modelReq.Load())
	}
}

// TestScrapesDoNotOverlap serves metrics slower than the interval.
func TestScrapesDoNotOverlap(t *testing.T) {
	opts := testOptions()
	f := newFakeEngine(t, func(w http.ResponseWriter) {
		time.Sleep(3 * opts.Interval)
		_, _ = w.Write([]byte(vllmBody))
	})
	v := newView(t, opts)
	v.Sync([]Target{{ID: "w", URL: f.URL, Engine: engines.KindVLLM}})
	eventually(t, 10*time.Second, "5 scrapes", func() bool { return v.Stats()["w"].Scrapes >= 5 })
	if m := f.maxIn.Load(); m != 1 {
		t.Errorf("%d scrapes of one target at once", m)
	}
	if s := v.Stats()["w"]; s.ScrapeFailures != 0 || s.LastScrape < 3*opts.Interval {
		t.Errorf("stats %+v", s)
	}
}

// TestSyncStopsPollers adds, changes and removes targets: a removed or changed target's
// poller must exit, and no goroutine may outlive Close.
func TestSyncStopsPollers(t *testing.T) {
	a := newFakeEngine(t, body(vllmBody))
	b := newFakeEngine(t, body(vllmBody))
	base := runtime.NumGoroutine()
	opts := testOptions()
	opts.HTTPClient = &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	v := New(opts)
	targets := []Target{
		{ID: "a", URL: a.URL, Engine: engines.KindVLLM},
		{ID: "b", URL: b.URL, Engine: engines.KindVLLM},
		{ID: "c", URL: b.URL, MetricsURL: b.URL + "/metrics", Engine: engines.KindVLLM},
		{ID: "", URL: b.URL, Engine: engines.KindVLLM},
	}
	v.Sync(targets)
	eventually(t, 5*time.Second, "three healthy workers", func() bool {
		snap := v.Snapshot()
		return len(snap) == 3 && snap["a"].Healthy && snap["b"].Healthy && snap["c"].Healthy
	})
	pollers := func() map[string]*poller {
		v.syncMu.Lock()
		defer v.syncMu.Unlock()
		out := map[string]*poller{}
		for id, p := range v.pollers {
			out[id] = p
		}
		return out
	}
	old := pollers()
	scrapesA := v.Stats()["a"].Scrapes
	drain(v.Changed())

	// Same a, b moved to another URL, c gone.
	v.Sync([]Target{targets[0], {ID: "b", URL: a.URL, Engine: engines.KindVLLM}})
	select {
	case <-old["c"].done:
	default:
		t.Error("removed target's poller still runs after Sync returned")
	}
	select {
	case <-old["b"].done:
	default:
		t.Error("changed target's poller still runs after Sync returned")
	}
	now := pollers()
	if now["a"] != old["a"] || now["b"] == old["b"] || now["c"] != nil || len(now) != 2 {
		t.Errorf("pollers after sync: %v", now)
	}
	if _, ok := v.Get("c"); ok {
		t.Error("removed target still in the view")
	}
	if _, ok := v.Stats()["c"]; ok {
		t.Error("removed target still in the stats")
	}
	if v.Stats()["a"].Scrapes < scrapesA {
		t.Error("an unchanged target's counters went back")
	}
	select {
	case <-v.Changed():
	default:
		t.Error("removal not signalled")
	}
	eventually(t, 5*time.Second, "moved target healthy", func() bool {
		s, _ := v.Get("b")
		return s.Healthy
	})

	v.Sync(nil)
	for id, p := range now {
		select {
		case <-p.done:
		default:
			t.Errorf("poller %s still runs after Sync(nil)", id)
		}
	}
	if len(v.Snapshot()) != 0 || len(v.Stats()) != 0 {
		t.Errorf("view not empty: %v", v.Snapshot())
	}
	v.Close()
	v.Close()
	// A signal still buffered is read first; then the channel reads as closed.
	<-v.Changed()
	if _, ok := <-v.Changed(); ok {
		t.Error("Changed's channel not closed by Close")
	}
	v.Sync(targets) // no effect after Close
	if len(v.Snapshot()) != 0 {
		t.Error("Sync after Close started pollers")
	}
	opts.HTTPClient.CloseIdleConnections()
	eventually(t, 5*time.Second, "goroutines back to where they were", func() bool {
		return runtime.NumGoroutine() <= base+2
	})
}

// TestChangedCoalesces: many changes while nobody reads leave one signal.
func TestChangedCoalesces(t *testing.T) {
	var n atomic.Int32
	f := newFakeEngine(t, func(w http.ResponseWriter) {
		// Running changes at every scrape.
		_, _ = w.Write([]byte(strings.Replace(vllmBody, "} 3\n", "} "+strconv.Itoa(int(n.Add(1)))+"\n", 1)))
	})
	v := newView(t, testOptions())
	v.Sync([]Target{{ID: "w", URL: f.URL, Engine: engines.KindVLLM}})
	eventually(t, 5*time.Second, "10 scrapes", func() bool { return v.Stats()["w"].Scrapes >= 10 })
	if len(v.Changed()) != 1 || cap(v.Changed()) != 1 {
		t.Fatalf("len %d cap %d", len(v.Changed()), cap(v.Changed()))
	}
	<-v.Changed()
	select {
	case <-v.Changed():
	case <-time.After(5 * time.Second):
		t.Fatal("no signal after reading one")
	}
}

// TestKVUsageThreshold: KV usage moving by less than a point raises no signal; crossing a
// point since the last signal does.
func TestKVUsageThreshold(t *testing.T) {
	usage := func(u string) func(http.ResponseWriter) {
		return body(strings.Replace(vllmBody, "0.25", u, 1))
	}
	f := newFakeEngine(t, usage("0.250"))
	v := newView(t, testOptions())
	v.Sync([]Target{{ID: "w", URL: f.URL, Engine: engines.KindVLLM}})
	eventually(t, 5*time.Second, "model known", func() bool { s, _ := v.Get("w"); return s.Model.ID == "m" })
	scrapes := v.Stats()["w"].Scrapes
	eventually(t, 5*time.Second, "a poll after discovery", func() bool { return v.Stats()["w"].Scrapes > scrapes+1 })
	drain(v.Changed())
	for _, u := range []string{"0.252", "0.255", "0.258"} {
		f.setMetrics(usage(u))
		want := u
		eventually(t, 5*time.Second, "usage "+u, func() bool {
			s, _ := v.Get("w")
			return strconv.FormatFloat(s.Load.KVUsage, 'f', 3, 64) == want
		})
	}
	select {
	case <-v.Changed():
		t.Error("signalled a KV usage move of less than a point")
	default:
	}
	f.setMetrics(usage("0.262"))
	select {
	case <-v.Changed():
	case <-time.After(5 * time.Second):
		t.Error("no signal for a KV usage move of more than a point")
	}
}

// TestCollector exports the counters through a Prometheus registry.
func TestCollector(t *testing.T) {
	f := newFakeEngine(t, body("garbage\n"))
	v := newView(t, testOptions())
	v.Sync([]Target{{ID: "w", URL: f.URL, Engine: engines.KindVLLM}})
	eventually(t, 5*time.Second, "a failed scrape and a healthy probe", func() bool {
		s := v.Stats()["w"]
		return s.ScrapeFailures > 0 && s.Healthy
	})
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(v); err != nil {
		t.Fatal(err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != 1 || m.GetLabel()[0].GetValue() != "w" {
				t.Errorf("%s: labels %v", f.GetName(), m.GetLabel())
			}
			v, _ := engines.Value(m)
			got[f.GetName()] = v
		}
	}
	if len(got) != 9 {
		t.Errorf("%d families, want 9: %v", len(got), got)
	}
	if got["kvrelay_loadview_healthy"] != 1 || got["kvrelay_loadview_scrape_failures_total"] < 1 ||
		got["kvrelay_loadview_scrapes_total"] < got["kvrelay_loadview_scrape_failures_total"] {
		t.Errorf("metrics %v", got)
	}
}

// TestNowStampsStates uses the configured clock for ObservedAt and CheckedAt.
func TestNowStampsStates(t *testing.T) {
	at := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	f := newFakeEngine(t, body(vllmBody))
	opts := testOptions()
	opts.Now = func() time.Time { return at }
	v := newView(t, opts)
	v.Sync([]Target{{ID: "w", URL: f.URL + "/", Engine: engines.KindVLLM}})
	eventually(t, 5*time.Second, "healthy", func() bool { s, _ := v.Get("w"); return s.Healthy })
	if s, _ := v.Get("w"); !s.ObservedAt.Equal(at) || !s.CheckedAt.Equal(at) {
		t.Errorf("stamped %v / %v, want %v", s.ObservedAt, s.CheckedAt, at)
	}
	if ids := v.IDs(); len(ids) != 1 || ids[0] != "w" {
		t.Errorf("IDs %v", ids)
	}
}

// TestPollsReuseConnectionsAcrossAFleet polls more workers than a default transport keeps
// idle connections for (100 in all): after the first polls, no poll may dial again.
func TestPollsReuseConnectionsAcrossAFleet(t *testing.T) {
	const n = 120
	var targets []Target
	var fakes []*fakeEngine
	for i := range n {
		f := newFakeEngine(t, body(vllmBody))
		fakes = append(fakes, f)
		targets = append(targets, Target{ID: fmt.Sprintf("w%d", i), URL: f.URL, Engine: engines.KindVLLM})
	}
	opts := testOptions()
	opts.Interval = 50 * time.Millisecond
	v := newView(t, opts)
	v.Sync(targets)
	scrapes := func(min uint64) bool {
		for _, tg := range targets {
			if st := v.Stats()[tg.ID]; st.Scrapes < min {
				return false
			}
		}
		return true
	}
	eventually(t, 20*time.Second, "every worker scraped twice", func() bool { return scrapes(2) })
	dials := func() int {
		c := 0
		for _, f := range fakes {
			f.peers.Range(func(any, any) bool { c++; return true })
		}
		return c
	}
	before := dials()
	eventually(t, 20*time.Second, "every worker scraped 5 times more", func() bool { return scrapes(7) })
	if d := dials() - before; d > n/20 {
		t.Errorf("%d connections dialled in 5 polls of %d workers after the first (%d before)", d, n, before)
	}
}
