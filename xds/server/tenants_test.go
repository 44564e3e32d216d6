package server

import (
	"math"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

func grantOf(gs []*xdsv1.TenantGrant, tenant string) *xdsv1.TenantGrant {
	for _, g := range gs {
		if g.GetTenant() == tenant {
			return g
		}
	}
	return nil
}

// A tenant's budgets divide among the proxies in proportion to what each is asked, every
// proxy keeping a floor, the shares adding up to 1, and other replicas' proxies counted.
func TestTenantGrants(t *testing.T) {
	s := New(Options{})
	now := time.Unix(1000, 0)
	s.load.now = func() time.Time { return now }
	report := func(node string, stream uint64, ts ...*xdsv1.TenantDemand) map[string]TenantDemand {
		r := &xdsv1.LoadReport{NodeId: node, Seq: 1, Tenants: ts}
		s.load.put(node, stream, r)
		return tenantsOf(r)
	}
	a := report("a", 1, &xdsv1.TenantDemand{Tenant: "t", Requests: 30, PromptTokens: 3000, OutputTokens: 0})
	b := report("b", 2, &xdsv1.TenantDemand{Tenant: "t", Requests: 10, PromptTokens: 1000},
		&xdsv1.TenantDemand{Tenant: "u", Requests: 5})
	now = now.Add(time.Second) // past the sums' interval
	ga, gb := grantOf(s.grants("a", a), "t"), grantOf(s.grants("b", b), "t")
	if ga == nil || gb == nil {
		t.Fatal("no grant for tenant t")
	}
	if sum := ga.GetRequests() + gb.GetRequests(); math.Abs(sum-1) > 1e-9 {
		t.Fatalf("shares of requests %v + %v = %v, want 1", ga.GetRequests(), gb.GetRequests(), sum)
	}
	if r := ga.GetRequests() / gb.GetRequests(); r < 2.5 || r > 3 {
		t.Fatalf("asked 3:1, shares %v and %v (×%.2f)", ga.GetRequests(), gb.GetRequests(), r)
	}
	if ga.GetProxies() != 2 {
		t.Fatalf("divided among %d proxies, want 2", ga.GetProxies())
	}
	// Nobody asked for output tokens: equal parts.
	if ga.GetOutputTokens() != 0.5 || gb.GetOutputTokens() != 0.5 {
		t.Fatalf("output shares %v and %v when nobody asks, want 0.5 each", ga.GetOutputTokens(), gb.GetOutputTokens())
	}
	// A tenant only one proxy serves is that proxy's whole.
	if u := grantOf(s.grants("b", b), "u"); u.GetRequests() != 1 || u.GetProxies() != 1 {
		t.Fatalf("tenant u on one proxy: %+v", u)
	}
	// A proxy not asked yet keeps a floor.
	c := report("c", 3, &xdsv1.TenantDemand{Tenant: "t"})
	now = now.Add(time.Second)
	gc := grantOf(s.grants("c", c), "t")
	if gc.GetRequests() <= 0 || gc.GetRequests() > 0.02 {
		t.Fatalf("an idle proxy's share %v, want a small floor above 0", gc.GetRequests())
	}
	// Another replica's proxy asked as much as a and b together: a's share halves.
	s.SetRemoteTenants(map[string]map[string]TenantDemand{"d": {"t": {Requests: 40}},
		"a": {"t": {Requests: 1000}}}) // a connected here counts with its own report
	now = now.Add(time.Second)
	ga2 := grantOf(s.grants("a", a), "t")
	if r := ga2.GetRequests() / ga.GetRequests(); r < 0.45 || r > 0.55 || ga2.GetProxies() != 4 {
		t.Fatalf("with a remote proxy asked 40: a's share %v (was %v), among %d proxies", ga2.GetRequests(), ga.GetRequests(), ga2.GetProxies())
	}
	tot := s.TenantTotals()["t"]
	if tot.Proxies != 4 || tot.Requests != 80 {
		t.Fatalf("totals %+v, want 4 proxies asked 80 requests/s", tot)
	}
	// A later report without tenants keeps the node's last ones; the stream's end drops them.
	s.load.put("a", 1, &xdsv1.LoadReport{NodeId: "a", Seq: 2})
	if _, ok := s.NodeTenants()["a"]; !ok {
		t.Fatal("a report without tenants dropped the node's")
	}
	s.load.drop("a", 1)
	if _, ok := s.NodeTenants()["a"]; ok {
		t.Fatal("a closed stream's tenants kept")
	}
}

// FuzzTenantsOf: any decoded report's tenants are kept only whole (named, bounded, finite,
// not negative, at most MaxReportTenants), and their grants are shares in (0, 1].
func FuzzTenantsOf(f *testing.F) {
	ok, _ := proto.Marshal(&xdsv1.LoadReport{NodeId: "a", Tenants: []*xdsv1.TenantDemand{{Tenant: "t", Requests: 3, PromptTokens: 10}}})
	f.Add(ok)
	bad, _ := proto.Marshal(&xdsv1.LoadReport{NodeId: "a", Tenants: []*xdsv1.TenantDemand{{Tenant: "", Requests: 1}, {Tenant: "x", Requests: math.NaN()},
		{Tenant: "y", PromptTokens: -1}, {Tenant: "z", OutputTokens: math.Inf(1)}, {Tenant: "big", Requests: math.MaxFloat64}}})
	f.Add(bad)
	f.Fuzz(func(t *testing.T, raw []byte) {
		var r xdsv1.LoadReport
		if proto.Unmarshal(raw, &r) != nil {
			return
		}
		ts := tenantsOf(&r)
		if len(ts) > MaxReportTenants {
			t.Fatalf("%d tenants kept", len(ts))
		}
		for name, d := range ts {
			if name == "" || len(name) > maxSampleString || !finite(d.Requests, d.PromptTokens, d.OutputTokens) || d.Requests < 0 || d.PromptTokens < 0 || d.OutputTokens < 0 {
				t.Fatalf("tenant %q %+v kept", name, d)
			}
		}
		s := New(Options{})
		s.load.put("a", 1, &r)
		s.load.put("b", 2, &r)
		for _, g := range s.grants("a", ts) {
			for _, v := range []float64{g.GetRequests(), g.GetPromptTokens(), g.GetOutputTokens()} {
				if !(v > 0 && v <= 1) {
					t.Fatalf("grant %+v", g)
				}
			}
		}
	})
}
