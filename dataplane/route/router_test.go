package route

import (
	"errors"
	"math"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/engines/blockhash"
)

func workers(n int) []*Worker {
	ws := make([]*Worker, n)
	for i := range ws {
		ws[i] = &Worker{ID: "w" + strconv.Itoa(i), Model: "m", BlockSize: 16}
	}
	return ws
}

func promptChain(group, user uint32, sharedBlocks, userBlocks int) ([]uint64, int) {
	toks := make([]uint32, 16*(sharedBlocks+userBlocks))
	for i := range toks {
		if i < 16*sharedBlocks {
			toks[i] = group*1_000_003 + uint32(i)
		} else {
			toks[i] = user*7_919_111 + uint32(i)
		}
	}
	return blockhash.Seq(toks, 16, nil), len(toks)
}

func newRouter(t testing.TB, cfg Config, n int) (*Router, *prefix.Approx) {
	t.Helper()
	idx := prefix.NewApprox(prefix.ApproxConfig{MaxBlocks: 1 << 16, TTL: time.Minute})
	r, err := NewRouter(cfg, NewPool(workers(n)), idx)
	if err != nil {
		t.Fatal(err)
	}
	return r, idx
}

// send routes one request, records it in the index and accounts its load as the proxy does;
// the returned usage ends it.
func send(t testing.TB, r *Router, idx *prefix.Approx, req *Request) (*Worker, *Usage) {
	t.Helper()
	var d Decision
	if err := r.Route(req, &d); err != nil {
		t.Fatal(err)
	}
	idx.Record(d.Worker.Index, req.Hashes, int(d.Overlap))
	u := &Usage{}
	u.Begin(d.Worker, req.PromptTokens, int(d.Overlap)*16, req.OSL)
	return d.Worker, u
}

func TestSamePrefixSameWorkerDistinctPrefixesSpread(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyKV}, 4)
	var req Request
	// Four prompt families, each 64 shared blocks plus a short user part. The first request
	// of each lands on a distinct idle worker; every later one follows its family.
	home := map[uint32]string{}
	var open []*Usage
	for round := range 5 {
		for g := uint32(1); g <= 4; g++ {
			req.Reset()
			req.Model = "m"
			req.Hashes, req.PromptTokens = promptChain(g, uint32(round)*10+g, 64, 2)
			w, u := send(t, r, idx, &req)
			open = append(open, u)
			if round == 0 {
				for _, id := range home {
					if id == w.ID {
						t.Fatalf("family %d's first request went to busy %s instead of an idle worker", g, w.ID)
					}
				}
				home[g] = w.ID
			} else if home[g] != w.ID {
				t.Fatalf("round %d: family %d went to %s, its prefix is on %s", round, g, w.ID, home[g])
			}
		}
	}
	for _, w := range r.Pool().Workers {
		if w.Inflight() != 5 {
			t.Fatalf("%s has %d requests, want 5 each", w.ID, w.Inflight())
		}
	}
	for _, u := range open {
		u.End()
	}
	for _, w := range r.Pool().Workers {
		if w.Inflight() != 0 || w.DecodeBlocks() != 0 || w.PrefillTokens() != 0 {
			t.Fatalf("%s load not returned: %d %d %d", w.ID, w.Inflight(), w.DecodeBlocks(), w.PrefillTokens())
		}
	}
}

