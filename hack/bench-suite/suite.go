package main

import (
	"fmt"
	"time"

	bh "github.com/kvrelay/kvrelay/internal/benchharness"
)

// row is one workload of the suite: what it stresses, and per engine kind the workload, the
// engines and the arrival speed-up. Every row runs on both kinds with every router.
type row struct {
	name string
	// stresses says what the workload puts routers to (README and summary).
	stresses string
	// kinds holds the settings per engine kind (bh.EngineLLMD, bh.EngineKVRelay).
	kinds map[string]kind
}

// kind is a row's settings on one engine kind.
type kind struct {
	// spec is the `kvrelay bench` workload spec; quick is appended to it by --quick (a
	// repeated key takes its last value), shrinking the run to seconds for a smoke test.
	spec, quick string
	// speedup divides the workload's arrival and think times (0: 1).
	speedup float64
	fleet   bh.Fleet
	// note explains the settings (README and summary).
	note string
}

// agenticCommon is bench-llmd's agentic session shape: a 6000-token preamble, 6 calls of
// growing context and 2 subagents of 3 calls each, 64 output tokens a call, no session ids.
const agenticCommon = "preamble=6000,task=200,turns=1,rounds=5,tool=250,subagents=2,sub_task=100,sub_rounds=2," +
	"reasoning=32,osl=32,tool_time=300ms,session_ids=false"

// agenticQuick shrinks an agentic row for --quick: three short sessions starting at once.
const agenticQuick = ",sessions=3,rate=2,rounds=2,subagents=1,sub_rounds=1"

// Mooncake LOAD (hack/bench-compare.sh): how many times faster than the engines run the
// trace arrives, with 8 engines of the kvrelay sim's defaults at --speedup-ratio 0.5
// (arrival speed-up 0.5 × LOAD). The suite runs 4 engines, so it halves the speed-up to give
// each engine the load it has there: 0.5 × LOAD × 4/8.
func mooncakeSpeedup(load float64) float64 { return 0.5 * load * 4 / 8 }

// mooncakeRequests is how many trace requests a Mooncake row replays: about 50 s of arrivals
// at LOAD 6.
const mooncakeRequests = 220

func mooncakeFleets() (llmd, kv bh.Fleet) {
	// kvrelay sim: hack/bench-compare.sh's engines (the sim's defaults: 256 sequences, an
	// 8192-token step, 131072 blocks) at half speed.
	kv = bh.DefaultFleet()
	kv.Blocks, kv.MaxNumSeqs, kv.MaxModelLen = 131072, 256, 131072
	// llm-d's simulator computes every prefill on its own (no shared step), so only its slots
	// bound it: max-num-seqs is set so that round-robin is near capacity at LOAD 6 (1.1
	// requests a second per engine, ~14K-token prompts, 350 output tokens at 15 ms).
	llmd = kv
	llmd.MaxNumSeqs = 16
	return llmd, kv
}

