package server

import (
	"cmp"
	"math"
	"math/bits"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// Bounds on a report's latency fits: models and roles a proxy routes to, the coefficients
// and decode table entries of one, and the workers of one.
const (
	maxReportFits = 64
	maxFitValues  = 64
)

// fitsOf returns the latency fits of a report that are whole: at most maxReportFits, each
// with a model name no longer than 256 bytes, finite non-negative figures, at most
// maxFitValues of each table and MaxReportWorkers workers (workers without an id or with
// figures out of bounds dropped). nil when the report carries none.
func fitsOf(r *xdsv1.LoadReport) []*xdsv1.LatencyFit {
	var out []*xdsv1.LatencyFit
	for _, f := range r.GetFits() {
		if len(out) == maxReportFits {
			break
		}
		if len(f.GetModel()) > maxSampleString || len(f.GetTheta()) > maxFitValues || len(f.GetDecodeStep()) > maxFitValues ||
			len(f.GetDecodeKv()) > maxFitValues || len(f.GetWorkers()) > MaxReportWorkers ||
			!finite(f.GetTheta()...) || !finite(f.GetDecodeStep()...) || !finite(f.GetDecodeKv()...) {
			continue
		}
		f = proto.CloneOf(f)
		f.Workers = slices.DeleteFunc(f.Workers, func(w *xdsv1.WorkerFit) bool {
			return w.GetWorkerId() == "" || len(w.GetWorkerId()) > maxSampleString ||
				!finite(w.GetSpeed(), w.GetOccupancy(), w.GetSigmaQueued(), w.GetSigmaFresh(), w.GetDecodeSpeed())
		})
		out = append(out, f)
	}
	return out
}

// FitKey names the workers one latency fit is of: a model in a role.
type FitKey struct {
	Model string
	Role  xdsv1.Role
}

// PooledFits pools the live proxies' latest latency fits per model and role: the
// coefficients and decode tables averaged over the proxies, each weighed by the
// observations that taught it (fits whose tables differ in length from the first one's
// left out), and per worker its figures averaged by the first tokens each proxy saw of it,
// with the largest concurrency limit any proxy learned. The result is recomputed at most
// every minInterval (the proxies send fits every few seconds); the map and its fits are
// shared, for reading only.
func (s *Server) PooledFits(minInterval time.Duration) map[FitKey]*xdsv1.LatencyFit {
	l := s.load
	l.fitMu.Lock()
	defer l.fitMu.Unlock()
	now := l.now()
	if l.pooled != nil && now.Sub(l.pooledAt) < minInterval {
		return l.pooled
	}
	byKey := map[FitKey][]*xdsv1.LatencyFit{}
	l.mu.Lock()
	for _, r := range l.nodes {
		for _, f := range r.fits {
			k := FitKey{f.GetModel(), f.GetRole()}
			byKey[k] = append(byKey[k], f)
		}
	}
	l.mu.Unlock()
	pooled := make(map[FitKey]*xdsv1.LatencyFit, len(byKey))
	for k, fs := range byKey {
		if p := poolFits(k, fs); p != nil {
			pooled[k] = p
		}
	}
	l.pooled, l.pooledAt = pooled, now
	return pooled
}

// poolFits pools the fits of one model and role (see PooledFits); nil when none taught
// anything.
func poolFits(k FitKey, fs []*xdsv1.LatencyFit) *xdsv1.LatencyFit {
	// Every proxy's fit is used in the same order, whatever the nodes map gave.
	slices.SortFunc(fs, func(a, b *xdsv1.LatencyFit) int {
		return cmp.Or(cmp.Compare(b.GetTtftObservations(), a.GetTtftObservations()), cmp.Compare(b.GetDecodeObservations(), a.GetDecodeObservations()))
	})
	first := fs[0]
	out := &xdsv1.LatencyFit{Model: k.Model, Role: k.Role,
		Theta: make([]float64, len(first.GetTheta())), DecodeStep: make([]float64, len(first.GetDecodeStep())), DecodeKv: make([]float64, len(first.GetDecodeKv()))}
	var tw, dw float64
	type acc struct {
		speed, occ, sq, sf, w float64
		ds, dw                float64 // decode speed, over the reports that carry one
		obs                   uint64
		seqs                  uint32
	}
	workers := map[string]*acc{}
	for _, f := range fs {
		if len(f.GetTheta()) != len(out.Theta) || len(f.GetDecodeStep()) != len(out.DecodeStep) || len(f.GetDecodeKv()) != len(out.DecodeKv) {
			continue
		}
		if n := float64(f.GetTtftObservations()); n > 0 {
			for i, v := range f.GetTheta() {
				out.Theta[i] += n * v
			}
			tw += n
			out.TtftObservations += f.GetTtftObservations()
		}
		if n := float64(f.GetDecodeObservations()); n > 0 {
			for i, v := range f.GetDecodeStep() {
				out.DecodeStep[i] += n * v
			}
			for i, v := range f.GetDecodeKv() {
				out.DecodeKv[i] += n * v
			}
			dw += n
			out.DecodeObservations += f.GetDecodeObservations()
		}
		for _, w := range f.GetWorkers() {
			a := workers[w.GetWorkerId()]
			if a == nil {
				a = &acc{}
				workers[w.GetWorkerId()] = a
			}
			a.seqs = max(a.seqs, w.GetMaxNumSeqs())
			if n := float64(w.GetObservations()); n > 0 {
				a.speed += n * w.GetSpeed()
				a.occ += n * w.GetOccupancy()
				a.sq += n * w.GetSigmaQueued()
				a.sf += n * w.GetSigmaFresh()
				a.w += n
				a.obs += w.GetObservations()
				if ds := w.GetDecodeSpeed(); ds > 0 { // 0: a proxy that does not report it
					a.ds += n * ds
					a.dw += n
				}
			}
		}
	}
	if tw == 0 && dw == 0 && len(workers) == 0 {
		return nil
	}
	for i := range out.Theta {
		out.Theta[i] = safeDiv(out.Theta[i], tw)
	}
	for i := range out.DecodeStep {
		out.DecodeStep[i] = safeDiv(out.DecodeStep[i], dw)
	}
	for i := range out.DecodeKv {
		out.DecodeKv[i] = safeDiv(out.DecodeKv[i], dw)
	}
	ids := make([]string, 0, len(workers))
	for id := range workers {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		a := workers[id]
		out.Workers = append(out.Workers, &xdsv1.WorkerFit{WorkerId: id, MaxNumSeqs: a.seqs, Observations: a.obs,
			Speed: safeDiv(a.speed, a.w), Occupancy: safeDiv(a.occ, a.w), SigmaQueued: safeDiv(a.sq, a.w), SigmaFresh: safeDiv(a.sf, a.w),
			DecodeSpeed: safeDiv(a.ds, a.dw)})
	}
	return out
}

func safeDiv(a, b float64) float64 {
	if b == 0 || math.IsNaN(a) || math.IsInf(a, 0) {
		return 0
	}
	return a / b
}

// FitFor is pooled's fit of a worker's model and role, carrying only that worker's own
// figures (nil: nothing pooled for them): what the worker's resource takes (Worker.fit).
// Its figures are rounded to two significant digits and its counts down to a power of two,
// so that a fit that moves by little leaves the resource as it was and is not pushed to
// every proxy again.
func FitFor(pooled map[FitKey]*xdsv1.LatencyFit, model string, role xdsv1.Role, workerID string) *xdsv1.LatencyFit {
	p := pooled[FitKey{model, role}]
	if p == nil {
		return nil
	}
	out := &xdsv1.LatencyFit{Model: p.Model, Role: p.Role, Theta: rounded(p.Theta), DecodeStep: rounded(p.DecodeStep), DecodeKv: rounded(p.DecodeKv),
		TtftObservations: pow2Floor(p.TtftObservations), DecodeObservations: pow2Floor(p.DecodeObservations)}
	if i, ok := slices.BinarySearchFunc(p.Workers, workerID, func(w *xdsv1.WorkerFit, id string) int { return cmp.Compare(w.GetWorkerId(), id) }); ok {
		w := p.Workers[i]
		out.Workers = []*xdsv1.WorkerFit{{WorkerId: w.WorkerId, Speed: round2(w.Speed), Occupancy: round2(w.Occupancy), MaxNumSeqs: w.MaxNumSeqs,
			SigmaQueued: round2(w.SigmaQueued), SigmaFresh: round2(w.SigmaFresh), Observations: pow2Floor(w.Observations), DecodeSpeed: round2(w.DecodeSpeed)}}
	}
	return out
}

// round2 rounds v to two significant digits.
func round2(v float64) float64 {
	if v == 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return v
	}
	p := math.Pow(10, math.Floor(math.Log10(math.Abs(v)))-1)
	return math.Round(v/p) * p
}

func rounded(vs []float64) []float64 {
	out := make([]float64, len(vs))
	for i, v := range vs {
		out[i] = round2(v)
	}
	return out
}

// pow2Floor is the largest power of two not above n (0 for 0).
func pow2Floor(n uint64) uint64 {
	if n == 0 {
		return 0
	}
	return 1 << (63 - bits.LeadingZeros64(n))
}
