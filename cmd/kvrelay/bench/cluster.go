package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// Cluster modes: how the workers split the two phases of a request, and when the proxy
// prefills a request on another worker than the one that decodes it.
const (
	// ModeAgg: every worker does both phases (role both).
	ModeAgg = "agg"
	// ModeDisagg: a prefill pool and a decode pool; every request prefills on a prefill
	// worker and moves its KV blocks to a decode worker (the proxy's DisaggThreshold -1).
	ModeDisagg = "disagg"
	// ModeConditional: the same pools, but a request whose uncached prompt is shorter than
	// the threshold prefills on its decode worker (vLLM's / Dynamo's conditional
	// disaggregation).
	ModeConditional = "conditional"
)

// DefaultDisaggThreshold is the conditional mode's threshold in uncached prompt tokens, the
// proxy's default (512).
var DefaultDisaggThreshold = proxy.DefaultConfig().DisaggThreshold

// ClusterConfig describes a local cluster: simulated workers behind a kvrelay proxy, all on
// loopback in this process.
type ClusterConfig struct {
	// Workers is the number of workers in mode agg, and the total split between the pools
	// in the other modes when PrefillWorkers and DecodeWorkers are not set.
	Workers int
	Model   string
	// Policy is the proxy's routing policy; Onboard its treatment of blocks below GPU memory
	// (proxy.Config.Onboard).
	Policy  string
	Onboard string
	// Speedup divides the simulated engines' step times.
	Speedup      float64
	NumGPUBlocks int
	BlockSize    int
	MaxModelLen  int
	MaxNumSeqs   int
	// Mode is ModeAgg (the default), ModeDisagg or ModeConditional.
	Mode string
	// PrefillWorkers and DecodeWorkers size the pools in modes disagg and conditional
	// (default: Workers split in half, the odd one decoding).
	PrefillWorkers, DecodeWorkers int
	// DisaggThreshold is the conditional mode's threshold: a request prefills on a prefill
	// worker when more than this many of its prompt tokens are not cached on the decode
	// worker the proxy picked, and on that decode worker otherwise (0:
	// DefaultDisaggThreshold).
	DisaggThreshold int
	// KVBytesScale, when positive, replaces the simulator's --kv-bytes-scale (1/64): the
	// share of the modelled KV bytes that prefill and decode workers really store and move
	// over loopback. The modelled transfer time does not depend on it; the real copying,
	// which the machine pays for and a compare run reports × its engine speedup, does.
	KVBytesScale float64
	// KVTransferBandwidth, when positive, replaces the simulator's modelled prefill→decode
	// bandwidth (50 GB/s) in bytes per second.
	KVTransferBandwidth float64
	// Static runs the proxy alone with static upstreams and its approximate index; by
	// default a control plane follows the workers' KV events and feeds the proxy over xDS.
	Static bool
	// CacheThreshold, OverlapWeight and QueueWeight override the kv policy's when positive,
	// ComputeWeight the latency policy's when not negative.
	CacheThreshold, OverlapWeight, QueueWeight float64
	// BatchWeight, when not negative, is the proxy's --batch-weight (latency policy).
	BatchWeight   float64
	ComputeWeight float64
	// Tiers configures the engines' KV block manager below and within the GPU tier.
	Tiers TierConfig
}

// TierConfig is the simulated engines' KV block manager: eviction policy and pins of the GPU
// tier, and the host and disk tiers below it (capacities in blocks; 0: none). Each engine's
// disk tier lives in its own directory under a temporary one the cluster removes.
type TierConfig struct {
	Eviction                     sim.Eviction
	CPUOffloadBlocks, DiskBlocks int
	OffloadOn                    sim.Offload
	// DiskAdmitMinHits, MaxPinnedFraction and the bandwidths: 0 is the simulator's default.
	DiskAdmitMinHits             int
	MaxPinnedFraction            float64
	HostBandwidth, DiskBandwidth float64
	// PeerFetch lets the engines pull a prefix a peer caches (sim.Config.PeerFetch); the
	// proxy then weighs fetching against computing it.
	PeerFetch bool
	// SharedDisk makes the disk tier one directory every engine mounts (sim.Config
	// DiskShared): DiskBlocks is then what each engine may write there.
	SharedDisk bool
	// LearnWriteOnce lets WORM engines learn write-once output (sim.Config.LearnWriteOnce).
	LearnWriteOnce bool
	// ReasoningTokens makes the engines reasoning models (sim.Config.ReasoningTokens).
	ReasoningTokens int
}

