package latency

import "math"

// MaxDim is the most features an RLS fits.
const MaxDim = 8

// Vec is a feature or coefficient vector; an RLS of dimension n uses its first n entries.
type Vec [MaxDim]float64

// RLS is recursive least squares with exponential forgetting: it fits y ≈ θ·x to a stream of
// observations, weighing each older one by Lambda more, in O(n³) per observation (n ≤
// MaxDim) and no allocation. It keeps the fit's information matrix and vector, not a
// covariance, and solves for θ afresh after each observation, within bounds. Three guards
// make it safe to run unattended on what engines do:
//
//   - Outliers: a residual beyond OutlierK times the running robust scale of residuals (the
//     decayed mean absolute residual) is clipped to that bound before the update (a Huber
//     step), so one request stuck behind a preempted batch cannot drag the fit.
//   - Windup: the prior counts as observations that are never forgotten (its information
//     is added back at the rate forgetting removes it), so a feature that stays at zero (a
//     queue term on an idle worker), or features that move together (the first step's
//     constant beside the decode step), keep the prior's weight along what the data do not
//     tell apart instead of none: a disturbance cannot swing θ along them, and θ drifts back
//     to the prior there rather than staying wherever the last disturbance left it.
//   - Physics: each coefficient stays within [Lo[i], Hi[i]], as the least-squares solution
//     under those bounds (an active-set solve), not as the free solution clamped: clamping
//     one coefficient of features that move together while the others keep the share they
//     took for it sends the fit away from the data, observation after observation.
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
	Lo, Hi   Vec     // bounds on each coefficient

	info   [MaxDim][MaxDim]float64 // Σ λᵏ x xᵀ plus the prior's information
	vec    Vec                     // Σ λᵏ x y plus the prior's
	prior  Vec                     // the prior's information, diagonal: 1 / its variances
	prior0 Vec                     // the prior's information times its coefficients

	scale    float64 // decayed mean absolute residual
	count    int     // observations taken
	outliers int     // observations clipped
}

// Init sets the prior: coefficients theta0, each with its own variance p0[i] (relative to
// the observations' noise variance; a variance of 0 or less counts as 1).
func (r *RLS) Init(n int, theta0, p0 Vec) {
	r.N = min(max(n, 1), MaxDim)
	r.info = [MaxDim][MaxDim]float64{}
	r.vec, r.prior, r.prior0 = Vec{}, Vec{}, Vec{}
	r.scale, r.count, r.outliers = 0, 0, 0
	if r.Lambda <= 0 || r.Lambda > 1 {
		r.Lambda = 0.98
	}
	if r.OutlierK <= 0 {
		r.OutlierK = 4
	}
	for i := range r.N {
		if r.Lo[i] == 0 && r.Hi[i] == 0 {
			r.Lo[i], r.Hi[i] = math.Inf(-1), math.Inf(1)
		}
		v := p0[i]
		if v <= 0 {
			v = 1
		}
		r.prior[i] = 1 / v
		r.prior0[i] = theta0[i] / v
		r.info[i][i] = r.prior[i]
		r.vec[i] = r.prior0[i]
	}
	r.Theta = theta0
	r.solve()
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
	pred := r.Predict(x)
	e := y - pred
	ae := math.Abs(e)
	if r.count >= minScaleObs && r.scale > 0 && ae > r.OutlierK*r.scale {
		clipped = true
		r.outliers++
		e = math.Copysign(r.OutlierK*r.scale, e)
		ae = r.OutlierK * r.scale
		y = pred + e
	}
	// The scale follows residuals after clipping, so a burst of outliers widens it only
	// slowly; early on it is the plain mean.
	if r.count < minScaleObs {
		r.scale = (r.scale*float64(r.count) + ae) / float64(r.count+1)
	} else {
		r.scale = 0.95*r.scale + 0.05*ae
	}
	r.count++

	// Forget, take the observation, and give the prior back what forgetting took of it.
	l, back := r.Lambda, 1-r.Lambda
	for i := range r.N {
		for j := range r.N {
			r.info[i][j] = l*r.info[i][j] + x[i]*x[j]
		}
		r.info[i][i] += back * r.prior[i]
		r.vec[i] = l*r.vec[i] + x[i]*y + back*r.prior0[i]
	}
	r.solve()
	return clipped
}

