package route

import (
	"errors"
	"fmt"
	"sort"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/policy"
)

// Errors Route returns.
var (
	// ErrNoWorker: no worker serves the model or every one is unhealthy or tried.
	ErrNoWorker = errors.New("no worker can serve the request")
	// ErrBusy: workers exist but every one is past its busy thresholds; the request should
	// wait for capacity.
	ErrBusy = errors.New("every eligible worker is busy")
)

// Policy names (package xds/policy holds them for both planes).
const (
	PolicyKV = policy.KV
	// PolicyDefault is the policy a Config that names none gets: latency.
	PolicyDefault     = policy.Default
	PolicyLatency     = policy.Latency
	PolicyRoundRobin  = policy.RoundRobin
	PolicyLeastLoaded = policy.LeastLoaded
	PolicyRandom      = policy.Random
	PolicyPowerOfTwo  = policy.PowerOfTwo
	PolicySession     = policy.Session
)

// PolicyNames lists the policies NewPolicy knows.
func PolicyNames() []string { return policy.Names() }

// Defaults of the kv policy's weights, in cost per KV block. An uncached prompt block is
// weighed far above a block of someone else's queued prefill, and that above a block held
// by running requests: computing a block again costs the worker's capacity for every later
// request, waiting behind a queue costs this request only, and held blocks matter only when
// a worker's cache nears full or its decode batch grows. Measured on the Mooncake
// conversation trace (8 workers of 65536 blocks, round-robin loaded to what a saturated run
// then gave as ~80% of its capacity, an overstatement: see hack/bench-compare.sh capacity):
// weights 64/2/1 reached 85% of the ideal hit rate, where one weight for both prefill terms
// (4/4/1) reached 47% and 64/64/1 57%, both losing follow-up turns to workers with shorter
// prefill queues.
// Held blocks at 0.1 instead of 1 let a worker's decode batch grow unchecked: on the agentic
// workload, whose requests all share a preamble every worker caches, sessions piled onto a
// few workers and TTFT p50 reached 12 s against round-robin's 0.16 s.
//
// The queue term weighs the worker's prefill backlog (Worker.PrefillBacklog: pending tokens
// less what the engine has computed since, at its learned rate), not every pending token: a
// long prompt that has mostly been computed no longer looks like a long queue. That let the
// queue weight rise from 2 to 8 without the hit-rate loss 8 cost on pending tokens (Mooncake,
// kv alone: 86.1% and 86.5% of the ideal against 82.6%; TTFT p50 231 ms against 240-248 at
// 2), and it took the agentic workload's TTFT tail at 1200 sessions (calls naming no session,
// 8 workers) from p99 611 ms to 236 ms (round-robin: 277), p50 from 110 to 89 ms: cache
// affinity no longer piles a burst of a worker's sessions behind one another.
const (
	DefaultOverlapWeight  = policy.DefaultOverlapWeight
	DefaultQueueWeight    = policy.DefaultQueueWeight
	DefaultCacheThreshold = policy.DefaultCacheThreshold
	DefaultDecodeWeight   = policy.DefaultDecodeWeight
)

