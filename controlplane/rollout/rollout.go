// Package rollout is the state machine of a routing policy rollout: a candidate policy
// tried in shadow, then on growing shares of the traffic, each step judged against the
// stable policy over the same interval, promoted when every step passes and rolled back at
// once when one fails, as Argo Rollouts, Flagger and Kayenta do for deployments. It knows
// nothing of proxies or storage: the control plane feeds it each arm's figures and the
// time, and applies the share it asks for.
package rollout

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// States of a rollout.
const (
	StateShadow     = "shadow"
	StateCanary     = "canary"
	StatePaused     = "paused"
	StatePromoted   = "promoted"
	StateRolledBack = "rolled_back"
	StateAborted    = "aborted"
)

// Verdicts of a step.
const (
	Pass         = "pass"
	Fail         = "fail"
	Inconclusive = "inconclusive"
)

// Spec is what a rollout does and how it judges.
type Spec struct {
	// Shadow is how long the candidate runs in shadow first (0: no shadow step).
	Shadow time.Duration
	// Steps are the candidate's shares of the traffic, increasing; a step of 1 is the
	// promotion itself (with no stable arm left to judge against), so the rollout promotes
	// once the step before it passes.
	Steps []float64
	// StepDuration is the least time a step runs; MinRequests the least requests, and
	// MinGroups the least conversation groups with requests, of each arm it must see;
	// StepTimeout the most it may wait for them (then the step is inconclusive).
	StepDuration time.Duration
	MinRequests  uint64
	MinGroups    int
	StepTimeout  time.Duration
	// A step fails on a figure when the candidate is worse than the stable arm beyond the
	// figure's bound and the difference is significant at Alpha (one-sided), judged on
	// conversation groups (see Check): TTFT p90 or p50 past MaxTTFTP90Ratio or
	// MaxTTFTP50Ratio × the stable one's (0: p50 not judged), inter-token gaps' p90 past
	// MaxITLP90Ratio × (0: not judged), the router's error rate (5xx, broken streams;
	// not client errors or clients that left) past the stable one's + MaxErrorRateDelta,
	// the prefix hit rate short of the stable one's by more than MaxHitRateDrop.
	MaxTTFTP90Ratio   float64
	MaxTTFTP50Ratio   float64
	MaxITLP90Ratio    float64
	MaxErrorRateDelta float64
	MaxHitRateDrop    float64
	Alpha             float64
	// FailureLimit is how many failed steps the rollout tolerates, each run again afresh,
	// before it rolls back (0: the first rolls back). InconclusiveLimit is the same for
	// steps that time out without enough to judge; past it OnInconclusive decides:
	// OnInconclusivePause (the default) pauses for an operator, OnInconclusiveRollback rolls
	// back.
	FailureLimit      int
	InconclusiveLimit int
	OnInconclusive    string
	// FastAbortAlpha, when above 0, rolls back at once, at any time in a step, a candidate
	// whose router errors are unmistakably more frequent than the stable arm's: at least
	// FastAbortErrors of them, and a chance below FastAbortAlpha of seeing as many at the
	// stable arm's rate + MaxErrorRateDelta.
	FastAbortAlpha  float64
	FastAbortErrors uint64
	// The shadow step fails when the candidate's picks hold fewer cached prompt blocks than
	// the stable policy's by more than MaxShadowOverlapDrop (a share of the stable picks'
	// mean; 0: not judged), or land on workers more loaded by more than MaxShadowLoadRatio
	// × (0: not judged), over at least MinRequests picks.
	MaxShadowOverlapDrop float64
	MaxShadowLoadRatio   float64
	// MaxBaselineTTFTP90Ratio pauses a step whose stable arm has become slower than it was
	// before the rollout began (its TTFT p90 past this × the baseline's, significant as
	// above; 0: not judged): both arms share workers, load and index, so a candidate that
	// herds requests slows the stable arm too, and comparing the arms alone would not see it.
	MaxBaselineTTFTP90Ratio float64
}

// What a step that stays inconclusive past InconclusiveLimit does (Spec.OnInconclusive).
const (
	OnInconclusivePause    = "pause"
	OnInconclusiveRollback = "rollback"
)

// DefaultSpec: steps 5, 25, 50, 100 %, each at least two minutes with 30 requests in 3
// conversation groups per arm and at most ten; candidate TTFT p90 and p50 and ITL p90 at
// most 1.10 × stable, router error rate at most stable + 0.5 points, hit rate at least
// stable − 2 points, each failing only when significant at 0.05 % (one-sided); an
// inconclusive step pauses; a candidate whose errors are unmistakable (3 or more, chance
// below 10⁻⁵) is rolled back at once; shadow fails on picks with a quarter fewer cached
// blocks (not on their load: a cache-aware candidate rightly picks busier workers); a stable
// arm 25 % slower at p90 than before the rollout pauses it.
func DefaultSpec() Spec {
	return Spec{Steps: []float64{0.05, 0.25, 0.5, 1}, StepDuration: 2 * time.Minute, MinRequests: 30, MinGroups: 3, StepTimeout: 10 * time.Minute,
		MaxTTFTP90Ratio: 1.10, MaxTTFTP50Ratio: 1.10, MaxITLP90Ratio: 1.10, MaxErrorRateDelta: 0.005, MaxHitRateDrop: 0.02, Alpha: 0.0005,
		OnInconclusive: OnInconclusivePause, FastAbortAlpha: 1e-5, FastAbortErrors: 3,
		MaxShadowOverlapDrop: 0.25, MaxBaselineTTFTP90Ratio: 1.25}
}

