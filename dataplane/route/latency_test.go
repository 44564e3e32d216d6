package route

import (
	"errors"
	"math"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/clock"
	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

func latencyRouter(t *testing.T, n, seqs int) (*Router, []*Worker, func(w *Worker, hashes []uint64)) {
	t.Helper()
	r, idx := newRouter(t, Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight}, n)
	ws := r.Pool().Workers
	for _, w := range ws {
		w.Engine.MaxNumSeqs = seqs
	}
	cache := func(w *Worker, hashes []uint64) { idx.Record(w.Index, hashes, 0) }
	return r, ws, cache
}

// busy puts n requests of this proxy in flight on w, each past its prefill, and returns
// their usages.
func busy(w *Worker, n int) []*Usage {
	us := make([]*Usage, n)
	for i := range us {
		us[i] = &Usage{}
		us[i].Begin(w, 100, 100, 0)
	}
	return us
}

// routeChain routes a request of model "m" for the prompt of hashes and n tokens.
func routeChain(t *testing.T, r *Router, hashes []uint64, n int) (*Request, Decision) {
	t.Helper()
	req := &Request{Model: "m", Hashes: hashes, PromptTokens: n}
	var d Decision
	if err := r.Route(req, &d); err != nil {
		t.Fatal(err)
	}
	return req, d
}

// TestLatencyAvoidsFullWorker: the worker that holds a long prefix but runs its max_num_seqs
// already would make a new request wait for a slot longer than its prefill elsewhere takes,
// so the request goes elsewhere; below its limit the same worker keeps it.
func TestLatencyAvoidsFullWorker(t *testing.T) {
	for _, tc := range []struct {
		name     string
		inflight int
		home     bool
	}{
		{"below the limit", 1, true},
		{"at the limit", 2, false},
		{"past the limit", 4, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, ws, cache := latencyRouter(t, 3, 2)
			hashes, n := promptChain(1, 1, 250, 4) // 4000 of 4064 tokens cached on w0
			cache(ws[0], hashes[:250])
			for _, u := range busy(ws[0], tc.inflight) {
				defer u.End()
			}
			req, d := routeChain(t, r, hashes, n)
			if !d.HasPrediction || d.Prediction.TTFT <= 0 {
				t.Fatalf("no prediction in %+v", d)
			}
			if got := d.Worker == ws[0]; got != tc.home {
				cands, preds := req.Candidates()
				for i, w := range cands {
					t.Logf("%s: %+v", w.ID, preds[i])
				}
				t.Fatalf("went to %s (home %v), want home %v", d.Worker.ID, got, tc.home)
			}
		})
	}
}

// TestLatencyNewPrefixesSpread: prompts nobody caches go to distinct idle workers.
func TestLatencyNewPrefixesSpread(t *testing.T) {
	r, _, _ := latencyRouter(t, 4, 8)
	seen := map[string]bool{}
	var open []*Usage
	defer func() {
		for _, u := range open {
			u.End()
		}
	}()
	for g := uint32(1); g <= 4; g++ {
		var req Request
		req.Model = "m"
		req.Hashes, req.PromptTokens = promptChain(g, g, 100, 2)
		var d Decision
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		if seen[d.Worker.ID] {
			t.Fatalf("prefix %d went to %s, already busy with another", g, d.Worker.ID)
		}
		seen[d.Worker.ID] = true
		u := &Usage{}
		u.Begin(d.Worker, req.PromptTokens, 0, 0)
		open = append(open, u)
	}
}

// Distinct prompts that share only a few blocks with what one idle worker caches (below the
// cache threshold) spread over idle workers instead of piling onto that one, and the
// decision says so; once a prompt's own prefix is cached, it goes home.
func TestLatencyLowOverlapSpreads(t *testing.T) {
	r, ws, cache := latencyRouter(t, 4, 8)
	seen := map[string]int{}
	for g := uint32(1); g <= 8; g++ {
		var req Request
		req.Model = "m"
		req.Hashes, req.PromptTokens = promptChain(g, g, 100, 2)
		cache(ws[0], req.Hashes[:3]) // 3% of the prompt
		var d Decision
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		if d.Mode != "spread" {
			t.Fatalf("prompt %d: mode %q, want spread", g, d.Mode)
		}
		seen[d.Worker.ID]++
		// In flight while the next ones route, as a proxy counts them: without that every
		// idle worker ties and the pick among them is random.
		u := &Usage{}
		u.Begin(d.Worker, req.PromptTokens, 0, 0)
		defer u.End()
	}
	if len(seen) < 3 {
		t.Fatalf("8 new prompts went to %v, want them spread over idle workers", seen)
	}
	var req Request
	req.Model = "m"
	req.Hashes, req.PromptTokens = promptChain(9, 9, 100, 2)
	cache(ws[2], req.Hashes[:60])
	var d Decision
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if d.Worker != ws[2] || d.Mode != "cost" {
		t.Fatalf("a prompt 60%% cached on %s went to %s (%s)", ws[2].ID, d.Worker.ID, d.Mode)
	}
}

