package ebpf

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/ebpf/gpu"
	"github.com/kvrelay/kvrelay/ebpf/probes"
)

// Mode says whether to attach the probes.
type Mode string

const (
	// ModeAuto attaches the probes when the process is privileged (root, or CAP_BPF with
	// CAP_PERFMON), and stays off quietly otherwise.
	ModeAuto Mode = "auto"
	// ModeOn attaches them and fails Start when none attaches.
	ModeOn Mode = "on"
	// ModeOff attaches nothing.
	ModeOff Mode = "off"
)

// ParseMode reads a --ebpf value.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(strings.ToLower(s)); m {
	case ModeAuto, ModeOn, ModeOff:
		return m, nil
	}
	return "", fmt.Errorf("--ebpf must be auto, on or off, got %q", s)
}

// The probes, as kvrelay_ebpf_probe_active names them.
const (
	ProbeTCPRTT      = "tcp_rtt"      // sock_ops: smoothed RTT, retransmits
	ProbeTCPState    = "tcp_state"    // tp_btf/inet_sock_set_state: connect latency, resets
	ProbeFirstByte   = "first_byte"   // cgroup_skb: request-to-first-byte
	ProbeListenQueue = "listen_queue" // iter/tcp: accept queue depth
	ProbeRunQueue    = "runq_latency" // tp_btf/sched_*: run-queue latency
)

// Probes lists every probe name.
var Probes = []string{ProbeTCPRTT, ProbeTCPState, ProbeFirstByte, ProbeListenQueue, ProbeRunQueue}

// Target is an engine endpoint and who it is.
type Target struct {
	// Addr is the engine's host:port (an IPv4 address or a name resolving to one) or URL.
	Addr   string
	Worker string
	// Pool is the worker's role: prefill, decode or agg.
	Pool string
}

// Process is an engine process and who it is.
type Process struct {
	PID    int
	Worker string
	Pool   string
}

// Config configures a Collector.
type Config struct {
	Mode Mode
	// CgroupPath is the cgroup v2 the socket probes attach to; they see the sockets of every
	// process below it. Default: this process's own cgroup (a proxy's container or service:
	// the probes then run only on its packets), which is the hierarchy's root where
	// processes are not put in cgroups of their own.
	CgroupPath string
	// DialScope attaches the socket probes (tcp_rtt, first_byte) to a child of CgroupPath
	// made for them, kvrelay-dial.PID, rather than to CgroupPath itself, so that they run
	// only on the connections a process dials once EnterDialScope has moved it there, and
	// not on those it accepts from listeners it opened before (dialscope.go). Where the
	// child cannot be made, they attach to CgroupPath (logged).
	DialScope bool
	// Probes selects the probes to attach by name (ProbeTCPRTT, …); nil attaches all. The
	// tcp_rtt and tcp_state probes share one object: selecting either loads it.
	Probes []string
	// SampleInterval is how often the accept queues and the first-byte histograms are
	// sampled (default 250ms).
	SampleInterval time.Duration
	// FirstByteWindow is how far back the recent first-byte latency of each worker looks
	// (FirstByteWaiting, kvrelay_ebpf_first_byte_recent_seconds; default 2s).
	FirstByteWindow time.Duration
	Logger          *slog.Logger
}

type attribution struct{ worker, pool string }

// Collector owns the attached probes and exports what they measure. Construct it with New
// (no side effects), Start it once, Close it when done (also after a failed Start). Its
// methods are safe for concurrent use; Collect is called by the Prometheus registry.
type Collector struct {
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	targets map[netip.AddrPort]attribution
	procs   map[uint32]attribution
	errs    map[string]error // why a probe is inactive; absent: active
	tcp     *probes.TCPConn
	fb      *probes.FirstByte
	lq      *probes.ListenQ
	rq      *probes.RunQLat
	dial    *dialScope // nil: the socket probes are on sockCg itself
	sockCg  string     // the cgroup the socket probes attach to
	queue   map[netip.AddrPort]queueSample
	fbw     fbWindow
	gpu     gpu.Collector // nil without NVML (no nvml build tag, or no driver)

	stop chan struct{}
	wg   sync.WaitGroup

	descActive, descSRTT, descConnect, descRetrans, descResets, descFirstByte, descRunQ *prometheus.Desc
	descQueueLen, descQueueMax, descFBRecent, descFBWaiting                             *prometheus.Desc
	queueDepth                                                                          *prometheus.HistogramVec
}

