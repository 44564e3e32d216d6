package latency

import "math"

// MaxDim is the most features an RLS fits.
const MaxDim = 7

// Vec is a feature or coefficient vector; an RLS of dimension n uses its first n entries.
type Vec [MaxDim]float64

// RLS is recursive least squares with exponential forgetting: it fits y ≈ θ·x to a stream of
// observations, weighing each older one by Lambda more, in O(n²) per observation and no
// allocation. Three guards make it safe to run unattended on what engines do:
//
//   - Outliers: a residual beyond OutlierK times the running robust scale of residuals (the
//     decayed mean absolute residual) is clipped to that bound before the update (a Huber
//     step), so one request stuck behind a preempted batch cannot drag the fit.
//   - Windup: forgetting inflates the covariance along features that stay at zero (a queue
//     term on an idle worker); the covariance's trace is held under MaxTrace, so the first
//     observation that excites such a feature cannot swing θ arbitrarily.
//   - Physics: each coefficient stays within [Lo[i], Hi[i]].
//
// Observations whose scale varies by orders of magnitude (a TTFT of 5 ms beside one of 5 s)
// should be divided, x and y alike, by a scale known before the outcome (the prediction):
// the fit then minimises relative error, and the prior variances are in relative units.
//
// An RLS is not safe for concurrent use; Model serialises it.
type RLS struct {
	N        int     // dimension, 1..MaxDim
	Theta    Vec     // current coefficients
	Lambda   float64 // forgetting factor in (0, 1]
	OutlierK float64 // residuals beyond OutlierK × Scale are clipped
	MaxTrace float64 // bound on the covariance's trace
	Lo, Hi   Vec     // bounds on each coefficient

	p        [MaxDim][MaxDim]float64
	scale    float64 // decayed mean absolute residual
	count    int     // observations taken
	outliers int     // observations clipped
}

// Init sets the prior: coefficients theta0, each with its own variance p0[i] (relative to
// the observations' noise variance).
func (r *RLS) Init(n int, theta0, p0 Vec) {
	r.N = min(max(n, 1), MaxDim)
	r.Theta = theta0
	r.p = [MaxDim][MaxDim]float64{}
	var trace float64
	for i := range r.N {
		r.p[i][i] = p0[i]
		trace += p0[i]
	}
	r.scale, r.count, r.outliers = 0, 0, 0
	if r.Lambda <= 0 || r.Lambda > 1 {
		r.Lambda = 0.98
	}
	if r.OutlierK <= 0 {
		r.OutlierK = 4
	}
	if r.MaxTrace <= 0 {
		r.MaxTrace = trace
	}
	for i := range r.N {
		if r.Lo[i] == 0 && r.Hi[i] == 0 {
			r.Lo[i], r.Hi[i] = math.Inf(-1), math.Inf(1)
		}
	}
}

// Predict returns θ·x.
func (r *RLS) Predict(x *Vec) float64 {
	var y float64
	for i := range r.N {
		y += r.Theta[i] * x[i]
	}
	return y
}

// minScaleObs is how many observations set the residual scale before outliers are clipped.
const minScaleObs = 8

// Update takes one observation and reports whether it was clipped as an outlier. A
// non-finite x or y is ignored.
func (r *RLS) Update(x *Vec, y float64) (clipped bool) {
	if math.IsNaN(y) || math.IsInf(y, 0) {
		return false
	}
	for i := range r.N {
		if math.IsNaN(x[i]) || math.IsInf(x[i], 0) {
			return false
		}
	}
	e := y - r.Predict(x)
	ae := math.Abs(e)
	if r.count >= minScaleObs && r.scale > 0 && ae > r.OutlierK*r.scale {
		clipped = true
		r.outliers++
		e = math.Copysign(r.OutlierK*r.scale, e)
		ae = r.OutlierK * r.scale
	}
	// The scale follows residuals after clipping, so a burst of outliers widens it only
	// slowly; early on it is the plain mean.
	if r.count < minScaleObs {
		r.scale = (r.scale*float64(r.count) + ae) / float64(r.count+1)
	} else {
		r.scale = 0.95*r.scale + 0.05*ae
	}
	r.count++

	// k = P x / (λ + xᵀ P x); θ += k e; P = (P − k xᵀ P) / λ.
	var px Vec
	for i := range r.N {
		for j := range r.N {
			px[i] += r.p[i][j] * x[j]
		}
	}
	den := r.Lambda
	for i := range r.N {
		den += x[i] * px[i]
	}
	if den <= 0 || math.IsNaN(den) {
		return clipped
	}
	var k Vec
	for i := range r.N {
		k[i] = px[i] / den
		r.Theta[i] += k[i] * e
		r.Theta[i] = min(max(r.Theta[i], r.Lo[i]), r.Hi[i])
	}
	var trace float64
	for i := range r.N {
		for j := range r.N {
			// P is symmetric, so xᵀP is (Px)ᵀ.
			r.p[i][j] = (r.p[i][j] - k[i]*px[j]) / r.Lambda
		}
		trace += r.p[i][i]
	}
	if trace > r.MaxTrace {
		f := r.MaxTrace / trace
		for i := range r.N {
			for j := range r.N {
				r.p[i][j] *= f
			}
		}
	}
	return clipped
}

// Count is the number of observations taken, Outliers how many of them were clipped.
func (r *RLS) Count() int    { return r.count }
func (r *RLS) Outliers() int { return r.outliers }

// Scale is the running mean absolute residual.
func (r *RLS) Scale() float64 { return r.scale }
