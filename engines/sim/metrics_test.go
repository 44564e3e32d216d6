package sim

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	return counterValueOf(c)
}

func counterValueOf(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

// TestQueueAndPrefillTimes: with one sequence slot, a second request waits in the queue for
// the whole of the first; vLLM's request_queue_time_seconds counts that wait and
// request_prefill_time_seconds the time from being scheduled to the first token.
func TestQueueAndPrefillTimes(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NumGPUBlocks = 1024
	cfg.MaxNumSeqs = 1
	m := NewMetrics(cfg)
	e, err := NewEngine(cfg, []uint32{11, 12}, nil, m)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Unix(1000, 0)
	first := submit(t, e, prompt(1000, 1), Params{MaxTokens: 10, IgnoreEOS: true})
	second := submit(t, e, prompt(1000, 2), Params{MaxTokens: 10, IgnoreEOS: true})
	first.arrival, second.arrival = start, start // on the virtual clock, not the wall's
	now := start
	var firstDone time.Time
	for {
		end, busy := e.StepAt(now)
		if !busy {
			break
		}
		now = end
		if _, done, _, _ := first.Output(nil, 0); done && firstDone.IsZero() {
			firstDone = now
		}
	}
	hist := func(name string) (count uint64, sum float64) {
		mfs, err := m.Registry().Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == name {
				h := mf.GetMetric()[0].GetHistogram()
				return h.GetSampleCount(), h.GetSampleSum()
			}
		}
		t.Fatalf("no %s", name)
		return 0, 0
	}
	qn, qsum := hist("vllm:request_queue_time_seconds")
	pn, psum := hist("vllm:request_prefill_time_seconds")
	if qn != 2 || pn != 2 {
		t.Fatalf("%d queue and %d prefill observations, want 2 each", qn, pn)
	}
	// Both arrived at start; the first was scheduled at once, the second when the first
	// finished.
	wantQueue := firstDone.Sub(start).Seconds()
	if qsum < wantQueue*0.99 || qsum > wantQueue*1.01 {
		t.Fatalf("queue time sum %.4f s, want about %.4f (the second waited for the first)", qsum, wantQueue)
	}
	onePrefill := cfg.Timing.StepTime(1000, 0, 0).Seconds()
	if psum < 2*onePrefill*0.99 || psum > 2*onePrefill*1.01+0.01 {
		t.Fatalf("prefill time sum %.4f s, want about 2 × %.4f", psum, onePrefill)
	}
}
