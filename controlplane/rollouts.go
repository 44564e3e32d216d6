package controlplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/api"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/controlplane/rollout"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

// A rollout takes the fleet from the stable routing policy to a candidate through the
// steps of package rollout: the controller below starts it, feeds the state machine the
// arms the proxies report (summed by the xDS server), persists every transition in the
// store, and makes the registry's policy carry what the state asks (the candidate, its
// share, shadow; the candidate alone once promoted; the stable policy alone once rolled
// back or aborted), which the xDS server pushes to every proxy. Proxies keep the last
// assignment while the control plane is away; the rollout moves only here.

// rolloutRecord is one rollout as the store keeps it.
type rolloutRecord struct {
	ID uint64 `json:"id"`
	// Candidate is the candidate's routing, with the version the registry gave it.
	Candidate     registry.Policy  `json:"candidate"`
	StableVersion uint64           `json:"stable_version"`
	Started       time.Time        `json:"started"`
	Ended         time.Time        `json:"ended,omitzero"`
	Reason        string           `json:"reason,omitempty"`
	R             *rollout.Rollout `json:"rollout"`
}

// errRolloutNotFound is GetRollout's answer before any rollout ran.
var errRolloutNotFound = errors.New("no rollout has run: kvrelay ctl policy rollout start")

// rollouts is the control plane's rollout controller. Its methods are safe for concurrent
// use.
type rollouts struct {
	s      *Server
	now    func() time.Time // Options.RolloutClock
	settle time.Duration    // Options.RolloutSettle

	mu      sync.Mutex
	cur     *rolloutRecord // the running or latest rollout; nil before the first
	started time.Time
	warned  time.Time // the last "no reports" warning
	// bases are each proxy's figures when the running step began, or when this replica
	// first heard of the proxy in it (stepBases); history the stable policy's summed
	// figures now and then, for the baseline of the next rollout.
	bases   stepBases
	history []armSnapshot
}

// stepBases are each proxy's arms (node id → policy version → cumulative figures) at the
// start of one step of one rollout, or at this replica's first report of the proxy in the
// step. A step's figures are the sum over proxies of what each served since its base: a
// proxy that drops out and returns adds what it served meanwhile, never its history from
// before the step, and one that restarted (its figures fell) counts from nothing.
type stepBases struct {
	id    uint64
	step  int
	start time.Time
	nodes map[string]map[uint64]rollout.Arm
}

// armSnapshot is the stable policy's figures summed over the proxies at a time.
type armSnapshot struct {
	at      time.Time
	version uint64
	arm     rollout.Arm
}

// Baseline window: the stable policy's figures over up to baselineWindow before a rollout
// (at least baselineMin of them), sampled every baselineEvery.
const (
	baselineWindow = 5 * time.Minute
	baselineMin    = time.Minute
	baselineEvery  = 10 * time.Second
)

// loadRollout reads the latest rollout from the store.
func (s *Server) loadRollout() (*rollouts, error) {
	c := &rollouts{s: s, now: s.opts.RolloutClock, settle: s.opts.RolloutSettle}
	rec, err := s.storedRollout()
	if err != nil {
		return nil, err
	}
	c.cur = rec
	return c, nil
}

// storedRollout is the latest rollout in the store, nil when none ran.
func (s *Server) storedRollout() (*rolloutRecord, error) {
	data, err := s.store.LastRollout()
	if err != nil || data == nil {
		return nil, err
	}
	var rec rolloutRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, fmt.Errorf("control plane: decoding the stored rollout: %w", err)
	}
	if rec.R == nil {
		return nil, fmt.Errorf("control plane: the stored rollout %d has no state", rec.ID)
	}
	return &rec, nil
}

