package benchharness

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// ports is where one run's processes listen, all on 127.0.0.1: engines base+1…base+9,
// the render sidecar +10, the router +80 (and its admin +81), the picker +90…92, KV events
// +100, the control plane +200/201.
type ports struct {
	engines             []int
	render              int // EPP precise's tokenizer sidecar (not an endpoint)
	router              int // the gateway or kvrelay proxy: the benchmark's target
	gatewayAdmin        int
	eppGRPC, eppHealth  int
	eppMetrics          int
	zmq                 int // the KV event endpoint the router binds and engines connect to
	cpXDS, cpAPI        int
	numEngines, baseNum int
}

func newPorts(base, n int) ports {
	p := ports{
		render: base + 10, router: base + 80, gatewayAdmin: base + 81,
		eppGRPC: base + 90, eppHealth: base + 91, eppMetrics: base + 92,
		zmq: base + 100, cpXDS: base + 200, cpAPI: base + 201,
		numEngines: n, baseNum: base,
	}
	for i := 1; i <= n; i++ {
		p.engines = append(p.engines, base+i)
	}
	return p
}

func (p ports) all() []int {
	return append(append([]int(nil), p.engines...), p.render, p.router, p.gatewayAdmin,
		p.eppGRPC, p.eppHealth, p.eppMetrics, p.zmq, p.cpXDS, p.cpAPI)
}

func (p ports) zmqEndpoint() string { return fmt.Sprintf("tcp://127.0.0.1:%d", p.zmq) }

func addr(port int) string { return fmt.Sprintf("127.0.0.1:%d", port) }

// stack is one run's processes: engines and a router.
type stack struct {
	cfg    *Config
	fleet  Fleet
	engine string
	router string
	dir    string // the run's log directory
	p      ports

	// what the measurement reads after the run
	routerMetrics string // URL of the router's Prometheus metrics (EPP or kvrelay proxy)
	cpMetrics     string // control plane's metrics, exact routers
	gatewayPicks  string // the gateway's per-request pick times, EPP routers
}

// up starts the engines and the router and waits until the router can serve.
func (s *stack) up(ctx context.Context) error {
	if err := s.startEngines(ctx); err != nil {
		return err
	}
	var err error
	switch {
	case IsEPP(s.router):
		err = s.startEPP(ctx)
	case IsKEPP(s.router):
		err = s.startKVRelayEPP(ctx)
	case IsExact(s.router):
		err = s.startKVRelayExact(ctx)
	default:
		err = s.startKVRelayApprox(ctx)
	}
	if err != nil {
		return err
	}
	// Let the router's first metric scrapes of the engines land before the load starts.
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(s.cfg.Settle):
	}
	if dead := procs.dead(); len(dead) > 0 {
		return fmt.Errorf("%s", strings.Join(dead, "; "))
	}
	return nil
}

func (s *stack) engineID(i int) string { return fmt.Sprintf("e%d", i+1) }

func (s *stack) topic(port int) string {
	return fmt.Sprintf("kv@127.0.0.1:%d@%s", port, s.cfg.Model)
}

func (s *stack) startEngines(ctx context.Context) error {
	var ps []*proc
	for i, port := range s.p.engines {
		var p *proc
		var err error
		name := "engine-" + s.engineID(i)
		if s.engine == EngineLLMD {
			p, err = procs.start(s.dir, name, []string{"POD_IP=127.0.0.1"}, s.cfg.SimBin, s.fleet.LLMDArgs(i, port, s.cfg.Model, s.p.zmqEndpoint())...)
		} else {
			p, err = procs.start(s.dir, name, nil, s.cfg.KVRelayBin, s.fleet.SimArgs(i, addr(port), s.cfg.Model, s.p.zmqEndpoint(), s.topic(port))...)
		}
		if err != nil {
			return err
		}
		ps = append(ps, p)
	}
	for i, port := range s.p.engines {
		if err := waitHTTP(ctx, "http://"+addr(port)+"/v1/models", ps[i], 30*time.Second); err != nil {
			return err
		}
	}
	return nil
}

