package rollout

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

var bounds = []float64{0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5}

// sample adds n TTFTs drawn around median (log-normal, sigma 0.5) to h.
func sample(rng *rand.Rand, h *Histogram, n int, median float64) {
	if h.Counts == nil {
		h.Bounds, h.Counts = bounds, make([]uint64, len(bounds)+1)
	}
	for range n {
		v := median * math.Exp(0.5*rng.NormFloat64())
		i := 0
		for i < len(bounds) && v > bounds[i] {
			i++
		}
		h.Counts[i]++
	}
}

// fleet is two arms' cumulative figures, fed requests as a simulated fleet would.
type fleet struct {
	rng           *rand.Rand
	stable, cand  Arm
	stableMedian  float64
	candMedian    float64
	candErrorRate float64
	candHitRate   float64
}

func (f *fleet) serve(stableN, candN int) {
	sample(f.rng, &f.stable.TTFT, stableN, f.stableMedian)
	sample(f.rng, &f.cand.TTFT, candN, f.candMedian)
	f.stable.Requests += uint64(stableN)
	f.cand.Requests += uint64(candN)
	f.stable.PromptBlocks += uint64(100 * stableN)
	f.stable.CachedBlocks += uint64(90 * stableN)
	f.cand.PromptBlocks += uint64(100 * candN)
	f.cand.CachedBlocks += uint64(float64(100*candN) * f.candHitRate)
	for range candN {
		if f.rng.Float64() < f.candErrorRate {
			f.cand.Errors++
		}
	}
}

// run drives a rollout on a virtual clock, ten-second ticks, 300 requests a tick split by
// the share it asks for, until it ends or an hour passes; it returns the rollout and the
// shares it asked for along the way.
func run(t *testing.T, spec Spec, f *fleet) (*Rollout, []float64) {
	t.Helper()
	now := time.Unix(1_800_000_000, 0)
	r, err := New(spec, now, f.stable, f.cand)
	if err != nil {
		t.Fatal(err)
	}
	var shares []float64
	for range 360 {
		if r.Done() {
			break
		}
		share, shadow := r.Share()
		if len(shares) == 0 || shares[len(shares)-1] != share {
			shares = append(shares, share)
		}
		c := int(300 * share)
		if shadow {
			c = 0
		}
		f.serve(300-c, c)
		now = now.Add(10 * time.Second)
		r.Advance(now, f.stable, f.cand)
	}
	return r, shares
}

func spec() Spec {
	s := DefaultSpec()
	s.Shadow = 30 * time.Second
	s.StepDuration, s.StepTimeout, s.MinRequests = time.Minute, 3*time.Minute, 100
	return s
}

func TestGoodCandidatePromotes(t *testing.T) {
	f := &fleet{rng: rand.New(rand.NewPCG(1, 2)), stableMedian: 0.2, candMedian: 0.1, candHitRate: 0.9}
	r, shares := run(t, spec(), f)
	if r.State != StatePromoted {
		t.Fatalf("state %s, results %+v", r.State, r.Results)
	}
	want := []float64{0, 0.05, 0.25, 0.5} // the step of 1 is the promotion
	if len(shares) != len(want) {
		t.Fatalf("shares asked %v, want %v", shares, want)
	}
	for i := range want {
		if shares[i] != want[i] {
			t.Fatalf("shares asked %v, want %v", shares, want)
		}
	}
	if len(r.Results) != 4 || r.Results[0].Step != -1 {
		t.Fatalf("results %+v", r.Results)
	}
	if s, sh := r.Share(); s != 1 || sh {
		t.Fatalf("promoted share %v shadow %v", s, sh)
	}
}