// TestLatencySLO: a request whose TTFT target only an idle worker meets goes there even when
// another caches more of it; a target no worker meets is ErrSLO.
func TestLatencySLO(t *testing.T) {
	r, ws, cache := latencyRouter(t, 2, 2)
	hashes, n := promptChain(2, 2, 250, 4)
	cache(ws[0], hashes[:250])
	for _, u := range busy(ws[0], 2) {
		defer u.End()
	}
	req, d := routeChain(t, r, hashes, n)
	best := d.Prediction.TTFT
	req.SLOTTFT = best * 1.5
	if err := r.Route(req, &d); err != nil || d.Worker != ws[1] || d.Mode != "slo" {
		t.Fatalf("with a reachable target: %v, %s mode %s", err, d.Worker.ID, d.Mode)
	}
	req.SLOTTFT = best / 10
	if err := r.Route(req, &d); !errors.Is(err, ErrSLO) {
		t.Fatalf("with an unreachable target: %v, want ErrSLO", err)
	}
	req.SLOTTFT, req.SLOTPOT = 0, 1e-6
	if err := r.Route(req, &d); !errors.Is(err, ErrSLO) {
		t.Fatalf("with an unreachable TPOT target: %v, want ErrSLO", err)
	}
}

// TestLatencyBackground: a low-priority request goes where no interactive request runs, when
// the two workers are otherwise alike.
func TestLatencyBackground(t *testing.T) {
	r, ws, _ := latencyRouter(t, 2, 8)
	hot := &Usage{}
	hot.Begin(ws[0], 100, 0, 0)
	hot.Predicted(nil, 1, false)
	defer hot.End()
	cold := &Usage{}
	cold.Begin(ws[1], 100, 0, 0)
	defer cold.End()
	if ws[0].Interactive() != 1 || ws[1].Interactive() != 0 {
		t.Fatalf("interactive counts %d %d", ws[0].Interactive(), ws[1].Interactive())
	}
	for range 20 {
		var req Request
		req.Model, req.Priority = "m", -1
		req.Hashes, req.PromptTokens = promptChain(3, 3, 100, 1)
		var d Decision
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		if d.Worker != ws[1] {
			t.Fatalf("background request went to %s, beside an interactive one", d.Worker.ID)
		}
	}
}

// TestLatencyLearnsFromUsage: streamed requests teach the chosen worker's model at the first
// token and at completion.
func TestLatencyLearnsFromUsage(t *testing.T) {
	r, ws, _ := latencyRouter(t, 1, 4)
	clk := int64(1e12)
	Clock = func() int64 { return clk }
	defer func() { Clock = clock.Mono }()
	var req Request
	req.Model = "m"
	req.Hashes, req.PromptTokens = promptChain(4, 4, 10, 1)
	var d Decision
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	u := &Usage{}
	u.Begin(d.Worker, req.PromptTokens, 0, 0)
	u.Predicted(&d, 0, true)
	clk += 30e6
	u.FirstToken()
	pred, got, ok := u.TTFTPrediction()
	if !ok || got != 0.03 || pred != d.Prediction.TTFT {
		t.Fatalf("TTFTPrediction = %v %v %v", pred, got, ok)
	}
	clk += 1e9
	u.CompletedAt(0, 101)
	u.End()
	st := ws[0].Latency().Stats()
	if st.Observations != 1 || st.Decodes != 1 || st.Occupancy != 1 {
		t.Fatalf("model after one request: %+v", st)
	}
}

// TestLatencyShortPromptPrefersIdle: a short uncached prompt goes to an idle worker rather
// than into the step of another's backlog, however high the compute weight: what the
// request's tokens cost the worker is the same on both, and the step it would start on the
// idle worker is not compute it takes from anyone.
func TestLatencyShortPromptPrefersIdle(t *testing.T) {
	for _, cw := range []float64{0, 1, 3, 10} {
		r, idx := newRouter(t, Config{Policy: PolicyLatency, ComputeWeight: cw}, 2)
		_ = idx
		ws := r.Pool().Workers
		u := &Usage{}
		u.Begin(ws[0], 3000, 0, 0) // 3000 uncached tokens prefilling on w0
		var req Request
		req.Model = "m"
		req.Hashes, req.PromptTokens = promptChain(9, 9, 55, 1)
		var d Decision
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		if d.Worker != ws[1] {
			cands, preds := req.Candidates()
			for i, w := range cands {
				t.Logf("%s: %+v", w.ID, preds[i])
			}
			t.Fatalf("compute weight %v: a short prompt went behind %s's backlog instead of to the idle worker", cw, d.Worker.ID)
		}
		u.End()
	}
}

// With a batch weight, a request whose cache saving on a worker is moderate goes to an idle
// worker rather than join that worker's running batch (an engine whose step grows with the
// batch); a long prompt cached there still wins.
func TestLatencyBatchWeightSpreadsDecodes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		weight float64
		cached int // of max(500, cached) blocks, on w0
		home   bool
	}{
		{"no weight, half cached", 0, 250, true},
		{"weight, half cached", 0.1, 250, false},
		{"weight, long prompt cached", 0.1, 2000, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, idx := newRouter(t, Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight, BatchWeight: tc.weight}, 2)
			ws := r.Pool().Workers
			for _, w := range ws {
				w.Engine.MaxNumSeqs = 4
			}
			for range 100 { // the workers' step grows 5 ms per running request
				for b := 1; b <= 4; b++ {
					ws[0].Latency().ObserveDecode(b, 0.1, 0.010+0.005*float64(b), 1)
				}
			}
			hashes, n := promptChain(3, 3, max(500, tc.cached), 4)
			idx.Record(ws[0].Index, hashes[:tc.cached], 0)
			for _, u := range busy(ws[0], 3) {
				defer u.End()
			}
			var req Request
			req.Model, req.Hashes, req.PromptTokens, req.OSL = "m", hashes, n, 64
			var d Decision
			if err := r.Route(&req, &d); err != nil {
				t.Fatal(err)
			}
			if got := d.Worker == ws[0]; got != tc.home {
				cands, preds := req.Candidates()
				for i, w := range cands {
					t.Logf("%s: %+v", w.ID, preds[i])
				}
				t.Fatalf("went to %s, want home %v", d.Worker.ID, tc.home)
			}
		})
	}
}

