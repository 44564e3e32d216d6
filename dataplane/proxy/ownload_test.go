package proxy

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/xds"
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
	names := func(seq uint64) *xdsv1.Load {
		return &xdsv1.Load{Reports: []*xdsv1.ReportSeq{{NodeId: "edge-a", Seq: 90}, {NodeId: "edge-b", Seq: seq}, {NodeId: "edge-c", Seq: 7}}}
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
	if got := x.ownSent("w1", &xdsv1.Load{Reports: names(0).Reports[:1]}); got != (ownSent{}) {
		t.Fatalf("a load naming no report of this proxy: %+v", got)
	}
	if got := x.ownSent("w1", nil); got != (ownSent{}) {
		t.Fatalf("a load naming no reports: %+v", got)
	}
}

// A pushed load that names its merge (Load.epoch) takes out the report the load stream said
// that merge includes; one of a merge older than the proxy remembers, the latest merge's
// (its shares have not changed since); one of a merge not heard of yet, the latest report.
// A new load stream forgets the merges of the last.
func TestOwnSentByEpoch(t *testing.T) {
	x := &xdsState{nodeID: "edge-b"}
	put := func(seq uint64, prefill int64) {
		r := &x.sent[seq%sentReports]
		r.seq, r.loads, x.last = seq, map[string]ownSent{"w1": {prefill: prefill}}, seq
	}
	put(1, 100)
	put(2, 200)
	put(3, 300)
	x.noteIncluded(1000, 1)
	x.noteIncluded(1001, 2)
	at := func(e uint64) int64 { return x.ownSent("w1", &xdsv1.Load{Epoch: e}).prefill }
	if got := at(1000); got != 100 {
		t.Fatalf("merge 1000 includes report 1: took out %d", got)
	}
	if got := at(1001); got != 200 {
		t.Fatalf("merge 1001 includes report 2: took out %d", got)
	}
	if got := at(1002); got != 300 {
		t.Fatalf("a merge not heard of: took out %d, want the latest report's 300", got)
	}
	for e := uint64(1002); e < 1002+sentReports; e++ {
		x.noteIncluded(e, 2)
	}
	if got := at(1000); got != 200 {
		t.Fatalf("a forgotten merge: took out %d, want the latest merge's 200", got)
	}
	x.noteIncluded(0, 0)
	if got := at(1001); got != 300 {
		t.Fatalf("after a new stream: took out %d, want the latest report's 300", got)
	}
}

