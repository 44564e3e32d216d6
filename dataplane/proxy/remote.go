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
// answers by request content.
type remoteTokenizer struct {
	client *http.Client
	next   atomic.Uint64

	mu     sync.Mutex
	cache  map[xxh3.Uint128][]uint32
	order  []xxh3.Uint128
	tokens int
	max    int
	hits   atomic.Uint64
	misses atomic.Uint64
}

func newRemoteTokenizer(timeout time.Duration, maxTokens int) *remoteTokenizer {
	return &remoteTokenizer{
		client: &http.Client{Timeout: timeout},
		cache:  map[xxh3.Uint128][]uint32{},
		max:    maxTokens,
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

// tokenizeBody builds the /tokenize request for a parsed chat or completion request.
func tokenizeBody(o *oai.Request, kind oai.Kind) ([]byte, error) {
	if kind == oai.Completions {
		return json.Marshal(map[string]any{"model": string(o.Model), "prompt": string(o.Prompt)})
	}
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
		Name    string `json:"name,omitempty"`
	}
	msgs := make([]msg, len(o.Messages))
	for i, m := range o.Messages {
		msgs[i] = msg{Role: string(m.Role), Content: string(m.Content), Name: string(m.Name)}
	}
	body := map[string]any{
		"model":                 string(o.Model),
		"messages":              msgs,
		"add_generation_prompt": o.AddGenerationPrompt && !o.ContinueFinalMessage,
	}
	if len(o.Tools) > 0 {
		body["tools"] = json.RawMessage(o.Tools)
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

// tokenizeRemote gets the request's ids from the cache, or starts fetching them and returns
// errPending; the fetch resumes the request on its loop.
func (cc *clientConn) tokenizeRemote() error {
	s := cc.srv
	body, err := tokenizeBody(&cc.oreq, cc.kind)
	if err != nil {
		return err
	}
	key := xxh3.Hash128(body)
	if ids, ok := s.remote.get(key); ok {
		s.remote.hits.Add(1)
		cc.toks = append(cc.toks[:0], ids...)
		return nil
	}
	s.remote.misses.Add(1)
	w := s.remote.pick(s.kv.Pool(), unsafeString(cc.oreq.Model))
	if w == nil {
		return errNoTokenizer
	}
	cc.state = stTokenize
	lp := cc.lp
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), s.remote.client.Timeout)
		defer cancel()
		ids, err := s.remote.fetch(ctx, w, body)
		if err == nil {
			s.remote.put(key, ids)
		}
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
	return errPending
}

var errNoTokenizer = errors.New("no healthy worker to tokenize the prompt")

// remoteDone continues a request whose remote tokenization ended: with the ids, or, when the
// engine could not tokenize, by estimating from the prompt's text.
func (cc *clientConn) remoteDone(ids []uint32, err error) {
	s := cc.srv
	if err != nil {
		s.log.Warn("remote tokenization failed; estimating from text", "err", err)
		s.metrics.remoteFallbacks.Inc()
		text, terr := cc.promptText(s.codecFor(cc.oreq.Model))
		if terr != nil {
			cc.errorReply(400, terr.Error(), "messages", "")
			return
		}
		cc.estimate(text)
	} else {
		cc.toks = append(cc.toks[:0], ids...)
		// The round trip is the tokenize stage of this request's decision.
		cc.stage(stageTokenize, cc.tokStart)
		cc.hashTokens()
	}
	cc.route(false)
}
