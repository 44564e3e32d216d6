package benchharness

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// Stat is a per-run value's median and range over the runs that measured it (NaN and
// infinite values left out).
type Stat struct {
	Med, Lo, Hi float64
	N           int
}

// StatOf summarises xs.
func StatOf(xs []float64) Stat {
	var v []float64
	for _, x := range xs {
		if !math.IsNaN(x) && !math.IsInf(x, 0) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return Stat{Med: math.NaN(), Lo: math.NaN(), Hi: math.NaN()}
	}
	slices.Sort(v)
	return Stat{Med: Quantile(v, 0.5), Lo: v[0], Hi: v[len(v)-1], N: len(v)}
}

// Cell is "median [min–max]", the range left out for a single run or where it rounds away.
func (s Stat) Cell(f func(float64) string) string {
	if s.N == 0 {
		return "–"
	}
	if s.N == 1 || f(s.Lo) == f(s.Hi) {
		return f(s.Med)
	}
	return fmt.Sprintf("%s [%s–%s]", f(s.Med), f(s.Lo), f(s.Hi))
}

// Overlaps reports whether the ranges of s and o share a value.
func (s Stat) Overlaps(o Stat) bool {
	if s.N == 0 || o.N == 0 {
		return false
	}
	return s.Lo <= o.Hi && o.Lo <= s.Hi
}

// Num formats a value with three significant digits or so; "–" for NaN.
func Num(v float64) string {
	switch a := math.Abs(v); {
	case math.IsNaN(v):
		return "–"
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3f", v)
	}
}

// Pct formats a fraction as a percentage.
func Pct(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%.1f%%", 100*v)
}

// Ratio formats a ratio as ×r.
func Ratio(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("×%.2f", v)
}

// StopAll stops every process the harness still runs (SIGTERM, then SIGKILL after grace):
// for a harness's deferred cleanup.
func StopAll(grace time.Duration) { procs.stopAll(grace) }