// Validate reports the first setting that cannot work.
func (s Spec) Validate() error {
	switch {
	case len(s.Steps) == 0:
		return errors.New("rollout: no steps")
	case s.StepDuration <= 0 || s.StepTimeout < s.StepDuration:
		return fmt.Errorf("rollout: step duration %v must be positive and no longer than the step timeout %v", s.StepDuration, s.StepTimeout)
	case !(s.MaxTTFTP90Ratio >= 1) || !(s.MaxTTFTP50Ratio == 0 || s.MaxTTFTP50Ratio >= 1) || !(s.MaxITLP90Ratio == 0 || s.MaxITLP90Ratio >= 1) ||
		!(s.MaxErrorRateDelta >= 0) || !(s.MaxHitRateDrop >= 0) || !(s.Alpha > 0 && s.Alpha < 0.5):
		return errors.New("rollout: thresholds out of range (TTFT ratio ≥ 1, deltas ≥ 0, alpha in (0, 0.5))")
	case s.Shadow < 0:
		return errors.New("rollout: negative shadow duration")
	case s.MinGroups < 2:
		return errors.New("rollout: min groups below 2 (a comparison needs at least 2 conversation groups per arm)")
	case s.FailureLimit < 0 || s.InconclusiveLimit < 0:
		return errors.New("rollout: negative failure or inconclusive limit")
	case s.OnInconclusive != OnInconclusivePause && s.OnInconclusive != OnInconclusiveRollback:
		return fmt.Errorf("rollout: on inconclusive %q: want %s or %s", s.OnInconclusive, OnInconclusivePause, OnInconclusiveRollback)
	case !(s.FastAbortAlpha >= 0 && s.FastAbortAlpha < 0.5) || s.FastAbortAlpha > 0 && s.FastAbortErrors == 0:
		return errors.New("rollout: fast abort alpha out of [0, 0.5), or without a least number of errors")
	case !(s.MaxShadowOverlapDrop >= 0 && s.MaxShadowOverlapDrop <= 1) || !(s.MaxShadowLoadRatio == 0 || s.MaxShadowLoadRatio >= 1) ||
		!(s.MaxBaselineTTFTP90Ratio == 0 || s.MaxBaselineTTFTP90Ratio >= 1):
		return errors.New("rollout: shadow or baseline bounds out of range (overlap drop in [0, 1], ratios 0 or ≥ 1)")
	}
	for i, v := range s.Steps {
		if !(v > 0 && v <= 1) || i > 0 && v <= s.Steps[i-1] {
			return fmt.Errorf("rollout: steps %v must increase within (0, 1]", s.Steps)
		}
	}
	return nil
}

// Arm is one policy's figures over an interval (cumulative; the rollout takes each step's
// share by subtracting the step's start).
type Arm struct {
	Requests, Errors           uint64
	TTFT                       Histogram // seconds
	CachedBlocks, PromptBlocks uint64
	// Shadow is the candidate's decisions in shadow (its arm only).
	Shadow Shadow
	// Rejections (429, 503) and ServerErrors (5xx) are among Errors.
	Rejections, ServerErrors uint64
	ITL                      Histogram // gaps between content chunks, seconds
	// Decisions are the requests the policy placed, RegretBlocks their summed regret.
	Decisions, RegretBlocks uint64
	// Hits is the distribution of the requests' shares of prompt blocks cached.
	Hits Histogram
	// RouterErrors are the answers the routing is answerable for (5xx, broken streams),
	// ClientErrors the 4xx other than 429, ClientGone the requests whose client left first.
	RouterErrors, ClientErrors, ClientGone uint64
	// Groups are the arm's figures by conversation group, sorted by ID.
	Groups []Group
}

// Shadow is what a candidate decided in shadow beside the stable policy: its decisions,
// those that picked another worker, and the sums over them of each pick's cached prompt
// blocks and of its worker's load.
type Shadow struct {
	Picks, Disagreements                   uint64
	StableOverlapBlocks, CandOverlapBlocks uint64
	StableLoad, CandLoad                   uint64
}

// clone copies a's histogram, which the caller goes on updating.
func (a Arm) clone() Arm {
	a.TTFT.Counts = slices.Clone(a.TTFT.Counts)
	a.ITL.Counts = slices.Clone(a.ITL.Counts)
	a.Hits.Counts = slices.Clone(a.Hits.Counts)
	a.Groups = slices.Clone(a.Groups)
	for i := range a.Groups {
		a.Groups[i].TTFT, a.Groups[i].ITL = slices.Clone(a.Groups[i].TTFT), slices.Clone(a.Groups[i].ITL)
	}
	return a
}

