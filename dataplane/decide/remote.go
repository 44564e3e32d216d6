package decide

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// remoteTokenizer asks engines' /tokenize for prompt token ids (vLLM's API: chat messages
// are posted as they are, so the engine applies its own chat template) and caches the
// answers: by the whole request's content, and by its messages as the prefix of a later,
// longer conversation (conversationKeys). A request whose conversation so far was tokenized
// before is routed at once on those tokens while its own are fetched in the background for
// the next turn, so an agent's tool rounds pay no round trip before their pick.
type remoteTokenizer struct {
	client *http.Client
	next   atomic.Uint64

	mu     sync.Mutex
	cache  map[xxh3.Uint128][]uint32
	order  []xxh3.Uint128
	tokens int
	max    int
	// fetching holds the keys of background fetches in flight, at most maxBackground.
	fetching map[xxh3.Uint128]bool

	hits, prefixHits, misses atomic.Uint64
}

// maxBackground bounds the background fetches in flight; past it a request's own tokens are
// not fetched for later (its next turn then waits for its round trip).
const maxBackground = 64

func newRemoteTokenizer(timeout time.Duration, maxTokens int) *remoteTokenizer {
	return &remoteTokenizer{
		client:   &http.Client{Timeout: timeout},
		cache:    map[xxh3.Uint128][]uint32{},
		fetching: map[xxh3.Uint128]bool{},
		max:      maxTokens,
	}
}

func (rt *remoteTokenizer) get(key xxh3.Uint128) ([]uint32, bool) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	ids, ok := rt.cache[key]
	return ids, ok
}

func (rt *remoteTokenizer) put(key xxh3.Uint128, ids []uint32) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.putLocked(key, ids)
}

func (rt *remoteTokenizer) putLocked(key xxh3.Uint128, ids []uint32) {
	if _, ok := rt.cache[key]; ok || len(ids) > rt.max {
		return
	}
	for rt.tokens+len(ids) > rt.max && len(rt.order) > 0 {
		old := rt.order[0]
		rt.order = rt.order[1:]
		rt.tokens -= len(rt.cache[old])
		delete(rt.cache, old)
	}
	rt.cache[key] = ids
	rt.order = append(rt.order, key)
	rt.tokens += len(ids)
}

// store keeps a fetched answer under the request's key and, for a chat request, its first
// tokens under its conversation's key (conv, zero for none) as the prefix of later turns.
func (rt *remoteTokenizer) store(key, conv xxh3.Uint128, ids []uint32) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.putLocked(key, ids)
	if conv != (xxh3.Uint128{}) && len(ids) > prefixMargin {
		rt.putLocked(conv, ids[:len(ids)-prefixMargin])
	}
}

// prefixMargin is the tokens dropped from the end of a conversation's tokens before they
// serve as a later turn's prefix: the generation prompt the template appends after the last
// message, which the next turn renders as the start of the assistant's message instead, and
// any other closing the template puts only after a final message.
const prefixMargin = 32

// longestPrefix returns the cached tokens of the longest earlier conversation among keys
// (keys[i] covers the first i+1 messages), not looking at the last key (the request's own
// conversation), and how many messages they cover.
func (rt *remoteTokenizer) longestPrefix(keys []xxh3.Uint128) ([]uint32, int) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for i := len(keys) - 2; i >= 0; i-- {
		if ids, ok := rt.cache[keys[i]]; ok {
			return ids, i + 1
		}
	}
	return nil, 0
}

// conversationKeys appends to keys one key per message of a chat request: keys[i] names the
// model, the tools, the template's arguments and messages 0..i, so that a later request extending the conversation
// shares its first keys. They are apart from the whole-request keys of the cache.
func conversationKeys(keys []xxh3.Uint128, o *oai.Request) []xxh3.Uint128 {
	h := xxh3.New()
	_, _ = h.WriteString("kvrelay conversation\x00")
	_, _ = h.Write(o.Model)
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(o.Tools)
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(o.ChatTemplateKwargs)
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(o.ReasoningEffort)
	sep := []byte{0}
	for i := range o.Messages {
		m := &o.Messages[i]
		for _, f := range [...][]byte{m.Role, m.Content, m.Name, m.ToolCallID, m.ToolCalls, m.Reasoning} {
			_, _ = h.Write(f)
			_, _ = h.Write(sep)
		}
		_, _ = h.Write([]byte{1})
		keys = append(keys, h.Sum128())
	}
	return keys
}

// tokenizeBody builds the /tokenize request for a parsed chat or completion request: chat
// messages with everything a template renders (content, name, tool calls and the id of the
// call a tool message answers, reasoning), the tools, the template's keyword arguments and
// reasoning effort, and whether to add the generation prompt.
func tokenizeBody(o *oai.Request, kind oai.Kind) ([]byte, error) {
	if kind == oai.Completions {
		return json.Marshal(map[string]any{"model": string(o.Model), "prompt": string(o.Prompt)})
	}
	type msg struct {
		Role       string          `json:"role"`
		Content    string          `json:"content"`
		Name       string          `json:"name,omitempty"`
		ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
		ToolCallID string          `json:"tool_call_id,omitempty"`
		Reasoning  string          `json:"reasoning_content,omitempty"`
	}
	msgs := make([]msg, len(o.Messages))
	for i, m := range o.Messages {
		msgs[i] = msg{Role: string(m.Role), Content: string(m.Content), Name: string(m.Name),
			ToolCalls: json.RawMessage(m.ToolCalls), ToolCallID: string(m.ToolCallID), Reasoning: string(m.Reasoning)}
	}
	body := map[string]any{
		"model":                 string(o.Model),
		"messages":              msgs,
		"add_generation_prompt": o.AddGenerationPrompt && !o.ContinueFinalMessage,
	}
	if len(o.Tools) > 0 {
		body["tools"] = json.RawMessage(o.Tools)
	}
	if len(o.ChatTemplateKwargs) > 0 {
		body["chat_template_kwargs"] = json.RawMessage(o.ChatTemplateKwargs)
	}
	if len(o.ReasoningEffort) > 0 {
		body["reasoning_effort"] = string(o.ReasoningEffort)
	}
	return json.Marshal(body)
}