type queueSample struct{ depth, max uint32 }

// New returns a collector that has attached nothing yet.
func New(cfg Config) *Collector {
	if cfg.Mode == "" {
		cfg.Mode = ModeAuto
	}
	if cfg.SampleInterval <= 0 {
		cfg.SampleInterval = 250 * time.Millisecond
	}
	if cfg.FirstByteWindow <= 0 {
		cfg.FirstByteWindow = 2 * time.Second
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	wp := []string{"worker", "pool"}
	c := &Collector{
		cfg: cfg, log: log,
		targets: map[netip.AddrPort]attribution{},
		procs:   map[uint32]attribution{},
		errs:    map[string]error{},
		queue:   map[netip.AddrPort]queueSample{},
		fbw:     fbWindow{span: cfg.FirstByteWindow},
		stop:    make(chan struct{}),
		descActive: prometheus.NewDesc("kvrelay_ebpf_probe_active",
			"1 when the eBPF probe is loaded and attached, 0 when it is off or could not attach.", []string{"probe"}, nil),
		descSRTT: prometheus.NewDesc("kvrelay_ebpf_tcp_srtt_seconds",
			"Smoothed RTT samples of the connections to the worker (sock_ops RTT callback).", wp, nil),
		descConnect: prometheus.NewDesc("kvrelay_ebpf_tcp_connect_seconds",
			"TCP connect latency to the worker, SYN sent to established (inet_sock_set_state).", wp, nil),
		descRetrans: prometheus.NewDesc("kvrelay_ebpf_tcp_retransmits_total",
			"TCP retransmits on connections to the worker (sock_ops).", wp, nil),
		descResets: prometheus.NewDesc("kvrelay_ebpf_tcp_resets_total",
			"Connections to the worker aborted: a reset sent or received, or a refused connect (inet_sock_set_state).", wp, nil),
		descFirstByte: prometheus.NewDesc("kvrelay_ebpf_first_byte_seconds",
			"Kernel-side time from a request's last byte sent to the worker to the first byte of its answer (cgroup_skb).", wp, nil),
		descRunQ: prometheus.NewDesc("kvrelay_ebpf_runq_latency_seconds",
			"Run-queue latency of the worker's process threads, wakeup to on-CPU (sched_wakeup/sched_switch). Workers sharing a process share it.", wp, nil),
		descQueueLen: prometheus.NewDesc("kvrelay_ebpf_listen_queue_length",
			"Connections waiting in the accept queue of the worker's listener at the last sample (iter/tcp).", wp, nil),
		descQueueMax: prometheus.NewDesc("kvrelay_ebpf_listen_queue_limit",
			"The accept queue limit of the worker's listener.", wp, nil),
		descFBRecent: prometheus.NewDesc("kvrelay_ebpf_first_byte_recent_seconds",
			"The worker's kernel-side first-byte latency over the last window (the mean of its answers, clamped to their median's log2 bucket); absent when it answered nothing in the window.", wp, nil),
		descFBWaiting: prometheus.NewDesc("kvrelay_ebpf_first_byte_waiting",
			"Requests the worker's recent first-byte latency implies waiting: its latency over the fastest worker's of the same pool, minus one, rounded down (the load signal).", wp, nil),
		queueDepth: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvrelay_ebpf_listen_queue_depth",
			Help:    "Sampled accept queue depth of the worker's listener (one observation per sample).",
			Buckets: []float64{0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096},
		}, wp),
	}
	for _, p := range Probes {
		c.errs[p] = errors.New("not started")
	}
	return c
}