func TestCostWeighsCacheAgainstLoad(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyKV}, 2)
	hashes, n := promptChain(1, 1, 100, 0)
	idx.Record(0, hashes, 0)
	var req Request
	req.Hashes, req.PromptTokens = hashes, n
	var d Decision
	if err := r.Route(&req, &d); err != nil || d.Worker.Index != 0 || d.Mode != "cost" || d.Overlap != 100 {
		t.Fatalf("cached worker should win: %+v %v", d, err)
	}
	w0 := r.Pool().Workers[0]
	saved := 100 * DefaultOverlapWeight // what computing the 100 blocks again would cost
	// Blocks held by running requests, at DefaultDecodeWeight each: tens of thousands do not
	// outweigh the cache...
	held := int(float64(saved) / DefaultDecodeWeight)
	var u Usage
	u.Begin(w0, 16*held/2, 16*held/2, 0)
	if err := r.Route(&req, &d); err != nil || d.Worker.Index != 0 {
		t.Fatalf("a cached worker holding %d blocks should still win: %+v %v", held/2, d, err)
	}
	u.End()
	// ...more than the saving does.
	u.Begin(w0, 16*(held+50), 16*(held+50), 0)
	if err := r.Route(&req, &d); err != nil || d.Worker.Index != 1 {
		t.Fatalf("a cached worker holding %d blocks should lose: %+v %v", held+50, d, err)
	}
	u.End()
	// Prefill queued on the worker weighs QueueWeight per block: a queue half as long as
	// the saving over the queue weight keeps the request, a longer one sends it elsewhere.
	// (The queued request's own blocks count as held too.)
	queue := saved / DefaultQueueWeight
	u.Begin(w0, 16*queue/2, 0, 0)
	if err := r.Route(&req, &d); err != nil || d.Worker.Index != 0 {
		t.Fatalf("a cached worker with %d blocks of prefill queued should still win: %+v %v", queue/2, d, err)
	}
	u.End()
	u.Begin(w0, 16*queue, 0, 0)
	if err := r.Route(&req, &d); err != nil || d.Worker.Index != 1 {
		t.Fatalf("a cached worker with %d blocks of prefill queued should lose: %+v %v", queue, d, err)
	}
	u.End()
}

func TestFiltersAndErrors(t *testing.T) {
	r, _ := newRouter(t, Config{Busy: BusyFilter{MaxPrefillTokens: 1000}}, 3)
	ws := r.Pool().Workers
	ws[2].Model = "other"
	var req Request
	req.Model = "m"
	req.Hashes, req.PromptTokens = promptChain(1, 1, 4, 0)
	var d Decision

	ws[0].SetDraining(true)
	req.Exclude = append(req.Exclude, 1)
	if err := r.Route(&req, &d); !errors.Is(err, ErrNoWorker) {
		t.Fatalf("draining, excluded and wrong-model workers: err %v", err)
	}
	ws[0].SetDraining(false)
	var u Usage
	u.Begin(ws[0], 5000, 0, 0)
	if err := r.Route(&req, &d); !errors.Is(err, ErrBusy) {
		t.Fatalf("the only candidate is busy: err %v", err)
	}
	u.FirstToken()
	if err := r.Route(&req, &d); err != nil || d.Worker != ws[0] {
		t.Fatalf("after its prefill the worker is free again: %v", err)
	}
	u.End()

	now := time.Now().UnixNano()
	if ws[0].Failed(now, 2, time.Hour) || !ws[0].Failed(now, 2, time.Hour) {
		t.Fatal("the second consecutive failure ejects")
	}
	if err := r.Route(&req, &d); !errors.Is(err, ErrNoWorker) {
		t.Fatal("an ejected worker must not be routed to")
	}
	ws[0].Succeeded()
	if !ws[0].Healthy(time.Now().UnixNano()) {
		t.Fatal("success ends the ejection")
	}
}

func TestPolicies(t *testing.T) {
	for _, name := range PolicyNames() {
		t.Run(name, func(t *testing.T) {
			r, idx := newRouter(t, Config{Policy: name}, 4)
			counts := map[string]int{}
			var req Request
			var open []*Usage
			for i := range 400 {
				req.Reset()
				req.Hashes, req.PromptTokens = promptChain(uint32(i), uint32(i), 2, 0)
				w, u := send(t, r, idx, &req)
				counts[w.ID]++
				if name != PolicyRandom && name != PolicyPowerOfTwo {
					open = append(open, u)
				} else {
					u.End()
				}
			}
			for _, w := range r.Pool().Workers {
				if c := counts[w.ID]; c < 50 {
					t.Fatalf("%s got %d of 400 distinct prompts: %v", w.ID, c, counts)
				}
			}
			for _, u := range open {
				u.End()
			}
		})
	}
}

func TestRoundRobinAndLeastLoadedAreExact(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyRoundRobin}, 3)
	var req Request
	for i := range 6 {
		w, u := send(t, r, idx, &req)
		u.End()
		if w.Index != i%3 {
			t.Fatalf("request %d went to %d", i, w.Index)
		}
	}
	r, idx = newRouter(t, Config{Policy: PolicyLeastLoaded}, 3)
	var us []*Usage
	for range 9 {
		_, u := send(t, r, idx, &req)
		us = append(us, u)
	}
	for _, w := range r.Pool().Workers {
		if w.Inflight() != 3 {
			t.Fatalf("least-loaded left %s with %d", w.ID, w.Inflight())
		}
	}
}

