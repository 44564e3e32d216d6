package decide

import (
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/dataplane/route"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// rolloutCore is a routing core over two workers, w0 and w1, whose policies the tests set
// as a control plane's push does (push).
func rolloutCore(t *testing.T) *Core {
	t.Helper()
	return newTestCore(t, testConfig(), testRouteConfig("kv"), testWorkers(2))
}

// pushed is the routing configuration of a pushed policy: policy with its weights and cache
// threshold over the proxy's defaults.
func pushed(policy string, overlap, queue, threshold float64) route.Config {
	cfg := testRouteConfig(policy)
	cfg.OverlapWeight, cfg.QueueWeight, cfg.CacheThreshold, cfg.Temperature = overlap, queue, threshold, 0
	return cfg
}

// push installs a stable policy of version, and a candidate beside it (nil: none), as the
// proxy's xDS client applies a push: the candidate first, the stable policy only when its
// version changed.
func push(t *testing.T, c *Core, version uint64, stable route.Config, cand *Candidate) {
	t.Helper()
	c.ApplyCandidate(c.Pool(), c.Index(), cand)
	if a := c.stableArm.Load(); a != nil && a.num == version {
		return
	}
	if err := c.SetPolicy(stable, version, DisaggAuto, 512); err != nil {
		t.Fatal(err)
	}
}

// armOf decides a chat of session id and returns the policy version that decided it.
func armOf(t *testing.T, s *Core, session string) string {
	t.Helper()
	r := prepared(t, s, chat8k("q "+session), session)
	if err := r.Decide(nanotime(), false); err != nil {
		t.Fatal(err)
	}
	return r.Arm()
}

// TestCandidateTakesItsShare: a pushed candidate routes its share of the sessions, each
// session always with the same policy and alike on every proxy; a changed share applies at
// once, and a removed candidate sends everything back to stable.
func TestCandidateTakesItsShare(t *testing.T) {
	s := rolloutCore(t)
	other := rolloutCore(t)
	stable := pushed("kv", 64, 8, 0.1)
	with := func(share float64, shadow bool) *Candidate {
		return &Candidate{Version: 8, Config: pushed("round-robin", 0, 0, 0), Share: share, Shadow: shadow}
	}
	count := func(s *Core) (cand int, arms []string) {
		for i := range 400 {
			a := armOf(t, s, "session-"+strconv.Itoa(i))
			arms = append(arms, a)
			if a == "8" {
				cand++
			}
		}
		return cand, arms
	}
	push(t, s, 7, stable, nil)
	if n, _ := count(s); n != 0 {
		t.Fatalf("%d requests routed by a candidate before there was one", n)
	}
	for _, share := range []float64{0.25, 0.5} {
		push(t, s, 7, stable, with(share, false))
		push(t, other, 7, stable, with(share, false))
		n, arms := count(s)
		if got := float64(n) / 400; math.Abs(got-share) > 0.08 {
			t.Errorf("share %v: the candidate routed %v of the sessions", share, got)
		}
		_, again := count(s)
		_, elsewhere := count(other)
		for i := range arms {
			if arms[i] != again[i] || arms[i] != elsewhere[i] {
				t.Fatalf("share %v: session %d went to %s, then %s, and %s on another proxy", share, i, arms[i], again[i], elsewhere[i])
			}
		}
	}
	// In shadow every request is stable's, and the candidate's picks are recorded.
	push(t, s, 7, stable, with(0.5, true))
	if n, _ := count(s); n != 0 {
		t.Fatalf("in shadow %d requests were routed by the candidate", n)
	}
	agree := testutil.ToFloat64(s.m.shadow.WithLabelValues("agree"))
	disagree := testutil.ToFloat64(s.m.shadow.WithLabelValues("disagree"))
	if agree+disagree != 400 || disagree == 0 {
		t.Fatalf("shadow decisions: %v agree, %v disagree; want 400 in all, some apart (round-robin against kv)", agree, disagree)
	}
	// The load report carries the same counts for the control plane's analysis.
	var rep *xdsv1.ArmReport
	for _, a := range s.ArmReports() {
		if a.GetPolicyVersion() == 8 {
			rep = a
		}
	}
	if rep.GetShadowPicks() != 400 || float64(rep.GetShadowDisagreements()) != disagree {
		t.Fatalf("reported shadow picks %d, disagreements %d; want 400 and %v", rep.GetShadowPicks(), rep.GetShadowDisagreements(), disagree)
	}
	push(t, s, 7, stable, nil)
	if s.cand.Load() != nil {
		t.Fatal("the candidate stayed after the rollout ended")
	}
	if n, _ := count(s); n != 0 {
		t.Fatalf("%d requests routed by a removed candidate", n)
	}
}

// TestCacheAwareCandidateBesideLoadOnlyStable: a kv candidate beside a round-robin stable
// policy sees the prompt's blocks (the proxy hashes them for it) and so the cache.
func TestCacheAwareCandidateBesideLoadOnlyStable(t *testing.T) {
	s := rolloutCore(t)
	push(t, s, 3, pushed("round-robin", 0, 0, 0), &Candidate{Version: 4, Config: pushed("kv", 64, 8, 0.1), Share: 1})
	cc := prepared(t, s, chat8k("q"), "")
	if len(cc.rreq.Hashes) < 400 {
		t.Fatalf("%d prompt blocks hashed for the kv candidate", len(cc.rreq.Hashes))
	}
	w1 := s.kv.Pool().Worker("w1")
	s.index.Record(w1.Index, cc.rreq.Hashes, 0)
	router, cand := cc.armFor(s.kv)
	if cand == nil {
		t.Fatal("share 1 left the request with the stable policy")
	}
	if err := router.Route(&cc.rreq, &cc.dec); err != nil {
		t.Fatal(err)
	}
	if cc.dec.Worker != w1 || cc.dec.Overlap < float64(len(cc.rreq.Hashes)-2) {
		t.Fatalf("the kv candidate picked %s with overlap %v, want w1 holding the prompt", cc.dec.Worker.ID, cc.dec.Overlap)
	}
}

// TestSplitWithoutSessions: without session ids, conversations split by their system
// prompt (past the template's opening every prompt shares), a conversation's later turns
// stay on its arm, and the user field keeps one user's requests together.
func TestSplitWithoutSessions(t *testing.T) {
	s := rolloutCore(t)
	push(t, s, 7, pushed("kv", 64, 8, 0.1), &Candidate{Version: 8, Config: pushed("round-robin", 0, 0, 0), Share: 0.5})
	fraction := func(body []byte) float64 { return prepared(t, s, body, "").splitFraction() }
	below := 0
	groups := map[int]bool{}
	for f := range 40 {
		prefix := "family " + strconv.Itoa(f) + " "
		a, b := fraction(chat8kWith(prefix, "first turn")), fraction(chat8kWith(prefix, "a later turn"))
		if a != b {
			t.Fatalf("family %d: its turns split at %v and %v", f, a, b)
		}
		// A conversation's turns count in one group of its arm's figures too.
		first, later := prepared(t, s, chat8kWith(prefix, "first turn"), ""), prepared(t, s, chat8kWith(prefix, "a later turn"), "")
		if first.armGroupOf() != later.armGroupOf() {
			t.Fatalf("family %d: its turns in groups %d and %d", f, first.armGroupOf(), later.armGroupOf())
		}
		groups[first.armGroupOf()] = true
		if a < 0.5 {
			below++
		}
	}
	if below < 10 || below > 30 {
		t.Fatalf("%d of 40 system prompts below the split at 0.5: the template's opening decides", below)
	}
	if len(groups) < 20 {
		t.Fatalf("40 conversations in %d of %d groups", len(groups), armGroups)
	}
	// Prompts that share their first 600 tokens (one system prompt for the whole fleet)
	// still split by what follows.
	shared := strings.Repeat("every conversation starts with these words ", 100)
	below = 0
	for f := range 40 {
		if fraction(chat8kWith(shared+"family "+strconv.Itoa(f)+" ", "first turn")) < 0.5 {
			below++
		}
	}
	if below < 10 || below > 30 {
		t.Fatalf("%d of 40 conversations behind one shared system prompt below the split at 0.5", below)
	}
	u1 := []byte(`{"model":"gpt-oss-120b","user":"alice","messages":[{"role":"user","content":"one"}]}`)
	u2 := []byte(`{"model":"gpt-oss-120b","user":"alice","messages":[{"role":"user","content":"something else entirely"}]}`)
	if fraction(u1) != fraction(u2) {
		t.Fatal("one user's requests split apart")
	}
}

// TestArmReportCountsEveryFigure: an arm's report carries its answers by kind (errors,
// rejections, 5xx; the routing's failures apart from the clients'), its TTFT and
// inter-token gaps in their buckets, its decisions' regret, and the same figures by
// conversation group.
func TestArmReportCountsEveryFigure(t *testing.T) {
	s := rolloutCore(t)
	a := s.newArmSeries("kv", "5")
	for _, st := range []int{200, 200, 429, 503, 500, 400} {
		a.observe(7, st, endAnswered, 0.03, st == 200, 3, 4)
	}
	a.observe(9, 200, endGone, 0.03, true, 0, 4)   // the client left mid-stream
	a.observe(9, 499, endAnswered, 0, false, 0, 0) // before any answer (ext_proc)
	a.observe(9, 200, endBroken, 0.03, true, 0, 4) // the stream broke: the router's failure
	if r := a.report(); r.Requests != 9 || r.RouterErrors != 4 || r.ClientErrors != 1 || r.ClientGone != 2 || len(r.Groups) != 2 {
		t.Fatalf("requests %d, router errors %d, client errors %d, gone %d, %d groups; want 9, 4, 1, 2, 2",
			r.Requests, r.RouterErrors, r.ClientErrors, r.ClientGone, len(r.Groups))
	} else if g := r.Groups[0]; g.Group != 7 || g.Requests != 6 || g.RouterErrors != 3 || g.ClientErrors != 1 || g.ClientGone != 0 ||
		g.TtftCounts[bucket(armTTFTBounds[:], 0.03)] != 2 || g.CachedBlocks != 18 || g.PromptBlocks != 24 {
		t.Fatalf("group %v", g)
	} else if g := r.Groups[1]; g.Group != 9 || g.Requests != 3 || g.RouterErrors != 1 || g.ClientGone != 2 {
		t.Fatalf("group %v", g)
	}
	a = s.newArmSeries("kv", "5")
	for _, st := range []int{200, 200, 429, 503, 500, 400} {
		a.observe(7, st, endAnswered, 0.03, st == 200, 3, 4)
	}
	itl := armITL{model: s.m.itl.WithLabelValues("m"), arm: a, group: 7}
	for _, gap := range []float64{0.0005, 0.003, 0.003, 5} {
		itl.Observe(gap)
	}
	s.observeRegret(a, &route.Decision{Achievable: 10, Overlap: 4})
	s.observeRegret(a, &route.Decision{Achievable: 2, Overlap: 2})
	r := a.report()
	if r.PolicyVersion != 5 || r.Requests != 6 || r.Errors != 4 || r.Rejections != 2 || r.ServerErrors != 2 ||
		r.TtftCounts[bucket(armTTFTBounds[:], 0.03)] != 2 || r.CachedBlocks != 18 || r.PromptBlocks != 24 {
		t.Fatalf("report %v", r)
	}
	if len(r.ItlCounts) != len(r.ItlBounds)+1 || r.ItlCounts[0] != 1 || r.ItlCounts[2] != 2 || r.ItlCounts[len(r.ItlBounds)] != 1 {
		t.Fatalf("ITL counts %v over %v", r.ItlCounts, r.ItlBounds)
	}
	if len(r.Groups) != 1 || !slices.Equal(r.Groups[0].ItlCounts, r.ItlCounts) {
		t.Fatalf("groups %v: want group 7 with the arm's gaps %v", r.Groups, r.ItlCounts)
	}
	if len(r.HitCounts) != len(r.HitBounds)+1 || r.HitCounts[bucket(armHitBounds[:], 0.75)] != 6 {
		t.Fatalf("hit ratio counts %v", r.HitCounts)
	}
	if r.Decisions != 2 || r.RegretBlocks != 6 {
		t.Fatalf("%d decisions, %d blocks of regret; want 2 and 6", r.Decisions, r.RegretBlocks)
	}
}

// TestShadowOverlapBesideALoadOnlyStable: in shadow beside a stable policy that does not
// match prompts (round-robin), the stable picks' cached blocks come from the candidate's
// match, so they count what the chosen workers hold instead of nothing.
func TestShadowOverlapBesideALoadOnlyStable(t *testing.T) {
	s := rolloutCore(t)
	push(t, s, 3, pushed("round-robin", 0, 0, 0), &Candidate{Version: 4, Config: pushed("kv", 64, 8, 0.1), Shadow: true})
	body := chat8k("q")
	cc := prepared(t, s, body, "")
	s.index.Record(s.kv.Pool().Worker("w1").Index, cc.rreq.Hashes, 0)
	for range 4 { // round-robin picks w1 for two of them
		cc := prepared(t, s, body, "")
		if err := s.kv.Route(&cc.rreq, &cc.dec); err != nil {
			t.Fatal(err)
		}
		cc.shadowPick()
	}
	sums := &s.cand.Load().arm.shadowSums
	blocks := uint64(len(cc.rreq.Hashes))
	if st, ca := sums[shadowStableOverlap].Load(), sums[shadowCandOverlap].Load(); st < blocks || ca < 3*blocks || sums[shadowPicks].Load() != 4 {
		t.Fatalf("shadow overlap sums: stable %d, candidate %d over %d picks; want the stable picks of w1 counted (%d blocks each)", st, ca, sums[shadowPicks].Load(), blocks)
	}
}
