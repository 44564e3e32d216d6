package planner

import (
	"errors"
	"math"
	"testing"
	"time"
)

// FuzzParseProfile feeds arbitrary bytes to the profile parser and asks every accepted
// profile for throughput and latency at arbitrary points: nothing panics, a rejected profile
// says ErrProfile, and what an accepted one answers is finite and not negative.
func FuzzParseProfile(f *testing.F) {
	f.Add([]byte(`{"version":1,"prefill":[{"isl":1000,"concurrency":1,"ttft_ms":50,"throughput":20000},{"isl":4000,"concurrency":4,"ttft_ms":400,"throughput":40000}],"decode":[{"context":2000,"concurrency":1,"itl_ms":6,"throughput":160},{"context":2000,"concurrency":64,"itl_ms":60,"throughput":1000}]}`),
		1500.0, 8.0, int64(2*time.Second))
	f.Add([]byte(`{"decode":[{"context":1,"concurrency":1,"itl_ms":1,"throughput":1}]}`), 0.0, -3.0, int64(0))
	f.Add([]byte(`{"prefill":[{"isl":-1}]}`), math.Inf(1), 1.0, int64(-1))
	f.Fuzz(func(t *testing.T, data []byte, x, conc float64, target int64) {
		p, err := ParseProfile(data)
		if err != nil {
			if !errors.Is(err, ErrProfile) {
				t.Fatalf("error %v does not wrap ErrProfile", err)
			}
			return
		}
		bad := func(v float64) bool { return math.IsNaN(v) || math.IsInf(v, 0) || v < 0 }
		if tps, _ := p.PrefillThroughput(time.Duration(target), x); p.HasPrefill() && bad(tps) {
			t.Fatalf("prefill throughput %v at %v", tps, x)
		}
		if tps, _ := p.DecodeThroughput(time.Duration(target), x); p.HasDecode() && bad(tps) {
			t.Fatalf("decode throughput %v at %v", tps, x)
		}
		if p.HasPrefill() {
			if d := p.TTFT(x, conc); d < 0 {
				t.Fatalf("TTFT %v", d)
			}
		}
		if p.HasDecode() {
			if d := p.ITL(x, conc); d < 0 {
				t.Fatalf("ITL %v", d)
			}
		}
	})
}