// Config tunes routing. The zero value of a field means its default.
type Config struct {
	// Policy is one of PolicyNames; default PolicyDefault (latency).
	Policy string
	// Explicit says every weight and threshold is as given, a zero included, as in a
	// policy whose fields all come set (the control plane's, a proxy's config): without it
	// a zero OverlapWeight, QueueWeight or CacheThreshold means the default.
	Explicit bool
	// OverlapWeight is the kv cost of one prompt block the worker would have to compute,
	// against DefaultDecodeWeight for a KV block held by running requests (default
	// DefaultOverlapWeight). Under the latency policy, its share of the default (at most 1)
	// is the share of a worker's cached blocks the prediction credits: 0 is load-only.
	OverlapWeight float64
	// QueueWeight is the kv cost of one block of the worker's prefill backlog, the uncached
	// prompt tokens it still has to compute before a new request's (default
	// DefaultQueueWeight).
	QueueWeight float64
	// Temperature > 0 samples among workers by a softmax over normalised costs (default 0:
	// the cheapest wins).
	Temperature float64
	// ComputeWeight and BackgroundWeight tune the latency policy (PredictedTTFT). They are
	// taken as they are, 0 included; the proxy's defaults are DefaultComputeWeight and
	// DefaultBackgroundWeight.
	ComputeWeight, BackgroundWeight float64
	// BatchWeight weighs the decode slowdown a request's joining a batch causes (latency
	// policy; default DefaultBatchWeight).
	BatchWeight float64
	// WaitWeight weighs the wait for a sequence slot once more (latency policy; default
	// DefaultWaitWeight).
	WaitWeight float64
	// TailWeight weighs the prediction's spread (Prediction.Spread) beside its mean: the
	// latency policy routes on TTFT + TailWeight·σ, so a worker whose predictions have
	// been unreliable, or whose wait is a guess, needs a clearer lead to win (latency
	// policy; default DefaultTailWeight).
	TailWeight float64
	// BalanceWeight weighs the slots a request takes from a worker that has few
	// (Prediction.Hold × Prediction.Scarcity): the wait or cache miss it leaves the next
	// requests that want that worker (latency policy; default DefaultBalanceWeight).
	BalanceWeight float64
	// Explore is the share of decisions that try a worker whose model has learned nothing
	// lately, when one is predicted within a quarter of the best (latency policy,
	// LatencyPick.Explore; default DefaultExplore).
	Explore float64
	// Onboard is how the latency policy treats a prompt's blocks a worker caches below GPU
	// memory: OnboardWeigh ("" too) predicts loading them against computing them and takes the
	// sooner (telling the worker max_load_tokens 0 when computing wins), OnboardAlways always
	// loads them, OnboardNever always computes them.
	Onboard string
	// CacheThreshold: when no worker caches this share of the prompt's blocks more than the
	// worker that caches least (a new prompt, or one whose only cached part is a system
	// prompt every worker holds), the kv policy spreads instead, to the worker with the least
	// prefill in flight, and the latency policy predicts as if every worker cached as little
	// as the one that caches least (default DefaultCacheThreshold).
	CacheThreshold float64
	// Busy are the thresholds past which a worker takes no new request.
	Busy BusyFilter
	// SessionTTL is how long a session stays bound to its worker after its last request
	// (default 30 minutes).
	SessionTTL time.Duration
	// Profile, when set, is the policy as data (Policy is then policy.Custom, the default
	// with a profile): its filters, scorers and picker instead of a built-in name's. Plugins
	// resolves it and the built-in names' presets (nil: Builtins).
	Profile *policy.Profile
	Plugins *Registry
}

func (c Config) withDefaults() Config {
	switch {
	case c.Policy == "" && c.Profile != nil:
		c.Policy = policy.Custom
	case c.Policy == "":
		c.Policy = policy.Default
	}
	if c.Explicit {
		// A zero weight or threshold is the operator's zero.
		if c.SessionTTL == 0 {
			c.SessionTTL = policy.DefaultSessionTTL
		}
		return c
	}
	if c.OverlapWeight == 0 {
		c.OverlapWeight = DefaultOverlapWeight
	}
	if c.QueueWeight == 0 {
		c.QueueWeight = DefaultQueueWeight
	}
	if c.CacheThreshold == 0 {
		c.CacheThreshold = DefaultCacheThreshold
	}
	if c.SessionTTL == 0 {
		c.SessionTTL = policy.DefaultSessionTTL
	}
	return c
}

