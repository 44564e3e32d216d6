package bench

import "testing"

// FuzzParseSetups: any --setups text either parses into setups a cluster can start (a known
// mode, distinct labels, pool sizes within bounds) or is refused; it never panics.
func FuzzParseSetups(f *testing.F) {
	for _, s := range []string{"agg:4,disagg:2+2,conditional:2+2", "conditional@1024:1+3", "agg", "disagg:0+2", "agg:4,agg:4", "conditional@x:2+2", ",,"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		setups, err := ParseSetups(s)
		if err != nil {
			return
		}
		seen := map[string]bool{}
		for _, st := range setups {
			switch st.Mode {
			case ModeAgg, ModeDisagg, ModeConditional:
			default:
				t.Fatalf("%q: mode %q", s, st.Mode)
			}
			if seen[st.Label] {
				t.Fatalf("%q: label %q twice", s, st.Label)
			}
			seen[st.Label] = true
			for _, n := range []int{st.Workers, st.PrefillWorkers, st.DecodeWorkers} {
				if n < 0 || n > 1024 {
					t.Fatalf("%q: pool size %d", s, n)
				}
			}
			if st.DisaggThreshold < 0 {
				t.Fatalf("%q: threshold %d", s, st.DisaggThreshold)
			}
		}
	})
}

// FuzzPredictedTTFT: any route header reads as no prediction or a positive one.
func FuzzPredictedTTFT(f *testing.F) {
	for _, s := range []string{"cost; overlap=3; best=3; ttft_ms=41.2", "spread; overlap=0; best=0", "x; ttft_ms=-1", "ttft_ms=NaN", "ttft_ms=1e300", "ttft_ms=5;ttft_ms=7"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if d := predictedTTFT(s); d < 0 {
			t.Fatalf("predictedTTFT(%q) = %v", s, d)
		}
	})
}
