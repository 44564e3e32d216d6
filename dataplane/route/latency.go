package route

import (
	"errors"
	"slices"

	"github.com/kvrelay/kvrelay/dataplane/latency"
)

// ErrSLO: the request carries latency targets and no eligible worker is predicted to meet
// them. The caller queues the request or refuses it (429).
var ErrSLO = errors.New("no worker is predicted to meet the request's latency targets")

// errNoPredictions: a policy marked as predicting scored a request with latency targets
// without predicting every candidate. Registry.Build refuses such a policy, so this is a
// safeguard, not a state a proxy reaches.
var errNoPredictions = errors.New("routing a request with latency targets: the policy's scorers predicted no latency for its candidates")

// predictor is a scorer that fills the request's latency predictions (Request.Candidates)
// for every worker it scores, as a policy that Predicts needs: what the SLO rule and the
// Decision's Prediction read. Only PredictedTTFT does.
type predictor interface {
	Scorer
	fillsPredictions()
}

func (PredictedTTFT) fillsPredictions() {}

// Defaults of the latency policy.
const (
	// DefaultComputeWeight weighs the engine time of the request's uncached tokens beside its
	// TTFT: compute spent on tokens another worker caches delays every request queued behind
	// it there, which this request's TTFT does not show. At 0 the policy takes whichever
	// worker answers this request first, however much it recomputes.
	DefaultComputeWeight = 1
	// DefaultBackgroundWeight weighs, for a request with a priority below 0, the engine time
	// of its uncached tokens once more per interactive request (priority above 0) this proxy
	// has running on the worker, so background work goes where it delays interactive work
	// least.
	DefaultBackgroundWeight = 1
	// DefaultBatchWeight weighs Prediction.Slowdown, the decode time a request's joining a
	// worker's running batch adds to that batch and to itself. Without it a policy that
	// sees only TTFT crowds decodes onto the workers holding shared prefixes (agentic
	// bench-compare: goodput 37.4 against kv's 44.0 req/s); at 0.05 it matches kv's goodput
	// and beats its TTFT, and costs nothing measurable on the Mooncake trace or llm-d's
	// simulators. 0 turns it off.
	DefaultBatchWeight = 0.05
	// DefaultWaitWeight weighs Prediction.Wait, the time a request would wait for a
	// sequence slot, once more beside its TTFT: while it waits it holds its place ahead of
	// every request that queues there after it, and leaves idle the slots another worker
	// has free. Off by default: at 1, on llm-d's simulators (4 slots, 3 rounds) TTFT p50 /
	// p90 were 138 [112–166] / 723 [589–808] ms against 102 [100–195] / 541 [504–913]
	// without it, within the rounds' spread and no better.
	DefaultWaitWeight = 0
	// DefaultTailWeight weighs Prediction.Spread beside the predicted TTFT: the policy
	// routes on TTFT + 1·σ, about the 84th percentile of the prediction.
	DefaultTailWeight = 1
	// DefaultBalanceWeight weighs Prediction.Hold × Prediction.Scarcity: a request that
	// takes the last free slot of a worker of four is charged half the time it will hold
	// it, twice the wait its taking the slot leaves the next request there (the first of
	// the four running requests to end frees one after a quarter of a hold, on average).
	// Chosen on internal/fleetsim's replays of the routing suite's workloads (hack/routesim):
	// 1 left agentic bursts queueing on the workers that held their sessions, 4 did no better
	// than 2.
	DefaultBalanceWeight = 2
	// DefaultExplore is the share of decisions that explore (LatencyPick.Explore): one in 64.
	DefaultExplore = 1.0 / 64
	// DefaultOSL is the output length assumed for Slowdown when a request states none.
	DefaultOSL = 128
	// MinPeerFetchTokens is the least a peer must cache beyond a worker for fetching from it
	// to be considered; PeerFetchOverhead what asking it costs beside the transfer.
	MinPeerFetchTokens = 512
	PeerFetchOverhead  = 0.002
	// PeerFetchCopyCost prices the second copy a fetch leaves: the fetched prefix stays
	// cached on both workers, and on the fetcher it displaces what was cached there, which
	// TTFT does not see. A fetch is charged this share of the engine time computing the
	// fetched tokens would take, so it wins only where it saves clearly more than it moves.
	// Under cache pressure (hack/bench-kvbm.sh, g3-fetch against g3-worm) fetches priced at 0
	// cost 3.6 points of hit rate; at 0.5 the hit rate is where it is without fetches
	// (86.4 % against 86.8 %), and a forked subagent's cold start still fetches.
	PeerFetchCopyCost = 0.5
)

