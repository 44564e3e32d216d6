package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// Result is one run's outcome.
type Result struct {
	Label string `json:"label"` // the policy or setup (compare), or the target for a single run
	// Setup, Policy and Cluster name a compare run's cluster setup ("disagg:2+2", empty when
	// the run compared policies only), routing policy and pools in words.
	Setup    string    `json:"setup,omitempty"`
	Policy   string    `json:"policy,omitempty"`
	Cluster  string    `json:"cluster,omitempty"`
	Workload string    `json:"workload"`
	Seed     uint64    `json:"seed"`
	Summary  Summary   `json:"summary"`
	Records  []*Record `json:"-"`
	// LatencyModels are the proxy's learned latency models at the end of a compare run
	// under a predicting policy (its /debug/latency).
	LatencyModels []proxy.WorkerModelJSON `json:"latency_models,omitempty"`
}

// Measure runs w against opts.Target and summarises it, the ideal hit rate computed with the
// model's own tokenizer and chat template.
func Measure(ctx context.Context, label string, opts Options, w *workload.Workload, seed uint64, slo SLO, blockSize int) (*Result, error) {
	recs, wall, err := Run(ctx, opts, w)
	if err != nil {
		return nil, err
	}
	opts.defaults()
	wall = scaleTimes(recs, wall, opts.TimeScale)
	res := &Result{Label: label, Workload: w.Spec, Seed: seed, Records: recs, Summary: Summarize(recs, wall, slo)}
	model := opts.Model
	if model == "" {
		model, _ = firstModel(ctx, opts.Target)
	}
	res.Summary.IdealHitRate, res.Summary.LRUHitRate = HitBounds(recs, tokenizer.CodecForModel(model), blockSize, opts.CacheBlocks)
	res.Summary.CacheBlocks = opts.CacheBlocks
	if opts.Prefill != nil {
		res.Summary.Breakdown = NewBreakdown(recs, *opts.Prefill)
	}
	return res, nil
}

// CompareOptions configure `bench compare`.
type CompareOptions struct {
	Workload string
	Seed     uint64
	Policies []string
	// Setups are the cluster setups to compare, each run with every policy; empty runs the
	// one Cluster describes.
	Setups []Setup
	// Cluster describes each run's cluster; a Speedup of 0 takes Run.Speedup, so that
	// arrivals and engine steps compress alike and the load keeps its shape. An engine
	// speedup below Run.Speedup raises the load by their ratio.
	Cluster  ClusterConfig
	Run      Options // Target is set per run
	SLO      SLO
	Progress io.Writer
}

// compareRun is one cluster of a comparison.
type compareRun struct {
	label, setup, policy string
	cluster              ClusterConfig
}

// runs expands the setups and policies into the comparison's runs, setups outermost. A run
// is labelled by its policy when only policies vary, by its setup when only setups do, and
// "setup/policy" when both do.
func (co *CompareOptions) runs() []compareRun {
	policies := co.Policies
	if len(policies) == 0 {
		policies = []string{co.Cluster.Policy}
		if policies[0] == "" {
			policies[0] = route.PolicyDefault
		}
	}
	setups := co.Setups
	if len(setups) == 0 {
		setups = []Setup{{Mode: co.Cluster.Mode}}
	}
	var out []compareRun
	for _, st := range setups {
		for _, policy := range policies {
			r := compareRun{policy: policy, setup: st.Label, cluster: st.Apply(co.Cluster)}
			r.cluster.Policy = policy
			switch {
			case len(co.Setups) == 0:
				r.label = policy
			case len(policies) == 1:
				r.label = st.Label
			default:
				r.label = st.Label + "/" + policy
			}
			out = append(out, r)
		}
	}
	return out
}

