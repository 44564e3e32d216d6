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