// reload takes the latest rollout from a store the leader writes: a follower shows what the
// leader does, and a new leader goes on from where the last one left it.
func (c *rollouts) reload() {
	rec, err := c.s.storedRollout()
	if err != nil {
		c.s.log.Error("stored rollout not read", "err", err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if rec != nil {
		c.cur = rec
	}
}

// setPolicy is an operator's change of the policy, refused while a rollout runs (it would
// change the arms under the analysis; pause, promote or abort it first).
func (c *rollouts) setPolicy(p registry.Policy) (registry.Policy, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur != nil && !c.cur.R.Done() {
		return registry.Policy{}, fmt.Errorf("%w: rollout %d is %s: promote or abort it before changing the policy", api.ErrConflict, c.cur.ID, c.cur.R.State)
	}
	if err := c.s.checkProfiles(p); err != nil {
		return registry.Policy{}, err
	}
	return c.s.reg.SetPolicy(p)
}

// checkProfiles refuses a policy, or candidate, whose profile the proxies cannot build.
func (s *Server) checkProfiles(p registry.Policy) error {
	v := s.opts.ValidateProfile
	if v == nil {
		return nil
	}
	for what, q := range map[string]*registry.Policy{"policy": &p, "candidate": p.Candidate} {
		if q != nil && q.Profile != nil {
			if err := v(*q.Profile); err != nil {
				return fmt.Errorf("%w: %s: %w", api.ErrInvalid, what, err)
			}
		}
	}
	return nil
}

// start begins a rollout of cand (its routing; versions are assigned) as spec says.
func (c *rollouts) start(cand registry.Policy, spec rollout.Spec) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur != nil && !c.cur.R.Done() {
		return fmt.Errorf("%w: rollout %d is %s: promote or abort it first", api.ErrConflict, c.cur.ID, c.cur.R.State)
	}
	now := c.now()
	r, err := rollout.New(spec, now, rollout.Arm{}, rollout.Arm{})
	if err != nil {
		return fmt.Errorf("%w: %w", api.ErrInvalid, err)
	}
	id := uint64(1)
	if c.cur != nil {
		id = c.cur.ID + 1
	}
	pol := c.s.reg.Policy()
	p := pol.Stable() // at the policy's version, so that a concurrent change conflicts
	cand.Candidate, cand.CandidateShare, cand.Shadow, cand.Version = nil, 0, false, 0
	p.Candidate = &cand
	p.CandidateShare, p.Shadow = r.Share()
	if err := c.s.checkProfiles(p); err != nil {
		return err
	}
	got, err := c.s.reg.ChangePolicy(p, fmt.Sprintf("rollout %d started", id))
	if err != nil {
		return err
	}
	if got.Candidate.Version == got.Version {
		return fmt.Errorf("%w: the candidate routes as the stable policy does", api.ErrInvalid)
	}
	nodes := c.s.nodeArms()
	arms := xdsserver.SumArms(nodes)
	r.BaseStable, r.BaseCandidate = armOf(arms, got.Version), armOf(arms, got.Candidate.Version)
	r.Baseline = c.baseline(now, got.Version, r.BaseStable)
	rec := &rolloutRecord{ID: id, Candidate: *got.Candidate, StableVersion: got.Version, Started: now, R: r}
	c.bases = newStepBases(rec, nodes)
	if err := c.persist(rec); err != nil {
		return err
	}
	c.cur = rec
	c.s.log.Info("rollout started", "id", id, "stable", got.Version, "candidate", got.Candidate.Version, "state", r.State, "steps", spec.Steps)
	return nil
}

// armOf is the summed arm of one policy version as the state machine takes it.
func armOf(arms map[uint64]xdsserver.Arm, version uint64) rollout.Arm {
	a, ok := arms[version]
	if !ok {
		return rollout.Arm{}
	}
	return armFrom(a)
}

// armFrom is one arm as the state machine takes it.
func armFrom(a xdsserver.Arm) rollout.Arm {
	return rollout.Arm{Requests: a.Requests, Errors: a.Errors, CachedBlocks: a.CachedBlocks, PromptBlocks: a.PromptBlocks,
		TTFT:   rollout.Histogram{Bounds: a.TTFTBounds, Counts: a.TTFTCounts},
		Shadow: rollout.Shadow(a.Shadow), Rejections: a.Rejections, ServerErrors: a.ServerErrors,
		ITL:       rollout.Histogram{Bounds: a.ITLBounds, Counts: a.ITLCounts},
		Decisions: a.Decisions, RegretBlocks: a.RegretBlocks,
		Hits:         rollout.Histogram{Bounds: a.HitBounds, Counts: a.HitCounts},
		RouterErrors: a.RouterErrors, ClientErrors: a.ClientErrors, ClientGone: a.ClientGone,
		Groups: groupsOf(a.Groups)}
}

// groupsOf is the conversation groups of a summed arm as the state machine takes them.
func groupsOf(gs []xdsserver.ArmGroup) []rollout.Group {
	out := make([]rollout.Group, len(gs))
	for i, g := range gs {
		out[i] = rollout.Group{ID: g.Group, Requests: g.Requests, RouterErrors: g.RouterErrors, ClientErrors: g.ClientErrors,
			ClientGone: g.ClientGone, CachedBlocks: g.CachedBlocks, PromptBlocks: g.PromptBlocks, TTFT: g.TTFTCounts, ITL: g.ITLCounts}
	}
	return out
}

// newStepBases are the bases of rec's running step: every proxy's arms now.
func newStepBases(rec *rolloutRecord, nodes map[string][]xdsserver.Arm) stepBases {
	b := stepBases{id: rec.ID, step: rec.R.Step, start: rec.R.StepStart, nodes: map[string]map[uint64]rollout.Arm{}}
	for node, arms := range nodes {
		b.nodes[node] = map[uint64]rollout.Arm{}
		for _, a := range arms {
			b.nodes[node][a.Version] = armFrom(a)
		}
	}
	return b
}

// stepArms are rec's two arms as cumulative figures whose growth since the step's bases is
// what the proxies served in the step (stepBases): the bases rec keeps plus each proxy's
// figures since its own base. Proxies first heard of now take their figures now as base.
func (c *rollouts) stepArms(rec *rolloutRecord, nodes map[string][]xdsserver.Arm) (stable, cand rollout.Arm) {
	r := rec.R
	if b := &c.bases; b.id != rec.ID || b.step != r.Step || !b.start.Equal(r.StepStart) || b.nodes == nil {
		*b = newStepBases(rec, nodes)
	}
	stable, cand = r.BaseStable, r.BaseCandidate
	for node, arms := range nodes {
		bases := c.bases.nodes[node]
		if bases == nil {
			bases = map[uint64]rollout.Arm{}
			c.bases.nodes[node] = bases
		}
		for _, a := range arms {
			if a.Version != rec.StableVersion && a.Version != rec.Candidate.Version {
				continue
			}
			cur := armFrom(a)
			base, ok := bases[a.Version]
			switch {
			case !ok:
				bases[a.Version] = cur // first heard of in the step: from now on
				continue
			case cur.Requests < base.Requests:
				base = rollout.Arm{} // restarted: all of it since
				bases[a.Version] = base
			}
			if a.Version == rec.StableVersion {
				stable = stable.Add(cur.Sub(base))
			} else {
				cand = cand.Add(cur.Sub(base))
			}
		}
	}
	return stable, cand
}

// record keeps the stable policy's summed figures every baselineEvery for baselineWindow.
func (c *rollouts) record(now time.Time, arms map[uint64]xdsserver.Arm) {
	if n := len(c.history); n > 0 && now.Sub(c.history[n-1].at) < baselineEvery {
		return
	}
	v := c.s.reg.Policy().Version
	if _, ok := arms[v]; !ok {
		return
	}
	c.history = append(c.history, armSnapshot{at: now, version: v, arm: armOf(arms, v)})
	for len(c.history) > 0 && now.Sub(c.history[0].at) > baselineWindow+baselineEvery {
		c.history = c.history[1:]
	}
}

// baseline is the stable policy version's figures from the oldest snapshot within
// baselineWindow (at least baselineMin old) to cur; none without one.
func (c *rollouts) baseline(now time.Time, version uint64, cur rollout.Arm) rollout.Arm {
	for _, h := range c.history {
		if h.version == version && now.Sub(h.at) <= baselineWindow+baselineEvery && now.Sub(h.at) >= baselineMin && cur.Requests >= h.arm.Requests {
			return cur.Sub(h.arm)
		}
	}
	return rollout.Arm{}
}

// tick judges the running step with the arms reported now, and applies a transition;
// between rollouts it keeps the stable policy's recent figures for the next one's baseline.
func (c *rollouts) tick() {
	running := func(rec *rolloutRecord) bool {
		return rec != nil && (rec.R.State == rollout.StateShadow || rec.R.State == rollout.StateCanary)
	}
	c.mu.Lock()
	settling := c.now().Sub(c.started) < c.settle
	idle := !running(c.cur) || settling
	due := len(c.history) == 0 || c.now().Sub(c.history[len(c.history)-1].at) >= baselineEvery
	c.mu.Unlock()
	if idle && (settling || !due) {
		return
	}
	nodes := c.s.nodeArms() // other replicas' shares are read without the lock
	arms := xdsserver.SumArms(nodes)
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	rec := c.cur
	if !running(rec) {
		c.record(now, arms)
		return
	}
	if _, ok := arms[rec.StableVersion]; !ok {
		// No proxy reports the stable arm (none connected, or their load reports went
		// stale): nothing to judge on, and the step waits.
		if now.Sub(c.warned) >= time.Minute {
			c.warned = now
			c.s.log.Warn("rollout waits: no proxy reports the stable policy's requests", "id", rec.ID, "state", rec.R.State, "stable", rec.StableVersion)
		}
		return
	}
	st, ca := c.stepArms(rec, nodes)
	if !rec.R.Advance(now, st, ca) {
		return
	}
	if !rec.R.Done() {
		c.bases = newStepBases(rec, nodes) // a new step (or the step again) from these figures
	} else {
		rec.Ended = now
		switch res := rec.R.Results; {
		case rec.R.State == rollout.StatePromoted:
			rec.Reason = "every step passed"
		case len(res) > 0:
			rec.Reason = fmt.Sprintf("step %d (%.0f%%) failed: %s", res[len(res)-1].Step+1, 100*res[len(res)-1].Share, res[len(res)-1].Reason)
		}
	}
	c.s.log.Info("rollout moved", "id", rec.ID, "state", rec.R.State, "step", rec.R.Step, "reason", rec.Reason)
	c.commit(rec)
}

// commit persists rec and makes the policy follow it; failures are logged, and the next
// apply (a later transition, or the next start of the control plane) retries.
func (c *rollouts) commit(rec *rolloutRecord) {
	if err := c.persist(rec); err != nil {
		c.s.log.Error("rollout not persisted", "id", rec.ID, "err", err)
	}
	if err := c.apply(rec); err != nil {
		c.s.log.Error("rollout not applied to the policy", "id", rec.ID, "state", rec.R.State, "err", err)
	}
}

func (c *rollouts) persist(rec *rolloutRecord) error {
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("encoding rollout %d: %w", rec.ID, err)
	}
	return c.s.store.PutRollout(rec.ID, data)
}

