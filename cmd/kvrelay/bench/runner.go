package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
)

// Options configure one run against one endpoint.
type Options struct {
	// Target is the endpoint's base URL, ending in /v1 (e.g. http://127.0.0.1:8080/v1).
	Target string
	// Model is sent in every request; empty asks the endpoint's /v1/models.
	Model string
	// Rate, when > 0, replaces the open-loop requests' own arrival times with Poisson
	// arrivals at Rate requests per second of the workload's time: Speedup divides the gaps
	// as it divides the workload's own, so that a compare run at engine speedup S offers
	// the engines Rate requests per second of their own time.
	Rate float64
	// Concurrency, when > 0, caps the requests in flight; open-loop requests then wait for
	// a free slot instead of their arrival time (a closed loop of Concurrency clients).
	Concurrency int
	// Requests, when > 0, stops after that many requests have been sent.
	Requests int
	// Duration, when > 0, stops sending after that long; requests in flight finish.
	Duration time.Duration
	// Speedup divides the workload's arrival and think times (the simulated engines' step
	// times are divided alike by the cluster, so a compressed run keeps its load shape).
	Speedup float64
	// TimeScale multiplies every measured time (latencies, start times, the run's wall
	// time) before they are summarised, so that a run against engines whose step times are
	// divided by N reports in the engines' own time with TimeScale N, and the SLO means what
	// it means on real engines. Default 1.
	TimeScale float64
	// RequestTimeout bounds one request (default 10 minutes).
	RequestTimeout time.Duration
	// Progress, when set, receives progress reports while the run goes.
	Progress *Progress
	// CacheBlocks, when > 0, is the endpoint's KV cache in blocks across all its engines: the
	// summary then also reports the hit rate one LRU cache of that size would reach
	// (Summary.LRUHitRate), a reference for routing with that much memory.
	CacheBlocks int
	// Prefill, when set, is the engines' prefill time model: the summary then splits each
	// request's TTFT into its own prefill and its wait (Summary.Breakdown).
	Prefill *PrefillModel
}

func (o *Options) defaults() {
	if o.Speedup <= 0 {
		o.Speedup = 1
	}
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = 10 * time.Minute
	}
	if o.TimeScale <= 0 {
		o.TimeScale = 1
	}
}

// scaleTimes multiplies the times recs measured, and wall, by k.
func scaleTimes(recs []*Record, wall time.Duration, k float64) time.Duration {
	if k == 1 {
		return wall
	}
	mul := func(d time.Duration) time.Duration { return time.Duration(float64(d) * k) }
	for _, r := range recs {
		r.Start, r.TTFT, r.E2E, r.PredictedTTFT = mul(r.Start), mul(r.TTFT), mul(r.E2E), mul(r.PredictedTTFT)
		for i, g := range r.ITL {
			r.ITL[i] = mul(g)
		}
	}
	return mul(wall)
}