func TestSessionAffinity(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyKV, SessionTTL: 50 * time.Millisecond}, 4)
	var req Request
	req.SessionID = "agent-1"
	first, u := send(t, r, idx, &req)
	for range 5 {
		// Even as the worker gets busier, the session sticks.
		w, u2 := send(t, r, idx, &req)
		if w != first {
			t.Fatalf("session moved from %s to %s", first.ID, w.ID)
		}
		defer u2.End()
	}
	u.End()
	time.Sleep(80 * time.Millisecond)
	w, _ := send(t, r, idx, &req)
	if w == first {
		t.Fatalf("after the TTL the session should be routed afresh (least loaded), got the busy %s again", w.ID)
	}
}

// The proxy's SessionID aliases its connection's read buffer, which the next request
// overwrites: the router must keep a copy, or the stored session changes name under it (and
// the map loses the entry).
func TestSessionIDMayAliasAReusedBuffer(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyRoundRobin}, 4)
	buf := []byte("agent-1")
	var req Request
	req.SessionID = unsafe.String(&buf[0], len(buf))
	first, u := send(t, r, idx, &req)
	u.End()
	copy(buf, "agent-2") // the buffer now holds the next request
	req.SessionID = unsafe.String(&buf[0], len(buf))
	if w, u := send(t, r, idx, &req); w == first {
		t.Fatalf("agent-2 joined agent-1 on %s: round-robin should have moved on", w.ID)
	} else {
		u.End()
	}
	for range 3 {
		req.SessionID = "agent-1"
		w, u := send(t, r, idx, &req)
		u.End()
		if w != first {
			t.Fatalf("agent-1 moved from %s to %s after its id's buffer was reused", first.ID, w.ID)
		}
	}
}

func TestTemperatureSharesNearEqualWorkers(t *testing.T) {
	r, idx := newRouter(t, Config{Temperature: 1}, 2)
	hashes, n := promptChain(1, 1, 50, 0)
	idx.Record(0, hashes, 0)
	idx.Record(1, hashes[:45], 0)
	var req Request
	req.Hashes, req.PromptTokens = hashes, n
	counts := [2]int{}
	var d Decision
	for range 2000 {
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		counts[d.Worker.Index]++
	}
	if counts[1] < 200 || counts[0] < counts[1] {
		t.Fatalf("softmax split %v: the cheaper worker should win most, the other some", counts)
	}
}

func TestRouteDoesNotAllocate(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyKV}, 64)
	hashes, n := promptChain(1, 1, 512, 0)
	idx.Record(7, hashes[:300], 0)
	var req Request
	req.Hashes, req.PromptTokens, req.Model = hashes, n, "m"
	var d Decision
	_ = r.Route(&req, &d)
	if a := testing.AllocsPerRun(200, func() { _ = r.Route(&req, &d) }); a != 0 {
		t.Fatalf("Route allocates %.1f times", a)
	}
	if d.Worker.Index != 7 {
		t.Fatalf("picked %d", d.Worker.Index)
	}
}

// A router given no policy routes for latency, the measured default.
func TestDefaultPolicyIsLatency(t *testing.T) {
	r, err := NewRouter(Config{}, NewPool(workers(2)), prefix.NewApprox(prefix.ApproxConfig{MaxBlocks: 1 << 10, TTL: time.Minute}))
	if err != nil {
		t.Fatal(err)
	}
	if p := r.Policy(); p.Name != PolicyLatency || !p.Predicts {
		t.Fatalf("default policy %q (predicts %v), want %q", p.Name, p.Predicts, PolicyLatency)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"defaults", Config{}, true},
		{"unknown policy", Config{Policy: "fastest"}, false},
		{"negative weight", Config{OverlapWeight: -1}, false},
		{"threshold above one", Config{CacheThreshold: 1.5}, false},
		{"negative temperature", Config{Temperature: -0.1}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.cfg.Validate(); (err == nil) != tc.ok {
				t.Fatalf("err %v", err)
			}
		})
	}
}

