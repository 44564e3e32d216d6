// Package rollout is the state machine of a routing policy rollout: a candidate policy
// tried in shadow, then on growing shares of the traffic, each step judged against the
// stable policy over the same interval, promoted when every step passes and rolled back at
// once when one fails, as Argo Rollouts, Flagger and Kayenta do for deployments. It knows
// nothing of proxies or storage: the control plane feeds it each arm's figures and the
// time, and applies the share it asks for.
package rollout

import (
	"errors"
	"fmt"
	"math"
	"slices"
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
	// StepDuration is the least time a step runs; MinRequests the least requests of each arm
	// it must see; StepTimeout the most it may wait for them before it rolls back.
	StepDuration time.Duration
	MinRequests  uint64
	StepTimeout  time.Duration
	// A step fails when the candidate's TTFT p90 exceeds MaxTTFTP90Ratio × the stable one's
	// and the rank test says it is slower, when its error rate exceeds the stable one's by
	// more than MaxErrorRateDelta, or when its prefix hit rate falls short by more than
	// MaxHitRateDrop and the rank test says its requests' hit ratios are lower (when both
	// arms report them).
	MaxTTFTP90Ratio float64
	// MaxITLP90Ratio is the same test on the gaps between content chunks (0: not judged).
	MaxITLP90Ratio    float64
	MaxErrorRateDelta float64
	MaxHitRateDrop    float64
	// Alpha is the rank test's significance level.
	Alpha float64
}

// DefaultSpec is the defaults: steps 5, 25, 50, 100 %, two minutes and 200
// requests per step, candidate TTFT p90 at most 1.10 × stable, error rate at most stable +
// 0.5 %, hit rate at least stable − 2 points, the rank test at 0.1 % (one-sided): a step fails on latency only when its p90 is past the ratio and the whole distribution is shifted beyond doubt.
func DefaultSpec() Spec {
	return Spec{Steps: []float64{0.05, 0.25, 0.5, 1}, StepDuration: 2 * time.Minute, MinRequests: 200, StepTimeout: 10 * time.Minute,
		MaxTTFTP90Ratio: 1.10, MaxITLP90Ratio: 1.10, MaxErrorRateDelta: 0.005, MaxHitRateDrop: 0.02, Alpha: 0.001}
}

