package proxy

import (
	"context"
	"io"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// rolloutServer is a proxy fed only by applyXDS, with two workers.
func rolloutServer(t *testing.T) (*Server, []*xdsv1.Worker) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.XDS = "127.0.0.1:1" // nothing answers: only applyXDS feeds the proxy
	cfg.XDSSyncTimeout = 0
	s, err := New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.setupXDS(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stopXDS)
	return s, []*xdsv1.Worker{
		{Id: "w0", Url: "http://127.0.0.1:20000", Model: "gpt-oss-120b", Healthy: true},
		{Id: "w1", Url: "http://127.0.0.1:20001", Model: "gpt-oss-120b", Healthy: true, Slot: 1},
	}
}

// preparedConn is a connection whose chat body (with session, "" for none) has been parsed
// and turned into routing input, as the request path does before it routes.
func preparedConn(t *testing.T, s *Server, body []byte, session string) *clientConn {
	t.Helper()
	cc := &clientConn{input: input{srv: s, kind: oai.ChatCompletions}, lp: newLoop(s, nil)}
	cc.body = body
	if session != "" {
		cc.session = []byte(session)
	}
	if err := cc.parser.Parse(cc.body, oai.ChatCompletions, &cc.oreq); err != nil {
		t.Fatal(err)
	}
	if err := cc.prepare(); err != nil {
		t.Fatal(err)
	}
	return cc
}

// armOf routes a chat of session id and returns the policy version that routed it.
func armOf(t *testing.T, s *Server, session string) string {
	t.Helper()
	cc := preparedConn(t, s, chat8k("q "+session), session)
	router, cand := cc.armFor(s.kv, cc.body)
	cc.arm = s.stableArm.Load()
	if cand != nil {
		cc.arm = cand.arm
	}
	if err := router.Route(&cc.rreq, &cc.dec); err != nil {
		t.Fatal(err)
	}
	if cand == nil {
		cc.shadowPick(&cc.lp.shadowReq, &cc.dec)
	}
	return cc.arm.version
}