// pick chooses the worker to ask: a healthy one serving model, in turn.
func (rt *remoteTokenizer) pick(pool *route.Pool, model string) *route.Worker {
	now := route.Now()
	ws := pool.Workers
	start := int(rt.next.Add(1))
	for i := range ws {
		w := ws[(start+i)%len(ws)]
		if (w.Model == "" || w.Model == model) && w.Healthy(now) {
			return w
		}
	}
	return nil
}

// fetch posts body to w's /tokenize and returns the ids.
func (rt *remoteTokenizer) fetch(ctx context.Context, w *route.Worker, body []byte) ([]uint32, error) {
	data, err := postJSON(ctx, rt.client, w.URL+"/tokenize", body, 64<<20)
	if err != nil {
		return nil, fmt.Errorf("tokenizing remotely on %s: %w", w.ID, err)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("tokenizing remotely on %s: %w", w.ID, err)
	}
	return out.Tokens, nil
}

// remotePending is a remote tokenization Prepare left to Work: the body to post to worker
// w's /tokenize, and the cache keys its answer goes under.
type remotePending struct {
	w         *route.Worker
	key, conv xxh3.Uint128
	body      []byte
}

// tokenizeRemote gets the request's ids from the cache, or routes it at once on the cached
// tokens of its conversation so far while fetching its own in the background, or leaves the
// fetch in r.pend and returns ErrRemote.
func (r *Request) tokenizeRemote() error {
	c := r.c
	body, err := tokenizeBody(&r.oreq, r.kind)
	if err != nil {
		return err
	}
	key := xxh3.Hash128(body)
	if ids, ok := c.remote.get(key); ok {
		c.remote.hits.Add(1)
		r.toks = append(r.toks[:0], ids...)
		return nil
	}
	var conv xxh3.Uint128
	if r.kind == oai.ChatCompletions {
		r.convKeys = conversationKeys(r.convKeys[:0], &r.oreq)
		conv = r.convKeys[len(r.convKeys)-1]
	}
	w := c.remote.pick(c.kv.Pool(), unsafeString(r.oreq.Model))
	if w == nil {
		return errNoTokenizer
	}
	if ids, covered := c.remote.longestPrefix(r.convKeys); covered > 0 {
		c.remote.prefixHits.Add(1)
		r.toks = append(r.toks[:0], ids...)
		// The messages past the prefix are new: their length is all routing needs of them.
		rest := 0
		for i := covered; i < len(r.oreq.Messages); i++ {
			rest += len(r.oreq.Messages[i].Content) + len(r.oreq.Messages[i].ToolCalls)
		}
		r.extraTokens = (rest + bytesPerToken - 1) / bytesPerToken
		c.remote.background(w, key, conv, body)
		return nil
	}
	c.remote.misses.Add(1)
	r.pend = remotePending{w: w, key: key, conv: conv, body: body}
	return ErrRemote
}

// fetchPending asks r.pend's worker for the ids, and caches them.
func (r *Request) fetchPending() ([]uint32, error) {
	c := r.c
	ctx, cancel := context.WithTimeout(context.Background(), c.remote.client.Timeout)
	defer cancel()
	p := r.pend
	ids, err := c.remote.fetch(ctx, p.w, p.body)
	if err == nil {
		c.remote.store(p.key, p.conv, ids)
	}
	return ids, err
}

// background fetches a request's ids for later turns, unless that fetch is under way or
// maxBackground are.
func (rt *remoteTokenizer) background(w *route.Worker, key, conv xxh3.Uint128, body []byte) {
	rt.mu.Lock()
	if rt.fetching[key] || len(rt.fetching) >= maxBackground {
		rt.mu.Unlock()
		return
	}
	rt.fetching[key] = true
	rt.mu.Unlock()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), rt.client.Timeout)
		defer cancel()
		ids, err := rt.fetch(ctx, w, body)
		if err == nil {
			rt.store(key, conv, ids)
		}
		rt.mu.Lock()
		delete(rt.fetching, key)
		rt.mu.Unlock()
	}()
}

// remoteResult goes on with a remote tokenization's answer: the ids, hashed, or, when the
// engine could not tokenize, an estimate from the prompt's text.
func (r *Request) remoteResult(ids []uint32, err error) error {
	c := r.c
	if err != nil {
		c.log.Warn("remote tokenization failed; estimating from text", "err", err)
		c.m.remoteFallbacks.Inc()
		text, terr := r.promptText(c.codecFor(r.oreq.Model))
		if terr != nil {
			return terr
		}
		r.estimate(text)
		return nil
	}
	r.toks = append(r.toks[:0], ids...)
	// The round trip is the tokenize stage of this request's decision.
	r.stage(stageTokenize, r.tokStart)
	r.hashTokens()
	return nil
}

// postJSON posts a JSON body and returns the answer of a 200, of at most limit bytes; any
// other status is an error quoting the start of the answer.
func postJSON(ctx context.Context, c *http.Client, url string, body []byte, limit int64) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("answer over %d bytes", limit)
	}
	if resp.StatusCode != http.StatusOK {
		if len(data) > 200 {
			data = append(data[:200:200], "…"...)
		}
		return nil, fmt.Errorf("status %d: %s", resp.StatusCode, data)
	}
	return data, nil
}
