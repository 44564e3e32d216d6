package rollout

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"
)

// spec is the defaults with a 30 s shadow step.
func spec() Spec {
	s := DefaultSpec()
	s.Shadow = 30 * time.Second
	return s
}

func TestGoodCandidatePromotes(t *testing.T) {
	tr := defaultTraffic(10)
	tr.cand = effect{ttft: 0.7}
	res := simulate(spec(), newFleet(1, tr), 0, time.Hour)
	r := res.r
	if r.State != StatePromoted {
		t.Fatalf("state %s, results %+v", r.State, r.Results)
	}
	want := []float64{0, 0.05, 0.25, 0.5} // the step of 1 is the promotion
	if len(res.shares) != len(want) {
		t.Fatalf("shares asked %v, want %v", res.shares, want)
	}
	for i := range want {
		if res.shares[i] != want[i] {
			t.Fatalf("shares asked %v, want %v", res.shares, want)
		}
	}
	if len(r.Results) != 4 || r.Results[0].Step != -1 || len(r.Results[1].Checks) == 0 {
		t.Fatalf("results %+v", r.Results)
	}
	if s, sh := r.Share(); s != 1 || sh {
		t.Fatalf("promoted share %v shadow %v", s, sh)
	}
}

func TestBadCandidateRollsBack(t *testing.T) {
	for _, c := range []struct {
		name string
		e    effect
		why  string
	}{
		{"twice as slow", effect{ttft: 2}, "TTFT p"},
		{"a quarter slower", effect{ttft: 1.25}, "TTFT p"},
		{"failing", effect{errorRate: 0.05}, "router error"},
		{"missing the cache", effect{hitRate: 0.7}, "prefix hit rate"},
	} {
		t.Run(c.name, func(t *testing.T) {
			tr := defaultTraffic(10)
			tr.cand = c.e
			r := simulate(spec(), newFleet(3, tr), 0, time.Hour).r
			last := r.Results[len(r.Results)-1]
			if r.State != StateRolledBack || last.Verdict != Fail || !strings.Contains(last.Reason, c.why) {
				t.Fatalf("state %s, last result %+v", r.State, last)
			}
			if s, sh := r.Share(); s != 0 || sh {
				t.Fatalf("rolled back, share %v shadow %v", s, sh)
			}
		})
	}
}

// TestClientErrorsAreNotTheRouters: a candidate whose clients err and leave more often (a
// share of users moved onto it by the split) is not rolled back for it; the figures show it.
func TestClientErrorsAreNotTheRouters(t *testing.T) {
	tr := defaultTraffic(10)
	tr.clientError, tr.clientGone = 0.03, 0.03
	r := simulate(spec(), newFleet(5, tr), 0, time.Hour).r
	if r.State != StatePromoted {
		t.Fatalf("state %s: %+v", r.State, r.Results[len(r.Results)-1])
	}
	if res := r.Results[1]; res.CandidateClientErrorRate == 0 || res.StableClientGoneRate == 0 || res.StableErrorRate <= res.StableRouterErrorRate {
		t.Fatalf("client errors and departures not shown apart: %+v", res)
	}
}

// TestInconclusiveStepPausesOrRollsBack: too few conversations keep a step waiting; at the
// step timeout it pauses by default (resume runs it again afresh), rolls back when asked,
// and runs again first as many times as the inconclusive limit allows.
func TestInconclusiveStepPausesOrRollsBack(t *testing.T) {
	s := DefaultSpec()
	s.MinGroups = 60 // more conversation groups than a 5 % share gets in ten minutes
	run := func(s Spec) *Rollout {
		return simulate(s, newFleet(5, defaultTraffic(10)), 0, time.Hour).r
	}
	r := run(s)
	last := r.Results[len(r.Results)-1]
	if r.State != StatePaused || last.Verdict != Inconclusive || !strings.Contains(last.Reason, "paused for an operator") ||
		!last.End.Equal(last.Start.Add(s.StepTimeout)) {
		t.Fatalf("default: state %s, %+v", r.State, last)
	}
	if sh, _ := r.Share(); sh != 0.05 {
		t.Fatalf("paused at share %v", sh)
	}
	// Resume: the step runs again from the next figures, its clock restarted.
	at := last.End.Add(time.Minute)
	if err := r.Resume(at); err != nil {
		t.Fatal(err)
	}
	if !r.Advance(at.Add(time.Second), r.BaseStable, r.BaseCandidate) || !r.StepStart.Equal(at.Add(time.Second)) || r.State != StateCanary {
		t.Fatalf("resumed: step start %v, state %s", r.StepStart, r.State)
	}

	s.OnInconclusive = OnInconclusiveRollback
	if r := run(s); r.State != StateRolledBack || !strings.Contains(r.Results[len(r.Results)-1].Reason, "timed out inconclusive") {
		t.Fatalf("rollback on inconclusive: %s %+v", r.State, r.Results)
	}
	s.InconclusiveLimit = 2
	r = run(s)
	if r.State != StateRolledBack || len(r.Results) != 3 || !strings.Contains(r.Results[0].Reason, "running the step again (1 of 2") {
		t.Fatalf("inconclusive limit 2: %s, %d results: %+v", r.State, len(r.Results), r.Results)
	}
}

