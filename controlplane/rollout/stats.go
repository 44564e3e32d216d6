package rollout

import (
	"math"
	"slices"
)

// The analysis compares the arms on the right unit. Proxies split a rollout's traffic by
// conversation (every request of a conversation goes to one arm), and a conversation's
// requests are not independent: they share a prompt, a cache, a worker and a client. So
// each proxy counts its figures in a fixed number of conversation groups (a conversation's
// hash names its group on every proxy), and the analysis takes the group, not the request,
// as its sample. Every figure is tested as a ratio of sums over the groups (errors of
// requests, cached of prompt blocks, requests slower than a threshold of requests), whose
// variance is the groups' spread around it (the cluster-robust, linearized variance of
// survey sampling), and the difference between the arms is judged with Student's t on the
// groups' degrees of freedom: a handful of long conversations cannot pass for hundreds of
// independent requests. A quantile is tested through the share of each arm's requests
// slower than both arms' quantile together: a tail that grew shows as more of the
// candidate's requests above the fleet's p90, which a shift of the median alone would not
// make, and which, unlike the quantile itself, varies smoothly from group to group.

// Group is one conversation group's figures in an arm: the unit of the analysis. TTFT and
// ITL count into the arm's histogram bounds.
type Group struct {
	ID                                               uint32
	Requests, RouterErrors, ClientErrors, ClientGone uint64
	CachedBlocks, PromptBlocks                       uint64
	TTFT, ITL                                        []uint64
}

// sample is one arm's groups with requests over a step, and its histogram bounds.
type sample struct {
	groups    []Group
	ttft, itl []float64
}

func sampleOf(a Arm) sample {
	s := sample{ttft: a.TTFT.Bounds, itl: a.ITL.Bounds}
	for _, g := range a.Groups {
		if g.Requests > 0 {
			s.groups = append(s.groups, g)
		}
	}
	return s
}

// metric is one figure the analysis compares: a rate (a share of a count, by group), or a
// quantile of a histogram; compared as a ratio (candidate ÷ stable) or a difference, with
// which way is worse (+1: higher) and the effect beyond which it fails.
type metric struct {
	name  string
	ratio bool
	worse float64
	bound float64
	// rate is a rate's events and count in a group.
	rate func(g *Group) (x, n float64)
	// q, hist and bounds make a quantile: the q-quantile of the histogram hist of each group
	// over bounds.
	q      float64
	hist   func(g *Group) []uint64
	bounds func(s *sample) []float64
}

// metrics are the figures a step is judged on, in the order a failure is reported.
func (s Spec) metrics() []metric {
	ttft := func(g *Group) []uint64 { return g.TTFT }
	ttftBounds := func(s *sample) []float64 { return s.ttft }
	ms := []metric{
		{name: "router error rate", worse: 1, bound: s.MaxErrorRateDelta,
			rate: func(g *Group) (float64, float64) { return float64(g.RouterErrors), float64(g.Requests) }},
		{name: "prefix hit rate", worse: -1, bound: s.MaxHitRateDrop,
			rate: func(g *Group) (float64, float64) { return float64(g.CachedBlocks), float64(g.PromptBlocks) }},
		{name: "TTFT p90", ratio: true, worse: 1, bound: s.MaxTTFTP90Ratio, q: 0.9, hist: ttft, bounds: ttftBounds},
	}
	if s.MaxTTFTP50Ratio > 0 {
		ms = append(ms, metric{name: "TTFT p50", ratio: true, worse: 1, bound: s.MaxTTFTP50Ratio, q: 0.5, hist: ttft, bounds: ttftBounds})
	}
	if s.MaxITLP90Ratio > 0 {
		ms = append(ms, metric{name: "ITL p90", ratio: true, worse: 1, bound: s.MaxITLP90Ratio, q: 0.9,
			hist: func(g *Group) []uint64 { return g.ITL }, bounds: func(s *sample) []float64 { return s.itl }})
	}
	return ms
}

