package planner

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
	"time"
)

// MeasureConfig says what Measure measures. Zero fields take DefaultMeasureConfig's values.
type MeasureConfig struct {
	// Target is the OpenAI base URL (http://host:port/v1; /v1 is added when missing).
	Target string
	// Role: "prefill" measures prefill points, "decode" decode points, "both" both.
	Role string
	// Model to request ("" asks /v1/models).
	Model string
	// ISLs and PrefillConcurrency span the prefill grid; every level sends
	// PrefillRequests per concurrent client (max_tokens 1).
	ISLs               []int
	PrefillConcurrency []int
	PrefillRequests    int
	// Contexts and DecodeConcurrency span the decode grid: DecodeConcurrency streams of
	// OSL tokens (ignore_eos) on prompts of each context length.
	Contexts          []int
	DecodeConcurrency []int
	OSL               int
	// Client makes the requests (default: no timeout but the context's).
	Client *http.Client
	// Progress, when set, receives one line per measured point.
	Progress io.Writer
}

// DefaultMeasureConfig spans inputs of 128 to 4096 tokens at 1 to 8 concurrent requests and
// contexts of 512 and 2048 tokens at 1 to 64 streams of 32 tokens.
func DefaultMeasureConfig() MeasureConfig {
	return MeasureConfig{
		Role:               "both",
		ISLs:               []int{128, 512, 1024, 2048, 4096},
		PrefillConcurrency: []int{1, 2, 4, 8},
		PrefillRequests:    2,
		Contexts:           []int{512, 2048},
		DecodeConcurrency:  []int{1, 4, 16, 32, 64},
		OSL:                32,
	}
}

// Measure profiles a worker through its OpenAI API (/v1/completions, streamed): any
// OpenAI-compatible engine, the simulated one included. Prompts are random words, unique
// per request so that no prefix is cached; their length is calibrated with the engine's
// own token count (usage.prompt_tokens), and the points record the lengths measured.
func Measure(ctx context.Context, cfg MeasureConfig) (*Profile, error) {
	d := DefaultMeasureConfig()
	if cfg.Role == "" {
		cfg.Role = d.Role
	}
	if len(cfg.ISLs) == 0 {
		cfg.ISLs = d.ISLs
	}
	if len(cfg.PrefillConcurrency) == 0 {
		cfg.PrefillConcurrency = d.PrefillConcurrency
	}
	if cfg.PrefillRequests <= 0 {
		cfg.PrefillRequests = d.PrefillRequests
	}
	if len(cfg.Contexts) == 0 {
		cfg.Contexts = d.Contexts
	}
	if len(cfg.DecodeConcurrency) == 0 {
		cfg.DecodeConcurrency = d.DecodeConcurrency
	}
	if cfg.OSL <= 1 {
		cfg.OSL = d.OSL
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{}
	}
	if cfg.Progress == nil {
		cfg.Progress = io.Discard
	}
	switch cfg.Role {
	case "both", "prefill", "decode":
	default:
		return nil, fmt.Errorf("measuring: role %q: want both, prefill or decode", cfg.Role)
	}
	base := strings.TrimSuffix(cfg.Target, "/")
	if !strings.HasSuffix(base, "/v1") {
		base += "/v1"
	}
	m := &measurer{cfg: cfg, base: base, rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))}
	if m.model = cfg.Model; m.model == "" {
		var err error
		if m.model, err = m.discoverModel(ctx); err != nil {
			return nil, err
		}
	}
	if err := m.calibrate(ctx); err != nil {
		return nil, err
	}
	p := &Profile{Version: ProfileVersion, Target: cfg.Target, Model: m.model, Role: cfg.Role}
	if cfg.Role != "decode" {
		for _, isl := range cfg.ISLs {
			for _, c := range cfg.PrefillConcurrency {
				pt, err := m.prefill(ctx, isl, c)
				if err != nil {
					return nil, fmt.Errorf("measuring prefill at %d tokens × %d: %w", isl, c, err)
				}
				fmt.Fprintf(cfg.Progress, "prefill isl=%.0f concurrency=%.0f ttft=%.1fms throughput=%.0f tok/s\n", pt.ISL, pt.Concurrency, pt.TTFTMs, pt.Throughput)
				p.Prefill = append(p.Prefill, pt)
			}
		}
	}
	if cfg.Role != "prefill" {
		for _, ctxLen := range cfg.Contexts {
			for _, c := range cfg.DecodeConcurrency {
				pt, err := m.decode(ctx, ctxLen, c)
				if err != nil {
					return nil, fmt.Errorf("measuring decode at %d tokens × %d: %w", ctxLen, c, err)
				}
				fmt.Fprintf(cfg.Progress, "decode context=%.0f concurrency=%.0f itl=%.2fms throughput=%.0f tok/s\n", pt.Context, pt.Concurrency, pt.ITLMs, pt.Throughput)
				p.Decode = append(p.Decode, pt)
			}
		}
	}
	p.MeasuredAt = time.Now().UTC()
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("measuring: %w", err)
	}
	return p, nil
}

