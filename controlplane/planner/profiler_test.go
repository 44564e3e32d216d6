package planner

import (
	"testing"
	"time"
)

// stream is a result whose chunks arrive at the given offsets (ms) from t0.
func stream(t0 time.Time, offsets ...int) result {
	r := result{start: t0}
	for _, o := range offsets {
		at := t0.Add(time.Duration(o) * time.Millisecond)
		if r.chunks == 0 {
			r.first = at
		}
		r.last = at
		r.chunks++
		r.times = append(r.times, at)
	}
	return r
}

// Decode points time steady decoding: the gaps after every stream has its first token, not
// the start, where the other streams' prefills run between an early stream's tokens.
func TestSteadyITL(t *testing.T) {
	t0 := time.Unix(100, 0)
	tests := []struct {
		name string
		rs   []result
		want float64
	}{
		// a's first token at 0, then 100 ms of b's prefill, then both decode every 10 ms.
		{"after the last first token", []result{stream(t0, 0, 100, 110, 120, 130), stream(t0, 100, 110, 120, 130)}, 10},
		// No gap starts after b's first token: whole streams, a's 50 ms (b, one token, has no
		// gap to count).
		{"whole streams when no steady gap", []result{stream(t0, 0, 50, 100), stream(t0, 100)}, 50},
		{"one token each", []result{stream(t0, 5), stream(t0, 7)}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := steadyITL(tc.rs)
			if ok != (tc.want > 0) || got != tc.want {
				t.Errorf("steadyITL = %v, %v; want %v", got, ok, tc.want)
			}
		})
	}
}