// TestLatencyOverlapWeightCreditsTheCache: under the latency policy the overlap weight is
// the share of the cache the prediction credits: at its default the worker holding the
// prompt wins although busier; at an explicit 0 the cache counts for nothing and the idle
// worker wins.
func TestLatencyOverlapWeightCreditsTheCache(t *testing.T) {
	for _, tc := range []struct {
		weight float64
		home   bool
	}{{DefaultOverlapWeight, true}, {0, false}} {
		r, ws, cache := latencyRouter(t, 2, 8)
		cfg := Config{Policy: PolicyLatency, Explicit: true, OverlapWeight: tc.weight, QueueWeight: DefaultQueueWeight,
			CacheThreshold: DefaultCacheThreshold, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight}
		if err := r.SetPolicy(cfg); err != nil {
			t.Fatal(err)
		}
		hashes, n := promptChain(1, 1, 250, 4)
		cache(ws[0], hashes[:250])
		us := busy(ws[0], 1)
		var req Request
		req.Model, req.Hashes, req.PromptTokens = "m", hashes, n
		var d Decision
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		for _, u := range us {
			u.End()
		}
		if got := d.Worker == ws[0]; got != tc.home {
			t.Fatalf("overlap weight %v: went to %s, want the cache's worker %v", tc.weight, d.Worker.ID, tc.home)
		}
	}
}

// TestLatencySlotWaitFollowsRunningRequests: of two full workers holding the prompt alike,
// the one whose running requests got their first tokens long ago frees a slot sooner, and
// the prediction says so: the request goes there, and its predicted wait is the rest of
// the oldest request's occupancy, not the mean.
func TestLatencySlotWaitFollowsRunningRequests(t *testing.T) {
	r, ws, cache := latencyRouter(t, 2, 2)
	hashes, n := promptChain(1, 1, 250, 4)
	cache(ws[0], hashes[:250])
	cache(ws[1], hashes[:250])
	occ := ws[0].Latency().Occupancy()
	now := Now()
	var us []*Usage
	for i, w := range ws {
		for j := range 2 {
			u := &Usage{}
			u.BeginAt(now-int64(2*occ*1e9), w, 100, 100, 0)
			// w0's requests are nearly done; w1's have just begun decoding.
			age := 0.05 * occ
			if i == 0 {
				age = (0.9 + 0.05*float64(j)) * occ
			}
			u.FirstTokenAt(now - int64(age*1e9))
			us = append(us, u)
		}
	}
	d := routeAt(t, r, hashes, n, now, us)
	if d.Worker != ws[0] {
		t.Fatalf("went to %s, want w0 whose requests end first", d.Worker.ID)
	}
	if want := 0.05 * occ; math.Abs(d.Prediction.X[latency.FeatSlotWait]-want) > 1e-3 {
		t.Fatalf("slot wait feature %v, want the oldest request's remaining %v", d.Prediction.X[latency.FeatSlotWait], want)
	}
}

// routeAt routes a request for the prompt of n tokens (hashes) at now, and ends the usages
// us after it.
func routeAt(t *testing.T, r *Router, hashes []uint64, n int, now int64, us []*Usage) Decision {
	t.Helper()
	defer func() {
		for _, u := range us {
			u.End()
		}
	}()
	var req Request
	req.Model, req.Hashes, req.PromptTokens, req.Now = "m", hashes, n, now
	var d Decision
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	return d
}

// TestLatencySlotWaitFollowsExpectedOutput: of two full workers whose running requests got
// their first tokens at the same moment, the one whose requests expect fewer output tokens
// (their osl) frees a slot sooner: the request goes there, and its predicted wait is what
// is left of those tokens at the worker's step time, not of the mean occupancy.
func TestLatencySlotWaitFollowsExpectedOutput(t *testing.T) {
	r, ws, cache := latencyRouter(t, 2, 2)
	hashes, n := promptChain(1, 1, 250, 4)
	cache(ws[0], hashes[:250])
	cache(ws[1], hashes[:250])
	now := Now()
	age := 0.05
	var us []*Usage
	for i, w := range ws {
		osl := 9 // w0: 8 steps after the first token
		if i == 1 {
			osl = 400
		}
		for range 2 {
			u := &Usage{}
			u.BeginAt(now-int64(1e9), w, 100, 100, osl)
			u.FirstTokenAt(now - int64(age*1e9))
			us = append(us, u)
		}
	}
	d := routeAt(t, r, hashes, n, now, us)
	if d.Worker != ws[0] {
		t.Fatalf("went to %s, want w0 whose requests have fewer tokens to go", d.Worker.ID)
	}
	want := 8*ws[0].Latency().DecodeStep(2, ws[0].KVInUse()) - age
	if math.Abs(d.Prediction.X[latency.FeatSlotWait]-want) > 1e-3 {
		t.Fatalf("slot wait feature %v, want 8 steps less the %v s since the first token: %v", d.Prediction.X[latency.FeatSlotWait], age, want)
	}
}

