package sim

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// Server is the OpenAI-compatible HTTP API of one simulated worker, shaped like vLLM's:
// /v1/chat/completions, /v1/completions, their /render forms, /v1/models, /tokenize,
// /detokenize, /health, /metrics and /reset_prefix_cache. Handlers run on net/http's goroutines and hand requests to
// the engine, whose scheduler goroutine produces the tokens they stream.
type Server struct {
	eng *Engine
	kv  *kvConnector // nil in role both without PeerFetch
	// offloads: the engine has a host or disk tier, so it reads max_load_tokens as vLLM's
	// offloading connector does.
	offloads bool
	codec    Codec
	metrics  *Metrics
	model    string
	text     map[uint32]string // filler token → its text; read-only after construction
	created  int64
	idBase   string
	ids      atomic.Uint64
	bufs     sync.Pool
}

// NewServer builds the API of eng. text maps each output token id to its text.
func NewServer(eng *Engine, codec Codec, metrics *Metrics, text map[uint32]string) *Server {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &Server{
		eng:      eng,
		kv:       eng.kv,
		offloads: eng.cfg.CPUOffloadBlocks > 0 || eng.cfg.DiskOffloadBlocks > 0,
		codec:    codec,
		metrics:  metrics,
		model:    eng.cfg.Model,
		text:     text,
		created:  time.Now().Unix(),
		idBase:   hex.EncodeToString(b[:]),
		bufs:     sync.Pool{New: func() any { b := make([]byte, 0, 4096); return &b }},
	}
}

// Handler returns the HTTP routes.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, true) })
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, false) })
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("POST /tokenize", s.tokenize)
	mux.HandleFunc("POST /v1/chat/completions/render", func(w http.ResponseWriter, r *http.Request) { s.render(w, r, true) })
	mux.HandleFunc("POST /v1/completions/render", func(w http.ResponseWriter, r *http.Request) { s.render(w, r, false) })
	mux.HandleFunc("POST /detokenize", s.detokenize)
	mux.HandleFunc("POST /reset_prefix_cache", s.resetPrefixCache)
	if s.kv != nil {
		mux.HandleFunc("POST /kvrelay/kv/export", s.exportKV)
	}
	if s.metrics != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics.Registry(), promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &apiError{status: http.StatusNotFound, typ: "NotFoundError", message: "no route for " + r.Method + " " + r.URL.Path})
	})
	return methodNotAllowed(mux)
}

// methodNotAllowed answers a known path asked with the wrong method with 405 and an OpenAI
// error object (the catch-all route would otherwise call it 404).
func methodNotAllowed(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, pattern := mux.Handler(r); pattern == "/" {
			probe := r.Clone(r.Context())
			for _, m := range []string{http.MethodGet, http.MethodPost} {
				probe.Method = m
				if _, p := mux.Handler(probe); p != "" && p != "/" {
					writeError(w, &apiError{status: http.StatusMethodNotAllowed, typ: "MethodNotAllowed", message: "method " + r.Method + " is not allowed on " + r.URL.Path})
					return
				}
			}
		}
		mux.ServeHTTP(w, r)
	})
}

func writeError(w http.ResponseWriter, e *apiError) {
	b := e.appendJSON(nil)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(e.status)
	_, _ = w.Write(b)
}

// readBody reads a request body within the engine's limit.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, *apiError) {
	limit := s.eng.cfg.MaxRequestBytes
	if r.ContentLength > limit {
		return nil, &apiError{status: http.StatusRequestEntityTooLarge, typ: "RequestEntityTooLarge", message: "the request body of " + strconv.FormatInt(r.ContentLength, 10) + " bytes is over the limit of " + strconv.FormatInt(limit, 10)}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, &apiError{status: http.StatusRequestEntityTooLarge, typ: "RequestEntityTooLarge", message: "the request body is over the limit of " + strconv.FormatInt(limit, 10) + " bytes"}
		}
		return nil, badRequest("reading the request body: %v", err)
	}
	return body, nil
}

func (s *Server) checkModel(model string) *apiError {
	if model != "" && model != s.model && !slices.Contains(s.eng.cfg.LoRAModules, model) {
		return &apiError{status: http.StatusNotFound, typ: "NotFoundError", message: "The model `" + model + "` does not exist.", param: "model"}
	}
	return nil
}