type measurer struct {
	cfg          MeasureConfig
	base, model  string
	tokensPerWrd float64

	mu  sync.Mutex
	rng *rand.Rand
}

var profileWords = strings.Fields("river stone cloud market engine garden silver window planet music forest signal copper " +
	"harbor lantern meadow orbit quartz rocket saddle timber velvet walnut yellow zenith amber bridge canyon delta ember falcon")

// prompt returns about tokens tokens of random words.
func (m *measurer) prompt(tokens int) string {
	n := max(1, int(float64(tokens)/m.tokensPerWrd))
	var b strings.Builder
	m.mu.Lock()
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(profileWords[m.rng.IntN(len(profileWords))])
	}
	m.mu.Unlock()
	return b.String()
}

func (m *measurer) discoverModel(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, m.base+"/models", nil)
	if err != nil {
		return "", fmt.Errorf("discovering the model: %w", err)
	}
	resp, err := m.cfg.Client.Do(req)
	if err != nil {
		return "", fmt.Errorf("discovering the model: %w", err)
	}
	defer resp.Body.Close()
	var body struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || len(body.Data) == 0 {
		return "", fmt.Errorf("discovering the model: %s: no model listed (%v)", resp.Status, err)
	}
	return body.Data[0].ID, nil
}

// calibrate measures tokens per word of the prompt generator with the engine's tokenizer.
func (m *measurer) calibrate(ctx context.Context) error {
	m.tokensPerWrd = 1
	r, err := m.send(ctx, m.prompt(400), 1)
	if err != nil {
		return fmt.Errorf("calibrating prompt lengths: %w", err)
	}
	if r.promptTokens <= 0 {
		return errors.New("calibrating prompt lengths: the engine reported no usage.prompt_tokens")
	}
	m.tokensPerWrd = float64(r.promptTokens) / 400
	return nil
}

type result struct {
	start, first, last         time.Time
	chunks                     int
	promptTokens, outputTokens int
	times                      []time.Time // every chunk's arrival, when more than one token was asked for
}