// apply makes the registry's policy carry what rec's state asks, if it does not already.
// An ended rollout changes the policy only while the policy still carries its candidate
// (an operator's later change stands).
func (c *rollouts) apply(rec *rolloutRecord) error {
	pol := c.s.reg.Policy()
	// The policy carries this rollout's candidate under the version recorded, or under
	// another one when it went back in anew (below) and the record read since is older than
	// that: the candidate's routing, not only its number, says it is ours.
	ours := pol.Candidate != nil && (pol.Candidate.Version == rec.Candidate.Version || registry.SameRouting(*pol.Candidate, rec.Candidate))
	cause := fmt.Sprintf("rollout %d %s", rec.ID, rec.R.State)
	var p registry.Policy
	switch rec.R.State {
	case rollout.StatePromoted:
		if !ours {
			return nil
		}
		p = *pol.Candidate
		p.Version = pol.Version
	case rollout.StateRolledBack, rollout.StateAborted:
		if !ours {
			return nil
		}
		p = pol.Stable()
	default:
		share, shadow := rec.R.Share()
		if ours && pol.CandidateShare == share && pol.Shadow == shadow {
			return nil
		}
		p = pol.Stable()
		cand := rec.Candidate
		p.Candidate, p.CandidateShare, p.Shadow = &cand, share, shadow
	}
	next, err := c.s.reg.ChangePolicy(p, cause)
	if err != nil {
		return err
	}
	if nc := next.Candidate; nc != nil && nc.Version != rec.Candidate.Version {
		// The candidate went back in under a new version (the policy had lost it: an
		// operator's change, or a leader that stopped between the rollout's write and the
		// policy's): the rollout follows it, or its arms and its end would miss it.
		rec.Candidate.Version = nc.Version
		return c.persist(rec)
	}
	return nil
}

