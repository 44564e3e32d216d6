package sim

import (
	"math"
	"testing"
	"time"
)

func TestTimingAttention(t *testing.T) {
	base := DefaultTiming()
	attn := base
	attn.PrefillAttention, attn.DecodeAttention = 0.002, 0.05
	b := &Batch{
		Prefill:       []Chunk{{Tokens: 1000, Context: 31000}, {Tokens: 999, Context: 0}},
		PrefillTokens: 1999,
		Decodes:       3, DecodeContext: 60000,
		KVUsage: 0.25,
	}
	// Chunk 1: 1000 tokens over 31000 cached, each attending on average to 31000 + 500.5;
	// chunk 2: 999 tokens over none, 500 on average. Decodes: 60 × 0.05 ms.
	wantMS := 0.002*1000*(31000+500.5)/1000 + 0.002*999*500.0/1000 + 0.05*60
	if got := attn.AttentionMS(b.Prefill, b.DecodeContext); math.Abs(got-wantMS) > 1e-9 {
		t.Fatalf("AttentionMS = %v, want %v", got, wantMS)
	}
	if got := base.AttentionMS(b.Prefill, b.DecodeContext); got != 0 {
		t.Fatalf("default timing has an attention cost %v, want none", got)
	}
	if got, want := base.Step(b), base.StepTime(b.PrefillTokens, b.Decodes, b.KVUsage); got != want {
		t.Fatalf("default Step = %v, want StepTime %v (no attention term)", got, want)
	}
	want := base.StepTime(b.PrefillTokens, b.Decodes, b.KVUsage) + time.Duration(wantMS*float64(time.Millisecond))
	if got := attn.Step(b); absDur(got-want) > time.Microsecond {
		t.Fatalf("Step with attention = %v, want %v", got, want)
	}
	// The speedup divides the attention term too.
	attn.Speedup = 4
	if got := attn.Step(b); absDur(got-want/4) > time.Microsecond {
		t.Fatalf("Step at speedup 4 = %v, want %v", got, want/4)
	}
	// A step without decodes reads no decode context, whatever the field holds.
	attn.Speedup = 1
	pre := &Batch{Prefill: []Chunk{{Tokens: 100, Context: 900}}, PrefillTokens: 100, DecodeContext: 1 << 20}
	if got, want := attn.Step(pre), base.StepTime(100, 0, 0)+time.Duration(0.002*100*(900+50.5)/1000*float64(time.Millisecond)); absDur(got-want) > time.Microsecond {
		t.Fatalf("prefill-only Step = %v, want %v", got, want)
	}
	if got, want := attn.PrefillChunkMS(100, 900), base.PrefillMS(100)+0.002*100*(900+50.5)/1000; math.Abs(got-want) > 1e-9 {
		t.Fatalf("PrefillChunkMS = %v, want %v", got, want)
	}
	// The onboarding time still bounds the step from below.
	on := &Batch{Onboard: time.Hour}
	if got := attn.Step(on); got != time.Hour {
		t.Fatalf("Step with a long onboarding = %v, want 1h", got)
	}
}

// TestChunkedPrefillAttendsToContext: an engine with a prefill attention cost prices each
// chunk of a long prompt by the context before it, so later chunks of the same size take
// longer; without it the equal chunks cost the same.
func TestChunkedPrefillAttendsToContext(t *testing.T) {
	for _, attention := range []float64{0, 0.0012} {
		e, _, c := newTestEngine(t, func(cfg *Config) {
			cfg.NumGPUBlocks = 4096
			cfg.Timing.PrefillAttention = attention
		})
		submit(t, e, prompt(20000, 5), Params{MaxTokens: 2, IgnoreEOS: true})
		var steps []time.Duration
		for range 3 {
			d, _, _ := c.step()
			steps = append(steps, d)
		}
		tm := e.cfg.Timing
		for i, ch := range []Chunk{{8192, 0}, {8192, 8192}, {3616, 16384}} {
			want := time.Duration(tm.PrefillChunkMS(ch.Tokens, ch.Context) * float64(time.Millisecond))
			if absDur(steps[i]-want) > time.Microsecond {
				t.Fatalf("attention %g: step %d (%d tokens over %d) took %v, want %v", attention, i, ch.Tokens, ch.Context, steps[i], want)
			}
		}
		if attention == 0 && steps[0] != steps[1] {
			t.Fatalf("without attention two 8192-token chunks cost %v and %v", steps[0], steps[1])
		}
		if attention > 0 && steps[1] <= steps[0] {
			t.Fatalf("with attention the chunk over 8192 cached tokens (%v) is not dearer than the first (%v)", steps[1], steps[0])
		}
	}
}

func TestValidateAttention(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Timing.DecodeAttention = -1
	if err := cfg.Validate(); err == nil {
		t.Fatal("a negative decode attention cost passed Validate")
	}
}

func absDur(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}
