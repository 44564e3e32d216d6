package planner

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestPredictorsKnownAnswers(t *testing.T) {
	seasonal := []float64{10, 20, 30, 40, 30, 20}
	var pure, trended []float64
	for i := range 60 {
		pure = append(pure, seasonal[i%6])
		trended = append(trended, seasonal[i%6]+0.5*float64(i))
	}
	var ramp []float64
	for i := range 40 {
		ramp = append(ramp, 5+2*float64(i))
	}
	tests := []struct {
		name   string
		p      Predictor
		series []float64
		want   float64 // the next value
		tol    float64
	}{
		{"constant predicts the last value", &Constant{}, []float64{3, 9, 5}, 5, 0},
		{"holt-winters on a pure season is exact", NewHoltWinters(6), pure, seasonal[60%6], 1e-9},
		{"holt-winters follows trend and season", NewHoltWinters(6), trended, seasonal[60%6] + 0.5*60, 0.5},
		{"holt-winters without a season is Holt's linear", NewHoltWinters(0), ramp, 5 + 2*40, 1e-6},
		{"kalman follows a linear ramp", NewKalman(), ramp, 5 + 2*40, 0.05},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for _, v := range tc.series {
				tc.p.Observe(v)
			}
			if got := tc.p.Predict(); math.Abs(got-tc.want) > tc.tol {
				t.Errorf("Predict() = %v, want %v ± %v", got, tc.want, tc.tol)
			}
		})
	}
}

func TestKalmanSmoothsNoise(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	k := NewKalman()
	for range 200 {
		k.Observe(100 + r.NormFloat64())
	}
	if got := k.Predict(); math.Abs(got-100) > 1.5 {
		t.Errorf("Predict() = %v on noisy 100, want within 1.5", got)
	}
}

func TestPredictorsBeforeData(t *testing.T) {
	for _, name := range PredictorNames() {
		p, err := NewPredictor(name, 4)
		if err != nil {
			t.Fatal(err)
		}
		if got := p.Predict(); got != 0 {
			t.Errorf("%s: Predict() = %v before any observation, want 0", name, got)
		}
	}
	if _, err := NewPredictor("arima", 0); err == nil {
		t.Error("NewPredictor(arima): no error")
	}
}

// On held-back history of a daily (seasonal) load, the seasonal forecast wins; on a ramp,
// the Kalman filter's trend beats the last value.
func TestChoosePredictorOnHeldBackHistory(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	var diurnal, ramp []float64
	for i := range 24 * 8 {
		diurnal = append(diurnal, 100+75*math.Sin(2*math.Pi*float64(i)/24)+r.NormFloat64()*3)
		ramp = append(ramp, 10+3*float64(i)+r.NormFloat64())
	}
	scores := ChoosePredictor(diurnal, 48, 24)
	if scores[0].Name != PredictorHoltWinters {
		t.Errorf("diurnal: best %s, want holt-winters (scores %+v)", scores[0].Name, scores)
	}
	if scores[0].N != 48 || scores[0].MAE <= 0 {
		t.Errorf("diurnal: score %+v", scores[0])
	}
	scores = ChoosePredictor(ramp, 48, 24)
	if scores[0].Name != PredictorKalman {
		t.Errorf("ramp: best %s, want kalman (scores %+v)", scores[0].Name, scores)
	}
}

// Auto starts with the last value and, once it has history, forecasts with the predictor
// that did best on the values it held back: the trend on a ramp, the season on a daily load.
func TestAutoChoosesOnHeldBackHistory(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	a, err := NewPredictor(PredictorAuto, 24)
	if err != nil {
		t.Fatal(err)
	}
	auto := a.(*Auto)
	for i := range 20 {
		auto.Observe(10 + 3*float64(i) + r.NormFloat64())
	}
	if auto.Chosen() != PredictorConstant {
		t.Errorf("before MinHistory: chose %s", auto.Chosen())
	}
	for i := 20; i < 60; i++ {
		auto.Observe(10 + 3*float64(i) + r.NormFloat64())
	}
	if auto.Chosen() != PredictorKalman {
		t.Errorf("ramp: chose %s, want kalman", auto.Chosen())
	}
	// It forecasts the ramp's next value, as the chosen predictor trained on the history.
	if got := auto.Predict(); math.Abs(got-(10+3*60)) > 3 {
		t.Errorf("ramp: Predict() = %v, want about %v", got, 10+3*60)
	}
	d := NewAuto(24)
	for i := range 24 * 5 {
		d.Observe(100 + 75*math.Sin(2*math.Pi*float64(i)/24) + r.NormFloat64()*3)
	}
	if d.Chosen() != PredictorHoltWinters {
		t.Errorf("diurnal: chose %s, want holt-winters", d.Chosen())
	}
}