// PredictedTTFT is the latency policy's scorer: each worker's predicted time to first token
// for the request (package latency: slot wait, prefill backlog, own uncached prefill,
// learned per model and worker), plus ComputeWeight times the engine time its uncached
// tokens take there (Prediction.Compute: the token-proportional part, not the per-step
// costs it shares with the requests in its steps), plus BatchWeight times the decode
// slowdown it causes (Prediction.Slowdown), plus WaitWeight times its wait for a slot
// (Prediction.Wait), plus, for a background request,
// BackgroundWeight times that per interactive request on the worker. Costs are in seconds.
// It also keeps each candidate's prediction in the request (Request.Candidates) for the
// Decision and for explanations. CacheCredit is the share of each worker's cached prompt
// blocks the prediction counts as cached, in [0, 1]: the policy's overlap weight over its
// default (1 at the default or above; 0 predicts every worker as caching nothing, so load
// alone decides).
type PredictedTTFT struct {
	ComputeWeight, BackgroundWeight, BatchWeight, WaitWeight, CacheCredit float64
	TailWeight, BalanceWeight                                             float64
	// Onboard is what it does with the blocks a worker caches below GPU memory: 0 weighs
	// loading them against computing them, onboardAlways loads them, onboardNever computes
	// them (Config.Onboard).
	Onboard int
}

// The latency policy's treatments of lower-tier blocks (Config.Onboard).
const (
	OnboardWeigh  = "weigh"
	OnboardAlways = "always"
	OnboardNever  = "never"
)

// onboardCode is Config.Onboard as the scorer's "onboard" parameter.
func onboardCode(s string) float64 {
	switch s {
	case OnboardAlways:
		return onboardAlways
	case OnboardNever:
		return onboardNever
	}
	return 0
}

const (
	onboardAlways = 1
	onboardNever  = 2
)

func (PredictedTTFT) Name() string { return "predicted-ttft" }

