package benchharness

import (
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestDefaultFleetArgs pins the engines hack/bench-llmd has always run.
func TestDefaultFleetArgs(t *testing.T) {
	f := DefaultFleet()
	got := f.LLMDArgs(0, 22001, "Qwen/Qwen3-8B", "tcp://127.0.0.1:22100")
	want := strings.Fields("--port 22001 --model Qwen/Qwen3-8B --force-dummy-tokenizer --max-num-seqs 4 --max-model-len 32768 " +
		"--enable-kvcache --kv-cache-size 1024 --block-size 16 --zmq-endpoint tcp://127.0.0.1:22100 --event-batch-size 16 " +
		"--latency-calculator per-token --prefill-overhead 25ms --prefill-time-per-token 60us --prefill-time-std-dev 2ms " +
		"--inter-token-latency 15ms --inter-token-latency-std-dev 1ms --time-factor-under-load 2")
	if !slices.Equal(got, want) {
		t.Errorf("llm-d args\n got %q\nwant %q", got, want)
	}
	got = f.SimArgs(1, "127.0.0.1:22002", "Qwen/Qwen3-8B", "tcp://127.0.0.1:22100", "kv@127.0.0.1:22002@Qwen/Qwen3-8B")
	want = strings.Fields("sim --listen 127.0.0.1:22002 --model Qwen/Qwen3-8B --max-num-seqs 4 --num-gpu-blocks 1024 --block-size 16 " +
		"--max-model-len 32768 --speedup-ratio 0.5 --kv-events-endpoint tcp://127.0.0.1:22100 --kv-events-connect " +
		"--kv-events-topic kv@127.0.0.1:22002@Qwen/Qwen3-8B")
	if !slices.Equal(got, want) {
		t.Errorf("kvrelay sim args\n got %q\nwant %q", got, want)
	}
}

// TestFleetOverrides: a heterogeneous fleet's slow engine runs at half speed on both kinds
// and its small engine has half the blocks; the others are untouched.
func TestFleetOverrides(t *testing.T) {
	f := DefaultFleet()
	f.Overrides = map[int]Override{1: {Slowdown: 2}, 2: {KVScale: 0.5}}
	f.Sim.PrefillAttention, f.MaxBatchedTokens = 0.001, 4096
	if err := f.Validate(); err != nil {
		t.Fatal(err)
	}
	arg := func(args []string, flag string) string {
		i := slices.Index(args, flag)
		if i < 0 || i+1 >= len(args) {
			return ""
		}
		return args[i+1]
	}
	for i, want := range []struct{ itl, perTok, blocks, speedup string }{
		{"15ms", "60us", "1024", "0.5"},
		{"30ms", "120us", "1024", "0.25"},
		{"15ms", "60us", "512", "0.5"},
		{"15ms", "60us", "1024", "0.5"},
	} {
		l := f.LLMDArgs(i, 1, "m", "z")
		s := f.SimArgs(i, "a", "m", "z", "t")
		if arg(l, "--inter-token-latency") != want.itl || arg(l, "--prefill-time-per-token") != want.perTok || arg(l, "--kv-cache-size") != want.blocks {
			t.Errorf("engine %d llm-d args %q", i, l)
		}
		if arg(s, "--speedup-ratio") != want.speedup || arg(s, "--num-gpu-blocks") != want.blocks ||
			arg(s, "--prefill-attention-ms") != "0.001" || arg(s, "--max-num-batched-tokens") != "4096" || slices.Contains(s, "--decode-attention-ms") {
			t.Errorf("engine %d kvrelay sim args %q", i, s)
		}
	}
	if got := f.TotalBlocks(); got != 3*1024+512 {
		t.Errorf("TotalBlocks = %d", got)
	}
	for _, bad := range []map[int]Override{{4: {Slowdown: 2}}, {0: {KVScale: -1}}} {
		g := DefaultFleet()
		g.Overrides = bad
		if g.Validate() == nil {
			t.Errorf("overrides %v passed Validate", bad)
		}
	}
}

// TestFloor: without attention terms the kvrelay floor is kvrelay bench's prefill model at
// the fleet's speedup, whatever the context; with them a prefill over a long cached context
// costs more. llm-d's floor is its linear model.
func TestFloor(t *testing.T) {
	f := DefaultFleet()
	m := bench.PrefillModel{Timing: sim.DefaultTiming(), ChunkTokens: 8192}
	for _, n := range []int{0, 1, 6000, 8192, 20000} {
		want := float64(m.Time(n)) / float64(time.Millisecond) / 0.5
		if got := f.FloorMS(EngineKVRelay, n, 50000); math.Abs(got-want) > 1e-3 {
			t.Errorf("kvrelay floor of %d tokens = %v, want %v", n, got, want)
		}
	}
	if got := f.FloorMS(EngineLLMD, 1000, 5000); math.Abs(got-(25+60)) > 1e-9 {
		t.Errorf("llm-d floor of 1000 tokens = %v, want 85", got)
	}
	f.Sim.PrefillAttention = 0.0012
	short, long := f.FloorMS(EngineKVRelay, 12000, 0), f.FloorMS(EngineKVRelay, 12000, 60000)
	// 12000 tokens over 60000 more cached: 0.0012 × 12000 × 60000 / 1000 / 0.5 = 1728 ms more.
	if d := long - short; math.Abs(d-1728) > 1e-6 {
		t.Errorf("60000 cached tokens add %v ms to the floor, want 1728", d)
	}
}

// TestUpstreamsCarryNoSchedulerLimits: kvrelay's routers learn the engines' max-num-seqs and
// token budget as llm-d's EPP does; the harness tells neither.
func TestUpstreamsCarryNoSchedulerLimits(t *testing.T) {
	f := DefaultFleet()
	f.Overrides = map[int]Override{2: {KVScale: 0.5}}
	s := &stack{cfg: &Config{Model: "m"}, fleet: f, p: newPorts(25000, f.Engines)}
	args := s.upstreams()
	if len(args) != 2*f.Engines {
		t.Fatalf("upstreams %q", args)
	}
	for i := 1; i < len(args); i += 2 {
		if strings.Contains(args[i], "max-num-seqs") || strings.Contains(args[i], "max-num-batched-tokens") {
			t.Errorf("upstream %q tells a scheduler limit", args[i])
		}
	}
	if want := "id=e3,url=http://127.0.0.1:25003,model=m,capacity=512"; args[5] != want {
		t.Errorf("upstream %q, want %q", args[5], want)
	}
}

func TestParseList(t *testing.T) {
	got, err := ParseList("latency-exact, round-robin,latency-exact", AllRouters, "--routers")
	if err != nil || !slices.Equal(got, []string{RouterRoundRobin, RouterLatencyExact}) {
		t.Errorf("ParseList = %v, %v", got, err)
	}
	for _, bad := range []string{"", ",", "nope"} {
		if _, err := ParseList(bad, AllRouters, "--routers"); err == nil {
			t.Errorf("ParseList(%q) passed", bad)
		}
	}
}

func TestStat(t *testing.T) {
	a := StatOf([]float64{3, 1, 2, math.NaN()})
	if a.Med != 2 || a.Lo != 1 || a.Hi != 3 || a.N != 3 {
		t.Fatalf("StatOf = %+v", a)
	}
	if a.Cell(Num) != "2.00 [1.00–3.00]" {
		t.Errorf("Cell = %q", a.Cell(Num))
	}
	if !a.Overlaps(StatOf([]float64{2.5, 9})) || a.Overlaps(StatOf([]float64{3.5, 9})) || a.Overlaps(StatOf(nil)) {
		t.Error("Overlaps wrong")
	}
	if KVRelayPolicy(RouterLeastRequest) != "power-of-two" || RouterHop(RouterEPPPrecise) == RouterHop(RouterLatencyExact) {
		t.Error("router table wrong")
	}
}

// TestFloorBelowTTFT: a request's floor is at most its TTFT, so the floor's p50 must be at
// most the TTFT p50 as kvrelay bench takes it (nearest rank), even on four requests, where
// interpolating between the middle two would put it above.
func TestFloorBelowTTFT(t *testing.T) {
	floors := []float64{275, 275, 76, 76}
	ttfts := []float64{309, 296, 93, 100}
	if f, tt := NearestRank(floors, 0.5), NearestRank(ttfts, 0.5); f > tt || tt != 100 {
		t.Errorf("floor p50 %v above TTFT p50 %v", f, tt)
	}
	if q := Quantile(floors, 0.5); q != 175.5 {
		t.Errorf("Quantile = %v", q)
	}
}
