package decide

import (
	"encoding/binary"
	"math"
	"strconv"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/dataplane/route"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// A rollout's candidate policy, pushed beside the stable one (RoutingPolicy.candidate):
// requests whose split fraction falls below its share route with it, the rest with the
// stable policy; in shadow, all route with the stable policy and the candidate's pick is
// only recorded. Each arm's requests are counted and timed under its policy version.

// Arms of a rollout.
const (
	armStable = iota
	armCandidate
)

// candidate is the candidate policy's router and its series.
type candidate struct {
	router  *route.Router
	version uint64
	share   float64
	shadow  bool
	arm     *armSeries
}

// armSeries are one policy version's series, and the same figures as counters for the load
// reports (ArmReport).
type armSeries struct {
	policy  string
	version string
	regret  *regretObs
	ttft    prometheus.Observer
	// outcomes count its answers: 2xx, the router's errors, the clients' errors, clients gone.
	outcomes [4]prometheus.Counter

	num              uint64 // the version; 0 for a static proxy's policy
	requests, errors atomic.Uint64
	ttftCounts       [len(armTTFTBounds) + 1]atomic.Uint64
	cached, prompt   atomic.Uint64
	// rejected counts 429 and 503 answers, server5xx those of 500 and above.
	rejected, server5xx atomic.Uint64
	itlCounts           [len(armITLBounds) + 1]atomic.Uint64
	hitCounts           [len(armHitBounds) + 1]atomic.Uint64
	// decisions placed, and the sum of their regret in blocks.
	decisions, regretSum atomic.Uint64
	// In shadow: decisions, disagreements, and the sums of each pick's overlap and worker
	// load (in the order of the shadow constants).
	shadowSums [shadowFields]atomic.Uint64
	// routerErr counts the answers the routing is answerable for (5xx, broken streams),
	// clientErr the 4xx other than 429, gone the requests whose client left first.
	routerErr, clientErr, gone atomic.Uint64
	// groups are the same figures split by conversation (armGroupOf).
	groups [armGroups]armGroup
}

// armGroups is how many conversation groups an arm's figures are split into: enough
// independent samples for a rollout's analysis to resample, few enough to report.
const armGroups = 64

// armGroup is one conversation group's figures in an arm.
type armGroup struct {
	requests, routerErr, clientErr, gone atomic.Uint64
	cached, prompt                       atomic.Uint64
	ttft                                 [len(armTTFTBounds) + 1]atomic.Uint64
	itl                                  [len(armITLBounds) + 1]atomic.Uint64
}

// The outcomes of an arm's answers, in armSeries.outcomes and its series' outcome label.
const (
	outcomeOK = iota
	outcomeRouterError
	outcomeClientError
	outcomeGone
)

var outcomeNames = [...]string{"ok", "router_error", "client_error", "client_gone"}

// How an answered request ends, for its arm (Request.ClientGone, Request.Broken).
const (
	endAnswered = iota // by its status
	endGone            // the client went away before its answer ended
	endBroken          // its stream broke after its head: the router's failure
)

// The shadow sums of an arm, in armSeries.shadowSums.
const (
	shadowPicks = iota
	shadowDisagree
	shadowStableOverlap
	shadowCandOverlap
	shadowStableLoad
	shadowCandLoad
	shadowFields
)

// armTTFTBounds are the TTFT buckets of each arm, in its histogram and its reports;
// armITLBounds those of the gaps between its content chunks.
var (
	armTTFTBounds = [...]float64{0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96}
	armITLBounds  = [...]float64{0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024}
	// armHitBounds bucket each request's share of prompt blocks cached; above the last, a
	// whole-prompt hit.
	armHitBounds = [...]float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99}
)

// bucket is the index of v's bucket among bounds (len(bounds): above the last).
func bucket(bounds []float64, v float64) int {
	i := 0
	for i < len(bounds) && v > bounds[i] {
		i++
	}
	return i
}

// armITL passes each inter-token gap to the model's histogram and to the request's arm
// and conversation group.
type armITL struct {
	model prometheus.Observer
	arm   *armSeries
	group int
}

func (t *armITL) Observe(v float64) {
	t.model.Observe(v)
	b := bucket(armITLBounds[:], v)
	t.arm.itlCounts[b].Add(1)
	t.arm.groups[t.group].itl[b].Add(1)
}

