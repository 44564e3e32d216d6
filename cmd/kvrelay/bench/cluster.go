package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// ClusterConfig describes a local cluster: simulated workers behind a kvrelay proxy, all on
// loopback in this process.
type ClusterConfig struct {
	Workers int
	Model   string
	// Policy is the proxy's routing policy.
	Policy string
	// Speedup divides the simulated engines' step times.
	Speedup      float64
	NumGPUBlocks int
	BlockSize    int
	MaxModelLen  int
	MaxNumSeqs   int
	// Mode is "agg" (every worker does both phases); "disagg" needs prefill and decode
	// roles, which the simulated engine does not offer yet.
	Mode string
	// Static runs the proxy alone with static upstreams and its approximate index; by
	// default a control plane follows the workers' KV events and feeds the proxy over xDS.
	Static bool
	// CacheThreshold, OverlapWeight and QueueWeight override the kv policy's when positive.
	CacheThreshold, OverlapWeight, QueueWeight float64
}

// DefaultClusterConfig is 8 gpt-oss-120b workers with vLLM's defaults behind the kv policy.
func DefaultClusterConfig() ClusterConfig {
	d := sim.DefaultConfig()
	return ClusterConfig{
		Workers: 8, Model: d.Model, Policy: "kv",
		NumGPUBlocks: d.NumGPUBlocks, BlockSize: d.BlockSize, MaxModelLen: d.MaxModelLen, MaxNumSeqs: d.MaxNumSeqs,
		Mode: "agg",
	}
}

// Cluster is a running local cluster.
type Cluster struct {
	workers []*sim.Worker
	proxy   *proxy.Server
	cp      *controlplane.Server
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

var codecs sync.Map // model → sim.Codec, loaded once per process

// StartCluster starts the workers and the proxy; Close stops them.
func StartCluster(ctx context.Context, cfg ClusterConfig) (*Cluster, error) {
	if cfg.Mode != "" && cfg.Mode != "agg" {
		return nil, fmt.Errorf("cluster mode %q: only agg is available until the simulated engine offers prefill and decode roles", cfg.Mode)
	}
	if cfg.Workers < 1 {
		return nil, errors.New("a cluster needs at least one worker")
	}
	codec, err := codecFor(cfg.Model)
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	c := &Cluster{cancel: cancel}
	pc := proxy.DefaultConfig()
	pc.Listen = "127.0.0.1:0"
	pc.Policy = cfg.Policy
	pc.ExposeWorkerHeader = true
	pc.BlockSize = cfg.BlockSize
	if cfg.CacheThreshold > 0 {
		pc.CacheThreshold = cfg.CacheThreshold
	}
	if cfg.OverlapWeight > 0 {
		pc.OverlapWeight = cfg.OverlapWeight
	}
	if cfg.QueueWeight > 0 {
		pc.QueueWeight = cfg.QueueWeight
	}
	var specs []registry.Worker
	for i := range cfg.Workers {
		ec := sim.DefaultConfig()
		ec.Model = cfg.Model
		ec.Timing.Speedup = cfg.Speedup
		if ec.Timing.Speedup <= 0 {
			ec.Timing.Speedup = 1
		}
		ec.NumGPUBlocks = cfg.NumGPUBlocks
		ec.BlockSize = cfg.BlockSize
		if cfg.MaxModelLen > 0 {
			ec.MaxModelLen = cfg.MaxModelLen
		}
		if cfg.MaxNumSeqs > 0 {
			ec.MaxNumSeqs = cfg.MaxNumSeqs
		}
		wc := sim.WorkerConfig{Engine: ec, Listen: "127.0.0.1:0", Codec: codec}
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
		id := "w" + strconv.Itoa(i)
		pc.Upstreams = append(pc.Upstreams, proxy.Upstream{ID: id, URL: w.URL(), Model: cfg.Model, Capacity: cfg.NumGPUBlocks})
		specs = append(specs, registry.Worker{ID: id, URL: w.URL(), Model: cfg.Model, BlockSize: cfg.BlockSize,
			KVEvents: w.EventsEndpoint(), KVEventsReplay: w.ReplayEndpoint(), Engine: "sim"})
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
// routing policy the proxy was configured with.
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
	pol.Temperature, pol.CacheThreshold = pc.Temperature, pc.CacheThreshold
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

// Target is the proxy's OpenAI base URL.
func (c *Cluster) Target() string { return "http://" + c.proxy.Addr() + "/v1" }

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
	return err
}
