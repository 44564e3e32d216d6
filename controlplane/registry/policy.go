package registry

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/xds"
	"github.com/kvrelay/kvrelay/xds/policy"
)

// Routing policy names, in Policy.Name (package xds/policy holds them for both planes).
const (
	PolicyKV          = policy.KV
	PolicyLatency     = policy.Latency
	PolicyRoundRobin  = policy.RoundRobin
	PolicyLeastLoaded = policy.LeastLoaded
	PolicyRandom      = policy.Random
	PolicyPowerOfTwo  = policy.PowerOfTwo
	PolicySession     = policy.Session
)

// PolicyNames lists the policy names Validate accepts. The returned slice is new on each
// call.
func PolicyNames() []string { return policy.Names() }

// Policy is the routing policy every proxy applies. Its fields mirror the xDS
// RoutingPolicy resource; zero busy thresholds turn those thresholds off.
type Policy struct {
	// Version names the way this policy routes: Registry.SetPolicy gives a changed policy
	// the next number and keeps it for a change that leaves the routing as it was (the
	// rollout's share, say).
	Version uint64 `json:"version"`
	// Name is the router policy, one of PolicyNames.
	Name string `json:"name"`
	// OverlapWeight is the kv cost of a prompt block a worker must compute, against 1 for a
	// KV block held by decodes; QueueWeight that of a block of its prefill backlog.
	OverlapWeight float64 `json:"overlap_weight"`
	QueueWeight   float64 `json:"queue_weight"`
	// Temperature > 0 samples a softmax over normalised costs instead of taking the lowest.
	Temperature float64 `json:"temperature"`
	// CacheThreshold is the share of a prompt's blocks the best overlap must reach for the
	// cache to decide the pick, in [0, 1].
	CacheThreshold float64 `json:"cache_threshold"`
	// TierWeights weigh a cached block by where it is: GPU, host memory, the worker's own
	// disk, storage shared by several workers; each in [0, 1], at most four. A tier left
	// out keeps its default weight.
	TierWeights []float64 `json:"tier_weights"`
	// Busy thresholds per worker: uncached prompt tokens still prefilling, KV blocks held
	// by decodes, share of the KV cache in use (in [0, 1]).
	BusyPrefillTokens uint64  `json:"busy_prefill_tokens"`
	BusyDecodeBlocks  uint64  `json:"busy_decode_blocks"`
	BusyKVFraction    float64 `json:"busy_kv_fraction"`
	// Disagg is "auto" (or empty) or "off": whether proxies split requests into prefill and
	// decode legs when the pool has both roles. DisaggThreshold, when set, overrides the
	// proxies' conditional-disaggregation threshold in tokens (negative: always remote).
	Disagg          string `json:"disagg,omitempty"`
	DisaggThreshold *int64 `json:"disagg_threshold,omitempty"`
	// KernelLoadSignals makes a control plane that runs the eBPF probes count connections
	// waiting in a worker's accept queue as waiting requests in its load, and raise its
	// waiting count to what its recent kernel-side request-to-first-byte latency implies
	// next to the fastest worker of its pool, so routing reacts to a backlog or a slow
	// engine before the engine's own metrics show it.
	KernelLoadSignals bool `json:"kernel_load_signals,omitempty"`
	// SessionTTL is how long a session stays bound to its worker (policy session).
	SessionTTL time.Duration `json:"session_ttl"`
	// ComputeWeight and BackgroundWeight, when set, tune the latency policy: the request's
	// own prefill time weighed again beside its predicted TTFT, and for a background
	// request once more per interactive request on the worker (unset: the proxies' own).
	ComputeWeight    *float64 `json:"compute_weight,omitempty"`
	BackgroundWeight *float64 `json:"background_weight,omitempty"`
	// Candidate, when set, is a rollout's candidate beside this (stable) policy: it routes
	// CandidateShare of the requests (in [0, 1]); with Shadow it routes none and proxies
	// record its picks. It has no candidate of its own. Its Version comes from the same
	// counter as the stable one's, so every version names one policy: SetPolicy gives a
	// new or changed candidate the next version, keeps an unchanged one's.
	Candidate      *Policy `json:"candidate,omitempty"`
	CandidateShare float64 `json:"candidate_share,omitempty"`
	Shadow         bool    `json:"shadow,omitempty"`
	// Profile, with Name policy.Custom, is the policy as data: filters, scorers and picker
	// by the names of the proxies' plugin registry (xds/policy.Profile).
	Profile *policy.Profile `json:"profile,omitempty"`
	// Issued is the highest version ever given out (kept by SetPolicy, which ignores the
	// caller's), so that a version stays one policy's even after a candidate that had it
	// was dropped.
	Issued uint64 `json:"issued,omitempty"`
}