// adapter is the LoRA adapter a request names as its model, or "".
func (s *Server) adapter(model string) string {
	if model != s.model && slices.Contains(s.eng.cfg.LoRAModules, model) {
		return model
	}
	return ""
}

// encode turns a decoded request into prompt token ids.
func (s *Server) encode(req *completionRequest, chat bool) ([]uint32, *apiError) {
	if !chat {
		p, err := parsePrompt(req.Prompt)
		if err != nil {
			return nil, asAPIError(err)
		}
		if p.isIDs {
			return p.tokens, nil
		}
		return s.codec.EncodePrompt(p.text), nil
	}
	msgs := make([]ChatMessage, len(req.Messages))
	for i, m := range req.Messages {
		if m.Role == "" {
			return nil, &apiError{status: 400, typ: "BadRequestError", message: "message " + strconv.Itoa(i) + " has no role", param: "messages"}
		}
		text, err := messageText(m.Content)
		if err != nil {
			return nil, asAPIError(err)
		}
		reasoning := m.ReasoningContent
		if reasoning == "" {
			reasoning = m.Reasoning
		}
		msgs[i] = ChatMessage{Role: m.Role, Content: text, Name: m.Name, ToolCallID: m.ToolCallID, ToolCalls: m.ToolCalls, Reasoning: reasoning}
	}
	opts := ChatOptions{AddGenerationPrompt: true, ContinueFinalMessage: bool(req.ContinueFinalMessage), Tools: req.Tools, ReasoningEffort: req.ReasoningEffort}
	if req.AddGenerationPrompt != nil {
		opts.AddGenerationPrompt = bool(*req.AddGenerationPrompt)
	}
	if opts.ContinueFinalMessage {
		opts.AddGenerationPrompt = false
	}
	toks, err := s.codec.EncodeChat(msgs, opts)
	if err != nil {
		return nil, badRequest("rendering the chat template: %v", err)
	}
	return toks, nil
}

func asAPIError(err error) *apiError {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae
	}
	return badRequest("%v", err)
}

func (s *Server) complete(w http.ResponseWriter, hr *http.Request, chat bool) {
	body, aerr := s.readBody(w, hr)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	req, err := decodeRequest(body, chat)
	if err != nil {
		writeError(w, asAPIError(err))
		return
	}
	if aerr := s.checkModel(req.Model); aerr != nil {
		writeError(w, aerr)
		return
	}
	var kvp *kvTransferParams
	if s.kv != nil || s.offloads {
		// Like vLLM, a worker without a KV connector (role both, no offloading tier)
		// ignores kv_transfer_params.
		bs := s.eng.cfg.BlockSize
		if kvp, aerr = parseKVTransferParams(req.KVTransferParams, (s.eng.cfg.MaxModelLen+bs-1)/bs); aerr != nil {
			writeError(w, aerr)
			return
		}
	}
	var limitLoad bool
	var maxLoad int
	if kvp != nil && kvp.HasMaxLoad {
		limitLoad, maxLoad = true, kvp.MaxLoadTokens
	}
	if s.kv == nil && kvp != nil {
		// An offloading connector alone acts on max_load_tokens only.
		kvp = nil
	}
	prompt, aerr := s.encode(req, chat)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	prefix := "cmpl-"
	if chat {
		prefix = "chatcmpl-"
	}
	id := prefix + s.idBase + strconv.FormatUint(s.ids.Add(1), 16)
	keys := blockhash.Keys{LoRA: s.adapter(req.Model), Salt: []byte(req.CacheSalt)}
	pin, _ := req.pinTTL() // checked by decodeRequest
	reasoning := 0
	if chat {
		// A reasoning model's chat completion: its first tokens are the reasoning (all of
		// them when max_tokens ends the request sooner).
		reasoning = s.eng.cfg.ReasoningTokens
		if n := req.maxTokens(); n > 0 {
			reasoning = min(reasoning, n)
		}
	}
	r, err := s.eng.NewRequest(id, prompt, keys, Params{
		MaxTokens:       req.maxTokens(),
		MinTokens:       int(req.MinTokens),
		IgnoreEOS:       bool(req.IgnoreEOS),
		Priority:        int(req.Priority),
		PinTTL:          pin,
		EphemeralOutput: req.ephemeralOutput() || reasoning > 0,
		LimitLoad:       limitLoad,
		MaxLoadTokens:   maxLoad,
	})
	if err != nil {
		writeError(w, badRequest("%s", strings.TrimPrefix(err.Error(), ErrInvalidRequest.Error()+": ")))
		return
	}
	if kvp != nil && kvp.HasMaxLoad && kvp.PeerFetch == "" && !kvp.DoRemoteDecode && !kvp.DoRemotePrefill {
		kvp = nil // max_load_tokens alone: no transfer, and the response says nothing of it
	}
	if kvp != nil && kvp.PeerFetch != "" {
		// A peer fetch: the prefix comes from the holder, asked once the request is
		// admitted, if it still has it (a decode leg's prefiller: the whole prompt); the
		// response says nothing of it, unless the request is also a prefill leg.
		if s.eng.kv != nil {
			r.peerHolder = strings.TrimSuffix(kvp.PeerFetch, "/")
			if kvp.FromPrefiller {
				r.prefillOf = kvp.KVRequestID
			}
		}
		if !kvp.DoRemoteDecode {
			kvp = nil
		}
	}
	if kvp != nil {
		r.kvDecode = kvp.DoRemoteDecode
		if r.kvDecode {
			r.kvRequestID = kvp.KVRequestID
		}
		if kvp.DoRemotePrefill && len(kvp.RemoteBlockIDs) > 0 {
			r.kvPull = kvp // with no blocks to pull, vLLM prefills locally
		}
	}
	s.eng.Submit(r)
	rs := responseState{s: s, r: r, chat: chat, kv: kvp != nil, p2p: kvp != nil && kvp.ForDecoder, model: s.model, created: time.Now().Unix(), reasoning: reasoning}
	if keys.LoRA != "" {
		rs.model = keys.LoRA // vLLM answers with the adapter's name
	}
	if req.Stream {
		rs.usage = req.StreamOptions != nil && bool(req.StreamOptions.IncludeUsage)
		s.stream(w, hr.Context(), &rs)
		return
	}
	s.respond(w, hr.Context(), &rs)
}

