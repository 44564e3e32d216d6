package rollout

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
)

// The analysis's operating figures, on the simulated fleet with the default spec: neutral
// candidates on conversations of 10–20 requests with 0.5 % router errors (and as many client
// errors and departures) are not rolled back; a candidate with a tail-only regression (85 %
// of requests 10 % faster, 15 % four times slower: p90 about ×1.8) is rolled back at 10
// requests per second; a candidate that fails every request is rolled back within 15 s of
// its first request; at 3 requests per second a neutral candidate is promoted, each step
// within its timeout. Each figure is measured over seeded rollouts and logged; the test
// fails when one misses its target.

// suite runs n seeded rollouts of tr on 2 goroutines and returns their results.
func suite(n int, s Spec, tr traffic, baseline float64) []simResult {
	out := make([]simResult, n)
	var wg sync.WaitGroup
	work := make(chan int)
	for range max(runtime.GOMAXPROCS(0), 2) {
		wg.Go(func() {
			for i := range work {
				out[i] = simulate(s, newFleet(uint64(1000+i), tr), baseline, 2*time.Hour)
			}
		})
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	return out
}

func count(rs []simResult, f func(simResult) bool) int {
	n := 0
	for _, r := range rs {
		if f(r) {
			n++
		}
	}
	return n
}

// reasons tallies how rollouts that did not promote ended.
func reasons(rs []simResult) string {
	m := map[string]int{}
	for _, r := range rs {
		if r.r.State != StatePromoted && len(r.r.Results) > 0 {
			why := r.r.Results[len(r.r.Results)-1].Reason
			if len(why) > 60 {
				why = why[:60]
			}
			m[r.r.State+": "+why]++
		}
	}
	return fmt.Sprint(m)
}

func TestSuiteNeutralIsNotRolledBack(t *testing.T) {
	if testing.Short() {
		t.Skip("600 simulated rollouts")
	}
	const n = 600
	rs := suite(n, DefaultSpec(), defaultTraffic(10), 0)
	bad := count(rs, func(r simResult) bool { return r.r.State != StatePromoted })
	t.Logf("neutral at 10 req/s: %d of %d not promoted (%.1f%%) %s", bad, n, 100*float64(bad)/n, reasons(rs))
	if bad > n/100 {
		t.Fatalf("%d of %d neutral rollouts not promoted: want at most 1%%", bad, n)
	}
}

func TestSuiteTailOnlyRegressionIsRolledBack(t *testing.T) {
	if testing.Short() {
		t.Skip("200 simulated rollouts")
	}
	const n = 200
	tr := defaultTraffic(10)
	tr.cand = effect{slowShare: 0.15, slowFactor: 4, fastFactor: 0.9}
	rs := suite(n, DefaultSpec(), tr, 0)
	caught := count(rs, func(r simResult) bool { return r.r.State == StateRolledBack })
	var at []float64
	for _, r := range rs {
		if r.r.State == StateRolledBack {
			at = append(at, r.at)
		}
	}
	slices.Sort(at)
	med := 0.0
	if len(at) > 0 {
		med = at[len(at)/2]
	}
	t.Logf("tail-only regression at 10 req/s: rolled back in %d of %d (median after %.0f s) %s", caught, n, med, reasons(rs))
	if caught < n*95/100 {
		t.Fatalf("rolled back in %d of %d: want at least 95%%", caught, n)
	}
}

func TestSuiteFailingCandidateIsAbortedFast(t *testing.T) {
	const n = 100
	tr := defaultTraffic(10)
	tr.cand = effect{failAll: true}
	s := DefaultSpec()
	rs := suite(n, s, tr, 0)
	// Seconds from the candidate's first request to the rollback.
	var worst float64
	late := 0
	for _, r := range rs {
		if r.r.State != StateRolledBack {
			t.Fatalf("a failing candidate ended %s: %+v", r.r.State, r.r.Results)
		}
		first := firstCandidateRequest(r)
		if d := r.at - first; d > 15 {
			late++
			worst = max(worst, d)
		}
	}
	t.Logf("failing every request at 10 req/s: rolled back in %d of %d, %d later than 15 s after the candidate's first request (worst %.0f s)", n, n, late, worst)
	if late > n*5/100 {
		t.Fatalf("%d of %d rolled back later than 15 s after the candidate's first request", late, n)
	}
}

// firstCandidateRequest is when (seconds) a simulated rollout first sent the candidate a
// request, replayed from its seed.
func firstCandidateRequest(r simResult) float64 {
	return r.firstCand
}

func TestSuiteLowTrafficPromotes(t *testing.T) {
	if testing.Short() {
		t.Skip("200 simulated rollouts")
	}
	const n = 200
	s := DefaultSpec()
	rs := suite(n, s, defaultTraffic(3), 0)
	promoted := count(rs, func(r simResult) bool { return r.r.State == StatePromoted })
	t.Logf("neutral at 3 req/s: promoted in %d of %d %s", promoted, n, reasons(rs))
	if promoted < n*95/100 {
		t.Fatalf("promoted in %d of %d: want at least 95%%", promoted, n)
	}
	for _, r := range rs {
		for _, res := range r.r.Results {
			if res.End.Sub(res.Start) > s.StepTimeout {
				t.Fatalf("a step ran %v, past its timeout", res.End.Sub(res.Start))
			}
		}
	}
}

// TestSuiteInterference: a candidate that herds requests onto the workers both arms share
// slows the stable arm as much as its own, so the arms compare alike; against the stable
// arm's figures before the rollout the slowdown shows, and the rollout pauses for an
// operator instead of promoting.
func TestSuiteInterference(t *testing.T) {
	if testing.Short() {
		t.Skip("50 simulated rollouts")
	}
	const n = 50
	tr := defaultTraffic(10)
	tr.interference = 1.5 // ×1.75 at a half share, ×1.4 at a quarter
	rs := suite(n, DefaultSpec(), tr, 300)
	paused := count(rs, func(r simResult) bool { return r.r.State == StatePaused })
	t.Logf("herding candidate at 10 req/s: paused in %d of %d %s", paused, n, reasons(rs))
	without := DefaultSpec()
	without.MaxBaselineTTFTP90Ratio = 0
	rs0 := suite(n, without, tr, 300)
	promoted0 := count(rs0, func(r simResult) bool { return r.r.State == StatePromoted })
	t.Logf("the same without the baseline: promoted in %d of %d", promoted0, n)
	if paused < n*9/10 {
		t.Fatalf("paused in %d of %d: want at least 90%%", paused, n)
	}
}

// TestSuiteOldRulesReproduceTheFlaws judges the same simulated steps by the rules the
// analysis had before it took conversations as its unit: each request an independent sample
// (a one-sided Mann–Whitney test at 0.001 on the TTFT buckets, beside p90 > 1.10 × stable),
// every non-2xx answer an error compared with no test (candidate rate > stable + 0.5
// points). On neutral conversations with 0.5 % router errors (and as many client errors and
// departures) those rules roll back far more than 1 % of rollouts, and they promote most
// tail-only regressions: the flaws the analysis above removes.
func TestSuiteOldRulesReproduceTheFlaws(t *testing.T) {
	if testing.Short() {
		t.Skip("300 simulated rollouts")
	}
	judgeErrors := true
	oldFails := func(stable, cand Arm) (bool, string) {
		se := float64(stable.Errors+stable.ClientGone) / float64(max(stable.Requests, 1))
		ce := float64(cand.Errors+cand.ClientGone) / float64(max(cand.Requests, 1))
		if judgeErrors && ce > se+0.005 {
			return true, "errors"
		}
		if cand.TTFT.Quantile(0.9) > 1.1*stable.TTFT.Quantile(0.9) && mannWhitneySlower(stable.TTFT, cand.TTFT, 0.001) {
			return true, "TTFT"
		}
		return false, ""
	}
	// Three steps of 2 minutes at 5, 25 and 50 %, 200 requests of each arm at least (the old
	// defaults), judged once each.
	rollout := func(seed uint64, tr traffic) (bool, string) {
		f := newFleet(seed, tr)
		now := 0.0
		for _, share := range []float64{0.05, 0.25, 0.5} {
			s0, c0 := f.stable.clone(), f.cand.clone()
			for end := now + 120; ; end += 10 {
				f.run(end, share)
				if f.cand.Requests-c0.Requests >= 200 || end >= now+600 {
					now = end
					break
				}
			}
			if failed, why := oldFails(f.stable.Sub(s0), f.cand.Sub(c0)); failed {
				return true, why
			}
		}
		return false, ""
	}
	const n = 300
	falseBack := map[string]int{}
	for i := range n {
		if failed, why := rollout(uint64(1000+i), defaultTraffic(10)); failed {
			falseBack[why]++
		}
	}
	// The tail-only regression on latency alone, on traffic without errors: how often the
	// old TTFT rule lets it through.
	judgeErrors = false
	tr := defaultTraffic(10)
	tr.errorRate, tr.clientError, tr.clientGone = 0, 0, 0
	tr.cand = effect{slowShare: 0.15, slowFactor: 4, fastFactor: 0.9}
	promoted := 0
	for i := range 100 {
		if failed, _ := rollout(uint64(1000+i), tr); !failed {
			promoted++
		}
	}
	t.Logf("the old rules: neutral rollouts rolled back %v of %d; tail-only regressions promoted by the TTFT rule %d of 100", falseBack, n, promoted)
	if falseBack["errors"]+falseBack["TTFT"] < n/20 {
		t.Fatalf("the old rules no longer show their flaws on this fleet: rolled back %v of %d neutral", falseBack, n)
	}
}

// mannWhitneySlower is the rank test the old analysis used: whether b's observations are
// stochastically greater than a's, one-sided at alpha, with the buckets' ties.
func mannWhitneySlower(a, b Histogram, alpha float64) bool {
	na, nb := float64(a.Total()), float64(b.Total())
	if na == 0 || nb == 0 || len(a.Counts) != len(b.Counts) {
		return false
	}
	var u, below, ties float64
	n := na + nb
	for i := range a.Counts {
		ca, cb := float64(a.Counts[i]), float64(b.Counts[i])
		u += cb * (below + ca/2)
		below += ca
		c := ca + cb
		ties += c*c*c - c
	}
	variance := na * nb / 12 * ((n + 1) - ties/(n*(n-1)))
	if variance <= 0 {
		return false
	}
	return (u-na*nb/2-0.5)/math.Sqrt(variance) > studentTQuantile(1-alpha, 1e9)
}
