package planner_test

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/planner"
	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// engineState is what a fake engine's /metrics reports (vLLM's names).
type engineState struct {
	requests, prompt, output float64
	ttftSum, ttftCount       float64
	itlSum, itlCount         float64
	islSum, oslSum, lenCount float64 // request_prompt_tokens and request_generation_tokens
	running, waiting         int
	kv                       float64
}

// fakeEngine serves an engineState as a vLLM metrics exposition; down makes it answer 503.
type fakeEngine struct {
	mu   sync.Mutex
	st   engineState
	down bool
	srv  *httptest.Server
}

func newFakeEngine(t *testing.T) *fakeEngine {
	e := &fakeEngine{}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.down {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		s := e.st
		var b strings.Builder
		fmt.Fprintf(&b, "# TYPE vllm:request_success_total counter\nvllm:request_success_total{finished_reason=\"length\"} %g\n", s.requests)
		fmt.Fprintf(&b, "# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total %g\n", s.prompt)
		fmt.Fprintf(&b, "# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total %g\n", s.output)
		for _, h := range []struct {
			name       string
			sum, count float64
		}{{"vllm:time_to_first_token_seconds", s.ttftSum, s.ttftCount}, {"vllm:inter_token_latency_seconds", s.itlSum, s.itlCount},
			{"vllm:request_prompt_tokens", s.islSum, s.lenCount}, {"vllm:request_generation_tokens", s.oslSum, s.lenCount}} {
			fmt.Fprintf(&b, "# TYPE %s histogram\n%s_bucket{le=\"+Inf\"} %g\n%s_sum %g\n%s_count %g\n", h.name, h.name, h.count, h.name, h.sum, h.name, h.count)
		}
		fmt.Fprintf(&b, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running %d\n", s.running)
		fmt.Fprintf(&b, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting %d\n", s.waiting)
		fmt.Fprintf(&b, "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc %g\n", s.kv)
		_, _ = w.Write([]byte(b.String()))
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *fakeEngine) set(f func(s *engineState)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	f(&e.st)
}

// workerList is a WorkerLister over a fixed slice the test may change between calls.
type workerList struct {
	mu sync.Mutex
	ws []registry.Worker
}

func (l *workerList) Workers() []registry.Worker {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]registry.Worker(nil), l.ws...)
}

func (l *workerList) add(w registry.Worker) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.ws = append(l.ws, w)
}

// TestMetricsObserverDifferencesCounters walks an observer through three scrapes of two
// workers: the first sets baselines, the second differences counters into the window's
// traffic and latencies, and a third adds a worker (new to the fleet: what it holds counts
// as arrived) while another fails to answer (left out, its baseline kept).
func TestMetricsObserverDifferencesCounters(t *testing.T) {
	a, b := newFakeEngine(t), newFakeEngine(t)
	ws := &workerList{ws: []registry.Worker{{ID: "a", URL: a.srv.URL}, {ID: "b", URL: b.srv.URL, Draining: true}}}
	now := time.Unix(1000, 0)
	o := &planner.MetricsObserver{Workers: ws, Now: func() time.Time { return now }}
	ctx := context.Background()

	a.set(func(s *engineState) {
		*s = engineState{requests: 100, prompt: 1e5, output: 1e4, ttftSum: 50, ttftCount: 100, running: 2}
	})
	b.set(func(s *engineState) { *s = engineState{requests: 50, prompt: 5e4, output: 5e3, running: 1} })
	first, err := o.Observe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if first.Window != 0 || first.Requests != 0 || first.Arrivals != 0 || len(first.Workers) != 2 {
		t.Fatalf("first observation %+v: want baselines only, both workers listed", first)
	}

	// 10 s later: a finished 20 (1000 in, 100 out each, TTFT 0.25 s, ITL 20 ms) and holds 7
	// (was 2): 25 arrived. b finished 10 and holds 0 (was 1): 9 arrived.
	now = now.Add(10 * time.Second)
	a.set(func(s *engineState) {
		s.requests += 20
		s.prompt += 20000
		s.output += 2000
		s.ttftSum += 5
		s.ttftCount += 20
		s.itlSum += 0.02 * 1980
		s.itlCount += 1980
		s.islSum += 20 * 900 // the requests that finished had 900 and 90 tokens: the rest of
		s.oslSum += 20 * 90  // the counters' tokens belong to requests still in flight
		s.lenCount += 20
		s.running, s.waiting, s.kv = 4, 3, 0.6
	})
	b.set(func(s *engineState) {
		s.requests += 10
		s.prompt += 10000
		s.output += 1000
		s.running = 0
	})
	got, err := o.Observe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got.Window != 10*time.Second || got.Requests != 30 || got.PromptTokens != 30000 || got.OutputTokens != 3000 || got.Arrivals != 34 {
		t.Errorf("window %s requests %v prompt %v output %v arrivals %v; want 10s, 30, 30000, 3000, 34", got.Window, got.Requests, got.PromptTokens, got.OutputTokens, got.Arrivals)
	}
	if got.LenCount != 20 || got.PromptLenSum != 18000 || got.OutputLenSum != 1800 {
		t.Errorf("lengths: %v requests of %v and %v tokens in all; want a's 20 of 18000 and 1800 (b has no histograms)", got.LenCount, got.PromptLenSum, got.OutputLenSum)
	}
	if math.Abs(got.TTFTSum/got.TTFTCount-0.25) > 1e-9 || math.Abs(got.ITLSum/got.ITLCount-0.02) > 1e-9 {
		t.Errorf("mean TTFT %v, ITL %v; want 0.25, 0.02", got.TTFTSum/got.TTFTCount, got.ITLSum/got.ITLCount)
	}
	wa, wb := got.Workers[0], got.Workers[1]
	if wa.ID != "a" || wa.Pool != planner.PoolBoth || wa.Running != 4 || wa.Waiting != 3 || wa.KVUsage != 0.6 || wa.TTFT != 250*time.Millisecond || wa.ITL != 20*time.Millisecond {
		t.Errorf("worker a %+v", wa)
	}
	if wb.ID != "b" || !wb.Draining || wb.TTFT != 0 {
		t.Errorf("worker b %+v: want draining, no TTFT measured", wb)
	}

	// 5 s later: b does not answer; c joins holding 3 with 1 finished.
	now = now.Add(5 * time.Second)
	c := newFakeEngine(t)
	c.set(func(s *engineState) { *s = engineState{requests: 1, prompt: 1000, output: 100, running: 3} })
	ws.add(registry.Worker{ID: "c", URL: c.srv.URL, Role: registry.RoleBoth})
	b.mu.Lock()
	b.down = true
	b.mu.Unlock()
	a.set(func(s *engineState) { s.requests += 5 })
	got, err = o.Observe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// a: 5 finished, in flight unchanged; c: new, 1 finished + 3 held.
	if got.Requests != 5 || got.Arrivals != 9 || len(got.Workers) != 2 {
		t.Errorf("requests %v arrivals %v workers %+v; want 5, 9 and a, c (b failed)", got.Requests, got.Arrivals, got.Workers)
	}
	// b answers again: differenced from the baseline it kept (10 finished since then).
	now = now.Add(5 * time.Second)
	b.mu.Lock()
	b.down = false
	b.st.requests += 10
	b.mu.Unlock()
	got, err = o.Observe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got.Requests != 10 || got.Arrivals != 10 {
		t.Errorf("after b came back: requests %v arrivals %v, want 10 and 10", got.Requests, got.Arrivals)
	}
}

