package bench

import (
	"time"

	"github.com/kvrelay/kvrelay/engines/sim"
)

// PrefillModel is how long an engine takes to compute a prompt's uncached tokens when it has
// nothing else to do: steps of up to ChunkTokens new tokens (the engine's token budget per
// step, max_num_batched_tokens), the full chunks first as a chunked-prefill scheduler takes
// them, each step costing Timing.PrefillMS. `bench compare` knows it for its simulated
// engines; with it a run's TTFT splits into the request's own prefill and the time it spent
// waiting (Breakdown).
type PrefillModel struct {
	// Timing is the engines' step-time model; its Speedup is ignored (a compare run reports
	// in the engines' own time).
	Timing      sim.Timing
	ChunkTokens int
}

// Time is the modelled time to compute tokens new prompt tokens on an idle engine; 0 for
// none.
func (m PrefillModel) Time(tokens int) time.Duration {
	if tokens <= 0 {
		return 0
	}
	chunk := m.ChunkTokens
	if chunk <= 0 {
		chunk = tokens
	}
	var ms float64
	for ; tokens > 0; tokens -= chunk {
		ms += m.Timing.PrefillMS(min(tokens, chunk))
	}
	return time.Duration(ms * float64(time.Millisecond))
}

// Breakdown describes what the TTFT of a run's successful requests is made of, by what an
// engine of the model must compute and what it did not have to. Each is a distribution of its
// own: percentiles do not add up (own prefill p50 + wait p50 is not TTFT p50).
//
//   - Prefill is each request's own prefill: its uncached prompt tokens (prompt_tokens less
//     the cached_tokens the engine reported) computed alone on an idle engine.
//   - Wait is its TTFT beyond that: the prefills queued ahead of it on its worker, other
//     prompts' tokens sharing its steps, the step under way when it arrived, the decodes
//     sharing its steps, a recomputation after preemption, a host that ran the engine late,
//     and the data plane (in a compare run all of it × the engine speedup, like every time
//     it reports). A request whose engine ran ahead of its model (a busy simulated engine
//     catching up up to 20 ms on a late step) counts 0.
//   - Floor is the own prefill it would have had with the ideal cache's hits
//     (Record.IdealCached: one unbounded prefix cache shared by every engine, or the
//     engine's own hits where they were more) and nothing else on its worker. Its p50 is a
//     lower bound of this run's TTFT p50 under any routing, on these engines and this
//     request stream, up to the engines' catching up: the best placement of every prompt,
//     no queue, no decodes beside. It assumes the engines' scheduler (full chunks first,
//     a step's cost rising with its tokens), and it is not tight: some waiting is
//     unavoidable at any load.
type Breakdown struct {
	Prefill Dist `json:"prefill"`
	Wait    Dist `json:"wait"`
	Floor   Dist `json:"floor"`
}

// NewBreakdown computes the breakdown of recs' successful requests under m.
func NewBreakdown(recs []*Record, m PrefillModel) *Breakdown {
	var own, wait, floor []time.Duration
	for _, r := range recs {
		if !r.OK() {
			continue
		}
		p := m.Time(r.PromptTokens - r.CachedTokens)
		own = append(own, p)
		wait = append(wait, max(r.TTFT-p, 0))
		// The ideal cache replays the successful requests in send order; an engine that took
		// them in another order, or that kept what a failed request computed, can have held
		// more of one, and then that is what the floor takes. (A request the replay did not
		// count has IdealCached 0.)
		floor = append(floor, m.Time(r.PromptTokens-max(r.CachedTokens, r.IdealCached)))
	}
	if len(own) == 0 {
		return nil
	}
	return &Breakdown{Prefill: dist(own), Wait: dist(wait), Floor: dist(floor)}
}