// Privileged says whether this process may load tracing and socket programs: root, or the
// effective capabilities CAP_SYS_ADMIN, or CAP_BPF with CAP_PERFMON and CAP_NET_ADMIN.
func Privileged() bool {
	if os.Geteuid() == 0 {
		return true
	}
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return false
			}
			has := func(bit uint) bool { return caps&(1<<bit) != 0 }
			const capNetAdmin, capSysAdmin, capPerfmon, capBPF = 12, 21, 38, 39
			return has(capSysAdmin) || has(capBPF) && has(capPerfmon) && has(capNetAdmin)
		}
	}
	return false
}

// Start attaches the probes (per Mode) and starts sampling the accept queues until ctx ends
// or Close. Each probe that fails is logged once and marked inactive. It returns an error
// only in ModeOn when no probe attached. It also opens NVML for the GPU metrics (whatever the
// mode: they need no privileges) when the build has the nvml tag and the host a driver.
// Register the collector after Start: Describe lists the GPU metrics only once NVML is open.
func (c *Collector) Start(ctx context.Context) error {
	if g, err := gpu.Open(); err != nil {
		c.log.Debug("ebpf: no GPU metrics", "err", err)
	} else {
		c.mu.Lock()
		c.gpu = g
		c.mu.Unlock()
	}
	switch c.cfg.Mode {
	case ModeOff:
		c.setAll(errors.New("--ebpf off"))
		return nil
	case ModeAuto:
		if !Privileged() {
			c.setAll(errors.New("not privileged"))
			c.log.Info("ebpf: probes off: not privileged (run as root or with CAP_BPF+CAP_PERFMON+CAP_NET_ADMIN, or --ebpf off)")
			return nil
		}
	}
	cg := c.cfg.CgroupPath
	var cgErr error
	if cg == "" {
		cg, cgErr = probes.OwnCgroupV2()
	}
	want := func(names ...string) bool {
		if c.cfg.Probes == nil {
			return true
		}
		for _, n := range names {
			if slices.Contains(c.cfg.Probes, n) {
				return true
			}
		}
		return false
	}
	var dial *dialScope
	if c.cfg.DialScope && cgErr == nil && want(ProbeTCPRTT, ProbeTCPState, ProbeFirstByte) {
		if d, err := newDialScope(cg); err != nil {
			c.log.Info("ebpf: socket probes on the process's cgroup, client connections included (no cgroup of their own)", "err", err)
		} else {
			dial, cg = d, d.dir
		}
	}
	c.mu.Lock()
	c.dial, c.sockCg = dial, cg
	unselected := errors.New("not selected")
	switch {
	case !want(ProbeTCPRTT, ProbeTCPState):
		c.errs[ProbeTCPRTT], c.errs[ProbeTCPState] = unselected, unselected
	case cgErr != nil:
		c.errs[ProbeTCPRTT], c.errs[ProbeTCPState] = cgErr, cgErr
	default:
		if p, err := probes.AttachTCPConn(cg); err != nil {
			c.errs[ProbeTCPRTT], c.errs[ProbeTCPState] = err, err
		} else {
			c.tcp = p
			c.errs[ProbeTCPRTT], c.errs[ProbeTCPState] = p.SockOpsErr, p.SetStateErr
			if p.ArmErr != nil { // (set only where sock_ops attached)
				c.log.Info("ebpf: tcp_rtt records one RTT callback in eight (its callback cannot be re-armed per collection here)", "err", p.ArmErr)
			}
		}
	}
	switch {
	case !want(ProbeFirstByte):
		c.errs[ProbeFirstByte] = unselected
	case cgErr != nil:
		c.errs[ProbeFirstByte] = cgErr
	default:
		if p, err := probes.AttachFirstByte(cg); err != nil {
			c.errs[ProbeFirstByte] = err
		} else {
			c.fb = p
			c.errs[ProbeFirstByte] = nil
		}
	}
	if !want(ProbeListenQueue) {
		c.errs[ProbeListenQueue] = unselected
	} else if p, err := probes.AttachListenQ(); err != nil {
		c.errs[ProbeListenQueue] = err
	} else {
		c.lq = p
		c.errs[ProbeListenQueue] = nil
	}
	if !want(ProbeRunQueue) {
		c.errs[ProbeRunQueue] = unselected
	} else if p, err := probes.AttachRunQLat(); err != nil {
		c.errs[ProbeRunQueue] = err
	} else {
		c.rq = p
		c.errs[ProbeRunQueue] = nil
	}
	if c.dial != nil && (c.tcp == nil || !c.tcp.SockOps()) && c.fb == nil {
		c.dropDialLocked() // no socket probe attached to the scope: nothing to enter it for
	}
	active := 0
	for _, name := range Probes {
		if err := c.errs[name]; err == unselected {
			continue
		} else if err != nil {
			c.log.Warn("ebpf: probe inactive", "probe", name, "err", err)
		} else {
			active++
		}
	}
	err := c.pushLocked()
	c.mu.Unlock()
	if err != nil {
		c.log.Warn("ebpf: setting watched endpoints", "err", err)
	}
	if active == 0 && c.cfg.Mode == ModeOn {
		return errors.New("ebpf: --ebpf on but no probe attached (see the warnings above)")
	}
	c.log.Info("ebpf: probes attached", "active", active, "of", len(Probes), "cgroup", c.SocketCgroup())
	if c.lq != nil || c.fb != nil {
		c.wg.Add(1)
		go c.sample(ctx)
	}
	return nil
}

