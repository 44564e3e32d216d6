package controlplane_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/ebpf"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/sim/simtest"
	"github.com/kvrelay/kvrelay/xds/auth"
	"github.com/kvrelay/kvrelay/xds/auth/authtest"
)

const model = "gpt-oss-120b"

var codecOnce = sync.OnceValues(func() (sim.Codec, error) { return sim.NewCodec(model, "", "") })

func quiet() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.DiscardHandler)
}

// cluster is a control plane, its proxies and simulated workers in one test process: the
// harness the control-plane tests share.
type cluster struct {
	t       *testing.T
	workers []*sim.Worker
	specs   []registry.Worker
	dataDir string
	cp      *controlplane.Server
	xds     string
	proxies []*proxy.Server
	warmed  map[int]map[int]bool // worker index → the families warmed on it
	xdsAuth auth.ServerConfig    // what the control plane asks of proxies
	cpOpts  func(*controlplane.Options)
}

// workerSpeedup is the simulated workers' speedup ratio (tests that need requests to last
// lower it for their own cluster).
var workerSpeedup = 50.0

// workerLoRAs are the LoRA adapters the simulated workers serve (tests that need some set
// it for their own cluster).
var workerLoRAs []string

func startWorkers(t *testing.T, n int, roles ...sim.Role) []*sim.Worker {
	t.Helper()
	codec, err := codecOnce()
	if err != nil {
		t.Fatal(err)
	}
	var ws []*sim.Worker
	for range n {
		cfg := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec,
			Events: kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}}
		cfg.Engine.NumGPUBlocks = 4096
		cfg.Engine.Timing.Speedup = workerSpeedup
		cfg.Engine.LoRAModules = workerLoRAs
		if i := len(ws); i < len(roles) {
			cfg.Engine.Role = roles[i]
		}
		ws = append(ws, simtest.Start(t, cfg))
	}
	return ws
}

func newCluster(t *testing.T, nworkers int) *cluster {
	t.Helper()
	return newClusterWith(t, nworkers, auth.ServerConfig{})
}

// newClusterWith is newCluster with a control plane that checks xDS credentials.
func newClusterWith(t *testing.T, nworkers int, xdsAuth auth.ServerConfig) *cluster {
	t.Helper()
	c := &cluster{t: t, workers: startWorkers(t, nworkers), dataDir: t.TempDir(), xdsAuth: xdsAuth}
	for i, w := range c.workers {
		c.specs = append(c.specs, specOf(i, w.URL(), w.EventsEndpoint(), w.ReplayEndpoint()))
	}
	c.startControlPlane("127.0.0.1:0")
	return c
}

// specOf is the registry entry of the harness's i-th simulated worker.
func specOf(i int, url, events, replay string) registry.Worker {
	return registry.Worker{ID: "w" + strconv.Itoa(i), URL: url, BlockSize: 16, Engine: "sim",
		KVEvents: events, KVEventsReplay: replay, LoRAModules: workerLoRAs}
}

func (c *cluster) startControlPlane(xdsAddr string) {
	c.t.Helper()
	opts := controlplane.Options{
		XDSListen:      xdsAddr,
		XDSAuth:        c.xdsAuth,
		APIListen:      "127.0.0.1:0",
		DataDir:        c.dataDir,
		Workers:        c.specs,
		ScrapeInterval: 50 * time.Millisecond,
		LoadRefresh:    100 * time.Millisecond,
		APIToken:       "secret",
		Logger:         quiet(),
	}
	if c.cpOpts != nil {
		c.cpOpts(&opts)
	}
	cp, err := controlplane.New(opts)
	if err != nil {
		c.t.Fatal(err)
	}
	if err := cp.Start(context.Background()); err != nil {
		c.t.Fatal(err)
	}
	c.cp = cp
	c.xds = cp.XDSAddr()
	c.t.Cleanup(func() { _ = cp.Close() })
}

// addProxy starts a proxy following the control plane at xds.
func (c *cluster) addProxy(xds string) *proxy.Server {
	c.t.Helper()
	return c.addProxyWith(xds, nil)
}

// addProxyWith starts a proxy following the control plane at xds, its config changed by mut.
func (c *cluster) addProxyWith(xds string, mut func(*proxy.Config)) *proxy.Server {
	c.t.Helper()
	cfg := proxy.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.XDS = xds
	cfg.NodeID = "proxy-" + strconv.Itoa(len(c.proxies))
	cfg.ExposeWorkerHeader = true
	cfg.EventLoops = 1
	cfg.XDSSyncTimeout = 10 * time.Second
	// No exploration: these tests assert where requests go, and proxies that have learned
	// nothing of the workers (warm-ups go to them directly) would send one decision in 64
	// to a worker at random.
	cfg.Explore = 0
	if mut != nil {
		mut(&cfg)
	}
	p, err := proxy.New(cfg, quiet())
	if err != nil {
		c.t.Fatal(err)
	}
	if err := p.Start(context.Background()); err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { _ = p.Close() })
	c.proxies = append(c.proxies, p)
	return p
}