// Check is one figure of a judged step: each arm's value, the effect (candidate ÷ stable,
// or candidate − stable for rates), the bound it may not pass, and the test: the
// difference between the arms' rates (for a quantile, their shares of requests beyond both
// arms' quantile together) in standard errors from the groups' spread (T), against
// Student's t at the spec's alpha on the groups' degrees of freedom (Critical). It fails
// when the effect is past its bound (Beyond) and T passes Critical.
type Check struct {
	Metric    string  `json:"metric"`
	Stable    float64 `json:"stable"`
	Candidate float64 `json:"candidate"`
	Effect    float64 `json:"effect"`
	Bound     float64 `json:"bound"`
	T         float64 `json:"t"`
	Critical  float64 `json:"critical"`
	Beyond    bool    `json:"beyond"`
	Failed    bool    `json:"failed"`
}

// ratioOf is the ratio of sums Σx ÷ Σn over groups (x, n), and its variance by the groups'
// spread (k/(k−1) Σ(x − r·n)² ÷ (Σn)²), at least the binomial variance of Σn independent
// trials at the rate (taken at one event in Σn + 2 at least: a rate of none is not
// certain).
func ratioOf(xs, ns []float64) (r, v float64, ok bool) {
	var sx, sn float64
	for i := range xs {
		sx += xs[i]
		sn += ns[i]
	}
	if sn <= 0 {
		return 0, 0, false
	}
	r = sx / sn
	k := float64(len(xs))
	for i := range xs {
		d := xs[i] - r*ns[i]
		v += d * d
	}
	if k > 1 {
		v *= k / (k - 1) / (sn * sn)
	}
	p := min(max(r, 1/(sn+2)), 1-1/(sn+2))
	return r, max(v, p*(1-p)/sn), true
}

// above is how many of counts (over bounds) lie above t, those of t's bucket in proportion
// to the part of the bucket above it; and their total.
func above(bounds []float64, counts []uint64, t float64) (x, n float64) {
	for i, c := range counts {
		n += float64(c)
		lo, hi := 0.0, math.Inf(1)
		if i > 0 {
			lo = bounds[i-1]
		}
		if i < len(bounds) {
			hi = bounds[i]
		}
		switch {
		case lo >= t:
			x += float64(c)
		case hi > t && !math.IsInf(hi, 1):
			x += float64(c) * (hi - t) / (hi - lo)
		}
	}
	return x, n
}

// compare judges cand against base on every metric.
func compare(ms []metric, base, cand sample, alpha float64) []Check {
	df := min(len(base.groups), len(cand.groups)) - 1
	crit := studentTQuantile(1-alpha, float64(max(df, 1)))
	out := make([]Check, 0, len(ms))
	xs, ns := make([]float64, 0, 64), make([]float64, 0, 64)
	for _, m := range ms {
		ch := Check{Metric: m.name, Bound: m.bound, Critical: crit}
		// The test's rates over each arm's groups: x of n in each group.
		var (
			rb, rc, vb, vc float64
			ok             = true
		)
		rateOf := func(s *sample, f func(g *Group) (float64, float64)) (float64, float64) {
			xs, ns = xs[:0], ns[:0]
			for i := range s.groups {
				x, n := f(&s.groups[i])
				xs, ns = append(xs, x), append(ns, n)
			}
			r, v, has := ratioOf(xs, ns)
			ok = ok && has
			return r, v
		}
		if m.rate != nil {
			rb, vb = rateOf(&base, m.rate)
			rc, vc = rateOf(&cand, m.rate)
			ch.Stable, ch.Candidate, ch.Effect = rb, rc, rc-rb
			ch.Beyond = m.worse*(rc-rb) > m.bound
		} else {
			hb, hc := sum(&base, m.hist), sum(&cand, m.hist)
			bb, bc := m.bounds(&base), m.bounds(&cand)
			if !slices.Equal(bb, bc) || len(hb) != len(bb)+1 {
				out = append(out, ch)
				continue
			}
			qb, qc := (Histogram{Bounds: bb, Counts: hb}).Quantile(m.q), (Histogram{Bounds: bb, Counts: hc}).Quantile(m.q)
			both := slices.Clone(hb)
			for i := range both {
				both[i] += hc[i]
			}
			t := (Histogram{Bounds: bb, Counts: both}).Quantile(m.q)
			if math.IsNaN(qb) || math.IsNaN(qc) || !(qb > 0) || math.IsNaN(t) {
				out = append(out, ch)
				continue
			}
			slower := func(g *Group) (float64, float64) {
				if h := m.hist(g); len(h) == len(bb)+1 {
					return above(bb, h, t)
				}
				return 0, 0
			}
			rb, vb = rateOf(&base, slower)
			rc, vc = rateOf(&cand, slower)
			ch.Stable, ch.Candidate, ch.Effect = qb, qc, qc/qb
			ch.Beyond = qc/qb > m.bound
		}
		if !ok {
			out = append(out, Check{Metric: m.name, Bound: m.bound, Critical: crit})
			continue
		}
		// Worse, for a quantile, is more of the arm's requests beyond the common quantile;
		// for a rate, the rate's worse direction.
		d := rc - rb
		if m.rate != nil {
			d *= m.worse
		}
		if se := math.Sqrt(vb + vc); d > 0 && se > 0 {
			ch.T = d / se
		}
		ch.Failed = ch.Beyond && ch.T > crit && df >= 1
		out = append(out, ch)
	}
	return out
}

