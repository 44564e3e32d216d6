package latency

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// scripted is one request of a scripted arrival sequence and what happened to it.
type scripted struct {
	at          time.Duration
	prompt, out int
	r           *sim.Request
	pred        Prediction
	sent, first time.Time
	done        bool
}

// TestQueueWaitMatchesSimulator replays scripted arrivals on the simulated engine's real
// scheduler (4 sequence slots, its default step model, virtual time) and predicts each
// request's TTFT as the router would, from the engine's running and waiting counts and the
// uncached prompt tokens not yet past their first token. Once the model has learned from
// the first arrivals, its median relative error is under 20%, also for the requests that
// had to wait for a slot.
func TestQueueWaitMatchesSimulator(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.NumGPUBlocks = 1 << 14
	cfg.MaxNumSeqs = 4
	e, err := sim.NewEngine(cfg, []uint32{11, 12, 13}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(7, 8))
	var script []*scripted
	var at time.Duration
	for range 400 {
		at += time.Duration(rng.ExpFloat64() * float64(180*time.Millisecond))
		script = append(script, &scripted{at: at, prompt: 200 + rng.IntN(3000), out: 20 + rng.IntN(60)})
	}
	w := newWorker()
	eng := &Engine{MaxNumSeqs: cfg.MaxNumSeqs, MaxBatchedTokens: cfg.MaxNumBatchedTokens}
	start := time.Unix(1000, 0)
	now := start
	next := 0
	var toks []uint32
	for steps := 0; steps < 1_000_000; steps++ {
		// Arrivals up to now are routed (predicted) and submitted in order.
		for next < len(script) && !start.Add(script[next].at).After(now) {
			s := script[next]
			var pending float64
			for _, o := range script[:next] {
				if !o.done && o.first.IsZero() {
					pending += float64(o.prompt)
				}
			}
			ld := e.Load()
			w.Predict(eng, State{Requests: ld.Running + ld.Waiting, Backlog: pending, KVUsage: ld.KVUsage}, float64(s.prompt), &s.pred)
			toks = toks[:0]
			for i := range s.prompt {
				toks = append(toks, uint32(next*7919+i+100))
			}
			r, err := e.NewRequest("r", toks, blockhash.Keys{}, sim.Params{MaxTokens: s.out, IgnoreEOS: true})
			if err != nil {
				t.Fatal(err)
			}
			s.r, s.sent = r, start.Add(s.at)
			e.Submit(r)
			next++
		}
		end, busy := e.StepAt(now)
		if !busy {
			if next == len(script) {
				break
			}
			now = start.Add(script[next].at)
			continue
		}
		now = end
		for _, s := range script[:next] {
			if s.done {
				continue
			}
			out, done, _, _ := s.r.Output(nil, 0)
			if len(out) > 0 && s.first.IsZero() {
				s.first = now
				w.ObserveTTFT(&s.pred, now.Sub(s.sent).Seconds())
			}
			if done {
				s.done = true
				held := now.Sub(s.first).Seconds()
				w.ObserveDecode(max(1, min(cfg.MaxNumSeqs, 4)), e.Load().KVUsage, held/float64(max(len(out)-1, 1)), held)
			}
		}
	}
	var all, queued []float64
	for i, s := range script {
		if !s.done {
			t.Fatalf("request %d never finished", i)
		}
		if i < 100 {
			continue // warm-up
		}
		y := s.first.Sub(s.sent).Seconds()
		rel := math.Abs(s.pred.TTFT-y) / y
		all = append(all, rel)
		if s.pred.X[FeatSlotWait] > 0 {
			queued = append(queued, rel)
		}
	}
	median := func(v []float64) float64 { sort.Float64s(v); return v[len(v)/2] }
	t.Logf("after warm-up: median relative TTFT error %.1f%% over %d requests, %.1f%% over the %d that waited for a slot; model %+v",
		100*median(all), len(all), 100*median(queued), len(queued), w.Stats())
	if len(queued) < 20 {
		t.Fatalf("only %d requests waited for a slot: the script does not load the engine", len(queued))
	}
	if median(all) > 0.2 || median(queued) > 0.3 {
		t.Fatalf("median relative error %.1f%% (slot waits %.1f%%), want under 20%% (30%%)", 100*median(all), 100*median(queued))
	}
}