// TestLatencyPricesOnboarding: a worker whose matched run sits in host memory or on disk is
// priced by the time those blocks take to come back at the bandwidths it advertises: a
// 16,000-token context on host (47 ms at 25 GB/s) beats recomputing it on an idle worker;
// on a slow disk (2.4 s at 0.5 GB/s) it does not (the request goes elsewhere, or to the holder
// told to compute instead: max_load_tokens 0), and a tier whose bandwidth the worker does
// not advertise earns no credit (the holder predicts as an idle worker). With nothing advertised the tier weights stand in (a disk block counts
// a quarter, so 250 of the 1000 blocks still draw the request home).
func TestLatencyPricesOnboarding(t *testing.T) {
	for _, tc := range []struct {
		name               string
		tier               blockset.Tier
		host, disk, shared float64
		home               bool
		onboardAtLeast     float64
	}{
		{"host at 25 GB/s", blockset.Host, 25e9, 0, 0, true, 0.04},
		{"disk at 0.5 GB/s", blockset.Disk, 0, 0.5e9, 0, false, 0},
		{"disk, only host bandwidth advertised", blockset.Disk, 25e9, 0, 0, false, -1}, // no credit: a tie
		{"disk, nothing advertised", blockset.Disk, 0, 0, 0, true, 0},
		{"host, nothing advertised", blockset.Host, 0, 0, 0, true, 0},
		// Shared storage at 10 GB/s: 118 ms to load beats about 340 ms of prefill; at
		// 0.2 GB/s (6 s) it does not; without its bandwidth it earns no credit.
		{"shared at 10 GB/s", blockset.Shared, 0, 0, 10e9, true, 0.1},
		{"shared at 0.2 GB/s", blockset.Shared, 0, 0, 0.2e9, false, 0},
		{"shared, only disk bandwidth advertised", blockset.Shared, 0, 25e9, 0, false, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := prefix.NewReplica(blockset.DefaultWeights)
			rep.SetSlots([]int{0, 1, 2})
			r, err := NewRouter(Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight}, NewPool(workers(3)), rep)
			if err != nil {
				t.Fatal(err)
			}
			ws := r.Pool().Workers
			for _, w := range ws {
				w.Engine.MaxNumSeqs = 8
			}
			if tc.host > 0 || tc.disk > 0 || tc.shared > 0 {
				ws[0].Engine.KVBytesPerToken = 73728
				ws[0].Engine.HostBandwidth, ws[0].Engine.DiskBandwidth = tc.host, tc.disk
				ws[0].Engine.SharedBandwidth = tc.shared
			}
			hashes, n := promptChain(1, 1, 1000, 2)
			var cs []journal.Change
			for _, h := range hashes[:1000] {
				cs = append(cs, journal.Change{Seq: h, Slot: 0, Tier: tc.tier, Op: journal.Stored})
			}
			rep.Apply(cs)
			// Both workers busy alike, so that the tie-break by load does not decide.
			for _, w := range ws {
				for _, u := range busy(w, 1) {
					defer u.End()
				}
			}
			req, d := routeChain(t, r, hashes, n)
			cands, preds := req.Candidates()
			for i, w := range cands {
				t.Logf("%s: TTFT %.3f s, features %v", w.ID, preds[i].TTFT, preds[i].X)
			}
			if tc.onboardAtLeast < 0 {
				// The holder's disk blocks count for nothing: it predicts as the others do.
				for i := range cands {
					if preds[i].TTFT != preds[0].TTFT {
						t.Fatalf("%s predicts %.3f s, %s %.3f s: want them alike", cands[i].ID, preds[i].TTFT, cands[0].ID, preds[0].TTFT)
					}
				}
				return
			}
			if d.Recompute && d.Worker != ws[0] {
				t.Fatalf("%s told to recompute blocks it does not hold below GPU", d.Worker.ID)
			}
			switch got := d.Worker == ws[0]; {
			case !tc.home && got && !d.Recompute:
				t.Fatalf("went to the holder to load its slow tier back, want another worker or a recompute (max_load_tokens 0)")
			case tc.home && (!got || d.Recompute && tc.onboardAtLeast > 0):
				t.Fatalf("went to %s (recompute %v), want the holder loading its blocks back", d.Worker.ID, d.Recompute)
			}
			if tc.onboardAtLeast > 0 {
				for i, w := range cands {
					if w == ws[0] && preds[i].X[latency.FeatPrefill] < tc.onboardAtLeast {
						t.Fatalf("holder's own prefill %.3f s does not include the %.3f s of onboarding", preds[i].X[latency.FeatPrefill], tc.onboardAtLeast)
					}
				}
			}
		})
	}
}