// Record is what one request measured.
type Record struct {
	// Seq is the order in which requests were sent.
	Seq int `json:"seq"`
	// Start is when the request was sent, from the start of the run.
	Start time.Duration `json:"start_ns"`
	// TTFT is the time to the first content chunk; E2E to the last byte.
	TTFT time.Duration `json:"ttft_ns"`
	E2E  time.Duration `json:"e2e_ns"`
	// ITL holds the gaps between consecutive content chunks.
	ITL []time.Duration `json:"itl_ns,omitempty"`
	// Status is the HTTP status (0 when the request failed before one arrived); Err the
	// error, if any (a failed connection, an error object mid-stream).
	Status int    `json:"status"`
	Err    string `json:"error,omitempty"`
	// Token counts the engine reported in usage.
	PromptTokens     int `json:"prompt_tokens"`
	CachedTokens     int `json:"cached_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	// Worker is the x-kvrelay-worker header, when the proxy exposes it.
	Worker string `json:"worker,omitempty"`
	// Route is the x-kvrelay-route header: how the proxy chose the worker and the prompt
	// blocks it believed cached there and anywhere.
	Route string `json:"route,omitempty"`
	// PredictedTTFT is the proxy's predicted TTFT for the request (the route header's
	// ttft_ms, under the latency policy), 0 when it gave none.
	PredictedTTFT time.Duration `json:"predicted_ttft_ns,omitempty"`
	Tag           string        `json:"tag,omitempty"`
	Session       string        `json:"session,omitempty"`
	// IdealCached is the prompt tokens an unbounded prefix cache shared by every engine
	// would have held for this request (HitBounds; 0 for a request it did not count).
	IdealCached int `json:"ideal_cached_tokens,omitempty"`

	req    *workload.Request
	answer string
}

// OK reports whether the request completed with a 200 and no stream error.
func (r *Record) OK() bool { return r.Status == http.StatusOK && r.Err == "" }

// Run replays w against opts.Target and returns every request's record, in send order.
func Run(ctx context.Context, opts Options, w *workload.Workload) ([]*Record, time.Duration, error) {
	opts.defaults()
	if opts.Model == "" {
		m, err := firstModel(ctx, opts.Target)
		if err != nil {
			return nil, 0, err
		}
		opts.Model = m
	}
	r := &runner{
		opts:   opts,
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4096, MaxConnsPerHost: 0, DisableCompression: true}},
		start:  time.Now(),
	}
	if opts.Concurrency > 0 {
		r.slots = make(chan struct{}, opts.Concurrency)
	}
	runCtx := ctx
	var cancel context.CancelFunc
	if opts.Duration > 0 {
		runCtx, cancel = context.WithTimeout(ctx, opts.Duration)
		defer cancel()
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); r.open(runCtx, ctx, w.Open) }()
	for _, s := range w.Sessions {
		wg.Add(1)
		go func() { defer wg.Done(); r.session(runCtx, ctx, s, "") }()
	}
	wg.Wait()
	wall := time.Since(r.start)
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.records, wall, ctx.Err()
}

type runner struct {
	opts    Options
	client  *http.Client
	start   time.Time
	slots   chan struct{}
	sent    atomic.Int64
	mu      sync.Mutex
	records []*Record
}

// claim reserves the next request number; false once Requests have been sent.
func (r *runner) claim() (int, bool) {
	n := int(r.sent.Add(1))
	if r.opts.Requests > 0 && n > r.opts.Requests {
		return 0, false
	}
	return n - 1, true
}

// open sends the open-loop requests at their arrival times (or Poisson at Rate, or as fast
// as the concurrency slots allow).
func (r *runner) open(sendCtx, ctx context.Context, reqs []workload.Request) {
	var wg sync.WaitGroup
	defer wg.Wait()
	rng := rand.New(rand.NewPCG(uint64(len(reqs)), 42))
	var at time.Duration
	for i := range reqs {
		req := &reqs[i]
		switch {
		case r.slots != nil:
			// Closed loop: the slot, not the clock, paces.
		case r.opts.Rate > 0:
			// Rate is in the workload's time, like its own arrival times: Speedup divides it.
			at += time.Duration(rng.ExpFloat64() / (r.opts.Rate * r.opts.Speedup) * float64(time.Second))
			if !sleepUntil(sendCtx, r.start.Add(at)) {
				return
			}
		default:
			if !sleepUntil(sendCtx, r.start.Add(time.Duration(float64(req.At)/r.opts.Speedup))) {
				return
			}
		}
		if r.slots != nil {
			select {
			case r.slots <- struct{}{}:
			case <-sendCtx.Done():
				return
			}
		}
		seq, ok := r.claim()
		if !ok {
			if r.slots != nil {
				<-r.slots
			}
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.send(ctx, seq, req)
			if r.slots != nil {
				<-r.slots
			}
		}()
	}
}

// session runs one closed-loop conversation: each turn after the previous answered and its
// think time passed; subagents a turn spawns run to their end before the next turn.
func (r *runner) session(sendCtx, ctx context.Context, s workload.Session, first string) {
	prev := first
	for {
		req, ok := s.Next(prev)
		if !ok {
			return
		}
		if !sleepFor(sendCtx, time.Duration(float64(req.At)/r.opts.Speedup)) {
			return
		}
		if r.slots != nil {
			select {
			case r.slots <- struct{}{}:
			case <-sendCtx.Done():
				return
			}
		}
		seq, ok := r.claim()
		if !ok {
			if r.slots != nil {
				<-r.slots
			}
			return
		}
		rec := r.send(ctx, seq, &req)
		if r.slots != nil {
			<-r.slots
		}
		if !rec.OK() {
			return // a conversation does not go on past a failed turn
		}
		if len(req.Spawn) > 0 {
			var wg sync.WaitGroup
			for _, sub := range req.Spawn {
				wg.Add(1)
				go func() { defer wg.Done(); r.session(sendCtx, ctx, sub, rec.answer) }()
			}
			wg.Wait()
		}
		prev = rec.answer
	}
}

// send makes one streaming request and measures it.
func (r *runner) send(ctx context.Context, seq int, req *workload.Request) *Record {
	rec := &Record{Seq: seq, Tag: req.Tag, Session: req.Session, req: req}
	path := "/completions"
	if req.Chat {
		path = "/chat/completions"
	}
	body := req.Body(r.opts.Model, true)
	ctx, cancel := context.WithTimeout(ctx, r.opts.RequestTimeout)
	defer cancel()
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, r.opts.Target+path, bytes.NewReader(body))
	if err != nil {
		rec.Err = err.Error()
		r.finish(rec)
		return rec
	}
	hreq.Header.Set("Content-Type", "application/json")
	if id := req.WireSession(); id != "" {
		hreq.Header.Set("x-session-id", id)
	}
	t0 := time.Now()
	rec.Start = t0.Sub(r.start)
	r.opts.Progress.sent()
	resp, err := r.client.Do(hreq)
	if err != nil {
		rec.Err = err.Error()
		rec.E2E = time.Since(t0)
		r.finish(rec)
		return rec
	}
	defer resp.Body.Close()
	rec.Status = resp.StatusCode
	rec.Worker = resp.Header.Get("x-kvrelay-worker")
	rec.Route = resp.Header.Get("x-kvrelay-route")
	rec.PredictedTTFT = predictedTTFT(rec.Route)
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		rec.Err = errorMessage(b)
		rec.E2E = time.Since(t0)
		r.finish(rec)
		return rec
	}
	readStream(resp.Body, t0, rec)
	rec.E2E = time.Since(t0)
	r.finish(rec)
	return rec
}

func (r *runner) finish(rec *Record) {
	r.mu.Lock()
	r.records = append(r.records, rec)
	r.mu.Unlock()
	r.opts.Progress.done(rec)
}

// chunk is the part of a streamed chunk the runner reads.
type chunk struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta struct {
			Content          string          `json:"content"`
			ReasoningContent string          `json:"reasoning_content"`
			Reasoning        string          `json:"reasoning"`
			ToolCalls        json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// readStream reads an SSE response: TTFT at the first content chunk, a gap per later
// content chunk, usage from the final chunk, the answer text (reasoning first, then content,
// as a session expects it).
func readStream(body io.Reader, t0 time.Time, rec *Record) {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	var reasoning, content strings.Builder
	var last time.Time
	for sc.Scan() {
		line := sc.Bytes()
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if bytes.Equal(data, []byte("[DONE]")) {
			continue
		}
		now := time.Now()
		var c chunk
		if err := json.Unmarshal(data, &c); err != nil {
			rec.Err = "malformed stream chunk: " + err.Error()
			continue
		}
		if c.Error != nil {
			rec.Err = "stream error: " + c.Error.Message
		}
		got := false
		for _, ch := range c.Choices {
			piece := ch.Text + ch.Delta.Content
			think := ch.Delta.ReasoningContent + ch.Delta.Reasoning
			if piece != "" || think != "" || len(ch.Delta.ToolCalls) > 0 {
				got = true
			}
			content.WriteString(piece)
			reasoning.WriteString(think)
		}
		if got {
			if last.IsZero() {
				rec.TTFT = now.Sub(t0)
			} else {
				rec.ITL = append(rec.ITL, now.Sub(last))
			}
			last = now
		}
		if u := c.Usage; u != nil {
			rec.PromptTokens, rec.CompletionTokens = u.PromptTokens, u.CompletionTokens
			if u.PromptTokensDetails != nil {
				rec.CachedTokens = u.PromptTokensDetails.CachedTokens
			}
		}
	}
	if err := sc.Err(); err != nil && rec.Err == "" {
		rec.Err = "reading the stream: " + err.Error()
	}
	rec.answer = reasoning.String() + content.String()
}

// errorMessage extracts an OpenAI error message from a body.
func errorMessage(b []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
		Message string `json:"message"`
	}
	if json.Unmarshal(b, &e) == nil {
		if e.Error.Message != "" {
			return e.Error.Message
		}
		if e.Message != "" {
			return e.Message
		}
	}
	return strings.TrimSpace(string(b))
}

// firstModel asks an endpoint which model it serves.
func firstModel(ctx context.Context, target string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target+"/models", nil)
	if err != nil {
		return "", fmt.Errorf("asking %s for its models: %w", target, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("asking %s for its models: %w", target, err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || len(list.Data) == 0 {
		return "", errors.New("the endpoint lists no model; pass --model")
	}
	return list.Data[0].ID, nil
}

func sleepUntil(ctx context.Context, t time.Time) bool { return sleepFor(ctx, time.Until(t)) }

func sleepFor(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-ctx.Done():
		return false
	}
}
