package benchharness

import (
	"fmt"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/engines/sim"
)

// Fleet describes the engines of a run: how many, their KV cache and scheduler limits, and
// each kind's timing. Overrides make a heterogeneous fleet. A Fleet is a value.
type Fleet struct {
	// Engines is how many engines run (1-9).
	Engines int
	// BlockSize is tokens per KV block; Blocks each engine's KV cache in blocks.
	BlockSize, Blocks int
	// MaxNumSeqs is each engine's limit of running requests.
	MaxNumSeqs int
	// MaxModelLen bounds prompt plus output (both kinds).
	MaxModelLen int
	// MaxBatchedTokens is the kvrelay sim's token budget per step (0: its default, 8192);
	// llm-d's simulator has none.
	MaxBatchedTokens int
	// LLMD is llm-d-inference-sim's latency model, Sim the kvrelay sim's.
	LLMD LLMDTiming
	Sim  SimTiming
	// Overrides change single engines, by index (0 is e1).
	Overrides map[int]Override
}

// LLMDTiming is llm-d-inference-sim's per-token latency model: TTFT = PrefillOverhead +
// PrefillPerToken × uncached prompt tokens, then ITL per output token, all × up to
// LoadFactor as the engine's running requests approach MaxNumSeqs. Linear in the tokens:
// it has no notion of context length.
type LLMDTiming struct {
	PrefillOverhead, PrefillPerToken, PrefillStdDev time.Duration
	ITL, ITLStdDev                                  time.Duration
	LoadFactor                                      float64
}

// SimTiming is the kvrelay sim's step model beyond its defaults: Speedup (--speedup-ratio)
// divides every step; the attention terms (--prefill-attention-ms, --decode-attention-ms)
// make steps dearer with context.
type SimTiming struct {
	Speedup                           float64
	PrefillAttention, DecodeAttention float64
}

// Override changes one engine of a fleet: Slowdown multiplies its step times (2: half as
// fast), KVScale its KV cache (0.5: half the blocks). Zero values change nothing.
type Override struct {
	Slowdown, KVScale float64
}

// DefaultFleet is hack/bench-llmd's fleet: four engines of 1024 blocks of 16 tokens and
// four sequences each; llm-d's simulator at 25 ms + 60 µs per uncached prompt token, ITL
// 15 ms, up to ×2 under load; the kvrelay sim at half speed.
func DefaultFleet() Fleet {
	return Fleet{
		Engines: 4, BlockSize: 16, Blocks: 1024, MaxNumSeqs: 4, MaxModelLen: 32768,
		LLMD: LLMDTiming{
			PrefillOverhead: 25 * time.Millisecond, PrefillPerToken: 60 * time.Microsecond, PrefillStdDev: 2 * time.Millisecond,
			ITL: 15 * time.Millisecond, ITLStdDev: time.Millisecond, LoadFactor: 2,
		},
		Sim: SimTiming{Speedup: 0.5},
	}
}

// Validate reports a fleet the harness cannot run.
func (f Fleet) Validate() error {
	switch {
	case f.Engines < 1 || f.Engines > 9:
		return fmt.Errorf("fleet: %d engines, want 1-9", f.Engines)
	case f.BlockSize <= 0 || f.Blocks <= 0 || f.MaxNumSeqs <= 0 || f.MaxModelLen <= 0:
		return fmt.Errorf("fleet: block size %d, blocks %d, max-num-seqs %d and max-model-len %d must be positive", f.BlockSize, f.Blocks, f.MaxNumSeqs, f.MaxModelLen)
	case f.Sim.Speedup <= 0:
		return fmt.Errorf("fleet: kvrelay sim speedup %g must be positive", f.Sim.Speedup)
	case f.LLMD.LoadFactor < 1:
		return fmt.Errorf("fleet: llm-d load factor %g must be at least 1", f.LLMD.LoadFactor)
	case f.Sim.PrefillAttention < 0 || f.Sim.DecodeAttention < 0 || f.MaxBatchedTokens < 0:
		return fmt.Errorf("fleet: negative attention cost or token budget")
	}
	for i, o := range f.Overrides {
		if i < 0 || i >= f.Engines || o.Slowdown < 0 || o.KVScale < 0 {
			return fmt.Errorf("fleet: override of engine %d (%+v) out of range", i, o)
		}
	}
	return nil
}