// Sub is a's figures less the earlier b's (each at least 0), group by group.
func (a Arm) Sub(b Arm) Arm { return a.zip(b, minus, Histogram.Sub, subGroups) }

// Add is the sum of a's and b's figures (histograms of other bounds than a's, where a has
// any, left out), group by group.
func (a Arm) Add(b Arm) Arm { return a.zip(b, plus, Histogram.add, addGroups) }

// zip is the arm whose every count is f of a's and b's, histograms h of theirs, groups g.
func (a Arm) zip(b Arm, f func(x, y uint64) uint64, h func(x, y Histogram) Histogram, g func(x, y []Group) []Group) Arm {
	sa, sb := a.Shadow, b.Shadow
	return Arm{Requests: f(a.Requests, b.Requests), Errors: f(a.Errors, b.Errors), TTFT: h(a.TTFT, b.TTFT),
		CachedBlocks: f(a.CachedBlocks, b.CachedBlocks), PromptBlocks: f(a.PromptBlocks, b.PromptBlocks),
		Shadow: Shadow{f(sa.Picks, sb.Picks), f(sa.Disagreements, sb.Disagreements), f(sa.StableOverlapBlocks, sb.StableOverlapBlocks),
			f(sa.CandOverlapBlocks, sb.CandOverlapBlocks), f(sa.StableLoad, sb.StableLoad), f(sa.CandLoad, sb.CandLoad)},
		Rejections: f(a.Rejections, b.Rejections), ServerErrors: f(a.ServerErrors, b.ServerErrors), ITL: h(a.ITL, b.ITL),
		Decisions: f(a.Decisions, b.Decisions), RegretBlocks: f(a.RegretBlocks, b.RegretBlocks), Hits: h(a.Hits, b.Hits),
		RouterErrors: f(a.RouterErrors, b.RouterErrors), ClientErrors: f(a.ClientErrors, b.ClientErrors), ClientGone: f(a.ClientGone, b.ClientGone),
		Groups: g(a.Groups, b.Groups)}
}

// minus is x − y, at least 0; plus is x + y, at most the largest uint64.
func minus(x, y uint64) uint64 { return x - min(x, y) }

func plus(x, y uint64) uint64 {
	if z := x + y; z >= x {
		return z
	}
	return math.MaxUint64
}

// add is h plus o (o alone when h has no counts; h alone when their bounds differ).
func (h Histogram) add(o Histogram) Histogram {
	switch {
	case len(h.Counts) == 0:
		return Histogram{Bounds: o.Bounds, Counts: slices.Clone(o.Counts)}
	case !slices.Equal(h.Bounds, o.Bounds) || len(h.Counts) != len(o.Counts):
		return Histogram{Bounds: h.Bounds, Counts: slices.Clone(h.Counts)}
	}
	out := Histogram{Bounds: h.Bounds, Counts: slices.Clone(h.Counts)}
	for i, c := range o.Counts {
		out.Counts[i] += c
	}
	return out
}

// addGroups is the groups of a and b (both sorted by ID) summed by ID, in a new slice.
func addGroups(a, b []Group) []Group {
	out := make([]Group, 0, max(len(a), len(b)))
	counts := func(x, y []uint64) []uint64 {
		switch {
		case len(x) == 0:
			return slices.Clone(y)
		case len(y) != len(x):
			return slices.Clone(x)
		}
		z := slices.Clone(x)
		for i := range y {
			z[i] += y[i]
		}
		return z
	}
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || i < len(a) && a[i].ID < b[j].ID:
			g := a[i]
			g.TTFT, g.ITL = slices.Clone(g.TTFT), slices.Clone(g.ITL)
			out = append(out, g)
			i++
		case i == len(a) || b[j].ID < a[i].ID:
			g := b[j]
			g.TTFT, g.ITL = slices.Clone(g.TTFT), slices.Clone(g.ITL)
			out = append(out, g)
			j++
		default:
			x, y := a[i], b[j]
			out = append(out, Group{ID: x.ID, Requests: x.Requests + y.Requests, RouterErrors: x.RouterErrors + y.RouterErrors,
				ClientErrors: x.ClientErrors + y.ClientErrors, ClientGone: x.ClientGone + y.ClientGone,
				CachedBlocks: x.CachedBlocks + y.CachedBlocks, PromptBlocks: x.PromptBlocks + y.PromptBlocks,
				TTFT: counts(x.TTFT, y.TTFT), ITL: counts(x.ITL, y.ITL)})
			i, j = i+1, j+1
		}
	}
	return out
}

