package main

import (
	"context"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/ebpf"
)

const ebpfFlagHelp = "eBPF probes (connection RTT and lifecycle, first byte, accept queues, run queues; kvrelay_ebpf_* on /metrics): auto (attach when privileged), on or off"

// addEBPFFlag registers --ebpf.
func addEBPFFlag(fs *pflag.FlagSet, v *string) {
	fs.StringVar(v, "ebpf", string(ebpf.ModeAuto), ebpfFlagHelp)
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
func startEBPF(ctx context.Context, mode string, targets func() []ebpf.Target, procs []ebpf.Process) (*ebpf.Collector, error) {
	m, err := ebpf.ParseMode(mode)
	if err != nil {
		return nil, err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	c := ebpf.New(ebpf.Config{Mode: m, Logger: log})
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
func startUpEBPF(ctx context.Context, mode string, ws []upWorker, deployMode string) (*ebpf.Collector, error) {
	targets := make([]ebpf.Target, 0, len(ws))
	for _, w := range ws {
		targets = append(targets, ebpf.Target{Addr: w.w.URL(), Worker: w.id, Pool: ebpfPool(string(w.role))})
	}
	pool := "agg"
	if deployMode == upModeDisagg {
		pool = "mixed"
	}
	return startEBPF(ctx, mode, func() []ebpf.Target { return targets },
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
