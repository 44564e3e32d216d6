package sim

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// recorder is an EventSink that keeps copies of everything it is given.
type recorder struct{ events []CacheEvent }

func (r *recorder) CacheEvents(_ time.Time, evs []CacheEvent) {
	for _, ev := range evs {
		ev.Hashes = slices.Clone(ev.Hashes)
		ev.Tokens = slices.Clone(ev.Tokens)
		r.events = append(r.events, ev)
	}
}

func (r *recorder) kinds(k CacheEventKind) (out []CacheEvent) {
	for _, ev := range r.events {
		if ev.Kind == k {
			out = append(out, ev)
		}
	}
	return out
}

// vclock drives an engine step by step on virtual time, without sleeping: each step advances
// the clock by its modelled duration.
type vclock struct {
	e     *Engine
	now   time.Time
	steps int
}

func newTestEngine(t *testing.T, mut func(*Config)) (*Engine, *recorder, *vclock) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.NumGPUBlocks = 1024
	if mut != nil {
		mut(&cfg)
	}
	rec := &recorder{}
	e, err := NewEngine(cfg, []uint32{11, 12, 13, 14, 15}, rec, nil)
	if err != nil {
		t.Fatal(err)
	}
	return e, rec, &vclock{e: e, now: time.Unix(1000, 0)}
}

// step runs one scheduler step and returns its modelled duration and what it computed.
func (c *vclock) step() (d time.Duration, prefill, decodes int) {
	c.e.drain(c.now)
	c.e.planAt = c.now
	prefill, decodes = c.e.plan()
	d = c.e.stepTime()
	c.now = c.now.Add(d)
	c.e.apply(c.now)
	c.steps++
	return d, prefill, decodes
}

func (c *vclock) runUntilIdle(t *testing.T, maxSteps int) {
	t.Helper()
	for i := 0; i < maxSteps; i++ {
		c.e.drain(c.now)
		if len(c.e.running) == 0 && c.e.waiting.len() == 0 {
			return
		}
		c.step()
	}
	t.Fatalf("engine still busy after %d steps: %d running, %d waiting", maxSteps, len(c.e.running), c.e.waiting.len())
}

func prompt(n int, seed uint32) []uint32 {
	p := make([]uint32, n)
	for i := range p {
		p[i] = seed*100003 + uint32(i)
	}
	return p
}

func submit(t *testing.T, e *Engine, toks []uint32, p Params) *Request {
	t.Helper()
	r, err := e.NewRequest("r", toks, blockhash.Keys{}, p)
	if err != nil {
		t.Fatal(err)
	}
	e.Submit(r)
	return r
}

func result(r *Request) (out []uint32, done bool, reason FinishReason, cached int) {
	return r.Output(nil, 0)
}

func TestPrefixCacheReuse(t *testing.T) {
	cases := []struct {
		name       string
		promptLen  int
		wantCached int
	}{
		{"partial last block", 100, 96},
		{"exact blocks recompute the last", 96, 80},
		{"shorter than a block", 10, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e, _, c := newTestEngine(t, nil)
			p := prompt(tc.promptLen, 7)
			first := submit(t, e, p, Params{MaxTokens: 4, IgnoreEOS: true})
			c.runUntilIdle(t, 100)
			if _, done, _, cached := result(first); !done || cached != 0 {
				t.Fatalf("first request: done=%v cached=%d, want done and nothing cached", done, cached)
			}
			second := submit(t, e, p, Params{MaxTokens: 4, IgnoreEOS: true})
			c.runUntilIdle(t, 100)
			out, done, reason, cached := result(second)
			if !done || reason != FinishLength || len(out) != 4 {
				t.Fatalf("second request: done=%v reason=%s out=%d", done, reason, len(out))
			}
			if cached != tc.wantCached {
				t.Fatalf("cached_tokens = %d, want %d", cached, tc.wantCached)
			}
		})
	}
}