// observe records one answered request of the arm in its conversation group: its status
// and how it ended (end*), its TTFT when it had a first token, and, when the engine
// reported its cache, the prompt blocks cached of those it had.
func (a *armSeries) observe(group, status, end int, ttft float64, hasTTFT bool, cached, prompt int) {
	g := &a.groups[group]
	a.requests.Add(1)
	g.requests.Add(1)
	if status < 200 || status >= 300 {
		a.errors.Add(1)
		if status == 429 || status == 503 {
			a.rejected.Add(1)
		}
		if status >= 500 {
			a.server5xx.Add(1)
		}
	}
	switch {
	case end == endGone || status == 499:
		a.gone.Add(1)
		g.gone.Add(1)
		a.outcomes[outcomeGone].Inc()
	case end == endBroken || status >= 500 || status == 429:
		a.routerErr.Add(1)
		g.routerErr.Add(1)
		a.outcomes[outcomeRouterError].Inc()
	case status >= 400:
		a.clientErr.Add(1)
		g.clientErr.Add(1)
		a.outcomes[outcomeClientError].Inc()
	default:
		a.outcomes[outcomeOK].Inc()
	}
	if hasTTFT {
		b := bucket(armTTFTBounds[:], ttft)
		a.ttft.Observe(ttft)
		a.ttftCounts[b].Add(1)
		g.ttft[b].Add(1)
	}
	if prompt > 0 {
		c := max(min(cached, prompt), 0)
		a.cached.Add(uint64(c))
		a.prompt.Add(uint64(prompt))
		g.cached.Add(uint64(c))
		g.prompt.Add(uint64(prompt))
		a.hitCounts[bucket(armHitBounds[:], float64(c)/float64(prompt))].Add(1)
	}
}

// report is the arm's figures for a load report.
func (a *armSeries) report() *xdsv1.ArmReport {
	r := &xdsv1.ArmReport{PolicyVersion: a.num, Requests: a.requests.Load(), Errors: a.errors.Load(),
		TtftBounds: armTTFTBounds[:], TtftCounts: make([]uint64, len(a.ttftCounts)),
		CachedBlocks: a.cached.Load(), PromptBlocks: a.prompt.Load(),
		ShadowPicks: a.shadowSums[shadowPicks].Load(), ShadowDisagreements: a.shadowSums[shadowDisagree].Load(),
		ShadowStableOverlapBlocks: a.shadowSums[shadowStableOverlap].Load(), ShadowCandidateOverlapBlocks: a.shadowSums[shadowCandOverlap].Load(),
		ShadowStableLoad: a.shadowSums[shadowStableLoad].Load(), ShadowCandidateLoad: a.shadowSums[shadowCandLoad].Load(),
		Rejections: a.rejected.Load(), ServerErrors: a.server5xx.Load(),
		ItlBounds: armITLBounds[:], ItlCounts: make([]uint64, len(a.itlCounts)),
		Decisions: a.decisions.Load(), RegretBlocks: a.regretSum.Load(),
		HitBounds: armHitBounds[:], HitCounts: make([]uint64, len(a.hitCounts))}
	for i := range a.ttftCounts {
		r.TtftCounts[i] = a.ttftCounts[i].Load()
	}
	for i := range a.itlCounts {
		r.ItlCounts[i] = a.itlCounts[i].Load()
	}
	for i := range a.hitCounts {
		r.HitCounts[i] = a.hitCounts[i].Load()
	}
	r.RouterErrors, r.ClientErrors, r.ClientGone = a.routerErr.Load(), a.clientErr.Load(), a.gone.Load()
	for i := range a.groups {
		g := &a.groups[i]
		n := g.requests.Load()
		if n == 0 {
			continue
		}
		rg := &xdsv1.ArmGroup{Group: uint32(i), Requests: n, RouterErrors: g.routerErr.Load(), ClientErrors: g.clientErr.Load(),
			ClientGone: g.gone.Load(), CachedBlocks: g.cached.Load(), PromptBlocks: g.prompt.Load(),
			TtftCounts: make([]uint64, len(g.ttft)), ItlCounts: make([]uint64, len(g.itl))}
		for j := range g.ttft {
			rg.TtftCounts[j] = g.ttft[j].Load()
		}
		for j := range g.itl {
			rg.ItlCounts[j] = g.itl[j].Load()
		}
		r.Groups = append(r.Groups, rg)
	}
	return r
}

// retire drops the series of an arm no policy routes with any more, unless live (the
// arm routing now under another role) carries the same version.
func (c *Core) retire(a *armSeries, live ...*armSeries) {
	if a == nil {
		return
	}
	for _, l := range live {
		if l != nil && l.version == a.version {
			return
		}
	}
	m := c.m
	m.regretBlocks.DeleteLabelValues(a.policy, a.version)
	m.costGap.DeleteLabelValues(a.policy, a.version)
	m.armTTFT.DeleteLabelValues(a.version)
	for _, o := range outcomeNames {
		m.armRequests.DeleteLabelValues(a.version, o)
	}
}