// Describe names the tiers, e.g. "G1 lru", "G1+G2(32768)+G3(131072) worm".
func (t TierConfig) Describe() string {
	s := "G1"
	if t.CPUOffloadBlocks > 0 {
		s += fmt.Sprintf("+G2(%d)", t.CPUOffloadBlocks)
	}
	if t.DiskBlocks > 0 && t.SharedDisk {
		s += fmt.Sprintf("+shared G3(%d each)", t.DiskBlocks)
	} else if t.DiskBlocks > 0 {
		s += fmt.Sprintf("+G3(%d)", t.DiskBlocks)
	}
	ev := t.Eviction
	if ev == "" {
		ev = sim.EvictLRU
	}
	s += " " + string(ev)
	if t.LearnWriteOnce {
		s += " (learned write-once)"
	}
	if t.ReasoningTokens > 0 {
		s += " (reasoning write-once)"
	}
	if t.PeerFetch {
		s += " + peer fetch"
	}
	return s
}

// DefaultClusterConfig is 8 gpt-oss-120b workers with vLLM's defaults behind the default
// policy (latency).
func DefaultClusterConfig() ClusterConfig {
	d := sim.DefaultConfig()
	return ClusterConfig{
		Workers: 8, Model: d.Model, Policy: route.PolicyDefault,
		NumGPUBlocks: d.NumGPUBlocks, BlockSize: d.BlockSize, MaxModelLen: d.MaxModelLen, MaxNumSeqs: d.MaxNumSeqs,
		Mode: ModeAgg, ComputeWeight: -1, BatchWeight: -1,
	}
}

// Pools returns the number of workers of each role the config starts: both (mode agg), or
// prefill and decode (modes disagg and conditional).
func (cfg ClusterConfig) Pools() (both, prefill, decode int, err error) {
	switch cfg.Mode {
	case "", ModeAgg:
		if cfg.Workers < 1 {
			return 0, 0, 0, errors.New("a cluster needs at least one worker")
		}
		return cfg.Workers, 0, 0, nil
	case ModeDisagg, ModeConditional:
		prefill, decode = cfg.PrefillWorkers, cfg.DecodeWorkers
		if prefill == 0 && decode == 0 {
			prefill = cfg.Workers / 2
			decode = cfg.Workers - prefill
		}
		if prefill < 1 || decode < 1 {
			return 0, 0, 0, fmt.Errorf("mode %s needs at least one prefill and one decode worker, got %d + %d", cfg.Mode, prefill, decode)
		}
		return 0, prefill, decode, nil
	default:
		return 0, 0, 0, fmt.Errorf("cluster mode %q: want %s, %s or %s", cfg.Mode, ModeAgg, ModeDisagg, ModeConditional)
	}
}

// engineConfig is the configuration of each simulated engine of the given role.
func (cfg ClusterConfig) engineConfig(role sim.Role) sim.Config {
	ec := sim.DefaultConfig() // KV transfer at the simulator's defaults
	ec.Model = cfg.Model
	ec.Role = role
	ec.Timing.Speedup = cfg.Speedup
	if ec.Timing.Speedup <= 0 {
		ec.Timing.Speedup = 1
	}
	ec.NumGPUBlocks = cfg.NumGPUBlocks
	ec.BlockSize = cfg.BlockSize
	// Zero settings keep the simulator's defaults.
	override(&ec.MaxModelLen, cfg.MaxModelLen)
	override(&ec.MaxNumSeqs, cfg.MaxNumSeqs)
	override(&ec.KVBytesScale, cfg.KVBytesScale)
	override(&ec.KVTransferBandwidth, cfg.KVTransferBandwidth)
	t := cfg.Tiers
	override(&ec.Eviction, t.Eviction)
	override(&ec.OffloadOn, t.OffloadOn)
	ec.CPUOffloadBlocks = t.CPUOffloadBlocks
	ec.DiskOffloadBlocks = t.DiskBlocks // the directory is the cluster's, per engine
	override(&ec.DiskAdmitMinHits, t.DiskAdmitMinHits)
	override(&ec.MaxPinnedFraction, t.MaxPinnedFraction)
	override(&ec.HostBandwidth, t.HostBandwidth)
	override(&ec.DiskBandwidth, t.DiskBandwidth)
	ec.PeerFetch = t.PeerFetch
	ec.DiskShared = t.SharedDisk
	ec.LearnWriteOnce = t.LearnWriteOnce
	ec.ReasoningTokens = t.ReasoningTokens
	return ec
}

