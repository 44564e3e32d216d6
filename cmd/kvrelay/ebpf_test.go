package main

import (
	"context"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/ebpf"
)

func TestEBPFPool(t *testing.T) {
	for _, tc := range []struct{ role, want string }{
		{"prefill", "prefill"}, {"decode", "decode"}, {"both", "agg"}, {"", "agg"},
	} {
		if got := ebpfPool(tc.role); got != tc.want {
			t.Errorf("ebpfPool(%q) = %q, want %q", tc.role, got, tc.want)
		}
	}
	for r, want := range map[route.Role]string{route.RolePrefill: "prefill", route.RoleDecode: "decode", route.RoleBoth: "agg"} {
		if got := routeRolePool(r); got != want {
			t.Errorf("routeRolePool(%v) = %q, want %q", r, got, want)
		}
	}
}

func TestStartEBPF(t *testing.T) {
	if _, err := startEBPF(context.Background(), ebpfFlags{mode: "maybe"}, func() []ebpf.Target { return nil }, nil); err == nil {
		t.Error("--ebpf maybe accepted")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c, err := startEBPF(ctx, ebpfFlags{mode: "off", cgroup: ebpfCgroupDial}, func() []ebpf.Target { return []ebpf.Target{{Addr: "127.0.0.1:1", Worker: "w0", Pool: "agg"}} }, nil)
	if err != nil {
		t.Fatal(err)
	}
	for p, on := range c.Active() {
		if on {
			t.Errorf("--ebpf off: probe %s active", p)
		}
	}
}

func TestEBPFFlagsConfig(t *testing.T) {
	for _, tc := range []struct {
		f    ebpfFlags
		dial bool
		path string
		err  bool
	}{
		{ebpfFlags{mode: "on", cgroup: "dial"}, true, "", false},
		{ebpfFlags{mode: "auto", cgroup: "own"}, false, "", false},
		{ebpfFlags{mode: "on", cgroup: "/sys/fs/cgroup/kvrelay"}, false, "/sys/fs/cgroup/kvrelay", false},
		{ebpfFlags{mode: "on", cgroup: "kvrelay"}, false, "", true},
		{ebpfFlags{mode: "sometimes", cgroup: "dial"}, false, "", true},
	} {
		cfg, err := tc.f.config()
		if (err != nil) != tc.err || err == nil && (cfg.DialScope != tc.dial || cfg.CgroupPath != tc.path) {
			t.Errorf("%+v: config %+v, %v", tc.f, cfg, err)
		}
	}
}