// A pushed policy replaces the proxy's own policy flags, and the proxy says which.
func TestPushedPolicyOverridesAreLogged(t *testing.T) {
	var buf bytes.Buffer
	cfg := DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.XDS = "127.0.0.1:1" // nothing answers: only applyXDS feeds the proxy
	cfg.XDSSyncTimeout = 0
	cfg.BusyPrefillTokens = 4096
	s, err := New(cfg, slog.New(slog.NewTextHandler(&buf, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.setupXDS(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stopXDS)
	s.applyXDS(nil, &xdsv1.RoutingPolicy{Version: 2, Policy: "kv", OverlapWeight: 1, CacheThreshold: 0.3}, xds.PushedLoads{})
	out := buf.String()
	for _, want := range []string{"replaces this proxy's --policy", "flag=" + cfg.Policy, "pushed=kv", "busy thresholds replace", "flag_prefill_tokens=4096", "pushed_prefill_tokens=0"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
}

// TestPushedZeroWeightIsZero: a pushed overlap_weight of 0 makes the proxy route by load
// alone (before, the proxy took a zero for "unset" and used the default weight).
func TestPushedZeroWeightIsZero(t *testing.T) {
	s, ws := rolloutServer(t)
	for _, c := range []struct {
		weight float64
		want   string
	}{{64, "w0"}, {0, "w1"}} {
		s.applyXDS(ws, &xdsv1.RoutingPolicy{Version: uint64(10 + c.weight), Policy: "kv", OverlapWeight: c.weight, QueueWeight: 8, CacheThreshold: 0.1}, xds.PushedLoads{})
		r := prepared(t, s, chat8k("q"))
		w0 := s.core.Pool().Worker("w0")
		s.core.Index().Record(w0.Index, r.BlockHashes(), 0) // w0 holds the prompt …
		var u route.Usage
		u.Begin(w0, 8000, 0, 64) // … and has another prompt to compute
		if err := r.Decide(nanotime(), false); err != nil {
			t.Fatal(err)
		}
		if got := r.Decision().Worker.ID; got != c.want {
			t.Errorf("pushed overlap_weight %v: routed to %s, want %s", c.weight, got, c.want)
		}
		u.End()
	}
}

// A pushed load not pushed again stays whole while the control plane answers on the load
// stream (it holds a load within its band, or one that did not change); once it stops
// answering, the load fades after load_stale_after and is gone after as long again.
func TestPushedLoadLivesWhileTheControlPlaneAnswers(t *testing.T) {
	const after = int64(3e9)
	s := &Server{cfg: Config{LoadStaleAfter: 3 * 1e9}, xds: &xdsState{pushed: map[string]pushedLoad{}}}
	w := &route.Worker{ID: "w1"}
	rep := &route.Reported{Running: 40, Waiting: 4}
	w.SetReported(rep)
	s.xds.pushed["w1"] = pushedLoad{w: w, r: rep, at: 1}
	// Answers every 100 ms for 10 s: the load stays.
	var now int64 = 1
	for ; now < 10e9; now += 1e8 {
		s.xds.acked.Store(now)
		s.ageLoads(now)
	}
	if got := w.Load(); got != 44 {
		t.Fatalf("after 10 s of answers the load is %d, want 44", got)
	}
	// The answers stop: half faded at 1.5× load_stale_after, gone at 2×.
	last := now - 1e8
	s.ageLoads(last + after + after/2)
	if got := w.Load(); got != 22 {
		t.Fatalf("1.5x load_stale_after after the last answer: load %d, want 22", got)
	}
	s.ageLoads(last + 2*after)
	if got := w.Load(); got != 0 {
		t.Fatalf("2x load_stale_after after the last answer: load %d, want 0", got)
	}
}

// TestPushedLoadsByShard: loads pushed as Loads reach each worker by its load index, an
// entry of another worker's id none; an update of loads alone (the same worker and policy
// resources) replaces them and keeps the pool; a changed worker applies the update whole.
func TestPushedLoadsByShard(t *testing.T) {
	s, ws := rolloutServer(t)
	ws[0].LoadIndex, ws[1].LoadIndex = 0, 1
	policy := &xdsv1.RoutingPolicy{Version: 3, Policy: "kv", OverlapWeight: 1, CacheThreshold: 0.3}
	shardOf := func(id0, id1 string, r0, r1 uint32) xds.PushedLoads {
		sh := xds.Shard{Loads: make([]*xdsv1.Load, xds.LoadsShard), Checks: make([]uint32, xds.LoadsShard)}
		sh.Loads[0], sh.Loads[1] = &xdsv1.Load{Running: r0}, &xdsv1.Load{Running: r1}
		sh.Checks[0], sh.Checks[1] = xds.IDCheck(id0), xds.IDCheck(id1)
		return xds.NewPushedLoads(map[uint32]xds.Shard{0: sh})
	}
	shard := func(r0, r1 uint32) xds.PushedLoads { return shardOf("w0", "w1", r0, r1) }
	s.applyXDS(ws, policy, shardOf("w1", "w0", 3, 5)) // entries of the other's id: none taken
	pool := s.core.Pool()
	if l0, l1 := pool.Worker("w0").Load(), pool.Worker("w1").Load(); l0 != 0 || l1 != 0 {
		t.Fatalf("entries of the other worker's id: w0 %d, w1 %d, want none", l0, l1)
	}
	s.applyXDS(slices.Clone(ws), policy, shard(3, 5))
	if l0, l1 := pool.Worker("w0").Load(), pool.Worker("w1").Load(); l0 != 3 || l1 != 5 {
		t.Fatalf("loads by index: w0 %d, w1 %d, want 3 and 5", l0, l1)
	}
	s.applyXDS(slices.Clone(ws), policy, shard(7, 0))
	if s.core.Pool() != pool {
		t.Error("an update of loads alone built a new pool")
	}
	if l0, l1 := pool.Worker("w0").Load(), pool.Worker("w1").Load(); l0 != 7 || l1 != 0 {
		t.Fatalf("loads alone: w0 %d, w1 %d, want 7 and 0", l0, l1)
	}
	drained := proto.Clone(ws[1]).(*xdsv1.Worker)
	drained.Draining = true
	s.applyXDS([]*xdsv1.Worker{ws[0], drained}, policy, shard(1, 2))
	if s.core.Pool() == pool {
		t.Error("a changed worker did not build a new pool")
	}
	if w1 := s.core.Pool().Worker("w1"); !w1.Draining() || w1.Load() != 2 {
		t.Errorf("w1 after draining: draining %v, load %d", w1.Draining(), w1.Load())
	}
}