func TestStoredEventsCarryWholeBlocks(t *testing.T) {
	e, rec, c := newTestEngine(t, nil)
	p := prompt(70, 3) // 4 full blocks and a partial one
	submit(t, e, p, Params{MaxTokens: 30, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	stored := rec.kinds(BlocksStored)
	if len(stored) == 0 {
		t.Fatal("no BlocksStored event")
	}
	var chain []uint64
	var tokens []uint32
	for _, ev := range stored {
		if len(ev.Tokens) != 16*len(ev.Hashes) {
			t.Fatalf("event with %d hashes carries %d tokens", len(ev.Hashes), len(ev.Tokens))
		}
		if len(chain) > 0 && (!ev.HasParent || ev.Parent != chain[len(chain)-1]) {
			t.Fatal("a later stored run must name the previous block as parent")
		}
		chain = append(chain, ev.Hashes...)
		tokens = append(tokens, ev.Tokens...)
	}
	// 70 prompt + 30 output = 100 tokens, of which the last sampled one is never computed:
	// 99 computed tokens fill 6 blocks.
	if len(chain) != 6 {
		t.Fatalf("stored %d blocks, want 6", len(chain))
	}
	if !slices.Equal(tokens[:70], p) {
		t.Fatal("stored tokens do not start with the prompt")
	}
	if stored[0].HasParent {
		t.Fatal("the first block has no parent")
	}
}

func TestEvictionIsLRUTailFirst(t *testing.T) {
	// 10 blocks of 16 tokens: a 64-token prompt plus 8 output tokens needs 5 blocks and
	// caches 4; two such requests fill the cache, and a third of 32+8 tokens needs 3 blocks:
	// the uncached partial block of the oldest request and then its two tail blocks.
	e, rec, c := newTestEngine(t, func(cfg *Config) { cfg.NumGPUBlocks = 10 })
	a, b, x := prompt(64, 1), prompt(64, 2), prompt(32, 3)
	submit(t, e, a, Params{MaxTokens: 8, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	submit(t, e, b, Params{MaxTokens: 8, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	if n := len(rec.kinds(BlocksRemoved)); n != 0 {
		t.Fatalf("%d removals before the cache was full", n)
	}
	submit(t, e, x, Params{MaxTokens: 8, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	removed := rec.kinds(BlocksRemoved)
	if len(removed) == 0 {
		t.Fatal("a cache too small for three prompts must evict and emit BlocksRemoved")
	}
	aHashes := e.mustHashes(t, a)
	var gone []uint64
	for _, ev := range removed {
		gone = append(gone, ev.Hashes...)
	}
	// The oldest request's blocks go first, tail before head.
	if gone[0] != aHashes[3] {
		t.Fatalf("first eviction %x, want the tail block of the oldest prompt %x", gone[0], aHashes[3])
	}
	// Only a's tail went: its head is still a hit.
	r := submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	if _, _, _, cached := result(r); cached != 32 {
		t.Fatalf("after tail-first eviction the head of the oldest prompt should still hit partly, cached=%d", cached)
	}
}

func (e *Engine) mustHashes(t *testing.T, p []uint32) []uint64 {
	t.Helper()
	r, err := e.NewRequest("h", p, blockhash.Keys{}, Params{MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	return r.hashes
}

func TestConcurrentStreamsShareSteps(t *testing.T) {
	e, _, c := newTestEngine(t, nil)
	const streams, tokens = 8, 50
	reqs := make([]*Request, streams)
	for i := range reqs {
		reqs[i] = submit(t, e, prompt(200, uint32(i+1)), Params{MaxTokens: tokens, IgnoreEOS: true})
	}
	var decodeSteps int
	var elapsed time.Duration
	for range 1000 {
		c.e.drain(c.now)
		if len(c.e.running) == 0 && c.e.waiting.len() == 0 {
			break
		}
		d, prefill, decodes := c.step()
		elapsed += d
		if prefill == 0 {
			decodeSteps++
			if decodes != streams {
				t.Fatalf("a decode step advanced %d sequences, want all %d together", decodes, streams)
			}
		}
	}
	// One step prefills all eight prompts (1600 tokens fit the budget) and samples the first
	// token of each; every further step gives each stream one more token.
	if c.steps != tokens || decodeSteps != tokens-1 {
		t.Fatalf("%d steps (%d decode) for %d tokens per stream", c.steps, decodeSteps, tokens)
	}
	tm := e.cfg.Timing
	perStep := tm.DecodeMS(0) // usage stays tiny
	if per := float64(elapsed.Milliseconds()) / float64(c.steps); per > 3*perStep || per < perStep {
		t.Fatalf("mean step %.2f ms, want about one decode step (%.2f ms), not one per stream", per, perStep)
	}
	for _, r := range reqs {
		if out, done, _, _ := result(r); !done || len(out) != tokens {
			t.Fatalf("stream got %d tokens, done=%v", len(out), done)
		}
	}
}

func TestChunkedPrefill(t *testing.T) {
	e, _, c := newTestEngine(t, func(cfg *Config) { cfg.NumGPUBlocks = 4096 })
	r := submit(t, e, prompt(20000, 5), Params{MaxTokens: 2, IgnoreEOS: true})
	var prefills []int
	for range 3 {
		_, p, _ := c.step()
		prefills = append(prefills, p)
		if out, _, _, _ := result(r); len(out) > 0 && len(prefills) < 3 {
			t.Fatalf("first token after %d steps, before the prompt was computed", len(prefills))
		}
	}
	if !slices.Equal(prefills, []int{8192, 8192, 3616}) {
		t.Fatalf("prefill chunks %v, want the 8192-token budget per step", prefills)
	}
	if out, _, _, _ := result(r); len(out) != 1 {
		t.Fatalf("after the last chunk the first token is out, got %d tokens", len(out))
	}
}

func TestPreemptionRecomputesAndCompletes(t *testing.T) {
	// 20 blocks; four requests of 64 prompt + 96 output tokens need 10 blocks each at the end.
	e, _, c := newTestEngine(t, func(cfg *Config) { cfg.NumGPUBlocks = 20 })
	m := NewMetrics(e.cfg)
	e.metrics = m
	var reqs []*Request
	for i := range 4 {
		reqs = append(reqs, submit(t, e, prompt(64, uint32(10+i)), Params{MaxTokens: 96, IgnoreEOS: true}))
	}
	c.runUntilIdle(t, 5000)
	for i, r := range reqs {
		if out, done, reason, _ := result(r); !done || reason != FinishLength || len(out) != 96 {
			t.Fatalf("request %d: done=%v reason=%s tokens=%d", i, done, reason, len(out))
		}
	}
	if got := counterValue(t, m.preemptions); got == 0 {
		t.Fatal("a cache too small for every request at once must preempt")
	}
	if e.kvm.numUsed() != 0 {
		t.Fatalf("%d blocks still held after every request finished", e.kvm.numUsed())
	}
}

func TestPriorityScheduling(t *testing.T) {
	e, _, c := newTestEngine(t, func(cfg *Config) {
		cfg.SchedulingPolicy = Priority
		cfg.MaxNumSeqs = 1
	})
	low := submit(t, e, prompt(32, 1), Params{MaxTokens: 2, IgnoreEOS: true, Priority: 10})
	high := submit(t, e, prompt(32, 2), Params{MaxTokens: 2, IgnoreEOS: true, Priority: -5})
	c.step()
	if out, _, _, _ := result(high); len(out) != 1 {
		t.Fatal("the lower priority value must run first")
	}
	if out, _, _, _ := result(low); len(out) != 0 {
		t.Fatal("only one sequence fits")
	}
	c.runUntilIdle(t, 100)
}

func TestAbortFreesBlocks(t *testing.T) {
	e, _, c := newTestEngine(t, nil)
	r := submit(t, e, prompt(300, 9), Params{MaxTokens: 1000, IgnoreEOS: true})
	c.step()
	c.step()
	if e.kvm.numUsed() == 0 {
		t.Fatal("a running request holds blocks")
	}
	e.Abort(r)
	e.drain(c.now)
	if e.kvm.numUsed() != 0 || len(e.running) != 0 {
		t.Fatalf("abort left %d blocks and %d running", e.kvm.numUsed(), len(e.running))
	}
	if _, done, reason, _ := result(r); !done || reason != FinishAborted {
		t.Fatalf("aborted request: done=%v reason=%s", done, reason)
	}
	e.Abort(r) // twice is harmless
	e.drain(c.now)
}

func TestNewRequestLimits(t *testing.T) {
	e, _, _ := newTestEngine(t, func(cfg *Config) { cfg.MaxModelLen = 1000; cfg.NumGPUBlocks = 32 })
	cases := []struct {
		name   string
		prompt int
		p      Params
		ok     bool
	}{
		{"fits", 100, Params{MaxTokens: 10}, true},
		{"empty prompt", 0, Params{MaxTokens: 10}, false},
		{"prompt over the model length", 1001, Params{}, false},
		{"prompt plus output over the model length", 900, Params{MaxTokens: 200}, false},
		{"more blocks than the cache", 600, Params{MaxTokens: 10}, false},
		{"negative max tokens", 10, Params{MaxTokens: -1}, false},
		{"min over max", 10, Params{MaxTokens: 5, MinTokens: 6}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.NewRequest("x", prompt(tc.prompt, 1), blockhash.Keys{}, tc.p)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestNaturalEndAndMinTokens(t *testing.T) {
	e, _, c := newTestEngine(t, nil)
	free := submit(t, e, prompt(40, 4), Params{MaxTokens: 4000})
	floor := submit(t, e, prompt(40, 4), Params{MaxTokens: 4000, MinTokens: 600})
	c.runUntilIdle(t, 2000)
	out, _, reason, _ := result(free)
	if reason != FinishStop || len(out) < 16 || len(out) > 512 {
		t.Fatalf("natural end: %d tokens, reason %s", len(out), reason)
	}
	if out, _, _, _ := result(floor); len(out) != 600 {
		t.Fatalf("min_tokens 600 gave %d tokens", len(out))
	}
}

func TestRunLoopRealTime(t *testing.T) {
	e, _, _ := newTestEngine(t, func(cfg *Config) { cfg.Timing.Speedup = 100 })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	r := submit(t, e, prompt(100, 1), Params{MaxTokens: 20, IgnoreEOS: true})
	awaitFinished(t, r, 10*time.Second)
	if out, _, _, _ := result(r); len(out) != 20 {
		t.Fatalf("got %d tokens", len(out))
	}
	ok, err := e.ResetPrefixCache(ctx)
	if err != nil || !ok {
		t.Fatalf("reset prefix cache: %v %v", ok, err)
	}
	pending := submit(t, e, prompt(100, 2), Params{MaxTokens: 10000, IgnoreEOS: true})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, finished, reason, _ := result(pending); !finished || reason != FinishAborted {
		t.Fatalf("a request still running at shutdown must end aborted, got done=%v %s", finished, reason)
	}
}

// TestStalled checks the engine's account of time lost to a host that does not run it when
// its step clock says: lag within maxLag is caught up, lag past it after a step is lost and
// counted, and the gap after an idle wait is not. A busy period starts when its request is
// there, however shortly after the last step.
func TestStalled(t *testing.T) {
	var e Engine
	t0 := time.Unix(1000, 0)
	if got := e.catchUp(t0, t0.Add(maxLag/2), true); !got.Equal(t0) {
		t.Errorf("lag within maxLag: next step starts at %v, want the last step's end %v", got, t0)
	}
	if got := e.catchUp(t0, t0.Add(time.Hour), false); !got.Equal(t0.Add(time.Hour)) {
		t.Errorf("after idling: next step starts at %v, want now", got)
	}
	if got := e.catchUp(t0, t0.Add(maxLag/2), false); !got.Equal(t0.Add(maxLag / 2)) {
		t.Errorf("after idling %v: next step starts at %v, want now, not back-dated to the last step's end", maxLag/2, got)
	}
	if n, lost := e.Stalled(); n != 0 || lost != 0 {
		t.Fatalf("no busy stall yet, Stalled() = %d, %v", n, lost)
	}
	e.catchUp(t0, t0.Add(50*time.Millisecond), true)
	e.catchUp(t0, t0.Add(30*time.Millisecond), true)
	if n, lost := e.Stalled(); n != 2 || lost != 80*time.Millisecond {
		t.Errorf("Stalled() = %d, %v, want 2, 80ms", n, lost)
	}

	// A speedup no host can follow: a step is modelled at about a nanosecond and takes the
	// run loop microseconds, so it falls maxLag behind every few thousand steps.
	fast, _, _ := newTestEngine(t, func(cfg *Config) { cfg.Timing.Speedup = 1e7; cfg.NumGPUBlocks = 16384 })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fast.Run(ctx) }()
	// One long decode, watched until the engine reports stalls adding up to more than
	// maxLag (within a few thousand steps; the decode's end, much later under the race
	// detector, only bounds the wait), then cancelled: an engine that never waits for its
	// clock still stops when told.
	finished := waitFinished(submit(t, fast, prompt(100, 1), Params{MaxTokens: 130000, IgnoreEOS: true}))
	start := time.Now()
	n, lost := fast.Stalled()
watch:
	for n == 0 || lost <= maxLag {
		select {
		case <-finished:
			n, lost = fast.Stalled()
			break watch
		case <-time.After(10 * time.Millisecond):
			n, lost = fast.Stalled()
		}
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a busy engine behind its clock did not stop within 10s of its context's end")
	}
	t.Logf("speedup 1e7: %d stalls, %v lost in %v", n, lost, time.Since(start).Round(time.Millisecond))
	if n == 0 || lost <= maxLag {
		t.Errorf("Stalled() = %d, %v: an engine far behind its modelled clock lost no time", n, lost)
	}
}

// TestIdleStartNotBackdated: a request reaching an idle engine shortly after its last step
// takes its modelled prefill from its arrival on, not from the end of that step.
func TestIdleStartNotBackdated(t *testing.T) {
	e, _, _ := newTestEngine(t, func(cfg *Config) { cfg.NumGPUBlocks = 4096 })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	defer func() { cancel(); <-done }()
	awaitFinished(t, submit(t, e, prompt(16, 1), Params{MaxTokens: 1, IgnoreEOS: true}), 30*time.Second)
	time.Sleep(maxLag / 2)
	const n = 2000
	start := time.Now()
	awaitFinished(t, submit(t, e, prompt(n, 2), Params{MaxTokens: 1, IgnoreEOS: true}), 30*time.Second)
	// One prefill step of n tokens; a slow host only adds to it.
	if took, want := time.Since(start), e.cfg.Timing.StepTime(n, 0, 0); took < want {
		t.Errorf("a %d-token prompt on an idle engine took %v, under its modelled prefill of %v", n, took, want)
	}
}

// awaitFinished fails the test unless r finishes within d.
func awaitFinished(t *testing.T, r *Request, d time.Duration) {
	t.Helper()
	select {
	case <-waitFinished(r):
	case <-time.After(d):
		t.Fatal("request did not finish")
	}
}

// waitFinished closes when r has finished.
func waitFinished(r *Request) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		for {
			<-r.Wait()
			if _, finished, _, _ := result(r); finished {
				close(ch)
				return
			}
		}
	}()
	return ch
}

// stepRecorder is a StepModel that prices every step at a fixed time and keeps what it saw.
type stepRecorder struct {
	d       time.Duration
	batches []Batch
}

func (s *stepRecorder) Step(b *Batch) time.Duration {
	c := *b
	c.Prefill = slices.Clone(b.Prefill)
	s.batches = append(s.batches, c)
	return s.d
}

// TestStepModelReplacesTiming: a Config.StepModel prices every step in place of the
// polynomial, and sees each step's composition: prefill chunks with their context, then
// decodes.
func TestStepModelReplacesTiming(t *testing.T) {
	model := &stepRecorder{d: 7 * time.Millisecond}
	e, _, _ := newTestEngine(t, func(c *Config) { c.StepModel = model; c.MaxNumBatchedTokens = 64 })
	submit(t, e, prompt(100, 1), Params{MaxTokens: 3, IgnoreEOS: true})
	now := time.Unix(1000, 0)
	for range 10 {
		end, busy := e.StepAt(now)
		if !busy {
			break
		}
		if end.Sub(now) != model.d {
			t.Fatalf("step took %v, want the model's %v", end.Sub(now), model.d)
		}
		now = end
	}
	want := []Batch{
		{Prefill: []Chunk{{Tokens: 64, Context: 0}}, PrefillTokens: 64},
		{Prefill: []Chunk{{Tokens: 36, Context: 64}}, PrefillTokens: 36},
		{Decodes: 1, DecodeContext: 100},
		{Decodes: 1, DecodeContext: 101},
	}
	if len(model.batches) != len(want) {
		t.Fatalf("model saw %d steps %+v, want %d", len(model.batches), model.batches, len(want))
	}
	for i, b := range model.batches {
		if len(b.Prefill) == 0 {
			b.Prefill = nil
		}
		if !slices.Equal(b.Prefill, want[i].Prefill) || b.PrefillTokens != want[i].PrefillTokens || b.Decodes != want[i].Decodes || b.DecodeContext != want[i].DecodeContext {
			t.Errorf("step %d: %+v, want %+v", i, b, want[i])
		}
	}
}
