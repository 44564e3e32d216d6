package workload

import (
	"math"
	"math/bits"
	"time"
)

// rng is a splitmix64 generator. kvrelay's workloads use it rather than math/rand so that a
// seed names the same requests on every Go release: the sequence and every value derived from
// it (integers, floats, exponential gaps) are defined in this file.
type rng struct{ s uint64 }

// newRNG returns a generator for one independent stream: the seed of the workload and the path
// of the stream below it (a kind, a session index, a block id, …). Each session owns its own
// stream, so the order in which a runner interleaves sessions never changes their requests.
func newRNG(seed uint64, path ...uint64) *rng {
	h := mix64(seed ^ 0x6b7672656c6179) // "kvrelay"
	for _, p := range path {
		h = mix64(h ^ mix64(p+0x9e3779b97f4a7c15))
	}
	return &rng{s: h}
}

// mix64 is the splitmix64 finalizer, a bijection on 64-bit values.
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func (r *rng) uint64() uint64 {
	r.s += 0x9e3779b97f4a7c15
	return mix64(r.s)
}

// intn returns a value in [0, n) for n > 0 (multiply-shift; the bias is below n/2^64).
func (r *rng) intn(n int) int {
	hi, _ := bits.Mul64(r.uint64(), uint64(n))
	return int(hi)
}

// rangeInt returns a value in [lo, hi].
func (r *rng) rangeInt(lo, hi int) int {
	if hi <= lo {
		return lo
	}
	return lo + r.intn(hi-lo+1)
}

// float64 returns a value in [0, 1).
func (r *rng) float64() float64 {
	return float64(r.uint64()>>11) / (1 << 53)
}

// exp returns an exponentially distributed duration with the given mean, rounded to the
// microsecond.
func (r *rng) exp(mean time.Duration) time.Duration {
	if mean <= 0 {
		return 0
	}
	d := -math.Log1p(-r.float64()) * float64(mean)
	return time.Duration(math.Round(d/1e3)) * time.Microsecond
}

// pick draws an index in [0, n) with P(k) ∝ 1/(k+1)^s by inverting the cumulative weights
// in cdf (built by zipfCDF).
func (r *rng) pick(cdf []float64) int {
	u := r.float64() * cdf[len(cdf)-1]
	lo, hi := 0, len(cdf)-1
	for lo < hi {
		m := (lo + hi) / 2
		if cdf[m] > u {
			hi = m
		} else {
			lo = m + 1
		}
	}
	return lo
}

// zipfCDF returns the cumulative weights of n ranks with exponent s (s = 0: uniform).
func zipfCDF(n int, s float64) []float64 {
	cdf := make([]float64, n)
	sum := 0.0
	for k := range cdf {
		sum += math.Pow(float64(k+1), -s)
		cdf[k] = sum
	}
	return cdf
}
