package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sglang"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/trtllm"
	"github.com/kvrelay/kvrelay/engines/vllm"
)

const model = "gpt-oss-120b"

var codecOnce = sync.OnceValues(func() (sim.Codec, error) { return sim.NewCodec(model, "", "") })

func adapters() engines.Adapters {
	return engines.Adapters{
		engines.KindVLLM:   vllm.New(),
		engines.KindSim:    vllm.NewSim(),
		engines.KindSGLang: sglang.New(),
		engines.KindTRTLLM: trtllm.New(),
	}
}

// cluster is simulated workers, a control plane and proxies in this process, as
// controlplane/harness_test.go builds them.
type cluster struct {
	lg      *slog.Logger
	workers []*sim.Worker
	stops   []func()
	specs   []registry.Worker
	dataDir string
	cp      *controlplane.Server
	xds     string
	proxies []*proxy.Server
}

type clusterOpts struct {
	workers   int
	speedup   float64
	gpuBlocks int
}

func newCluster(o clusterOpts, lg *slog.Logger) (*cluster, error) {
	codec, err := codecOnce()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "bench-xds-")
	if err != nil {
		return nil, err
	}
	c := &cluster{lg: lg, dataDir: dir}
	for i := range o.workers {
		cfg := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec,
			Events: kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}}
		cfg.Engine.NumGPUBlocks = o.gpuBlocks
		cfg.Engine.Timing.Speedup = o.speedup
		w, err := sim.NewWorker(cfg)
		if err != nil {
			c.close()
			return nil, err
		}
		ctx, cancel := context.WithCancel(context.Background())
		if err := w.Start(ctx); err != nil {
			cancel()
			c.close()
			return nil, err
		}
		done := make(chan struct{})
		go func() { _ = w.Run(ctx); close(done) }()
		c.stops = append(c.stops, func() { cancel(); <-done; w.Close() })
		c.workers = append(c.workers, w)
		c.specs = append(c.specs, registry.Worker{
			ID: "w" + strconv.Itoa(i), URL: w.URL(), BlockSize: 16, Engine: "sim",
			KVEvents: w.EventsEndpoint(), KVEventsReplay: w.ReplayEndpoint(),
		})
	}
	return c, nil
}

func (c *cluster) startControlPlane(xdsAddr string) error {
	cp, err := controlplane.New(controlplane.Options{
		XDSListen:      xdsAddr,
		DataDir:        c.dataDir,
		Workers:        c.specs,
		Adapters:       adapters(),
		ScrapeInterval: 50 * time.Millisecond,
		Logger:         c.lg,
	})
	if err != nil {
		return err
	}
	if err := cp.Start(context.Background()); err != nil {
		cp.Close()
		return err
	}
	c.cp = cp
	c.xds = cp.XDSAddr()
	return nil
}

// addProxy starts a proxy following the control plane (xds) or, with upstreams, a proxy in
// approximate mode over the workers.
func (c *cluster) addProxy(mod func(*proxy.Config)) (*proxy.Server, error) {
	cfg := proxy.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.XDS = c.xds
	cfg.NodeID = "proxy-" + strconv.Itoa(len(c.proxies))
	cfg.ExposeWorkerHeader = true
	cfg.EventLoops = 1
	cfg.XDSSyncTimeout = 10 * time.Second
	if mod != nil {
		mod(&cfg)
	}
	p, err := proxy.New(cfg, c.lg)
	if err != nil {
		return nil, err
	}
	if err := p.Start(context.Background()); err != nil {
		return nil, err
	}
	c.proxies = append(c.proxies, p)
	return p, nil
}

// staticUpstreams is the approximate-mode configuration over the cluster's workers.
func (c *cluster) staticUpstreams(cfg *proxy.Config) {
	cfg.XDS = ""
	cfg.Upstreams = nil
	for _, s := range c.specs {
		cfg.Upstreams = append(cfg.Upstreams, proxy.Upstream{ID: s.ID, URL: s.URL, Model: model, BlockSize: 16})
	}
}

func (c *cluster) close() {
	for _, p := range c.proxies {
		_ = p.Close()
	}
	if c.cp != nil {
		_ = c.cp.Close()
	}
	var wg sync.WaitGroup
	for _, s := range c.stops {
		wg.Add(1)
		go func() { defer wg.Done(); s() }()
	}
	wg.Wait()
	os.RemoveAll(c.dataDir)
}

// waitWorkers waits until p routes over n non-draining workers.
func waitWorkers(p *proxy.Server, n int) error {
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		ok := 0
		for _, w := range p.Workers() {
			if !w.Draining() {
				ok++
			}
		}
		if ok == n {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("proxy %s has %d workers, want %d healthy", p.Addr(), len(p.Workers()), n)
}

// waitBlocks waits until the control plane's index has at least n blocks and stopped
// growing, and every proxy's replica holds as many.
func (c *cluster) waitBlocks(n int) error {
	deadline := time.Now().Add(15 * time.Second)
	for last := -1; ; {
		l := c.cp.Index().Len()
		if l >= n && l == last {
			n = l
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("control plane index has %d blocks, want %d", l, n)
		}
		last = l
		time.Sleep(100 * time.Millisecond)
	}
	for _, p := range c.proxies {
		r := p.Replica()
		if r == nil {
			continue
		}
		for r.Len() < n {
			if time.Now().After(deadline) {
				return fmt.Errorf("proxy %s replica has %d blocks, want %d", p.Addr(), r.Len(), n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	return nil
}

// reply is what one chat completion returned.
type reply struct {
	status         int
	worker         string
	prompt, cached int
	err            string
	latency        time.Duration
}

var httpClient = &http.Client{
	Transport: &http.Transport{MaxIdleConns: 256, MaxIdleConnsPerHost: 64, IdleConnTimeout: 90 * time.Second},
	Timeout:   60 * time.Second,
}

func chat(base, system, user string, maxTokens int) reply {
	body, _ := json.Marshal(map[string]any{
		"model": model, "max_tokens": maxTokens,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}},
	})
	t0 := time.Now()
	resp, err := httpClient.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return reply{err: err.Error(), latency: time.Since(t0)}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	r := reply{status: resp.StatusCode, worker: resp.Header.Get("x-kvrelay-worker"), latency: time.Since(t0)}
	var out struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != 200 {
		r.err = strings.TrimSpace(string(b))
		if len(r.err) > 200 {
			r.err = r.err[:200]
		}
	}
	r.prompt, r.cached = out.Usage.PromptTokens, out.Usage.PromptTokensDetails.CachedTokens
	return r
}

// family is a long prompt (about 2.8k tokens) unique to f, as in the harness tests.
func family(f int) string {
	var sb strings.Builder
	for i := range 700 {
		fmt.Fprintf(&sb, "family%d word%d ", f, i)
	}
	return sb.String()
}