// ArmReports are the figures of the arms routing now, for a load report.
func (c *Core) ArmReports() []*xdsv1.ArmReport {
	var out []*xdsv1.ArmReport
	if a := c.stableArm.Load(); a != nil && a.num != 0 {
		out = append(out, a.report())
	}
	if cand := c.cand.Load(); cand != nil {
		out = append(out, cand.arm.report())
	}
	return out
}

func (c *Core) newArmSeries(policy, version string) *armSeries {
	num, _ := strconv.ParseUint(version, 10, 64)
	a := &armSeries{
		policy:  policy,
		num:     num,
		version: version,
		regret: &regretObs{
			blocks: c.m.regretBlocks.WithLabelValues(policy, version),
			gap:    c.m.costGap.WithLabelValues(policy, version),
		},
		ttft: c.m.armTTFT.WithLabelValues(version),
	}
	for i, o := range outcomeNames {
		a.outcomes[i] = c.m.armRequests.WithLabelValues(version, o)
	}
	return a
}

// regretObs are a policy version's routing regret histograms.
type regretObs struct{ blocks, gap prometheus.Observer }

// setRegretLabels points the stable policy's series at policy and version.
func (c *Core) setRegretLabels(policy, version string) {
	old := c.stableArm.Swap(c.newArmSeries(policy, version))
	var cand *armSeries
	if cur := c.cand.Load(); cur != nil {
		cand = cur.arm
	}
	c.retire(old, c.stableArm.Load(), cand)
}

// observeRegret records what the decision d gave up, under the arm that made it.
func (c *Core) observeRegret(a *armSeries, d *route.Decision) {
	if a == nil {
		return
	}
	r := max(d.Achievable-d.Overlap, 0)
	a.regret.blocks.Observe(r)
	a.decisions.Add(1)
	a.regretSum.Add(uint64(math.Round(r)))
	if d.HasCost {
		a.regret.gap.Observe(max(d.CostGap, 0))
	}
}

// Candidate is a rollout's candidate policy: its version, routing settings, the share of
// requests it routes, or whether it only decides in shadow beside the stable policy.
type Candidate struct {
	Version uint64
	Config  route.Config
	Share   float64
	Shadow  bool
}

// CandidateStatus is the candidate routing now (ok false: none).
func (c *Core) CandidateStatus() (cand Candidate, ok bool) {
	cur := c.cand.Load()
	if cur == nil {
		return Candidate{}, false
	}
	return Candidate{Version: cur.version, Share: cur.share, Shadow: cur.shadow}, true
}

// ApplyCandidate follows a rollout's candidate policy (nil: none): a new one gets its own
// router over pool, matching prompts against index (sharing the workers, their load and the
// index with the stable router), a changed share or shadow applies at once, none removes
// it. Its Config is only read for a version new to the core.
func (c *Core) ApplyCandidate(pool *route.Pool, index prefix.Index, p *Candidate) {
	cur := c.cand.Load()
	if p == nil {
		if cur != nil {
			c.cand.Store(nil)
			c.retire(cur.arm, c.stableArm.Load())
			c.log.Info("rollout candidate removed", "version", cur.version)
		}
		return
	}
	if cur != nil && cur.version == p.Version {
		cur.router.SetPool(pool)
		if cur.share != p.Share || cur.shadow != p.Shadow {
			next := *cur
			next.share, next.shadow = p.Share, p.Shadow
			c.cand.Store(&next)
			c.log.Info("rollout candidate share", "version", next.version, "share", next.share, "shadow", next.shadow)
		}
		return
	}
	r, err := route.NewRouter(p.Config, pool, index)
	if err != nil {
		c.log.Error("rollout candidate not applied", "version", p.Version, "err", err)
		c.cand.Store(nil)
		return
	}
	c.cand.Store(&candidate{router: r, version: p.Version, share: p.Share, shadow: p.Shadow,
		arm: c.newArmSeries(p.Config.Policy, strconv.FormatUint(p.Version, 10))})
	if cur != nil {
		c.retire(cur.arm, c.stableArm.Load())
	}
	c.log.Info("rollout candidate applied", "version", p.Version, "policy", p.Config.Policy, "share", p.Share, "shadow", p.Shadow)
}