// send streams one completion and times its chunks.
func (m *measurer) send(ctx context.Context, prompt string, maxTokens int) (result, error) {
	body, _ := json.Marshal(map[string]any{
		"model": m.model, "prompt": prompt, "max_tokens": maxTokens, "stream": true, "ignore_eos": true,
		"temperature": 0, "stream_options": map[string]any{"include_usage": true},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, m.base+"/completions", bytes.NewReader(body))
	if err != nil {
		return result{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	r := result{start: time.Now()}
	resp, err := m.cfg.Client.Do(req)
	if err != nil {
		return r, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return r, fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(msg))
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			break
		}
		var chunk struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(data, &chunk); err != nil {
			return r, fmt.Errorf("decoding a stream chunk: %w", err)
		}
		now := time.Now()
		if len(chunk.Choices) > 0 {
			if r.chunks == 0 {
				r.first = now
			}
			r.last = now
			r.chunks++
			if maxTokens > 1 {
				r.times = append(r.times, now)
			}
		}
		if chunk.Usage != nil {
			r.promptTokens, r.outputTokens = chunk.Usage.PromptTokens, chunk.Usage.CompletionTokens
		}
	}
	if err := sc.Err(); err != nil {
		return r, err
	}
	if r.chunks == 0 {
		return r, errors.New("the stream carried no tokens")
	}
	return r, nil
}

// run sends conc concurrent clients' requests, each client n in turn.
func (m *measurer) run(ctx context.Context, conc, n, tokens, maxTokens int) ([]result, time.Duration, error) {
	out := make([]result, conc*n)
	errs := make([]error, conc)
	start := time.Now()
	var wg sync.WaitGroup
	for c := range conc {
		wg.Go(func() {
			for i := range n {
				r, err := m.send(ctx, m.prompt(tokens), maxTokens)
				if err != nil {
					errs[c] = err
					return
				}
				out[c*n+i] = r
			}
		})
	}
	wg.Wait()
	return out, time.Since(start), errors.Join(errs...)
}

func (m *measurer) prefill(ctx context.Context, isl, conc int) (PrefillPoint, error) {
	rs, wall, err := m.run(ctx, conc, m.cfg.PrefillRequests, isl, 1)
	if err != nil {
		return PrefillPoint{}, err
	}
	var ttft, tokens float64
	for _, r := range rs {
		ttft += float64(r.first.Sub(r.start))
		tokens += float64(r.promptTokens)
	}
	n := float64(len(rs))
	return PrefillPoint{
		ISL: tokens / n, Concurrency: float64(conc),
		TTFTMs:     ttft / n / float64(time.Millisecond),
		Throughput: tokens / wall.Seconds(),
	}, nil
}

// decode measures conc streams decoding at once. The conc requests start together, so
// their prefills run first, interleaved with the early streams' first tokens: the point's
// ITL is taken over the gaps after every stream has its first token (steady decoding, as a
// loaded server sees it), or over whole streams when OSL is too short to leave any.
func (m *measurer) decode(ctx context.Context, ctxLen, conc int) (DecodePoint, error) {
	rs, _, err := m.run(ctx, conc, 1, ctxLen, m.cfg.OSL)
	if err != nil {
		return DecodePoint{}, err
	}
	itlMs, ok := steadyITL(rs)
	if !ok {
		return DecodePoint{}, errors.New("no stream carried more than one token")
	}
	var prompt float64
	for _, r := range rs {
		prompt += float64(r.promptTokens)
	}
	itlMs = max(itlMs, 1e-3)
	return DecodePoint{
		Context: prompt/float64(len(rs)) + float64(m.cfg.OSL)/2, Concurrency: float64(conc),
		ITLMs: itlMs, Throughput: float64(conc) * 1000 / itlMs,
	}, nil
}

// steadyITL is the mean inter-token gap (ms) of the streams after the last of them got its
// first token; without any such gap, over each stream from its first token to its last.
func steadyITL(rs []result) (float64, bool) {
	var all time.Time
	for _, r := range rs {
		if r.first.After(all) {
			all = r.first
		}
	}
	var steady, whole float64
	ns, nw := 0, 0
	for _, r := range rs {
		if r.chunks < 2 {
			continue
		}
		whole += float64(r.last.Sub(r.first)) / float64(r.chunks-1)
		nw++
		var sum time.Duration
		gaps := 0
		for i := 1; i < len(r.times); i++ {
			if !r.times[i-1].Before(all) {
				sum += r.times[i].Sub(r.times[i-1])
				gaps++
			}
		}
		if gaps > 0 {
			steady += float64(sum) / float64(gaps)
			ns++
		}
	}
	switch {
	case ns > 0:
		return steady / float64(ns) / float64(time.Millisecond), true
	case nw > 0:
		return whole / float64(nw) / float64(time.Millisecond), true
	}
	return 0, false
}