// startEPP starts the llm-d endpoint picker (file discovery, no Kubernetes) and the Envoy
// stand-in in front of it; precise mode also a tokenizer sidecar for the picker's render
// calls, tokenizing as the engines do.
func (s *stack) startEPP(ctx context.Context) error {
	mode := strings.TrimPrefix(s.router, "epp-")
	var eps strings.Builder
	eps.WriteString("endpoints:\n")
	for i, port := range s.p.engines {
		fmt.Fprintf(&eps, "  - name: sim-%d\n    address: \"127.0.0.1\"\n    port: \"%d\"\n", i+1, port)
	}
	epFile := filepath.Join(s.dir, "endpoints.yaml")
	if err := os.WriteFile(epFile, []byte(eps.String()), 0o644); err != nil {
		return err
	}
	tmpl, err := os.ReadFile(filepath.Join(s.cfg.Root, "hack/bench-llmd", "epp-"+mode+".yaml"))
	if err != nil {
		return err
	}
	renderURL := "http://" + addr(s.p.render)
	conf := strings.NewReplacer("@ENDPOINTS_FILE@", epFile, "@MODEL@", s.cfg.Model,
		"@RENDER_URL@", renderURL, "@ZMQ_ENDPOINT@", s.p.zmqEndpoint()).Replace(string(tmpl))
	confFile := filepath.Join(s.dir, "epp.yaml")
	if err := os.WriteFile(confFile, []byte(conf), 0o644); err != nil {
		return err
	}
	if mode == "precise" {
		var rp *proc
		if s.engine == EngineLLMD {
			rp, err = procs.start(s.dir, "render", []string{"POD_IP=127.0.0.1"}, s.cfg.SimBin,
				"--port", fmt.Sprint(s.p.render), "--model", s.cfg.Model, "--force-dummy-tokenizer",
				"--max-model-len", fmt.Sprint(s.fleet.MaxModelLen))
		} else {
			rp, err = procs.start(s.dir, "render", nil, s.cfg.KVRelayBin, "sim",
				"--listen", addr(s.p.render), "--model", s.cfg.Model, "--max-model-len", fmt.Sprint(s.fleet.MaxModelLen))
		}
		if err != nil {
			return err
		}
		if err := waitHTTP(ctx, renderURL+"/v1/models", rp, 30*time.Second); err != nil {
			return err
		}
	}
	epp, err := procs.start(s.dir, "epp", nil, s.cfg.EPPBin, "--config-file", confFile,
		"--pool-name", "llmd-bench", "--pool-namespace", "bench",
		"--grpc-port", fmt.Sprint(s.p.eppGRPC), "--grpc-health-port", fmt.Sprint(s.p.eppHealth),
		"--metrics-port", fmt.Sprint(s.p.eppMetrics), "--secure-serving=false",
		"--metrics-endpoint-auth=false", "--tracing=false", "--enable-pprof=false", "--health-checking",
		"--drain-timeout=1s", "-v", "1")
	if err != nil {
		return err
	}
	s.routerMetrics = "http://" + addr(s.p.eppMetrics) + "/metrics"
	if err := waitHTTP(ctx, s.routerMetrics, epp, 60*time.Second); err != nil {
		return err
	}
	// Ready once the picker has discovered every endpoint.
	want := float64(len(s.p.engines))
	err = waitFor(ctx, epp, 30*time.Second, "EPP ready endpoints", func() bool {
		fams, err := scrape(s.routerMetrics)
		if err != nil {
			return false
		}
		for _, n := range []string{"llm_d_epp_ready_endpoints", "inference_pool_ready_pods", "inference_extension_ready_pods"} {
			if v, ok := gaugeSum(fams, n); ok {
				return v >= want
			}
		}
		return true // no such gauge in this EPP version: the metrics endpoint is all we have
	})
	if err != nil {
		return err
	}
	if err := waitTCP(ctx, addr(s.p.eppGRPC), epp, 30*time.Second); err != nil {
		return err
	}
	return s.startGateway(ctx)
}

// startGateway starts the Envoy stand-in in front of the picker on the EPP port.
func (s *stack) startGateway(ctx context.Context) error {
	gw, err := procs.start(s.dir, "gateway", nil, s.cfg.GatewayBin, "--listen", addr(s.p.router),
		"--epp", addr(s.p.eppGRPC), "--admin-listen", addr(s.p.gatewayAdmin))
	if err != nil {
		return err
	}
	s.gatewayPicks = "http://" + addr(s.p.gatewayAdmin) + "/picks"
	if err := waitTCP(ctx, addr(s.p.router), gw, 30*time.Second); err != nil {
		return err
	}
	return waitHTTP(ctx, s.gatewayPicks, gw, 30*time.Second)
}

