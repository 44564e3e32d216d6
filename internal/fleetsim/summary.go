package fleetsim

import (
	"math"
	"slices"
	"time"
)

// Summary condenses a replay's records.
type Summary struct {
	Requests, Errors int
	// TTFT percentiles of the requests that got a first token.
	TTFTP50, TTFTP90, TTFTP99 time.Duration
	E2EP50                    time.Duration
	// HitRate is Σ cached prompt tokens / Σ prompt tokens, as engines report them.
	HitRate float64
	// PredErrP50 and PredErrP90 are the median and 90th percentile of |predicted − actual| /
	// actual TTFT over the requests routed with a prediction (0 without any).
	PredErrP50, PredErrP90 float64
	// AloneErrP50 and AloneErrP90 are those of |Alone − actual| / actual TTFT: the error of
	// a prediction that knows the engine's state exactly and nothing of what arrives later.
	// ModelAloneErrP50 and ModelAloneErrP90 are those of |predicted − Alone| / actual TTFT:
	// the predictor's own error. Both over the requests with a prediction and an Alone.
	AloneErrP50, AloneErrP90           float64
	ModelAloneErrP50, ModelAloneErrP90 float64
	PerWorker                          []int
}

// Summarize summarises res, skipping the first skip records (warm-up) for the prediction
// error only.
func Summarize(res *Result, skip int) Summary {
	var s Summary
	var ttft, e2e []time.Duration
	var errs, alone, modelAlone []float64
	var cached, prompt int
	for i, r := range res.Records {
		s.Requests++
		if r.Err != "" {
			s.Errors++
			continue
		}
		ttft = append(ttft, r.TTFT)
		e2e = append(e2e, r.E2E)
		cached += r.Cached
		prompt += r.Prompt
		if r.Predict > 0 && r.TTFT > 0 && i >= skip {
			errs = append(errs, math.Abs(float64(r.Predict-r.TTFT))/float64(r.TTFT))
			if r.Alone > 0 {
				alone = append(alone, math.Abs(float64(r.Alone-r.TTFT))/float64(r.TTFT))
				modelAlone = append(modelAlone, math.Abs(float64(r.Predict-r.Alone))/float64(r.TTFT))
			}
		}
	}
	s.TTFTP50, s.TTFTP90, s.TTFTP99 = pct(ttft, 0.5), pct(ttft, 0.9), pct(ttft, 0.99)
	s.E2EP50 = pct(e2e, 0.5)
	if prompt > 0 {
		s.HitRate = float64(cached) / float64(prompt)
	}
	s.PredErrP50, s.PredErrP90 = median90(errs)
	s.AloneErrP50, s.AloneErrP90 = median90(alone)
	s.ModelAloneErrP50, s.ModelAloneErrP90 = median90(modelAlone)
	s.PerWorker = res.PerWorker
	return s
}

// median90 is v's median and 90th percentile (zeros when empty); it sorts v.
func median90(v []float64) (float64, float64) {
	if len(v) == 0 {
		return 0, 0
	}
	slices.Sort(v)
	return v[len(v)/2], v[min(len(v)*9/10, len(v)-1)]
}

func pct(v []time.Duration, q float64) time.Duration {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}
