package rollout

import (
	"encoding/binary"
	"math"
	"testing"
)

// FuzzAnalysis: histograms and conversation groups summed from proxies' reports, whatever
// their counts, give a quantile within the bounds (or NaN when empty) and a comparison that
// never panics and never fails an arm against itself.
func FuzzAnalysis(f *testing.F) {
	f.Add([]byte{1, 0, 2, 0, 3, 0, 4, 0, 0, 0, 9, 0})
	f.Add([]byte{255, 255, 0, 0, 0, 0, 7, 0, 1, 0, 0, 0, 255, 255, 3, 0, 0, 0, 9, 9})
	f.Fuzz(func(t *testing.T, raw []byte) {
		bounds := []float64{0.01, 0.1, 1, 10, 100}
		a := Histogram{Bounds: bounds, Counts: make([]uint64, len(bounds)+1)}
		var groups []Group
		for i := 0; i+2 <= len(raw); i += 2 {
			c := uint64(binary.LittleEndian.Uint16(raw[i:]))
			j := (i / 2) % len(a.Counts)
			a.Counts[j] += c
			if j == 0 {
				groups = append(groups, Group{ID: uint32(len(groups)), TTFT: make([]uint64, len(bounds)+1)})
			}
			g := &groups[len(groups)-1]
			g.TTFT[j] += c
			g.Requests += c
			g.RouterErrors += c % 3
			g.PromptBlocks += 10 * c
			g.CachedBlocks += c * uint64(j)
		}
		q := a.Quantile(0.9)
		if a.Total() == 0 != math.IsNaN(q) || !math.IsNaN(q) && (q < 0 || q > bounds[len(bounds)-1]) {
			t.Fatalf("p90 %v of %v", q, a.Counts)
		}
		s := DefaultSpec()
		arm := Arm{TTFT: a, Groups: groups}
		for _, c := range compare(s.metrics(), sampleOf(arm), sampleOf(arm), s.Alpha) {
			if c.Failed || math.IsNaN(c.T) {
				t.Fatalf("an arm against itself: %+v", c)
			}
		}
	})
}