func (c *Collector) setAll(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range Probes {
		c.errs[p] = err
	}
}

// SocketCgroup is the cgroup v2 directory the socket probes (tcp_rtt, first_byte) are
// attached to, or "" before Start.
func (c *Collector) SocketCgroup() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sockCg
}

// EnterDialScope moves process pid (0: this one) into the dial scope (Config.DialScope), so
// that the sockets it makes from now on, its connections to engines, run the socket probes,
// while the connections it accepts from listeners opened before never do. Call it once the
// listeners are open and before the first connection to an engine: connections dialed
// before are not measured until they are replaced. Without a dial scope it does nothing.
//
// Where the process cannot be moved (a cgroup that holds no processes of its own, one not
// writable here), the socket probes move to the scope's parent instead, where they see
// every connection again; that is logged, and the error returned only when that move
// failed too.
func (c *Collector) EnterDialScope(pid int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dial == nil {
		return nil
	}
	if pid == 0 {
		pid = os.Getpid()
	}
	err := c.dial.enter(pid)
	if err == nil {
		c.log.Info("ebpf: socket probes on dialed connections only", "pid", pid, "cgroup", c.dial.dir)
		return nil
	}
	c.log.Warn("ebpf: socket probes moved to the process's cgroup, client connections included", "err", err)
	var errs []error
	if c.tcp != nil {
		if err := c.tcp.MoveTo(c.dial.parent); err != nil {
			c.log.Warn("ebpf: probe inactive", "probe", ProbeTCPRTT, "err", err)
			c.errs[ProbeTCPRTT] = err
			errs = append(errs, err)
		}
	}
	if c.fb != nil {
		if err := c.fb.MoveTo(c.dial.parent); err != nil {
			c.log.Warn("ebpf: probe inactive", "probe", ProbeFirstByte, "err", err)
			c.errs[ProbeFirstByte] = err
			errs = append(errs, err)
		}
	}
	c.dropDialLocked()
	return errors.Join(errs...)
}

// dropDialLocked removes the dial scope; the socket probes' cgroup is its parent again.
func (c *Collector) dropDialLocked() {
	if err := c.dial.close(); err != nil {
		c.log.Warn("ebpf: removing the dial scope", "err", err)
	}
	c.sockCg, c.dial = c.dial.parent, nil
}

// Active reports whether each probe is attached.
func (c *Collector) Active() map[string]bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]bool, len(Probes))
	for _, p := range Probes {
		out[p] = c.errs[p] == nil
	}
	return out
}