// Validate reports the first setting that cannot work.
func (c Config) Validate() error {
	c = c.withDefaults()
	if c.Profile != nil && c.Policy != policy.Custom {
		return fmt.Errorf("a profile is policy %s, not %s", policy.Custom, c.Policy)
	}
	if _, err := NewPolicy(c); err != nil {
		return err
	}
	switch {
	case c.OverlapWeight < 0:
		return fmt.Errorf("overlap weight %g must not be negative", c.OverlapWeight)
	case c.QueueWeight < 0:
		return fmt.Errorf("queue weight %g must not be negative", c.QueueWeight)
	case c.Temperature < 0:
		return fmt.Errorf("temperature %g must not be negative", c.Temperature)
	case c.CacheThreshold < 0 || c.CacheThreshold > 1:
		return fmt.Errorf("cache threshold %g must be within [0, 1]", c.CacheThreshold)
	case !(c.ComputeWeight >= 0 && c.ComputeWeight <= 1e6) || !(c.BackgroundWeight >= 0 && c.BackgroundWeight <= 1e6) || !(c.BatchWeight >= 0 && c.BatchWeight <= 1e6) || !(c.WaitWeight >= 0 && c.WaitWeight <= 1e6):
		return fmt.Errorf("compute weight %g, background weight %g, batch weight %g and wait weight %g must be within [0, 1e6]", c.ComputeWeight, c.BackgroundWeight, c.BatchWeight, c.WaitWeight)
	case c.Onboard != "" && c.Onboard != OnboardWeigh && c.Onboard != OnboardAlways && c.Onboard != OnboardNever:
		return fmt.Errorf("onboard %q: want %s, %s or %s", c.Onboard, OnboardWeigh, OnboardAlways, OnboardNever)
	case !(c.Explore >= 0 && c.Explore <= 1):
		return fmt.Errorf("explore %g must be within [0, 1]", c.Explore)
	case !(c.TailWeight >= 0 && c.TailWeight <= 1e6) || !(c.BalanceWeight >= 0 && c.BalanceWeight <= 1e6):
		return fmt.Errorf("tail weight %g and balance weight %g must be within [0, 1e6]", c.TailWeight, c.BalanceWeight)
	}
	return nil
}

// Policy is a named composition of plugins.
type Policy struct {
	Name    string
	Filters []Filter
	Busy    BusyFilter
	Scorers []Scorer
	Picker  Picker
	// UsesIndex makes the router match the prompt against the KV index before scoring.
	UsesIndex bool
	// Predicts marks a policy whose scorers predict latency (PredictedTTFT): the Decision
	// carries the chosen worker's prediction, requests with latency targets go only where
	// they are predicted to be met, and sessions are a matter of cache, not binding.
	Predicts bool
	// Spread picks instead of the scorers and Picker when no worker caches at least
	// CacheThreshold of the prompt's blocks more than the one that caches least (kv:
	// LeastPrefill). A predicting policy has no Spread: below the threshold its prediction
	// counts every worker's cache as the least one's, so that load alone separates them and
	// distinct new prompts do not pile onto the worker that holds a few of their blocks.
	Spread         Picker
	CacheThreshold float64
}

// NewPolicy builds the policy cfg names (its Preset) or, for a Profile, the one it
// describes, with cfg's registry of plugins (Builtins when none).
func NewPolicy(cfg Config) (*Policy, error) {
	cfg = cfg.withDefaults()
	reg := cfg.Plugins
	if reg == nil {
		reg = Builtins()
	}
	if cfg.Profile != nil {
		return reg.Build(*cfg.Profile, cfg)
	}
	prof, err := Preset(cfg)
	if err != nil {
		return nil, err
	}
	return reg.Build(prof, cfg)
}

// Pool is an immutable set of workers. Replacing a worker's identity means a new Pool; load
// lives in the *Worker values, so a new pool should reuse the Worker of every worker that
// stays.
type Pool struct {
	Workers []*Worker
	byID    map[string]*Worker
	models  []string
	size    int
	// roles[model] has bit 1<<RolePrefill when a prefill worker serves model, 1<<RoleDecode
	// for a decode worker ("" for workers that serve any model); adapters count as models.
	roles map[string]uint8
	// adapters maps each LoRA adapter to the base model of the first worker listing it.
	adapters map[string]string
	// maxLen[model] is the longest context among its workers, -1 when one is unknown.
	maxLen map[string]int
}

