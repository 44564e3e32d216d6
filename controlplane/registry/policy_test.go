package registry

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/policy"
)

func xdsPolicy(p Policy) *xdsv1.RoutingPolicy {
	return &xdsv1.RoutingPolicy{
		Version: p.Version, Policy: p.Name, OverlapWeight: p.OverlapWeight, QueueWeight: p.QueueWeight, Temperature: p.Temperature,
		CacheThreshold: p.CacheThreshold, TierWeights: p.TierWeights, BusyPrefillTokens: p.BusyPrefillTokens,
		BusyDecodeBlocks: p.BusyDecodeBlocks, BusyKvFraction: p.BusyKVFraction,
		SessionTtlMs: p.SessionTTL.Milliseconds(), Disagg: p.Disagg, DisaggThreshold: p.DisaggThreshold,
	}
}

func TestDefaultPolicy(t *testing.T) {
	p := DefaultPolicy()
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
	if p.Version != 1 || p.Name != policy.Default || p.SessionTTL != 30*time.Minute || p.CacheThreshold != policy.DefaultCacheThreshold {
		t.Fatalf("DefaultPolicy() = %+v", p)
	}
	// The same defaults as the xDS resource a control plane serves without a store.
	x, d := xdsPolicy(p), xds.DefaultPolicy()
	if x.String() != d.String() {
		t.Fatalf("DefaultPolicy() as xDS = %v, xds.DefaultPolicy() = %v", x, d)
	}
}

func TestPolicyValidate(t *testing.T) {
	tests := []struct {
		name    string
		edit    func(*Policy)
		wantErr string
	}{
		{name: "default", edit: func(*Policy) {}},
		{name: "every name", edit: func(p *Policy) { p.Name = PolicyPowerOfTwo }},
		{name: "no tier weights", edit: func(p *Policy) { p.TierWeights = nil }},
		{name: "thresholds", edit: func(p *Policy) { p.BusyPrefillTokens, p.BusyDecodeBlocks, p.BusyKVFraction = 8192, 4096, 0.9 }},
		{name: "unknown name", edit: func(p *Policy) { p.Name = "fastest" }, wantErr: `name "fastest"`},
		{name: "empty name", edit: func(p *Policy) { p.Name = "" }, wantErr: "name"},
		{name: "negative overlap", edit: func(p *Policy) { p.OverlapWeight = -1 }, wantErr: "overlap weight"},
		{name: "NaN overlap", edit: func(p *Policy) { p.OverlapWeight = math.NaN() }, wantErr: "overlap weight"},
		{name: "infinite temperature", edit: func(p *Policy) { p.Temperature = math.Inf(1) }, wantErr: "temperature"},
		{name: "negative temperature", edit: func(p *Policy) { p.Temperature = -0.5 }, wantErr: "temperature"},
		{name: "threshold above 1", edit: func(p *Policy) { p.CacheThreshold = 1.5 }, wantErr: "cache threshold"},
		{name: "kv fraction below 0", edit: func(p *Policy) { p.BusyKVFraction = -0.1 }, wantErr: "busy kv fraction"},
		{name: "five tiers", edit: func(p *Policy) { p.TierWeights = []float64{1, 1, 1, 1, 1} }, wantErr: "5 tier weights"},
		{name: "tier above 1", edit: func(p *Policy) { p.TierWeights = []float64{1, 2} }, wantErr: "tier weight 1"},
		{name: "negative ttl", edit: func(p *Policy) { p.SessionTTL = -time.Second }, wantErr: "session ttl"},
		{name: "ttl over a week", edit: func(p *Policy) { p.SessionTTL = 8 * 24 * time.Hour }, wantErr: "session ttl"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := DefaultPolicy()
			tt.edit(&p)
			err := p.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if err := xds.ValidatePolicy(xdsPolicy(p)); err != nil {
					t.Fatalf("a proxy refuses a valid policy: %v", err)
				}
				return
			}
			if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Validate() = %v, want ErrInvalid mentioning %q", err, tt.wantErr)
			}
		})
	}
}

func TestNextPolicy(t *testing.T) {
	cur := DefaultPolicy()
	p := cur
	p.Temperature = 0.5
	next, err := nextPolicy(cur, p)
	if err != nil || next.Version != 2 || next.Temperature != 0.5 {
		t.Fatalf("nextPolicy = %+v, %v; want version 2", next, err)
	}
	next.TierWeights[0] = 0
	if cur.TierWeights[0] != 1 {
		t.Fatal("nextPolicy shares TierWeights with its argument")
	}
	p.Version = 0
	if next, err := nextPolicy(cur, p); err != nil || next.Version != 2 {
		t.Fatalf("nextPolicy without a version = %+v, %v", next, err)
	}
	p.Version = 7
	if _, err := nextPolicy(cur, p); !errors.Is(err, ErrVersionConflict) {
		t.Fatalf("nextPolicy from a stale version: %v, want ErrVersionConflict", err)
	}
}
