package controlplane

import (
	"context"
	"encoding/json"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

// Each replica divides tenants' budgets among the proxies connected to it (the xDS server's
// grants); so that the division is over the whole fleet, each replica shares what its
// proxies' tenants asked in a KvrelayShare every tenantShareEvery, and reads the others' as
// often, taking those written within tenantShareMaxAge.
const (
	shareTenants      = "tenants"
	tenantShareEvery  = time.Second
	tenantShareMaxAge = 5 * time.Second
)

// tenantShare is one replica's share: its proxies' latest tenant demand by node id, and
// when.
type tenantShare struct {
	At    time.Time                                    `json:"at"`
	Nodes map[string]map[string]xdsserver.TenantDemand `json:"nodes"`
}

// shareTenantsLoop writes this replica's share and reads the others' until ctx ends. It
// writes nothing while no proxy here reports a tenant with a budget (after one empty share
// that replaces what it wrote before).
func (s *Server) shareTenantsLoop(ctx context.Context, ks *registry.KubeStore) {
	t := time.NewTicker(tenantShareEvery)
	defer t.Stop()
	self := s.opts.Leader.Identity()
	wrote := false
	var warned time.Time
	warn := func(msg string, err error) {
		if time.Since(warned) >= time.Minute {
			warned = time.Now()
			s.log.Warn(msg, "store", ks.Where(), "err", err)
		}
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		nodes := s.xds.NodeTenants()
		if len(nodes) > 0 || wrote {
			b, err := json.Marshal(tenantShare{At: time.Now(), Nodes: nodes})
			if err == nil {
				err = ks.PutShare(shareTenants, self, b)
			}
			if err != nil {
				warn("this replica's tenants' demand not shared: budgets divide over its own proxies", err)
			} else {
				wrote = len(nodes) > 0
			}
		}
		shares, err := ks.Shares(ctx, shareTenants)
		if err != nil {
			warn("the other replicas' tenants' demand not read: budgets divide over this replica's proxies", err)
			continue
		}
		remote := map[string]map[string]xdsserver.TenantDemand{}
		for replica, b := range shares {
			var sh tenantShare
			if replica == self || json.Unmarshal(b, &sh) != nil || time.Since(sh.At) > tenantShareMaxAge {
				continue
			}
			for node, ts := range sh.Nodes {
				remote[node] = ts
			}
		}
		s.xds.SetRemoteTenants(remote)
	}
}