// TestFailureLimitRunsAFailedStepAgain: a failure within the limit runs the step again
// from fresh figures; past it, the rollout rolls back.
func TestFailureLimitRunsAFailedStepAgain(t *testing.T) {
	tr := defaultTraffic(10)
	tr.cand = effect{ttft: 2}
	s := DefaultSpec()
	s.FailureLimit = 1
	r := simulate(s, newFleet(7, tr), 0, time.Hour).r
	if r.State != StateRolledBack || len(r.Results) != 2 || r.Results[0].Step != r.Results[1].Step ||
		!strings.Contains(r.Results[0].Reason, "failure 1 of 1 allowed") {
		t.Fatalf("state %s, results %+v", r.State, r.Results)
	}
}

// TestShadowIsJudged: a candidate whose shadow picks cache far less than the stable
// policy's fails in shadow, and, where asked (MaxShadowLoadRatio), one whose picks land on
// busier workers; one that agrees passes.
func TestShadowIsJudged(t *testing.T) {
	s := spec()
	s.MaxShadowLoadRatio = 2
	for _, c := range []struct {
		name string
		sh   Shadow
		want string
	}{
		{"agrees", Shadow{Picks: 500, Disagreements: 100, StableOverlapBlocks: 50000, CandOverlapBlocks: 48000, StableLoad: 1000, CandLoad: 1100}, Pass},
		{"misses the cache", Shadow{Picks: 500, Disagreements: 400, StableOverlapBlocks: 50000, CandOverlapBlocks: 20000, StableLoad: 1000, CandLoad: 1000}, Fail},
		{"herds", Shadow{Picks: 500, Disagreements: 400, StableOverlapBlocks: 50000, CandOverlapBlocks: 50000, StableLoad: 1000, CandLoad: 3000}, Fail},
		{"too few picks", Shadow{Picks: 10, StableOverlapBlocks: 100, CandOverlapBlocks: 0}, Pass},
	} {
		t0 := time.Unix(1_800_000_000, 0)
		r, _ := New(s, t0, Arm{}, Arm{})
		r.Advance(t0.Add(s.Shadow), Arm{Requests: 1000}, Arm{Shadow: c.sh})
		if got := r.Results[0]; got.Verdict != c.want {
			t.Errorf("%s: %s (%s)", c.name, got.Verdict, got.Reason)
		}
	}
}