// override sets *dst to v unless v is its type's zero value.
func override[T comparable](dst *T, v T) {
	var zero T
	if v != zero {
		*dst = v
	}
}

// prefillModel is the prefill time model of the cluster's engines in mode agg, where a
// request prefills where it decodes and its TTFT is one engine's work; nil in the other modes
// (a decode worker reports a pulled prompt as cached, and TTFT spans two workers).
func (cfg ClusterConfig) prefillModel() *PrefillModel {
	if cfg.Mode != "" && cfg.Mode != ModeAgg {
		return nil
	}
	ec := cfg.engineConfig(sim.RoleBoth)
	return &PrefillModel{Timing: ec.Timing, ChunkTokens: ec.MaxNumBatchedTokens}
}

// Describe names the cluster's pools and disaggregation policy, e.g. "agg 4 workers",
// "disagg 2 prefill + 2 decode", "conditional (threshold 512 tokens) 2 prefill + 2 decode".
func (cfg ClusterConfig) Describe() string {
	both, prefill, decode, err := cfg.Pools()
	switch {
	case err != nil:
		return "invalid: " + err.Error()
	case both > 0:
		return fmt.Sprintf("agg %d workers", both)
	case cfg.Mode == ModeConditional:
		return fmt.Sprintf("conditional (threshold %d tokens) %d prefill + %d decode", cfg.threshold(), prefill, decode)
	default:
		return fmt.Sprintf("disagg %d prefill + %d decode", prefill, decode)
	}
}

func (cfg ClusterConfig) threshold() int {
	if cfg.DisaggThreshold > 0 {
		return cfg.DisaggThreshold
	}
	return DefaultDisaggThreshold
}

// disaggSettings are the proxy's Disagg and DisaggThreshold for the mode: in mode disagg
// every request prefills remotely (a negative threshold), in mode conditional only those
// whose uncached prompt exceeds the threshold; mode agg has no prefill or decode workers,
// and turns disaggregation off outright.
func (cfg ClusterConfig) disaggSettings() (mode string, threshold int) {
	switch cfg.Mode {
	case ModeDisagg:
		return proxy.DisaggAuto, -1
	case ModeConditional:
		return proxy.DisaggAuto, cfg.threshold()
	default:
		return proxy.DisaggOff, proxy.DefaultConfig().DisaggThreshold
	}
}

// WorkerInfo describes one worker of a running cluster.
type WorkerInfo struct {
	ID   string
	Role sim.Role
	// URL is the OpenAI API's base URL (without /v1).
	URL string
	// KVTransfer is the nixl agent's address and EngineID the engine's id in
	// kv_transfer_params; both empty in role both.
	KVTransfer, EngineID string
}

// Cluster is a running local cluster.
type Cluster struct {
	workers []*sim.Worker
	info    []WorkerInfo
	proxy   *proxy.Server
	cp      *controlplane.Server
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	diskDir string // the engines' disk tiers, removed by Close
}

var codecs sync.Map // model → sim.Codec, loaded once per process