// Compare runs the identical request stream against a fresh local cluster per setup and
// policy.
func Compare(ctx context.Context, co CompareOptions, tok workload.Tokenizer) ([]*Result, error) {
	runs := co.runs()
	for _, r := range runs { // refuse a bad setup before running the others
		if _, _, _, err := r.cluster.Pools(); err != nil {
			return nil, fmt.Errorf("%s: %w", r.label, err)
		}
	}
	width := 0
	for _, r := range runs {
		width = max(width, len(r.label))
	}
	var out []*Result
	for _, run := range runs {
		w, err := workload.Parse(co.Workload, co.Seed, tok)
		if err != nil {
			return out, err
		}
		cc := run.cluster
		if cc.Speedup <= 0 {
			cc.Speedup = max(co.Run.Speedup, 1) // the same shape, compressed
		}
		cl, err := StartCluster(ctx, cc)
		if err != nil {
			return out, fmt.Errorf("%s: %w", run.label, err)
		}
		opts := co.Run
		opts.Target = cl.Target()
		opts.TimeScale = cc.Speedup // report in the engines' own time
		opts.Model = cc.Model
		opts.CacheBlocks = prefixCacheBlocks(cc)
		opts.Prefill = cc.prefillModel()
		if co.Progress != nil {
			opts.Progress = NewProgress(co.Progress, fmt.Sprintf("%-*s", max(width, 13), run.label), expected(w, opts))
		}
		res, err := Measure(ctx, run.label, opts, w, co.Seed, co.SLO, cc.BlockSize)
		opts.Progress.Stop()
		lost, engines := cl.EngineStall()
		ts := cl.TierStats()
		models := cl.LatencyModels()
		cerr := cl.Close()
		if err != nil {
			return out, fmt.Errorf("%s: %w", run.label, err)
		}
		if cerr != nil {
			return out, fmt.Errorf("%s: stopping the cluster: %w", run.label, cerr)
		}
		res.Setup, res.Policy, res.Cluster = run.setup, run.policy, cc.Describe()
		res.Summary.Engines = engines
		res.LatencyModels = models
		if cc.Tiers != (TierConfig{}) && ts.PromptTokens > 0 {
			p := float64(ts.PromptTokens)
			res.Summary.Tiers = &TierSummary{Setup: cc.Tiers.Describe(),
				HitGPU: float64(ts.CachedByTier[0]) / p, HitCPU: float64(ts.CachedByTier[1]) / p, HitDisk: float64(ts.CachedByTier[2]) / p,
				HitPeer:  float64(ts.PeerTokens) / p,
				Uncached: ts.PromptTokens - ts.CachedTokens - ts.PeerTokens, DiskWritten: ts.DiskWritten, DiskRead: ts.DiskReadBytes,
				FetchPulled: ts.PeerFetches[sim.PeerPulled], FetchPartial: ts.PeerFetches[sim.PeerPartial],
				FetchFallback: ts.PeerFetches[sim.PeerFallback], FetchNoRoom: ts.PeerFetches[sim.PeerNoRoom],
				OnboardSkipped: ts.OnboardSkipped}
		}
		// Summary.Wall is in the engines' time (scaled by the speedup); lost is wall time.
		if wall := float64(res.Summary.Wall) / cc.Speedup; engines > 0 && wall > 0 {
			res.Summary.EngineStall = float64(lost) / (float64(engines) * wall)
		}
		out = append(out, res)
		// Let the loopback ports of the last cluster drain before the next starts.
		time.Sleep(100 * time.Millisecond)
	}
	return out, nil
}

// expected is the number of requests a run will send, when it is known up front.
func expected(w *workload.Workload, o Options) int {
	n := len(w.Open)
	if len(w.Sessions) > 0 {
		return o.Requests // sessions decide their own length
	}
	if o.Requests > 0 {
		n = min(n, o.Requests)
	}
	return n
}

// prefixCacheBlocks is the KV cache of the workers whose prefix cache prompts can hit: every
// worker in mode agg and in mode conditional (decode workers prefill short remainders there),
// the prefill pool alone in mode disagg (the decode pool's blocks mostly copy it). 0 when the
// config does not say.
func prefixCacheBlocks(cc ClusterConfig) int {
	both, prefill, decode, err := cc.Pools()
	if err != nil || cc.NumGPUBlocks <= 0 {
		return 0
	}
	if cc.Mode == ModeDisagg {
		decode = 0
	}
	return (both + prefill + decode) * cc.NumGPUBlocks
}
