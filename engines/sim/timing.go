package sim

import "time"

// Timing is the step-time model of a simulated engine: how long one scheduler step takes on
// the modelled GPU, from what the step computes. The defaults are ARCHITECTURE.md's fit for a
// vLLM server (prefill cost quadratic in the new prefill tokens of the step; decode cost a
// function of the KV cache usage fraction).
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

// DefaultTiming returns the model of ARCHITECTURE.md at speedup 1.
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

// Step returns the wall time of a step that computes prefillTokens new prefill tokens while
// decodes sequences each decode one token, at KV usage fraction p: prefill(T) + decode(p),
// either term absent when the step has none of that work, divided by the speedup.
func (m Timing) Step(prefillTokens, decodes int, p float64) time.Duration {
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