// TestCandidateTakesItsShare: a pushed candidate routes its share of the sessions, each
// session always with the same policy and alike on every proxy; a changed share applies at
// once, and a removed candidate sends everything back to stable.
func TestCandidateTakesItsShare(t *testing.T) {
	s, ws := rolloutServer(t)
	other, _ := rolloutServer(t)
	stable := &xdsv1.RoutingPolicy{Version: 7, Policy: "kv", OverlapWeight: 64, QueueWeight: 8, CacheThreshold: 0.1}
	with := func(share float64, shadow bool) *xdsv1.RoutingPolicy {
		p := &xdsv1.RoutingPolicy{Version: 7, Policy: "kv", OverlapWeight: 64, QueueWeight: 8, CacheThreshold: 0.1,
			Candidate:      &xdsv1.RoutingPolicy{Version: 8, Policy: "round-robin"},
			CandidateShare: share, Shadow: shadow}
		return p
	}
	count := func(s *Server) (cand int, arms []string) {
		for i := range 400 {
			a := armOf(t, s, "session-"+strconv.Itoa(i))
			arms = append(arms, a)
			if a == "8" {
				cand++
			}
		}
		return cand, arms
	}
	s.applyXDS(ws, stable)
	if n, _ := count(s); n != 0 {
		t.Fatalf("%d requests routed by a candidate before there was one", n)
	}
	for _, share := range []float64{0.25, 0.5} {
		s.applyXDS(ws, with(share, false))
		other.applyXDS(ws, with(share, false))
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
	s.applyXDS(ws, with(0.5, true))
	if n, _ := count(s); n != 0 {
		t.Fatalf("in shadow %d requests were routed by the candidate", n)
	}
	agree := testutil.ToFloat64(s.metrics.shadow.WithLabelValues("agree"))
	disagree := testutil.ToFloat64(s.metrics.shadow.WithLabelValues("disagree"))
	if agree+disagree != 400 || disagree == 0 {
		t.Fatalf("shadow decisions: %v agree, %v disagree; want 400 in all, some apart (round-robin against kv)", agree, disagree)
	}
	// The load report carries the same counts for the control plane's analysis.
	var rep *xdsv1.ArmReport
	for _, a := range s.armReports() {
		if a.GetPolicyVersion() == 8 {
			rep = a
		}
	}
	if rep.GetShadowPicks() != 400 || float64(rep.GetShadowDisagreements()) != disagree {
		t.Fatalf("reported shadow picks %d, disagreements %d; want 400 and %v", rep.GetShadowPicks(), rep.GetShadowDisagreements(), disagree)
	}
	s.applyXDS(ws, stable)
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
	s, ws := rolloutServer(t)
	s.applyXDS(ws, &xdsv1.RoutingPolicy{Version: 3, Policy: "round-robin",
		Candidate: &xdsv1.RoutingPolicy{Version: 4, Policy: "kv", OverlapWeight: 64, QueueWeight: 8, CacheThreshold: 0.1}, CandidateShare: 1})
	cc := preparedConn(t, s, chat8k("q"), "")
	if len(cc.rreq.Hashes) < 400 {
		t.Fatalf("%d prompt blocks hashed for the kv candidate", len(cc.rreq.Hashes))
	}
	w1 := s.kv.Pool().Worker("w1")
	s.index.Record(w1.Index, cc.rreq.Hashes, 0)
	router, cand := cc.armFor(s.kv, cc.body)
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
	s, ws := rolloutServer(t)
	s.applyXDS(ws, &xdsv1.RoutingPolicy{Version: 7, Policy: "kv", OverlapWeight: 64, QueueWeight: 8, CacheThreshold: 0.1,
		Candidate: &xdsv1.RoutingPolicy{Version: 8, Policy: "round-robin"}, CandidateShare: 0.5})
	fraction := func(body []byte) float64 { return preparedConn(t, s, body, "").splitFraction(body) }
	below := 0
	for f := range 40 {
		prefix := "family " + strconv.Itoa(f) + " "
		a, b := fraction(chat8kWith(prefix, "first turn")), fraction(chat8kWith(prefix, "a later turn"))
		if a != b {
			t.Fatalf("family %d: its turns split at %v and %v", f, a, b)
		}
		if a < 0.5 {
			below++
		}
	}
	if below < 10 || below > 30 {
		t.Fatalf("%d of 40 system prompts below the split at 0.5: the template's opening decides", below)
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
// rejections, 5xx), its TTFT and inter-token gaps in their buckets, and its decisions'
// regret.
func TestArmReportCountsEveryFigure(t *testing.T) {
	s, _ := rolloutServer(t)
	a := s.newArmSeries("kv", "5")
	for _, st := range []int{200, 200, 429, 503, 500, 400} {
		a.observe(st, 0.03, st == 200, 3, 4)
	}
	itl := armITL{model: s.metrics.itl.WithLabelValues("m"), arm: a}
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
	if len(r.HitCounts) != len(r.HitBounds)+1 || r.HitCounts[bucket(armHitBounds[:], 0.75)] != 6 {
		t.Fatalf("hit ratio counts %v", r.HitCounts)
	}
	if r.Decisions != 2 || r.RegretBlocks != 6 {
		t.Fatalf("%d decisions, %d blocks of regret; want 2 and 6", r.Decisions, r.RegretBlocks)
	}
}

// TestProxyRefusesProfilesItCannotBuild: a pushed profile, or a candidate's, naming a
// plugin this proxy's registry lacks is refused (the xDS client NACKs it); one it can build
// passes and routes.
func TestProxyRefusesProfilesItCannotBuild(t *testing.T) {
	s, ws := rolloutServer(t)
	good := &xdsv1.Profile{Scorers: []*xdsv1.Plugin{{Name: "load", Weight: 1}}, Picker: &xdsv1.Plugin{Name: "min-cost"}}
	bad := &xdsv1.Profile{Scorers: []*xdsv1.Plugin{{Name: "gpu-temperature", Weight: 1}}, Picker: &xdsv1.Plugin{Name: "min-cost"}}
	if err := s.checkPolicy(&xdsv1.RoutingPolicy{Version: 2, Policy: "custom", Profile: bad}); err == nil || !strings.Contains(err.Error(), "gpu-temperature") {
		t.Fatalf("an unknown scorer: %v", err)
	}
	if err := s.checkPolicy(&xdsv1.RoutingPolicy{Version: 2, Policy: "kv", Candidate: &xdsv1.RoutingPolicy{Version: 3, Policy: "custom", Profile: bad}}); err == nil {
		t.Fatal("a candidate with an unknown scorer passed")
	}
	p := &xdsv1.RoutingPolicy{Version: 2, Policy: "custom", Profile: good}
	if err := s.checkPolicy(p); err != nil {
		t.Fatal(err)
	}
	s.applyXDS(ws, p)
	if pol := s.RoutingPolicy(); pol.Name != "custom" || pol.Scorers[0].Name() != "load" {
		t.Fatalf("routing with %+v", pol)
	}
}

// TestShadowOverlapBesideALoadOnlyStable: in shadow beside a stable policy that does not
// match prompts (round-robin), the stable picks' cached blocks come from the candidate's
// match, so they count what the chosen workers hold instead of nothing.
func TestShadowOverlapBesideALoadOnlyStable(t *testing.T) {
	s, ws := rolloutServer(t)
	s.applyXDS(ws, &xdsv1.RoutingPolicy{Version: 3, Policy: "round-robin",
		Candidate: &xdsv1.RoutingPolicy{Version: 4, Policy: "kv", OverlapWeight: 64, QueueWeight: 8, CacheThreshold: 0.1}, Shadow: true})
	body := chat8k("q")
	cc := preparedConn(t, s, body, "")
	s.index.Record(s.kv.Pool().Worker("w1").Index, cc.rreq.Hashes, 0)
	for range 4 { // round-robin picks w1 for two of them
		cc := preparedConn(t, s, body, "")
		if err := s.kv.Route(&cc.rreq, &cc.dec); err != nil {
			t.Fatal(err)
		}
		cc.shadowPick(&cc.lp.shadowReq, &cc.dec)
	}
	sums := &s.cand.Load().arm.shadowSums
	blocks := uint64(len(cc.rreq.Hashes))
	if st, ca := sums[shadowStableOverlap].Load(), sums[shadowCandOverlap].Load(); st < blocks || ca < 3*blocks || sums[shadowPicks].Load() != 4 {
		t.Fatalf("shadow overlap sums: stable %d, candidate %d over %d picks; want the stable picks of w1 counted (%d blocks each)", st, ca, sums[shadowPicks].Load(), blocks)
	}
}