// solve sets θ to the minimum of θᵀ·info·θ − 2·vec·θ within the bounds, by active sets: solve
// for the free coefficients with the others at their bounds, hold at its bound each one the
// solution leaves them by, free each held one whose gradient points inside, until neither
// happens. It starts from the bounds the current θ sits at, so a fit that stays where it was
// solves once. info is positive definite (the prior's diagonal is in it), so every solve has
// a solution.
func (r *RLS) solve() {
	n := r.N
	var held [MaxDim]bool
	for i := range n {
		held[i] = r.Theta[i] <= r.Lo[i] || r.Theta[i] >= r.Hi[i]
	}
	theta := r.Theta
	for range 4 * MaxDim {
		if !r.solveFree(&theta, &held) {
			break // numerically singular: keep the last θ
		}
		// Hold the free coefficient furthest past its bound, as a fraction of the way there.
		worst, frac := -1, 1.0
		for i := range n {
			if held[i] {
				continue
			}
			var f float64
			switch {
			case theta[i] < r.Lo[i]:
				f = (r.Theta[i] - r.Lo[i]) / (r.Theta[i] - theta[i])
			case theta[i] > r.Hi[i]:
				f = (r.Hi[i] - r.Theta[i]) / (theta[i] - r.Theta[i])
			default:
				continue
			}
			if f = min(max(f, 0), 1); worst < 0 || f < frac {
				worst, frac = i, f
			}
		}
		if worst >= 0 {
			// Step from the current feasible θ toward the free solution as far as the first
			// bound it meets, and hold that coefficient there.
			for i := range n {
				if !held[i] {
					r.Theta[i] += frac * (theta[i] - r.Theta[i])
				}
			}
			if theta[worst] < r.Lo[worst] {
				r.Theta[worst] = r.Lo[worst]
			} else {
				r.Theta[worst] = r.Hi[worst]
			}
			held[worst] = true
			theta = r.Theta
			continue
		}
		r.Theta = theta
		// Free the held coefficient whose gradient most wants it inside.
		release, best := -1, 0.0
		for i := range n {
			if !held[i] {
				continue
			}
			g := -r.vec[i] // ∂/∂θᵢ of ½θᵀ·info·θ − vec·θ
			for j := range n {
				g += r.info[i][j] * r.Theta[j]
			}
			if (r.Theta[i] <= r.Lo[i] && g < -best) || (r.Theta[i] >= r.Hi[i] && g > best) {
				release, best = i, math.Abs(g)
			}
		}
		if release < 0 {
			break
		}
		held[release] = false
	}
	for i := range n {
		r.Theta[i] = min(max(r.Theta[i], r.Lo[i]), r.Hi[i])
	}
}

// solveFree sets the free coefficients of theta to the least-squares solution with the held
// ones where theta has them (Cholesky on the free block). It reports false when that block
// is not positive definite.
func (r *RLS) solveFree(theta *Vec, held *[MaxDim]bool) bool {
	var idx [MaxDim]int
	m := 0
	for i := range r.N {
		if !held[i] {
			idx[m] = i
			m++
		}
	}
	if m == 0 {
		return true
	}
	var a [MaxDim][MaxDim]float64
	var b Vec
	for p := range m {
		i := idx[p]
		b[p] = r.vec[i]
		for j := range r.N {
			if held[j] {
				b[p] -= r.info[i][j] * theta[j]
			}
		}
		for q := range m {
			a[p][q] = r.info[i][idx[q]]
		}
	}
	// a = L Lᵀ in place (lower triangle).
	for p := range m {
		for q := 0; q <= p; q++ {
			s := a[p][q]
			for k := range q {
				s -= a[p][k] * a[q][k]
			}
			if p == q {
				if s <= 0 || math.IsNaN(s) {
					return false
				}
				a[p][p] = math.Sqrt(s)
			} else {
				a[p][q] = s / a[q][q]
			}
		}
	}
	for p := range m { // L z = b
		s := b[p]
		for k := range p {
			s -= a[p][k] * b[k]
		}
		b[p] = s / a[p][p]
	}
	for p := m - 1; p >= 0; p-- { // Lᵀ θ = z
		s := b[p]
		for k := p + 1; k < m; k++ {
			s -= a[k][p] * b[k]
		}
		b[p] = s / a[p][p]
	}
	for p := range m {
		theta[idx[p]] = b[p]
	}
	return true
}

// Count is the number of observations taken, Outliers how many of them were clipped.
func (r *RLS) Count() int    { return r.count }
func (r *RLS) Outliers() int { return r.outliers }

// Scale is the running mean absolute residual.
func (r *RLS) Scale() float64 { return r.scale }

// priorOK reports whether theta is a possible centre of the prior: finite and within the
// bounds.
func (r *RLS) priorOK(theta *Vec) bool {
	for i := range r.N {
		v := theta[i]
		if math.IsNaN(v) || math.IsInf(v, 0) || v < r.Lo[i] || v > r.Hi[i] {
			return false
		}
	}
	return true
}

// SetPriorMean moves the prior's centre to theta, keeping its variances: the information
// the prior lends the fit now pulls toward theta, and the fit is solved again. What the
// observations taught stays.
func (r *RLS) SetPriorMean(theta *Vec) {
	for i := range r.N {
		next := r.prior[i] * theta[i]
		r.vec[i] += next - r.prior0[i]
		r.prior0[i] = next
	}
	r.solve()
}
