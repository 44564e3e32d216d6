package proxy

import (
	"testing"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// A pushed load takes out exactly the report of this proxy it names, even when newer
// reports have gone out since; an unknown (too old) seq falls back to the latest, and a
// load that names no report of this proxy includes none of its requests.
func TestOwnSentBySeq(t *testing.T) {
	x := &xdsState{nodeID: "edge-b"}
	put := func(seq uint64, prefill int64) {
		r := &x.sent[seq%sentReports]
		r.seq, r.loads, x.last = seq, map[string]ownSent{"w1": {prefill: prefill, decode: prefill / 16}}, seq
	}
	put(1, 1600)
	put(2, 3200)
	put(3, 0)
	names := func(seq uint64) []*xdsv1.ReportSeq {
		return []*xdsv1.ReportSeq{{NodeId: "edge-a", Seq: 90}, {NodeId: "edge-b", Seq: seq}, {NodeId: "edge-c", Seq: 7}}
	}
	if got := x.ownSent("w1", names(2)); got.prefill != 3200 || got.decode != 200 {
		t.Fatalf("report 2: %+v", got)
	}
	if got := x.ownSent("w1", names(1)); got.prefill != 1600 {
		t.Fatalf("report 1: %+v", got)
	}
	if got := x.ownSent("w2", names(2)); got != (ownSent{}) {
		t.Fatalf("a worker report 2 left out: %+v", got)
	}
	for i := uint64(4); i < 4+sentReports; i++ {
		put(i, int64(i))
	}
	last := x.last
	if got := x.ownSent("w1", names(2)); got.prefill != int64(last) {
		t.Fatalf("forgotten report 2: %+v, want the latest (%d)", got, last)
	}
	if got := x.ownSent("w1", names(0)[:1]); got != (ownSent{}) {
		t.Fatalf("a load naming no report of this proxy: %+v", got)
	}
	if got := x.ownSent("w1", nil); got != (ownSent{}) {
		t.Fatalf("a load naming no reports: %+v", got)
	}
}
