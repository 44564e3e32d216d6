package ebpf

import (
	"math"
	"time"

	"github.com/kvrelay/kvrelay/ebpf/probes"
)

// The first-byte load signal (Collector.FirstByteWaiting).
const (
	// minFirstByteRef is the least reference latency: a peer answering faster (an error
	// page, a cached answer) does not make every other worker look many requests behind.
	minFirstByteRef = time.Millisecond
	// maxFirstByteWaiting bounds the requests one worker's latency may imply.
	maxFirstByteWaiting = 64
)

// fbSnap is the cumulative first-byte histogram of each worker at one sample.
type fbSnap struct {
	at time.Time
	h  map[attribution]probes.Hist
}

// fbWindow turns the cumulative first-byte histograms sampled from the kernel into each
// worker's latency over the last span and the waiting requests it implies. Guarded by the
// Collector's mu.
type fbWindow struct {
	span  time.Duration
	snaps []fbSnap // oldest first; the first one is at least span old once there are enough

	recent  map[attribution]time.Duration // workers that answered in the window
	excess  map[attribution]int
	waiting map[string]int // by worker, for FirstByteWaiting
}

// add records the histograms sampled at now and recomputes the recent latencies.
func (w *fbWindow) add(now time.Time, h map[attribution]probes.Hist) {
	w.snaps = append(w.snaps, fbSnap{at: now, h: h})
	// Keep one snapshot at least span old (the window's base), drop the older ones.
	drop := 0
	for drop+1 < len(w.snaps) && !w.snaps[drop+1].at.After(now.Add(-w.span)) {
		drop++
	}
	w.snaps = append(w.snaps[:0], w.snaps[drop:]...)
	base := w.snaps[0].h
	w.recent = map[attribution]time.Duration{}
	for a, cur := range h {
		d := cur // new since the base: everything it holds is in the window
		old, inBase := base[a]
		switch {
		case inBase && old.Count > cur.Count:
			continue // the histogram restarted (the probe reattached): no window yet
		case inBase:
			d = histSub(cur, old)
		case len(w.snaps) == 1:
			continue // the first sample: nothing to compare with
		}
		if v, ok := windowLatency(&d); ok {
			w.recent[a] = v
		}
	}
	w.excess = firstByteExcess(w.recent)
	w.waiting = map[string]int{}
	for a, n := range w.excess {
		if m, ok := w.waiting[a.worker]; !ok || n > m {
			w.waiting[a.worker] = n
		}
	}
}

func histSub(a, b probes.Hist) probes.Hist {
	a.Count -= b.Count
	a.SumNs -= b.SumNs
	for i := range a.Slots {
		a.Slots[i] -= min(b.Slots[i], a.Slots[i])
	}
	return a
}

// windowLatency estimates the typical latency of the observations in d (the growth of a
// histogram over the window): their mean, clamped into the log2 slot holding their median.
// Where they share a slot (the common case) that is the exact mean; a few outliers in other
// slots pull the mean out of the median's slot and are clamped away. false when d is empty.
func windowLatency(d *probes.Hist) (time.Duration, bool) {
	if d.Count == 0 {
		return 0, false
	}
	mean := float64(d.SumNs) / float64(d.Count)
	half := (d.Count + 1) / 2
	var n uint64
	for i, c := range d.Slots {
		n += c
		if n >= half {
			lo, hi := math.Ldexp(1, i), math.Ldexp(1, i+1)
			if i == 0 {
				lo = 0
			}
			if i == len(d.Slots)-1 {
				hi = math.Inf(1)
			}
			return time.Duration(min(max(mean, lo), hi)), true
		}
	}
	return time.Duration(mean), true // slots and count disagree (a read mid-update): the mean
}

// firstByteExcess is, per worker answering in the window, the waiting requests its latency
// implies next to the fastest worker of its pool: latency / reference - 1, rounded down, in
// [0, maxFirstByteWaiting]. A pool with one worker answering has no reference: its worker
// counts 0.
func firstByteExcess(recent map[attribution]time.Duration) map[attribution]int {
	ref := map[string]time.Duration{}
	peers := map[string]int{}
	for a, d := range recent {
		if r, ok := ref[a.pool]; !ok || d < r {
			ref[a.pool] = d
		}
		peers[a.pool]++
	}
	out := make(map[attribution]int, len(recent))
	for a, d := range recent {
		if peers[a.pool] < 2 {
			out[a] = 0
			continue
		}
		r := max(ref[a.pool], minFirstByteRef)
		n := int(float64(d)/float64(r)) - 1
		out[a] = min(max(n, 0), maxFirstByteWaiting)
	}
	return out
}
