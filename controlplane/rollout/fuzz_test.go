package rollout

import (
	"encoding/binary"
	"math"
	"testing"
)

// FuzzAnalysis: histograms summed from proxies' reports, whatever their counts, give a
// quantile within the bounds (or NaN when empty) and a rank test that never panics.
func FuzzAnalysis(f *testing.F) {
	f.Add([]byte{1, 0, 2, 0, 3, 0, 4, 0, 0, 0, 9, 0})
	f.Fuzz(func(t *testing.T, raw []byte) {
		bounds := []float64{0.01, 0.1, 1, 10, 100}
		a := Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}
		b := Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}
		for i := 0; i+2 <= len(raw) && i/2 < 2*len(a.Counts); i += 2 {
			c := uint64(binary.LittleEndian.Uint16(raw[i:]))
			if j := i / 2; j < len(a.Counts) {
				a.Counts[j] = c
			} else {
				b.Counts[j-len(a.Counts)] = c
			}
		}
		for _, h := range []Histogram{a, b} {
			q := h.Quantile(0.9)
			if h.Total() == 0 != math.IsNaN(q) || !math.IsNaN(q) && (q < 0 || q > bounds[len(bounds)-1]) {
				t.Fatalf("p90 %v of %v", q, h.Counts)
			}
		}
		_ = Slower(a, b, 0.001)
		if Slower(a, a, 0.001) {
			t.Fatalf("%v slower than itself", a.Counts)
		}
	})
}