// sum is a sample's histogram hist summed over its groups (those of the bounds' length).
func sum(s *sample, hist func(g *Group) []uint64) []uint64 {
	var out []uint64
	for i := range s.groups {
		h := hist(&s.groups[i])
		switch {
		case len(h) == 0:
		case out == nil:
			out = slices.Clone(h)
		case len(h) == len(out):
			for j, c := range h {
				out[j] += c
			}
		}
	}
	return out
}

// studentTQuantile is Student's t distribution's p-quantile with df degrees of freedom
// (p in (0.5, 1)), by bisection on its distribution function.
func studentTQuantile(p, df float64) float64 {
	lo, hi := 0.0, 1e3
	for range 200 {
		mid := (lo + hi) / 2
		if studentTCDF(mid, df) < p {
			lo = mid
		} else {
			hi = mid
		}
	}
	return (lo + hi) / 2
}

// studentTCDF is P(T ≤ t) for t ≥ 0.
func studentTCDF(t, df float64) float64 {
	return 1 - 0.5*betaInc(df/2, 0.5, df/(df+t*t))
}

// binomialTail is P(X ≥ k) for X binomial with n trials of probability p.
func binomialTail(k, n uint64, p float64) float64 {
	switch {
	case k == 0:
		return 1
	case k > n:
		return 0
	case p <= 0:
		return 0
	case p >= 1:
		return 1
	}
	return betaInc(float64(k), float64(n-k+1), p)
}

// betaInc is the regularized incomplete beta function I_x(a, b), by its continued
// fraction (Lentz's method), as Numerical Recipes gives it.
func betaInc(a, b, x float64) float64 {
	switch {
	case x <= 0:
		return 0
	case x >= 1:
		return 1
	}
	la, _ := math.Lgamma(a)
	lb, _ := math.Lgamma(b)
	lab, _ := math.Lgamma(a + b)
	front := math.Exp(lab - la - lb + a*math.Log(x) + b*math.Log1p(-x))
	if x > (a+1)/(a+b+2) {
		return 1 - front*betaCF(b, a, 1-x)/b
	}
	return front * betaCF(a, b, x) / a
}

func betaCF(a, b, x float64) float64 {
	const tiny = 1e-300
	c, d := 1.0, 1-(a+b)*x/(a+1)
	if math.Abs(d) < tiny {
		d = tiny
	}
	d = 1 / d
	h := d
	for m := 1.0; m <= 500; m++ {
		m2 := 2 * m
		aa := m * (b - m) * x / ((a + m2 - 1) * (a + m2))
		d = 1 + aa*d
		if math.Abs(d) < tiny {
			d = tiny
		}
		c = 1 + aa/c
		if math.Abs(c) < tiny {
			c = tiny
		}
		d = 1 / d
		h *= d * c
		aa = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))
		d = 1 + aa*d
		if math.Abs(d) < tiny {
			d = tiny
		}
		c = 1 + aa/c
		if math.Abs(c) < tiny {
			c = tiny
		}
		d = 1 / d
		del := d * c
		h *= del
		if math.Abs(del-1) < 1e-12 {
			break
		}
	}
	return h
}