// splitFraction places a request in [0, 1) by a hash of what keeps a conversation
// together: its session id, else its user, else the chain hash of its prompt's first
// splitBlocks blocks (past the chat template's opening, which every prompt shares, and
// unchanged as a conversation grows), else its model and the start of its body. Every
// proxy and every restart places it alike.
func (r *Request) splitFraction() float64 {
	return float64(r.splitHash()>>11) / (1 << 53)
}

// armGroupOf is the request's conversation group in its arm's figures: the low bits of the
// hash whose high bits place it in the split, so that every request of a conversation
// falls in one group on every proxy.
func (r *Request) armGroupOf() int {
	return int(r.splitHash() % armGroups)
}

// splitHash is the hash of what keeps the request's conversation together (splitFraction).
func (r *Request) splitHash() uint64 {
	var h uint64
	switch rr := &r.rreq; {
	case rr.SessionID != "":
		h = xxh3.HashString(rr.SessionID)
	case len(r.oreq.User) > 0 && string(r.oreq.User) != "null":
		h = xxh3.Hash(r.oreq.User)
	case len(rr.Hashes) > 0:
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], rr.Hashes[min(len(rr.Hashes), splitBlocks)-1])
		h = xxh3.Hash(b[:])
	default:
		// The model's hash mixed with the body's start's, without joining them (no allocation:
		// every request's arm group comes from here).
		h = xxh3.Hash(r.oreq.Model)*0x9e3779b97f4a7c15 ^ xxh3.Hash(r.body[:min(len(r.body), 1024)])
	}
	return h
}

// usesIndex reports whether a policy routing now matches prompts against the index: the
// stable one, or a rollout's candidate (which must see the cache to be judged on it).
func (c *Core) usesIndex() bool {
	if c.kv.Policy().UsesIndex {
		return true
	}
	cand := c.cand.Load()
	return cand != nil && cand.router.Policy().UsesIndex
}

// splitBlocks is how many leading prompt blocks name a conversation for the split: 1,024
// tokens at vLLM's block size. A fleet's prompts often share their first few hundred
// tokens (a chat template's opening, one system prompt: the Mooncake trace's requests all
// share their first 512), so the split must reach past them to tell conversations apart,
// while a conversation's later turns still share the whole depth with its first.
const splitBlocks = 64

// armFor picks the router of a request: the candidate's for its share of requests, else
// stable.
func (r *Request) armFor(stable *route.Router) (*route.Router, *candidate) {
	c := r.c.cand.Load()
	if c == nil || c.shadow || c.share <= 0 || r.splitFraction() >= c.share {
		return stable, nil
	}
	return c.router, c
}

// shadowPick records, in shadow, what the candidate would have picked beside the stable
// decision, routing the carrier's scratch request.
func (r *Request) shadowPick() {
	c := r.c.cand.Load()
	if c == nil || !c.shadow {
		return
	}
	sr, d := r.scratch, &r.dec
	m := r.c.m
	r.rreq.CopyInputs(sr)
	sr.DryRun = true // the candidate binds no session to a worker that never served it
	var cd route.Decision
	if err := c.router.Route(sr, &cd); err != nil {
		m.shadow.WithLabelValues("no_pick").Inc()
		return
	}
	sums := &c.arm.shadowSums
	sums[shadowPicks].Add(1)
	if cd.Worker == d.Worker {
		m.shadow.WithLabelValues("agree").Inc()
	} else {
		m.shadow.WithLabelValues("disagree").Inc()
		sums[shadowDisagree].Add(1)
	}
	// Each pick's cached blocks come from whichever policy matched the prompt against the
	// index: one that does not (round-robin, say) has no overlap of its own to report.
	so, co := d.Overlap, cd.Overlap
	switch stableMatched, candMatched := r.c.kv.Policy().UsesIndex, c.router.Policy().UsesIndex; {
	case !stableMatched && candMatched:
		so = sr.Overlap(d.Worker)
	case stableMatched && !candMatched:
		co = r.rreq.Overlap(cd.Worker)
	}
	m.shadowOverlap.WithLabelValues("stable").Observe(so)
	m.shadowOverlap.WithLabelValues("candidate").Observe(co)
	sums[shadowStableOverlap].Add(uint64(math.Round(max(so, 0))))
	sums[shadowCandOverlap].Add(uint64(math.Round(max(co, 0))))
	if d.Worker != nil && cd.Worker != nil {
		sums[shadowStableLoad].Add(uint64(max(d.Worker.Load(), 0)))
		sums[shadowCandLoad].Add(uint64(max(cd.Worker.Load(), 0)))
	}
}