// slowdown and blocks are engine i's, overrides applied.
func (f Fleet) slowdown(i int) float64 {
	if o, ok := f.Overrides[i]; ok && o.Slowdown > 0 {
		return o.Slowdown
	}
	return 1
}

func (f Fleet) blocks(i int) int {
	if o, ok := f.Overrides[i]; ok && o.KVScale > 0 {
		return max(1, int(float64(f.Blocks)*o.KVScale))
	}
	return f.Blocks
}

// TotalBlocks is the fleet's KV cache in blocks, overrides applied.
func (f Fleet) TotalBlocks() int {
	n := 0
	for i := range f.Engines {
		n += f.blocks(i)
	}
	return n
}

// scaleDur writes d × x as a Go duration in whole ms, µs ("us") or ns.
func scaleDur(d time.Duration, x float64) string {
	d = time.Duration(float64(d) * x)
	switch {
	case d%time.Millisecond == 0:
		return fmt.Sprintf("%dms", d/time.Millisecond)
	case d%time.Microsecond == 0:
		return fmt.Sprintf("%dus", d/time.Microsecond)
	}
	return fmt.Sprintf("%dns", d.Nanoseconds())
}

// LLMDArgs are llm-d-inference-sim's flags for engine i on port, publishing KV events to zmq.
func (f Fleet) LLMDArgs(i, port int, model, zmq string) []string {
	s := f.slowdown(i)
	t := f.LLMD
	return []string{"--port", fmt.Sprint(port), "--model", model, "--force-dummy-tokenizer",
		"--max-num-seqs", fmt.Sprint(f.MaxNumSeqs), "--max-model-len", fmt.Sprint(f.MaxModelLen),
		"--enable-kvcache", "--kv-cache-size", fmt.Sprint(f.blocks(i)), "--block-size", fmt.Sprint(f.BlockSize),
		"--zmq-endpoint", zmq, "--event-batch-size", "16",
		"--latency-calculator", "per-token", "--prefill-overhead", scaleDur(t.PrefillOverhead, s),
		"--prefill-time-per-token", scaleDur(t.PrefillPerToken, s), "--prefill-time-std-dev", scaleDur(t.PrefillStdDev, s),
		"--inter-token-latency", scaleDur(t.ITL, s), "--inter-token-latency-std-dev", scaleDur(t.ITLStdDev, s),
		"--time-factor-under-load", fmt.Sprint(t.LoadFactor)}
}

// SimArgs are `kvrelay sim`'s flags for engine i listening on addr, publishing KV events
// by connecting to zmq under topic.
func (f Fleet) SimArgs(i int, addr, model, zmq, topic string) []string {
	args := []string{"sim", "--listen", addr, "--model", model,
		"--max-num-seqs", fmt.Sprint(f.MaxNumSeqs), "--num-gpu-blocks", fmt.Sprint(f.blocks(i)),
		"--block-size", fmt.Sprint(f.BlockSize), "--max-model-len", fmt.Sprint(f.MaxModelLen),
		"--speedup-ratio", fmt.Sprint(f.Sim.Speedup / f.slowdown(i)),
		"--kv-events-endpoint", zmq, "--kv-events-connect", "--kv-events-topic", topic}
	if f.MaxBatchedTokens > 0 {
		args = append(args, "--max-num-batched-tokens", fmt.Sprint(f.MaxBatchedTokens))
	}
	if f.Sim.PrefillAttention > 0 {
		args = append(args, "--prefill-attention-ms", fmt.Sprint(f.Sim.PrefillAttention))
	}
	if f.Sim.DecodeAttention > 0 {
		args = append(args, "--decode-attention-ms", fmt.Sprint(f.Sim.DecodeAttention))
	}
	return args
}