// NewPool numbers ws (setting each Index) and returns the pool. The pool owns ws.
func NewPool(ws []*Worker) *Pool {
	for i, w := range ws {
		w.Index = i
	}
	return NewPoolIndexed(ws)
}

// NewPoolIndexed returns a pool of ws keeping the Index each worker already has, so that a
// proxy whose workers come and go (from a control plane) can keep per-worker state in
// slices indexed by a position that never changes while the worker lives. Indexes must be
// distinct and not negative; there may be holes. The pool owns ws.
func NewPoolIndexed(ws []*Worker) *Pool {
	p := &Pool{Workers: ws, byID: make(map[string]*Worker, len(ws)), roles: map[string]uint8{}, maxLen: map[string]int{}}
	attachModels(ws)
	seen := map[string]bool{}
	for _, w := range ws {
		p.size = max(p.size, w.Index+1)
		p.byID[w.ID] = w
		p.roles[w.Model] |= 1 << w.Role
		if w.Model != "" && !seen[w.Model] {
			seen[w.Model] = true
			p.models = append(p.models, w.Model)
		}
		p.noteMaxLen(w.Model, w.MaxModelLen)
		for _, a := range w.LoRAs {
			p.noteMaxLen(a, w.MaxModelLen)
			p.roles[a] |= 1 << w.Role
			if p.adapters == nil {
				p.adapters = map[string]string{}
			}
			if _, ok := p.adapters[a]; !ok {
				p.adapters[a] = w.Model
			}
		}
	}
	for a := range p.adapters {
		if seen[a] { // a base model somewhere: not an adapter
			delete(p.adapters, a)
			continue
		}
		seen[a] = true
		p.models = append(p.models, a)
	}
	sort.Strings(p.models)
	return p
}

func (p *Pool) noteMaxLen(model string, n int) {
	if n <= 0 {
		n = -1
	}
	if cur, ok := p.maxLen[model]; !ok || (cur >= 0 && (n < 0 || n > cur)) {
		p.maxLen[model] = n
	}
}

// MaxModelLen is the longest context in tokens of the workers that serve model, 0 when one
// of them (or one serving any model) does not say: a longer prompt fits on none of them.
func (p *Pool) MaxModelLen(model string) int {
	n, ok := p.maxLen[model]
	a, anyOK := p.maxLen[""] // workers that serve any model
	switch {
	case !ok && !anyOK:
		return 0
	case !ok:
		n = a
	case anyOK && (n < 0 || a < 0):
		n = -1
	case anyOK:
		n = max(n, a)
	}
	return max(n, 0)
}

// Adapter reports whether model is a LoRA adapter of the pool (a name some worker lists
// among its LoRAs and none serves as its model) and, if so, the base model it adapts.
func (p *Pool) Adapter(model string) (base string, ok bool) {
	base, ok = p.adapters[model]
	return base, ok
}

// attachModels ties every worker of ws to the latency model of its model and role: the one
// a worker of ws that stays already shares, or a new one. The workers that serve one model
// in one role learn one model together (each keeps its own speed against it).
func attachModels(ws []*Worker) {
	type key struct {
		model string
		role  Role
	}
	models := map[key]*latency.Model{}
	for _, w := range ws {
		if m := w.latModel.Load(); m != nil && !w.latAlone.Load() {
			if _, ok := models[key{w.Model, w.Role}]; !ok {
				models[key{w.Model, w.Role}] = m
			}
		}
	}
	for _, w := range ws {
		k := key{w.Model, w.Role}
		m := models[k]
		if m == nil {
			m = new(latency.Model)
			m.Init()
			models[k] = m
		}
		w.attachModel(m)
	}
}

// Size is one more than the largest worker Index: the length of slices indexed by Index.
func (p *Pool) Size() int { return p.size }

