package controlplane

import (
	"context"
	"encoding/json"
	"maps"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

// Each replica hears the load reports, and with them the rollout figures (arms), of the
// proxies connected to it; the leader judges rollouts on every proxy's. So in Kubernetes each
// replica shares its proxies' arms in a KvrelayShare (registry.KubeStore.PutShare), every
// RolloutInterval while a rollout runs and every armShareIdle otherwise (so that a rollout
// starts from every proxy's figures), and a replica adds what the others shared within
// armShareMaxAge to its own proxies'.
const (
	shareArms      = "arms"
	armShareIdle   = 5 * time.Second
	armShareMaxAge = 15 * time.Second
)

// armShare is one replica's share: its proxies' latest arms by node id, and when.
type armShare struct {
	At    time.Time                  `json:"at"`
	Nodes map[string][]xdsserver.Arm `json:"nodes"`
}

// shareArmsLoop writes this replica's share until ctx ends. The leader writes one too: it
// judges on its own proxies' live arms, but a follower showing a rollout and the next
// leader read it.
func (s *Server) shareArmsLoop(ctx context.Context, ks *registry.KubeStore) {
	t := time.NewTicker(s.opts.RolloutInterval)
	defer t.Stop()
	var last time.Time
	var warned time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.reg.Policy().Candidate == nil && time.Since(last) < armShareIdle {
			continue
		}
		b, err := json.Marshal(armShare{At: time.Now(), Nodes: s.xds.NodeArms()})
		if err == nil {
			err = ks.PutShare(shareArms, s.opts.Leader.Identity(), b)
		}
		if err != nil {
			if time.Since(warned) >= time.Minute {
				warned = time.Now()
				s.log.Warn("this replica's proxies' rollout figures not shared with the leader", "store", ks.Where(), "err", err)
			}
			continue
		}
		last = time.Now()
	}
}

// nodeArms is every proxy's arms by node id: those of the proxies connected here and, with
// replicas in Kubernetes, those the other replicas shared within armShareMaxAge. A proxy
// found in several (it moved from one replica to another) counts once, with the figures of
// most requests (its arms are cumulative).
func (s *Server) nodeArms() map[string][]xdsserver.Arm {
	nodes := s.xds.NodeArms()
	ks, ok := s.store.(*registry.KubeStore)
	if !ok || s.opts.Leader == nil {
		return nodes
	}
	shares, err := ks.Shares(context.Background(), shareArms)
	if err != nil {
		s.log.Warn("rollout judged on this replica's proxies alone", "err", err)
		return nodes
	}
	nodes = maps.Clone(nodes)
	for replica, b := range shares {
		var sh armShare
		if replica == s.opts.Leader.Identity() || json.Unmarshal(b, &sh) != nil || time.Since(sh.At) > armShareMaxAge {
			continue
		}
		for node, arms := range sh.Nodes {
			if cur, ok := nodes[node]; !ok || requests(arms) > requests(cur) {
				nodes[node] = arms
			}
		}
	}
	return nodes
}

func requests(arms []xdsserver.Arm) uint64 {
	var n uint64
	for _, a := range arms {
		n += a.Requests
	}
	return n
}