// simTiming is the kvrelay sim's step model at speedup 1 with the fleet's attention terms.
func (f Fleet) simTiming() sim.Timing {
	t := sim.DefaultTiming()
	t.PrefillAttention, t.DecodeAttention = f.Sim.PrefillAttention, f.Sim.DecodeAttention
	return t
}

func (f Fleet) chunk() int {
	if f.MaxBatchedTokens > 0 {
		return f.MaxBatchedTokens
	}
	return sim.DefaultConfig().MaxNumBatchedTokens
}

// FloorMS is a request's TTFT floor on an idle engine of the fleet at full speed: the
// prefill of uncached prompt tokens after cached ones, nothing queued, no load factor.
// llm-d: PrefillOverhead + PrefillPerToken × uncached. kvrelay sim: its step model over
// chunks of the token budget, each attending to the context before it, ÷ Speedup.
func (f Fleet) FloorMS(kind string, uncached, cached int) float64 {
	uncached, cached = max(uncached, 0), max(cached, 0)
	if kind == EngineLLMD {
		return ms(f.LLMD.PrefillOverhead + time.Duration(uncached)*f.LLMD.PrefillPerToken)
	}
	t, chunk := f.simTiming(), f.chunk()
	var total float64
	for ctx := cached; uncached > 0; {
		n := min(uncached, chunk)
		total += t.PrefillChunkMS(n, ctx)
		ctx += n
		uncached -= n
	}
	return total / f.Sim.Speedup
}

// Describe is a line describing the fleet's engines of a kind.
func (f Fleet) Describe(kind, model string) string {
	var b strings.Builder
	if kind == EngineLLMD {
		t := f.LLMD
		fmt.Fprintf(&b, "%d × llm-d-inference-sim (%s, dummy tokenizer, max-num-seqs %d, KV cache %d blocks of %d, per-token latency: %v + %v per uncached prompt token, ITL %v, up to ×%g under load; linear in tokens, no context-length term)",
			f.Engines, model, f.MaxNumSeqs, f.Blocks, f.BlockSize, t.PrefillOverhead, t.PrefillPerToken, t.ITL, t.LoadFactor)
	} else {
		fmt.Fprintf(&b, "%d × kvrelay sim (%s, ChatML + o200k_base, max-num-seqs %d, %d blocks of %d, --speedup-ratio %g: 6000 uncached tokens prefill in %.0f ms",
			f.Engines, model, f.MaxNumSeqs, f.Blocks, f.BlockSize, f.Sim.Speedup, f.FloorMS(EngineKVRelay, 6000, 0))
		if f.MaxBatchedTokens > 0 {
			fmt.Fprintf(&b, ", --max-num-batched-tokens %d", f.MaxBatchedTokens)
		}
		if f.Sim.PrefillAttention > 0 || f.Sim.DecodeAttention > 0 {
			fmt.Fprintf(&b, ", attention --prefill-attention-ms %g --decode-attention-ms %g: 12000 tokens over 60000 cached prefill in %.0f ms",
				f.Sim.PrefillAttention, f.Sim.DecodeAttention, f.FloorMS(EngineKVRelay, 12000, 60000))
		}
		b.WriteString(")")
	}
	for i := range f.Engines {
		if o, ok := f.Overrides[i]; ok {
			var parts []string
			if o.Slowdown > 0 && o.Slowdown != 1 {
				parts = append(parts, fmt.Sprintf("%g× slower", o.Slowdown))
			}
			if o.KVScale > 0 && o.KVScale != 1 {
				parts = append(parts, fmt.Sprintf("%d blocks", f.blocks(i)))
			}
			if len(parts) > 0 {
				fmt.Fprintf(&b, "; e%d %s", i+1, strings.Join(parts, ", "))
			}
		}
	}
	return b.String()
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