// Validate reports the first setting that cannot work.
func (s Spec) Validate() error {
	switch {
	case len(s.Steps) == 0:
		return errors.New("rollout: no steps")
	case s.StepDuration <= 0 || s.StepTimeout < s.StepDuration:
		return fmt.Errorf("rollout: step duration %v must be positive and no longer than the step timeout %v", s.StepDuration, s.StepTimeout)
	case !(s.MaxTTFTP90Ratio >= 1) || !(s.MaxITLP90Ratio == 0 || s.MaxITLP90Ratio >= 1) || !(s.MaxErrorRateDelta >= 0) || !(s.MaxHitRateDrop >= 0) || !(s.Alpha > 0 && s.Alpha < 0.5):
		return errors.New("rollout: thresholds out of range (TTFT ratio ≥ 1, deltas ≥ 0, alpha in (0, 0.5))")
	case s.Shadow < 0:
		return errors.New("rollout: negative shadow duration")
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
	return a
}

func (a Arm) sub(b Arm) Arm {
	d := func(x, y uint64) uint64 {
		if x > y {
			return x - y
		}
		return 0
	}
	sa, sb := a.Shadow, b.Shadow
	return Arm{Requests: d(a.Requests, b.Requests), Errors: d(a.Errors, b.Errors), TTFT: a.TTFT.Sub(b.TTFT),
		CachedBlocks: d(a.CachedBlocks, b.CachedBlocks), PromptBlocks: d(a.PromptBlocks, b.PromptBlocks),
		Shadow: Shadow{d(sa.Picks, sb.Picks), d(sa.Disagreements, sb.Disagreements), d(sa.StableOverlapBlocks, sb.StableOverlapBlocks),
			d(sa.CandOverlapBlocks, sb.CandOverlapBlocks), d(sa.StableLoad, sb.StableLoad), d(sa.CandLoad, sb.CandLoad)},
		Rejections: d(a.Rejections, b.Rejections), ServerErrors: d(a.ServerErrors, b.ServerErrors), ITL: a.ITL.Sub(b.ITL),
		Decisions: d(a.Decisions, b.Decisions), RegretBlocks: d(a.RegretBlocks, b.RegretBlocks), Hits: a.Hits.Sub(b.Hits)}
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
// to the next step (or promoted) when it passes, rolled back when it fails, or rolled back
// when it stays inconclusive past the step timeout. It reports whether the state changed.
func (r *Rollout) Advance(now time.Time, stable, cand Arm) bool {
	if r.State != StateShadow && r.State != StateCanary {
		return false
	}
	elapsed := now.Sub(r.StepStart)
	if r.State == StateShadow {
		if elapsed < r.Spec.Shadow {
			return false
		}
		res := r.Current(stable, cand)
		res.Start, res.End, res.Verdict, res.Reason = r.StepStart, now, Pass, "shadow ran its time"
		r.Results = append(r.Results, res)
		r.next(now, stable, cand)
		return true
	}
	if elapsed < r.Spec.StepDuration {
		return false
	}
	res := r.judge(stable.sub(r.BaseStable), cand.sub(r.BaseCandidate))
	res.Start, res.End, res.Step, res.Share = r.StepStart, now, r.Step, r.Spec.Steps[r.Step]
	res.clearShadow()
	switch {
	case res.Verdict == Inconclusive && elapsed < r.Spec.StepTimeout:
		return false // wait for more requests
	case res.Verdict == Inconclusive:
		res.Verdict, res.Reason = Fail, "step timed out inconclusive: "+res.Reason
	}
	r.Results = append(r.Results, res)
	if res.Verdict == Fail {
		r.State = StateRolledBack
		return true
	}
	r.next(now, stable, cand)
	return true
}

// next starts the step after the current one, or promotes after the last (or at a step of
// the whole traffic).
func (r *Rollout) next(now time.Time, stable, cand Arm) {
	r.Step++
	if r.Step >= len(r.Spec.Steps) || r.Spec.Steps[r.Step] >= 1 {
		r.State, r.Step = StatePromoted, min(r.Step, len(r.Spec.Steps)-1)
		return
	}
	r.State, r.StepStart, r.BaseStable, r.BaseCandidate = StateCanary, now, stable.clone(), cand.clone()
}

// Current is the running step's figures so far, not judged (Verdict empty), from each arm's
// cumulative figures now.
func (r *Rollout) Current(stable, cand Arm) Result {
	res := figures(stable.sub(r.BaseStable), cand.sub(r.BaseCandidate))
	res.Step, res.Start = r.Step, r.StepStart
	if r.Step >= 0 {
		res.clearShadow() // picks proxies made in shadow before the step's share reached them
	}
	if r.Step >= 0 && r.Step < len(r.Spec.Steps) {
		res.Share = r.Spec.Steps[r.Step]
	}
	return res
}

// Rebase restarts the step's figures from each arm's cumulative figures now, for an arm
// whose sums fell (a proxy restarted and its counts began again).
func (r *Rollout) Rebase(stable, cand Arm) {
	if stable.Requests < r.BaseStable.Requests {
		r.BaseStable = stable.clone()
	}
	if cand.Requests < r.BaseCandidate.Requests {
		r.BaseCandidate = cand.clone()
	}
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
		ShadowPicks: sh.Picks, ShadowDisagreement: mean(sh.Disagreements),
		ShadowStableOverlap: mean(sh.StableOverlapBlocks), ShadowCandidateOverlap: mean(sh.CandOverlapBlocks),
		ShadowStableLoad: mean(sh.StableLoad), ShadowCandidateLoad: mean(sh.CandLoad)}
}

// judge compares the arms over one step.
func (r *Rollout) judge(stable, cand Arm) Result {
	s := r.Spec
	res := figures(stable, cand)
	if stable.Requests < s.MinRequests || cand.Requests < s.MinRequests {
		res.Verdict, res.Reason = Inconclusive, fmt.Sprintf("%d stable and %d candidate requests, %d needed of each", stable.Requests, cand.Requests, s.MinRequests)
		return res
	}
	switch {
	case res.CandidateErrorRate > res.StableErrorRate+s.MaxErrorRateDelta:
		res.Verdict, res.Reason = Fail, fmt.Sprintf("error rate %.2f%% against %.2f%%", 100*res.CandidateErrorRate, 100*res.StableErrorRate)
	case stable.PromptBlocks > 0 && cand.PromptBlocks > 0 && res.CandidateHitRate < res.StableHitRate-s.MaxHitRateDrop &&
		(cand.Hits.Total() == 0 || stable.Hits.Total() == 0 || Slower(cand.Hits, stable.Hits, s.Alpha)):
		res.Verdict, res.Reason = Fail, fmt.Sprintf("prefix hit rate %.1f%% against %.1f%%", 100*res.CandidateHitRate, 100*res.StableHitRate)
		if cand.Hits.Total() > 0 && stable.Hits.Total() > 0 {
			res.Reason += " (and requests' hit ratios lower by the rank test)"
		}
	case cand.TTFT.Total() > 0 && stable.TTFT.Total() > 0 && res.CandidateTTFTP90 > s.MaxTTFTP90Ratio*res.StableTTFTP90 && Slower(stable.TTFT, cand.TTFT, s.Alpha):
		res.Verdict, res.Reason = Fail, fmt.Sprintf("TTFT p90 %.0f ms against %.0f ms (×%.2f, and slower by the rank test)", 1e3*res.CandidateTTFTP90, 1e3*res.StableTTFTP90, res.CandidateTTFTP90/res.StableTTFTP90)
	case s.MaxITLP90Ratio > 0 && cand.ITL.Total() > 0 && stable.ITL.Total() > 0 && res.CandidateITLP90 > s.MaxITLP90Ratio*res.StableITLP90 && Slower(stable.ITL, cand.ITL, s.Alpha):
		res.Verdict, res.Reason = Fail, fmt.Sprintf("ITL p90 %.1f ms against %.1f ms (×%.2f, and slower by the rank test)", 1e3*res.CandidateITLP90, 1e3*res.StableITLP90, res.CandidateITLP90/res.StableITLP90)
	default:
		res.Verdict, res.Reason = Pass, "within every threshold"
	}
	return res
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
