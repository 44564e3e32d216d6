// Command bench-routing compares routing policies on a prefix-sharing workload, in one run:
// for each policy it starts simulated workers and a proxy in this process, replays the same
// request stream (16 system prompts of about 2k tokens, each request adding a short user
// question, Poisson arrivals), and reports the prefix cache hit rate the engines report
// (cached_tokens over prompt_tokens), TTFT and end-to-end latency as clients see them, with
// ratios to the first policy.
//
//	go run ./hack/bench-routing [-policies kv,round-robin] [-requests 400] [-rate 20]
//
// Workers get a KV cache that holds about a third of the prompts' prefixes, as in a
// production fleet, so that where a prefix goes decides whether it is found again.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
)

func main() {
	policies := flag.String("policies", "kv,round-robin", "comma-separated routing policies; ratios are to the first")
	workers := flag.Int("workers", 4, "simulated workers")
	groups := flag.Int("groups", 16, "distinct system prompts")
	sysWords := flag.Int("system-words", 1000, "words per system prompt (about 2 tokens each)")
	requests := flag.Int("requests", 400, "requests per policy")
	rate := flag.Float64("rate", 20, "mean arrivals per second (Poisson)")
	blocks := flag.Int("num-gpu-blocks", 1024, "KV blocks per worker")
	speedup := flag.Float64("speedup", 10, "simulated engine speedup")
	maxTokens := flag.Int("max-tokens", 32, "output tokens per request")
	seed := flag.Uint64("seed", 1, "workload seed")
	flag.Parse()

	codec, err := sim.NewCodec("gpt-oss-120b", "", "")
	if err != nil {
		log.Fatal(err)
	}
	work := workload(*seed, *groups, *sysWords, *requests, *rate, *maxTokens)
	var results []result
	for _, policy := range strings.Split(*policies, ",") {
		r, err := runPolicy(policy, codec, work, *workers, *blocks, *speedup)
		if err != nil {
			log.Fatalf("%s: %v", policy, err)
		}
		results = append(results, r)
	}
	print(results, *workers, *groups, *requests, *rate, *blocks)
}

type request struct {
	at   time.Duration
	body string
}

func workload(seed uint64, groups, sysWords, n int, rate float64, maxTokens int) []request {
	rng := rand.New(rand.NewPCG(seed, 7))
	vocab := strings.Fields("river stone cloud market engine garden silver window planet music forest signal copper lantern harbor meadow")
	systems := make([]string, groups)
	for g := range systems {
		var b strings.Builder
		fmt.Fprintf(&b, "You are assistant number %d. ", g)
		for range sysWords {
			b.WriteString(vocab[rng.IntN(len(vocab))])
			b.WriteByte(' ')
		}
		systems[g] = b.String()
	}
	var out []request
	var t time.Duration
	for i := range n {
		t += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		g := rng.IntN(groups)
		user := fmt.Sprintf("Question %d: %s %s %s?", i, vocab[rng.IntN(len(vocab))], vocab[rng.IntN(len(vocab))], vocab[rng.IntN(len(vocab))])
		body, _ := json.Marshal(map[string]any{
			"model": "gpt-oss-120b", "max_tokens": maxTokens, "ignore_eos": true, "stream": true,
			"stream_options": map[string]bool{"include_usage": true},
			"messages":       []map[string]string{{"role": "system", "content": systems[g]}, {"role": "user", "content": user}},
		})
		out = append(out, request{at: t, body: string(body)})
	}
	return out
}

type result struct {
	policy         string
	prompt, cached int64
	ttft, e2e      []time.Duration
	errors         int
	wall           time.Duration
}