// BenchmarkDecision is the routing decision for an 8k-token prompt (512 blocks) over 64
// workers with 1M blocks indexed: hash the token ids, match the index, score, pick.
func BenchmarkDecision(b *testing.B) {
	idx := prefix.NewApprox(prefix.ApproxConfig{MaxBlocks: 1 << 20, TTL: time.Hour})
	r, err := NewRouter(Config{}, NewPool(workers(64)), idx)
	if err != nil {
		b.Fatal(err)
	}
	for g := uint32(0); idx.Len() < (1<<20)-1024; g++ {
		h, _ := promptChain(g+100, g+100, 256, 0)
		idx.Record(int(g%64), h, 0)
	}
	toks := make([]uint32, 8192)
	for i := range toks {
		toks[i] = uint32(i * 31)
	}
	var hasher blockhash.Hasher
	full := hasher.AppendSeq(nil, toks, 16, nil)
	idx.Record(9, full[:400], 0)
	var req Request
	var d Decision
	b.ReportAllocs()
	for b.Loop() {
		req.Reset()
		req.Model = "m"
		req.PromptTokens = len(toks)
		req.Hashes = hasher.AppendSeq(req.Hashes, toks, 16, nil)
		if err := r.Route(&req, &d); err != nil {
			b.Fatal(err)
		}
	}
	if d.Worker.Index != 9 {
		b.Fatalf("picked %d", d.Worker.Index)
	}
}

// A prompt no worker caches goes where prefill starts soonest: behind the least uncached
// prompt work, not to the worker with the fewest requests.
func TestSpreadGoesBehindTheLeastPrefill(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyKV}, 3)
	var req Request
	req.Model = "m"
	// w0: one long prompt still prefilling; w1: three short requests, past their prefill;
	// w2: two short prompts prefilling.
	ws := r.Pool().Workers
	var open []*Usage
	begin := func(w *Worker, prompt, cached int, firstToken bool) {
		u := &Usage{}
		u.Begin(w, prompt, cached, 0)
		if firstToken {
			u.FirstToken()
		}
		open = append(open, u)
	}
	begin(ws[0], 60000, 0, false)
	for range 3 {
		begin(ws[1], 2000, 0, true)
	}
	begin(ws[2], 1000, 0, false)
	begin(ws[2], 1000, 0, false)
	req.Hashes, req.PromptTokens = promptChain(9, 9, 0, 40)
	w, u := send(t, r, idx, &req)
	u.End()
	if w != ws[1] {
		t.Fatalf("new prompt went to %s (prefill %d, load %d), want w1 (prefill %d, load %d)",
			w.ID, w.PrefillTokens(), w.Load(), ws[1].PrefillTokens(), ws[1].Load())
	}
	// Equal prefill: fewest requests wins.
	for _, u := range open {
		u.End()
	}
	open = open[:0]
	begin(ws[0], 2000, 0, true)
	begin(ws[0], 2000, 0, true)
	begin(ws[2], 2000, 0, true)
	w, u = send(t, r, idx, &req)
	u.End()
	if w != ws[1] {
		t.Fatalf("with no prefill anywhere the prompt went to %s, want the idle w1", w.ID)
	}
	for _, u := range open {
		u.End()
	}
}

// A prompt whose only cached blocks are a system prompt every worker holds is new to all of
// them alike: it spreads by prefill in flight rather than weighing KV held.
func TestSystemPromptCachedEverywhereSpreads(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyKV}, 3)
	ws := r.Pool().Workers
	sys, _ := promptChain(1, 0, 40, 0)
	for _, w := range ws {
		idx.Record(w.Index, sys, 0)
	}
	var open []*Usage
	begin := func(w *Worker, prompt int, firstToken bool) {
		u := &Usage{}
		u.Begin(w, prompt, 0, 0)
		if firstToken {
			u.FirstToken()
		}
		open = append(open, u)
	}
	// w0 and w2 hold little KV but are prefilling; w1 holds much KV, all past prefill.
	begin(ws[0], 4000, false)
	begin(ws[2], 3000, false)
	begin(ws[1], 200000, true)
	var req Request
	req.Model = "m"
	req.Hashes, req.PromptTokens = promptChain(1, 5, 40, 60)
	var d Decision
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if d.Mode != "spread" || d.Worker != ws[1] || d.Overlap != 40 {
		t.Fatalf("got %s on %s with overlap %g, want spread to w1 (no prefill in flight) with the system prompt's 40 blocks", d.Mode, d.Worker.ID, d.Overlap)
	}
	// Once one worker holds more of the prompt than the rest, the cost decides.
	full, _ := promptChain(1, 5, 40, 60)
	idx.Record(ws[2].Index, full, 40)
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if d.Mode != "cost" || d.Worker != ws[2] {
		t.Fatalf("got %s on %s, want cost on w2, which caches the whole prompt", d.Mode, d.Worker.ID)
	}
	for _, u := range open {
		u.End()
	}
}

