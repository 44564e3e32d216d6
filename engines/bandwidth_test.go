package engines

import (
	"math"
	"testing"
)

func TestParseBandwidth(t *testing.T) {
	for in, want := range map[string]float64{"50": 50e9, "50GB/s": 50e9, "800MB/s": 800e6, "1.6TB/s": 1.6e12, "12 GB": 12e9, "100B/s": 100} {
		if got, err := ParseBandwidth(in); err != nil || got != want {
			t.Errorf("ParseBandwidth(%q) = %v, %v", in, got, err)
		}
	}
	for _, in := range []string{"0", "-5GB/s", "fast", "", "Inf"} {
		if _, err := ParseBandwidth(in); err == nil {
			t.Errorf("ParseBandwidth(%q) accepted", in)
		}
	}
}

func TestFormatBandwidth(t *testing.T) {
	for v, want := range map[float64]string{25e9: "25GB/s", 800e6: "800MB/s", 1.6e12: "1.6TB/s", 512: "512B/s"} {
		if got := FormatBandwidth(v); got != want {
			t.Errorf("FormatBandwidth(%v) = %q, want %q", v, got, want)
		}
	}
}

// FuzzBandwidthRoundTrip: what FormatBandwidth writes, ParseBandwidth reads back exactly.
func FuzzBandwidthRoundTrip(f *testing.F) {
	for _, v := range []float64{1, 25e9, 0.1e9 + 1, 123456789.123, 7e15} {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v float64) {
		if !(v > 0) || math.IsInf(v, 0) {
			return
		}
		s := FormatBandwidth(v)
		got, err := ParseBandwidth(s)
		if err != nil || got != v {
			t.Fatalf("FormatBandwidth(%v) = %q reads back as %v, %v", v, s, got, err)
		}
	})
}
