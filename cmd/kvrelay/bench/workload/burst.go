package workload

import (
	"fmt"
	"time"
)

// burstParams are the keys of the on/off arrival modifier that the workloads with arrivals
// (prefix-groups, agentic and multi-turn with a rate, mixed) append to their own.
var burstParams = []param{
	{"burst", "1", "on/off arrivals: each burst_period starts with an on part of burst_period/burst in which arrivals come at burst × the mean rate, then none until the period ends (the mean rate is kept); 1: steady Poisson arrivals"},
	{"burst_period", "20s", "length of one on/off period of burst"},
}

// burst warps the arrival times of a steady (Poisson) process into an on/off one with the
// same mean rate: each period P keeps the arrivals the steady process makes in it, squeezed
// into its first P/factor. The steady process's draws are unchanged, so burst=1 gives the
// same requests as before, and any factor the same requests at other times.
type burst struct {
	factor float64
	period time.Duration
}

// burstOf reads the burst keys; errors are recorded in p.
func burstOf(p *params) burst {
	b := burst{factor: p.float("burst", 1, 1000), period: p.duration("burst_period")}
	if b.factor > 1 && b.period <= 0 && p.err == nil {
		p.fail("burst_period", p.vals["burst_period"], "a positive duration when burst > 1")
	}
	return b
}

// on reports whether the modifier changes arrival times.
func (b burst) on() bool { return b.factor > 1 && b.period > 0 }

// at maps the steady process's arrival time t to the on/off process's: the k-th period's
// arrivals keep their order and are compressed by factor towards the period's start.
func (b burst) at(t time.Duration) time.Duration {
	if !b.on() || t <= 0 {
		return t
	}
	k := t / b.period
	r := t - k*b.period
	return k*b.period + time.Duration(float64(r)/b.factor)
}

// needRate is the error for burst on a workload whose arrivals are not a rate.
func (b burst) needRate(name string) error {
	if b.on() {
		return fmt.Errorf("parsing workload %s: %w: burst needs arrivals at a rate (rate > 0)", name, ErrSpec)
	}
	return nil
}