// BeginAt and FirstTokenAt run at the time the caller read (an event loop's), on the clock
// that Begin and FirstToken read themselves.
func TestUsageAtTheCallersTime(t *testing.T) {
	w := &Worker{ID: "w", Model: "m", BlockSize: 16}
	const s = int64(time.Second)
	t0 := Now()
	var u Usage
	u.BeginAt(t0, w, 10000, 0, 0)
	if got := w.PrefillBacklog(ClockAt(t0 + s/2)); got != 10000 {
		t.Fatalf("backlog %d, want the 10000 pending", got)
	}
	u.FirstTokenAt(t0 + s) // 10000 tokens in the 1 s the caller says passed
	if r := math.Float64frombits(w.rate.Load()); r < 9999 || r > 10001 {
		t.Fatalf("learned rate %.0f tokens/s, want 10000: the times given were not used", r)
	}
	var v Usage
	v.BeginAt(t0+s, w, 5000, 0, 0)
	if got := w.PrefillBacklog(ClockAt(t0 + s + s/4)); got != 2500 {
		t.Fatalf("backlog %d a quarter second into 5000 tokens at 10000/s, want 2500", got)
	}
	if d := ClockAt(Now()) - Clock(); d > 0 || d < -int64(time.Second) {
		t.Fatalf("ClockAt(Now()) is %d ns off Clock()", d)
	}
	u.End()
	v.End()
}

// The backlog model learns how fast a worker prefills from the time between first tokens and
// takes what the engine has computed since off the tokens still pending; it never exceeds
// them, and without a rate learned it is the pending tokens.
func TestPrefillBacklogDrainsAtTheLearnedRate(t *testing.T) {
	var now int64
	saved := Clock
	Clock = func() int64 { return now }
	t.Cleanup(func() { Clock = saved })
	const s = int64(time.Second)
	w := &Worker{ID: "w", Model: "m", BlockSize: 16}

	var a, b, c Usage
	a.Begin(w, 10000, 0, 0)
	now = s / 2
	if got := w.PrefillBacklog(now); got != 10000 {
		t.Fatalf("nothing learned yet: backlog %d, want the 10000 pending", got)
	}
	now = s
	a.FirstToken() // 10000 tokens in 1 s
	b.Begin(w, 20000, 0, 0)
	now = s + s/2
	if got := w.PrefillBacklog(now); got != 15000 {
		t.Fatalf("half a second at 10000 tokens/s into 20000: backlog %d, want 15000", got)
	}
	if got := w.PrefillTokens(); got != 20000 {
		t.Fatalf("pending %d, want 20000 until the first token", got)
	}
	// Queued behind b, c starts once b is done: b (20000) and c (5000) take 2.5 s from 1 s.
	c.Begin(w, 5000, 0, 0)
	if got := w.PrefillBacklog(now); got != 20000 {
		t.Fatalf("backlog %d after c arrived, want 15000 + 5000", got)
	}
	now = 4 * s
	if got := w.PrefillBacklog(now); got != 0 {
		t.Fatalf("backlog %d past the time both take at the learned rate, want 0", got)
	}
	// The engine was slower than learned: b's first token at 4 s teaches a lower rate
	// (20000 tokens in 3 s); c is still pending, and the backlog is at most c's tokens.
	b.FirstToken()
	if got := w.PrefillBacklog(now); got != 5000 {
		t.Fatalf("backlog %d right after b's first token, want c's 5000", got)
	}
	if r := math.Float64frombits(w.rate.Load()); r < 7000 || r > 8000 {
		t.Fatalf("learned rate %.0f tokens/s, want between 10000/1 and 20000/3 weighted by tokens", r)
	}
	// A request that ends without a first token (aborted, or not streamed) leaves nothing.
	c.End()
	a.End()
	b.End()
	if got := w.PrefillBacklog(now); got != 0 {
		t.Fatalf("backlog %d with nothing pending", got)
	}
	// What another proxy has in flight (reported) adds to it as it is.
	w.SetReported(&Reported{PrefillTokens: 700})
	if got := w.PrefillBacklog(now); got != 700 {
		t.Fatalf("backlog %d, want the 700 reported", got)
	}
}