// Worker returns the worker with the given id, or nil.
func (p *Pool) Worker(id string) *Worker { return p.byID[id] }

// Models returns the distinct models and LoRA adapters the pool serves, sorted. The slice
// must not be altered.
func (p *Pool) Models() []string { return p.models }

// Serves reports whether some worker serves model (a worker without a model serves any).
func (p *Pool) Serves(model string) bool {
	for _, w := range p.Workers {
		if w.Model == "" || w.Model == model {
			return true
		}
	}
	_, ok := p.adapters[model]
	return ok
}

// Disaggregated reports whether the pool has both prefill-role and decode-role workers for
// model, so that its requests can be split into a prefill leg and a decode leg.
func (p *Pool) Disaggregated(model string) bool {
	const both = 1<<RolePrefill | 1<<RoleDecode
	return (p.roles[model]|p.roles[""])&both == both
}

// Decision is how Route chose.
type Decision struct {
	Worker *Worker
	// Overlap is the chosen worker's cached prompt blocks, BestOverlap the best of any.
	Overlap, BestOverlap float64
	// Achievable is the most cached prompt blocks among the workers that could take the
	// request (past the filters and the busy thresholds): Achievable − Overlap is the
	// decision's routing regret in blocks.
	Achievable float64
	// CostGap is, for a decision by cost, the chosen worker's cost less the cheapest
	// candidate's, in the policy's units (seconds for latency, blocks for kv): what
	// sampling, ties, sessions' stickiness or the spread rule gave up (HasCost).
	CostGap float64
	HasCost bool
	// Mode says which rule decided: "cost", "spread", "session", "slo", "affinity" (Request.Pin) or the picker's name.
	Mode string
	// Match and Score are the time spent matching the index and scoring, when the request
	// asked to be timed.
	Match, Score time.Duration
	// Prediction is the chosen worker's predicted latency, under a policy that predicts
	// (HasPrediction).
	Prediction    latency.Prediction
	HasPrediction bool
	// PeerFetch, when not nil, is the worker to pull the prompt's prefix from: the chosen
	// worker is predicted to answer sooner pulling what PeerFetch caches than computing it.
	PeerFetch *Worker
	// Recompute: the chosen worker is predicted to answer sooner computing the prompt blocks
	// it caches below GPU memory than loading them back (a slow disk, shared storage under
	// load): it is told to load none (vLLM's kv_transfer_params max_load_tokens 0).
	Recompute bool
}

// Router routes requests over the current pool with one policy. It is safe for concurrent
// use by every event loop; SetPool swaps the pool atomically.
type Router struct {
	policy   atomic.Pointer[Policy]
	index    prefix.Index
	pool     atomic.Pointer[Pool]
	sessions sessions
}

// NewRouter returns a router for cfg's policy over pool, matching prompts against index (nil:
// no index, every overlap 0).
func NewRouter(cfg Config, pool *Pool, index prefix.Index) (*Router, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p, err := NewPolicy(cfg)
	if err != nil {
		return nil, err
	}
	r := &Router{index: index}
	r.policy.Store(p)
	r.sessions.ttl.Store(int64(cfg.SessionTTL))
	r.sessions.init(maxSessions)
	r.pool.Store(pool)
	return r, nil
}

// Pool returns the current pool.
func (r *Router) Pool() *Pool { return r.pool.Load() }

// SetPool replaces the pool; requests already routed keep their workers.
func (r *Router) SetPool(p *Pool) { r.pool.Store(p) }

// Policy returns the router's policy.
func (r *Router) Policy() *Policy { return r.policy.Load() }

// SetPolicy replaces the policy (a control plane pushed a new one); requests being routed
// finish with the old one. Sessions stay bound.
func (r *Router) SetPolicy(cfg Config) error {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	p, err := NewPolicy(cfg)
	if err != nil {
		return err
	}
	r.policy.Store(p)
	r.sessions.ttl.Store(int64(cfg.SessionTTL))
	return nil
}

