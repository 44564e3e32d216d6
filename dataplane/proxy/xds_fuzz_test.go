package proxy

import (
	"context"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// FuzzApplyXDS feeds arbitrary Worker and RoutingPolicy resources through what the proxy's
// xDS client does with a push: decode and validate (xds.DecodeWorker/DecodePolicy plus the
// proxy's own checks, profiles built against its registry included), then apply what passes to a live proxy's routing state. Nothing may
// panic, and a worker that is applied must be routable state the pool can hold.
func FuzzApplyXDS(f *testing.F) {
	w, _ := proto.Marshal(&xdsv1.Worker{Id: "w1", Url: "http://127.0.0.1:8001", Model: "m", BlockSize: 16, Slot: 3, Healthy: true,
		Load: &xdsv1.Load{Running: 2, Waiting: 1, KvUsage: 0.5, PrefillTokens: 100, DecodeBlocks: 7}})
	p, _ := proto.Marshal(&xdsv1.RoutingPolicy{Version: 2, Policy: "kv", OverlapWeight: 1, CacheThreshold: 0.3, TierWeights: []float64{1, 0.5, 0.25}})
	f.Add(w, p, w)
	rollout, _ := proto.Marshal(&xdsv1.RoutingPolicy{Version: 2, Policy: "kv", OverlapWeight: 1,
		Candidate: &xdsv1.RoutingPolicy{Version: 3, Policy: "latency"}, CandidateShare: 0.25, Shadow: true})
	f.Add(w, rollout, w)
	custom, _ := proto.Marshal(&xdsv1.RoutingPolicy{Version: 4, Policy: "custom", Profile: &xdsv1.Profile{
		Filters: []*xdsv1.Plugin{{Name: "model"}}, Scorers: []*xdsv1.Plugin{{Name: "prefill", Weight: 1, Params: map[string]float64{"overlap_weight": 8}}},
		Picker: &xdsv1.Plugin{Name: "min-cost"}, Spread: &xdsv1.Plugin{Name: "least-prefill"}}})
	f.Add(w, custom, w)
	f.Add([]byte{0x0a, 0x02, 'w', '2', 0x12, 0x05, 'h', 't', 't', 'p', ':'}, []byte{0x08, 0xff, 0x01}, []byte{})
	f.Add([]byte{0x40, 0xff, 0xff, 0xff, 0xff, 0x0f}, []byte{0x12, 0x03, 'b', 'a', 'd'}, []byte{0x0a, 0x00})

	cfg := DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.XDS = "127.0.0.1:1" // nothing answers: only applyXDS feeds the proxy
	cfg.XDSSyncTimeout = 0
	s, err := New(cfg, nil)
	if err != nil {
		f.Fatal(err)
	}
	if err := s.setupXDS(context.Background()); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(s.stopXDS)

	f.Fuzz(func(t *testing.T, a, pol, b []byte) {
		var workers []*xdsv1.Worker
		for _, raw := range [][]byte{a, b} {
			probe := &xdsv1.Worker{}
			if proto.Unmarshal(raw, probe) != nil {
				continue
			}
			w, err := xds.DecodeWorker(probe.GetId(), &anypb.Any{TypeUrl: xds.WorkerType, Value: raw})
			if err != nil || s.checkWorker(w) != nil {
				continue
			}
			workers = append(workers, w)
		}
		var policy *xdsv1.RoutingPolicy
		if p, err := xds.DecodePolicy(xds.PolicyName, &anypb.Any{TypeUrl: xds.PolicyType, Value: pol}); err == nil && s.checkPolicy(p) == nil {
			policy = p
		}
		s.applyXDS(workers, policy, xds.PushedLoads{})
		pool := s.core.Pool()
		states := s.core.WorkerStates()
		for _, w := range pool.Workers {
			if w.Index >= len(states) || states[w.Index] == nil || states[w.Index].W != w {
				t.Fatalf("worker %s at %d has no state", w.ID, w.Index)
			}
		}
		overlap := make([]float64, pool.Size())
		s.Replica().Match([]uint64{1, 2, 3}, overlap)
		// An applied candidate routes only a share in [0, 1] under its own version.
		if c, ok := s.core.CandidateStatus(); ok && (!(c.Share >= 0 && c.Share <= 1) || c.Version == 0) {
			t.Fatalf("candidate applied with share %v, version %d", c.Share, c.Version)
		}
	})
}