// control applies an operator's action: pause, resume, promote or abort.
func (c *rollouts) control(action string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	rec := c.cur
	if rec == nil {
		return fmt.Errorf("%w: %w", api.ErrNotFound, errRolloutNotFound)
	}
	now := c.now()
	var err error
	switch action {
	case "pause":
		err = rec.R.Pause(now)
	case "resume":
		err = rec.R.Resume(now)
	case "promote":
		err = rec.R.Promote()
	case "abort":
		err = rec.R.Abort()
	default:
		err = fmt.Errorf("unknown action %q", action)
	}
	if err != nil {
		return fmt.Errorf("%w: rollout %d: %w", api.ErrConflict, rec.ID, err)
	}
	if rec.R.Done() {
		rec.Ended, rec.Reason = now, rec.R.State+" by an operator"
	}
	c.s.log.Info("rollout "+action, "id", rec.ID, "state", rec.R.State)
	c.commit(rec)
	return nil
}

// latest returns a copy of the running or latest rollout and its running step's figures
// so far.
func (c *rollouts) latest() (*rolloutRecord, rollout.Result, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == nil {
		return nil, rollout.Result{}, fmt.Errorf("%w: %w", api.ErrNotFound, errRolloutNotFound)
	}
	// The candidate policy is never changed once recorded (apply hands the registry a
	// copy), so the record's copy may share its slices.
	rec := *c.cur
	rec.R = c.cur.R.Clone()
	var cur rollout.Result
	if !rec.R.Done() {
		nodes := c.s.nodeArms()
		if c.s.opts.Leader.Leading() {
			cur = rec.R.Current(c.stepArms(c.cur, nodes))
		} else {
			// A follower shows the step from the leader's bases and every proxy's figures
			// summed (its own proxy bases would start when it was first asked).
			arms := xdsserver.SumArms(nodes)
			cur = rec.R.Current(armOf(arms, rec.StableVersion), armOf(arms, rec.Candidate.Version))
		}
	}
	return &rec, cur, nil
}