// TestLatencyPeerFetch: the worker holding a 16,000-token context is at its limit; an idle
// worker that can pull from peers is told to fetch it (23 ms at 50 GB/s against about 340 ms
// of prefill), one that cannot recomputes it or waits; a few hundred tokens are not worth a
// fetch, nor is fetching onto a worker whose free blocks cannot take the prompt, nor a fetch
// that saves less than the copy it leaves costs (PeerFetchCopyCost: half the prefill).
func TestLatencyPeerFetch(t *testing.T) {
	for _, tc := range []struct {
		name   string
		peerBW float64
		blocks int
		usage  float64 // the idle worker's reported KV usage, of 4,096 blocks
		fetch  bool
	}{
		{"fetch", 50e9, 1000, 0, true},
		{"cannot fetch", 0, 1000, 0, false},
		{"too little to fetch", 50e9, 20, 0, false},
		{"room for the prompt", 50e9, 1000, 0.7, true},
		{"no room for the prompt", 50e9, 1000, 0.8, false},
		{"fetch at 10 GB/s", 10e9, 1000, 0, true},
		{"fetch at 2 GB/s: it saves less than the copy costs", 2e9, 1000, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, ws, cache := latencyRouter(t, 2, 1)
			for _, w := range ws {
				w.Engine.KVBytesPerToken, w.Engine.PeerBandwidth = 73728, tc.peerBW
				w.Capacity = 4096
			}
			if tc.usage > 0 {
				ws[1].SetReported(&Reported{Running: 1, KVUsage: tc.usage})
			}
			hashes, n := promptChain(1, 1, tc.blocks, 4)
			cache(ws[0], hashes[:tc.blocks])
			for _, u := range busy(ws[0], 1) {
				defer u.End()
			}
			_, d := routeChain(t, r, hashes, n)
			if got := d.PeerFetch != nil; got != tc.fetch {
				t.Fatalf("peer fetch %v (to %s from %v), want %v; prediction %+v", got, d.Worker.ID, d.PeerFetch, tc.fetch, d.Prediction)
			}
			want := float64(tc.blocks*16*73728)/tc.peerBW + PeerFetchOverhead
			if tc.fetch && (d.Worker != ws[1] || d.PeerFetch != ws[0] || math.Abs(d.Prediction.Fetch-want) > 0.1*want) {
				t.Fatalf("went to %s fetching from %v in %.3f s, want w1 from w0 in %.3f s", d.Worker.ID, d.PeerFetch, d.Prediction.Fetch, want)
			}
		})
	}
}

// TestPeerFetchLeavesCachedBlocks: on a replica of the engines' events, which counts what
// each worker holds in GPU memory, a peer fetch goes only where the prompt's blocks fit
// beside what the worker caches: a pull that evicts cached blocks costs the worker its own
// hits. With the count unknown (the index cannot tell) only the requests' blocks count.
func TestPeerFetchLeavesCachedBlocks(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cached int // other blocks worker 1 holds in GPU memory, of 4,096
		usage  float64
		fetch  bool
	}{
		{"room beside its cache", 1000, 0, true},
		{"its cache fills the room", 3500, 0, false},
		{"requests hold more than it caches", 1000, 0.8, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep := prefix.NewReplica(blockset.DefaultWeights)
			rep.SetSlots([]int{0, 1})
			r, err := NewRouter(Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight}, NewPool(workers(2)), rep)
			if err != nil {
				t.Fatal(err)
			}
			ws := r.Pool().Workers
			for _, w := range ws {
				w.Engine.MaxNumSeqs, w.Engine.KVBytesPerToken, w.Engine.PeerBandwidth = 1, 73728, 50e9
				w.Capacity = 4096
			}
			if tc.usage > 0 {
				ws[1].SetReported(&Reported{Running: 1, KVUsage: tc.usage})
			}
			hashes, n := promptChain(1, 1, 1000, 4)
			var cs []journal.Change
			for _, h := range hashes {
				cs = append(cs, journal.Change{Seq: h, Slot: 0, Tier: blockset.GPU, Op: journal.Stored})
			}
			for i := range tc.cached {
				cs = append(cs, journal.Change{Seq: uint64(1e9 + i), Slot: 1, Tier: blockset.GPU, Op: journal.Stored})
			}
			rep.Apply(cs)
			if got, ok := rep.GPUBlocks(1); !ok || got != tc.cached {
				t.Fatalf("replica counts %d blocks on worker 1 (%v), want %d", got, ok, tc.cached)
			}
			for _, u := range busy(ws[0], 1) {
				defer u.End()
			}
			_, d := routeChain(t, r, hashes, n)
			if got := d.PeerFetch != nil; got != tc.fetch {
				t.Fatalf("peer fetch %v (to %s from %v), want %v", got, d.Worker.ID, d.PeerFetch, tc.fetch)
			}
		})
	}
}

// TestLatencyWaitWeightUsesFreeSlots: a worker whose slots are all taken and that caches
// part of the prompt, against an idle one that caches none of it. Without the wait weight
// the request queues there as soon as its wait is shorter than computing what that worker
// caches; with it, only for a larger share of the prompt: for some cache sizes the weight
// sends the request to the free slots, and never the other way round.
func TestLatencyWaitWeightUsesFreeSlots(t *testing.T) {
	home := func(weight float64, cached int) (bool, latency.Prediction) {
		r, idx := newRouter(t, Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight, WaitWeight: weight}, 2)
		ws := r.Pool().Workers
		for _, w := range ws {
			w.Engine.MaxNumSeqs = 2
		}
		hashes, n := promptChain(5, 5, 500, 4)
		idx.Record(ws[0].Index, hashes[:cached], 0)
		now := Now()
		occ := ws[0].Latency().Occupancy()
		for j := range 2 { // both slots taken, the first to free one in 80 ms
			u := &Usage{}
			u.BeginAt(now-int64(2*occ*1e9), ws[0], 100, 100, 0)
			u.FirstTokenAt(now - int64((occ-0.08-0.02*float64(j))*1e9))
			defer u.End()
		}
		var req Request
		req.Model, req.Hashes, req.PromptTokens, req.Now = "m", hashes, n, now
		var d Decision
		if err := r.Route(&req, &d); err != nil {
			t.Fatal(err)
		}
		_, preds := req.Candidates()
		return d.Worker == ws[0], preds[0]
	}
	moved := 0
	for cached := 25; cached <= 500; cached += 25 {
		h0, p := home(0, cached)
		h1, _ := home(1, cached)
		if p.Wait <= 0 {
			t.Fatalf("%d blocks cached: the full worker predicts no wait: %+v", cached, p)
		}
		if h1 && !h0 {
			t.Fatalf("%d blocks cached: the wait weight sent the request to the full worker", cached)
		}
		if h0 && !h1 {
			moved++
		}
	}
	if moved == 0 {
		t.Fatal("the wait weight never sent a request to the free slots")
	}
}