func TestBadCandidateRollsBack(t *testing.T) {
	for _, c := range []struct {
		name string
		f    fleet
		why  string
	}{
		{"slower", fleet{stableMedian: 0.1, candMedian: 0.3, candHitRate: 0.9}, "TTFT p90"},
		{"a quarter slower", fleet{stableMedian: 0.1, candMedian: 0.125, candHitRate: 0.9}, "TTFT p90"},
		{"failing", fleet{stableMedian: 0.1, candMedian: 0.1, candHitRate: 0.9, candErrorRate: 0.05}, "error rate"},
		{"missing the cache", fleet{stableMedian: 0.1, candMedian: 0.1, candHitRate: 0.5}, "hit rate"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := c.f
			f.rng = rand.New(rand.NewPCG(3, 4))
			r, _ := run(t, spec(), &f)
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

// TestNeutralCandidateIsNotRolledBack: the same distribution on both arms passes every
// step in 50 seeded rollouts: no false rollback.
func TestNeutralCandidateIsNotRolledBack(t *testing.T) {
	for seed := range uint64(50) {
		f := &fleet{rng: rand.New(rand.NewPCG(seed, 7)), stableMedian: 0.15, candMedian: 0.15, candHitRate: 0.9}
		r, _ := run(t, spec(), f)
		if r.State != StatePromoted {
			t.Fatalf("seed %d: a neutral candidate ended %s: %+v", seed, r.State, r.Results[len(r.Results)-1])
		}
	}
}

// TestInconclusiveStepTimesOut: too few requests keep a step waiting, then roll it back at
// the step timeout, saying why.
func TestInconclusiveStepTimesOut(t *testing.T) {
	s := spec()
	s.Shadow, s.MinRequests = 0, 1_000_000
	f := &fleet{rng: rand.New(rand.NewPCG(5, 6)), stableMedian: 0.1, candMedian: 0.1, candHitRate: 0.9}
	now := time.Unix(1_800_000_000, 0)
	r, err := New(s, now, f.stable, f.cand)
	if err != nil {
		t.Fatal(err)
	}
	for elapsed := 10 * time.Second; elapsed < s.StepTimeout; elapsed += 10 * time.Second {
		f.serve(100, 5)
		if r.Advance(now.Add(elapsed), f.stable, f.cand) {
			t.Fatalf("an inconclusive step moved at %v: %s", elapsed, r.State)
		}
	}
	if !r.Advance(now.Add(s.StepTimeout), f.stable, f.cand) || r.State != StateRolledBack || !strings.Contains(r.Results[0].Reason, "timed out inconclusive") {
		t.Fatalf("at the timeout: %s %+v", r.State, r.Results)
	}
}

// TestManualCommands: pause holds a step (and moves its clock by the time paused), resume
// continues, promote and abort end a rollout, and nothing moves a finished one.
func TestManualCommands(t *testing.T) {
	s := spec()
	s.Shadow = 0
	f := &fleet{rng: rand.New(rand.NewPCG(8, 9)), stableMedian: 0.1, candMedian: 0.1, candHitRate: 0.9}
	t0 := time.Unix(1_800_000_000, 0)
	r, _ := New(s, t0, f.stable, f.cand)
	f.serve(2000, 200)
	if err := r.Pause(t0.Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if sh, _ := r.Share(); sh != 0.05 || r.Advance(t0.Add(10*time.Minute), f.stable, f.cand) {
		t.Fatalf("paused: share %v, state %s", sh, r.State)
	}
	if err := r.Resume(t0.Add(10 * time.Minute)); err != nil {
		t.Fatal(err)
	}
	// 30 s ran before the pause: the step needs 30 s more, not 0.
	if r.Advance(t0.Add(10*time.Minute+20*time.Second), f.stable, f.cand) {
		t.Fatal("the step ended before its time, counting the pause")
	}
	if !r.Advance(t0.Add(10*time.Minute+30*time.Second), f.stable, f.cand) || r.Step != 1 {
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
		func(s *Spec) { s.Alpha = 0 },
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

// TestSlowerAndQuantile: the rank test finds a real shift and not noise; the quantile
// interpolates within buckets.
func TestSlowerAndQuantile(t *testing.T) {
	rng := rand.New(rand.NewPCG(10, 11))
	var a, b, c Histogram
	sample(rng, &a, 400, 0.1)
	sample(rng, &b, 400, 0.1)
	sample(rng, &c, 400, 0.13)
	if Slower(a, b, 0.05) {
		t.Error("two samples of one distribution: slower")
	}
	if !Slower(a, c, 0.05) || Slower(c, a, 0.05) {
		t.Error("a 30% shift is not found, or found the wrong way")
	}
	h := Histogram{Bounds: []float64{1, 2}, Counts: []uint64{0, 10, 0}}
	if q := h.Quantile(0.5); math.Abs(q-1.5) > 1e-9 {
		t.Errorf("median of 10 in (1, 2] = %v", q)
	}
	if !math.IsNaN((Histogram{Bounds: []float64{1}, Counts: []uint64{0, 0}}).Quantile(0.9)) {
		t.Error("an empty histogram has a quantile")
	}
}

// TestFalseRollbackRate measures, over 500 seeded neutral rollouts (3 judged steps each),
// how often noise rolls one back; with the defaults it must stay under 1 %.
func TestFalseRollbackRate(t *testing.T) {
	if testing.Short() {
		t.Skip("500 rollouts")
	}
	rollbacks := 0
	for seed := range uint64(500) {
		f := &fleet{rng: rand.New(rand.NewPCG(seed, 99)), stableMedian: 0.15, candMedian: 0.15, candHitRate: 0.9}
		if r, _ := run(t, spec(), f); r.State != StatePromoted {
			rollbacks++
		}
	}
	t.Logf("false rollbacks: %d of 500 neutral rollouts", rollbacks)
	if rollbacks > 5 {
		t.Fatalf("%d of 500 neutral rollouts rolled back", rollbacks)
	}
}

// TestPersistedRolloutResumes: a rollout written out as JSON mid-step, paused, and read
// back goes on exactly as the one kept in memory (the control plane's store after a
// restart).
func TestPersistedRolloutResumes(t *testing.T) {
	spec := DefaultSpec()
	spec.Shadow = time.Minute
	f := &fleet{rng: rand.New(rand.NewPCG(7, 7)), stableMedian: 0.2, candMedian: 0.2, candHitRate: 0.9}
	now := time.Unix(1_800_000_000, 0)
	a, err := New(spec, now, f.stable, f.cand)
	if err != nil {
		t.Fatal(err)
	}
	f.serve(300, 0)
	now = now.Add(2 * time.Minute)
	a.Advance(now, f.stable, f.cand) // the shadow step ends: canary at 5 %
	f.serve(285, 15)
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
	for i := range 40 {
		f.serve(270, 30)
		now = now.Add(10 * time.Second)
		ca, cb := a.Advance(now, f.stable, f.cand), b.Advance(now, f.stable, f.cand)
		if ca != cb || a.State != b.State || a.Step != b.Step || !a.StepStart.Equal(b.StepStart) || len(a.Results) != len(b.Results) {
			t.Fatalf("tick %d: in memory %s step %d (%v), persisted %s step %d (%v)", i, a.State, a.Step, ca, b.State, b.Step, cb)
		}
	}
	if a.Results[0].Step != -1 || len(a.Results) < 2 {
		t.Fatalf("results %+v", a.Results)
	}
}

// TestHitRateDropNeedsTheRankTest: a block-weighted hit rate that falls by more than the
// threshold only because the candidate drew longer prompts passes when the requests' hit
// ratios are alike; a candidate whose requests hit less fails.
func TestHitRateDropNeedsTheRankTest(t *testing.T) {
	hb := []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99}
	hits := func(low, high uint64) Histogram {
		c := make([]uint64, len(hb)+1)
		c[2], c[10] = low, high // ratios in (0.1, 0.2] and (0.9, 0.99]
		return Histogram{Bounds: hb, Counts: c}
	}
	ttft := Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}
	ttft.Counts[3] = 1000
	stable := Arm{Requests: 1000, TTFT: ttft, PromptBlocks: 100000, CachedBlocks: 55000, Hits: hits(500, 500)}
	spec := DefaultSpec()
	r := &Rollout{Spec: spec}
	// Same per-request ratios, the low-hit half of the candidate's prompts longer: 52%.
	alike := Arm{Requests: 1000, TTFT: ttft, PromptBlocks: 100000, CachedBlocks: 52000, Hits: hits(500, 500)}
	if res := r.judge(stable, alike); res.Verdict != Pass {
		t.Fatalf("alike requests: %s (%s)", res.Verdict, res.Reason)
	}
	worse := Arm{Requests: 1000, TTFT: ttft, PromptBlocks: 100000, CachedBlocks: 40000, Hits: hits(650, 350)}
	if res := r.judge(stable, worse); res.Verdict != Fail || !strings.Contains(res.Reason, "rank test") {
		t.Fatalf("fewer hits: %s (%s)", res.Verdict, res.Reason)
	}
	// Without ratios (an older proxy) the threshold alone decides.
	alike.Hits, stable.Hits = Histogram{}, Histogram{}
	if res := r.judge(stable, alike); res.Verdict != Fail {
		t.Fatalf("without ratios: %s (%s)", res.Verdict, res.Reason)
	}
}

// TestCloneSharesNothing: a clone's steps, results and step bases are its own.
func TestCloneSharesNothing(t *testing.T) {
	h := Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}
	r := &Rollout{Spec: Spec{Steps: []float64{0.5, 1}}, BaseStable: Arm{TTFT: h}, BaseCandidate: Arm{TTFT: Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}}, Results: []Result{{Step: 0}}}
	c := r.Clone()
	c.Spec.Steps[0], c.Results[0].Step, c.BaseStable.TTFT.Counts[0], c.BaseCandidate.TTFT.Counts[0] = 0.25, 7, 9, 9
	if r.Spec.Steps[0] != 0.5 || r.Results[0].Step != 0 || r.BaseStable.TTFT.Counts[0] != 0 || r.BaseCandidate.TTFT.Counts[0] != 0 {
		t.Fatalf("the clone's changes reached the original: %+v", r)
	}
}