func runPolicy(policy string, codec sim.Codec, work []request, n, blocks int, speedup float64) (result, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	cfg := proxy.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.Policy = policy
	for i := range n {
		wc := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec}
		wc.Engine.NumGPUBlocks = blocks
		wc.Engine.Timing.Speedup = speedup
		w, err := sim.NewWorker(wc)
		if err != nil {
			return result{}, err
		}
		if err := w.Start(ctx); err != nil {
			return result{}, err
		}
		defer w.Close()
		wg.Add(1)
		go func() { defer wg.Done(); _ = w.Run(ctx) }()
		cfg.Upstreams = append(cfg.Upstreams, proxy.Upstream{ID: "w" + strconv.Itoa(i), URL: w.URL(), Model: "gpt-oss-120b", Capacity: blocks})
	}
	p, err := proxy.New(cfg, nil)
	if err != nil {
		return result{}, err
	}
	if err := p.Start(ctx); err != nil {
		return result{}, err
	}
	defer p.Close()
	url := "http://" + p.Addr() + "/v1/chat/completions"
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}

	res := result{policy: policy}
	var mu sync.Mutex
	var reqs sync.WaitGroup
	start := time.Now()
	for _, r := range work {
		time.Sleep(time.Until(start.Add(r.at)))
		reqs.Add(1)
		go func() {
			defer reqs.Done()
			ttft, e2e, prompt, cached, err := send(client, url, r.body)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				res.errors++
				return
			}
			res.ttft = append(res.ttft, ttft)
			res.e2e = append(res.e2e, e2e)
			res.prompt += prompt
			res.cached += cached
		}()
	}
	reqs.Wait()
	res.wall = time.Since(start)
	cancel()
	wg.Wait()
	return res, nil
}

// send streams one request and measures TTFT (first content chunk) and end to end.
func send(client *http.Client, url, body string) (ttft, e2e time.Duration, prompt, cached int64, err error) {
	t0 := time.Now()
	resp, err := client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		return 0, 0, 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return 0, 0, 0, 0, fmt.Errorf("status %d", resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens        int64 `json:"prompt_tokens"`
				PromptTokensDetails struct {
					CachedTokens int64 `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if json.Unmarshal([]byte(data), &chunk) != nil {
			continue
		}
		if ttft == 0 && len(chunk.Choices) > 0 && chunk.Choices[0].Delta.Content != "" {
			ttft = time.Since(t0)
		}
		if chunk.Usage != nil {
			prompt, cached = chunk.Usage.PromptTokens, chunk.Usage.PromptTokensDetails.CachedTokens
		}
	}
	return ttft, time.Since(t0), prompt, cached, sc.Err()
}

func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

func print(rs []result, workers, groups, requests int, rate float64, blocks int) {
	fmt.Printf("prefix-sharing workload: %d workers × %d KV blocks, %d system prompts, %d requests at %.0f/s\n\n", workers, blocks, groups, requests, rate)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\thit rate\tTTFT p50\tTTFT p99\tE2E p50\tE2E p99\terrors\t")
	for _, r := range rs {
		hit := 0.0
		if r.prompt > 0 {
			hit = float64(r.cached) / float64(r.prompt)
		}
		fmt.Fprintf(tw, "%s\t%.1f%%\t%v\t%v\t%v\t%v\t%d\t\n", r.policy, 100*hit,
			pct(r.ttft, .5).Round(time.Microsecond*100), pct(r.ttft, .99).Round(time.Microsecond*100),
			pct(r.e2e, .5).Round(time.Microsecond*100), pct(r.e2e, .99).Round(time.Microsecond*100), r.errors)
	}
	tw.Flush()
	if len(rs) > 1 {
		fmt.Println()
		base := rs[0]
		for _, r := range rs[1:] {
			fmt.Printf("%s vs %s: hit rate %.2fx, TTFT p50 %.2fx, TTFT p99 %.2fx\n", base.policy, r.policy,
				ratio(hitRate(base), hitRate(r)), ratio(float64(pct(r.ttft, .5)), float64(pct(base.ttft, .5))),
				ratio(float64(pct(r.ttft, .99)), float64(pct(base.ttft, .99))))
		}
		fmt.Println("(hit rate: higher is better; TTFT ratios: how many times slower the other policy is)")
	}
}

func hitRate(r result) float64 {
	if r.prompt == 0 {
		return 0
	}
	return float64(r.cached) / float64(r.prompt)
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
