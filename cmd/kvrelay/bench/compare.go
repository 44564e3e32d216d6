package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// Result is one run's outcome.
type Result struct {
	Label    string    `json:"label"` // the policy, or the target for a single run
	Workload string    `json:"workload"`
	Seed     uint64    `json:"seed"`
	Summary  Summary   `json:"summary"`
	Records  []*Record `json:"-"`
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
	res.Summary.IdealHitRate = IdealHitRate(recs, tokenizer.CodecForModel(model), blockSize)
	return res, nil
}

// CompareOptions configure `bench compare`.
type CompareOptions struct {
	Workload string
	Seed     uint64
	Policies []string
	// Cluster describes each policy's cluster; a Speedup of 0 takes Run.Speedup, so that
	// arrivals and engine steps compress alike and the load keeps its shape. An engine
	// speedup below Run.Speedup raises the load by their ratio.
	Cluster  ClusterConfig
	Run      Options // Target is set per policy
	SLO      SLO
	Progress io.Writer
}

// Compare runs the identical request stream against a fresh local cluster per policy.
func Compare(ctx context.Context, co CompareOptions, tok workload.Tokenizer) ([]*Result, error) {
	var out []*Result
	for _, policy := range co.Policies {
		w, err := workload.Parse(co.Workload, co.Seed, tok)
		if err != nil {
			return out, err
		}
		cc := co.Cluster
		cc.Policy = policy
		if cc.Speedup <= 0 {
			cc.Speedup = max(co.Run.Speedup, 1) // the same shape, compressed
		}
		cl, err := StartCluster(ctx, cc)
		if err != nil {
			return out, err
		}
		opts := co.Run
		opts.Target = cl.Target()
		opts.TimeScale = cc.Speedup // report in the engines' own time
		opts.Model = cc.Model
		if co.Progress != nil {
			opts.Progress = NewProgress(co.Progress, fmt.Sprintf("%-13s", policy), expected(w, opts))
		}
		res, err := Measure(ctx, policy, opts, w, co.Seed, co.SLO, cc.BlockSize)
		opts.Progress.Stop()
		cerr := cl.Close()
		if err != nil {
			return out, fmt.Errorf("policy %s: %w", policy, err)
		}
		if cerr != nil {
			return out, fmt.Errorf("policy %s: stopping the cluster: %w", policy, cerr)
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