// subGroups is the groups of a less the same groups of the earlier b (both sorted by ID),
// those left without requests dropped.
func subGroups(a, b []Group) []Group {
	counts := func(x, y []uint64) []uint64 {
		if len(y) != len(x) {
			return slices.Clone(x)
		}
		out := make([]uint64, len(x))
		for i := range x {
			out[i] = minus(x[i], y[i])
		}
		return out
	}
	var out []Group
	for _, g := range a {
		var e Group
		if i, ok := slices.BinarySearchFunc(b, g.ID, func(x Group, id uint32) int { return cmp.Compare(x.ID, id) }); ok {
			e = b[i]
		}
		n := Group{ID: g.ID, Requests: minus(g.Requests, e.Requests), RouterErrors: minus(g.RouterErrors, e.RouterErrors),
			ClientErrors: minus(g.ClientErrors, e.ClientErrors), ClientGone: minus(g.ClientGone, e.ClientGone),
			CachedBlocks: minus(g.CachedBlocks, e.CachedBlocks), PromptBlocks: minus(g.PromptBlocks, e.PromptBlocks),
			TTFT: counts(g.TTFT, e.TTFT), ITL: counts(g.ITL, e.ITL)}
		if n.Requests > 0 {
			out = append(out, n)
		}
	}
	return out
}

func rate(n, d uint64) float64 {
	if d == 0 {
		return 0
	}
	return float64(n) / float64(d)
}

// Result is one judged step.
type Result struct {
	Step    int     `json:"step"` // -1: shadow
	Share   float64 `json:"share"`
	Verdict string  `json:"verdict"`
	Reason  string  `json:"reason"`
	// Each arm's figures over the step (TTFT in seconds).
	StableRequests     uint64  `json:"stable_requests"`
	CandidateRequests  uint64  `json:"candidate_requests"`
	StableTTFTP50      float64 `json:"stable_ttft_p50"`
	CandidateTTFTP50   float64 `json:"candidate_ttft_p50"`
	StableTTFTP90      float64 `json:"stable_ttft_p90"`
	CandidateTTFTP90   float64 `json:"candidate_ttft_p90"`
	StableErrorRate    float64 `json:"stable_error_rate"`
	CandidateErrorRate float64 `json:"candidate_error_rate"`
	StableHitRate      float64 `json:"stable_hit_rate"`
	CandidateHitRate   float64 `json:"candidate_hit_rate"`
	StableITLP50       float64 `json:"stable_itl_p50"`
	CandidateITLP50    float64 `json:"candidate_itl_p50"`
	StableITLP90       float64 `json:"stable_itl_p90"`
	CandidateITLP90    float64 `json:"candidate_itl_p90"`
	// 5xx answers and rejections (429, 503) as shares of each arm's requests; each arm's
	// mean routing regret in blocks.
	StableServerErrorRate    float64 `json:"stable_server_error_rate"`
	CandidateServerErrorRate float64 `json:"candidate_server_error_rate"`
	StableRejectionRate      float64 `json:"stable_rejection_rate"`
	CandidateRejectionRate   float64 `json:"candidate_rejection_rate"`
	StableRegret             float64 `json:"stable_regret_blocks"`
	CandidateRegret          float64 `json:"candidate_regret_blocks"`
	// In shadow: the candidate's decisions, the share of them that picked another worker
	// than the stable policy, and each arm's mean cached prompt blocks and worker load at
	// its picks.
	ShadowPicks            uint64    `json:"shadow_picks,omitempty"`
	ShadowDisagreement     float64   `json:"shadow_disagreement,omitempty"`
	ShadowStableOverlap    float64   `json:"shadow_stable_overlap,omitempty"`
	ShadowCandidateOverlap float64   `json:"shadow_candidate_overlap,omitempty"`
	ShadowStableLoad       float64   `json:"shadow_stable_load,omitempty"`
	ShadowCandidateLoad    float64   `json:"shadow_candidate_load,omitempty"`
	Start                  time.Time `json:"start"`
	End                    time.Time `json:"end"`
	// The errors the routing is answerable for (5xx, broken streams), the clients' errors
	// (4xx but 429) and the clients that left before their answer ended, as shares of each
	// arm's requests; the conversation groups each arm's requests fell in.
	StableRouterErrorRate    float64 `json:"stable_router_error_rate"`
	CandidateRouterErrorRate float64 `json:"candidate_router_error_rate"`
	StableClientErrorRate    float64 `json:"stable_client_error_rate"`
	CandidateClientErrorRate float64 `json:"candidate_client_error_rate"`
	StableClientGoneRate     float64 `json:"stable_client_gone_rate"`
	CandidateClientGoneRate  float64 `json:"candidate_client_gone_rate"`
	StableGroups             int     `json:"stable_groups"`
	CandidateGroups          int     `json:"candidate_groups"`
	// Checks are the judged figures (a judged canary step), and the stable arm against its
	// own figures before the rollout (Metric prefixed "baseline ").
	Checks []Check `json:"checks,omitempty"`
}