// SetTargets replaces the watched engine endpoints. Addresses that do not resolve to IPv4
// are skipped (the socket probes are IPv4-only) and reported in the error.
func (c *Collector) SetTargets(ts []Target) error {
	m := map[netip.AddrPort]attribution{}
	var errs []error
	for _, t := range ts {
		ap, err := resolve(t.Addr)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		m[ap] = attribution{t.Worker, t.Pool}
	}
	c.mu.Lock()
	c.targets = m
	err := c.pushLocked()
	c.mu.Unlock()
	return errors.Join(append(errs, err)...)
}

// SetProcesses replaces the watched engine processes.
func (c *Collector) SetProcesses(ps []Process) error {
	m := map[uint32]attribution{}
	for _, p := range ps {
		m[uint32(p.PID)] = attribution{p.Worker, p.Pool}
	}
	c.mu.Lock()
	c.procs = m
	err := c.pushLocked()
	c.mu.Unlock()
	return err
}

// pushLocked writes the targets and processes into the attached probes' maps.
func (c *Collector) pushLocked() error {
	eps := make([]netip.AddrPort, 0, len(c.targets))
	for ap := range c.targets {
		eps = append(eps, ap)
	}
	var errs []error
	if c.tcp != nil {
		errs = append(errs, c.tcp.SetTargets(eps))
	}
	if c.fb != nil {
		errs = append(errs, c.fb.SetTargets(eps))
	}
	if c.rq != nil {
		pids := make([]uint32, 0, len(c.procs))
		for pid := range c.procs {
			pids = append(pids, pid)
		}
		err := c.rq.SetPIDs(pids)
		if err != nil && len(pids) > 0 && !c.rq.Attached() {
			c.errs[ProbeRunQueue] = err // its programs could not attach again
		} else if err == nil {
			c.errs[ProbeRunQueue] = nil
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// resolve turns host:port or a URL into an IPv4 address and port.
func resolve(addr string) (netip.AddrPort, error) {
	if _, rest, ok := strings.Cut(addr, "://"); ok {
		addr, _, _ = strings.Cut(rest, "/")
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("ebpf target %q: %w", addr, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("ebpf target %q: port: %w", addr, err)
	}
	if host == "localhost" || host == "" {
		host = "127.0.0.1"
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		ips, lerr := net.LookupIP(host)
		if lerr != nil {
			return netip.AddrPort{}, fmt.Errorf("ebpf target %q: %w", addr, lerr)
		}
		for _, a := range ips {
			if a4 := a.To4(); a4 != nil {
				ip = netip.AddrFrom4([4]byte(a4))
				break
			}
		}
	}
	ip = ip.Unmap()
	if !ip.Is4() {
		return netip.AddrPort{}, fmt.Errorf("ebpf target %q: not IPv4", addr)
	}
	return netip.AddrPortFrom(ip, uint16(p)), nil
}

// rttArmInterval is how often the RTT callbacks are re-armed: each followed connection gives
// one srtt sample per interval. (Arming walks every TCP socket of the network namespace.)
const rttArmInterval = time.Second

// sample runs the accept-queue iterator and reads the first-byte histograms every
// SampleInterval, and re-arms the RTT callbacks every rttArmInterval.
func (c *Collector) sample(ctx context.Context) {
	defer c.wg.Done()
	t := time.NewTicker(c.cfg.SampleInterval)
	defer t.Stop()
	var armed time.Time
	logged := map[string]bool{}
	logOnce := func(what string, err error) {
		if !logged[what] {
			c.log.Warn("ebpf: "+what, "err", err)
			logged[what] = true
		}
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.stop:
			return
		case now := <-t.C:
			if c.lq != nil {
				if err := c.sampleQueues(); err != nil {
					logOnce("sampling accept queues", err)
				}
			}
			if c.fb != nil {
				if err := c.sampleFirstByte(now); err != nil {
					logOnce("reading first-byte histograms", err)
				}
			}
			if c.tcp != nil && now.Sub(armed) >= rttArmInterval {
				armed = now
				if err := c.tcp.Arm(); err != nil {
					logOnce("re-arming RTT callbacks", err)
				}
			}
		}
	}
}

func (c *Collector) sampleQueues() error {
	ls, err := c.lq.Sample()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for ap, a := range c.targets {
		for _, l := range ls {
			if l.Addr.Port() != ap.Port() || !(l.Addr.Addr() == ap.Addr() || l.Addr.Addr().IsUnspecified()) {
				continue
			}
			c.queue[ap] = queueSample{l.Backlog, l.MaxBacklog}
			c.queueDepth.WithLabelValues(a.worker, a.pool).Observe(float64(l.Backlog))
			break
		}
	}
	return nil
}

func (c *Collector) sampleFirstByte(now time.Time) error {
	hs, err := c.fb.Read()
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	by := map[attribution]probes.Hist{}
	for ap, h := range hs {
		if a, ok := c.targets[ap]; ok {
			sum := by[a]
			sum.Add(h)
			by[a] = sum
		}
	}
	c.fbw.add(now, by)
	return nil
}

// AcceptQueue is the last sampled accept-queue length of the worker's listener (summed over
// its endpoints), and whether one was sampled: the connections waiting for the engine to
// accept them, a backlog its own metrics cannot show yet. Safe for concurrent use; a load
// signal for the control plane (controlplane.Options.KernelWaiting).
func (c *Collector) AcceptQueue(worker string) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n, found := 0, false
	for ap, q := range c.queue {
		if a, ok := c.targets[ap]; ok && a.worker == worker {
			n += int(q.depth)
			found = true
		}
	}
	return n, found
}

// FirstByteWaiting is how many requests the worker's recent kernel-side first-byte latency
// implies waiting in front of it, and whether it answered in the last FirstByteWindow (and a
// worker of its pool did, to compare with). The latency W is its answers' mean over the
// window (clamped into the log2 bucket of their median, so that one slow outlier moves it
// little); the fastest worker of the same pool answering in the window sets the reference R
// (at least 1 ms); the count is W/R - 1 rounded down, at most 64: as many requests as,
// served one after another at the fastest peer's speed, would explain the wait. A worker
// no faster than twice the reference counts 0. Requests sent from this host's sockets (in
// the probes' cgroup) are the ones timed, so this sees the proxies that run here. Safe for
// concurrent use; a load signal for the control plane
// (controlplane.Options.KernelLatencyWaiting).
func (c *Collector) FirstByteWaiting(worker string) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n, ok := c.fbw.waiting[worker]
	return n, ok
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.descActive, c.descSRTT, c.descConnect, c.descRetrans, c.descResets,
		c.descFirstByte, c.descRunQ, c.descQueueLen, c.descQueueMax, c.descFBRecent, c.descFBWaiting} {
		ch <- d
	}
	c.queueDepth.Describe(ch)
	c.mu.Lock()
	g := c.gpu
	c.mu.Unlock()
	if g != nil {
		g.Describe(ch)
	}
}

