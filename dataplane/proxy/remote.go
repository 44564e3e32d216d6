package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/panjf2000/gnet/v2"
	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// errPending reports that a request's tokens come from a remote tokenizer: the request
// resumes on its loop when they arrive.
var errPending = errors.New("tokenization pending")

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
	data, err := postJSON(ctx, rt.client, w.URL+"/tokenize", nil, body, 64<<20)
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

// remotePending is a remote tokenization input.prepare left to its caller: the body to
// post to worker w's /tokenize, and the cache keys its answer goes under.
type remotePending struct {
	w         *route.Worker
	key, conv xxh3.Uint128
	body      []byte
}

// tokenizeRemote gets the request's ids from the cache, or routes it at once on the cached
// tokens of its conversation so far while fetching its own in the background, or leaves the
// fetch in in.pend and returns errPending.
func (in *input) tokenizeRemote() error {
	s := in.srv
	body, err := tokenizeBody(&in.oreq, in.kind)
	if err != nil {
		return err
	}
	key := xxh3.Hash128(body)
	if ids, ok := s.remote.get(key); ok {
		s.remote.hits.Add(1)
		in.toks = append(in.toks[:0], ids...)
		return nil
	}
	var conv xxh3.Uint128
	if in.kind == oai.ChatCompletions {
		in.convKeys = conversationKeys(in.convKeys[:0], &in.oreq)
		conv = in.convKeys[len(in.convKeys)-1]
	}
	w := s.remote.pick(s.kv.Pool(), unsafeString(in.oreq.Model))
	if w == nil {
		return errNoTokenizer
	}
	if ids, covered := s.remote.longestPrefix(in.convKeys); covered > 0 {
		s.remote.prefixHits.Add(1)
		in.toks = append(in.toks[:0], ids...)
		// The messages past the prefix are new: their length is all routing needs of them.
		rest := 0
		for i := covered; i < len(in.oreq.Messages); i++ {
			rest += len(in.oreq.Messages[i].Content) + len(in.oreq.Messages[i].ToolCalls)
		}
		in.extraTokens = (rest + bytesPerToken - 1) / bytesPerToken
		s.remote.background(w, key, conv, body)
		return nil
	}
	s.remote.misses.Add(1)
	in.pend = remotePending{w: w, key: key, conv: conv, body: body}
	return errPending
}

// fetchPending asks in.pend's worker for the ids, and caches them.
func (in *input) fetchPending() ([]uint32, error) {
	s := in.srv
	ctx, cancel := context.WithTimeout(context.Background(), s.remote.client.Timeout)
	defer cancel()
	p := in.pend
	ids, err := s.remote.fetch(ctx, p.w, p.body)
	if err == nil {
		s.remote.store(p.key, p.conv, ids)
	}
	return ids, err
}

// fetchRemote fetches the ids prepare left pending on a goroutine and resumes the request on
// its loop with them (remoteDone).
func (cc *clientConn) fetchRemote() {
	cc.state = stTokenize
	lp := cc.lp
	go func() {
		ids, err := cc.fetchPending()
		_ = lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
			if cc.state != stTokenize {
				return nil // the client left
			}
			cc.lp.now = nanotime()
			cc.state = stIdle
			cc.remoteDone(ids, err)
			return nil
		}))
	}()
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

var errNoTokenizer = errors.New("no healthy worker to tokenize the prompt")

// remoteResult goes on with a remote tokenization's answer: the ids, hashed, or, when the
// engine could not tokenize, an estimate from the prompt's text.
func (in *input) remoteResult(ids []uint32, err error) error {
	s := in.srv
	if err != nil {
		s.log.Warn("remote tokenization failed; estimating from text", "err", err)
		s.metrics.remoteFallbacks.Inc()
		text, terr := in.promptText(s.codecFor(in.oreq.Model))
		if terr != nil {
			return terr
		}
		in.estimate(text)
		return nil
	}
	in.toks = append(in.toks[:0], ids...)
	// The round trip is the tokenize stage of this request's decision.
	in.stage(stageTokenize, in.tokStart)
	in.hashTokens()
	return nil
}

// remoteDone continues a request whose remote tokenization ended.
func (cc *clientConn) remoteDone(ids []uint32, err error) {
	if err := cc.remoteResult(ids, err); err != nil {
		cc.errorReply(400, err.Error(), "messages", "")
		return
	}
	cc.route(false)
}