// responseState is what one response writer needs about its request.
type responseState struct {
	s       *Server
	r       *Request
	chat    bool
	usage   bool
	kv      bool // the request carried kv_transfer_params: the response carries the field too
	p2p     bool // a prefill leg in vLLM's p2p form: the field is null, its decoder asks by id
	toks    []uint32
	model   string // the served model or LoRA adapter the request named
	created int64  // Unix seconds when the request came
	// reasoning is how many of the first output tokens are reasoning (Config.ReasoningTokens),
	// answered as reasoning_content.
	reasoning int
}

// wait blocks until the request has output past what was already read, or has finished, or
// the client has gone (then the request is aborted and freed at once).
func (rs *responseState) wait(ctx context.Context) (done bool, reason FinishReason, cached int, ok bool) {
	for {
		n := len(rs.toks)
		rs.toks, done, reason, cached = rs.r.Output(rs.toks, n)
		if done || len(rs.toks) > n {
			return done, reason, cached, true
		}
		select {
		case <-rs.r.Wait():
		case <-ctx.Done():
			rs.s.eng.Abort(rs.r)
			return false, "", 0, false
		}
	}
}

func (s *Server) respond(w http.ResponseWriter, ctx context.Context, rs *responseState) {
	var (
		done   bool
		reason FinishReason
		cached int
		ok     bool
	)
	for !done {
		if done, reason, cached, ok = rs.wait(ctx); !ok {
			return
		}
	}
	switch reason {
	case FinishAborted:
		writeError(w, &apiError{status: http.StatusServiceUnavailable, typ: "ServiceUnavailableError", message: "the engine stopped before the request finished"})
		return
	case FinishError:
		_, failure := rs.r.transfer()
		writeError(w, failure.apiError())
		return
	}
	kvParams := rs.publishKV()
	bp := s.bufs.Get().(*[]byte)
	b := (*bp)[:0]
	b = append(b, `{"id":`...)
	b = appendJSONString(b, rs.r.ID)
	if rs.chat {
		b = append(b, `,"object":"chat.completion"`...)
	} else {
		b = append(b, `,"object":"text_completion"`...)
	}
	b = appendHead(b, rs)
	if rs.chat {
		b = append(b, `,"choices":[{"index":0,"message":{"role":"assistant",`...)
		think := min(rs.reasoning, len(rs.toks))
		if think > 0 {
			b = append(b, `"reasoning_content":`...)
			b = s.appendText(b, rs.toks[:think])
			b = append(b, ',')
		}
		b = append(b, `"content":`...)
		b = s.appendText(b, rs.toks[think:])
		b = append(b, `,"tool_calls":[]},"logprobs":null,"finish_reason":`...)
	} else {
		b = append(b, `,"choices":[{"index":0,"text":`...)
		b = s.appendText(b, rs.toks)
		b = append(b, `,"logprobs":null,"finish_reason":`...)
	}
	b = appendJSONString(b, string(reason))
	b = append(b, `,"stop_reason":null}],"usage":`...)
	b = appendUsage(b, rs.r.PromptTokens(), len(rs.toks), cached)
	if rs.kv {
		b = append(b, `,"kv_transfer_params":`...)
		b = append(b, kvParams...)
	}
	b = append(b, "}\n"...)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	_, _ = w.Write(b)
	*bp = b
	s.bufs.Put(bp)
}