// Collect implements prometheus.Collector: it reads the kernel maps now.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range Probes {
		v := 0.0
		if c.errs[p] == nil {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(c.descActive, prometheus.GaugeValue, v, p)
	}
	if c.tcp != nil {
		if stats, err := c.tcp.Read(); err == nil {
			srtt, conn := map[attribution]*probes.Hist{}, map[attribution]*probes.Hist{}
			retrans, resets := map[attribution]uint64{}, map[attribution]uint64{}
			for ap, s := range stats {
				a, ok := c.targets[ap]
				if !ok {
					continue
				}
				addHist(srtt, a, &s.SRTT)
				addHist(conn, a, &s.Connect)
				retrans[a] += s.Retransmits
				resets[a] += s.Resets
			}
			if c.errs[ProbeTCPRTT] == nil {
				emitHists(ch, c.descSRTT, srtt)
				for a, n := range retrans {
					ch <- prometheus.MustNewConstMetric(c.descRetrans, prometheus.CounterValue, float64(n), a.worker, a.pool)
				}
			}
			if c.errs[ProbeTCPState] == nil {
				emitHists(ch, c.descConnect, conn)
				for a, n := range resets {
					ch <- prometheus.MustNewConstMetric(c.descResets, prometheus.CounterValue, float64(n), a.worker, a.pool)
				}
			}
		}
	}
	if c.fb != nil {
		if hs, err := c.fb.Read(); err == nil {
			by := map[attribution]*probes.Hist{}
			for ap, h := range hs {
				if a, ok := c.targets[ap]; ok {
					addHist(by, a, h)
				}
			}
			emitHists(ch, c.descFirstByte, by)
		}
	}
	if c.rq != nil {
		if hs, err := c.rq.Read(); err == nil {
			by := map[attribution]*probes.Hist{}
			for pid, h := range hs {
				if a, ok := c.procs[pid]; ok {
					addHist(by, a, h)
				}
			}
			emitHists(ch, c.descRunQ, by)
		}
	}
	for ap, q := range c.queue {
		if a, ok := c.targets[ap]; ok {
			ch <- prometheus.MustNewConstMetric(c.descQueueLen, prometheus.GaugeValue, float64(q.depth), a.worker, a.pool)
			ch <- prometheus.MustNewConstMetric(c.descQueueMax, prometheus.GaugeValue, float64(q.max), a.worker, a.pool)
		}
	}
	for a, d := range c.fbw.recent {
		ch <- prometheus.MustNewConstMetric(c.descFBRecent, prometheus.GaugeValue, d.Seconds(), a.worker, a.pool)
		ch <- prometheus.MustNewConstMetric(c.descFBWaiting, prometheus.GaugeValue, float64(c.fbw.excess[a]), a.worker, a.pool)
	}
	c.queueDepth.Collect(ch)
	if c.gpu != nil {
		c.gpu.Collect(ch)
	}
}

