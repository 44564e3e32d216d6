package latency

import (
	"math"
	"math/rand/v2"
	"testing"
)

func newModel() *Model {
	m := new(Model)
	m.Init()
	return m
}

// The table learns a step that grows with the batch and the cache, and reads it between
// the batch sizes it saw.
func TestDecodeLearnsCurve(t *testing.T) {
	m := newModel()
	truth := func(b int, kv float64) float64 { return (0.012 + 0.0015*float64(b)) * (1 + 0.6*kv) }
	rng := rand.New(rand.NewPCG(1, 2))
	for range 4000 {
		b := 1 + rng.IntN(40)
		kv := rng.Float64()
		m.observeITL(b, kv, truth(b, kv)*(1+0.1*rng.NormFloat64()))
	}
	for _, c := range []struct {
		b  int
		kv float64
	}{{1, 0.1}, {4, 0.5}, {8, 0.9}, {22, 0.3}, {37, 0.7}} {
		if got, want := m.ITL(c.b, c.kv), truth(c.b, c.kv); math.Abs(got-want) > 0.08*want {
			t.Errorf("ITL(%d, %.1f) = %.4f, want %.4f", c.b, c.kv, got, want)
		}
	}
	prev := 0.0
	for b := 1; b <= 300; b++ {
		got := m.ITL(b, 0.2)
		if got < prev {
			t.Fatalf("ITL(%d) = %v below ITL(%d) = %v", b, got, b-1, prev)
		}
		prev = got
	}
}

// A burst of outliers (requests stalled behind a preemption) moves a trained bucket a few
// percent at most, and a table taught wrong things for a while comes back to what the
// engine does within tens of observations a bucket.
func TestDecodeRobust(t *testing.T) {
	m := newModel()
	for range 200 {
		m.observeITL(4, 0.2, 0.020)
	}
	for range 5 {
		m.observeITL(4, 0.2, 2.0)
	}
	if got := m.ITL(4, 0.2); got > 0.020*1.2 {
		t.Fatalf("after 5 outliers ITL(4) = %v, want near 0.020", got)
	}
	// Taught a step five times too slow for long enough to believe it.
	for range 500 {
		m.observeITL(4, 0.2, 0.100)
	}
	if got := m.ITL(4, 0.2); got < 0.08 {
		t.Fatalf("ITL(4) = %v after a persistent shift, want near 0.100", got)
	}
	n := 0
	for m.ITL(4, 0.2) > 0.022 {
		m.observeITL(4, 0.2, 0.020)
		if n++; n > 100 {
			t.Fatalf("ITL(4) = %v after %d observations of 0.020", m.ITL(4, 0.2), n)
		}
	}
	// The neighbours nothing taught follow the bucket that was.
	if got := m.ITL(5, 0.2); math.Abs(got-m.ITL(4, 0.2)) > 1e-9 {
		t.Fatalf("ITL(5) = %v, want ITL(4) = %v carried flat", got, m.ITL(4, 0.2))
	}
	for _, bad := range []float64{math.NaN(), math.Inf(1), -1, 0} {
		w := new(Worker)
		w.Init(m)
		before := m.ITL(4, 0.2)
		w.ObserveDecode(4, 0.2, bad, 1)
		if m.ITL(4, 0.2) != before {
			t.Fatalf("ObserveDecode(itl %v) moved the table", bad)
		}
	}
}

func TestIsotonic(t *testing.T) {
	v := []float64{1, 3, 2, 2, 5, 4}
	isotonic(v, []float64{1, 1, 1, 1, 1, 3})
	want := []float64{1, 7.0 / 3, 7.0 / 3, 7.0 / 3, 4.25, 4.25}
	for i := range v {
		if math.Abs(v[i]-want[i]) > 1e-12 {
			t.Fatalf("isotonic = %v, want %v", v, want)
		}
	}
}

func TestBucketOf(t *testing.T) {
	for _, c := range []struct {
		b      float64
		lo, hi int
		w      float64
	}{{0, 0, 0, 0}, {1, 0, 0, 0}, {3, 2, 2, 0}, {16, 15, 15, 0}, {18, 15, 16, 0.5}, {56, 20, 21, 0.5}, {256, 25, 25, 0}, {1000, 25, 25, 0}} {
		lo, hi, w := bucketOf(c.b)
		if lo != c.lo || hi != c.hi || math.Abs(w-c.w) > 1e-12 {
			t.Errorf("bucketOf(%v) = %d, %d, %v; want %d, %d, %v", c.b, lo, hi, w, c.lo, c.hi, c.w)
		}
	}
}
