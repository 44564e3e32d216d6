package telemetry

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/vllm"
)

// fakeEngine serves a vLLM exposition of the load it is set to, or a status, over real HTTP.
type fakeEngine struct {
	mu               sync.Mutex
	running, waiting int
	kv               float64
	status           int
	body             string // served as is when set
	hits             atomic.Int64
	srv              *httptest.Server
}

func newFakeEngine(t *testing.T) *fakeEngine {
	e := &fakeEngine{status: 200}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.hits.Add(1)
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.status != 200 {
			w.WriteHeader(e.status)
			return
		}
		if e.body != "" {
			fmt.Fprint(w, e.body)
			return
		}
		fmt.Fprintf(w, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} %d\n", e.running)
		fmt.Fprintf(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} %d\n", e.waiting)
		fmt.Fprintf(w, "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} %g\n", e.kv)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *fakeEngine) set(f func(e *fakeEngine)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	f(e)
}

func start(t *testing.T, s *Scraper) context.CancelFunc {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != context.Canceled {
			t.Errorf("Run returned %v", err)
		}
	})
	return cancel
}

// eventually polls cond for up to 10 s (the scraper runs on its own clock).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestScraperReportsAndTeachesTheLimit: the engine's running and waiting requests reach the
// worker's load (requests this proxy never sent count), and waits beside the most it runs
// teach the latency model its concurrency limit without it being configured.
func TestScraperReportsAndTeachesTheLimit(t *testing.T) {
	e := newFakeEngine(t)
	w := &route.Worker{ID: "w", URL: e.srv.URL, Model: "m"}
	route.NewPool([]*route.Worker{w})
	e.set(func(e *fakeEngine) { e.running, e.waiting, e.kv = 3, 0, 0.4 })
	s := &Scraper{Workers: func() []*route.Worker { return []*route.Worker{w} }, Adapter: vllm.New(), Interval: 5 * time.Millisecond}
	start(t, s)
	eventually(t, "the engine's 3 requests in the worker's load", func() bool { return w.Load() == 3 })
	if got := w.KVInUse(); got != 0.4 {
		t.Fatalf("KV in use %v, want the engine's 0.4", got)
	}
	if got := w.Latency().MaxNumSeqs(&w.Engine); got != 0 {
		t.Fatalf("limit %d learned from a worker running with none waiting", got)
	}
	e.set(func(e *fakeEngine) { e.running, e.waiting = 4, 2 })
	eventually(t, "the limit learned", func() bool { return w.Latency().MaxNumSeqs(&w.Engine) == 4 })
	if got := w.Load(); got != 6 {
		t.Fatalf("load %d, want 6", got)
	}
}

// TestScraperClearsAFailingWorker: metrics that fail FailAfter times in a row clear the
// worker's report (routing falls back to the proxy's own count), and come back when the
// metrics do; a body that is no exposition counts as a failure, not a crash.
func TestScraperClearsAFailingWorker(t *testing.T) {
	e := newFakeEngine(t)
	w := &route.Worker{ID: "w", URL: e.srv.URL, Model: "m"}
	route.NewPool([]*route.Worker{w})
	e.set(func(e *fakeEngine) { e.running, e.waiting, e.kv = 5, 1, 0.5 })
	s := &Scraper{Workers: func() []*route.Worker { return []*route.Worker{w} }, Adapter: vllm.New(), Interval: 5 * time.Millisecond, FailAfter: 3}
	start(t, s)
	eventually(t, "the report", func() bool { return w.Load() == 6 })
	e.set(func(e *fakeEngine) { e.status = 500 })
	eventually(t, "the report cleared", func() bool { return w.Load() == 0 })
	e.set(func(e *fakeEngine) { e.status = 200 })
	eventually(t, "the report back", func() bool { return w.Load() == 6 })
	e.set(func(e *fakeEngine) { e.body = "{\"not\": \"an exposition\"}\n" })
	before := s.Stats().Failures
	eventually(t, "failures counted", func() bool { return s.Stats().Failures >= before+3 })
	eventually(t, "the report cleared again", func() bool { return w.Load() == 0 })
}

// TestScraperFollowsThePool: a worker that leaves the pool is no longer polled, one that
// joins is.
func TestScraperFollowsThePool(t *testing.T) {
	a, b := newFakeEngine(t), newFakeEngine(t)
	wa := &route.Worker{ID: "a", URL: a.srv.URL, Model: "m"}
	wb := &route.Worker{ID: "b", URL: b.srv.URL, Model: "m"}
	var mu sync.Mutex
	pool := []*route.Worker{wa}
	s := &Scraper{Workers: func() []*route.Worker {
		mu.Lock()
		defer mu.Unlock()
		return pool
	}, Adapter: vllm.New(), Interval: 5 * time.Millisecond}
	start(t, s)
	eventually(t, "a polled", func() bool { return a.hits.Load() >= 2 })
	mu.Lock()
	pool = []*route.Worker{wb}
	mu.Unlock()
	eventually(t, "b polled", func() bool { return b.hits.Load() >= 2 })
	eventually(t, "a's poller stopped", func() bool { return s.active.Load() == 1 })
	n := a.hits.Load()
	eventually(t, "b polled twice more", func() bool { return b.hits.Load() >= 4 })
	if got := a.hits.Load(); got != n {
		t.Fatalf("a polled %d more times after its poller stopped", got-n)
	}
}

func TestScraperNeedsWorkersAndAdapter(t *testing.T) {
	if err := (&Scraper{}).Run(context.Background()); err == nil {
		t.Fatal("Run without Workers or Adapter did not fail")
	}
}
