package fleetsim

import (
	"github.com/kvrelay/kvrelay/dataplane/prefix"
)

// routeIndex is the router's prefix index plus what the proxy tells it as requests go.
type routeIndex interface {
	prefix.Index
	// recordCached is called at a request's first token: its worker now caches its prompt.
	recordCached(f *flight)
	// correct is called at its end with the prompt tokens its engine found cached.
	correct(f *flight, cached int)
}

// exactIndex is the engines' caches themselves, kept from their store and remove events.
type exactIndex struct {
	cached []map[uint64]struct{}
}

func newExactIndex(n int) *exactIndex {
	x := &exactIndex{cached: make([]map[uint64]struct{}, n)}
	for i := range x.cached {
		x.cached[i] = map[uint64]struct{}{}
	}
	return x
}

// store and remove are the engines' cache events.
func (x *exactIndex) store(w int, hashes []uint64) {
	for _, h := range hashes {
		x.cached[w][h] = struct{}{}
	}
}

func (x *exactIndex) remove(w int, hashes []uint64) {
	for _, h := range hashes {
		delete(x.cached[w], h)
	}
}

func (x *exactIndex) clear(w int) { clear(x.cached[w]) }

// Match implements prefix.Index: each worker's leading run of cached blocks.
func (x *exactIndex) Match(hashes []uint64, overlap []float64) float64 {
	best := 0.0
	for w, set := range x.cached {
		if w >= len(overlap) {
			break
		}
		n := 0
		for _, h := range hashes {
			if _, ok := set[h]; !ok {
				break
			}
			n++
		}
		overlap[w] = float64(n)
		best = max(best, float64(n))
	}
	return best
}

func (x *exactIndex) recordCached(*flight) {}
func (x *exactIndex) correct(*flight, int) {}

// approxIndex is the proxy's own approximate index (prefix.Approx): what it routed where,
// recorded at the first token and corrected from the cached tokens engines report, as the
// proxy's tally does.
type approxIndex struct {
	*prefix.Approx
	fl       *fleet
	receipts map[*flight]prefix.Receipt
}

func newApproxIndex(fl *fleet) *approxIndex {
	return &approxIndex{Approx: prefix.NewApprox(prefix.DefaultApproxConfig()), fl: fl, receipts: map[*flight]prefix.Receipt{}}
}

// Match implements prefix.Index at the fleet's virtual time.
func (a *approxIndex) Match(hashes []uint64, overlap []float64) float64 {
	return a.Approx.MatchAt(hashes, overlap, a.fl.tod())
}

func (a *approxIndex) recordCached(f *flight) {
	if len(f.hashes) == 0 {
		return
	}
	overlap := int(f.overlap)
	a.receipts[f] = a.Approx.RecordAt(a.fl.tod(), f.wi, f.hashes, overlap)
	f.worker.SetCachedBlocks(a.Approx.Blocks(f.wi))
}

func (a *approxIndex) correct(f *flight, cached int) {
	r, ok := a.receipts[f]
	if !ok {
		return
	}
	delete(a.receipts, f)
	a.Approx.CorrectAt(a.fl.tod(), f.hashes, r, cached/a.fl.cfg.BlockSize)
}

// GPUBlocks implements prefix.HeldIndex: what worker w's events say it caches, as the
// control plane's replica counts it.
func (x *exactIndex) GPUBlocks(w int) (int, bool) {
	if w < 0 || w >= len(x.cached) {
		return 0, false
	}
	return len(x.cached[w]), true
}
