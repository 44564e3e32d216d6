package planner

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// Predictor forecasts the next value of a series (a request rate, a mean length) from the
// values observed so far, one per planning interval. Implementations are not safe for
// concurrent use; the planner's goroutine owns its predictors.
type Predictor interface {
	// Observe adds the latest value.
	Observe(v float64)
	// Predict returns the forecast of the next value; 0 before any observation.
	Predict() float64
}

// Predictor names for NewPredictor and Config.Predictor.
const (
	PredictorConstant    = "constant"
	PredictorHoltWinters = "holt-winters"
	PredictorKalman      = "kalman"
	// PredictorAuto re-chooses among the others by their error on held-back history (Auto).
	PredictorAuto = "auto"
)

// PredictorNames lists the forecasting predictors NewPredictor knows (ChoosePredictor
// ranks these); NewPredictor also takes PredictorAuto.
func PredictorNames() []string {
	return []string{PredictorConstant, PredictorHoltWinters, PredictorKalman}
}

// NewPredictor returns a predictor by name with its defaults; season is the period, in
// intervals, of the Holt-Winters predictor (a day in planning intervals).
func NewPredictor(name string, season int) (Predictor, error) {
	switch name {
	case PredictorConstant, "":
		return &Constant{}, nil
	case PredictorHoltWinters:
		return NewHoltWinters(season), nil
	case PredictorKalman:
		return NewKalman(), nil
	case PredictorAuto:
		return NewAuto(season), nil
	}
	return nil, fmt.Errorf("unknown predictor %q (one of %s, %s)", name, strings.Join(PredictorNames(), ", "), PredictorAuto)
}

// Constant predicts the last value.
type Constant struct{ last float64 }

func (c *Constant) Observe(v float64) { c.last = v }
func (c *Constant) Predict() float64  { return c.last }

// HoltWinters is additive triple exponential smoothing: level, trend and a season of Season
// values. Until two seasons are seen it smooths level and trend only (Holt's method); then it
// initialises the seasonal terms from the first two seasons.
type HoltWinters struct {
	Alpha, Beta, Gamma float64
	Season             int

	hist         []float64 // values until initialised
	level, trend float64
	seasonal     []float64
	n            int // values observed
	ready        bool
}

// NewHoltWinters returns a Holt-Winters predictor with smoothing 0.5 (level), 0.1 (trend)
// and 0.3 (season); a season under 2 disables the seasonal terms.
func NewHoltWinters(season int) *HoltWinters {
	return &HoltWinters{Alpha: 0.5, Beta: 0.1, Gamma: 0.3, Season: season}
}

func (h *HoltWinters) Observe(v float64) {
	h.n++
	m := h.Season
	if m < 2 {
		h.holt(v)
		return
	}
	if !h.ready {
		h.hist = append(h.hist, v)
		if len(h.hist) < 2*m {
			h.holt(v)
			return
		}
		var s1, s2 float64
		for i := range m {
			s1 += h.hist[i]
			s2 += h.hist[m+i]
		}
		s1, s2 = s1/float64(m), s2/float64(m)
		h.trend = (s2 - s1) / float64(m)
		h.seasonal = make([]float64, m)
		for i := range m {
			// The average of the value's deviation from its season's mean over both seasons.
			h.seasonal[i] = (h.hist[i] - s1 + h.hist[m+i] - s2) / 2
		}
		// The level at the last observation: the second season's mean moved to its end.
		h.level = s2 + h.trend*float64(m-1)/2
		h.hist = nil
		h.ready = true
		return
	}
	i := (h.n - 1) % m
	prev := h.level
	h.level = h.Alpha*(v-h.seasonal[i]) + (1-h.Alpha)*(h.level+h.trend)
	h.trend = h.Beta*(h.level-prev) + (1-h.Beta)*h.trend
	h.seasonal[i] = h.Gamma*(v-h.level) + (1-h.Gamma)*h.seasonal[i]
}

// holt smooths level and trend without seasons.
func (h *HoltWinters) holt(v float64) {
	switch h.n {
	case 1:
		h.level = v
	case 2:
		h.trend = v - h.level
		h.level = v
	default:
		prev := h.level
		h.level = h.Alpha*v + (1-h.Alpha)*(h.level+h.trend)
		h.trend = h.Beta*(h.level-prev) + (1-h.Beta)*h.trend
	}
}

func (h *HoltWinters) Predict() float64 {
	if h.n == 0 {
		return 0
	}
	if !h.ready {
		return h.level + h.trend
	}
	return h.level + h.trend + h.seasonal[h.n%h.Season]
}

// Kalman is a Kalman filter over a local linear trend model: the level moves by the slope
// each interval, both with process noise; observations add measurement noise. Q and R are
// relative (their ratio sets the gain), so the defaults suit any scale.
type Kalman struct {
	// QLevel and QSlope are the process noise variances relative to the measurement
	// noise R.
	QLevel, QSlope, R float64

	x [2]float64    // level, slope
	p [2][2]float64 // covariance
	n int
}

