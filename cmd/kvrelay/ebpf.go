package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/ebpf"
)

const ebpfFlagHelp = "eBPF probes (connection RTT and lifecycle, first byte, accept queues, run queues; kvrelay_ebpf_* on /metrics): auto (attach when privileged), on or off"

// ebpfFlags are --ebpf and --ebpf-cgroup.
type ebpfFlags struct {
	mode   string
	cgroup string
}

const (
	ebpfCgroupDial = "dial" // a cgroup of the probes' own that the process enters once its listeners are open
	ebpfCgroupOwn  = "own"  // the process's own cgroup
)

// addEBPFFlags registers --ebpf and --ebpf-cgroup (default cgroup: dial or own).
func addEBPFFlags(fs *pflag.FlagSet, v *ebpfFlags, cgroup string) {
	fs.StringVar(&v.mode, "ebpf", string(ebpf.ModeAuto), ebpfFlagHelp)
	fs.StringVar(&v.cgroup, "ebpf-cgroup", cgroup, "where the socket probes (tcp_rtt, first_byte) run: dial (only on the connections this process opens to engines: it moves into a child cgroup of its own once its listeners are open, so client connections never pass through them), own (every socket of this process's cgroup) or a cgroup v2 directory")
}

// config is the collector's configuration for these flags.
func (f ebpfFlags) config() (ebpf.Config, error) {
	m, err := ebpf.ParseMode(f.mode)
	if err != nil {
		return ebpf.Config{}, err
	}
	cfg := ebpf.Config{Mode: m}
	switch f.cgroup {
	case ebpfCgroupDial:
		cfg.DialScope = true
	case ebpfCgroupOwn, "":
	default:
		if !filepath.IsAbs(f.cgroup) {
			return ebpf.Config{}, fmt.Errorf("--ebpf-cgroup must be dial, own or an absolute cgroup v2 directory, got %q", f.cgroup)
		}
		cfg.CgroupPath = f.cgroup
	}
	return cfg, nil
}

// ebpfPool is the pool label of a worker role: prefill, decode, or agg for a worker that does
// both phases.
func ebpfPool(role string) string {
	switch role {
	case "prefill", "decode":
		return role
	}
	return "agg"
}

// startEBPF attaches the probes per mode, keeps their targets following targets() (read now
// and every 2s) and detaches them when ctx ends. The caller registers the returned collector
// on a /metrics registry (with --ebpf off too, so kvrelay_ebpf_probe_active says they are
// off). Probes that cannot attach are logged and left inactive; only --ebpf on with none
// attached is an error.
//
// With --ebpf-cgroup dial the process still has to enter the dial scope once its listeners
// are open (ebpf.Collector.EnterDialScope).
func startEBPF(ctx context.Context, f ebpfFlags, targets func() []ebpf.Target, procs []ebpf.Process) (*ebpf.Collector, error) {
	cfg, err := f.config()
	if err != nil {
		return nil, err
	}
	m := cfg.Mode
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	cfg.Logger = log
	c := ebpf.New(cfg)
	if err := c.Start(ctx); err != nil {
		_ = c.Close()
		return nil, err
	}
	if err := c.SetProcesses(procs); err != nil {
		log.Warn("ebpf: watching processes", "err", err)
	}
	if err := c.SetTargets(targets()); err != nil {
		log.Warn("ebpf: watching workers", "err", err)
	}
	go func() {
		defer c.Close()
		if m == ebpf.ModeOff {
			<-ctx.Done()
			return
		}
		t := time.NewTicker(2 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				_ = c.SetTargets(targets())
			}
		}
	}()
	return c, nil
}

// startUpEBPF starts the probes of `kvrelay up` on its workers; up starts it before the
// control plane and the proxy so that the probes see their connections from the first SYN
// (sock_ops only follows connections it saw established), and registers it on the proxy's
// /metrics. The workers are goroutines of this process, so the run-queue latency is the whole
// process's (worker "up"; pool agg, or mixed with a prefill and a decode pool): attributing it
// per worker needs the workers in separate processes (kvrelay sim; their PIDs go to
// ebpf.Collector.SetProcesses).
func startUpEBPF(ctx context.Context, f ebpfFlags, ws []upWorker, deployMode string) (*ebpf.Collector, error) {
	targets := make([]ebpf.Target, 0, len(ws))
	for _, w := range ws {
		targets = append(targets, ebpf.Target{Addr: w.w.URL(), Worker: w.id, Pool: ebpfPool(string(w.role))})
	}
	pool := "agg"
	if deployMode == upModeDisagg {
		pool = "mixed"
	}
	return startEBPF(ctx, f, func() []ebpf.Target { return targets },
		[]ebpf.Process{{PID: os.Getpid(), Worker: "up", Pool: pool}})
}

// proxyEBPFTargets are the proxy's current workers (static, or from the control plane).
func proxyEBPFTargets(p *proxy.Server) func() []ebpf.Target {
	return func() []ebpf.Target {
		ws := p.Workers()
		out := make([]ebpf.Target, 0, len(ws))
		for _, w := range ws {
			out = append(out, ebpf.Target{Addr: w.Addr, Worker: w.ID, Pool: routeRolePool(w.Role)})
		}
		return out
	}
}

func routeRolePool(r route.Role) string {
	switch r {
	case route.RolePrefill:
		return "prefill"
	case route.RoleDecode:
		return "decode"
	}
	return "agg"
}

// registryEBPFTargets are the control plane's registered workers.
func registryEBPFTargets(r *registry.Registry) func() []ebpf.Target {
	return func() []ebpf.Target {
		ws := r.Workers()
		out := make([]ebpf.Target, 0, len(ws))
		for _, w := range ws {
			out = append(out, ebpf.Target{Addr: w.URL, Worker: w.ID, Pool: ebpfPool(w.Role)})
		}
		return out
	}
}