// StartCluster starts the workers and the proxy; Close stops them.
func StartCluster(ctx context.Context, cfg ClusterConfig) (*Cluster, error) {
	both, prefill, decode, err := cfg.Pools()
	if err != nil {
		return nil, err
	}
	codec, err := codecFor(cfg.Model)
	if err != nil {
		return nil, err
	}
	pc := proxy.DefaultConfig()
	pc.Listen = "127.0.0.1:0"
	pc.Policy = cfg.Policy
	pc.Onboard = cfg.Onboard
	pc.ExposeWorkerHeader = true
	pc.BlockSize = cfg.BlockSize
	// One event loop: the engines, the control plane and the load generator share this
	// process, and a gnet loop waiting in epoll_wait holds its P; with a loop per P they
	// would run only when sysmon takes a P back, up to 10 ms late, which slows the simulated
	// engines' clocks and adds to every latency measured.
	pc.EventLoops = 1
	if cfg.CacheThreshold > 0 {
		pc.CacheThreshold = cfg.CacheThreshold
	}
	if cfg.OverlapWeight > 0 {
		pc.OverlapWeight = cfg.OverlapWeight
	}
	if cfg.QueueWeight > 0 {
		pc.QueueWeight = cfg.QueueWeight
	}
	if cfg.BatchWeight >= 0 {
		pc.BatchWeight = cfg.BatchWeight // the proxy's own: not part of the pushed policy
	}
	if cfg.ComputeWeight >= 0 {
		pc.ComputeWeight = cfg.ComputeWeight
	}
	pc.Disagg, pc.DisaggThreshold = cfg.disaggSettings()
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	c := &Cluster{cancel: cancel}
	type pool struct {
		role   sim.Role
		n      int
		prefix string
	}
	var specs []registry.Worker
	for _, p := range []pool{{sim.RoleBoth, both, "w"}, {sim.RolePrefill, prefill, "p"}, {sim.RoleDecode, decode, "d"}} {
		for i := range p.n {
			ec := cfg.engineConfig(p.role)
			if ec.DiskOffloadBlocks > 0 {
				if c.diskDir == "" {
					if c.diskDir, err = os.MkdirTemp("", "kvrelay-bench-disk-"); err != nil {
						c.Close()
						return nil, fmt.Errorf("starting cluster: %w", err)
					}
				}
				ec.DiskOffloadDir = filepath.Join(c.diskDir, p.prefix+strconv.Itoa(i))
				if ec.DiskShared {
					ec.DiskOffloadDir = filepath.Join(c.diskDir, "shared")
				}
			}
			wc := sim.WorkerConfig{Engine: ec, Listen: "127.0.0.1:0", Codec: codec}
			if p.role != sim.RoleBoth || ec.PeerFetch {
				wc.KVTransferListen = "127.0.0.1:0"
			}
			if !cfg.Static {
				wc.Events = kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}
			}
			w, err := sim.NewWorker(wc)
			if err != nil {
				c.Close()
				return nil, fmt.Errorf("starting cluster: %w", err)
			}
			if err := w.Start(runCtx); err != nil {
				_ = w.Close()
				c.Close()
				return nil, fmt.Errorf("starting cluster: %w", err)
			}
			c.workers = append(c.workers, w)
			c.wg.Add(1)
			go func() { defer c.wg.Done(); _ = w.Run(runCtx) }()
			id := p.prefix + strconv.Itoa(i)
			c.info = append(c.info, WorkerInfo{ID: id, Role: p.role, URL: w.URL(), KVTransfer: w.KVTransferAddr(), EngineID: w.EngineID()})
			kvBytes, host, disk, peer := ec.Tiers()
			pc.Upstreams = append(pc.Upstreams, proxy.Upstream{ID: id, URL: w.URL(), Model: cfg.Model, Capacity: cfg.NumGPUBlocks, Role: string(p.role), Engine: "sim",
				MaxNumSeqs: ec.MaxNumSeqs, MaxNumBatchedTokens: ec.MaxNumBatchedTokens,
				KVBytesPerToken: kvBytes, HostBandwidth: host, DiskBandwidth: disk, SharedBandwidth: ec.SharedTier(), PeerBandwidth: peer})
			specs = append(specs, registry.Worker{ID: id, URL: w.URL(), Model: cfg.Model, Role: string(p.role), BlockSize: cfg.BlockSize,
				KVEvents: w.EventsEndpoint(), KVEventsReplay: w.ReplayEndpoint(), Engine: "sim",
				MaxNumSeqs: ec.MaxNumSeqs, MaxNumBatchedTokens: ec.MaxNumBatchedTokens,
				KVBytesPerToken: kvBytes, HostBandwidth: host, DiskBandwidth: disk, SharedBandwidth: ec.SharedTier(), PeerBandwidth: peer})
		}
	}
	if !cfg.Static {
		if err := c.startControlPlane(runCtx, specs, pc); err != nil {
			c.Close()
			return nil, fmt.Errorf("starting cluster: %w", err)
		}
		pc.Upstreams = nil
		pc.XDS = c.cp.XDSAddr()
		pc.NodeID = "bench-proxy"
	}
	p, err := proxy.New(pc, nil)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("starting cluster: %w", err)
	}
	if err := p.Start(runCtx); err != nil {
		c.Close()
		return nil, fmt.Errorf("starting cluster: %w", err)
	}
	c.proxy = p
	return c, nil
}