// Route picks the worker for req and fills d. It returns ErrNoWorker when no worker can
// serve the request and ErrBusy when all that could are busy.
//
// Before any of the policy's filters, the router itself keeps only the workers that may take
// a request at all: healthy ones (not draining, not ejected) that req.Exclude does not name
// (the workers a retry already tried, or those outside a gateway's endpoint subset). No
// profile can route around that. It copies them into req's candidate buffers, so that no
// filter, scorer or picker ever sees (or could alter) the pool's own slice.
func (r *Router) Route(req *Request, d *Decision) error {
	*d = Decision{}
	req.preds = req.preds[:0]
	pool := r.pool.Load()
	policy := r.policy.Load()
	now := req.Now
	if now == 0 {
		now = Now()
	}
	if n := len(pool.Workers); cap(req.eligible) < n || cap(req.scratch) < n {
		// Once per request buffer and pool size: no filter's output outgrows them.
		req.eligible, req.scratch = make([]*Worker, 0, n), make([]*Worker, 0, n)
	}
	req.eligible = admissible(req, pool.Workers, now, req.eligible[:0])
	cur := req.eligible
	for _, f := range policy.Filters {
		out := f.Filter(req, cur, req.scratch[:0])
		if !sameArray(out, req.scratch) {
			// A filter that returned its input (or a slice of its own): copy, so that the
			// two buffers stay apart and the next filter never writes the slice it reads.
			out = append(req.scratch[:0], out...)
		}
		cur, req.scratch, req.eligible = out, req.eligible[:0], out
	}
	if len(cur) == 0 {
		return ErrNoWorker
	}
	if req.Pin != "" {
		for _, w := range cur {
			if w.ID == req.Pin {
				d.Worker, d.Mode, req.Pinned = w, "affinity", true
				return nil
			}
		}
		if req.PinOnly {
			return ErrNoWorker
		}
	}
	req.holders = req.holders[:0]
	if policy.Busy != (BusyFilter{}) {
		if policy.Predicts && canFetch(cur) {
			// A worker too busy to take the request can still give its cached blocks.
			req.holders = append(req.holders, cur...)
		}
		req.scratch = policy.Busy.Filter(req, cur, req.scratch[:0])
		cur, req.scratch, req.eligible = req.scratch, req.eligible[:0], req.scratch
		if len(cur) == 0 {
			return ErrBusy
		}
	}
	ws := cur

	if policy.UsesIndex && r.index != nil && len(req.Hashes) > 0 {
		var t0 time.Time
		if req.Timed {
			t0 = time.Now()
		}
		req.overlap = growFloat(req.overlap, pool.size)
		req.held, _ = r.index.(prefix.HeldIndex)
		if ti, ok := r.index.(prefix.TierIndex); ok && policy.Predicts {
			if cap(req.lower) < pool.size {
				req.lower = make([]blockset.Lower, pool.size)
			}
			req.lower = req.lower[:pool.size]
			req.best = prefix.MatchTiersAt(ti, req.Hashes, req.overlap, req.lower, req.Now)
		} else {
			req.lower = nil
			req.best = prefix.MatchAt(r.index, req.Hashes, req.overlap, req.Now)
		}
		if req.Timed {
			d.Match = time.Since(t0)
		}
	} else {
		req.overlap = growFloat(req.overlap, pool.size)
		req.best = 0
	}
	d.BestOverlap = req.best
	// Over the workers that could take it, whichever rule decides: the spread rule below
	// asks whether any of them (not a worker filtered out: busy, excluded, of another role)
	// caches a useful share more than another.
	if req.best > 0 {
		for _, w := range ws {
			d.Achievable = max(d.Achievable, req.Overlap(w))
		}
	}
	// What a candidate can have cached: more than it caches itself when it can fetch from
	// a worker the busy filter took out.
	reach := d.Achievable
	if req.best > reach && len(req.holders) > len(ws) && canFetch(ws) {
		reach = req.best
	}

	if req.SessionID != "" && !policy.Predicts {
		if id, ok := r.sessions.get(req.SessionID, now); ok {
			for _, w := range ws {
				if w.ID == id {
					d.Worker, d.Mode = w, "session"
					d.Overlap = req.Overlap(w)
					if !req.DryRun {
						r.sessions.put(req.SessionID, w.ID, now)
					}
					return nil
				}
			}
		}
	}

	var t0 time.Time
	if req.Timed {
		t0 = time.Now()
	}
	var i int
	switch {
	case policy.Spread != nil && reach-leastOverlap(req, ws) < policy.CacheThreshold*float64(req.PromptBlocks(ws[0].BlockSize)):
		i, d.Mode = policy.Spread.Pick(req, ws, nil), "spread"
	case len(policy.Scorers) > 0:
		d.Mode = "cost"
		req.flat = false
		if policy.Predicts && policy.CacheThreshold > 0 {
			lo := leastOverlap(req, ws)
			if reach-lo < policy.CacheThreshold*float64(req.PromptBlocks(ws[0].BlockSize)) {
				req.flat, req.flatOverlap, d.Mode = true, lo, "spread"
			}
		}
		req.costs = growFloat(req.costs, len(ws))
		for _, s := range policy.Scorers {
			s.Score(req, ws, req.costs)
		}
		if policy.Predicts && (req.SLOTTFT > 0 || req.SLOTPOT > 0) {
			if len(req.preds) != len(ws) {
				return errNoPredictions
			}
			n := meetSLO(req, ws, req.costs)
			if n == 0 {
				return ErrSLO
			}
			ws, req.costs, req.preds = ws[:n], req.costs[:n], req.preds[:n]
			req.candidates = ws
			d.Mode = "slo"
		}
		i = policy.Picker.Pick(req, ws, req.costs)
		cheapest := req.costs[0]
		for _, c := range req.costs[1:len(ws)] {
			cheapest = min(cheapest, c)
		}
		d.CostGap, d.HasCost = req.costs[i]-cheapest, true
	default:
		i, d.Mode = policy.Picker.Pick(req, ws, nil), policy.Picker.Name()
	}
	if req.Timed {
		d.Score = time.Since(t0)
	}
	d.Worker = ws[i]
	d.Overlap = req.Overlap(ws[i])
	if policy.Predicts && i < len(req.preds) {
		d.Prediction, d.HasPrediction = req.preds[i], true
		if i < len(req.fetch) {
			d.PeerFetch = req.fetch[i]
		}
		if i < len(req.recompute) {
			d.Recompute = req.recompute[i] && d.PeerFetch == nil
		}
	}
	if req.SessionID != "" && !policy.Predicts {
		if !req.DryRun {
			r.sessions.put(req.SessionID, ws[i].ID, now)
		}
	}
	return nil
}

// admissible appends to out the workers of ws that may take req at now: healthy (not
// draining, not ejected) and not named by req.Exclude. It is the router's own filter, ahead
// of every policy's.
func admissible(req *Request, ws []*Worker, now int64, out []*Worker) []*Worker {
next:
	for _, w := range ws {
		if !w.Healthy(now) {
			continue
		}
		for _, x := range req.Exclude {
			if x == w.Index {
				continue next
			}
		}
		out = append(out, w)
	}
	return out
}

// sameArray reports whether a and b share their first element's backing array.
func sameArray(a, b []*Worker) bool {
	return cap(a) > 0 && cap(b) > 0 && &a[:1][0] == &b[:1][0]
}

// leastOverlap is the fewest prompt blocks any of ws caches: what every worker offers
// alike, so no reason to prefer one.
func leastOverlap(req *Request, ws []*Worker) float64 {
	lo := req.Overlap(ws[0])
	for _, w := range ws[1:] {
		lo = min(lo, req.Overlap(w))
	}
	return lo
}