// startKVRelayEPP runs kvrelay epp (the latency policy) behind the gateway: on the control
// plane's index with the engines' tokenization (exact), or on its own approximate index.
func (s *stack) startKVRelayEPP(ctx context.Context) error {
	args := []string{"epp", "--listen", addr(s.p.eppGRPC), "--health-listen", addr(s.p.eppHealth),
		"--metrics-listen", addr(s.p.eppMetrics)}
	if IsExact(s.router) {
		if _, err := s.startControlPlane(ctx); err != nil {
			return err
		}
		args = append(args, "--xds", addr(s.p.cpXDS))
		if s.cfg.ExactTok != "" {
			args = append(args, "--tokenizer", s.cfg.ExactTok)
		}
	} else {
		args = append(args, "--policy", KVRelayPolicy(s.router))
		args = append(args, s.cfg.PolicyArgs...)
		if s.cfg.ApproxTok != "" {
			args = append(args, "--tokenizer", s.cfg.ApproxTok)
		}
		args = append(args, s.upstreams()...)
	}
	args = append(args, s.cfg.ProxyArgs...)
	epp, err := procs.start(s.dir, "kvrelay-epp", nil, s.cfg.KVRelayBin, args...)
	if err != nil {
		return err
	}
	s.routerMetrics = "http://" + addr(s.p.eppMetrics) + "/metrics"
	if err := waitHTTP(ctx, s.routerMetrics, epp, 30*time.Second); err != nil {
		return err
	}
	want := float64(len(s.p.engines))
	err = waitFor(ctx, epp, 30*time.Second, "kvrelay epp following its workers", func() bool {
		fams, err := scrape(s.routerMetrics)
		if err != nil {
			return false
		}
		if !IsExact(s.router) {
			return true
		}
		conn, _ := gaugeSum(fams, "kvrelay_proxy_xds_connected")
		ws, _ := gaugeSum(fams, "kvrelay_proxy_xds_workers")
		return conn == 1 && ws >= want
	})
	if err != nil {
		return err
	}
	if err := waitTCP(ctx, addr(s.p.eppGRPC), epp, 30*time.Second); err != nil {
		return err
	}
	return s.startGateway(ctx)
}

// proxyCommon are the flags every kvrelay proxy of the comparison runs with.
func (s *stack) proxyCommon() []string {
	// The proxy's admin listener takes the gateway's admin port (kvrelay's stacks run no
	// gateway): its learned latency models are saved after each run.
	return []string{"proxy", "--listen", addr(s.p.router), "--admin-listen", addr(s.p.gatewayAdmin), "--expose-worker-header", "--ebpf", "off"}
}

// upstreams are the --upstream flags of a kvrelay router without a control plane: each
// engine's id, URL, model and KV cache size in blocks, which llm-d's EPP reads from the
// engines' vllm:cache_config_info. No scheduler limits (max-num-seqs, token budget): the
// EPP is not told them either, so kvrelay has to learn them from the engines.
func (s *stack) upstreams() []string {
	var args []string
	for i, port := range s.p.engines {
		args = append(args, "--upstream", fmt.Sprintf("id=%s,url=http://%s,model=%s,capacity=%d",
			s.engineID(i), addr(port), s.cfg.Model, s.fleet.blocks(i)))
	}
	return args
}

func (s *stack) engineKind() string {
	if s.engine == EngineLLMD {
		return "vllm"
	}
	return "sim"
}

// startKVRelayApprox runs the proxy alone: on its own approximate prefix index (kv,
// latency), or as a baseline (round-robin, least-request).
func (s *stack) startKVRelayApprox(ctx context.Context) error {
	args := append(s.proxyCommon(), "--policy", KVRelayPolicy(s.router))
	if !isBaseline(s.router) {
		args = append(args, s.cfg.PolicyArgs...)
		args = append(args, s.cfg.ProxyArgs...)
	}
	if s.cfg.ApproxTok != "" {
		args = append(args, "--tokenizer", s.cfg.ApproxTok)
	}
	args = append(args, s.upstreams()...)
	px, err := procs.start(s.dir, "proxy", nil, s.cfg.KVRelayBin, args...)
	if err != nil {
		return err
	}
	s.routerMetrics = "http://" + addr(s.p.router) + "/metrics"
	return waitHTTP(ctx, "http://"+addr(s.p.router)+"/v1/models", px, 30*time.Second)
}

// startKVRelayExact runs the control plane, then the proxy on the control plane's index.
func (s *stack) startKVRelayExact(ctx context.Context) error {
	version, err := s.startControlPlane(ctx)
	if err != nil {
		return err
	}
	want := len(s.p.engines)
	args := append(s.proxyCommon(), "--xds", addr(s.p.cpXDS))
	if s.router == RouterLatencyQuery {
		args = append(args, "--index-query")
	}
	args = append(args, s.cfg.ProxyArgs...)
	if s.cfg.ExactTok != "" {
		args = append(args, "--tokenizer", s.cfg.ExactTok)
	}
	px, err := procs.start(s.dir, "proxy", nil, s.cfg.KVRelayBin, args...)
	if err != nil {
		return err
	}
	s.routerMetrics = "http://" + addr(s.p.router) + "/metrics"
	if err := waitHTTP(ctx, "http://"+addr(s.p.router)+"/v1/models", px, 30*time.Second); err != nil {
		return err
	}
	// The pushed workers and policy in force.
	return waitFor(ctx, px, 30*time.Second, "proxy following the control plane", func() bool {
		fams, err := scrape(s.routerMetrics)
		if err != nil {
			return false
		}
		conn, _ := gaugeSum(fams, "kvrelay_proxy_xds_connected")
		ws, _ := gaugeSum(fams, "kvrelay_proxy_xds_workers")
		pv, _ := gaugeSum(fams, "kvrelay_proxy_xds_policy_version")
		return conn == 1 && ws >= float64(want) && pv >= version
	})
}