// Rollout is one rollout's state; its JSON form is what the control plane persists. It is
// not safe for concurrent use.
type Rollout struct {
	Spec  Spec   `json:"spec"`
	State string `json:"state"`
	// Step is the canary step running (index into Spec.Steps; -1 in shadow).
	Step      int       `json:"step"`
	StepStart time.Time `json:"step_start"`
	// ResumeTo keeps, while paused, the state to go back to on Resume; PausedAt shifts the
	// step's clock.
	ResumeTo string    `json:"resume_to,omitempty"`
	PausedAt time.Time `json:"paused_at,omitzero"`
	// BaseStable and BaseCandidate are each arm's cumulative figures when the step started.
	BaseStable    Arm      `json:"base_stable"`
	BaseCandidate Arm      `json:"base_candidate"`
	Results       []Result `json:"results"`
	// Baseline is the stable arm's figures over a while before the rollout began (none:
	// not judged against).
	Baseline Arm `json:"baseline,omitzero"`
	// Failures and Inconclusives count the steps that failed, or timed out inconclusive,
	// and ran again (Spec.FailureLimit, Spec.InconclusiveLimit); Restart makes the next
	// Advance run the step afresh (resumed after an inconclusive pause).
	Failures      int  `json:"failures,omitempty"`
	Inconclusives int  `json:"inconclusives,omitempty"`
	Restart       bool `json:"restart,omitempty"`
	// Looks counts the running step's judgements (at its duration, then each time its
	// figures doubled); Suspect says why the last one let it run on: a figure worse beyond
	// its bound, not yet beyond doubt.
	Looks   int    `json:"looks,omitempty"`
	Suspect string `json:"suspect,omitempty"`
}

// New starts a rollout at now, in shadow if the spec has a shadow step; stable and cand
// are the arms' cumulative figures then.
func New(spec Spec, now time.Time, stable, cand Arm) (*Rollout, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	r := &Rollout{Spec: spec, State: StateCanary, StepStart: now, BaseStable: stable.clone(), BaseCandidate: cand.clone()}
	if spec.Shadow > 0 {
		r.State, r.Step = StateShadow, -1
	}
	return r, nil
}

// Clone returns a copy of r that shares nothing it changes.
func (r *Rollout) Clone() *Rollout {
	c := *r
	c.Spec.Steps = slices.Clone(r.Spec.Steps)
	c.BaseStable, c.BaseCandidate = r.BaseStable.clone(), r.BaseCandidate.clone()
	c.Results = slices.Clone(r.Results)
	for i := range c.Results {
		c.Results[i].Checks = slices.Clone(r.Results[i].Checks)
	}
	c.Baseline = r.Baseline.clone()
	return &c
}

// Share is what proxies should do now: the candidate's share, and whether in shadow.
func (r *Rollout) Share() (share float64, shadow bool) {
	switch r.State {
	case StateShadow:
		return 0, true
	case StateCanary:
		return r.Spec.Steps[r.Step], false
	case StatePaused:
		if r.ResumeTo == StateShadow {
			return 0, true
		}
		return r.Spec.Steps[r.Step], false
	case StatePromoted:
		return 1, false
	}
	return 0, false
}

// Done reports whether the rollout has ended (promoted, rolled back or aborted).
func (r *Rollout) Done() bool {
	return r.State == StatePromoted || r.State == StateRolledBack || r.State == StateAborted
}

