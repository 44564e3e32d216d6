package sim

import "time"

// Timing is the step-time model of a simulated engine: how long one scheduler step takes on
// the modelled GPU, from what the step computes: a prefill cost quadratic in the new prefill
// tokens of the step, a decode cost a function of the KV cache usage fraction. The default
// coefficients are an assumption, not a measurement of a GPU (docs/timing-model.md says where
// they come from).
//
// A Timing is a value; it is safe to copy and to use from any goroutine.
type Timing struct {
	// PrefillA, PrefillB and PrefillC give a step with T new prefill tokens a prefill cost of
	// A·T² + B·T + C milliseconds.
	PrefillA, PrefillB, PrefillC float64
	// DecodeA, DecodeB and DecodeC give a step with decoding sequences a decode cost of
	// max(DecodeMin, A·p² + B·p + C) milliseconds, p being the KV usage fraction.
	DecodeA, DecodeB, DecodeC, DecodeMin float64
	// Speedup divides every step time (the engine's --speedup-ratio). Values ≤ 0 mean 1.
	Speedup float64
}

// DefaultTiming returns the default model (docs/timing-model.md) at speedup 1.
func DefaultTiming() Timing {
	return Timing{
		PrefillA: 4.209989e-7, PrefillB: 1.518344e-2, PrefillC: 16.50142,
		DecodeA: -25.74, DecodeB: 54.01, DecodeC: 5.74, DecodeMin: 1,
		Speedup: 1,
	}
}

// PrefillMS is the modelled cost in milliseconds of computing t new prefill tokens in a step,
// before the speedup.
func (m Timing) PrefillMS(t int) float64 {
	if t <= 0 {
		return 0
	}
	x := float64(t)
	return m.PrefillA*x*x + m.PrefillB*x + m.PrefillC
}

// DecodeMS is the modelled cost in milliseconds of one decode step at KV usage fraction p,
// before the speedup.
func (m Timing) DecodeMS(p float64) float64 {
	return max(m.DecodeMin, m.DecodeA*p*p+m.DecodeB*p+m.DecodeC)
}

// StepTime returns the wall time of a step that computes prefillTokens new prefill tokens
// while decodes sequences each decode one token, at KV usage fraction p: prefill(T) +
// decode(p), either term absent when the step has none of that work, divided by the speedup.
func (m Timing) StepTime(prefillTokens, decodes int, p float64) time.Duration {
	ms := m.PrefillMS(prefillTokens)
	if decodes > 0 {
		ms += m.DecodeMS(p)
	}
	s := m.Speedup
	if s <= 0 {
		s = 1
	}
	return time.Duration(ms / s * float64(time.Millisecond))
}

// Batch is what one scheduler step computes, as a StepModel prices it.
type Batch struct {
	// Prefill are the step's prefill chunks, one per request computing prompt tokens.
	Prefill []Chunk
	// PrefillTokens is the new prefill tokens of the step, summed over Prefill.
	PrefillTokens int
	// Decodes is the sequences that each decode one token; DecodeContext the tokens their
	// KV caches hold before the step, summed.
	Decodes, DecodeContext int
	// KVUsage is the fraction of GPU KV blocks in use.
	KVUsage float64
	// Onboard is the time the blocks this step's requests brought back from host memory or
	// disk take to reach GPU memory; engines overlap it with the step's compute, layer by
	// layer.
	Onboard time.Duration
}

// Chunk is one request's part of a step's prefill: Tokens new tokens computed over Context
// tokens already in its KV cache.
type Chunk struct{ Tokens, Context int }

// StepModel prices a scheduler step: the wall time of computing b. The engine's plan()
// builds b from the batch it scheduled; a calibrated or context-length-aware model replaces
// the polynomial Timing through Config.StepModel without touching the scheduler.
type StepModel interface {
	Step(b *Batch) time.Duration
}

var _ StepModel = Timing{}

// Step is the polynomial model's price of b: StepTime of its prefill tokens and decodes,
// or the onboarding time when that is longer (the transfer of layer i+1 overlaps the
// compute of layer i, so the slower of the two sets the step).
func (m Timing) Step(b *Batch) time.Duration {
	return max(m.StepTime(b.PrefillTokens, b.Decodes, b.KVUsage), b.Onboard)
}
