package server

import (
	"testing"
	"time"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// MergedEpochs: a worker keeps its epoch while no proxy's share of it changes, takes the
// merge's epoch when one does (even when the sum stays: one proxy's request moving to
// another), and drops it when no proxy has a share; every node whose report a merge includes
// hears so on its stream's mailbox, the latest merge only.
func TestMergedEpochs(t *testing.T) {
	l := newLoadStore(time.Minute, time.Now)
	l.known.Store(&map[string]struct{}{"w1": {}, "w2": {}})
	report := func(node string, stream, seq uint64, w1, w2 uint32) {
		r := &xdsv1.LoadReport{NodeId: node, Seq: seq}
		for id, n := range map[string]uint32{"w1": w1, "w2": w2} {
			if n > 0 {
				r.Workers = append(r.Workers, &xdsv1.WorkerLoad{WorkerId: id, Inflight: n, PrefillTokens: uint64(n) * 100})
			}
		}
		l.put(node, stream, r)
	}
	boxA, boxB := l.subscribe(1), l.subscribe(2)
	report("a", 1, 1, 1, 2)
	report("b", 2, 1, 1, 0)
	sums, e1 := l.mergedEpochs()
	if sums["w1"].Inflight != 2 || sums["w2"].Inflight != 2 || e1["w1"] == 0 || e1["w1"] != e1["w2"] {
		t.Fatalf("first merge: sums %v epochs %v", sums, e1)
	}
	first := e1["w1"]
	if in := <-boxA; in != (inclusion{first, 1}) {
		t.Fatalf("a heard %+v, want merge %d includes its report 1", in, first)
	}
	// New reports with the same shares: the epochs stay, so the workers are not resent.
	report("a", 1, 2, 1, 2)
	report("b", 2, 2, 1, 0)
	_, e2 := l.mergedEpochs()
	if e2["w1"] != first || e2["w2"] != first {
		t.Fatalf("unchanged shares moved the epochs: %v, want %d", e2, first)
	}
	// b's request on w1 moves to a: w1's sum is unchanged but its shares are not.
	report("a", 1, 3, 2, 2)
	report("b", 2, 3, 0, 0)
	sums, e3 := l.mergedEpochs()
	if sums["w1"].Inflight != 2 || e3["w1"] <= first || e3["w2"] != first {
		t.Fatalf("a share moved: sums %v epochs %v (first %d)", sums, e3, first)
	}
	// The mailbox keeps only the latest merge.
	if in := <-boxB; in != (inclusion{e3["w1"], 3}) {
		t.Fatalf("b heard %+v, want the latest merge %d with its report 3", in, e3["w1"])
	}
	select {
	case in := <-boxB:
		t.Fatalf("b's mailbox held a second merge: %+v", in)
	default:
	}
	// No shares left on w2: no epoch.
	report("a", 1, 4, 2, 0)
	if _, e4 := l.mergedEpochs(); e4["w2"] != 0 {
		t.Fatalf("w2 without shares has epoch %d", e4["w2"])
	}
	l.unsubscribe(1)
	report("a", 1, 5, 1, 0)
	l.mergedEpochs() // a's stream is gone: nothing to tell, nothing blocks
}