// Advance judges the running step at now with each arm's cumulative figures and moves on:
// to the next step (or promoted) when it passes; when it fails, rolled back, or the step
// run again while Spec.FailureLimit allows; when it stays inconclusive past the step
// timeout, the step run again while Spec.InconclusiveLimit allows, then paused or rolled
// back (Spec.OnInconclusive). A candidate whose errors are unmistakable is rolled back at
// any time (Spec.FastAbortAlpha). It reports whether the state changed.
func (r *Rollout) Advance(now time.Time, stable, cand Arm) bool {
	if r.State != StateShadow && r.State != StateCanary {
		return false
	}
	if r.Restart {
		r.Restart = false
		r.restartStep(now, stable, cand)
		return true
	}
	elapsed := now.Sub(r.StepStart)
	if r.State == StateShadow {
		if elapsed < r.Spec.Shadow {
			return false
		}
		res := r.Current(stable, cand)
		res.Start, res.End = r.StepStart, now
		res.Verdict, res.Reason = r.judgeShadow(res)
		r.Results = append(r.Results, res)
		if res.Verdict == Fail {
			r.State = StateRolledBack
			return true
		}
		r.next(now, stable, cand)
		return true
	}
	if reason, abort := r.fastAbort(minus(stable.Requests, r.BaseStable.Requests), minus(stable.RouterErrors, r.BaseStable.RouterErrors),
		minus(cand.Requests, r.BaseCandidate.Requests), minus(cand.RouterErrors, r.BaseCandidate.RouterErrors)); abort {
		res := figures(stable.Sub(r.BaseStable), cand.Sub(r.BaseCandidate))
		res.clearShadow()
		res.Start, res.End, res.Step, res.Share = r.StepStart, now, r.Step, r.Spec.Steps[r.Step]
		res.Verdict, res.Reason = Fail, reason
		r.Results = append(r.Results, res)
		r.State = StateRolledBack
		return true
	}
	if elapsed < r.Spec.StepDuration<<r.Looks {
		return false
	}
	res, suspect := r.judge(stable.Sub(r.BaseStable), cand.Sub(r.BaseCandidate))
	res.Start, res.End, res.Step, res.Share = r.StepStart, now, r.Step, r.Spec.Steps[r.Step]
	res.clearShadow()
	if res.Verdict == Inconclusive && elapsed < r.Spec.StepTimeout {
		return false // wait for more requests
	}
	if res.Verdict != Inconclusive {
		r.Looks++
		if res.Verdict == Pass && suspect != "" && r.Spec.StepDuration<<r.Looks <= r.Spec.StepTimeout {
			// Worse beyond a bound but not yet beyond doubt: the step runs on to its next
			// look, with twice the figures.
			r.Suspect = suspect
			return false
		}
	}
	switch res.Verdict {
	case Inconclusive:
		r.Inconclusives++
		r.Results = append(r.Results, res)
		switch {
		case r.Inconclusives <= r.Spec.InconclusiveLimit:
			r.Results[len(r.Results)-1].Reason += fmt.Sprintf("; running the step again (%d of %d allowed)", r.Inconclusives, r.Spec.InconclusiveLimit)
			r.restartStep(now, stable, cand)
		case r.Spec.OnInconclusive == OnInconclusiveRollback:
			r.Results[len(r.Results)-1].Reason = "step timed out inconclusive: " + res.Reason
			r.State = StateRolledBack
		default:
			// An operator decides: resume runs the step again afresh, promote or abort ends it.
			r.Results[len(r.Results)-1].Reason = "step timed out inconclusive, paused for an operator: " + res.Reason
			r.ResumeTo, r.State, r.PausedAt, r.Restart = StateCanary, StatePaused, now, true
		}
		return true
	case Fail:
		r.Failures++
		r.Results = append(r.Results, res)
		if r.Failures <= r.Spec.FailureLimit {
			r.Results[len(r.Results)-1].Reason += fmt.Sprintf("; running the step again (failure %d of %d allowed)", r.Failures, r.Spec.FailureLimit)
			r.restartStep(now, stable, cand)
			return true
		}
		r.State = StateRolledBack
		return true
	}
	r.Results = append(r.Results, res)
	r.next(now, stable, cand)
	return true
}

// restartStep runs the current step again from now, on figures from now.
func (r *Rollout) restartStep(now time.Time, stable, cand Arm) {
	r.StepStart, r.BaseStable, r.BaseCandidate = now, stable.clone(), cand.clone()
	r.Looks, r.Suspect = 0, ""
}

// looks is how many times a step is judged at most: at its duration, then each time its
// figures have doubled (twice, four times its duration…) within its timeout.
func (s Spec) looks() int {
	n := 1
	for s.StepDuration<<n <= s.StepTimeout && n < 16 {
		n++
	}
	return n
}

// fastAbort reports whether the candidate's router errors over the step so far are
// unmistakably more frequent than the stable arm's (Spec.FastAbortAlpha), and why.
func (r *Rollout) fastAbort(stableRequests, stableErrors, candRequests, candErrors uint64) (string, bool) {
	s := r.Spec
	if s.FastAbortAlpha <= 0 || candErrors < s.FastAbortErrors {
		return "", false
	}
	// The stable arm's rate, taken at one error more than seen (so that a clean stable arm
	// does not make every error look impossible), plus the tolerated difference.
	p0 := min(float64(stableErrors+1)/float64(stableRequests+2)+s.MaxErrorRateDelta, 1)
	tail := binomialTail(candErrors, max(candRequests, candErrors), p0)
	if tail >= s.FastAbortAlpha {
		return "", false
	}
	return fmt.Sprintf("fast abort: %d router errors in %d candidate requests against %d in %d stable (chance %.1e at the stable rate + %.1f points)",
		candErrors, candRequests, stableErrors, stableRequests, tail, 100*s.MaxErrorRateDelta), true
}

// judgeShadow judges the shadow step on what the candidate picked beside the stable policy.
func (r *Rollout) judgeShadow(res Result) (verdict, reason string) {
	s := r.Spec
	switch {
	case res.ShadowPicks < s.MinRequests:
		return Pass, fmt.Sprintf("shadow ran its time; %d picks, too few to judge (%d needed)", res.ShadowPicks, s.MinRequests)
	case s.MaxShadowOverlapDrop > 0 && res.ShadowStableOverlap > 0 && res.ShadowCandidateOverlap < (1-s.MaxShadowOverlapDrop)*res.ShadowStableOverlap:
		return Fail, fmt.Sprintf("shadow: the candidate's picks cache %.1f prompt blocks on average against the stable policy's %.1f (%.0f%% fewer; at most %.0f%%)",
			res.ShadowCandidateOverlap, res.ShadowStableOverlap, 100*(1-res.ShadowCandidateOverlap/res.ShadowStableOverlap), 100*s.MaxShadowOverlapDrop)
	case s.MaxShadowLoadRatio > 0 && res.ShadowCandidateLoad > s.MaxShadowLoadRatio*max(res.ShadowStableLoad, 1):
		return Fail, fmt.Sprintf("shadow: the candidate's picks carry %.1f requests on average against the stable policy's %.1f (×%.2f; at most ×%.2f)",
			res.ShadowCandidateLoad, res.ShadowStableLoad, res.ShadowCandidateLoad/max(res.ShadowStableLoad, 1), s.MaxShadowLoadRatio)
	}
	return Pass, fmt.Sprintf("shadow ran its time: %.0f%% of %d picks differ, %.1f cached blocks against %.1f",
		100*res.ShadowDisagreement, res.ShadowPicks, res.ShadowCandidateOverlap, res.ShadowStableOverlap)
}

