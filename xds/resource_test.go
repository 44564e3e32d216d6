package xds

import (
	"errors"
	"math"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

func TestTypeURLsMatchDescriptors(t *testing.T) {
	for _, m := range []proto.Message{&xdsv1.Worker{}, &xdsv1.Loads{}, &xdsv1.RoutingPolicy{}, &xdsv1.TenantKeys{}} {
		want := "type.googleapis.com/" + string(m.ProtoReflect().Descriptor().FullName())
		if got := TypeURL(m); got != want {
			t.Errorf("TypeURL(%T) = %q, want %q", m, got, want)
		}
		a, err := anypb.New(m)
		if err != nil {
			t.Fatal(err)
		}
		if a.GetTypeUrl() != want {
			t.Errorf("anypb type URL %q, want %q", a.GetTypeUrl(), want)
		}
	}
	if got := TypeURLs(); len(got) != 4 || got[0] != WorkerType || got[1] != LoadsType || got[2] != PolicyType || got[3] != KeysType {
		t.Errorf("TypeURLs() = %v", got)
	}
	if TypeURL(&xdsv1.LoadReport{}) != "" || ResourceName(&xdsv1.LoadReport{}) != "" {
		t.Error("a load report is not a resource")
	}
}

func TestResourceName(t *testing.T) {
	if got := ResourceName(NewWorker("w1", "http://127.0.0.1:8001", "m")); got != "w1" {
		t.Errorf("worker name %q", got)
	}
	if got := ResourceName(DefaultPolicy()); got != PolicyName {
		t.Errorf("policy name %q", got)
	}
}

func TestValidateWorker(t *testing.T) {
	valid := func() *xdsv1.Worker {
		w := NewWorker("w1", "http://127.0.0.1:8001", "Qwen/Qwen3-0.6B")
		w.BlockSize = 16
		w.Engine = "vllm"
		w.Load = &xdsv1.Load{Running: 3, KvUsage: 0.5}
		return w
	}
	long := strings.Repeat("a", MaxNameLen+1)
	cases := []struct {
		name   string
		mutate func(w *xdsv1.Worker)
		ok     bool
	}{
		{"valid", func(*xdsv1.Worker) {}, true},
		{"https with path", func(w *xdsv1.Worker) { w.Url = "https://engine.svc:443/v1" }, true},
		{"ipv6 host", func(w *xdsv1.Worker) { w.Url = "http://[::1]:8000" }, true},
		{"no port", func(w *xdsv1.Worker) { w.Url = "http://engine" }, true},
		{"unknown block size", func(w *xdsv1.Worker) { w.BlockSize = 0 }, true},
		{"no load", func(w *xdsv1.Worker) { w.Load = nil }, true},
		{"decode role", func(w *xdsv1.Worker) { w.Role = xdsv1.Role_ROLE_DECODE }, true},
		{"empty id", func(w *xdsv1.Worker) { w.Id = "" }, false},
		{"wildcard id", func(w *xdsv1.Worker) { w.Id = "*" }, false},
		{"id with space", func(w *xdsv1.Worker) { w.Id = "w 1" }, false},
		{"id with control", func(w *xdsv1.Worker) { w.Id = "w\x001" }, false},
		{"id invalid utf8", func(w *xdsv1.Worker) { w.Id = "w\xff" }, false},
		{"id too long", func(w *xdsv1.Worker) { w.Id = long }, false},
		{"empty url", func(w *xdsv1.Worker) { w.Url = "" }, false},
		{"unparsable url", func(w *xdsv1.Worker) { w.Url = "http://%zz" }, false},
		{"tcp scheme", func(w *xdsv1.Worker) { w.Url = "tcp://127.0.0.1:5557" }, false},
		{"no scheme", func(w *xdsv1.Worker) { w.Url = "127.0.0.1:8000" }, false},
		{"no host", func(w *xdsv1.Worker) { w.Url = "http:///v1" }, false},
		{"port zero", func(w *xdsv1.Worker) { w.Url = "http://127.0.0.1:0" }, false},
		{"port too big", func(w *xdsv1.Worker) { w.Url = "http://127.0.0.1:70000" }, false},
		{"empty port", func(w *xdsv1.Worker) { w.Url = "http://127.0.0.1:" }, false},
		{"query", func(w *xdsv1.Worker) { w.Url = "http://127.0.0.1:1?a=b" }, false},
		{"user", func(w *xdsv1.Worker) { w.Url = "http://u:p@127.0.0.1:1" }, false},
		{"url too long", func(w *xdsv1.Worker) { w.Url = "http://h/" + strings.Repeat("x", MaxURLLen) }, false},
		{"unknown role", func(w *xdsv1.Worker) { w.Role = 7 }, false},
		{"model with newline", func(w *xdsv1.Worker) { w.Model = "m\n" }, false},
		{"engine too long", func(w *xdsv1.Worker) { w.Engine = long }, false},
		{"huge block size", func(w *xdsv1.Worker) { w.BlockSize = MaxBlockSize + 1 }, false},
		{"huge slot", func(w *xdsv1.Worker) { w.Slot = MaxSlot }, false},
		{"kv usage NaN", func(w *xdsv1.Worker) { w.Load.KvUsage = math.NaN() }, false},
		{"kv usage above 1", func(w *xdsv1.Worker) { w.Load.KvUsage = 1.5 }, false},
		{"kv usage negative", func(w *xdsv1.Worker) { w.Load.KvUsage = -0.1 }, false},
		{"observed before epoch", func(w *xdsv1.Worker) { w.Load.ObservedUnixNano = -1 }, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := valid()
			tc.mutate(w)
			err := ValidateWorker(w)
			if (err == nil) != tc.ok {
				t.Fatalf("ValidateWorker = %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v does not wrap ErrInvalid", err)
			}
		})
	}
	if err := ValidateWorker(nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil worker: %v", err)
	}
}