// TestLatencyPickTiesKeepTheCache: among costs the model cannot tell apart, a worker caching
// a tenth of the prompt more than another goes first, whatever its load; among workers
// caching alike, the less loaded one.
func TestLatencyPickTiesKeepTheCache(t *testing.T) {
	_, ws, _ := latencyRouter(t, 3, 4)
	for _, u := range busy(ws[0], 2) {
		defer u.End()
	}
	costs := []float64{0.0100, 0.0101, 0.0102} // within tieSeconds of each other
	for _, tc := range []struct {
		name    string
		overlap []float64
		want    int
	}{
		{"the busy worker caches the prompt", []float64{130, 0, 5}, 0},
		{"caches alike: the idle ones", []float64{3, 0, 5}, -1},
		{"two cache it: the idle one of them", []float64{130, 0, 128}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := Request{PromptTokens: 131 * 16, overlap: tc.overlap, creditsCache: true}
			got := LatencyPick{}.Pick(&req, ws, costs)
			if tc.want >= 0 && got != tc.want || tc.want < 0 && got == 0 {
				t.Fatalf("picked w%d", got)
			}
		})
	}
}

// TestSpreadRuleCountsOnlyCandidates: the worker holding the prompt is out of the running
// (excluded: a retry, or a gateway's subset hint), and the others cache nothing useful of
// it: the request spreads by load and KV rather than being priced as if one of them cached
// it, so it goes to the one holding least.
func TestSpreadRuleCountsOnlyCandidates(t *testing.T) {
	r, ws, cache := latencyRouter(t, 3, 4)
	hashes, n := promptChain(2, 1, 250, 4)
	cache(ws[0], hashes[:250])
	cache(ws[1], hashes[:1]) // a template block: no useful share
	other, _ := promptChain(3, 1, 200, 4)
	cache(ws[1], other) // and a full cache of another prompt
	ws[0].SetCachedBlocks(250)
	ws[1].SetCachedBlocks(201)
	var req Request
	req.Model, req.Hashes, req.PromptTokens = "m", hashes, n
	req.Exclude = append(req.Exclude, ws[0].Index)
	var d Decision
	if err := r.Route(&req, &d); err != nil {
		t.Fatal(err)
	}
	if d.Mode != "spread" || d.Worker != ws[2] {
		t.Fatalf("mode %s, worker %s; want spread to w2 (w1 holds another prompt)", d.Mode, d.Worker.ID)
	}
}

// TestLatencyPeerFetchFromBusyHolder: the worker holding the context is past the busy
// filter's threshold, so it takes no new request, but its blocks can still be read: the
// request goes to an idle worker told to fetch them from it.
func TestLatencyPeerFetchFromBusyHolder(t *testing.T) {
	r, idx := newRouter(t, Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight,
		Busy: BusyFilter{MaxPrefillTokens: 4000}}, 2)
	ws := r.Pool().Workers
	for _, w := range ws {
		w.Engine.MaxNumSeqs, w.Engine.KVBytesPerToken, w.Engine.PeerBandwidth = 1, 73728, 50e9
	}
	hashes, n := promptChain(1, 1, 1000, 4)
	idx.Record(ws[0].Index, hashes, 0)
	var u Usage
	u.Begin(ws[0], 8000, 100, 0) // 8,000 tokens still to prefill: past the threshold
	defer u.End()
	_, d := routeChain(t, r, hashes, n)
	if d.Worker != ws[1] || d.PeerFetch != ws[0] {
		t.Fatalf("went to %s fetching from %v, want w1 fetching from the busy w0", d.Worker.ID, d.PeerFetch)
	}
}

// latencyDefaults is the latency policy as kvrelay proxy runs it by default.
func latencyDefaults() Config {
	return Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight,
		BatchWeight: DefaultBatchWeight, TailWeight: DefaultTailWeight, BalanceWeight: DefaultBalanceWeight}
}

// An idle worker that never got a shared preamble is not left idle while the workers that
// hold it queue past what its cold prefill costs: its compute delays nobody (the compute
// weight counts in the share a worker is busy). While the warm workers' queue is short, the
// preamble's holders keep the request.
func TestLatencyOpensAnIdleWorker(t *testing.T) {
	for _, tc := range []struct {
		name     string
		backlog  int // uncached prompt tokens queued on each warm worker
		wantCold bool
	}{
		{"warm workers' queue is short", 1000, false},
		{"warm workers queue past a cold prefill", 8000, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := latencyDefaults()
			cfg.TailWeight, cfg.BalanceWeight = 0, 0 // the compute weight's share alone
			r, idx := newRouter(t, cfg, 4)
			ws := r.Pool().Workers
			hashes, n := promptChain(5, 6, 375, 20) // a 6000-token preamble and a short task
			for _, w := range ws {
				w.Engine.MaxNumSeqs = 4
			}
			for _, w := range ws[:3] {
				idx.Record(w.Index, hashes[:375], 0)
				var u Usage
				u.Begin(w, tc.backlog, 0, 0)
				defer u.End()
			}
			req, d := routeChain(t, r, hashes, n)
			if got := d.Worker == ws[3]; got != tc.wantCold {
				cands, preds := req.Candidates()
				for i, w := range cands {
					t.Logf("%s: cost %.3f %+v", w.ID, req.Costs()[i], preds[i])
				}
				t.Fatalf("went to %s (cold %v), want cold %v", d.Worker.ID, got, tc.wantCold)
			}
		})
	}
}