// DefaultPolicy is the policy served until an operator sets one, version 1: latency
// (policy.Default) with package policy's default weights and cache threshold, greedy pick
// (temperature 0), tier weights GPU 1, host 0.75, disk 0.25 (docs/routing-cost.md; the same as
// xds.DefaultPolicy), no busy thresholds, sessions kept 30 minutes.
func DefaultPolicy() Policy {
	return Policy{
		Version:        1,
		Name:           policy.Default,
		OverlapWeight:  policy.DefaultOverlapWeight,
		QueueWeight:    policy.DefaultQueueWeight,
		CacheThreshold: policy.DefaultCacheThreshold,
		TierWeights:    policy.DefaultTierWeights(),
		SessionTTL:     policy.DefaultSessionTTL,
	}
}

// Validate reports what is wrong with p, or nil: the name must be one of PolicyNames;
// overlap weight and temperature finite, non-negative and within xds.MaxWeight and
// xds.MaxTemperature; cache threshold, busy KV fraction and each of at most xds.NumTiers
// tier weights in [0, 1]; session TTL in [0, a week]. A policy that passes also passes
// xds.ValidatePolicy. Version is not checked. Errors wrap ErrInvalid.
func (p Policy) Validate() error {
	if err := p.validate(); err != nil {
		return fmt.Errorf("%w: policy: %w", ErrInvalid, err)
	}
	return nil
}

func (p Policy) validate() error {
	switch {
	case p.Profile != nil && p.Name != policy.Custom:
		return fmt.Errorf("a profile under name %q: a profile is policy %s", p.Name, policy.Custom)
	case p.Profile != nil:
		if err := p.Profile.Check(); err != nil {
			return err
		}
	case p.Name == policy.Custom:
		return fmt.Errorf("policy %s without a profile", policy.Custom)
	case !slices.Contains(PolicyNames(), p.Name):
		return fmt.Errorf("name %q: want one of %s, or %s with a profile", p.Name, strings.Join(PolicyNames(), ", "), policy.Custom)
	}
	if err := checkRange("overlap weight", p.OverlapWeight, 0, xds.MaxWeight); err != nil {
		return err
	}
	if err := checkRange("queue weight", p.QueueWeight, 0, xds.MaxWeight); err != nil {
		return err
	}
	if err := checkRange("temperature", p.Temperature, 0, xds.MaxTemperature); err != nil {
		return err
	}
	if err := checkRange("cache threshold", p.CacheThreshold, 0, 1); err != nil {
		return err
	}
	if err := checkRange("busy kv fraction", p.BusyKVFraction, 0, 1); err != nil {
		return err
	}
	if len(p.TierWeights) > xds.NumTiers {
		return fmt.Errorf("%d tier weights, at most %d (GPU, host, disk, shared storage)", len(p.TierWeights), xds.NumTiers)
	}
	for i, tw := range p.TierWeights {
		if err := checkRange(fmt.Sprintf("tier weight %d", i), tw, 0, 1); err != nil {
			return err
		}
	}
	if maxTTL := time.Duration(xds.MaxSessionTTLMillis) * time.Millisecond; p.SessionTTL < 0 || p.SessionTTL > maxTTL {
		return fmt.Errorf("session ttl %v outside [0, %v]", p.SessionTTL, maxTTL)
	}
	if p.Disagg != "" && p.Disagg != "auto" && p.Disagg != "off" {
		return fmt.Errorf("disagg %q: want auto or off", p.Disagg)
	}
	for what, v := range map[string]*float64{"compute weight": p.ComputeWeight, "background weight": p.BackgroundWeight} {
		if v != nil {
			if err := checkRange(what, *v, 0, xds.MaxWeight); err != nil {
				return err
			}
		}
	}
	if err := checkRange("candidate share", p.CandidateShare, 0, 1); err != nil {
		return err
	}
	switch c := p.Candidate; {
	case c == nil && (p.CandidateShare > 0 || p.Shadow):
		return fmt.Errorf("a candidate share or shadow without a candidate")
	case c != nil && c.Candidate != nil:
		return fmt.Errorf("the candidate has a candidate")
	case c != nil && (c.CandidateShare != 0 || c.Shadow):
		return fmt.Errorf("the candidate has a share or shadow of its own")
	case c != nil:
		if err := c.validate(); err != nil {
			return fmt.Errorf("candidate: %w", err)
		}
	}
	return nil
}

