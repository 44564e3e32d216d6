package server

import (
	"maps"
	"math"
	"sync"
	"time"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// MaxReportTenants bounds the tenants of one load report.
const MaxReportTenants = 4096

// TenantDemand is what one tenant asked of one proxy (LoadReport.tenants): the costs of
// its requests per second, admitted or refused, and its requests admitted and refused.
type TenantDemand struct {
	Requests, PromptTokens, OutputTokens float64
	Admitted, Refused                    uint64
}

// tenantsOf returns the tenants of a report that are whole: a name no longer than 256
// bytes, finite rates not below 0; at most MaxReportTenants. nil when the report carries
// none (it keeps the node's last), empty (not nil) when it carries only bad ones.
func tenantsOf(r *xdsv1.LoadReport) map[string]TenantDemand {
	ts := r.GetTenants()
	if len(ts) == 0 {
		return nil
	}
	out := make(map[string]TenantDemand, min(len(ts), MaxReportTenants))
	for _, t := range ts {
		if len(out) == MaxReportTenants {
			break
		}
		name := t.GetTenant()
		if name == "" || len(name) > maxSampleString || !finite(t.GetRequests(), t.GetPromptTokens(), t.GetOutputTokens()) ||
			t.GetRequests() < 0 || t.GetPromptTokens() < 0 || t.GetOutputTokens() < 0 {
			continue
		}
		out[name] = TenantDemand{Requests: t.GetRequests(), PromptTokens: t.GetPromptTokens(), OutputTokens: t.GetOutputTokens(),
			Admitted: t.GetAdmitted(), Refused: t.GetRefused()}
	}
	return out
}

// NodeTenants returns each live proxy's latest tenant demand by node id: what a replica
// shares with the others (SetRemoteTenants), so that budgets divide over the whole fleet's
// proxies. The maps are the caller's to read, not to modify.
func (s *Server) NodeTenants() map[string]map[string]TenantDemand {
	l := s.load
	cutoff := l.now().Add(-l.staleAfter)
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]map[string]TenantDemand{}
	for id, r := range l.nodes {
		if len(r.tenants) > 0 && !r.at.Before(cutoff) {
			out[id] = r.tenants
		}
	}
	return out
}

// SetRemoteTenants gives the tenant demand of the proxies connected to other replicas, by
// node id (their NodeTenants), which TenantTotals and the shares this replica grants its
// own proxies add to theirs. A node connected here counts with its own report only. The
// map is the Server's after the call.
func (s *Server) SetRemoteTenants(nodes map[string]map[string]TenantDemand) {
	s.tenants.mu.Lock()
	s.tenants.remote = nodes
	s.tenants.at = time.Time{} // the next grant sums again
	s.tenants.mu.Unlock()
}

// TenantTotal is one tenant's demand summed over the fleet's proxies that serve it.
type TenantTotal struct {
	TenantDemand
	Proxies int
}

// TenantTotals sums every live proxy's tenant demand (this replica's and, through
// SetRemoteTenants, the others'), by tenant. The map is the caller's.
func (s *Server) TenantTotals() map[string]TenantTotal { return sumTenants(s.allTenants()) }

// sumTenants sums the proxies' tenant demand (by node id) by tenant.
func sumTenants(nodes map[string]map[string]TenantDemand) map[string]TenantTotal {
	out := map[string]TenantTotal{}
	for _, ts := range nodes {
		for name, d := range ts {
			t := out[name]
			t.Requests += d.Requests
			t.PromptTokens += d.PromptTokens
			t.OutputTokens += d.OutputTokens
			t.Admitted = satAdd(t.Admitted, d.Admitted)
			t.Refused = satAdd(t.Refused, d.Refused)
			t.Proxies++
			out[name] = t
		}
	}
	return out
}

// allTenants is every live proxy's tenant demand by node id, this replica's reports over
// the others' shares.
func (s *Server) allTenants() map[string]map[string]TenantDemand {
	nodes := s.NodeTenants()
	s.tenants.mu.Lock()
	remote := s.tenants.remote
	s.tenants.mu.Unlock()
	if len(remote) == 0 {
		return nodes
	}
	all := maps.Clone(remote)
	maps.Copy(all, nodes)
	return all
}

// tenantShares divides tenants' budgets among the proxies that serve them: each proxy's
// share of a limit is its demand's part of all of theirs, every proxy given a floor of
// shareFloor of the mean demand so that one that was not asked yet can still admit a first
// request (and be asked more). The sums behind it are taken again at most every
// tenantSumEvery.
type tenantShares struct {
	mu     sync.Mutex
	remote map[string]map[string]TenantDemand
	at     time.Time
	nodes  map[string]map[string]TenantDemand // the demand the sums were taken from
	sums   map[string]TenantTotal
}

const (
	shareFloor     = 0.02
	tenantSumEvery = 200 * time.Millisecond
)

// grants are node's shares of the tenants it reported (demand, its latest report's).
func (s *Server) grants(node string, demand map[string]TenantDemand) []*xdsv1.TenantGrant {
	if len(demand) == 0 {
		return nil
	}
	ts := &s.tenants
	now := s.load.now()
	ts.mu.Lock()
	if now.Sub(ts.at) >= tenantSumEvery || ts.sums == nil {
		ts.mu.Unlock()
		nodes := s.allTenants()
		sums := sumTenants(nodes)
		ts.mu.Lock()
		ts.at, ts.nodes, ts.sums = now, nodes, sums
	}
	nodes, sums := ts.nodes, ts.sums
	ts.mu.Unlock()

	mine := nodes[node]
	out := make([]*xdsv1.TenantGrant, 0, len(demand))
	for name, d := range demand {
		sum := sums[name]
		// The others' demand: the sums less what this node counted in them.
		if old, ok := mine[name]; ok {
			sum.Requests -= old.Requests
			sum.PromptTokens -= old.PromptTokens
			sum.OutputTokens -= old.OutputTokens
			sum.Proxies--
		}
		n := sum.Proxies + 1
		out = append(out, &xdsv1.TenantGrant{Tenant: name, Proxies: uint32(n),
			Requests:     share(d.Requests, sum.Requests, n),
			PromptTokens: share(d.PromptTokens, sum.PromptTokens, n),
			OutputTokens: share(d.OutputTokens, sum.OutputTokens, n)})
	}
	return out
}

// share is the part of a budget of the proxy asked mine when the n-1 others are asked
// others together: in proportion to demand, each proxy's raised by a floor of shareFloor
// of the mean (equal parts when nobody asks anything).
func share(mine, others float64, n int) float64 {
	others = max(others, 0)
	total := mine + others
	floor := shareFloor * total / float64(n)
	if total <= 0 || floor <= 0 || math.IsInf(total, 0) {
		return 1 / float64(n)
	}
	return min((mine+floor)/(total+float64(n)*floor), 1)
}
