package prefix

import (
	"sync"

	"github.com/kvrelay/kvrelay/xds/blockset"
)

// Overlay answers Match with the larger of two indexes' overlaps, worker by worker. A proxy
// fed by a control plane overlays its Replica (what the engines said they stored) with a
// short-lived Approx of its own recent routing decisions: between routing a prompt and the
// engine's BlockStored events (the prefill's duration plus the journal's delay) the replica
// does not yet know where the prompt went, and a burst of requests sharing a new prefix
// would otherwise spread over every worker.
type Overlay struct {
	Primary, Recent Index
	scratch         sync.Pool // *[]float64
}

var (
	_ TimedIndex     = (*Overlay)(nil)
	_ TimedTierIndex = (*Overlay)(nil)
	_ HeldIndex      = (*Overlay)(nil)
)

// GPUBlocks implements HeldIndex: the primary's count, which the engines' own events keep
// (the recent decisions' blocks are on their way into it).
func (o *Overlay) GPUBlocks(w int) (int, bool) {
	if h, ok := o.Primary.(HeldIndex); ok {
		return h.GPUBlocks(w)
	}
	return 0, false
}

// NewOverlay returns primary overlaid with recent.
func NewOverlay(primary, recent Index) *Overlay {
	o := &Overlay{Primary: primary, Recent: recent}
	o.scratch.New = func() any { s := make([]float64, 0, 64); return &s }
	return o
}

// Match implements Index.
func (o *Overlay) Match(hashes []uint64, overlap []float64) float64 {
	return o.MatchAt(hashes, overlap, 0)
}

// MatchAt implements TimedIndex: each index at now.
func (o *Overlay) MatchAt(hashes []uint64, overlap []float64, now int64) float64 {
	return o.MatchTiersAt(hashes, overlap, nil, now)
}

// MatchTiers implements TierIndex: MatchTiersAt now.
func (o *Overlay) MatchTiers(hashes []uint64, overlap []float64, lower []blockset.Lower) float64 {
	return o.MatchTiersAt(hashes, overlap, lower, 0)
}

// MatchTiersAt implements TimedTierIndex: the primary's tiers (when it tells them) where its
// overlap stands. A worker the recent decisions credit with more than the primary's whole
// run (every tier counted) was sent the prompt since the engine last reported: it is
// credited that run in GPU memory, where the prefill it is doing puts it. A worker the
// primary credits a longer run than the recent decisions keeps the primary's answer.
func (o *Overlay) MatchTiersAt(hashes []uint64, overlap []float64, lower []blockset.Lower, now int64) float64 {
	var best float64
	ti, tiers := o.Primary.(TierIndex)
	if lower != nil && tiers {
		best = MatchTiersAt(ti, hashes, overlap, lower, now)
	} else {
		clear(lower)
		best = MatchAt(o.Primary, hashes, overlap, now)
	}
	sp := o.scratch.Get().(*[]float64)
	defer o.scratch.Put(sp)
	if cap(*sp) < len(overlap) {
		*sp = make([]float64, len(overlap))
	}
	recent := (*sp)[:len(overlap)]
	if MatchAt(o.Recent, hashes, recent, now) == 0 {
		return best
	}
	for i, r := range recent {
		run := overlap[i]
		if lower != nil {
			run += lower[i].Deficit
		}
		if r > overlap[i] && r >= run {
			overlap[i] = r
			best = max(best, r)
			if lower != nil {
				lower[i] = blockset.Lower{}
			}
		}
	}
	return best
}