// waitWorkers waits until p routes over n healthy workers.
func waitWorkers(t *testing.T, p *proxy.Server, n int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		healthy := 0
		for _, w := range p.Workers() {
			if !w.Draining() {
				healthy++
			}
		}
		if healthy == n {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("proxy %s has %d workers, want %d healthy", p.Addr(), len(p.Workers()), n)
}

type reply struct {
	status   int
	worker   string
	cached   int
	body     string
	decision string // x-kvrelay-decision, when the proxy exposes it
}

func chat(t *testing.T, base string, system, user string) reply {
	t.Helper()
	return chatAs(t, base, model, "", system, user)
}

// chatAs is chat naming a model (or LoRA adapter) and a cache salt ("": none).
func chatAs(t *testing.T, base, model, salt, system, user string) reply {
	t.Helper()
	return chatWith(t, base, model, salt, "", system, user)
}

// chatWith is chatAs sending key as the bearer ("": no Authorization).
func chatWith(t *testing.T, base, model, salt, key, system, user string) reply {
	t.Helper()
	req := map[string]any{
		"model": model, "max_tokens": 4,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}},
	}
	if salt != "" {
		req["cache_salt"] = salt
	}
	body, _ := json.Marshal(req)
	hr, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	hr.Header.Set("Content-Type", "application/json")
	if key != "" {
		hr.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		return reply{body: err.Error()}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Usage struct {
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	_ = json.Unmarshal(b, &out)
	return reply{status: resp.StatusCode, worker: resp.Header.Get("x-kvrelay-worker"), cached: out.Usage.PromptTokensDetails.CachedTokens,
		body: string(b), decision: resp.Header.Get("x-kvrelay-decision")}
}

func family(f int) string {
	var sb strings.Builder
	for i := range 700 {
		fmt.Fprintf(&sb, "family%d word%d ", f, i)
	}
	return sb.String()
}

// waitBlocks waits until the control plane's index holds at least n blocks and has stopped
// growing, every worker holds at least 150 blocks per family warmed on it, and every proxy's
// replica holds as many.
func (c *cluster) waitBlocks(n int) {
	c.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	// At least n blocks, each warmed worker's share, and no change for 300 ms: on a loaded
	// machine one worker's events can lag the others' by more than one poll, and the total
	// alone can be reached before the slowest worker's blocks arrive.
	for last, stable := -1, 0; ; {
		l := c.cp.Index().Len()
		if l >= n && l == last && c.warmedIndexed() {
			stable++
		} else {
			stable = 0
		}
		if stable >= 3 {
			n = l
			break
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("control plane index has %d blocks, want %d", l, n)
		}
		last = l
		time.Sleep(100 * time.Millisecond)
	}
	for _, p := range c.proxies {
		for p.Remote() == nil && p.Replica().Len() < n { // a proxy asking the index keeps no replica
			if time.Now().After(deadline) {
				c.t.Fatalf("proxy %s replica has %d blocks, want %d (control plane index %d)", p.Addr(), p.Replica().Len(), n, c.cp.Index().Len())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// warmedIndexed says whether the control plane's index holds, for each worker, at least 150
// blocks (a family's prompt is about 180) per family warmed on it, across tiers. A per-worker
// sum: it catches a worker whose events lag behind the others', not a family half indexed
// beside a complete one.
func (c *cluster) warmedIndexed() bool {
	for i, fams := range c.warmed {
		held := 0
		for _, n := range c.cp.Index().Blocks(c.specs[i].ID) {
			held += n
		}
		if held < 150*len(fams) {
			return false
		}
	}
	return true
}

// warm sends each family's prompt straight to worker f % len(workers), bypassing proxies.
func (c *cluster) warm(families int) {
	c.t.Helper()
	if c.warmed == nil {
		c.warmed = map[int]map[int]bool{}
	}
	for f := range families {
		i := f % len(c.workers)
		if c.warmed[i] == nil {
			c.warmed[i] = map[int]bool{}
		}
		c.warmed[i][f] = true
		w := c.workers[i]
		if r := chat(c.t, w.URL(), family(f), "warm"); r.status != 200 {
			c.t.Fatalf("warming family %d: %d %s", f, r.status, r.body)
		}
	}
}

// checkExposition fails unless each URL's answer (a metrics page) holds its string.
func checkExposition(t *testing.T, want map[string]string) {
	t.Helper()
	for url, w := range want {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(b), w) {
			t.Errorf("%s lacks %q", url, w)
		}
	}
}

// TestPrecisionThroughProxies: two proxies following one control plane route each warmed
// family to the worker caching it, from their replicas of its index. The policy is kv:
// routing on the cache alone, which is what this checks; the latency policy weighs its
// predictions' spread and the workers' load beside the cache, and on a machine loaded by
// other tests it has sent a warmed family elsewhere.
func TestPrecisionThroughProxies(t *testing.T) {
	c := newCluster(t, 4)
	pol := c.cp.Registry().Policy()
	pol.Name = "kv"
	if _, err := c.cp.Registry().SetPolicy(pol); err != nil {
		t.Fatal(err)
	}
	p0, p1 := c.addProxy(c.xds), c.addProxy(c.xds)
	waitWorkers(t, p0, 4)
	waitWorkers(t, p1, 4)
	c.warm(8)
	c.waitBlocks(8 * 150) // each family's prompt is about 180 blocks
	checkExposition(t, map[string]string{
		"http://" + p0.Addr() + "/metrics":      "kvrelay_proxy_xds_connected 1",
		"http://" + c.cp.APIAddr() + "/metrics": "kvrelay_controlplane_proxies 2",
	})
	// One proxy at a time: the other proxy's requests, finished a moment ago, still count in
	// the fleet-wide load until its next report (100 ms) reaches this one.
	for _, p := range []*proxy.Server{p0, p1} {
		time.Sleep(300 * time.Millisecond)
		for f := range 8 {
			want := "w" + strconv.Itoa(f%4)
			r := chat(t, "http://"+p.Addr(), family(f), "variant "+p.Addr())
			if r.status != 200 || r.worker != want || r.cached == 0 {
				t.Errorf("family %d via %s: status %d worker %q cached %d, want %s with cached tokens", f, p.Addr(), r.status, r.worker, r.cached, want)
			}
		}
	}
}

func TestProxiesKeepRoutingWithoutTheControlPlaneAndResync(t *testing.T) {
	c := newCluster(t, 4)
	p := c.addProxy(c.xds)
	waitWorkers(t, p, 4)
	c.warm(4)
	c.waitBlocks(4 * 150)

	addr := c.xds
	_ = c.cp.Close()
	for f := range 4 {
		r := chat(t, "http://"+p.Addr(), family(f), "while the control plane is down")
		if r.status != 200 || r.worker != "w"+strconv.Itoa(f) {
			t.Fatalf("control plane down, family %d: status %d worker %q: %s\nproxy's workers: %s", f, r.status, r.worker, r.body, workerStates(p))
		}
	}

	// The control plane comes back on the same address with the same data dir: the proxy
	// resubscribes by itself, and the rebuilt index (replayed by the engines) reaches it.
	downAt := time.Now()
	c.startControlPlane(addr)
	before := p.Replica().Len()
	c.warm(8) // families 4..7 are new
	c.waitBlocks(before + 4*150)
	st, _ := p.XDSStats()
	t.Logf("resynced %v after restart: ads streams %d, journal streams %d, replica %d blocks", time.Since(downAt).Round(time.Millisecond), st.ADS.Streams, st.Journal.Streams, st.Blocks)
	if st.ADS.Streams < 2 || st.Journal.Streams < 2 {
		t.Fatalf("the proxy did not reconnect: %+v", st)
	}
	for f := 4; f < 8; f++ {
		if r := chat(t, "http://"+p.Addr(), family(f), "after resync"); r.status != 200 || r.worker != "w"+strconv.Itoa(f%4) {
			t.Fatalf("after resync, family %d: status %d worker %q\nproxy's workers: %s", f, r.status, r.worker, workerStates(p))
		}
	}
}

// workerLoad is the load the proxy sees on worker id, -1 if it does not know the worker.
func workerLoad(p *proxy.Server, id string) int64 {
	for _, w := range p.Workers() {
		if w.ID == id {
			return w.Load()
		}
	}
	return -1
}

// workerStates describes what a proxy knows of each worker, for a failed routing assertion:
// whether it is draining (as last pushed: a worker the control plane saw unhealthy stays so
// while it is down), ejected, and its load.
// waitKnown waits until p knows the model and KV capacity of n workers: until the control
// plane has scraped them, a push that adds them replaces the proxy's Worker values, and the
// load counted on the old ones is not on the new.
func waitKnown(t *testing.T, p *proxy.Server, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		known := 0
		for _, w := range p.Workers() {
			if w.Model != "" && w.Capacity > 0 {
				known++
			}
		}
		if known == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("workers' model and capacity never reached the proxy: %s", workerStates(p))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func workerStates(p *proxy.Server) string {
	var sb strings.Builder
	for _, w := range p.Workers() {
		inflight, prefill, decode := w.Own()
		fmt.Fprintf(&sb, "\n  %s draining=%v ejected_until=%v inflight=%d prefill_tokens=%d decode_blocks=%d (with reports: load %d prefill %d decode %d)",
			w.ID, w.Draining(), w.EjectedUntil(), inflight, prefill, decode, w.Load(), w.PrefillTokens(), w.DecodeBlocks())
	}
	return sb.String()
}

// relay listens on loopback and joins each connection it accepts to one that dial makes,
// copying each direction with pipe (which closes its dst when src ends).
func relay(t *testing.T, dial func() (net.Conn, error), pipe func(dst, src net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := dial()
			if err != nil {
				conn.Close()
				continue
			}
			go pipe(up, conn)
			go pipe(conn, up)
		}
	}()
	return ln.Addr().String()
}

// delayRelay forwards TCP connections to target, holding every chunk for delay in each
// direction: a control plane 50 ms away.
func delayRelay(t *testing.T, target string, delay time.Duration) string {
	t.Helper()
	pipe := func(dst, src net.Conn) {
		type chunk struct {
			at time.Time
			b  []byte
		}
		q := make(chan chunk, 1024)
		go func() {
			for c := range q {
				time.Sleep(time.Until(c.at))
				if _, err := dst.Write(c.b); err != nil {
					return
				}
			}
			dst.Close()
		}()
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				q <- chunk{time.Now().Add(delay), buf[:n]}
			}
			if err != nil {
				close(q)
				return
			}
		}
	}
	return relay(t, func() (net.Conn, error) { return net.Dial("tcp", target) }, pipe)
}

// TestNoControlPlaneCallOnTheRequestPath: a proxy whose control plane is 250 ms away (half a
// second a round trip) serves requests as fast as one beside it. Requests alternate between
// the two proxies, so that a loaded machine slows both alike, and the margin allowed is half
// of what one round trip on the request path would add: the scheduling noise of a loaded
// machine (a p90 tens of milliseconds apart between two runs of 100) stays well under it.
func TestNoControlPlaneCallOnTheRequestPath(t *testing.T) {
	const away = 250 * time.Millisecond
	c := newCluster(t, 2)
	near := c.addProxy(c.xds)
	far := c.addProxy(delayRelay(t, c.xds, away))
	waitWorkers(t, near, 2)
	waitWorkers(t, far, 2)
	latencies := func() (ns, fs []time.Duration) {
		for i := range 100 {
			for _, p := range []*proxy.Server{near, far} {
				t0 := time.Now()
				if r := chat(t, "http://"+p.Addr(), "short system prompt", "question "+strconv.Itoa(i)); r.status != 200 {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				if p == near {
					ns = append(ns, time.Since(t0))
				} else {
					fs = append(fs, time.Since(t0))
				}
			}
		}
		return ns, fs
	}
	pct := func(ds []time.Duration) (p50, p90, p99 time.Duration) {
		slices.Sort(ds)
		return ds[len(ds)/2], ds[len(ds)*9/10], ds[len(ds)*99/100]
	}
	latencies() // warm both paths
	ns, fs := latencies()
	n50, n90, n99 := pct(ns)
	f50, f90, f99 := pct(fs)
	t.Logf("request latency: control plane near p50 %v p90 %v p99 %v; %v away p50 %v p90 %v p99 %v", n50, n90, n99, away, f50, f90, f99)
	// A control-plane round trip on the request path would add 2 × away to every request
	// that made one.
	if f50 > n50+away || f90 > n90+away {
		t.Fatalf("a control plane %v away slows requests: p50 %v p90 %v (near: %v, %v)", away, f50, f90, n50, n90)
	}
}

// api calls the operator API's JSON side.
func (c *cluster) api(method, path, body string, token bool) (int, map[string]any) {
	c.t.Helper()
	h := map[string]string{}
	if token {
		h["Authorization"] = "Bearer secret"
	}
	return c.apiWith(method, path, body, h)
}

// apiWith is api with the headers h (the token among them, if any).
func (c *cluster) apiWith(method, path, body string, h map[string]string) (int, map[string]any) {
	c.t.Helper()
	code, out, err := callAPI(http.DefaultClient, c.cp.APIAddr(), method, path, body, h)
	if err != nil {
		c.t.Fatal(err)
	}
	return code, out
}

// callAPI calls the operator API's JSON side at addr through client with the headers h: a
// change (not a GET) with other headers and no Authorization carries the token.
func callAPI(client *http.Client, addr, method, path, body string, h map[string]string) (int, map[string]any, error) {
	req, _ := http.NewRequest(method, "http://"+addr+path, strings.NewReader(body))
	if _, ok := h["Authorization"]; !ok && method != "GET" && len(h) > 0 {
		req.Header.Set("Authorization", "Bearer secret")
	}
	for k, v := range h {
		req.Header.Set(k, v)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out, nil
}

func TestOperatorDrainAndPolicyReachProxies(t *testing.T) {
	c := newCluster(t, 3)
	p := c.addProxy(c.xds)
	waitWorkers(t, p, 3)

	if code, out := c.api("GET", "/v1/workers", "", false); code != 200 || len(out["workers"].([]any)) != 3 {
		t.Fatalf("list workers: %d %v", code, out)
	}
	if code, _ := c.api("POST", "/v1/workers/w0/drain", "", false); code != 401 {
		t.Fatalf("drain without the token: %d, want 401", code)
	}
	if code, out := c.api("POST", "/v1/workers/w0/drain", "", true); code != 200 {
		t.Fatalf("drain: %d %v", code, out)
	}
	waitWorkers(t, p, 2)
	for i := range 12 {
		if r := chat(t, "http://"+p.Addr(), "system "+strconv.Itoa(i), "hi"); r.status != 200 || r.worker == "w0" {
			t.Fatalf("request %d after draining w0: status %d worker %q", i, r.status, r.worker)
		}
	}
	if code, out := c.api("PUT", "/v1/policy", `{"policy":"round-robin","overlap_weight":1,"cache_threshold":0.3,"tier_weights":[1,0.75,0.25],"session_ttl_ms":60000}`, true); code != 200 {
		t.Fatalf("set policy: %d %v", code, out)
	}
	waitPolicy(t, p, 2)
	// Removing a worker the flags configured is refused, and says why.
	if code, out := c.api("DELETE", "/v1/workers/w1", "", true); code != 409 {
		t.Fatalf("removing a flag worker: %d %v, want 409", code, out)
	}
	// A worker added through the API reaches the proxy and survives a control-plane restart.
	w := c.workers[0]
	if code, out := c.api("PUT", "/v1/workers/extra", fmt.Sprintf(`{"id":"extra","url":%q,"engine":"sim","block_size":16}`, w.URL()), true); code != 200 {
		t.Fatalf("add worker: %d %v", code, out)
	}
	waitWorkers(t, p, 3)
	addr := c.xds
	_ = c.cp.Close()
	c.startControlPlane(addr)
	if code, out := c.api("GET", "/v1/workers/extra", "", false); code != 200 {
		t.Fatalf("API worker lost across a restart: %d %v", code, out)
	}
	if code, out := c.api("GET", "/v1/policy", "", false); code != 200 || out["policy"] != "round-robin" {
		t.Fatalf("policy lost across a restart: %d %v", code, out)
	}
}

func TestBadWorkersFileFailsTheStart(t *testing.T) {
	dir := t.TempDir()
	path := dir + "/workers.yaml"
	if err := os.WriteFile(path, []byte("workers:\n  - id: w1\n    url: not-a-url\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cp, err := controlplane.New(controlplane.Options{XDSListen: "127.0.0.1:0", DataDir: dir + "/data", WorkersFile: path, Logger: quiet()})
	if err == nil {
		cp.Close()
		t.Fatal("a control plane started on a workers file it cannot read")
	}
	if !strings.Contains(err.Error(), "url") {
		t.Fatalf("error %q does not say what is wrong", err)
	}
	// The data dir is not left locked: a corrected start succeeds.
	if err := os.WriteFile(path, []byte("workers: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cp, err = controlplane.New(controlplane.Options{XDSListen: "127.0.0.1:0", DataDir: dir + "/data", WorkersFile: path, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	cp.Close()
}

// waitPolicy waits until proxy p applies policy version v.
func waitPolicy(t *testing.T, p *proxy.Server, v uint64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if st, _ := p.XDSStats(); st.PolicyVersion == v {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the proxy never applied policy version %d", v)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Prefill and decode workers registered with their roles: the proxy splits requests across
// them (the decode worker pulls the KV over nixl), and the routing policy turns that off and
// changes the conditional threshold.
func TestDisaggregatedPoolsOverXDS(t *testing.T) {
	c := &cluster{t: t, workers: startWorkers(t, 2, sim.RolePrefill, sim.RoleDecode), dataDir: t.TempDir()}
	for i, w := range c.workers {
		c.specs = append(c.specs, registry.Worker{
			ID: []string{"p0", "d0"}[i], URL: w.URL(), BlockSize: 16, Engine: "sim", Role: []string{"prefill", "decode"}[i],
			KVEvents: w.EventsEndpoint(), KVEventsReplay: w.ReplayEndpoint(),
		})
	}
	c.startControlPlane("127.0.0.1:0")
	p := c.addProxy(c.xds)
	waitWorkers(t, p, 2)
	base := "http://" + p.Addr()
	metric := func(series string) float64 {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, series+" "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				return f
			}
		}
		return 0
	}
	if r := chat(t, base, family(1), "hi"); r.status != 200 || r.worker != "d0" {
		t.Fatalf("disaggregated request: %d from %q: %s", r.status, r.worker, r.body)
	}
	if v := metric(`kvrelay_proxy_disagg_requests_total{path="remote"}`); v != 1 {
		t.Fatalf("remote prefills %v, want 1", v)
	}
	// disagg off: prefill and decode workers take no requests.
	if code, out := c.api("PUT", "/v1/policy", `{"policy":"kv","disagg":"off"}`, true); code != 200 {
		t.Fatalf("set policy: %d %v", code, out)
	}
	waitPolicy(t, p, 2)
	if r := chat(t, base, family(2), "hi"); r.status != 503 {
		t.Fatalf("with disaggregation off: %d %s, want 503", r.status, r.body)
	}
	// A threshold above the prompt's length: the decode worker prefills it itself.
	if code, out := c.api("PUT", "/v1/policy", `{"policy":"kv","disagg":"auto","disagg_threshold":1000000}`, true); code != 200 {
		t.Fatalf("set policy: %d %v", code, out)
	}
	waitPolicy(t, p, 3)
	if r := chat(t, base, family(3), "hi"); r.status != 200 || r.worker != "d0" {
		t.Fatalf("conditional request: %d from %q: %s", r.status, r.worker, r.body)
	}
	if v := metric(`kvrelay_proxy_disagg_requests_total{path="local"}`); v != 1 {
		t.Fatalf("local prefills %v, want 1", v)
	}
	if code, out := c.api("GET", "/v1/policy", "", false); code != 200 || out["disagg_threshold"] != "1000000" {
		t.Fatalf("policy: %d %v", code, out)
	}
}

// kernelWaitingControlPlane starts a control plane over one simulated worker, w0, whose
// kernel signals always say 9 requests wait in front of it (counted while the policy's
// kernel_load_signals is on), scraped every 20 ms and published at most every
// publishInterval (0: the default).
func kernelWaitingControlPlane(t *testing.T, publishInterval time.Duration) *controlplane.Server {
	t.Helper()
	ws := startWorkers(t, 1)
	cp, err := controlplane.New(controlplane.Options{
		XDSListen: "127.0.0.1:0", APIListen: "127.0.0.1:0", DataDir: t.TempDir(), APIToken: "secret",
		Workers:        []registry.Worker{{ID: "w0", URL: ws[0].URL(), BlockSize: 16, Engine: "sim"}},
		ScrapeInterval: 20 * time.Millisecond, PublishInterval: publishInterval, Logger: quiet(),
		KernelWaiting: func(id string) (int, bool) { return 9, id == "w0" },
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Close() })
	return cp
}

// kernelLoadSignalsOn turns the routing policy's kernel_load_signals on.
func kernelLoadSignalsOn(t *testing.T, cp *controlplane.Server) {
	t.Helper()
	pol := cp.Registry().Policy()
	pol.KernelLoadSignals = true
	if _, err := cp.Registry().SetPolicy(pol); err != nil {
		t.Fatal(err)
	}
}

// The kernel's accept-queue backlog counts as waiting load only while the routing policy's
// kernel_load_signals is on (the eBPF probes' reading is faked here).
func TestKernelLoadSignalsFollowThePolicy(t *testing.T) {
	cp := kernelWaitingControlPlane(t, 0)
	waiting := func() int {
		st, _ := cp.View().Get("w0")
		return st.Load.Waiting
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if st, _ := cp.View().Get("w0"); st.Healthy {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("worker never scraped")
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	if n := waiting(); n != 0 {
		t.Fatalf("waiting %d with kernel_load_signals off, want 0", n)
	}
	kernelLoadSignalsOn(t, cp)
	for waiting() != 9 {
		if time.Now().After(deadline.Add(5 * time.Second)) {
			t.Fatalf("waiting %d with kernel_load_signals on, want 9", waiting())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A load change the view signals right after a forced publish (a policy change publishes at
// once) reaches the proxies at the next tick that may publish, not at the next change: the
// rate limit skips a tick less than PublishInterval after the forced publish, and the change
// stays pending. Here nothing else changes after the policy turns kernel_load_signals on.
func TestLoadChangeAfterAForcedPublishReachesProxies(t *testing.T) {
	cp := kernelWaitingControlPlane(t, 300*time.Millisecond)
	c := &cluster{t: t}
	p := c.addProxy(cp.XDSAddr())
	waitWorkers(t, p, 1)
	load := func() int64 { return workerLoad(p, "w0") }
	time.Sleep(400 * time.Millisecond) // scraped and published, idle
	if n := load(); n != 0 {
		t.Fatalf("proxy sees load %d on the idle worker with kernel_load_signals off, want 0", n)
	}
	kernelLoadSignalsOn(t, cp)
	deadline := time.Now().Add(5 * time.Second)
	for load() != 9 {
		if time.Now().After(deadline) {
			st, _ := cp.View().Get("w0")
			t.Fatalf("proxy sees load %d, the view waiting %d: the change was never published", load(), st.Load.Waiting)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// An engine whose answers come late (a relay holds every chunk 40 ms each way) shows more
// waiting load in the control plane's view, and gets fewer new requests through a proxy,
// while kernel_load_signals is on, and not while it is off: the eBPF first_byte probe times
// the proxy's requests to both workers from the kernel (root only).
func TestKernelFirstByteSteersRouting(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the eBPF probes need root")
	}
	ws := startWorkers(t, 2)
	slowURL := "http://" + delayRelay(t, strings.TrimPrefix(ws[1].URL(), "http://"), 40*time.Millisecond)
	probes := ebpf.New(ebpf.Config{Mode: ebpf.ModeOn, Probes: []string{ebpf.ProbeFirstByte},
		SampleInterval: 50 * time.Millisecond, Logger: quiet()})
	if err := probes.Start(context.Background()); err != nil {
		t.Skipf("probes: %v", err)
	}
	t.Cleanup(func() { _ = probes.Close() })
	if !probes.Active()[ebpf.ProbeFirstByte] {
		t.Skip("first_byte probe did not attach (see the log with -v)")
	}
	if err := probes.SetTargets([]ebpf.Target{{Addr: ws[0].URL(), Worker: "w0", Pool: "agg"}, {Addr: slowURL, Worker: "w1", Pool: "agg"}}); err != nil {
		t.Fatal(err)
	}
	cp, err := controlplane.New(controlplane.Options{
		XDSListen: "127.0.0.1:0", APIListen: "127.0.0.1:0", DataDir: t.TempDir(), APIToken: "secret",
		Workers: []registry.Worker{
			{ID: "w0", URL: ws[0].URL(), BlockSize: 16, Engine: "sim"},
			{ID: "w1", URL: slowURL, BlockSize: 16, Engine: "sim"},
		},
		ScrapeInterval: 20 * time.Millisecond, Logger: quiet(),
		KernelLatencyWaiting: probes.FirstByteWaiting,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Close() })
	c := &cluster{t: t}
	p := c.addProxy(cp.XDSAddr())
	waitWorkers(t, p, 2)

	// send makes n sequential completions of prompts sharing no block (so the KV cost ties
	// and the load decides) and counts them per worker.
	seq := 0
	send := func(n int) map[string]int {
		counts := map[string]int{}
		for range n {
			seq++
			body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 2,
				"prompt": fmt.Sprintf("request %d asks about rivers and stones and the sea", seq)})
			resp, err := http.Post("http://"+p.Addr()+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			counts[resp.Header.Get("x-kvrelay-worker")]++
		}
		return counts
	}
	viewWaiting := func(id string) int {
		st, _ := cp.View().Get(id)
		return st.Load.Waiting
	}
	const n = 30
	// Off, the slow worker still gets requests; not always an even share: the engines' own
	// reports (Running, scraped every 20 ms) lag its longer requests and steer some away, more
	// so on a busy machine (13 and 19 of 30 on a quiet one, 2 and 3 under make test). Up to
	// two more rounds of n are sent while it has none, so that a loaded machine cannot fail
	// this, and the last round stays recent for the first-byte window below.
	off := send(n)
	for round := 1; off["w1"] == 0 && round < 3; round++ {
		for id, k := range send(n) {
			off[id] += k
		}
	}
	implied, seen := probes.FirstByteWaiting("w1")
	t.Logf("off: %v; view waiting w0 %d w1 %d; implied by w1's first byte %d (%v)", off, viewWaiting("w0"), viewWaiting("w1"), implied, seen)
	if off["w1"] == 0 {
		t.Fatalf("kernel_load_signals off: the slow worker got none of %d requests", off["w0"])
	}
	if implied < 2 {
		t.Fatalf("the slow worker's first byte implies %d waiting (%v), want at least 2", implied, seen)
	}
	if w := viewWaiting("w1"); w != 0 {
		t.Fatalf("kernel_load_signals off: the view counts %d waiting on the slow worker, want 0", w)
	}

	kernelLoadSignalsOn(t, cp)
	// The proxy sees the slow worker loaded before the window (2 s) forgets its answers.
	start := time.Now()
	deadline := start.Add(1500 * time.Millisecond)
	for {
		load := workerLoad(p, "w1")
		if load >= 2 {
			t.Logf("kernel_load_signals on: the proxy saw load %d on the slow worker after %v", load, time.Since(start).Round(time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("kernel_load_signals on: the proxy sees load %d on the slow worker (view waiting %d)", load, viewWaiting("w1"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	on := send(n)
	t.Logf("on: %v; view waiting w0 %d w1 %d", on, viewWaiting("w0"), viewWaiting("w1"))
	if on["w1"] > n/10 || on["w1"] >= off["w1"] {
		t.Fatalf("kernel_load_signals on: the slow worker got %d of %d requests (off: %d), want at most %d", on["w1"], n, off["w1"], n/10)
	}
}

// Load another proxy put on a worker reaches this one through the control plane and keeps it
// off that worker (busy_decode_blocks); when the control plane dies with that load pushed, it
// fades after load_stale_after, and requests reach the worker again.
func TestPushedLoadFadesWithoutTheControlPlane(t *testing.T) {
	workerSpeedup = 1
	c := newCluster(t, 2)
	workerSpeedup = 50
	if code, out := c.api("PUT", "/v1/policy", `{"policy":"least-loaded","busy_decode_blocks":20,"cache_threshold":0.1,"tier_weights":[1,0.75,0.25],"session_ttl_ms":60000}`, true); code != 200 {
		t.Fatalf("set policy: %d %v", code, out)
	}
	const stale = 300 * time.Millisecond
	a := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.LoadStaleAfter = stale })
	b := c.addProxy(c.xds)
	waitWorkers(t, a, 2)
	waitWorkers(t, b, 2)
	waitPolicy(t, a, 2)
	waitPolicy(t, b, 2)
	waitKnown(t, a, 2)
	waitKnown(t, b, 2)

	// A long request through b holds some 175 blocks on one worker (at speedup 1, 2000
	// tokens take some 20 s).
	body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 2000, "ignore_eos": true, "stream": true,
		"messages": []map[string]string{{"role": "system", "content": family(0)}, {"role": "user", "content": "go on"}}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+b.Addr()+"/v1/chat/completions", bytes.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	busy := resp.Header.Get("x-kvrelay-worker")
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || busy == "" {
		t.Fatalf("long request: %v, status %d, worker %q", err, resp.StatusCode, busy)
	}
	seesBusy := func() bool {
		for _, w := range a.Workers() {
			if w.ID == busy {
				return w.DecodeBlocks() > 20
			}
		}
		return false
	}
	deadline := time.Now().Add(10 * time.Second)
	for !seesBusy() {
		if time.Now().After(deadline) {
			sa, _ := a.XDSStats()
			sb, _ := b.XDSStats()
			t.Fatalf("proxy a never saw b's load on %s (a: %d responses, b: %d reports): %s\nb: %s", busy, sa.ADS.Responses, sb.Reports, workerStates(a), workerStates(b))
		}
		time.Sleep(20 * time.Millisecond)
	}
	// While the control plane runs, its refresh keeps a steady load from going stale.
	for i := range 8 {
		if r := chat(t, "http://"+a.Addr(), "system "+strconv.Itoa(i), "hi"); r.status != 200 || r.worker == busy {
			t.Fatalf("request %d while %s is busy: status %d worker %q", i, busy, r.status, r.worker)
		}
		if !seesBusy() {
			sa, _ := a.XDSStats()
			t.Fatalf("b's steady load on %s faded under a running control plane (a: %d responses): %s\nb: %s", busy, sa.ADS.Responses, workerStates(a), workerStates(b))
		}
		time.Sleep(150 * time.Millisecond)
	}

	// The control plane dies with that load pushed; b's request ends.
	_ = c.cp.Close()
	downAt := time.Now()
	cancel()
	sawStale := false
	for i := 0; ; i++ {
		if time.Since(downAt) > 2*stale+2*time.Second {
			t.Fatalf("%s still shunned %v after the control plane died: %s", busy, time.Since(downAt), workerStates(a))
		}
		if !sawStale {
			if mr, err := http.Get("http://" + a.Addr() + "/metrics"); err == nil {
				m, _ := io.ReadAll(mr.Body)
				mr.Body.Close()
				sawStale = regexp.MustCompile(`(?m)^kvrelay_proxy_xds_load_stale [12]$`).Match(m)
			}
		}
		if r := chat(t, "http://"+a.Addr(), "after "+strconv.Itoa(i), "hi"); r.status == 200 && r.worker == busy {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("%s took requests again %v after the control plane died", busy, time.Since(downAt).Round(time.Millisecond))
	if time.Since(downAt) < stale {
		t.Fatalf("the pushed load faded before load_stale_after")
	}
	if !sawStale {
		t.Error("kvrelay_proxy_xds_load_stale never said the load was stale")
	}
}

// The loopback operator API answers only requests whose Host is loopback (a page on another
// name rebound to 127.0.0.1 gets nothing), sends no CORS headers, and counts and logs what
// it refuses by reason.
func TestOperatorAPIRefusesForeignHosts(t *testing.T) {
	c := newCluster(t, 1)
	api := "http://" + c.cp.APIAddr()
	do := func(host, path, token string) *http.Response {
		req, _ := http.NewRequest("GET", api+path, nil)
		if host != "" {
			req.Host = host
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		req.Header.Set("Origin", "http://evil.example")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	for _, host := range []string{"evil.example:" + strings.Split(c.cp.APIAddr(), ":")[1], "evil.example", "10.0.0.1"} {
		if r := do(host, "/v1/workers", ""); r.StatusCode != http.StatusMisdirectedRequest {
			t.Errorf("Host %s: %d, want 421", host, r.StatusCode)
		}
	}
	for _, host := range []string{"", "localhost:1234", "127.0.0.1"} {
		r := do(host, "/v1/workers", "")
		if r.StatusCode != 200 {
			t.Errorf("Host %q: %d, want 200", host, r.StatusCode)
		}
		for k := range r.Header {
			if strings.HasPrefix(strings.ToLower(k), "access-control-") {
				t.Errorf("CORS header %s sent", k)
			}
		}
	}
	if r := do("", "/v1/workers/w0/drain", "wrong"); r.StatusCode == 200 {
		t.Fatal("a GET drain with a wrong token succeeded")
	}
	req, _ := http.NewRequest("POST", api+"/v1/workers/w0/drain", nil)
	req.Header.Set("Authorization", "Bearer wrong")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 401 {
		t.Fatalf("drain with a wrong token: %v %v", err, resp)
	}
	resp, err := http.Get(api + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`kvrelay_controlplane_api_rejected_total{reason="host"} 3`, `kvrelay_controlplane_api_rejected_total{reason="unauthenticated"} 1`} {
		if !strings.Contains(string(m), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// TestProxiesNeedTheirCredentials: behind a control plane that checks mutual TLS and
// tokens, a proxy with its own certificate and token routes; a proxy without credentials,
// one with a wrong token, and one claiming another proxy's node id get no workers, and the
// control plane counts each refusal.
func TestProxiesNeedTheirCredentials(t *testing.T) {
	dir := t.TempDir()
	ca, err := authtest.NewCA(dir, "fleet")
	if err != nil {
		t.Fatal(err)
	}
	cpPair, err := ca.Issue("cp", "control-plane", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, s string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	tokens := write("tokens", "edge-a token-for-edge-a-0123456789\nedge-b token-for-edge-b-0123456789\n")
	c := newClusterWith(t, 2, auth.ServerConfig{CertFile: cpPair.CertFile, KeyFile: cpPair.KeyFile, ClientCAFile: ca.CertFile, TokensFile: tokens})
	creds := func(node, token string) func(*proxy.Config) {
		pair, err := ca.Issue(node, node)
		if err != nil {
			t.Fatal(err)
		}
		return func(cfg *proxy.Config) {
			cfg.NodeID = node
			cfg.XDSSyncTimeout = 300 * time.Millisecond
			cfg.XDSAuth = auth.ClientConfig{CAFile: ca.CertFile, CertFile: pair.CertFile, KeyFile: pair.KeyFile}
			if token != "" {
				cfg.XDSAuth.TokenFile = write(node+"-token", token)
			}
		}
	}
	good := c.addProxyWith(c.xds, creds("edge-a", "token-for-edge-a-0123456789"))
	plain := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.NodeID = "edge-a"; cfg.XDSSyncTimeout = 300 * time.Millisecond })
	noToken := c.addProxyWith(c.xds, creds("edge-c", ""))
	wrongToken := c.addProxyWith(c.xds, creds("edge-d", "token-nobody-was-ever-given-01"))
	impostor := c.addProxyWith(c.xds, creds("edge-b2", "token-for-edge-a-0123456789"))
	waitWorkers(t, good, 2)
	if r := chat(t, "http://"+good.Addr(), "You are terse.", "hello"); r.status != 200 {
		t.Fatalf("chat through the proxy with credentials: %d %s", r.status, r.body)
	}
	time.Sleep(500 * time.Millisecond)
	for name, p := range map[string]*proxy.Server{"plaintext": plain, "no token": noToken, "wrong token": wrongToken, "another node's token": impostor} {
		if n := len(p.Workers()); n != 0 {
			t.Errorf("proxy with %s got %d workers", name, n)
		}
	}
	resp, err := http.Get("http://" + c.cp.APIAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, reason := range []string{"no_token", "bad_token", "wrong_node"} {
		re := regexp.MustCompile(`kvrelay_controlplane_xds_refused_streams_total\{reason="` + reason + `"\} ([1-9][0-9]*)`)
		if !re.Match(m) {
			t.Errorf("no refusal counted for %s", reason)
		}
	}
}

// TestExtraKeysMatchThroughTheIndex: salted and LoRA prompts, warmed on one worker each
// straight at the engines, are found in the control plane's index (the engines' extra_keys
// folded by the proxy's rule) by a proxy that never saw them, and reach that worker with a
// cache hit; the same prompt plain, under another salt or under the base model matches no
// block of its family anywhere (only the chat template's opening blocks, which every prompt
// under the same keys shares).
func TestExtraKeysMatchThroughTheIndex(t *testing.T) {
	workerLoRAs = []string{"sql-lora"}
	t.Cleanup(func() { workerLoRAs = nil })
	c := newCluster(t, 3)
	p := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.ExposeDecisionHeader = true })
	waitWorkers(t, p, 3)
	warm := []struct {
		model, salt string
		family      int
	}{{model, "tenant-a", 0}, {"sql-lora", "", 1}, {model, "", 2}}
	c.warmed = map[int]map[int]bool{}
	for i, w := range warm {
		c.warmed[i] = map[int]bool{w.family: true}
		if r := chatAs(t, c.workers[i].URL(), w.model, w.salt, family(w.family), "warm"); r.status != 200 {
			t.Fatalf("warming %+v: %d %s", w, r.status, r.body)
		}
	}
	c.waitBlocks(3 * 150)
	base := "http://" + p.Addr()
	for i, w := range warm {
		r := chatAs(t, base, w.model, w.salt, family(w.family), "again")
		if want := "w" + strconv.Itoa(i); r.status != 200 || r.worker != want || r.cached == 0 {
			t.Errorf("%+v: status %d worker %q cached %d, want %s with cached tokens (decision %s)", w, r.status, r.worker, r.cached, want, r.decision)
		}
		time.Sleep(150 * time.Millisecond) // its load reported and gone before the next
	}
	cachedRe := regexp.MustCompile(`cached=([0-9]+)`)
	for _, alias := range []struct {
		what, model, salt string
		family            int
	}{
		{"the salted prompt plain", model, "", 0},
		{"the salted prompt under another salt", model, "tenant-b", 0},
		{"the LoRA prompt under the base model", model, "", 1},
		{"the plain prompt salted", model, "tenant-a", 2},
		{"the plain prompt under the adapter", "sql-lora", "", 2},
	} {
		r := chatAs(t, base, alias.model, alias.salt, family(alias.family), "alias")
		if r.status != 200 || r.decision == "" {
			t.Fatalf("%s: status %d, decision %q: %s", alias.what, r.status, r.decision, r.body)
		}
		// A family's prompt is about 180 blocks; the template's opening is 5.
		const shared = 10
		for _, m := range cachedRe.FindAllStringSubmatch(r.decision, -1) {
			if n, _ := strconv.Atoi(m[1]); n >= shared {
				t.Errorf("%s matched its family's blocks: %s", alias.what, r.decision)
				break
			}
		}
		if r.cached >= shared*16 {
			t.Errorf("%s got %d cached tokens from %s", alias.what, r.cached, r.worker)
		}
	}
}

// TestRolloutReachesProxies: a candidate set through the operator API reaches the proxies
// with its own version and routes its share (all of it here), measured under that version;
// an unchanged candidate keeps its version when the stable policy changes; aborting sends
// every request back to the stable policy, and promoting makes the candidate stable under
// a new version.
func TestRolloutReachesProxies(t *testing.T) {
	c := newCluster(t, 2)
	p := c.addProxy(c.xds)
	waitWorkers(t, p, 2)
	base := "http://" + p.Addr()
	stable := `"policy":"kv","overlap_weight":64,"queue_weight":8,"cache_threshold":0.1,"busy_kv_fraction":0.95,"tier_weights":[1,0.75,0.25]`
	candidate := strings.Replace(stable, `"overlap_weight":64`, `"overlap_weight":0`, 1)
	code, got := c.api("PUT", "/v1/policy", `{`+stable+`,"candidate":{`+candidate+`},"candidate_share":1}`, true)
	if code != 200 {
		t.Fatalf("starting a rollout: %d %v", code, got)
	}
	ver := jsonUint(got["version"])
	cand, _ := got["candidate"].(map[string]any)
	if cand == nil || jsonUint(cand["version"]) <= ver || cand["overlap_weight"] != nil && cand["overlap_weight"].(float64) != 0 {
		t.Fatalf("stored rollout: %v", got)
	}
	cv := jsonUint(cand["version"])
	waitPolicy(t, p, ver)
	metric := func(v uint64) string {
		return `kvrelay_proxy_policy_requests_total{outcome="ok",policy_version="` + strconv.FormatUint(v, 10) + `"}`
	}
	count := func(v uint64) int {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for line := range strings.SplitSeq(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, metric(v)+" "); ok {
				n, _ := strconv.Atoi(rest)
				return n
			}
		}
		return 0
	}
	for i := range 3 {
		if r := chat(t, base, family(i), "rollout"); r.status != 200 {
			t.Fatalf("chat: %d %s", r.status, r.body)
		}
	}
	if n := count(cv); n != 3 {
		t.Fatalf("the candidate (version %d) routed %d of 3 requests at share 1", cv, n)
	}
	// The proxies' reports carry each arm to the control plane.
	want := `kvrelay_controlplane_policy_requests_total{outcome="ok",policy_version="` + strconv.FormatUint(cv, 10) + `"} 3`
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := http.Get("http://" + c.cp.APIAddr() + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(b), want) && strings.Contains(string(b), `kvrelay_controlplane_policy_ttft_p90_seconds{policy_version="`+strconv.FormatUint(cv, 10)+`"}`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("control plane metrics lack %s", want)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The stable policy changes; the candidate, unchanged, keeps its version.
	code, got = c.api("PUT", "/v1/policy", `{`+stable+`,"temperature":0.5,"candidate":{`+candidate+`},"candidate_share":1}`, true)
	if code != 200 || jsonUint(got["candidate"].(map[string]any)["version"]) != cv {
		t.Fatalf("changing the stable policy: %d %v, want the candidate at version %d", code, got, cv)
	}
	// Abort: all back to stable.
	code, got = c.api("PUT", "/v1/policy", `{`+stable+`}`, true)
	if code != 200 || got["candidate"] != nil {
		t.Fatalf("aborting: %d %v", code, got)
	}
	sv := jsonUint(got["version"])
	waitPolicy(t, p, sv)
	if r := chat(t, base, family(9), "after"); r.status != 200 {
		t.Fatalf("chat: %d %s", r.status, r.body)
	}
	// The candidate's series go with it (its version routes nothing any more).
	if count(sv) != 1 || count(cv) != 0 {
		t.Fatalf("after the abort: stable version %d routed %d, candidate %d shows %d; want 1, and its series gone", sv, count(sv), cv, count(cv))
	}
	// A share or shadow without a candidate is refused.
	if code, _ := c.api("PUT", "/v1/policy", `{`+stable+`,"candidate_share":0.5}`, true); code != 400 {
		t.Fatalf("a share without a candidate: %d, want 400", code)
	}
}

// jsonUint reads a 64-bit integer of a protojson body (a string there) or a JSON number.
func jsonUint(v any) uint64 {
	switch x := v.(type) {
	case string:
		n, _ := strconv.ParseUint(x, 10, 64)
		return n
	case float64:
		return uint64(x)
	}
	return 0
}

// /readyz answers 503 while the replica's subscribers catch up with the engines and 200 once
// its index is whole (or CatchUpTimeout passed), without a token.
func TestReadyzFollowsCatchUp(t *testing.T) {
	c := &cluster{t: t, dataDir: t.TempDir()}
	// An engine whose KV event and replay endpoints answer nobody: its subscriber never
	// catches up.
	c.specs = []registry.Worker{{ID: "w0", URL: "http://127.0.0.1:9", BlockSize: 16, Engine: "sim", KVEvents: "tcp://127.0.0.1:9", KVEventsReplay: "tcp://127.0.0.1:9"}}
	started := time.Now()
	c.startControlPlane("127.0.0.1:0")
	if code, out := c.api("GET", "/readyz", "", false); code != 503 || out["status"] != "catching_up" {
		t.Fatalf("readyz at start: %d %v, want 503 catching_up", code, out)
	}
	for {
		code, out := c.api("GET", "/readyz", "", false)
		if code == 200 {
			if out["status"] != "ready" || out["role"] != "leader" {
				t.Fatalf("readyz: %v", out)
			}
			break
		}
		if time.Since(started) > controlplane.CatchUpTimeout+2*time.Second {
			t.Fatalf("readyz still %d %v after the catch-up timeout", code, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if d := time.Since(started); d < controlplane.CatchUpTimeout-500*time.Millisecond {
		t.Fatalf("ready after %s though its engine never answered (catch-up timeout %s)", d, controlplane.CatchUpTimeout)
	}
}