// stream writes the response as server-sent events, one chunk per token as vLLM does, all
// chunks that are ready written and flushed together.
func (s *Server) stream(w http.ResponseWriter, ctx context.Context, rs *responseState) {
	if rs.r.kvPull != nil {
		// A decode leg fails before its first token if its KV cannot be pulled: wait for
		// that token, so that a failure still gets its HTTP status.
		for len(rs.toks) == 0 {
			done, reason, _, ok := rs.wait(ctx)
			if !ok {
				return
			}
			if done && reason == FinishError {
				_, failure := rs.r.transfer()
				writeError(w, failure.apiError())
				return
			}
			if done {
				break
			}
		}
	}
	fl, _ := w.(http.Flusher)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	bw := bufio.NewWriterSize(w, 4096)
	bp := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(bp)
	if rs.chat {
		// vLLM opens a chat stream with the assistant role and empty content.
		*bp = s.appendChunk((*bp)[:0], rs, `"role":"assistant","content":""`, nil, "")
		_, _ = bw.Write(*bp)
	}
	sent := 0
	for {
		var (
			done, ok bool
			reason   FinishReason
			cached   int
		)
		if sent < len(rs.toks) { // tokens the decode leg's wait above already read
			rs.toks, done, reason, cached = rs.r.Output(rs.toks, len(rs.toks))
		} else if done, reason, cached, ok = rs.wait(ctx); !ok {
			return
		}
		if done && rs.kv {
			rs.publishKV() // vLLM keeps the blocks but sends no kv_transfer_params in a stream
		}
		b := (*bp)[:0]
		for i := sent; i < len(rs.toks); i++ {
			fin := FinishReason("")
			if done && i == len(rs.toks)-1 {
				fin = reason
			}
			delta := ""
			if i < rs.reasoning {
				delta = "reasoning"
			}
			b = s.appendChunk(b, rs, delta, rs.toks[i:i+1], fin)
		}
		sent = len(rs.toks)
		if done {
			if reason == FinishAborted {
				e := apiError{status: http.StatusServiceUnavailable, typ: "ServiceUnavailableError", message: "the engine stopped before the request finished"}
				b = append(b, "data: "...)
				b = e.appendJSON(b)
				b = append(b, "\n\n"...)
			} else if rs.usage {
				b = append(b, `data: {"id":`...)
				b = appendJSONString(b, rs.r.ID)
				b = s.appendObject(b, rs)
				b = append(b, `,"choices":[],"usage":`...)
				b = appendUsage(b, rs.r.PromptTokens(), len(rs.toks), cached)
				b = append(b, "}\n\n"...)
			}
			b = append(b, "data: [DONE]\n\n"...)
		}
		*bp = b
		if _, err := bw.Write(b); err != nil {
			s.eng.Abort(rs.r)
			return
		}
		if err := bw.Flush(); err != nil {
			s.eng.Abort(rs.r)
			return
		}
		if fl != nil {
			fl.Flush()
		}
		if done {
			return
		}
	}
}