// startControlPlane runs the control plane (the engines' KV events on one bound endpoint,
// told apart by topic), sets the router's policy and waits until every worker is healthy;
// it returns the policy's version.
func (s *stack) startControlPlane(ctx context.Context) (float64, error) {
	tok := make([]byte, 16)
	_, _ = rand.Read(tok)
	tokFile := filepath.Join(s.dir, "api-token")
	if err := os.WriteFile(tokFile, []byte(hex.EncodeToString(tok)), 0o600); err != nil {
		return 0, err
	}
	dataDir := filepath.Join(s.dir, "cp-data")
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return 0, err
	}
	args := []string{"controlplane", "--xds-listen", addr(s.p.cpXDS), "--api-listen", addr(s.p.cpAPI),
		"--data-dir", dataDir, "--api-token-file", tokFile, "--ebpf", "off"}
	// Each worker's id, URL, model, block size (the EPP's precise index is told it too) and
	// KV event endpoint; no scheduler limits (see upstreams).
	for i, port := range s.p.engines {
		args = append(args, "--worker", fmt.Sprintf("id=%s,url=http://%s,model=%s,block-size=%d,kv-events-bind=%s,engine=%s",
			s.engineID(i), addr(port), s.cfg.Model, s.fleet.BlockSize, s.p.zmqEndpoint(), s.engineKind()))
	}
	cp, err := procs.start(s.dir, "controlplane", nil, s.cfg.KVRelayBin, args...)
	if err != nil {
		return 0, err
	}
	s.cpMetrics = "http://" + addr(s.p.cpAPI) + "/metrics"
	if err := waitHTTP(ctx, s.cpMetrics, cp, 30*time.Second); err != nil {
		return 0, err
	}
	policy := KVRelayPolicy(s.router)
	out, err := s.ctl(ctx, tokFile, append([]string{"policy", "set", "--policy", policy}, s.cfg.PolicyArgs...)...)
	if err != nil {
		return 0, fmt.Errorf("kvrelay ctl policy set --policy %s: %v: %s", policy, err, out)
	}
	out, err = s.ctl(ctx, tokFile, "-o", "json", "policy")
	if err != nil {
		return 0, fmt.Errorf("kvrelay ctl policy: %v: %s", err, out)
	}
	version := policyVersion(out)
	// Every worker registered and healthy (its metrics scraped) before the proxy starts.
	want := len(s.p.engines)
	var last string
	err = waitFor(ctx, cp, 30*time.Second, "control plane workers healthy", func() bool {
		out, err := s.ctl(ctx, tokFile, "-o", "json", "workers")
		if err != nil {
			return false
		}
		last = out
		return countHealthy(out) >= want
	})
	if err != nil {
		return 0, fmt.Errorf("%v; last `kvrelay ctl workers -o json`: %s", err, last)
	}
	return version, nil
}

func (s *stack) ctl(ctx context.Context, tokFile string, args ...string) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	full := append([]string{"ctl", "--api", addr(s.p.cpAPI), "--token-file", tokFile}, args...)
	out, err := exec.CommandContext(cctx, s.cfg.KVRelayBin, full...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// countHealthy counts the healthy workers in `kvrelay ctl -o json workers` output:
// {"workers": [{"spec": {...}, "status": {"healthy": true, ...}}, ...]}.
func countHealthy(out string) int {
	var v struct {
		Workers []struct {
			Status struct {
				Healthy bool `json:"healthy"`
			} `json:"status"`
		} `json:"workers"`
	}
	if json.Unmarshal([]byte(out), &v) != nil {
		return 0
	}
	n := 0
	for _, w := range v.Workers {
		if w.Status.Healthy {
			n++
		}
	}
	return n
}

// policyVersion reads the version of `kvrelay ctl -o json policy` output.
func policyVersion(out string) float64 {
	var v struct {
		Version json.Number `json:"version"`
	}
	if json.Unmarshal([]byte(out), &v) != nil {
		return 0
	}
	f, _ := v.Version.Float64()
	return f
}

// isBaseline reports whether router is a kvrelay proxy running a load-balancing baseline,
// which takes no policy flags.
func isBaseline(router string) bool {
	return router == RouterRoundRobin || router == RouterLeastRequest
}