func addHist(m map[attribution]*probes.Hist, a attribution, h *probes.Hist) {
	if h.Count == 0 {
		return
	}
	if m[a] == nil {
		m[a] = &probes.Hist{}
	}
	m[a].Add(h)
}

// firstBucket is the first log2 slot exported as its own bucket: its bound is 2^10 ns ≈ 1µs;
// the slots below fold into it.
const firstBucket = 9

// emitHists sends each kernel histogram as a Prometheus histogram in seconds.
func emitHists(ch chan<- prometheus.Metric, d *prometheus.Desc, m map[attribution]*probes.Hist) {
	keys := make([]attribution, 0, len(m))
	for a := range m {
		keys = append(keys, a)
	}
	slices.SortFunc(keys, func(x, y attribution) int { return strings.Compare(x.worker+"\x00"+x.pool, y.worker+"\x00"+y.pool) })
	for _, a := range keys {
		ch <- constHist(d, m[a], a.worker, a.pool)
	}
}

func constHist(d *prometheus.Desc, h *probes.Hist, labels ...string) prometheus.Metric {
	buckets := make(map[float64]uint64, probes.HistSlots-firstBucket)
	var cum uint64
	for i, n := range h.Slots {
		cum += n
		if i >= firstBucket && i < probes.HistSlots-1 {
			buckets[float64(uint64(1)<<(i+1))/1e9] = cum
		}
	}
	return prometheus.MustNewConstHistogram(d, h.Count, float64(h.SumNs)/1e9, buckets, labels...)
}

// Close stops sampling and detaches every probe. It is safe after a failed or no Start.
func (c *Collector) Close() error {
	c.mu.Lock()
	select {
	case <-c.stop:
	default:
		close(c.stop)
	}
	c.mu.Unlock()
	c.wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	if c.tcp != nil {
		errs = append(errs, c.tcp.Close())
		c.tcp = nil
	}
	if c.fb != nil {
		errs = append(errs, c.fb.Close())
		c.fb = nil
	}
	if c.lq != nil {
		errs = append(errs, c.lq.Close())
		c.lq = nil
	}
	if c.rq != nil {
		errs = append(errs, c.rq.Close())
		c.rq = nil
	}
	if c.gpu != nil {
		errs = append(errs, c.gpu.Close())
		c.gpu = nil
	}
	if c.dial != nil {
		errs = append(errs, c.dial.close())
		c.dial = nil
	}
	for _, p := range Probes {
		c.errs[p] = errors.New("closed")
	}
	return errors.Join(errs...)
}

var _ prometheus.Collector = (*Collector)(nil)
