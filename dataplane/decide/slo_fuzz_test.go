package decide

import (
	"math"
	"testing"
)

// FuzzMillis: a latency target header of any bytes reads as 0 or a positive finite number of
// milliseconds of at most a day.
func FuzzMillis(f *testing.F) {
	for _, s := range []string{"250", "0.5", "1e3", "-5", "NaN", "Inf", "0", "86400001", "", " 12", "0x10", "1_000"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		v := millis(b)
		if v != 0 && !(v > 0 && v <= 86400e3) || math.IsNaN(v) {
			t.Fatalf("millis(%q) = %v", b, v)
		}
	})
}

func TestMillis(t *testing.T) {
	for in, want := range map[string]float64{"250": 250, "0.5": 0.5, "-5": 0, "NaN": 0, "Inf": 0, "": 0, "86400001": 0, "abc": 0} {
		if got := millis([]byte(in)); got != want {
			t.Errorf("millis(%q) = %v, want %v", in, got, want)
		}
	}
}