// TestManualCommands: pause holds a step (and moves its clock by the time paused), resume
// continues, promote and abort end a rollout, and nothing moves a finished one.
func TestManualCommands(t *testing.T) {
	s := DefaultSpec()
	f := newFleet(8, defaultTraffic(20))
	t0 := time.Unix(1_800_000_000, 0)
	r, _ := New(s, t0, f.stable.clone(), f.cand.clone())
	f.run(30, 0.05)
	if err := r.Pause(t0.Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	f.run(600, 0.05)
	if sh, _ := r.Share(); sh != 0.05 || r.Advance(t0.Add(10*time.Minute), f.stable, f.cand) {
		t.Fatalf("paused: share %v, state %s", sh, r.State)
	}
	if err := r.Resume(t0.Add(10 * time.Minute)); err != nil {
		t.Fatal(err)
	}
	// 30 s ran before the pause: the step needs 90 s more, not 0.
	if r.Advance(t0.Add(10*time.Minute+80*time.Second), f.stable, f.cand) {
		t.Fatal("the step ended before its time, counting the pause")
	}
	if !r.Advance(t0.Add(10*time.Minute+90*time.Second), f.stable, f.cand) || r.Step != 1 {
		t.Fatalf("after its time: step %d, %+v", r.Step, r.Results)
	}
	if err := r.Promote(); err != nil || r.State != StatePromoted {
		t.Fatal(err)
	}
	if r.Abort() == nil || r.Pause(t0) == nil || r.Advance(t0.Add(time.Hour), f.stable, f.cand) {
		t.Fatal("a finished rollout took a command")
	}
	r2, _ := New(s, t0, Arm{}, Arm{})
	if err := r2.Abort(); err != nil || r2.State != StateAborted {
		t.Fatal(err)
	}
	if sh, shadow := r2.Share(); sh != 0 || shadow {
		t.Fatal("an aborted rollout still routes some traffic to the candidate")
	}
}

func TestSpecValidate(t *testing.T) {
	for _, bad := range []func(*Spec){
		func(s *Spec) { s.Steps = nil },
		func(s *Spec) { s.Steps = []float64{0.5, 0.25} },
		func(s *Spec) { s.Steps = []float64{0, 1} },
		func(s *Spec) { s.StepTimeout = s.StepDuration / 2 },
		func(s *Spec) { s.MaxTTFTP90Ratio = 0.9 },
		func(s *Spec) { s.MaxTTFTP50Ratio = 0.5 },
		func(s *Spec) { s.Alpha = 0 },
		func(s *Spec) { s.MinGroups = 1 },
		func(s *Spec) { s.FailureLimit = -1 },
		func(s *Spec) { s.OnInconclusive = "promote" },
		func(s *Spec) { s.FastAbortErrors = 0 },
		func(s *Spec) { s.MaxShadowOverlapDrop = 2 },
		func(s *Spec) { s.MaxBaselineTTFTP90Ratio = 0.5 },
	} {
		s := DefaultSpec()
		bad(&s)
		if s.Validate() == nil {
			t.Errorf("%+v accepted", s)
		}
	}
	if err := DefaultSpec().Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestQuantileAndDistributions: the histogram quantile interpolates within buckets; the
// t quantiles and binomial tails the analysis uses match their tables.
func TestQuantileAndDistributions(t *testing.T) {
	h := Histogram{Bounds: []float64{1, 2}, Counts: []uint64{0, 10, 0}}
	if q := h.Quantile(0.5); math.Abs(q-1.5) > 1e-9 {
		t.Errorf("median of 10 in (1, 2] = %v", q)
	}
	if !math.IsNaN((Histogram{Bounds: []float64{1}, Counts: []uint64{0, 0}}).Quantile(0.9)) {
		t.Error("an empty histogram has a quantile")
	}
	for _, c := range []struct{ p, df, want float64 }{
		{0.975, 1, 12.706}, {0.999, 3, 10.215}, {0.999, 10, 4.144}, {0.999, 60, 3.232}, {0.95, 1e6, 1.645},
	} {
		if got := studentTQuantile(c.p, c.df); math.Abs(got-c.want) > 2e-3*c.want {
			t.Errorf("t(%v, %v) = %.4f, want %.3f", c.p, c.df, got, c.want)
		}
	}
	// P(X ≥ k) for n = 20, p = 0.1, summed term by term.
	for k := uint64(0); k <= 20; k++ {
		want := 0.0
		for j := k; j <= 20; j++ {
			lc, _ := math.Lgamma(21)
			lj, _ := math.Lgamma(float64(j) + 1)
			ln, _ := math.Lgamma(float64(21 - j))
			want += math.Exp(lc - lj - ln + float64(j)*math.Log(0.1) + float64(20-j)*math.Log(0.9))
		}
		if got := binomialTail(k, 20, 0.1); math.Abs(got-want) > 1e-9+1e-6*want {
			t.Errorf("P(X ≥ %d) = %v, want %v", k, got, want)
		}
	}
}

// TestPersistedRolloutResumes: a rollout written out as JSON mid-step, paused, and read
// back goes on exactly as the one kept in memory (the control plane's store after a
// restart).
func TestPersistedRolloutResumes(t *testing.T) {
	spec := DefaultSpec()
	spec.Shadow = time.Minute
	f := newFleet(7, defaultTraffic(20))
	now := time.Unix(1_800_000_000, 0)
	a, err := New(spec, now, f.stable.clone(), f.cand.clone())
	if err != nil {
		t.Fatal(err)
	}
	f.run(120, 0)
	now = now.Add(2 * time.Minute)
	a.Advance(now, f.stable, f.cand) // the shadow step ends: canary at 5 %
	f.run(150, 0.05)
	if err := a.Pause(now.Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	var b Rollout
	if err := json.Unmarshal(data, &b); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*Rollout{a, &b} {
		if err := r.Resume(now.Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 600 {
		share, _ := a.Share()
		f.run(150+float64(i+1), share)
		now = now.Add(time.Second)
		ca, cb := a.Advance(now, f.stable, f.cand), b.Advance(now, f.stable, f.cand)
		if ca != cb || a.State != b.State || a.Step != b.Step || !a.StepStart.Equal(b.StepStart) || len(a.Results) != len(b.Results) {
			t.Fatalf("tick %d: in memory %s step %d (%v), persisted %s step %d (%v)", i, a.State, a.Step, ca, b.State, b.Step, cb)
		}
	}
	if a.Results[0].Step != -1 || len(a.Results) < 2 {
		t.Fatalf("results %+v", a.Results)
	}
	for i := range a.Results {
		if ja, jb := mustJSON(t, a.Results[i]), mustJSON(t, b.Results[i]); ja != jb {
			t.Fatalf("result %d: in memory %s, persisted %s", i, ja, jb)
		}
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestCloneSharesNothing: a clone's steps, results, checks, step bases and groups are its own.
func TestCloneSharesNothing(t *testing.T) {
	h := Histogram{Bounds: ttftBounds, Counts: make([]uint64, len(ttftBounds)+1)}
	g := []Group{{ID: 3, Requests: 1, TTFT: make([]uint64, 3)}}
	r := &Rollout{Spec: Spec{Steps: []float64{0.5, 1}}, BaseStable: Arm{TTFT: h, Groups: g},
		BaseCandidate: Arm{TTFT: Histogram{Bounds: ttftBounds, Counts: make([]uint64, len(ttftBounds)+1)}},
		Results:       []Result{{Step: 0, Checks: []Check{{Metric: "TTFT p90"}}}}}
	c := r.Clone()
	c.Spec.Steps[0], c.Results[0].Step, c.BaseStable.TTFT.Counts[0], c.BaseCandidate.TTFT.Counts[0] = 0.25, 7, 9, 9
	c.Results[0].Checks[0].Metric, c.BaseStable.Groups[0].TTFT[0], c.BaseStable.Groups[0].Requests = "x", 5, 5
	if r.Spec.Steps[0] != 0.5 || r.Results[0].Step != 0 || r.BaseStable.TTFT.Counts[0] != 0 || r.BaseCandidate.TTFT.Counts[0] != 0 ||
		r.Results[0].Checks[0].Metric != "TTFT p90" || g[0].TTFT[0] != 0 || g[0].Requests != 1 {
		t.Fatalf("the clone's changes reached the original: %+v", r)
	}
}

// TestSubGroups: a step's groups are the later figures less the earlier, group by group; a
// group new since has all its figures, one without requests since is left out.
func TestSubGroups(t *testing.T) {
	later := []Group{{ID: 1, Requests: 5, RouterErrors: 1, TTFT: []uint64{3, 2}}, {ID: 2, Requests: 4, TTFT: []uint64{4, 0}}, {ID: 7, Requests: 2, TTFT: []uint64{1, 1}}}
	earlier := []Group{{ID: 1, Requests: 2, TTFT: []uint64{1, 1}}, {ID: 2, Requests: 4, TTFT: []uint64{4, 0}}}
	got := subGroups(later, earlier)
	if len(got) != 2 || got[0].ID != 1 || got[0].Requests != 3 || got[0].RouterErrors != 1 || got[0].TTFT[0] != 2 || got[0].TTFT[1] != 1 ||
		got[1].ID != 7 || got[1].Requests != 2 {
		t.Fatalf("%+v", got)
	}
}
