package route

import "slices"

// ModelFilter keeps workers that serve the requested model (or any model).
type ModelFilter struct{}

func (ModelFilter) Name() string { return "model" }

func (ModelFilter) Filter(req *Request, in, out []*Worker) []*Worker {
	for _, w := range in {
		if w.Model == "" || req.Model == "" || w.Model == req.Model || slices.Contains(w.LoRAs, req.Model) {
			out = append(out, w)
		}
	}
	return out
}

// HealthFilter drops draining workers, ejected workers and workers req.Exclude names. The
// router applies the same rule to every request before any policy's filters (Router.Route),
// so in a profile it changes nothing; it stays registered so that profiles naming it keep
// building.
type HealthFilter struct{}

func (HealthFilter) Name() string { return "health" }

func (HealthFilter) Filter(req *Request, in, out []*Worker) []*Worker {
	now := req.Now
	if now == 0 {
		now = Now()
	}
next:
	for _, w := range in {
		if !w.Healthy(now) {
			continue
		}
		for _, x := range req.Exclude {
			if x == w.Index {
				continue next
			}
		}
		out = append(out, w)
	}
	return out
}

// RoleFilter keeps the workers of the request's pool (Request.Role): workers that serve
// whole requests (role both) unless the request is one leg of a disaggregated request.
type RoleFilter struct{}

func (RoleFilter) Name() string { return "role" }

func (RoleFilter) Filter(req *Request, in, out []*Worker) []*Worker {
	for _, w := range in {
		if w.Role == req.Role {
			out = append(out, w)
		}
	}
	return out
}

// BusyFilter drops workers past their busy thresholds: more uncached prompt tokens still
// prefilling than MaxPrefillTokens, or more KV blocks held than MaxDecodeBlocks (or, when the
// worker's capacity is known, than MaxKVFraction of it). Zero thresholds are off. When every
// worker is busy the request waits in the admission queue.
type BusyFilter struct {
	MaxPrefillTokens int64
	MaxDecodeBlocks  int64
	MaxKVFraction    float64
	// MaxRequests is the requests a worker takes at once (its slots, or fewer); a request
	// with Headroom sees it full that many requests sooner, and sees busy a worker still
	// prefilling another request, and every worker while half of them or more are: a tenant
	// that floods starts its prefills on fewer than half the workers at once, so that
	// another tenant's request finds a worker whose next step is not the flood's prefill.
	MaxRequests int64
}

func (BusyFilter) Name() string { return "busy" }

func (f BusyFilter) Filter(req *Request, in, out []*Worker) []*Worker {
	staggered := req.Headroom > 0 && f.MaxRequests > 0
	start, prefilling := len(out), 0
	for _, w := range in {
		busy := f.busy(w, req.Headroom)
		if staggered && w.PrefillTokens() > 0 {
			prefilling++
			busy = true
		}
		if !busy {
			out = append(out, w)
		}
	}
	if staggered && 2*prefilling >= len(in) {
		return out[:start]
	}
	return out
}

// Busy reports whether w is past a threshold.
func (f BusyFilter) Busy(w *Worker) bool { return f.busy(w, 0) }

// busy is Busy for a request that may not take a worker's last headroom slots.
func (f BusyFilter) busy(w *Worker, headroom int64) bool {
	if f.MaxRequests > 0 && w.Load() >= f.MaxRequests-max(headroom, 0) {
		return true
	}
	if f.MaxPrefillTokens > 0 && w.PrefillTokens() > f.MaxPrefillTokens {
		return true
	}
	if f.MaxDecodeBlocks > 0 && w.DecodeBlocks() > f.MaxDecodeBlocks {
		return true
	}
	if f.MaxKVFraction > 0 && w.Capacity > 0 && float64(w.DecodeBlocks()) > f.MaxKVFraction*float64(w.Capacity) {
		return true
	}
	return false
}

var (
	_ Filter = ModelFilter{}
	_ Filter = HealthFilter{}
	_ Filter = RoleFilter{}
	_ Filter = BusyFilter{}
)