// A worker that has computed most of a long prompt no longer looks busier than one with a
// short prompt just queued: new prompts go behind the one that will finish first.
func TestSpreadFollowsTheBacklogNotThePendingTokens(t *testing.T) {
	var now int64
	saved := Clock
	Clock = func() int64 { return now }
	t.Cleanup(func() { Clock = saved })
	r, idx := newRouter(t, Config{Policy: PolicyKV}, 2)
	ws := r.Pool().Workers
	const s = int64(time.Second)
	// Both workers learn 10000 tokens/s.
	for _, w := range ws {
		var u Usage
		now = 0
		u.Begin(w, 10000, 0, 0)
		now = s
		u.FirstToken()
		u.End()
	}
	var long, short Usage
	long.Begin(ws[0], 40000, 0, 0) // at 1 s: done at 5 s
	now = 4*s + s/2
	short.Begin(ws[1], 8000, 0, 0) // at 4.5 s: done at 5.3 s
	defer long.End()
	defer short.End()
	var req Request
	req.Model = "m"
	req.Hashes, req.PromptTokens = promptChain(7, 7, 0, 40)
	w, u := send(t, r, idx, &req)
	u.End()
	if w != ws[0] {
		t.Fatalf("new prompt went to %s; want w0, whose long prompt has 5000 tokens left against w1's 8000 (pending %d and %d)",
			w.ID, ws[0].PrefillTokens(), ws[1].PrefillTokens())
	}
}

// TestDecisionRegret: a decision says the most blocks any candidate held (achievable) and,
// by cost, how much dearer its pick was than the cheapest: nothing for a cheapest pick, the
// difference when sampling chose another.
func TestDecisionRegret(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyKV, Temperature: 1}, 2)
	hashes, n := promptChain(1, 1, 50, 0)
	idx.Record(0, hashes, 0)
	idx.Record(1, hashes[:45], 0)
	var req Request
	req.Hashes, req.PromptTokens = hashes, n
	var d Decision
	seen := [2]bool{}
	for range 2000 {
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		if d.Achievable != 50 || !d.HasCost {
			t.Fatalf("achievable %v, has cost %v; want 50 and true", d.Achievable, d.HasCost)
		}
		switch d.Worker.Index {
		case 0:
			if d.CostGap != 0 || d.Achievable-d.Overlap != 0 {
				t.Fatalf("the cheapest, best-cached pick has a cost gap %v and regret %v", d.CostGap, d.Achievable-d.Overlap)
			}
		case 1:
			if d.CostGap <= 0 || d.Achievable-d.Overlap != 5 {
				t.Fatalf("the dearer pick has a cost gap %v and regret %v; want > 0 and 5", d.CostGap, d.Achievable-d.Overlap)
			}
		}
		seen[d.Worker.Index] = true
	}
	if !seen[0] || !seen[1] {
		t.Fatalf("sampling never picked both workers: %v", seen)
	}
	// A worker kept out by the busy thresholds is not achievable.
	rb, idxb := newRouter(t, Config{Policy: PolicyKV, Busy: BusyFilter{MaxPrefillTokens: 100}}, 2)
	idxb.Record(0, hashes, 0)
	rb.pool.Load().Workers[0].prefillTokens.Store(5000)
	if err := rb.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if d.Worker.Index != 1 || d.Achievable != 0 {
		t.Fatalf("with the cached worker busy: picked %d, achievable %v; want 1 and 0", d.Worker.Index, d.Achievable)
	}
}