// Disaggregated: requests, tokens and ITL come from the decode pool, TTFT from the prefill
// pool, and arrivals from every pool's queues plus the decode pool's finished requests.
func TestMetricsObserverDisaggregated(t *testing.T) {
	pre, dec := newFakeEngine(t), newFakeEngine(t)
	ws := &workerList{ws: []registry.Worker{{ID: "p", URL: pre.srv.URL, Role: registry.RolePrefill}, {ID: "d", URL: dec.srv.URL, Role: registry.RoleDecode}}}
	o := &planner.MetricsObserver{Workers: ws}
	ctx := context.Background()
	if _, err := o.Observe(ctx); err != nil {
		t.Fatal(err)
	}
	pre.set(func(s *engineState) {
		s.requests, s.prompt, s.ttftSum, s.ttftCount, s.waiting = 12, 12000, 1.2, 12, 2
	})
	dec.set(func(s *engineState) {
		s.requests, s.prompt, s.output, s.ttftSum, s.ttftCount, s.itlSum, s.itlCount, s.running = 10, 10000, 1000, 9, 10, 30, 1000, 2
	})
	got, err := o.Observe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got.Requests != 10 || got.OutputTokens != 1000 || got.TTFTCount != 12 || math.Abs(got.TTFTSum-1.2) > 1e-9 || got.ITLCount != 1000 {
		t.Errorf("observation %+v: want decode's requests and ITL, prefill's TTFT", got)
	}
	if got.Arrivals != 14 {
		t.Errorf("arrivals %v, want 10 finished + 2 waiting for prefill + 2 decoding = 14", got.Arrivals)
	}
	if got.Workers[0].Pool != planner.PoolPrefill || got.Workers[1].Pool != planner.PoolDecode {
		t.Errorf("pools %+v", got.Workers)
	}
}

func TestMetricsObserverEveryWorkerFailing(t *testing.T) {
	e := newFakeEngine(t)
	e.down = true
	o := &planner.MetricsObserver{Workers: &workerList{ws: []registry.Worker{{ID: "a", URL: e.srv.URL}}}}
	if _, err := o.Observe(context.Background()); err == nil || !strings.Contains(err.Error(), "every one of 1 workers") {
		t.Errorf("Observe with every worker down: err %v", err)
	}
	// No workers at all is an empty fleet, not an error.
	o = &planner.MetricsObserver{Workers: &workerList{}}
	if got, err := o.Observe(context.Background()); err != nil || len(got.Workers) != 0 {
		t.Errorf("Observe of no workers: %+v, %v", got, err)
	}
}
