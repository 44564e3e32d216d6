// Command bench-tenants measures how tenants share one fleet through a kvrelay proxy: an
// interactive tenant's TTFT while another floods the fleet past its capacity, with the
// admission queue first come, first served (no API keys: every request one flow) and fair
// across tenants (--api-keys-file), fair with headroom (tenant_headroom), and how two
// flooding tenants of weights 3 and 1 split the tokens served. Simulated engines and the
// proxy run in this process, on loopback. -trace prints each interactive request of the
// flood scenarios with its worker, the proxy's decision (x-kvrelay-route and
// x-kvrelay-decision: its wait in the admission queue, every candidate's predicted queue
// and prefill) and every engine's load when it was sent.
//
//	go run ./hack/bench-tenants -out hack/bench-tenants/results/<date>-<commit>.md
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
)

const model = "gpt-oss-120b"

var (
	workers  = flag.Int("workers", 4, "simulated engines")
	seqs     = flag.Int("max-num-seqs", 4, "each engine's request slots")
	speedup  = flag.Float64("speedup", 0.5, "engines' speed-up of the simulated timing")
	duration = flag.Duration("duration", 20*time.Second, "each scenario's load")
	chatRate = flag.Float64("chat-rate", 1, "the interactive tenant's requests per second")
	flood    = flag.Float64("flood", 5, "the flooding tenant's rate, in multiples of the fleet's capacity")
	out      = flag.String("out", "", "write the results (Markdown) here too")
	seed     = flag.Uint64("seed", 1, "arrival seed")
	headroom = flag.Int64("headroom", 1, "the fair scenario with headroom: slots of each worker a tenant past its share may not take")
	chatW    = flag.Float64("chat-weight", 1, "the interactive tenant's weight (the flood's is 3, the idle third tenant's 1)")
	verbose  = flag.Bool("v", false, "print every refused request")
	only     = flag.String("only", "", "run only the scenarios whose name contains this (and no weighted split)")
	trace    = flag.Bool("trace", false, "print each interactive request of the flood scenarios: its TTFT, its worker and every engine's running and waiting requests when it was sent")
)

// engines are the simulated engines, for -trace and the stall counts.
var engines []*sim.Engine

// A request: a prompt of its tenant's own and a fixed output.
const (
	promptWords = 300
	outTokens   = 48
)