func TestValidatePolicy(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(p *xdsv1.RoutingPolicy)
		ok     bool
	}{
		{"default", func(*xdsv1.RoutingPolicy) {}, true},
		{"zero means defaults", func(p *xdsv1.RoutingPolicy) { proto.Reset(p) }, true},
		{"sampling", func(p *xdsv1.RoutingPolicy) { p.Temperature = 0.7 }, true},
		{"canary", func(p *xdsv1.RoutingPolicy) {
			p.Candidate = &xdsv1.RoutingPolicy{Version: p.Version + 1, Policy: "round-robin"}
			p.CandidateShare = 0.25
		}, true},
		{"shadow", func(p *xdsv1.RoutingPolicy) {
			p.Candidate = &xdsv1.RoutingPolicy{Version: p.Version + 1, Policy: "kv"}
			p.Shadow = true
		}, true},
		{"share without a candidate", func(p *xdsv1.RoutingPolicy) { p.CandidateShare = 0.5 }, false},
		{"share above 1", func(p *xdsv1.RoutingPolicy) {
			p.Candidate = &xdsv1.RoutingPolicy{Version: p.Version + 1}
			p.CandidateShare = 1.5
		}, false},
		{"candidate of a candidate", func(p *xdsv1.RoutingPolicy) {
			p.Candidate = &xdsv1.RoutingPolicy{Version: p.Version + 1, Candidate: &xdsv1.RoutingPolicy{Version: p.Version + 2}}
		}, false},
		{"candidate of the same version", func(p *xdsv1.RoutingPolicy) { p.Candidate = &xdsv1.RoutingPolicy{Version: p.Version} }, false},
		{"candidate of version 0", func(p *xdsv1.RoutingPolicy) { p.Candidate = &xdsv1.RoutingPolicy{Version: 0, Policy: "kv"} }, false},
		{"invalid candidate", func(p *xdsv1.RoutingPolicy) {
			p.Candidate = &xdsv1.RoutingPolicy{Version: p.Version + 1, CacheThreshold: 2}
		}, false},
		{"two tiers", func(p *xdsv1.RoutingPolicy) { p.TierWeights = []float64{1, 0.5} }, true},
		{"busy thresholds", func(p *xdsv1.RoutingPolicy) { p.BusyKvFraction = 0.95; p.BusyPrefillTokens = 1 << 20 }, true},
		{"negative overlap weight", func(p *xdsv1.RoutingPolicy) { p.OverlapWeight = -1 }, false},
		{"infinite overlap weight", func(p *xdsv1.RoutingPolicy) { p.OverlapWeight = math.Inf(1) }, false},
		{"NaN temperature", func(p *xdsv1.RoutingPolicy) { p.Temperature = math.NaN() }, false},
		{"absurd temperature", func(p *xdsv1.RoutingPolicy) { p.Temperature = 1e9 }, false},
		{"threshold above 1", func(p *xdsv1.RoutingPolicy) { p.CacheThreshold = 1.01 }, false},
		{"busy kv fraction above 1", func(p *xdsv1.RoutingPolicy) { p.BusyKvFraction = 2 }, false},
		{"four tiers", func(p *xdsv1.RoutingPolicy) { p.TierWeights = []float64{1, 1, 1, 1} }, true},
		{"five tiers", func(p *xdsv1.RoutingPolicy) { p.TierWeights = []float64{1, 1, 1, 1, 1} }, false},
		{"negative tier weight", func(p *xdsv1.RoutingPolicy) { p.TierWeights[2] = -0.25 }, false},
		{"negative session ttl", func(p *xdsv1.RoutingPolicy) { p.SessionTtlMs = -1 }, false},
		{"year-long session ttl", func(p *xdsv1.RoutingPolicy) { p.SessionTtlMs = 365 * 24 * 3600 * 1000 }, false},
		{"policy name with space", func(p *xdsv1.RoutingPolicy) { p.Policy = "k v" }, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := DefaultPolicy()
			tc.mutate(p)
			err := ValidatePolicy(p)
			if (err == nil) != tc.ok {
				t.Fatalf("ValidatePolicy = %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v does not wrap ErrInvalid", err)
			}
		})
	}
	if err := ValidatePolicy(nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil policy: %v", err)
	}
}

