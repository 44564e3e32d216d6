package rollout

import (
	"math"
	"slices"
)

// Histogram is a latency distribution in fixed buckets, as Prometheus keeps one: Counts[i]
// observations at most Bounds[i] (and above Bounds[i-1]); Counts has one more entry than
// Bounds, for the observations above the last bound.
type Histogram struct {
	Bounds []float64
	Counts []uint64
}

// Total is the number of observations.
func (h Histogram) Total() uint64 {
	var n uint64
	for _, c := range h.Counts {
		n += c
	}
	return n
}

// Sub is h less an earlier snapshot of the same series (a step's share of a cumulative
// histogram). Mismatched buckets give h unchanged.
func (h Histogram) Sub(earlier Histogram) Histogram {
	if !slices.Equal(h.Bounds, earlier.Bounds) || len(h.Counts) != len(earlier.Counts) {
		return h
	}
	out := Histogram{Bounds: h.Bounds, Counts: make([]uint64, len(h.Counts))}
	for i := range h.Counts {
		if h.Counts[i] > earlier.Counts[i] {
			out.Counts[i] = h.Counts[i] - earlier.Counts[i]
		}
	}
	return out
}

// Quantile estimates the q-quantile by linear interpolation within its bucket (the last,
// unbounded bucket counts as its lower bound); NaN without observations.
func (h Histogram) Quantile(q float64) float64 {
	n := h.Total()
	if n == 0 || len(h.Bounds) == 0 {
		return math.NaN()
	}
	rank := q * float64(n)
	var seen float64
	for i, c := range h.Counts {
		if c == 0 {
			continue
		}
		if seen+float64(c) >= rank {
			if i >= len(h.Bounds) {
				return h.Bounds[len(h.Bounds)-1]
			}
			lo := 0.0
			if i > 0 {
				lo = h.Bounds[i-1]
			}
			return lo + (h.Bounds[i]-lo)*(rank-seen)/float64(c)
		}
		seen += float64(c)
	}
	return h.Bounds[len(h.Bounds)-1]
}

// Slower reports whether the observations of b are stochastically greater than those of a
// by a one-sided Mann–Whitney U test at significance alpha, on the buckets (observations
// sharing a bucket are ties), with the normal approximation and its tie correction: the
// rank test Kayenta uses, so that a p90 that moved by noise does not fail a step.
func Slower(a, b Histogram, alpha float64) bool {
	na, nb := float64(a.Total()), float64(b.Total())
	if na == 0 || nb == 0 || len(a.Counts) != len(b.Counts) {
		return false
	}
	// U of b: for each bucket, b's observations beat a's in lower buckets, tie within it.
	var u, below, ties float64
	n := na + nb
	for i := range a.Counts {
		ca, cb := float64(a.Counts[i]), float64(b.Counts[i])
		u += cb * (below + ca/2)
		below += ca
		t := ca + cb
		ties += t*t*t - t
	}
	mean := na * nb / 2
	variance := na * nb / 12 * ((n + 1) - ties/(n*(n-1)))
	if variance <= 0 {
		return false
	}
	z := (u - mean - 0.5) / math.Sqrt(variance) // continuity correction
	return z > normalQuantile(1-alpha)
}

// normalQuantile is the standard normal's quantile for the usual levels (bisection on
// Erf; p in (0, 1)).
func normalQuantile(p float64) float64 {
	lo, hi := -10.0, 10.0
	for range 100 {
		mid := (lo + hi) / 2
		if 0.5*(1+math.Erf(mid/math.Sqrt2)) < p {
			lo = mid
		} else {
			hi = mid
		}
	}
	return (lo + hi) / 2
}