// With a balance weight, a request whose cache saving is small does not take the last free
// slot of the worker that holds its session's tail when another worker that holds the
// preamble has room: the next requests that want the full worker would wait. A request
// whose whole prompt is cached there still goes there.
func TestLatencyBalanceKeepsLastSlots(t *testing.T) {
	for _, tc := range []struct {
		name    string
		balance float64
		tail    int // of the prompt's blocks beyond the shared preamble, cached on w0
		home    bool
	}{
		{"no balance, session tail cached", 0, 60, true},
		{"balance, session tail cached", DefaultBalanceWeight, 60, false},
		{"balance, long prompt cached", DefaultBalanceWeight, 2000, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := latencyDefaults()
			cfg.BalanceWeight = tc.balance
			r, idx := newRouter(t, cfg, 2)
			ws := r.Pool().Workers
			for _, w := range ws {
				w.Engine.MaxNumSeqs = 4
				w.Latency().ObserveDecode(2, 0.3, 0.02, 2)
			}
			hashes, n := promptChain(7, 8, 100, tc.tail)
			idx.Record(ws[0].Index, hashes, 0)       // preamble and tail
			idx.Record(ws[1].Index, hashes[:100], 0) // the preamble only
			for _, u := range busy(ws[0], 3) {
				defer u.End()
			}
			for _, u := range busy(ws[1], 1) {
				defer u.End()
			}
			req, d := routeChain(t, r, hashes, n)
			if got := d.Worker == ws[0]; got != tc.home {
				cands, preds := req.Candidates()
				for i, w := range cands {
					t.Logf("%s: cost %.3f %+v", w.ID, req.Costs()[i], preds[i])
				}
				t.Fatalf("went to %s, want home %v", d.Worker.ID, tc.home)
			}
		})
	}
}

// With a tail weight, a worker whose recent predictions proved reliable wins over one
// predicted a little sooner on the mean whose predictions were often far off; without it
// the lower mean wins.
func TestLatencyTailWeightPrefersReliable(t *testing.T) {
	for _, tail := range []float64{0, DefaultTailWeight} {
		cfg := latencyDefaults()
		cfg.TailWeight, cfg.BalanceWeight = tail, 0
		r, _ := newRouter(t, cfg, 2)
		ws := r.Pool().Workers
		hashes, n := promptChain(9, 9, 0, 200)
		for i := range 60 {
			// w0's first tokens come three times sooner or later than predicted; w1's
			// a steady 15% late, so that w1 learns to predict itself slower.
			for j, w := range ws {
				var p latency.Prediction
				w.Latency().Predict(&w.Engine, latency.State{}, float64(n), &p)
				f := 1.15
				if j == 0 {
					f = 3.0
					if i%2 == 0 {
						f = 1 / f
					}
				}
				w.Latency().ObserveTTFT(&p, p.TTFT*f)
			}
		}
		picks := map[string]int{}
		for range 20 {
			_, d := routeChain(t, r, hashes, n)
			picks[d.Worker.ID]++
		}
		want := ws[1].ID // the reliable one
		if tail == 0 {
			want = ws[0].ID // the lower mean
		}
		if picks[want] != 20 {
			t.Fatalf("tail weight %v: picks %v, want every one on %s", tail, picks, want)
		}
	}
}

// A worker that learned something before it joined a pool (a report of its load, which the
// proxy hands it before it builds the pool) still shares its model's latency model with the
// pool's other workers of that model, and keeps what it learned of itself.
func TestWorkersShareTheirModelAfterAReport(t *testing.T) {
	ws := workers(3)
	ws[0].SetReported(&Reported{Running: 4, Waiting: 0})
	p := NewPool(ws)
	m := ws[1].Latency().Model()
	for _, w := range p.Workers {
		if w.Latency().Model() != m {
			t.Fatalf("%s has a latency model of its own", w.ID)
		}
	}
	if got := ws[0].Latency().SeqsLow(); got != 4 {
		t.Fatalf("the report's lesson was lost: most running %d, want 4", got)
	}
	// A pool of the same workers later keeps the model they share.
	if NewPool(ws); ws[2].Latency().Model() != m {
		t.Fatal("a new pool gave the workers another model")
	}
}