func main() {
	flag.Parse()
	codec, err := sim.NewCodec(model, "", "")
	must(err)
	var urls []string
	for range *workers {
		cfg := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec}
		cfg.Engine.NumGPUBlocks = 8192
		cfg.Engine.MaxNumSeqs = *seqs
		cfg.Engine.Timing.Speedup = *speedup
		w, err := sim.NewWorker(cfg)
		must(err)
		ctx := context.Background()
		must(w.Start(ctx))
		go func() { _ = w.Run(ctx) }()
		urls = append(urls, w.URL())
		engines = append(engines, w.Engine())
	}
	dir, err := os.MkdirTemp("", "bench-tenants")
	must(err)
	defer os.RemoveAll(dir)
	keys := filepath.Join(dir, "keys")
	must(os.WriteFile(keys, []byte(fmt.Sprintf("sk-chat tenant=chat,weight=%g\nsk-batch tenant=batch,weight=3\nsk-bulk tenant=bulk,weight=1\n", *chatW)), 0o600))

	// The fleet's capacity in requests a second, measured: a closed loop of as many
	// clients as slots.
	p := startProxy(urls, "", 0, false)
	capacity := measureCapacity("http://"+p.Addr(), *workers**seqs)
	_ = p.Close()
	var report strings.Builder
	fmt.Fprintf(&report, "# bench-tenants\n\n%d simulated engines (max-num-seqs %d, speed-up %g), prompts of ~%d words, %d output tokens; the fleet's capacity %.1f requests/s (a closed loop of %d clients). The proxy queues a request once every worker runs as many requests as it has slots (busy_requests). Each scenario %s; interactive tenant at %.1f requests/s (Poisson), weight %g (the flood's 3, an idle tenant's 1), the flood at %.0f× capacity.\n\n",
		*workers, *seqs, *speedup, promptWords, outTokens, capacity, *workers**seqs, *duration, *chatRate, *chatW, *flood)
	fmt.Fprintf(&report, "| scenario | interactive TTFT p50 ms | p90 ms | p99 ms | interactive ok | of them queued | flood sent | flood ok |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
	type row struct {
		name     string
		keys     string
		flood    bool
		headroom int64
	}
	var alone, fifo, fair, roomy float64
	var stalls []string // how far the engines fell behind their timing model, by scenario
	for _, sc := range []row{
		{name: "interactive alone", keys: keys},
		{name: "with a flood, first come first served (no keys: one flow)", keys: "", flood: true},
		{name: "with a flood, fair across tenants (--api-keys-file)", keys: keys, flood: true},
		{name: fmt.Sprintf("with a flood, fair, headroom %d slot a worker (tenant_headroom)", *headroom), keys: keys, flood: true, headroom: *headroom},
	} {
		if *only != "" && sc.flood && !strings.Contains(sc.name, *only) {
			continue
		}
		var stall0 time.Duration
		for _, e := range engines {
			_, l := e.Stalled()
			stall0 += l
		}
		p := startProxy(urls, sc.keys, sc.headroom, true)
		base := "http://" + p.Addr()
		ctx, cancel := context.WithTimeout(context.Background(), *duration)
		var wg sync.WaitGroup
		var floodSent, floodOK atomic.Int64
		if sc.flood {
			wg.Add(1)
			go func() {
				defer wg.Done()
				openLoop(ctx, *flood*capacity, *seed+1, func(i int) {
					floodSent.Add(1)
					if _, ok := request(ctx, base, "sk-batch", fmt.Sprintf("batch %d", i)); ok {
						floodOK.Add(1)
					}
				})
			}()
		}
		var mu sync.Mutex
		var ttfts []float64
		okChat, queued := 0, 0
		openLoop(ctx, *chatRate, *seed, func(i int) {
			var at string
			if *trace {
				at = loads(p)
			}
			ttft, ok, worker := requestVia(ctx, base, "sk-chat", fmt.Sprintf("chat %d", i))
			if *trace && sc.flood {
				fmt.Fprintf(os.Stderr, "%s chat %d ttft %.0f ms on %s; at send %s\n", sc.name[:20], i, ttft, worker, at)
			}
			mu.Lock()
			defer mu.Unlock()
			if ok {
				okChat++
				ttfts = append(ttfts, ttft)
				if strings.Contains(worker, "waited_ms=") {
					queued++
				}
			}
		})
		cancel()
		wg.Wait()
		_ = p.Close()
		time.Sleep(2 * time.Second) // the engines finish what the flood left
		var stall time.Duration
		for _, e := range engines {
			_, l := e.Stalled()
			stall += l
		}
		stalls = append(stalls, (stall - stall0).Round(time.Millisecond).String())
		slices.Sort(ttfts)
		p50, p90, p99 := pct(ttfts, 0.5), pct(ttfts, 0.9), pct(ttfts, 0.99)
		fmt.Fprintf(&report, "| %s | %.0f | %.0f | %.0f | %d | %d | %d | %d |\n", sc.name, p50, p90, p99, okChat, queued, floodSent.Load(), floodOK.Load())
		switch {
		case !sc.flood:
			alone = p90
		case sc.keys == "":
			fifo = p90
		case sc.headroom > 0:
			roomy = p90
		default:
			fair = p90
		}
	}
	fmt.Fprintf(&report, "\n- the engines fell behind their timing model (the host did not keep up) by %s in the scenarios in order\n", strings.Join(stalls, ", "))
	if *only != "" {
		write(report.String())
		return
	}
	fmt.Fprintf(&report, "- interactive TTFT p90, with the flood ÷ alone: first come first served ×%.2f, fair ×%.2f, fair with headroom ×%.2f\n", fifo/alone, fair/alone, roomy/alone)

	// Two flooding tenants of weights 3 and 1: the tokens each was served.
	p = startProxy(urls, keys, 0, false)
	base := "http://" + p.Addr()
	ctx, cancel := context.WithTimeout(context.Background(), *duration)
	var tok [2]atomic.Int64
	var wg sync.WaitGroup
	for i, key := range []string{"sk-batch", "sk-bulk"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			openLoop(ctx, *flood*capacity/2, *seed+uint64(10+i), func(n int) {
				if _, ok := request(ctx, base, key, fmt.Sprintf("%s %d", key, n)); ok {
					tok[i].Add(outTokens)
				}
			})
		}()
	}
	wg.Wait()
	cancel()
	_ = p.Close()
	fmt.Fprintf(&report, "- two tenants flooding at %.0f× capacity together, weights 3 and 1: output tokens served %d and %d, ×%.2f (the weights say ×3)\n",
		*flood, tok[0].Load(), tok[1].Load(), float64(tok[0].Load())/max(float64(tok[1].Load()), 1))
	write(report.String())
}