// TestExplicitZeroIsZero: in an explicit config (a pushed policy, a proxy's) a zero overlap
// weight is load-only routing, not the default weight; elsewhere a zero still means the
// default.
func TestExplicitZeroIsZero(t *testing.T) {
	hashes, n := promptChain(1, 1, 50, 0)
	for _, c := range []struct {
		explicit bool
		want     int // worker index
	}{{false, 0}, {true, 1}} {
		r, idx := newRouter(t, Config{Policy: PolicyKV, Explicit: c.explicit, QueueWeight: 8, CacheThreshold: 0.1}, 2)
		idx.Record(0, hashes, 0)
		r.pool.Load().Workers[0].decodeBlocks.Store(40) // the cached worker holds some decodes
		var req Request
		req.Hashes, req.PromptTokens = hashes, n
		var d Decision
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		if d.Worker.Index != c.want {
			t.Errorf("explicit %v, overlap weight 0: picked w%d, want w%d", c.explicit, d.Worker.Index, c.want)
		}
	}
	if cfg := (Config{Explicit: true}).withDefaults(); cfg.OverlapWeight != 0 || cfg.CacheThreshold != 0 || cfg.SessionTTL == 0 || cfg.Policy == "" {
		t.Errorf("explicit defaults: %+v", cfg)
	}
}

// TestDryRunBindsNoSession: a dry-run decision (a shadow pick) leaves no session binding.
func TestDryRunBindsNoSession(t *testing.T) {
	r, _ := newRouter(t, Config{Policy: PolicyKV}, 4)
	var req Request
	req.Hashes, req.PromptTokens = promptChain(1, 1, 4, 0)
	req.SessionID, req.DryRun = "s1", true
	var d Decision
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if _, ok := r.sessions.get("s1", Now()); ok {
		t.Fatal("a dry-run decision bound its session")
	}
	req.DryRun = false
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if id, ok := r.sessions.get("s1", Now()); !ok || id != d.Worker.ID {
		t.Fatalf("a real decision bound %q, %v; want %s", id, ok, d.Worker.ID)
	}
}

// TestHeadroomStaggersPrefills: a request with headroom (its tenant floods) sees a worker
// full that many slots sooner, sees busy a worker still prefilling another request, and
// sees every worker busy while half of them prefill; a request without headroom takes any
// worker under its slots.
func TestHeadroomStaggersPrefills(t *testing.T) {
	r, _ := newRouter(t, Config{Busy: BusyFilter{MaxRequests: 4}}, 4)
	ws := r.Pool().Workers
	var req Request
	req.Model = "m"
	req.Hashes, req.PromptTokens = promptChain(7, 1, 4, 0)
	route := func(headroom int64) (*Worker, error) {
		req.Headroom = headroom
		var d Decision
		err := r.Route(&req, &d)
		return d.Worker, err
	}
	// Three requests decoding on every worker: one slot left on each, the headroom's.
	var decoding []*Usage
	for _, w := range ws {
		for range 3 {
			u := &Usage{}
			u.Begin(w, 64, 0, 0)
			u.FirstToken()
			decoding = append(decoding, u)
		}
	}
	if _, err := route(1); !errors.Is(err, ErrBusy) {
		t.Fatalf("headroom 1 on workers with one slot left: err %v, want busy", err)
	}
	if _, err := route(0); err != nil {
		t.Fatalf("no headroom: %v", err)
	}
	for _, u := range decoding[:3] { // w0 free again
		u.End()
	}
	var prefill Usage
	prefill.Begin(ws[0], 1000, 0, 0)
	if _, err := route(1); !errors.Is(err, ErrBusy) {
		t.Fatalf("with headroom, the only worker with room prefills: err %v, want busy", err)
	}
	for _, u := range decoding[3:6] { // w1 free again, w0 still prefilling
		u.End()
	}
	if w, err := route(1); err != nil || w != ws[1] {
		t.Fatalf("with headroom, one worker of four prefilling: got %v %v, want w1", w, err)
	}
	var second Usage
	second.Begin(ws[2], 1000, 0, 0) // two of four prefilling
	if _, err := route(1); !errors.Is(err, ErrBusy) {
		t.Fatalf("with headroom, half the workers prefilling: err %v, want busy", err)
	}
	if _, err := route(0); err != nil {
		t.Fatalf("without headroom, half the workers prefilling: %v", err)
	}
	prefill.FirstToken()
	if w, err := route(1); err != nil || w != ws[0] && w != ws[1] {
		t.Fatalf("with headroom, after one prefill ended: got %v %v, want w0 or w1", w, err)
	}
	second.End()
	prefill.End()
	for _, u := range decoding[6:] {
		u.End()
	}
}