// next starts the step after the current one, or promotes after the last (or at a step of
// the whole traffic).
func (r *Rollout) next(now time.Time, stable, cand Arm) {
	r.Step++
	if r.Step >= len(r.Spec.Steps) || r.Spec.Steps[r.Step] >= 1 {
		r.State, r.Step = StatePromoted, min(r.Step, len(r.Spec.Steps)-1)
		return
	}
	r.State = StateCanary
	r.restartStep(now, stable, cand)
}

// Current is the running step's figures so far, not judged (Verdict empty), from each arm's
// cumulative figures now.
func (r *Rollout) Current(stable, cand Arm) Result {
	res := figures(stable.Sub(r.BaseStable), cand.Sub(r.BaseCandidate))
	res.Step, res.Start = r.Step, r.StepStart
	if r.Step >= 0 {
		res.clearShadow() // picks proxies made in shadow before the step's share reached them
	}
	if r.Step >= 0 && r.Step < len(r.Spec.Steps) {
		res.Share = r.Spec.Steps[r.Step]
	}
	return res
}

// clearShadow drops the shadow figures from a canary step's result.
func (res *Result) clearShadow() {
	res.ShadowPicks, res.ShadowDisagreement, res.ShadowStableOverlap, res.ShadowCandidateOverlap = 0, 0, 0, 0
	res.ShadowStableLoad, res.ShadowCandidateLoad = 0, 0
}

// figures are both arms' figures over a step, shadow ones included.
func figures(stable, cand Arm) Result {
	sh := cand.Shadow
	mean := func(sum uint64) float64 { return rate(sum, sh.Picks) }
	q := func(h Histogram, p float64) float64 { // 0 without observations: results are JSON
		if v := h.Quantile(p); !math.IsNaN(v) {
			return v
		}
		return 0
	}
	return Result{StableRequests: stable.Requests, CandidateRequests: cand.Requests,
		StableTTFTP50: q(stable.TTFT, 0.5), CandidateTTFTP50: q(cand.TTFT, 0.5),
		StableTTFTP90: q(stable.TTFT, 0.9), CandidateTTFTP90: q(cand.TTFT, 0.9),
		StableErrorRate: rate(stable.Errors, stable.Requests), CandidateErrorRate: rate(cand.Errors, cand.Requests),
		StableHitRate: rate(stable.CachedBlocks, stable.PromptBlocks), CandidateHitRate: rate(cand.CachedBlocks, cand.PromptBlocks),
		StableITLP50: q(stable.ITL, 0.5), CandidateITLP50: q(cand.ITL, 0.5),
		StableITLP90: q(stable.ITL, 0.9), CandidateITLP90: q(cand.ITL, 0.9),
		StableServerErrorRate: rate(stable.ServerErrors, stable.Requests), CandidateServerErrorRate: rate(cand.ServerErrors, cand.Requests),
		StableRejectionRate: rate(stable.Rejections, stable.Requests), CandidateRejectionRate: rate(cand.Rejections, cand.Requests),
		StableRegret: rate(stable.RegretBlocks, stable.Decisions), CandidateRegret: rate(cand.RegretBlocks, cand.Decisions),
		StableRouterErrorRate: rate(stable.RouterErrors, stable.Requests), CandidateRouterErrorRate: rate(cand.RouterErrors, cand.Requests),
		StableClientErrorRate: rate(stable.ClientErrors, stable.Requests), CandidateClientErrorRate: rate(cand.ClientErrors, cand.Requests),
		StableClientGoneRate: rate(stable.ClientGone, stable.Requests), CandidateClientGoneRate: rate(cand.ClientGone, cand.Requests),
		StableGroups: len(sampleOf(stable).groups), CandidateGroups: len(sampleOf(cand).groups),
		ShadowPicks: sh.Picks, ShadowDisagreement: mean(sh.Disagreements),
		ShadowStableOverlap: mean(sh.StableOverlapBlocks), ShadowCandidateOverlap: mean(sh.CandOverlapBlocks),
		ShadowStableLoad: mean(sh.StableLoad), ShadowCandidateLoad: mean(sh.CandLoad)}
}