// write prints the report and writes it to -out when given.
func write(report string) {
	fmt.Print(report)
	if *out != "" {
		must(os.MkdirAll(filepath.Dir(*out), 0o755))
		must(os.WriteFile(*out, []byte(report), 0o644))
	}
}

// startProxy starts a proxy over the workers; expose adds the routing headers (the
// admission queue's wait among them).
func startProxy(urls []string, keys string, headroom int64, expose bool) *proxy.Server {
	cfg := proxy.DefaultConfig()
	cfg.ExposeWorkerHeader, cfg.ExposeDecisionHeader = expose, expose
	cfg.Listen = "127.0.0.1:0"
	cfg.APIKeysFile = keys
	cfg.EventLoops = 1
	// A worker is busy once it runs as many requests as it has slots.
	cfg.BusyRequests = int64(*seqs)
	cfg.TenantHeadroom = headroom
	cfg.QueueSize = 100000
	cfg.QueueTimeout = 10 * time.Minute
	for i, u := range urls {
		cfg.Upstreams = append(cfg.Upstreams, proxy.Upstream{ID: fmt.Sprintf("w%d", i), URL: u, Model: model})
	}
	p, err := proxy.New(cfg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	must(err)
	must(p.Start(context.Background()))
	return p
}

// loads describes every engine's running and waiting requests and the proxy's count of
// each worker's, as "w0 3+0 w1 4+1 proxy w0 3 w1 4".
func loads(p *proxy.Server) string {
	var b strings.Builder
	for i, e := range engines {
		l := e.Load()
		fmt.Fprintf(&b, "w%d %d+%d ", i, l.Running, l.Waiting)
	}
	b.WriteString("proxy")
	for _, w := range p.Workers() {
		fmt.Fprintf(&b, " %s %d", w.ID, w.Load())
	}
	return strings.TrimSpace(b.String())
}

// request sends one streamed chat completion and returns its TTFT in milliseconds.
func request(ctx context.Context, base, key, tag string) (float64, bool) {
	ttft, ok, _ := requestVia(ctx, base, key, tag)
	return ttft, ok
}

// requestVia is request, and how the proxy routed it when it says (x-kvrelay-worker,
// x-kvrelay-route and, in brackets, x-kvrelay-decision).
func requestVia(ctx context.Context, base, key, tag string) (float64, bool, string) {
	var prompt strings.Builder
	for i := range promptWords {
		fmt.Fprintf(&prompt, "%s w%d ", tag, i)
	}
	body, _ := json.Marshal(map[string]any{"model": model, "stream": true, "max_tokens": outTokens, "ignore_eos": true,
		"messages": []map[string]string{{"role": "user", "content": prompt.String()}}})
	req, _ := http.NewRequestWithContext(ctx, "POST", base+"/v1/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	t0 := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, false, ""
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		if *verbose {
			fmt.Fprintf(os.Stderr, "%s: %d %s\n", tag, resp.StatusCode, b)
		}
		return 0, false, ""
	}
	sc := bufio.NewScanner(resp.Body)
	var ttft float64
	for sc.Scan() {
		line := sc.Text()
		if ttft == 0 && strings.HasPrefix(line, "data: {") && strings.Contains(line, `"content"`) {
			ttft = float64(time.Since(t0).Microseconds()) / 1000
		}
	}
	return ttft, ttft > 0, resp.Header.Get("x-kvrelay-worker") + " " + resp.Header.Get("x-kvrelay-route") + " [" + resp.Header.Get("x-kvrelay-decision") + "]"
}

// openLoop calls f (each on a goroutine) at Poisson arrivals of rate per second until ctx
// ends, and waits for the calls.
func openLoop(ctx context.Context, rate float64, seed uint64, f func(i int)) {
	r := rand.New(rand.NewPCG(seed, 7))
	var wg sync.WaitGroup
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			wg.Wait()
			return
		case <-time.After(time.Duration(r.ExpFloat64() / rate * float64(time.Second))):
		}
		wg.Add(1)
		go func() { defer wg.Done(); f(i) }()
	}
}

// measureCapacity runs n clients back to back for 10 s and returns requests per second.
func measureCapacity(base string, n int) float64 {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var done atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for c := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				if _, ok := request(ctx, base, "", fmt.Sprintf("cap %d %d", c, i)); ok && ctx.Err() == nil {
					done.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	return float64(done.Load()) / time.Since(start).Seconds()
}

func pct(s []float64, q float64) float64 {
	if len(s) == 0 {
		return 0
	}
	return s[min(int(q*float64(len(s))), len(s)-1)]
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-tenants:", err)
		os.Exit(1)
	}
}