func checkRange(what string, v, lo, hi float64) error {
	if math.IsNaN(v) || v < lo || v > hi {
		return fmt.Errorf("%s %g outside [%g, %g]", what, v, lo, hi)
	}
	return nil
}

// clone returns p with its own TierWeights and optional weights.
func (p Policy) clone() Policy {
	p.TierWeights = slices.Clone(p.TierWeights)
	p.ComputeWeight = clonePtr(p.ComputeWeight)
	p.BackgroundWeight = clonePtr(p.BackgroundWeight)
	p.DisaggThreshold = clonePtr(p.DisaggThreshold)
	if p.Profile != nil {
		c := p.Profile.Clone()
		p.Profile = &c
	}
	if p.Candidate != nil {
		c := p.Candidate.clone()
		p.Candidate = &c
	}
	return p
}

// latest is the largest version p and its candidate use.
func (p Policy) latest() uint64 {
	if p.Candidate != nil {
		return max(p.Version, p.Candidate.Version)
	}
	return p.Version
}

// SameRouting reports whether a and b route alike: every field but the versions.
func SameRouting(a, b Policy) bool {
	a.Version, b.Version, a.Issued, b.Issued = 0, 0, 0, 0
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

func clonePtr[T any](v *T) *T {
	if v == nil {
		return nil
	}
	c := *v
	return &c
}

// nextPolicy returns p as the successor of cur: validated, with version cur.Version+1. A
// non-zero p.Version must equal cur.Version (the version the caller read and changed), so
// that two operators editing at once do not silently undo each other.
func nextPolicy(cur, p Policy) (Policy, error) {
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	if p.Version != 0 && p.Version != cur.Version {
		return Policy{}, fmt.Errorf("%w: the policy is at version %d, not %d", ErrVersionConflict, cur.Version, p.Version)
	}
	p = p.clone()
	// A version names one way of routing: the stable policy and the candidate each keep
	// theirs while they route as before (a rollout's share moving changes neither; a
	// promoted candidate keeps its own as the stable one), and a new or changed one takes
	// the next number never given out.
	next := max(cur.latest(), cur.Issued) + 1
	switch {
	case SameRouting(cur.Stable(), p.Stable()) && cur.Version != 0:
		p.Version = cur.Version
	case cur.Candidate != nil && p.Candidate == nil && SameRouting(*cur.Candidate, p.Stable()):
		p.Version = cur.Candidate.Version
	default:
		p.Version, next = next, next+1
	}
	if c := p.Candidate; c != nil {
		if old := cur.Candidate; old != nil && SameRouting(*old, *c) {
			c.Version = old.Version
		} else {
			c.Version = next
		}
	}
	p.Issued = max(cur.Issued, p.latest())
	return p, nil
}

// Stable is p without its rollout (candidate, share, shadow), at p's version.
func (p Policy) Stable() Policy {
	p.Candidate, p.CandidateShare, p.Shadow = nil, 0, false
	return p
}