// TestLatencyRecomputesASlowTier: the worker caching a context's first 200 blocks in GPU
// memory and the next 800 on a slow disk (0.5 GB/s: 1.9 s to load) is the best place to
// compute those 800 (a fifth of the prompt is cached there) rather than to load them: the
// decision says Recompute, and its prediction is the recompute's.
func TestLatencyRecomputesASlowTier(t *testing.T) {
	r, hashes, n := splitHolder(t, Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight}, 3, blockset.Disk)
	ws := r.Pool().Workers
	for _, w := range ws {
		w.Engine.MaxNumSeqs = 8
	}
	ws[0].Engine.KVBytesPerToken, ws[0].Engine.DiskBandwidth = 73728, 0.5e9
	req, d := routeChain(t, r, hashes, n)
	cands, preds := req.Candidates()
	for i, w := range cands {
		t.Logf("%s: TTFT %.3f s", w.ID, preds[i].TTFT)
	}
	if d.Worker != ws[0] || !d.Recompute {
		t.Fatalf("went to %s, recompute %v: want the holder computing what its disk holds", d.Worker.ID, d.Recompute)
	}
	if d.Prediction.TTFT > 1 {
		t.Fatalf("predicted %.3f s: the prediction is the load's, not the recompute's", d.Prediction.TTFT)
	}
}

// TestLatencyOnboardSettings: Onboard always never tells a worker to recompute, even a slow
// disk's blocks; never always does, even a fast host tier's.
func TestLatencyOnboardSettings(t *testing.T) {
	for _, tc := range []struct {
		onboard   string
		tier      blockset.Tier
		recompute bool
	}{
		{OnboardAlways, blockset.Disk, false},
		{OnboardNever, blockset.Host, true},
		{OnboardWeigh, blockset.Host, false},
		{OnboardWeigh, blockset.Disk, true},
	} {
		t.Run(tc.onboard, func(t *testing.T) {
			r, hashes, n := splitHolder(t, Config{Policy: PolicyLatency, ComputeWeight: DefaultComputeWeight, BackgroundWeight: DefaultBackgroundWeight, Onboard: tc.onboard}, 2, tc.tier)
			ws := r.Pool().Workers
			ws[0].Engine.KVBytesPerToken, ws[0].Engine.HostBandwidth, ws[0].Engine.DiskBandwidth = 73728, 25e9, 0.2e9
			_, d := routeChain(t, r, hashes, n)
			// Told to load a slow disk back, the holder is the worse place: it may go
			// elsewhere, but never with a recompute.
			if (d.Worker != ws[0] && tc.onboard != OnboardAlways) || d.Recompute != tc.recompute {
				t.Fatalf("went to %s, recompute %v; want w0, recompute %v", d.Worker.ID, d.Recompute, tc.recompute)
			}
		})
	}
	if _, err := NewRouter(Config{Policy: PolicyLatency, Onboard: "sometimes"}, NewPool(workers(1)), nil); err == nil {
		t.Fatal("an unknown onboard setting was accepted")
	}
}

// splitHolder is a router with cfg over n workers of which w0 caches a 1000-block context's
// first 200 blocks in GPU memory and the other 800 in tier below; it returns the router and
// the context's chain (hashes, tokens) as promptChain does.
func splitHolder(t *testing.T, cfg Config, n int, below blockset.Tier) (*Router, []uint64, int) {
	t.Helper()
	rep := prefix.NewReplica(blockset.DefaultWeights)
	slots := make([]int, n)
	for i := range slots {
		slots[i] = i
	}
	rep.SetSlots(slots)
	r, err := NewRouter(cfg, NewPool(workers(n)), rep)
	if err != nil {
		t.Fatal(err)
	}
	hashes, tokens := promptChain(1, 1, 1000, 2)
	var cs []journal.Change
	for i, h := range hashes[:1000] {
		tier := blockset.GPU
		if i >= 200 {
			tier = below
		}
		cs = append(cs, journal.Change{Seq: h, Slot: 0, Tier: tier, Op: journal.Stored})
	}
	rep.Apply(cs)
	return r, hashes, tokens
}

// TestLatencyPickExplores: an exploring decision takes, among the candidates predicted
// within a quarter of the cheapest, one whose model has learned nothing lately or ever: the
// worker never chosen (its prior predicting it slower than what the chosen one learned)
// gets tried, and so does one not chosen for longer than exploreStale; a worker that
// learned just now does not, nor one predicted far slower. Without exploring, the cheapest.
func TestLatencyPickExplores(t *testing.T) {
	r, _ := newRouter(t, Config{Policy: PolicyLatency}, 3)
	ws := r.Pool().Workers
	now := Now()
	at := ClockAt(now) // the clock the router stamps observations with
	var p latency.Prediction
	ws[0].Latency().ObserveTTFTAt(at, &p, 0.05)
	req := &Request{Now: now}
	pick := LatencyPick{Explore: 1}
	near := []float64{0.10, 0.12, 0.12}
	for range 20 {
		if got := pick.Pick(req, ws[:2], near[:2]); got != 1 {
			t.Fatalf("exploring picked w%d, want w1, never chosen", got)
		}
	}
	if got := (LatencyPick{}).Pick(req, ws[:2], near[:2]); got != 0 {
		t.Fatalf("without exploring picked w%d, want the cheapest w0", got)
	}
	if got := pick.Pick(req, ws[:2], []float64{0.10, 0.5}); got != 0 {
		t.Fatalf("explored w%d, predicted five times slower", got)
	}
	// w1 learned just now, w2 long ago: only w2 is explored.
	ws[1].Latency().ObserveTTFTAt(at, &p, 0.05)
	ws[2].Latency().ObserveTTFTAt(at-2*exploreStale, &p, 0.05)
	for range 20 {
		if got := pick.Pick(req, ws, near); got != 2 {
			t.Fatalf("exploring picked w%d, want w2, stale", got)
		}
	}
}