// publishKV, for a finished request that carried kv_transfer_params, writes the content of
// the blocks it keeps for a remote decode and returns the response's kv_transfer_params:
// vLLM NixlConnector's object, or null when nothing is kept (a decode leg, a request that
// did not stop at its length, a capped region's slot conflict).
func (rs *responseState) publishKV() []byte {
	held, _ := rs.r.transfer()
	if held == nil || rs.p2p {
		return []byte("null") // a p2p hold's blocks are published when its decoder exports them
	}
	kv := rs.s.kv
	if !kv.publish(held.blocks[:len(held.keys)], held.keys) {
		rs.s.eng.releaseHeld([]string{rs.r.ID})
		return []byte("null")
	}
	return kv.appendParams(make([]byte, 0, 256+8*len(held.blocks)), held.blocks, rs.r.ID)
}

// appendParams appends the kv_transfer_params that let a peer READ held blocks: NixlConnector's
// decode-leg object naming their slots (their block ids, unless the region is capped or a
// block is staged), this engine and the held request id.
func (c *kvConnector) appendParams(b []byte, blocks []int32, id string) []byte {
	b = append(b, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[`...)
	for i, blk := range blocks {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(c.slot(blk)), 10) // what a reader finds at slot × slot bytes
	}
	b = append(b, `],"remote_engine_id":`...)
	b = appendJSONString(b, c.engineID)
	b = append(b, `,"remote_request_id":`...)
	b = appendJSONString(b, id)
	b = append(b, `,"remote_host":`...)
	b = appendJSONString(b, c.host)
	b = append(b, `,"remote_port":`...)
	b = strconv.AppendInt(b, int64(c.port), 10)
	return append(b, `,"tp_size":1}`...)
}

func (s *Server) appendObject(b []byte, rs *responseState) []byte {
	if rs.chat {
		b = append(b, `,"object":"chat.completion.chunk"`...)
	} else {
		b = append(b, `,"object":"text_completion"`...)
	}
	return appendHead(b, rs)
}

// appendHead appends a response's created time (when its request came, as vLLM stamps it)
// and model.
func appendHead(b []byte, rs *responseState) []byte {
	b = append(b, `,"created":`...)
	b = strconv.AppendInt(b, rs.created, 10)
	b = append(b, `,"model":`...)
	return appendJSONString(b, rs.model)
}

// appendChunk appends one SSE event. For chat, delta is raw JSON members, or the text of
// toks as content when empty, or as reasoning_content when "reasoning"; a completion chunk
// carries the text of toks.
func (s *Server) appendChunk(b []byte, rs *responseState, delta string, toks []uint32, fin FinishReason) []byte {
	b = append(b, `data: {"id":`...)
	b = appendJSONString(b, rs.r.ID)
	b = s.appendObject(b, rs)
	if rs.chat {
		b = append(b, `,"choices":[{"index":0,"delta":{`...)
		switch delta {
		case "":
			b = append(b, `"content":`...)
			b = s.appendText(b, toks)
		case "reasoning":
			b = append(b, `"reasoning_content":`...)
			b = s.appendText(b, toks)
		default:
			b = append(b, delta...)
		}
		b = append(b, `},"logprobs":null,"finish_reason":`...)
	} else {
		b = append(b, `,"choices":[{"index":0,"text":`...)
		b = s.appendText(b, toks)
		b = append(b, `,"logprobs":null,"finish_reason":`...)
	}
	if fin == "" {
		b = append(b, "null"...)
	} else {
		b = appendJSONString(b, string(fin))
	}
	return append(b, `,"stop_reason":null}]}`+"\n\n"...)
}

// appendText appends the JSON string of the output tokens' text.
func (s *Server) appendText(b []byte, toks []uint32) []byte {
	if len(toks) == 1 {
		if t, ok := s.text[toks[0]]; ok {
			return appendJSONString(b, t)
		}
	}
	var text []byte
	for _, t := range toks {
		if piece, ok := s.text[t]; ok {
			text = append(text, piece...)
		} else {
			text = append(text, s.codec.Decode([]uint32{t})...)
		}
	}
	return appendJSONString(b, string(text))
}

func appendUsage(b []byte, prompt, completion, cached int) []byte {
	b = append(b, `{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt+completion), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(completion), 10)
	b = append(b, `,"prompt_tokens_details":{"cached_tokens":`...)
	b = strconv.AppendInt(b, int64(cached), 10)
	return append(b, "}}"...)
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	b := []byte(`{"object":"list","data":[{"id":`)
	b = appendJSONString(b, s.model)
	b = append(b, `,"object":"model","created":`...)
	b = strconv.AppendInt(b, s.created, 10)
	b = append(b, `,"owned_by":"vllm","root":`...)
	b = appendJSONString(b, s.model)
	b = append(b, `,"parent":null,"max_model_len":`...)
	b = strconv.AppendInt(b, int64(s.eng.cfg.MaxModelLen), 10)
	b = append(b, '}')
	for _, name := range s.eng.cfg.LoRAModules { // as vLLM lists --lora-modules
		b = append(b, `,{"id":`...)
		b = appendJSONString(b, name)
		b = append(b, `,"object":"model","created":`...)
		b = strconv.AppendInt(b, s.created, 10)
		b = append(b, `,"owned_by":"vllm","root":`...)
		b = appendJSONString(b, "/adapters/"+name)
		b = append(b, `,"parent":`...)
		b = appendJSONString(b, s.model)
		b = append(b, `,"max_model_len":null}`...)
	}
	b = append(b, "]}\n"...)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

// tokenize answers vLLM's /tokenize: {"prompt": ...} or {"messages": [...]} in, the ids out.
// The proxy's remote tokenizer mode relies on it.
func (s *Server) tokenize(w http.ResponseWriter, hr *http.Request) {
	body, aerr := s.readBody(w, hr)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	var probe struct {
		Messages []chatMessage `json:"messages"`
	}
	chat := json.Unmarshal(body, &probe) == nil && len(probe.Messages) > 0
	req, err := decodeRequest(body, chat)
	if err != nil {
		writeError(w, asAPIError(err))
		return
	}
	if aerr := s.checkModel(req.Model); aerr != nil {
		writeError(w, aerr)
		return
	}
	toks, aerr := s.encode(req, chat)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	b := []byte(`{"count":`)
	b = strconv.AppendInt(b, int64(len(toks)), 10)
	b = append(b, `,"max_model_len":`...)
	b = strconv.AppendInt(b, int64(s.eng.cfg.MaxModelLen), 10)
	b = append(b, `,"tokens":[`...)
	for i, t := range toks {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(t), 10)
	}
	b = append(b, "],\"token_strs\":null}\n"...)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

// render answers vLLM's /v1/chat/completions/render and /v1/completions/render: the body of
// a chat or text completion in, the prompt's token ids out, as the engine would compute
// them ({"token_ids": [...]} for chat, an array of one such object for text). Endpoint
// pickers that tokenize before they pick (llm-d's precise prefix scorer) call them.
func (s *Server) render(w http.ResponseWriter, hr *http.Request, chat bool) {
	body, aerr := s.readBody(w, hr)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	req, err := decodeRequest(body, chat)
	if err != nil {
		writeError(w, asAPIError(err))
		return
	}
	if aerr := s.checkModel(req.Model); aerr != nil {
		writeError(w, aerr)
		return
	}
	toks, aerr := s.encode(req, chat)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	var b []byte
	if !chat {
		b = append(b, '[')
	}
	b = append(b, `{"token_ids":[`...)
	for i, t := range toks {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(t), 10)
	}
	b = append(b, "]}"...)
	if !chat {
		b = append(b, ']')
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(b, '\n'))
}

func (s *Server) detokenize(w http.ResponseWriter, hr *http.Request) {
	body, aerr := s.readBody(w, hr)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	var req struct {
		Model  string   `json:"model"`
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		writeError(w, badRequest("the request body is not valid JSON: %v", err))
		return
	}
	if aerr := s.checkModel(req.Model); aerr != nil {
		writeError(w, aerr)
		return
	}
	b := []byte(`{"prompt":`)
	b = appendJSONString(b, s.codec.Decode(req.Tokens))
	b = append(b, "}\n"...)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(b)
}

func (s *Server) resetPrefixCache(w http.ResponseWriter, hr *http.Request) {
	ok, err := s.eng.ResetPrefixCache(hr.Context())
	switch {
	case err != nil:
		return // the client left
	case !ok:
		writeError(w, &apiError{status: http.StatusConflict, typ: "ConflictError", message: "the prefix cache cannot be reset while requests hold KV blocks"})
	default:
		w.WriteHeader(http.StatusOK)
	}
}
