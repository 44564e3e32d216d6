// Command bench-ebpf attaches kvrelay's eBPF probes from a process of its own, so that
// hack/bench-ebpf.sh can measure a proxy with the probes attached and detached without
// changing the proxy: it watches the --target endpoints and, once --pid-file holds a PID,
// that process's run queue; prints "attached" on stdout; and holds the probes until SIGINT or
// SIGTERM, when it prints each kvrelay_ebpf_* histogram's observation count and exits.
//
// With --dial the socket probes attach to a dial scope under --cgroup (ebpf.Config.DialScope)
// and the --pid-file process is moved into it as soon as the file names it, as `kvrelay proxy`
// moves itself once its listener is open (so write the file only then); "entered" on stdout
// says it is done.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/ebpf"
)

func main() {
	var targets stringList
	flag.Var(&targets, "target", "engine host:port to watch (repeat)")
	pidFile := flag.String("pid-file", "", "file that will hold the PID whose run-queue latency to watch")
	cgroup := flag.String("cgroup", "", "cgroup v2 directory the socket probes attach to (default: the hierarchy's root)")
	dial := flag.Bool("dial", false, "attach the socket probes to a dial scope under --cgroup and move the --pid-file process into it")
	only := flag.String("probes", "", "comma-separated probes to attach (default: all): "+strings.Join(ebpf.Probes, ","))
	flag.Parse()
	var sel []string
	if *only != "" {
		sel = strings.Split(*only, ",")
	}
	if err := run(targets, *pidFile, *cgroup, *dial, sel); err != nil {
		fmt.Fprintln(os.Stderr, "bench-ebpf:", err)
		os.Exit(1)
	}
}

func run(targets []string, pidFile, cgroup string, dial bool, sel []string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	c := ebpf.New(ebpf.Config{Mode: ebpf.ModeOn, CgroupPath: cgroup, DialScope: dial, Probes: sel, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err := c.Start(ctx); err != nil {
		return err
	}
	defer c.Close()
	var ts []ebpf.Target
	for i, t := range targets {
		ts = append(ts, ebpf.Target{Addr: t, Worker: "w" + strconv.Itoa(i), Pool: "agg"})
	}
	if err := c.SetTargets(ts); err != nil {
		return err
	}
	fmt.Println("attached")
	pidSet := pidFile == ""
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return report(c)
		case <-tick.C:
		}
		if pidSet {
			continue
		}
		if b, err := os.ReadFile(pidFile); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
				if err := c.SetProcesses([]ebpf.Process{{PID: pid, Worker: "proxy", Pool: "agg"}}); err != nil {
					return err
				}
				if dial {
					if err := c.EnterDialScope(pid); err != nil {
						return err
					}
					fmt.Println("entered", c.SocketCgroup())
				}
				pidSet = true
			}
		}
	}
}

func report(c *ebpf.Collector) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		return err
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if h := m.GetHistogram(); h != nil {
				fmt.Fprintf(os.Stderr, "%s_count %d sum %.6f\n", mf.GetName(), h.GetSampleCount(), h.GetSampleSum())
			}
		}
	}
	return nil
}

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }
