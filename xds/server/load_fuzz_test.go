package server

import (
	"math"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// FuzzArmsOf: any load report a proxy sends yields arms that are versioned, at most
// maxArms, with increasing finite bounds and one count more than bounds, and two proxies
// sending it sum without a panic.
func FuzzArmsOf(f *testing.F) {
	ok, _ := proto.Marshal(&xdsv1.LoadReport{NodeId: "a", Arms: []*xdsv1.ArmReport{
		{PolicyVersion: 3, Requests: 10, TtftBounds: []float64{0.1, 1}, TtftCounts: []uint64{5, 4, 1}}}})
	f.Add(ok)
	f.Add([]byte{0x22, 0x02, 0x08, 0x01})
	noGaps, _ := proto.Marshal(&xdsv1.LoadReport{NodeId: "a", Arms: []*xdsv1.ArmReport{
		{PolicyVersion: 3, TtftCounts: []uint64{1}, ItlCounts: []uint64{2}, HitCounts: []uint64{3}}}})
	f.Add(noGaps)
	groups, _ := proto.Marshal(&xdsv1.LoadReport{NodeId: "a", Arms: []*xdsv1.ArmReport{
		{PolicyVersion: 3, Requests: 4, TtftBounds: []float64{0.1, 1}, TtftCounts: []uint64{2, 1, 1}, Groups: []*xdsv1.ArmGroup{
			{Group: 9, Requests: 3, TtftCounts: []uint64{1, 1, 1}}, {Group: 2, Requests: 1, TtftCounts: []uint64{1}},
			{Group: 9, Requests: 7}, {Group: 1000, Requests: 1}}}}})
	f.Add(groups)
	f.Fuzz(func(t *testing.T, raw []byte) {
		var r xdsv1.LoadReport
		if proto.Unmarshal(raw, &r) != nil {
			return
		}
		arms := armsOf(&r)
		if len(arms) > maxArms {
			t.Fatalf("%d arms kept", len(arms))
		}
		for _, a := range arms {
			if a.Version == 0 || len(a.TTFTCounts) != len(a.TTFTBounds)+1 {
				t.Fatalf("arm %+v kept", a)
			}
			for i, b := range a.TTFTBounds {
				if math.IsNaN(b) || math.IsInf(b, 0) || i > 0 && b <= a.TTFTBounds[i-1] {
					t.Fatalf("bounds %v kept", a.TTFTBounds)
				}
			}
		}
		// Conversation groups: numbered below MaxArmGroups, each once, sorted, histograms as
		// long as the arm's or none.
		checkGroups := func(what string, a Arm) {
			for i, g := range a.Groups {
				if g.Group >= MaxArmGroups || i > 0 && g.Group <= a.Groups[i-1].Group ||
					len(g.TTFTCounts) != 0 && len(g.TTFTCounts) != len(a.TTFTCounts) || len(g.ITLCounts) != 0 && len(g.ITLCounts) != len(a.ITLBounds)+1 {
					t.Fatalf("%s: groups %+v kept", what, a.Groups)
				}
			}
		}
		for _, a := range arms {
			checkGroups("decoded arm", a)
		}
		l := newLoadStore(time.Minute, time.Now)
		l.put("a", 1, &r)
		l.put("b", 2, &r)
		for v, a := range SumArms(l.nodeArms()) {
			if len(a.TTFTCounts) != len(a.TTFTBounds)+1 || len(a.ITLCounts) > 0 && len(a.ITLCounts) != len(a.ITLBounds)+1 {
				t.Fatalf("summed arm %d: %+v", v, a)
			}
			checkGroups("summed arm", a)
		}
	})
}

// FuzzDecisionsOf: any decoded report's decision samples are kept only whole (a worker,
// bounded names, finite non-negative figures, at most MaxReportDecisions of at most 64
// candidates each, every candidate named and finite), without a panic.
func FuzzDecisionsOf(f *testing.F) {
	ok, _ := proto.Marshal(&xdsv1.LoadReport{NodeId: "a", Decisions: []*xdsv1.DecisionSample{
		{Id: 1, Worker: "w0", Mode: "cost", OverlapBlocks: 3, Ttft: 0.05, Candidates: []*xdsv1.CandidateSample{{Worker: "w0", CachedBlocks: 3}, {Worker: "w1"}}}}})
	f.Add(ok)
	bad, _ := proto.Marshal(&xdsv1.LoadReport{NodeId: "a", Decisions: []*xdsv1.DecisionSample{{Worker: "", Ttft: math.NaN()}, {Worker: "w", Itl: -1}}})
	f.Add(bad)
	f.Fuzz(func(t *testing.T, raw []byte) {
		var r xdsv1.LoadReport
		if proto.Unmarshal(raw, &r) != nil {
			return
		}
		ds := DecisionsOf(&r)
		if len(ds) > MaxReportDecisions {
			t.Fatalf("%d decisions kept", len(ds))
		}
		for _, d := range ds {
			if d.GetWorker() == "" || len(d.GetWorker()) > maxSampleString || !finite(d.GetOverlapBlocks(), d.GetAchievableBlocks(), d.GetTtft(), d.GetItl()) || len(d.GetCandidates()) > maxSampleCandidates {
				t.Fatalf("decision %v kept", d)
			}
			for _, c := range d.GetCandidates() {
				if c.GetWorker() == "" || !finite(c.GetCachedBlocks(), c.GetTtft(), c.GetQueue(), c.GetPrefill()) {
					t.Fatalf("candidate %v kept", c)
				}
			}
		}
	})
}

// FuzzFitsOf: any decoded report's latency fits are kept only whole (at most maxReportFits,
// a bounded model name, finite coefficients and decode steps of bounded length), and of
// their workers only those named, within bounds and with finite figures, the decode speed
// included; without a panic. The seed's second worker, whose decode speed is NaN, is
// dropped and the first kept.
func FuzzFitsOf(f *testing.F) {
	seed := &xdsv1.LoadReport{NodeId: "a", Fits: []*xdsv1.LatencyFit{{Model: "m", Theta: []float64{1, 2}, DecodeStep: []float64{0.01}, DecodeKv: []float64{1},
		TtftObservations: 10, Workers: []*xdsv1.WorkerFit{
			{WorkerId: "w0", Speed: 1, Occupancy: 2, SigmaQueued: 0.5, SigmaFresh: 0.2, Observations: 10, DecodeSpeed: 1.5},
			{WorkerId: "w1", Speed: 1, Occupancy: 2, SigmaQueued: 0.5, SigmaFresh: 0.2, Observations: 10, DecodeSpeed: math.NaN()}}}}}
	if fs := fitsOf(seed); len(fs) != 1 || len(fs[0].GetWorkers()) != 1 || fs[0].GetWorkers()[0].GetWorkerId() != "w0" {
		f.Fatalf("fits of the seed: %v, want w0's alone", fs)
	}
	raw, _ := proto.Marshal(seed)
	f.Add(raw)
	f.Fuzz(func(t *testing.T, raw []byte) {
		var r xdsv1.LoadReport
		if proto.Unmarshal(raw, &r) != nil {
			return
		}
		fs := fitsOf(&r)
		if len(fs) > maxReportFits {
			t.Fatalf("%d fits kept", len(fs))
		}
		for _, fit := range fs {
			if len(fit.GetModel()) > maxSampleString || len(fit.GetTheta()) > maxFitValues || !finite(fit.GetTheta()...) || !finite(fit.GetDecodeStep()...) || !finite(fit.GetDecodeKv()...) {
				t.Fatalf("fit %v kept", fit)
			}
			for _, w := range fit.GetWorkers() {
				if w.GetWorkerId() == "" || len(w.GetWorkerId()) > maxSampleString ||
					!finite(w.GetSpeed(), w.GetOccupancy(), w.GetSigmaQueued(), w.GetSigmaFresh(), w.GetDecodeSpeed()) {
					t.Fatalf("worker fit %v kept", w)
				}
			}
		}
	})
}