func TestDecode(t *testing.T) {
	w := NewWorker("w1", "http://127.0.0.1:8001", "m")
	wa, _ := anypb.New(w)
	pa, _ := anypb.New(DefaultPolicy())
	t.Run("worker", func(t *testing.T) {
		got, err := DecodeWorker("w1", wa)
		if err != nil || !proto.Equal(got, w) {
			t.Fatalf("DecodeWorker = %v, %v", got, err)
		}
	})
	t.Run("policy", func(t *testing.T) {
		got, err := DecodePolicy(PolicyName, pa)
		if err != nil || !proto.Equal(got, DefaultPolicy()) {
			t.Fatalf("DecodePolicy = %v, %v", got, err)
		}
	})
	bad := []struct {
		name string
		fn   func() error
	}{
		{"worker under another name", func() error { _, err := DecodeWorker("w2", wa); return err }},
		{"policy body as worker", func() error { _, err := DecodeWorker("w1", pa); return err }},
		{"nil body", func() error { _, err := DecodeWorker("w1", nil); return err }},
		{"garbage bytes", func() error {
			_, err := DecodeWorker("w1", &anypb.Any{TypeUrl: WorkerType, Value: []byte{0xff, 0xff, 0xff}})
			return err
		}},
		{"policy under another name", func() error { _, err := DecodePolicy("canary", pa); return err }},
		{"worker body as policy", func() error { _, err := DecodePolicy(PolicyName, wa); return err }},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.fn(); !errors.Is(err, ErrInvalid) {
				t.Fatalf("got %v, want ErrInvalid", err)
			}
		})
	}
}

func TestRoles(t *testing.T) {
	for _, name := range []string{"both", "prefill", "decode"} {
		r, err := ParseRole(name)
		if err != nil || RoleName(r) != name {
			t.Errorf("ParseRole(%q) = %v, %v", name, r, err)
		}
	}
	if r, err := ParseRole(""); err != nil || r != xdsv1.Role_ROLE_BOTH {
		t.Errorf("empty role: %v, %v", r, err)
	}
	if r, err := ParseRole("ROLE_DECODE"); err != nil || r != xdsv1.Role_ROLE_DECODE {
		t.Errorf("enum name: %v, %v", r, err)
	}
	if _, err := ParseRole("router"); err == nil {
		t.Error("ParseRole accepted an unknown role")
	}
	if got := RoleName(9); got != "role(9)" {
		t.Errorf("RoleName(9) = %q", got)
	}
}

// DecodeKeys takes the one keys resource under its name and within MaxKeysLen, and refuses
// another name, another type or a body too large.
func TestDecodeKeys(t *testing.T) {
	ok, _ := anypb.New(&xdsv1.TenantKeys{Keys: "sha256:ab tenant=a\n"})
	if k, err := DecodeKeys(KeysName, ok); err != nil || k.GetKeys() != "sha256:ab tenant=a\n" {
		t.Fatalf("DecodeKeys: %v %v", k, err)
	}
	big, _ := anypb.New(&xdsv1.TenantKeys{Keys: strings.Repeat("x", MaxKeysLen+1)})
	other, _ := anypb.New(&xdsv1.RoutingPolicy{})
	for name, c := range map[string]struct {
		name string
		res  *anypb.Any
	}{"another name": {"other", ok}, "too large": {KeysName, big}, "another type": {KeysName, other}, "no body": {KeysName, nil}} {
		if _, err := DecodeKeys(c.name, c.res); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	if ResourceName(&xdsv1.TenantKeys{}) != KeysName {
		t.Error("the keys resource's name")
	}
}