// startControlPlane runs a control plane over the workers in a temporary data dir, with the
// routing policy the proxy was configured with, disaggregation settings included; the
// workers' roles and the policy reach the proxy over xDS.
func (c *Cluster) startControlPlane(ctx context.Context, specs []registry.Worker, pc proxy.Config) error {
	dir, err := os.MkdirTemp("", "kvrelay-bench-")
	if err != nil {
		return err
	}
	cp, err := controlplane.New(controlplane.Options{
		XDSListen: "127.0.0.1:0", DataDir: dir, RemoveDataDir: true, Workers: specs,
		Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		os.RemoveAll(dir)
		return err
	}
	pol := cp.Registry().Policy()
	pol.Name, pol.OverlapWeight, pol.QueueWeight = pc.Policy, pc.OverlapWeight, pc.QueueWeight
	pol.ComputeWeight = &pc.ComputeWeight
	pol.Temperature, pol.CacheThreshold = pc.Temperature, pc.CacheThreshold
	threshold := int64(pc.DisaggThreshold)
	pol.Disagg, pol.DisaggThreshold = pc.Disagg, &threshold
	if _, err := cp.Registry().SetPolicy(pol); err != nil {
		cp.Close()
		return err
	}
	if err := cp.Start(ctx); err != nil {
		cp.Close()
		return err
	}
	c.cp = cp
	return nil
}

func codecFor(model string) (sim.Codec, error) {
	if c, ok := codecs.Load(model); ok {
		return c.(sim.Codec), nil
	}
	c, err := sim.NewCodec(model, "", "")
	if err != nil {
		return nil, err
	}
	codecs.Store(model, c)
	return c, nil
}

// EngineStall sums the time the cluster's simulated engines lost running behind their
// modelled step clocks (sim.Engine.Stalled), and says how many engines there are.
func (c *Cluster) EngineStall() (lost time.Duration, engines int) {
	for _, w := range c.workers {
		_, l := w.Engine().Stalled()
		lost += l
	}
	return lost, len(c.workers)
}

// LatencyModels returns the proxy's learned latency models (nil under a policy that predicts
// nothing, where they stay at their priors unused).
func (c *Cluster) LatencyModels() []proxy.WorkerModelJSON {
	ms := c.proxy.WorkerModels()
	for _, m := range ms {
		if m.ModelObservations > 0 {
			return ms
		}
	}
	return nil
}

// Target is the proxy's OpenAI base URL.
func (c *Cluster) Target() string { return "http://" + c.proxy.Addr() + "/v1" }

// Workers describes the cluster's workers: the both pool (w0, w1, …), then the prefill pool
// (p0, …), then the decode pool (d0, …).
func (c *Cluster) Workers() []WorkerInfo { return c.info }

// Close stops the proxy and the workers.
func (c *Cluster) Close() error {
	var err error
	if c.proxy != nil {
		err = c.proxy.Close()
	}
	if c.cp != nil {
		_ = c.cp.Close()
	}
	c.cancel()
	c.wg.Wait()
	for _, w := range c.workers {
		_ = w.Close()
	}
	if c.diskDir != "" {
		_ = os.RemoveAll(c.diskDir)
	}
	return err
}

// TierStats sums the engines' KV totals (sim.Engine.TierStats).
func (c *Cluster) TierStats() sim.TierStats {
	var s sim.TierStats
	for _, w := range c.workers {
		t := w.Engine().TierStats()
		s.PromptTokens += t.PromptTokens
		s.CachedTokens += t.CachedTokens
		for i := range s.CachedByTier {
			s.CachedByTier[i] += t.CachedByTier[i]
		}
		s.DiskReadBytes += t.DiskReadBytes
		s.DiskWritten += t.DiskWritten
		s.OffloadedCPU += t.OffloadedCPU
		s.OffloadedDisk += t.OffloadedDisk
		for i := range s.PeerFetches {
			s.PeerFetches[i] += t.PeerFetches[i]
		}
		s.PeerTokens += t.PeerTokens
		s.OnboardSkipped += t.OnboardSkipped
	}
	return s
}

// Setup is one cluster of a comparison: a mode and its pools.
type Setup struct {
	// Label names the setup in tables and files, e.g. "agg:4", "disagg:2+2",
	// "conditional@1024:2+2".
	Label string
	Mode  string
	// Workers sizes mode agg; PrefillWorkers and DecodeWorkers the other modes.
	Workers, PrefillWorkers, DecodeWorkers int
	// DisaggThreshold is the conditional mode's threshold (0: the cluster config's).
	DisaggThreshold int
}

// Apply returns cfg with the setup's mode and pools.
func (s Setup) Apply(cfg ClusterConfig) ClusterConfig {
	cfg.Mode = s.Mode
	if s.Workers > 0 {
		cfg.Workers = s.Workers
	}
	if s.PrefillWorkers > 0 || s.DecodeWorkers > 0 {
		cfg.PrefillWorkers, cfg.DecodeWorkers = s.PrefillWorkers, s.DecodeWorkers
	}
	if s.DisaggThreshold > 0 {
		cfg.DisaggThreshold = s.DisaggThreshold
	}
	return cfg
}

// ParseSetups reads a comma-separated list of setups, each MODE[@THRESHOLD][:POOLS]: agg:N
// (N workers of role both), disagg:P+D (P prefill and D decode workers, every request
// prefilled remotely), conditional:P+D (the same pools; a request prefills remotely when its
// uncached prompt reaches the threshold, default the cluster's) and conditional@T:P+D (its
// own threshold of T tokens). Without pools a setup takes the cluster config's (--workers,
// --prefill-workers, --decode-workers). Example: "agg:4,disagg:2+2,conditional:2+2".
func ParseSetups(s string) ([]Setup, error) {
	var out []Setup
	seen := map[string]bool{}
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		st, err := parseSetup(item)
		if err != nil {
			return nil, fmt.Errorf("setup %q: %w", item, err)
		}
		if seen[st.Label] {
			return nil, fmt.Errorf("setup %q appears twice", st.Label)
		}
		seen[st.Label] = true
		out = append(out, st)
	}
	if len(out) == 0 {
		return nil, errors.New("no setups")
	}
	return out, nil
}