// NewKalman returns a filter with QLevel 0.1, QSlope 0.01 and R 1.
func NewKalman() *Kalman { return &Kalman{QLevel: 0.1, QSlope: 0.01, R: 1} }

func (k *Kalman) Observe(v float64) {
	k.n++
	if k.n == 1 {
		// A diffuse start: the first observation fixes the level, the slope is unknown.
		k.x = [2]float64{v, 0}
		big := 1e6 * math.Max(1, v*v)
		k.p = [2][2]float64{{k.R, 0}, {0, big}}
		return
	}
	// Predict: x = F x, P = F P Fᵀ + Q with F = [[1 1] [0 1]].
	x0 := k.x[0] + k.x[1]
	x1 := k.x[1]
	p := k.p
	p00 := p[0][0] + p[0][1] + p[1][0] + p[1][1] + k.QLevel
	p01 := p[0][1] + p[1][1]
	p10 := p[1][0] + p[1][1]
	p11 := p[1][1] + k.QSlope
	// Update with H = [1 0].
	s := p00 + k.R
	k0, k1 := p00/s, p10/s
	y := v - x0
	k.x = [2]float64{x0 + k0*y, x1 + k1*y}
	k.p = [2][2]float64{
		{(1 - k0) * p00, (1 - k0) * p01},
		{p10 - k1*p00, p11 - k1*p01},
	}
}

func (k *Kalman) Predict() float64 {
	if k.n == 0 {
		return 0
	}
	return k.x[0] + k.x[1]
}

// Score is a predictor's one-step-ahead error on held-back history.
type Score struct {
	Name string  `json:"name"`
	MAE  float64 `json:"mae"`
	RMSE float64 `json:"rmse"`
	// MAPE is the mean absolute error relative to the actual values (those not zero).
	MAPE float64 `json:"mape"`
	N    int     `json:"n"`
}

// Evaluate trains a fresh predictor on series[:len-holdout] and scores its one-step-ahead
// forecasts of the last holdout values, observing each after forecasting it.
func Evaluate(name string, p Predictor, series []float64, holdout int) Score {
	holdout = min(max(holdout, 0), len(series))
	train := len(series) - holdout
	for _, v := range series[:train] {
		p.Observe(v)
	}
	s := Score{Name: name, N: holdout}
	var se, ape float64
	nape := 0
	for _, v := range series[train:] {
		e := p.Predict() - v
		s.MAE += math.Abs(e)
		se += e * e
		if v != 0 {
			ape += math.Abs(e / v)
			nape++
		}
		p.Observe(v)
	}
	if holdout > 0 {
		s.MAE /= float64(holdout)
		s.RMSE = math.Sqrt(se / float64(holdout))
	}
	if nape > 0 {
		s.MAPE = ape / float64(nape)
	}
	return s
}

// ChoosePredictor evaluates every known predictor on series (holding back holdout values)
// and returns the scores, best (lowest MAE) first.
func ChoosePredictor(series []float64, holdout, season int) []Score {
	var out []Score
	for _, name := range PredictorNames() {
		p, _ := NewPredictor(name, season)
		out = append(out, Evaluate(name, p, series, holdout))
	}
	slices.SortStableFunc(out, func(a, b Score) int { return cmpf(a.MAE, b.MAE) })
	return out
}

// Auto forecasts with whichever of the other predictors did best (lowest mean absolute
// one-step error, ChoosePredictor) on the latest Holdout values of its own history, held back
// from that predictor's training: the choice per deployment the planner would otherwise ask
// an operator to make, re-made as the traffic changes. Until MinHistory values are seen it
// uses the constant predictor; it re-evaluates every Every observations over the last Keep
// values, and a newly chosen predictor is trained on that history before it forecasts.
type Auto struct {
	Season                           int
	Holdout, MinHistory, Every, Keep int

	hist   []float64
	cur    Predictor
	chosen string
	n      int
}

// NewAuto returns an Auto predictor holding back 12 values, choosing first after 24, then
// every 6, over the last 4 seasons (at least 96 values).
func NewAuto(season int) *Auto {
	return &Auto{Season: season, Holdout: 12, MinHistory: 24, Every: 6, Keep: max(96, 4*season),
		cur: &Constant{}, chosen: PredictorConstant}
}

func (a *Auto) Observe(v float64) {
	a.n++
	a.hist = append(a.hist, v)
	if len(a.hist) > a.Keep {
		a.hist = a.hist[len(a.hist)-a.Keep:]
	}
	a.cur.Observe(v)
	if len(a.hist) < a.MinHistory || a.n%max(a.Every, 1) != 0 {
		return
	}
	best := ChoosePredictor(a.hist, a.Holdout, a.Season)[0].Name
	if best == a.chosen {
		return
	}
	p, _ := NewPredictor(best, a.Season)
	for _, x := range a.hist {
		p.Observe(x)
	}
	a.cur, a.chosen = p, best
}

func (a *Auto) Predict() float64 { return a.cur.Predict() }

// Chosen names the predictor Auto forecasts with now.
func (a *Auto) Chosen() string { return a.chosen }
