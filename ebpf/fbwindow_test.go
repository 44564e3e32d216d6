package ebpf

import (
	"math/bits"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/ebpf/probes"
)

// hist builds a kernel-style histogram of the given latencies.
func hist(ds ...time.Duration) probes.Hist {
	var h probes.Hist
	for _, d := range ds {
		ns := uint64(d)
		slot := 0
		if ns > 0 {
			slot = min(bits.Len64(ns)-1, probes.HistSlots-1)
		}
		h.Count++
		h.SumNs += ns
		h.Slots[slot]++
	}
	return h
}

func TestWindowLatency(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []time.Duration
		want time.Duration
		ok   bool
	}{
		{"empty", nil, 0, false},
		{"one", []time.Duration{30 * time.Millisecond}, 30 * time.Millisecond, true},
		{"same slot: the mean", []time.Duration{20 * time.Millisecond, 22 * time.Millisecond, 24 * time.Millisecond}, 22 * time.Millisecond, true},
		// 10, 11, 12 ms and one 2 s outlier: the mean (508 ms) is clamped to the top of the
		// median's slot [2^23, 2^24) ns.
		{"outlier clamped", []time.Duration{10 * time.Millisecond, 11 * time.Millisecond, 12 * time.Millisecond, 2 * time.Second}, 1 << 24, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := hist(tc.in...)
			got, ok := windowLatency(&h)
			if ok != tc.ok || got != tc.want {
				t.Errorf("windowLatency = %v, %v; want %v, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
}

func TestFirstByteExcess(t *testing.T) {
	ms := time.Millisecond
	a := func(w, p string) attribution { return attribution{w, p} }
	for _, tc := range []struct {
		name   string
		recent map[attribution]time.Duration
		want   map[attribution]int
	}{
		{"alone in its pool", map[attribution]time.Duration{a("w0", "agg"): 500 * ms}, map[attribution]int{a("w0", "agg"): 0}},
		{"five times the fastest: four waiting", map[attribution]time.Duration{a("w0", "agg"): 10 * ms, a("w1", "agg"): 50 * ms},
			map[attribution]int{a("w0", "agg"): 0, a("w1", "agg"): 4}},
		{"under twice the fastest: none", map[attribution]time.Duration{a("w0", "agg"): 10 * ms, a("w1", "agg"): 19 * ms},
			map[attribution]int{a("w0", "agg"): 0, a("w1", "agg"): 0}},
		{"pools compared apart", map[attribution]time.Duration{
			a("p0", "prefill"): 100 * ms, a("p1", "prefill"): 300 * ms, a("d0", "decode"): 5 * ms, a("d1", "decode"): 5 * ms},
			map[attribution]int{a("p0", "prefill"): 0, a("p1", "prefill"): 2, a("d0", "decode"): 0, a("d1", "decode"): 0}},
		{"reference floored at 1ms", map[attribution]time.Duration{a("w0", "agg"): 100 * time.Microsecond, a("w1", "agg"): 3 * ms},
			map[attribution]int{a("w0", "agg"): 0, a("w1", "agg"): 2}},
		{"capped", map[attribution]time.Duration{a("w0", "agg"): 2 * ms, a("w1", "agg"): 10 * time.Second},
			map[attribution]int{a("w0", "agg"): 0, a("w1", "agg"): maxFirstByteWaiting}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := firstByteExcess(tc.recent)
			if len(got) != len(tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			for k, v := range tc.want {
				if got[k] != v {
					t.Errorf("%v: got %d, want %d (all: %v)", k, got[k], v, got)
				}
			}
		})
	}
}

// The window looks back span: a worker that stopped answering drops out once its last
// answers are older than that, and the other's signal goes with the lost reference.
func TestFBWindowSlides(t *testing.T) {
	fast, slow := attribution{"fast", "agg"}, attribution{"slow", "agg"}
	w := fbWindow{span: 2 * time.Second}
	t0 := time.Unix(1000, 0)
	var hf, hs []time.Duration
	snap := func() map[attribution]probes.Hist {
		return map[attribution]probes.Hist{fast: hist(hf...), slow: hist(hs...)}
	}
	w.add(t0, snap())
	if len(w.waiting) != 0 {
		t.Fatalf("first sample: %v, want nothing", w.waiting)
	}
	// For 2 s both answer: fast in 4 ms, slow in 40 ms.
	for i := 1; i <= 8; i++ {
		hf = append(hf, 4*time.Millisecond)
		hs = append(hs, 40*time.Millisecond)
		w.add(t0.Add(time.Duration(i)*250*time.Millisecond), snap())
	}
	if w.waiting["slow"] != 9 || w.waiting["fast"] != 0 {
		t.Fatalf("both answering: %v, want slow 9, fast 0", w.waiting)
	}
	if d := w.recent[slow]; d != 40*time.Millisecond {
		t.Fatalf("slow recent %v, want 40ms", d)
	}
	// Then only fast answers; slow's answers leave the window 2 s later.
	for i := 9; i <= 16; i++ {
		hf = append(hf, 4*time.Millisecond)
		w.add(t0.Add(time.Duration(i)*250*time.Millisecond), snap())
		_, has := w.waiting["slow"]
		if want := i < 16; has != want {
			t.Fatalf("at %d: slow in the window %v, want %v (%v)", i, has, want, w.waiting)
		}
	}
	if len(w.snaps) > 10 {
		t.Errorf("%d snapshots kept for a 2 s window sampled every 250 ms", len(w.snaps))
	}
	// A restarted histogram (fewer observations than the base) gives no window.
	hs = hs[:1]
	w.add(t0.Add(17*250*time.Millisecond), snap())
	if _, has := w.recent[slow]; has {
		t.Errorf("restarted histogram in the window: %v", w.recent)
	}
}