// suite is the table of workloads, in run order.
func suite() []row {
	def := bh.DefaultFleet()

	// Eight preambles' running requests do not share blocks: four of them need about 1750
	// blocks, which llm-d's simulator refuses with 500 on 1024. With 2048 an engine holds
	// about five preambles, the fleet all eight with their sessions if each stays on few engines.
	expensive := def
	expensive.Blocks = 2048
	expensive.LLMD.PrefillPerToken = 150 * time.Microsecond // a 6000-token miss: 925 ms
	expensive.Sim.Speedup = 0.25                            // a 6000-token miss: 490 ms

	moonLLMD, moonKV := mooncakeFleets()

	long := def
	long.Blocks, long.MaxNumSeqs, long.MaxModelLen = 16384, 8, 131072
	long.Sim.Speedup = 1
	long.Sim.PrefillAttention, long.Sim.DecodeAttention = 0.0012, 0.05

	mixed := def
	mixed.Blocks = 2048

	// 1536 blocks, e3 768: the half cache still holds the longest prompt (about 9K tokens).
	hetero := def
	hetero.Blocks = 1536
	hetero.Overrides = map[int]bh.Override{1: {Slowdown: 2}, 2: {KVScale: 0.5}}

	const longSpec = "multi-turn:sessions=10,rate=0.4,system=32000,systems=10,user=12000,turns=5,osl=32,think=1s,session_ids=false"
	const burstSpec = "prefix-groups:groups=16,prompt=3000,user=200,osl=64,zipf=1,burst=3,burst_period=15s"

	return []row{
		{
			name: "agentic-shared",
			stresses: "Agent sessions without session ids sharing one 6000-token preamble that every engine soon caches, cheap prefill: " +
				"finding each session's growing tail (tool rounds, subagent forks) on the engine that ran it last, against " +
				"spreading load over 4 × 4 slots whose queues decide TTFT. bench-llmd's default workload, fewer sessions.",
			kinds: map[string]kind{
				bh.EngineLLMD:    {spec: "agentic:sessions=24,rate=0.6," + agenticCommon, quick: agenticQuick, fleet: def},
				bh.EngineKVRelay: {spec: "agentic:sessions=9,rate=0.3," + agenticCommon, quick: agenticQuick, fleet: def},
			},
		},
		{
			name: "agentic-preambles",
			stresses: "Eight agents' preambles (8 × 6000 tokens = 3000 blocks) and their sessions on engines of 2048 blocks: " +
				"the working set exceeds any engine's cache but fits the fleet's if each preamble stays on few engines, " +
				"which a router has to arrange; prefill is expensive (a miss costs about a second on llm-d's simulator, half on kvrelay's), " +
				"so every misplaced call pays for it.",
			kinds: map[string]kind{
				bh.EngineLLMD: {spec: "agentic:sessions=20,rate=0.45,preambles=8,preamble=6000,task=200,turns=1,rounds=3,tool=250,subagents=1,sub_task=100,sub_rounds=1,reasoning=0,osl=32,tool_time=300ms,session_ids=false",
					quick: agenticQuick, fleet: expensive, note: "llm-d prefill 150 µs a token"},
				bh.EngineKVRelay: {spec: "agentic:sessions=12,rate=0.3,preambles=8,preamble=6000,task=200,turns=1,rounds=3,tool=250,subagents=1,sub_task=100,sub_rounds=1,reasoning=0,osl=32,tool_time=300ms,session_ids=false",
					quick: agenticQuick, fleet: expensive, note: "kvrelay sim at --speedup-ratio 0.25"},
			},
		},
		mooncakeRow(6, moonLLMD, moonKV),
		mooncakeRow(7, moonLLMD, moonKV),
		{
			name: "long-context",
			stresses: "Ten conversations of their own (no shared prefix) growing from 44K to about 92K tokens over 5 turns, on " +
				"engines of 16384 blocks (262K tokens, 2-3 conversations at their peak): keeping a conversation where its " +
				"context is cached saves seconds of prefill, and on the kvrelay sim (attention terms on) a step's cost is " +
				"mostly attention over the cached context, so long-context requests sharing an engine slow each other. " +
				"llm-d's simulator is linear in the uncached tokens (60 µs each) and has no context-length term.",
			kinds: map[string]kind{
				bh.EngineLLMD:    {spec: longSpec, quick: ",sessions=2,rate=2,turns=2,system=8000,user=2000", fleet: long},
				bh.EngineKVRelay: {spec: longSpec, quick: ",sessions=2,rate=2,turns=2,system=8000,user=2000", fleet: long, note: "kvrelay sim at speedup 1 with --prefill-attention-ms 0.0012 --decode-attention-ms 0.05"},
			},
		},
		{
			name: "bursty",
			stresses: "Requests on 16 shared 3000-token system prompts (zipf 1: a few popular) arriving on/off: 5 s at three " +
				"times the mean rate, then 10 s of quiet. During a burst the fleet is over capacity: a router that herds " +
				"requests onto the engines caching their prompt builds long queues there; one that spreads them pays " +
				"prefill; the quiet parts drain what was queued.",
			kinds: map[string]kind{
				bh.EngineLLMD:    {spec: burstSpec + ",requests=130,rate=2.5", quick: ",requests=12", fleet: def},
				bh.EngineKVRelay: {spec: burstSpec + ",requests=80,rate=1.5", quick: ",requests=8", fleet: def},
			},
		},
		{
			name: "mixed",
			stresses: "Short chat turns from many users (one 300-token system prompt, 60-token messages, 64 output tokens) beside " +
				"long RAG prompts (a 6000-token document out of 16, zipf 1, plus a question): most requests are cheap, most " +
				"prefill is RAG's, and a RAG prompt queued ahead of a chat turn costs it seconds; a router should keep " +
				"documents where they are cached without putting chat behind them. Engines of 2048 blocks.",
			kinds: map[string]kind{
				bh.EngineLLMD:    {spec: "mixed:users=70,user_rate=1.4,turns=3,think=2s,rag=35,rag_rate=0.7,docs=16,doc=6000,zipf=1", quick: ",users=4,rag=3", fleet: mixed},
				bh.EngineKVRelay: {spec: "mixed:users=50,user_rate=1,turns=3,think=2s,rag=22,rag_rate=0.45,docs=16,doc=6000,zipf=1", quick: ",users=3,rag=2", fleet: mixed},
			},
		},
		{
			name: "hetero",
			stresses: "agentic-shared's sessions on a heterogeneous fleet: e2 runs at half speed (every step, or every latency, " +
				"twice as long) and e3 has half the KV cache (768 blocks of the others' 1536). A router that treats the engines alike overloads " +
				"e2 and thrashes e3's cache; one that learns what each engine does sends them less.",
			kinds: map[string]kind{
				bh.EngineLLMD:    {spec: "agentic:sessions=16,rate=0.5," + agenticCommon, quick: agenticQuick, fleet: hetero},
				bh.EngineKVRelay: {spec: "agentic:sessions=7,rate=0.3," + agenticCommon, quick: agenticQuick, fleet: hetero},
			},
		},
	}
}

func mooncakeRow(load float64, llmd, kv bh.Fleet) row {
	spec := fmt.Sprintf("mooncake:requests=%d,block=512", mooncakeRequests)
	note := fmt.Sprintf("LOAD %g: arrival speed-up %g (0.5 × LOAD × 4/8 engines)", load, mooncakeSpeedup(load))
	return row{
		name: fmt.Sprintf("mooncake-load%g", load),
		stresses: fmt.Sprintf("The first %d requests of the Mooncake conversation trace (~14K-token prompts sharing conversation "+
			"prefixes, ~350 output tokens) at LOAD %g, hack/bench-compare.sh's measure of offered load, per engine as there: "+
			"near round-robin's capacity, where placement decides whether queues build. Large caches (131072 blocks): "+
			"hits depend on sending a conversation's turns to the engine that holds it.", mooncakeRequests, load),
		kinds: map[string]kind{
			bh.EngineLLMD:    {spec: spec, quick: ",requests=10", speedup: mooncakeSpeedup(load), fleet: llmd, note: note + "; llm-d max-num-seqs 16"},
			bh.EngineKVRelay: {spec: spec, quick: ",requests=10", speedup: mooncakeSpeedup(load), fleet: kv, note: note + "; the kvrelay sim's defaults (256 sequences, 8192-token steps)"},
		},
	}
}

// rowNames lists the suite's workloads in run order.
func rowNames(rows []row) []string {
	names := make([]string, len(rows))
	for i, r := range rows {
		names[i] = r.name
	}
	return names
}