func (s PredictedTTFT) Score(req *Request, ws []*Worker, costs []float64) {
	req.creditsCache = s.CacheCredit > 0
	now := req.clock()
	if cap(req.preds) < len(ws) {
		req.preds = make([]latency.Prediction, len(ws))
	}
	req.preds = req.preds[:len(ws)]
	req.candidates = ws
	osl := 0.0
	if s.BatchWeight > 0 {
		osl = float64(req.OSL)
		if osl <= 0 {
			osl = DefaultOSL
		}
	}
	var leftBuf [latency.MaxSlotSim]float64
	// The workers caching most of the prompt: the peers a worker that can fetch would fetch
	// from (the best, or for the best itself the second), among the candidates and those
	// only the busy filter took out; found at the first worker that can fetch, so that
	// fleets without peer fetch pay nothing for it.
	var first, second *Worker
	found := false
	holders := func() {
		found = true
		pool := ws
		if len(req.holders) > 0 {
			pool = req.holders
		}
		for _, w := range pool {
			o := req.Overlap(w)
			switch {
			case first == nil || o > req.Overlap(first):
				first, second = w, first
			case second == nil || o > req.Overlap(second):
				second = w
			}
		}
	}
	req.fetch = req.fetch[:0]
	req.recompute = req.recompute[:0]
	for i, w := range ws {
		bs := max(w.BlockSize, 1)
		overlap := req.Overlap(w)
		onboard := 0.0
		gpuOnly := -1.0 // the overlap without the blocks to load back, when there are some
		if req.flat {
			overlap = req.flatOverlap
		} else if lw, ok := req.Lower(w); ok && (lw.Host > 0 || lw.Disk > 0 || lw.Shared > 0) && w.Engine.Onboards() {
			// The worker says how fast its host memory, disk and shared storage give blocks
			// back: count those blocks as cached and price bringing them back, instead of
			// the tier weights (a tier of unknown bandwidth: its blocks are computed).
			gpu := overlap + lw.Deficit - lw.Host - lw.Disk - lw.Shared
			host, disk, shared := lw.Host, lw.Disk, lw.Shared
			if w.Engine.HostBandwidth <= 0 {
				host = 0
			}
			if w.Engine.DiskBandwidth <= 0 {
				disk = 0
			}
			if w.Engine.SharedBandwidth <= 0 {
				shared = 0
			}
			overlap = gpu + host + disk + shared
			tok := float64(bs) * s.CacheCredit
			onboard = w.Engine.OnboardSeconds(host*tok, disk*tok, shared*tok)
			if onboard > 0 {
				gpuOnly = gpu * s.CacheCredit
			}
		}
		overlap *= s.CacheCredit
		uncached := max(float64(req.PromptTokens)-overlap*float64(bs), 0)
		st := latency.State{Requests: int(w.Load()), Backlog: float64(w.PrefillBacklog(now)), KVUsage: w.KVInUse(), OSL: osl, Onboard: onboard,
			Cached: min(overlap*float64(bs), float64(req.PromptTokens))}
		if seqs := w.Latency().MaxNumSeqs(&w.Engine); seqs > 0 && st.Requests >= seqs {
			// A full worker: the wait for a slot from when each of its requests we know
			// is expected to end (its expected output at a full batch's step time, from
			// when its first token came), not from the mean.
			occ := w.Latency().Occupancy()
			left := w.DecodingLeft(now, w.Latency().DecodeStep(seqs, st.KVUsage), occ, leftBuf[:0])
			own := int(w.Inflight())
			st.SlotWait, st.HasSlotWait = latency.SlotWait(seqs, st.Requests-seqs, left, max(own-len(left), 0), max(st.Requests-own, 0), occ)
		}
		p := &req.preds[i]
		w.Latency().Predict(&w.Engine, st, uncached, p)
		c := s.cost(req, w, p)
		req.recompute = append(req.recompute, false)
		if gpuOnly >= 0 && s.Onboard != onboardAlways {
			// Computing what sits below GPU memory instead of loading it back: the engine
			// is told so (max_load_tokens 0) when that is predicted cheaper.
			alt, ast := latency.Prediction{}, st
			ast.Onboard, ast.Cached = 0, min(gpuOnly*float64(bs), float64(req.PromptTokens))
			w.Latency().Predict(&w.Engine, ast, max(float64(req.PromptTokens)-gpuOnly*float64(bs), 0), &alt)
			if ca := s.cost(req, w, &alt); ca < c || s.Onboard == onboardNever {
				*p, c, req.recompute[i] = alt, ca, true
			}
		}
		req.fetch = append(req.fetch, nil)
		if !req.flat && w.Engine.Fetches() {
			if !found {
				holders()
			}
			h := first
			if h == w {
				h = second
			}
			// Pull what the peer caches beyond this worker instead of computing it, when
			// that is predicted cheaper: the subagent whose context is on a busy parent.
			// Only onto a worker with room for the prompt's blocks: a fetch takes them all
			// before any of it runs, and an engine without them computes instead.
			if h != nil && roomFor(req, w, req.PromptBlocks(bs)-int(overlap)) {
				gain := (req.Overlap(h) - overlap) * float64(bs) * s.CacheCredit
				if gain >= MinPeerFetchTokens {
					var alt latency.Prediction
					w.Latency().Predict(&w.Engine, st, max(uncached-gain, 0), &alt)
					alt.Fetch = gain*w.Engine.KVBytesPerToken/w.Engine.PeerBandwidth + PeerFetchOverhead
					alt.Queue += alt.Fetch
					alt.TTFT += alt.Fetch
					copied := PeerFetchCopyCost * max(p.Compute-alt.Compute, 0)
					if ca := s.cost(req, w, &alt) + copied; ca < c {
						*p, c, req.fetch[i] = alt, ca, h
					}
				}
			}
		}
		costs[i] += c
	}
}

// canFetch reports whether any of ws can pull a prefix from a peer.
func canFetch(ws []*Worker) bool {
	return slices.ContainsFunc(ws, func(w *Worker) bool { return w.Engine.Fetches() })
}

// roomFor reports whether w has n blocks free, as far as its capacity and reported KV usage
// say (true when they do not): free of requests, and, where the index counts what w holds in
// GPU memory (Request.held), free of cached blocks too. A pulled prefix that takes the place
// of cached blocks costs the worker the hits those blocks would have given: under cache
// pressure, pulls into blocks free only of requests made TTFT worse than no pulls at all
// (hack/bench-kvbm.sh, g3-fetch against g3-worm).
func roomFor(req *Request, w *Worker, n int) bool {
	if w.Capacity <= 0 {
		return true
	}
	used := w.KVInUse() * float64(w.Capacity)
	if req.held != nil {
		if h, ok := req.held.GPUBlocks(w.Index); ok {
			used = max(used, float64(h))
		}
	}
	return float64(n) <= float64(w.Capacity)-used
}

// cost is the policy's cost of prediction p on w.
func (s PredictedTTFT) cost(req *Request, w *Worker, p *latency.Prediction) float64 {
	c := p.TTFT + s.TailWeight*p.Spread + s.ComputeWeight*p.Busy*p.Compute + s.BatchWeight*p.Slowdown + s.WaitWeight*p.Wait +
		s.BalanceWeight*p.Hold*p.Scarcity
	if req.Priority < 0 {
		c += s.BackgroundWeight * p.Compute * float64(w.Interactive())
	}
	return c
}