// resume reconciles the policy with the stored rollout when the control plane starts
// (a transition persisted just before a crash may not have reached the policy).
func (c *rollouts) resume() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.started = c.now()
	if c.cur == nil {
		return
	}
	if err := c.apply(c.cur); err != nil {
		c.s.log.Error("stored rollout not applied to the policy", "id", c.cur.ID, "err", err)
	}
	if !c.cur.R.Done() {
		c.s.log.Info("rollout resumed", "id", c.cur.ID, "state", c.cur.R.State, "step", c.cur.R.Step)
	}
}

// runRollouts judges the running rollout every RolloutInterval until ctx ends, and takes
// over as soon as this replica wins the lead (checked every leadCheck).
func (s *Server) runRollouts(ctx context.Context) {
	t := time.NewTicker(s.opts.RolloutInterval)
	defer t.Stop()
	lead := time.NewTicker(leadCheck)
	defer lead.Stop()
	leading := s.opts.Leader.Leading() // a control plane alone leads from the start
	for {
		judge := false
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			judge = true
		case <-lead.C:
		}
		// Only the leader steps a rollout; a follower's view waits for the rollout the
		// leader writes. A replica that has just become the leader goes on from the stored
		// rollout, its step's figures gathered anew from now, and applies a policy edited
		// in Kubernetes while no one led.
		now := s.opts.Leader.Leading()
		if now && !leading {
			s.takeOver(ctx)
		}
		if s.opts.Leader != nil {
			s.acting.Store(now)
		}
		if leading = now; leading && judge {
			s.rollouts.tick()
		}
	}
}

// leadCheck is how often a replica looks whether it has won the lead: the takeover, and so
// the operator API's writes, wait at most this long after the Lease is won.
const leadCheck = 50 * time.Millisecond

// takeOver acts on the shared state as the API server has it, not as far as this replica's
// watch has got (the last leader's final writes may still be on their way), and resumes the
// stored rollout.
func (s *Server) takeOver(ctx context.Context) {
	if ks, ok := s.store.(*registry.KubeStore); ok {
		if err := ks.Refresh(ctx); err != nil {
			s.log.Error("shared state not read afresh on taking the lead", "store", ks.Where(), "err", err)
		}
		if err := s.reg.Reload(); err != nil {
			s.log.Error("shared state not reloaded", "store", ks.Where(), "err", err)
		}
	}
	s.rollouts.reload()
	s.rollouts.resume()
	s.stateChanged()
}
