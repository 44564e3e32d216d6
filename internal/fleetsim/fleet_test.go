package fleetsim

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

const testModel = "Qwen/Qwen3-8B"

// replay runs a small agentic workload on four llm-d engines without noise, under policy.
func replay(t *testing.T, policy, spec string, seed uint64) *Result {
	t.Helper()
	tok, _ := tokenizer.ForModel(testModel)
	w, err := workload.Parse(spec, seed, tok)
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Model: testModel, Workload: w, Exact: true, ReportEvery: 100 * time.Millisecond, Seed: seed, Alone: true,
		Routing: route.Config{Policy: policy, Explicit: true, OverlapWeight: route.DefaultOverlapWeight, QueueWeight: route.DefaultQueueWeight,
			ComputeWeight: route.DefaultComputeWeight, BatchWeight: route.DefaultBatchWeight, Explore: route.DefaultExplore}}
	for range 4 {
		e := BenchLLMD()
		e.PrefillStdDev, e.InterTokenStdDev = 0, 0
		cfg.Engines = append(cfg.Engines, EngineSpec{Kind: KindLLMD, LLMD: e})
	}
	res, err := Run(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

const testAgentic = "agentic:sessions=8,rate=1,preamble=3000,task=200,turns=1,rounds=3,tool=250,subagents=1,sub_task=100,sub_rounds=1,reasoning=0,osl=32,tool_time=300ms,session_ids=false"

// TestRunIsDeterministic: a replay makes the same decisions and gets the same times every
// time, exploration and the power of two choices included (the router's randomness is
// seeded by the replay's seed), and another seed makes other ones.
func TestRunIsDeterministic(t *testing.T) {
	for _, policy := range []string{"latency", "power-of-two"} {
		a, b := replay(t, policy, testAgentic, 3), replay(t, policy, testAgentic, 3)
		if len(a.Records) == 0 || !slices.EqualFunc(a.Records, b.Records, func(x, y Record) bool {
			return x.Worker == y.Worker && x.TTFT == y.TTFT && x.E2E == y.E2E && x.Predict == y.Predict
		}) {
			t.Fatalf("%s: two replays of one seed differ", policy)
		}
		c := replay(t, policy, testAgentic, 4)
		if slices.EqualFunc(a.Records, c.Records, func(x, y Record) bool { return x.Worker == y.Worker && x.TTFT == y.TTFT }) {
			t.Fatalf("%s: seeds 3 and 4 replayed alike", policy)
		}
	}
}

// TestAlone: on noiseless llm-d engines a request's TTFT is set at its decision: requests
// that arrive later queue behind it, and the batch cannot grow while it waits, so Alone is
// its TTFT, alone on its fleet or under a load that makes requests queue for slots.
func TestAlone(t *testing.T) {
	for _, tc := range []struct {
		spec   string
		queues bool
	}{
		{"agentic:sessions=1,rate=1,preamble=3000,task=200,turns=1,rounds=3,tool=250,subagents=0,reasoning=0,osl=32,tool_time=300ms,session_ids=false", false},
		{"agentic:sessions=40,rate=4,preamble=3000,task=200,turns=1,rounds=3,tool=250,subagents=1,sub_task=100,sub_rounds=1,reasoning=0,osl=32,tool_time=300ms,session_ids=false", true},
	} {
		spec := tc.spec
		res := replay(t, "least-loaded", spec, 1)
		queued := 0
		for _, r := range res.Records {
			if r.Alone != r.TTFT {
				t.Fatalf("%s: request %d: Alone %v, TTFT %v", spec, r.Seq, r.Alone, r.TTFT)
			}
			if r.Waited > 0 {
				queued++
			}
		}
		if tc.queues != (queued > 0) {
			t.Fatalf("%s: %d of %d requests queued for a slot", spec, queued, len(res.Records))
		}
		t.Logf("%d requests, %d of them queued for a slot", len(res.Records), queued)
	}
}