func parseSetup(item string) (Setup, error) {
	head, pools, hasPools := strings.Cut(item, ":")
	mode, thr, hasThr := strings.Cut(head, "@")
	st := Setup{Mode: strings.TrimSpace(mode)}
	label := st.Mode
	switch st.Mode {
	case ModeAgg, ModeDisagg, ModeConditional:
	default:
		return Setup{}, fmt.Errorf("mode %q: want %s, %s or %s", st.Mode, ModeAgg, ModeDisagg, ModeConditional)
	}
	if hasThr {
		if st.Mode != ModeConditional {
			return Setup{}, errors.New("only conditional takes a threshold (conditional@TOKENS)")
		}
		t, err := strconv.Atoi(strings.TrimSpace(thr))
		if err != nil || t < 1 {
			return Setup{}, fmt.Errorf("threshold %q: want a positive number of tokens", thr)
		}
		st.DisaggThreshold = t
		label += "@" + strconv.Itoa(t)
	}
	if !hasPools {
		return Setup{Label: label, Mode: st.Mode, DisaggThreshold: st.DisaggThreshold}, nil
	}
	pools = strings.TrimSpace(pools)
	count := func(s string) (int, error) {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 || n > 1024 {
			return 0, fmt.Errorf("worker count %q: want 1 to 1024", s)
		}
		return n, nil
	}
	var err error
	if st.Mode == ModeAgg {
		if st.Workers, err = count(pools); err != nil {
			return Setup{}, err
		}
		st.Label = label + ":" + strconv.Itoa(st.Workers)
		return st, nil
	}
	p, d, ok := strings.Cut(pools, "+")
	if !ok {
		return Setup{}, fmt.Errorf("pools %q: want PREFILL+DECODE, e.g. 2+2", pools)
	}
	if st.PrefillWorkers, err = count(p); err != nil {
		return Setup{}, err
	}
	if st.DecodeWorkers, err = count(d); err != nil {
		return Setup{}, err
	}
	st.Label = fmt.Sprintf("%s:%d+%d", label, st.PrefillWorkers, st.DecodeWorkers)
	return st, nil
}