// judge compares the arms over one step on their conversation groups, and the stable arm
// with its figures before the rollout.
func (r *Rollout) judge(stable, cand Arm) (res Result, suspect string) {
	s := r.Spec
	res = figures(stable, cand)
	ss, cs := sampleOf(stable), sampleOf(cand)
	res.StableGroups, res.CandidateGroups = len(ss.groups), len(cs.groups)
	switch {
	case stable.Requests < s.MinRequests || cand.Requests < s.MinRequests:
		res.Verdict, res.Reason = Inconclusive, fmt.Sprintf("%d stable and %d candidate requests, %d needed of each", stable.Requests, cand.Requests, s.MinRequests)
		return res, ""
	case len(ss.groups) < s.MinGroups || len(cs.groups) < s.MinGroups:
		res.Verdict, res.Reason = Inconclusive, fmt.Sprintf("%d stable and %d candidate conversation groups, %d needed of each", len(ss.groups), len(cs.groups), s.MinGroups)
		return res, ""
	}
	// Each look tests at alpha shared among the step's looks, so that judging a step up to
	// that many times does not make a neutral candidate fail more often.
	alpha := s.Alpha / float64(s.looks())
	res.Checks = compare(s.metrics(), ss, cs, alpha)
	for _, c := range res.Checks {
		if c.Failed {
			res.Verdict, res.Reason = Fail, c.describe()
			return res, ""
		}
		if suspect == "" && c.suspect() {
			suspect = c.describe()
		}
	}
	if s.MaxBaselineTTFTP90Ratio > 0 {
		bs := sampleOf(r.Baseline)
		if r.Baseline.Requests >= s.MinRequests && len(bs.groups) >= s.MinGroups {
			ms := []metric{{name: "TTFT p90", ratio: true, worse: 1, bound: s.MaxBaselineTTFTP90Ratio, q: 0.9,
				hist: func(g *Group) []uint64 { return g.TTFT }, bounds: func(s *sample) []float64 { return s.ttft }}}
			bc := compare(ms, bs, ss, alpha)
			for i := range bc {
				bc[i].Metric = "baseline " + bc[i].Metric
			}
			res.Checks = append(res.Checks, bc...)
			if bc[0].Failed {
				res.Verdict = Inconclusive
				res.Reason = fmt.Sprintf("the stable arm's TTFT p90 is %.0f ms against %.0f ms before the rollout (×%.2f, t %.1f > %.1f): the candidate may be loading the workers both arms share, or the traffic changed",
					1e3*bc[0].Candidate, 1e3*bc[0].Stable, bc[0].Effect, bc[0].T, bc[0].Critical)
				return res, ""
			}
			if suspect == "" && bc[0].suspect() {
				suspect = "the stable arm against its figures before the rollout: " + bc[0].describe()
			}
		}
	}
	res.Verdict, res.Reason = Pass, "within every bound"
	return res, suspect
}

// suspect reports whether the check's effect is past its bound and at least one standard
// error worse than none, without being beyond doubt.
func (c Check) suspect() bool { return !c.Failed && c.Beyond && c.T >= 1 }

// describe says why a check failed.
func (c Check) describe() string {
	if strings.HasSuffix(c.Metric, "rate") {
		return fmt.Sprintf("%s %.2f%% against %.2f%% (%+.2f points, at most %.2f; t %.1f > %.1f)", c.Metric, 100*c.Candidate, 100*c.Stable,
			100*c.Effect, 100*c.Bound, c.T, c.Critical)
	}
	unit, f := "ms", 1e3
	return fmt.Sprintf("%s %.1f %s against %.1f %s (×%.2f, at most ×%.2f; t %.1f > %.1f)", c.Metric, f*c.Candidate, unit, f*c.Stable, unit,
		c.Effect, c.Bound, c.T, c.Critical)
}

// Pause holds the rollout at its step; Resume continues it with the step's clock moved by
// the time paused.
func (r *Rollout) Pause(now time.Time) error {
	if r.State != StateShadow && r.State != StateCanary {
		return fmt.Errorf("rollout is %s, not running", r.State)
	}
	r.ResumeTo, r.State, r.PausedAt = r.State, StatePaused, now
	return nil
}

func (r *Rollout) Resume(now time.Time) error {
	if r.State != StatePaused {
		return fmt.Errorf("rollout is %s, not paused", r.State)
	}
	r.State, r.ResumeTo = r.ResumeTo, ""
	r.StepStart = r.StepStart.Add(now.Sub(r.PausedAt))
	r.PausedAt = time.Time{}
	if r.Restart {
		r.Inconclusives = 0 // an operator's resume after an inconclusive step: a fresh start
	}
	return nil
}

// Promote ends the rollout with the candidate taking all traffic; Abort ends it with the
// stable policy taking all traffic.
func (r *Rollout) Promote() error {
	if r.Done() {
		return fmt.Errorf("rollout already %s", r.State)
	}
	r.State = StatePromoted
	return nil
}

func (r *Rollout) Abort() error {
	if r.Done() {
		return fmt.Errorf("rollout already %s", r.State)
	}
	r.State = StateAborted
	return nil
}