// LatencyPick picks the cheapest worker by predicted latency. Costs within tieSeconds or
// tieShare of the cheapest count as equal: among those, under a scoring that credits the
// cache, a worker caching tieCacheShare of the prompt more than another goes first (a model that has learned prefill to be nearly free
// predicts every worker alike, and the cache should still keep a prompt where it is), then
// the fewest requests, then the least KV in use (so that distinct new prefixes land on
// distinct caches), then a random one. With Temperature > 0 it samples a softmax over
// normalised costs instead (MinCost).
//
// With Explore > 0, that share of the decisions picks at random among the candidates whose
// cost is within exploreShare of the cheapest's and whose model has learned nothing for
// exploreStale, or never has, when there are any: a worker that once looked slow and has
// not been chosen since is tried again, and one that was never chosen is tried at all (its
// prior can look slower than what the chosen ones have learned, under light load for
// ever), so that what its model learns of it (its speed, its errors) does not come only
// from the times it looked best.
type LatencyPick struct{ Temperature, Explore float64 }

// exploreShare bounds how much worse than the cheapest an explored candidate may be
// predicted (exploring costs at most that share of a decision's latency); exploreStale is how
// long a worker's model must have gone without an observation to be explored.
const (
	exploreShare = 0.25
	exploreStale = int64(10e9)
)

// Ties: predictions closer than this are within the model's own noise.
const (
	tieSeconds = 0.002
	tieShare   = 0.02
	// tieCacheShare is the share of the prompt's blocks by which one tied worker must cache
	// more than another to go first (the spread rule's default cache threshold).
	tieCacheShare = 0.1
)

func (LatencyPick) Name() string { return "latency" }

func (p LatencyPick) Pick(req *Request, ws []*Worker, costs []float64) int {
	if p.Temperature > 0 {
		return MinCost{Temperature: p.Temperature}.Pick(req, ws, costs)
	}
	lo := costs[0]
	for _, c := range costs[1:] {
		lo = min(lo, c)
	}
	if p.Explore > 0 && len(ws) > 1 && randFloat64() < p.Explore {
		now := req.clock()
		// A worker never observed is tried only beside one that was: where no candidate
		// teaches its model (answers not streamed), trying one teaches nothing either.
		learning := false
		for _, w := range ws {
			learning = learning || w.Latency().LastObserved() != 0
		}
		pick, seen := -1, 0
		for i, c := range costs {
			last := ws[i].Latency().LastObserved()
			if c <= lo+exploreShare*max(lo, 0) && (last == 0 && learning || last != 0 && now-last > exploreStale) {
				if seen++; randIntN(seen) == 0 {
					pick = i
				}
			}
		}
		if pick >= 0 {
			return pick
		}
	}
	tol := max(tieSeconds, tieShare*max(lo, 0))
	cached := 0.0 // the most any tied worker caches
	for i, c := range costs {
		if c <= lo+tol {
			cached = max(cached, req.Overlap(ws[i]))
		}
	}
	floor := cached - tieCacheShare*float64(req.PromptBlocks(ws[0].BlockSize))
	if !req.creditsCache {
		floor = 0 // a cache-blind policy: load alone breaks ties
	}
	best, seen := -1, 0
	var bk loadKey
	for i, c := range costs {
		if c > lo+tol || req.Overlap(ws[i]) < floor {
			continue
		}
		k := loadKey{load: ws[i].Load(), kv: ws[i].KVInUse()}
		switch {
		case best < 0 || k.less(bk):
			best, bk, seen = i, k, 1
		case k == bk:
			seen++
			if randIntN(seen) == 0 {
				best = i
			}
		}
	}
	return best
}

// meetSLO keeps the candidates predicted to meet req's targets and turns their costs into
// the negative of their headroom (the smaller share of each target left over), so the
// picker takes the one with the most. It returns how many remain, compacting ws, costs and
// the request's predictions in place.
func meetSLO(req *Request, ws []*Worker, costs []float64) int {
	n := 0
	for i := range ws {
		p := req.preds[i]
		head := 1.0
		ok := true
		if req.SLOTTFT > 0 {
			head = min(head, (req.SLOTTFT-p.TTFT)/req.SLOTTFT)
			ok = ok && p.TTFT <= req.SLOTTFT
		}
		if req.SLOTPOT > 0 {
			head = min(head, (req.SLOTPOT-p.ITL)/req.SLOTPOT)
			ok = ok && p.ITL <= req.SLOTPOT
		}
		if !ok {
			continue
		}
		ws[n], costs[n], req.preds[n] = ws[i], -head, p
		if i < len(req.fetch) {
			req.fetch[n] = req.fetch[i]
		}
		n++
	}
	return n
}

var (
	_ Scorer    = PredictedTTFT{}
	_ predictor = PredictedTTFT{}
	_ Picker    = LatencyPick{}
)
