package latency

import "math"

// Sharing what proxies learn. Every proxy learns its own Models from the requests it routes;
// a control plane pools what they report (their Fits, each weighed by the observations that
// taught it) and pushes the pool back, and each proxy centres its Model's prior on the pool
// (Model.Share) and takes the pool's figures of a worker it has seen little of
// (Worker.Share). A new proxy so starts from what the fleet knows, and every proxy's fit
// leans on the whole fleet's traffic, not only its own.

// Fit is what a Model learned: its TTFT coefficients and decode step table, and how many
// observations taught them.
type Fit struct {
	Theta              Vec
	DecodeStep         [numDecode]float64
	DecodeKV           [numKV]float64
	TTFTObs, DecodeObs int64
}

// NumDecode and NumKV are the lengths of a Fit's decode table and KV multipliers.
const (
	NumDecode = numDecode
	NumKV     = numKV
	NumFeat   = numFeat
)

// Fit returns what the model has learned.
func (m *Model) Fit() Fit {
	m.mu.Lock()
	defer m.mu.Unlock()
	f := Fit{TTFTObs: int64(m.ttft.Count()), DecodeObs: int64(m.dec.count)}
	copy(f.Theta[:numFeat], m.cur.theta[:])
	f.DecodeStep, f.DecodeKV = m.cur.step, m.cur.kv
	return f
}

// Share takes a fit pooled over the fleet's proxies: its coefficients become the centre of
// the model's prior, so that the model's own observations refine the fleet's estimate
// rather than the curve's prior, and, where the pool learned the decode table from more
// observations than the model, the pool's table stands in for the buckets the model has
// not learned itself. A fit with no observations, or with coefficients out of bounds,
// changes nothing; it reports whether the model changed.
func (m *Model) Share(f Fit) bool {
	if f.TTFTObs <= 0 && f.DecodeObs <= 0 {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	changed := false
	if f.TTFTObs > 0 && m.ttft.priorOK(&f.Theta) {
		m.ttft.SetPriorMean(&f.Theta)
		changed = true
	}
	if f.DecodeObs > int64(m.dec.count) && decodeOK(&f) {
		for i := range numDecode {
			if m.dec.n[i] == 0 {
				m.dec.logT[i], m.dec.n[i] = math.Log(f.DecodeStep[i]), 1
			}
		}
		for i := 1; i < numKV; i++ {
			if m.dec.nK[i] == 0 {
				m.dec.logK[i], m.dec.nK[i] = math.Log(f.DecodeKV[i]), 1
			}
		}
		m.dec.publish(&m.cur)
		changed = true
	}
	if changed {
		m.publishLocked()
	}
	return changed
}

// decodeOK reports whether f's decode table is one a model could have learned.
func decodeOK(f *Fit) bool {
	for _, v := range f.DecodeStep {
		if !(v >= minITL && v <= maxITL) {
			return false
		}
	}
	for _, v := range f.DecodeKV {
		if !(v >= 1/maxKVMul && v <= maxKVMul) {
			return false
		}
	}
	return true
}

// WorkerFit is what a Worker learned of its worker: its prefill and decode speeds against
// its model (DecodeSpeed 0: not known), how long a request holds a slot there, its
// concurrency limit (0: unknown), the relative errors of its recent queued and fresh
// predictions, and how many first tokens taught it.
type WorkerFit struct {
	Speed, DecodeSpeed, Occupancy float64
	MaxNumSeqs                    int
	SigmaQueued, SigmaFresh       float64
	Obs                           int64
}

// Fit returns what the worker's model learned of it.
func (w *Worker) Fit() WorkerFit {
	return WorkerFit{Speed: load(&w.speed), DecodeSpeed: load(&w.decodeSpeed), Occupancy: load(&w.occBit), MaxNumSeqs: int(w.seqs.Load()),
		SigmaQueued: load(&w.sigma[resQueued]), SigmaFresh: load(&w.sigma[resFresh]), Obs: w.obs.Load()}
}

// Share takes what the fleet's proxies together learned of the worker: its speeds,
// occupancy and errors when they saw at least twice as many of its first tokens as this
// model did (its decode speed only where they reported one), and its concurrency limit
// while this model has learned none (and saw it run no more). Figures out of bounds are
// ignored. It reports whether the worker changed.
func (w *Worker) Share(f WorkerFit) bool {
	changed := false
	if n := w.seqs.Load(); n <= 0 && f.MaxNumSeqs > 0 && int64(f.MaxNumSeqs) >= w.seqsLow.Load() {
		w.seqs.Store(int64(f.MaxNumSeqs))
		changed = true
	}
	if f.Obs < 2*max(w.obs.Load(), 1) {
		return changed
	}
	if !(f.Speed >= math.Exp(-maxLogSpeed) && f.Speed <= math.Exp(maxLogSpeed)) || !(f.Occupancy > 0 && f.Occupancy < 1e4) ||
		!(f.SigmaQueued > 0 && f.SigmaQueued <= maxSigma) || !(f.SigmaFresh > 0 && f.SigmaFresh <= maxSigma) {
		return changed
	}
	w.mu.Lock()
	w.logSpeed = math.Log(f.Speed)
	w.speed.Store(math.Float64bits(f.Speed))
	w.occ = f.Occupancy
	w.nOcc = max(w.nOcc, 1)
	w.occBit.Store(math.Float64bits(f.Occupancy))
	if f.DecodeSpeed >= math.Exp(-maxLogSpeed) && f.DecodeSpeed <= math.Exp(maxLogSpeed) {
		w.logDecode = math.Log(f.DecodeSpeed)
		w.decodeSpeed.Store(math.Float64bits(f.DecodeSpeed))
	}
	w.mu.Unlock()
	w.sigma[resQueued].Store(math.Float64bits(f.SigmaQueued))
	w.sigma[resFresh].Store(math.Float64bits(f.SigmaFresh))
	return true
}
