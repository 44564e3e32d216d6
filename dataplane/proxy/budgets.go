package proxy

import (
	"time"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// Fleet-wide budgets. A tenant's limits in the keys file are the fleet's: every proxy with
// the file reports, every second, what each tenant with a budget asked of it (tenantDemand,
// LoadReport.tenants), and the control plane answers with this proxy's share of each budget
// (applyGrants, LoadReportAck.tenants): the part of the fleet's demand this proxy sees, so
// that the proxies together admit the limit and not N times it. Until the first answer, and
// without a control plane, a proxy admits the whole limit itself.

// applyKeys takes the API keys the control plane gives beside the keys file's (checked by
// Keys.CheckRemote before).
func (s *Server) applyKeys(keys string) {
	if err := s.keys.SetRemote(keys); err != nil {
		s.log.Error("the control plane's API keys not taken; the keys in force stay", "err", err)
		return
	}
	s.log.Info("API keys from the control plane", "tenants", len(s.keys.Table().Tenants()), "checking keys", s.keys.Active())
}

// tenantDemand is what the tenants with budgets asked of this proxy since the last report.
func (s *Server) tenantDemand() []*xdsv1.TenantDemand {
	if !s.keys.Active() {
		return nil
	}
	now := time.Now()
	var out []*xdsv1.TenantDemand
	for name, t := range s.keys.Table().Tenants() {
		if !t.Limited() {
			continue
		}
		d := t.Demand(now)
		out = append(out, &xdsv1.TenantDemand{Tenant: name, Requests: d.Requests, PromptTokens: d.PromptTokens,
			OutputTokens: d.OutputTokens, Admitted: d.Admitted, Refused: d.Refused})
	}
	return out
}

// applyGrants gives each tenant named its share of its budgets on this proxy.
func (s *Server) applyGrants(gs []*xdsv1.TenantGrant) {
	if !s.keys.Active() {
		return
	}
	tenants := s.keys.Table().Tenants()
	now := time.Now()
	for _, g := range gs {
		if t := tenants[g.GetTenant()]; t != nil && t.Limited() {
			t.SetShare(g.GetRequests(), g.GetPromptTokens(), g.GetOutputTokens(), now)
		}
	}
}
