package decide

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"unsafe"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// Request is one request being decided, and then accounted for on its worker until its
// answer ends, with the scratch space all of that reuses: its routing hints, the parsed
// OpenAI request, its prompt's tokens and block hashes, the decision (worker, policy arm,
// disaggregation), its wait in the admission queue, and its tally on the worker (load,
// the latency model's lessons, the index record, the metrics).
//
// A carrier keeps one per connection or stream and reuses it for each request it carries:
// a client connection of the proxy on its event loop's goroutine, a pick of the endpoint
// picker on its stream's goroutine. It is not safe for concurrent use: Work may run on
// another goroutine, but only while the carrier leaves the Request alone.
//
// A request's life: Start, SetHints, Parse, Validate, Prepare (and Work, Resume when it
// says so), Decide (and Enqueue while every worker is busy; then Decide again once
// woken), Dispatch, Answer, Feed with each piece of the answer, Settle.
type Request struct {
	c *Core
	// scratch is the route.Request a shadow pick routes with: the carrier's, shared by the
	// requests of one goroutine.
	scratch *route.Request
	// legs: the carrier sends a disaggregated request's prefill leg itself and decides
	// again once it ends (the proxy); without, the decode worker's side runs it (a pick).
	legs bool

	// The routing hints of the request's head: x-session-id, x-kvrelay-priority,
	// x-kvrelay-osl, x-slo-ttft-ms and x-slo-tpot-ms.
	session []byte
	hdrPrio int
	hasPrio bool
	hdrOSL  int
	sloTTFT float64 // x-slo-ttft-ms, 0 when absent
	sloTPOT float64 // x-slo-tpot-ms

	// The OpenAI request and the routing input derived from it.
	body     []byte // the carrier's, as the client sent it
	parser   oai.Parser
	oreq     oai.Request
	kind     oai.Kind
	model    string // the model's metric label
	rreq     route.Request
	toks     []uint32
	text     []byte // the rendered prompt, reused
	hasher   blockhash.Hasher
	msgs     []tokenizer.Message
	extra    []byte         // the multimodal identifiers keys.MM points into
	keys     blockhash.Keys // this request's blocks' extra keys
	prio     int
	timed    bool   // this request's decision stages are timed (sampled)
	decID    uint64 // its sampled decision in the core's decisionLog (0: none)
	tokStart int64  // when a timed request's tokenization began
	// convKeys are the request's conversation keys for the remote tokenizer's cache;
	// extraTokens the estimated tokens of messages past a cached conversation prefix, which
	// routing counts beside the prefix's.
	convKeys    []xxh3.Uint128
	extraTokens int

	// The work Prepare left for Work: a remote tokenization (pend) or a large prompt
	// (large), and what Work found.
	pending error // ErrRemote, ErrLarge, ErrIndex or nil
	// remoteDone: Work finished a remote tokenization (and asked the index) itself, with
	// remoteErr what remoteResult said.
	remoteDone bool
	remoteErr  error
	pend       remotePending
	large      largePrompt
	workIDs    []uint32
	workErr    error
	workOK     bool

	// arrived is when the request's body was complete (its latency targets count from
	// it); decideAt when its decision began, for the total decision time of a timed one.
	arrived  int64
	decideAt int64
	queuedAt int64
	qitem    *QueueItem
	// flow and flowWeight are the request's fair-queuing flow in the admission queue
	// (SetFlow).
	flow       string
	flowWeight float64
	// tenant and tenantShare are the request's tenant and its weighted share of the fleet
	// (SetTenant); running says the request counts among the tenant's running ones.
	tenant      string
	tenantShare float64
	running     bool
	// charged: the request took a slot ahead of a waiting queue and its flow was counted
	// the service (admitDirect).
	charged bool

	dec route.Decision
	arm *armSeries // the policy version that routed this request
	// group is its conversation group in the arm's figures (-1: not computed yet); end how
	// its answer ended (end*).
	group, end int
	pd         pdState

	t   tally
	obs oai.Observer
	itl armITL // the Observer's ITL sink while the request has an arm
	mm  *modelMetrics
	// untimed: the answer's pieces reach the core at times that are not its tokens'
	// (Untimed).
	untimed bool
}

// pdState is a request's disaggregation: whether it goes across prefill and decode
// pools, the prefill worker chosen, and the prefill leg's hold on that worker's load.
type pdState struct {
	on        bool // routed across prefill and decode pools
	prefilled bool // its prefill leg succeeded: the decode worker pulls the prompt's KV
	fallback  bool // its prefill leg failed: the decode worker prefills
	prefill   *route.Worker
	// source is the peer the prefill worker pulls the prompt's prefix from instead of
	// computing it (the prefill pool's decision's PeerFetch), nil when it computes it all.
	source  *route.Worker
	overlap int         // the prompt blocks the prefill worker caches
	pre     route.Usage // the prefill leg's load on its worker
}

// largePrompt is a prompt Prepare left to be tokenized off the carrier's loop.
type largePrompt struct {
	cd    *codec
	text  string // aliases the carrier's body or the request's buffers
	limit int
	t0    int64
}

// Work that Prepare leaves to its caller (Work, then Resume): both are the "needs
// off-loop work" answer, told apart because they bound differently (a carrier runs many
// round trips at once, but only as many tokenizations as it has CPUs to spare).
var (
	// ErrRemote: the prompt's tokens come from an engine's /tokenize; Work makes the round
	// trip (blocking I/O).
	ErrRemote = errors.New("decide: tokenization pending on a remote tokenizer")
	// ErrLarge: the prompt is large enough (offLoopBytes) that tokenizing it would hold up
	// an event loop; Work tokenizes it (CPU).
	ErrLarge = errors.New("decide: tokenization of a large prompt pending")
	// ErrIndex: the core asks the control plane's index about each prompt (SetIndexQuery);
	// Work makes the round trip (blocking I/O). Resume can answer it after ErrLarge, once
	// the prompt is hashed: Work and Resume again. After ErrRemote, Work hashes the prompt
	// and asks in the same trip.
	ErrIndex = errors.New("decide: the prompt's index query pending")
)

// IndexQuery asks the control plane's index about a prompt's blocks and keeps the answer
// where the routers' index reads it (prefix.Remote). Query blocks for a round trip.
type IndexQuery interface {
	Query(ctx context.Context, hashes []uint64) error
}

// offLoopBytes is the prompt size from which tokenizing is left to Work: about 15 ms of BPE,
// long enough to delay every other connection of an event loop noticeably.
const offLoopBytes = 256 << 10

// OffLoopBytes is the body size from which a carrier on an event loop parses off it.
const OffLoopBytes = offLoopBytes

// bytesPerToken estimates tokens from text: about four bytes each.
const bytesPerToken = 4

// KeepBytes and keepToks bound the buffers a Request keeps after a request (Shrink).
const (
	KeepBytes = 4 << 20
	keepToks  = 1 << 20
)

// errNoTokenizer: a remote tokenizer is configured and no worker can tokenize.
var errNoTokenizer = errors.New("no healthy worker to tokenize the prompt")

// contextLengthError is a prompt longer than the model's context, refused as vLLM refuses
// it (400) but before the whole prompt is tokenized or any engine sees it.
type contextLengthError int

func (e contextLengthError) Error() string {
	return fmt.Sprintf("This model's maximum context length is %d tokens. However, your request has more input tokens than that. Please reduce the length of the input messages.", int(e))
}

// Init binds r to core c. scratch is a route.Request the carrier lends its requests' shadow
// picks (one per goroutine); legs says the carrier sends the prefill legs of disaggregated
// requests itself.
func (r *Request) Init(c *Core, scratch *route.Request, legs bool) {
	r.c, r.scratch, r.legs = c, scratch, legs
	r.obs.Reset(0, 0)
}

// Start begins a request of kind (0 when none: a request the carrier answers itself),
// complete at now; timed samples its decision (one in SampleEvery of the carrier's). The
// hints (SetHints) are the carrier's to set, before or after.
func (r *Request) Start(kind oai.Kind, now int64, timed bool) {
	r.kind, r.model, r.arm, r.decID = kind, "", nil, 0
	r.obs.Reset(0, 0) // no answer yet: Result is not the previous request's
	r.group, r.end = -1, endAnswered
	r.timed, r.untimed = timed, false
	r.arrived = now
	// A new request: the queue item of the carrier's last one (dequeued and served) is not
	// its own, neither its deadline nor its place in line.
	r.qitem = nil
	r.flow, r.flowWeight = "", 0
	r.countRunning(-1) // a request its carrier never settled stops counting
	r.tenant, r.tenantShare, r.charged = "", 0, false
	r.pd = pdState{}
	r.pending = nil
	r.workIDs, r.workErr, r.workOK = nil, nil, false
	r.remoteDone, r.remoteErr = false, nil
	r.decideAt = r.clock()
}

// SetHints reads the routing hints of the request's head (the carrier's own copies, or
// bytes that stay unchanged until the next SetHints): x-session-id, x-kvrelay-priority,
// x-kvrelay-osl, x-slo-ttft-ms and x-slo-tpot-ms. Malformed numbers count as absent.
func (r *Request) SetHints(session, priority, osl, sloTTFT, sloTPOT []byte) {
	r.session = append(r.session[:0], session...)
	r.hdrPrio, r.hasPrio = atoi(priority)
	r.hdrOSL, _ = atoi(osl)
	r.sloTTFT, r.sloTPOT = millis(sloTTFT), millis(sloTPOT)
}

// SetPriority sets the request's priority over what its head and body say (an inference
// objective's).
func (r *Request) SetPriority(p int) { r.hdrPrio, r.hasPrio = p, true }

// millis reads a latency target in milliseconds (x-slo-ttft-ms: 250, or 0.5); 0 when it is
// absent, malformed, not positive or beyond a day.
func millis(b []byte) float64 {
	if len(b) == 0 || len(b) > 16 {
		return 0
	}
	v, err := strconv.ParseFloat(string(b), 64)
	if err != nil || !(v > 0 && v <= 86400e3) {
		return 0
	}
	return v
}

func atoi(b []byte) (int, bool) {
	if len(b) == 0 || len(b) > 12 {
		return 0, false
	}
	n, err := strconv.Atoi(string(b))
	return n, err == nil
}

// Parse parses body, the request's whole body, which r keeps (aliased) until the request
// ends: a *Refusal when it is not an OpenAI request of its kind.
func (r *Request) Parse(body []byte) error {
	t0 := r.clock()
	r.body = body
	if err := r.parser.Parse(body, r.kind, &r.oreq); err != nil {
		var pe *oai.Error
		if errors.As(err, &pe) {
			return refusal(pe.Status(), pe.Message, pe.Param, pe.Code)
		}
		return refusal(400, err.Error(), "", "")
	}
	r.stage(stageParse, t0)
	return nil
}

// Validate checks what the core routes on: the model, served by some worker, and no
// field only kvrelay may set. A *Refusal otherwise.
func (r *Request) Validate() error {
	c := r.c
	if len(r.oreq.Model) == 0 {
		return refusal(400, "you must provide a model parameter", "model", "")
	}
	if !c.kv.Pool().Serves(unsafeString(r.oreq.Model)) {
		return refusal(404, "The model `"+string(r.oreq.Model)+"` does not exist.", "model", "model_not_found")
	}
	if p := r.oreq.KVTransferParams; len(p) > 0 && string(p) != "null" {
		// The engines' KV connector parameters say where to pull or push KV blocks: only
		// kvrelay's own prefill and decode legs may carry them, or a client could make an
		// engine dial any host it names.
		c.m.refused.WithLabelValues("kv_transfer_params").Inc()
		c.log.Debug("refused a request carrying kv_transfer_params", "model", r.model)
		return refusal(400, "kv_transfer_params is set by kvrelay for its prefill and decode legs; requests may not carry it", "kv_transfer_params", "")
	}
	r.model = c.ModelLabel(r.oreq.Model)
	return nil
}

// Prepare turns the parsed request into routing input: priority, expected output length,
// session, and for completions the prompt's token ids and block hashes. It returns nil,
// ErrRemote, ErrLarge or ErrIndex (call Work, then Resume), or a *Refusal.
func (r *Request) Prepare() error {
	err := r.prepare()
	if err == nil {
		err = r.askIndex()
	}
	if err == nil || errors.Is(err, ErrRemote) || errors.Is(err, ErrLarge) || errors.Is(err, ErrIndex) {
		r.pending = err
		return err
	}
	return r.refusal(err)
}

// askIndex returns ErrIndex when the core asks the control plane's index about prompts and
// this one has blocks to ask about.
func (r *Request) askIndex() error {
	if r.c.query.Load() != nil && len(r.rreq.Hashes) > 0 {
		return ErrIndex
	}
	return nil
}

// Work does what Prepare left: the remote round trip, the large prompt's tokenization or
// the index query. It blocks, and runs where the carrier can afford that (a goroutine of its
// own, never an event loop); nothing else may use r meanwhile.
func (r *Request) Work() {
	switch r.pending {
	case ErrRemote:
		r.workIDs, r.workErr = r.fetchPending()
		if q := r.c.query.Load(); q != nil {
			// An index to ask: the prompt is hashed here and asked about in the same trip
			// off the loop, not in a second one after Resume.
			ids, err := r.workIDs, r.workErr
			r.workIDs, r.workErr = nil, nil
			r.remoteErr, r.remoteDone = r.remoteResult(ids, err), true
			if r.remoteErr == nil && len(r.rreq.Hashes) > 0 {
				_ = r.queryIndex(*q) // a failure routes as uncached, counted by the index
			}
		}
	case ErrLarge:
		l := &r.large
		r.toks, r.workOK = tokenizer.AppendEncodeLimit(l.cd.tok, r.toks[:0], l.text, l.limit)
	case ErrIndex:
		if q := r.c.query.Load(); q != nil {
			r.workErr = r.queryIndex(*q)
		}
	}
}

// queryIndex asks q about the prompt's hashes, timing the round trip as the index stage.
func (r *Request) queryIndex(q IndexQuery) error {
	t0 := r.clock()
	err := q.Query(context.Background(), r.rreq.Hashes)
	r.stage(stageIndex, t0)
	return err
}

// Resume goes on, on the carrier's goroutine, with what Work found: nil, ErrIndex (the
// prompt, now hashed, is to be asked of the index: Work and Resume again) or a *Refusal.
func (r *Request) Resume() error {
	pending := r.pending
	r.pending = nil
	switch pending {
	case ErrIndex:
		// A failed query routes the prompt as uncached; the index counts it.
		r.workErr = nil
		return nil
	case ErrRemote:
		if r.remoteDone {
			// Work finished the prompt and asked the index.
			err := r.remoteErr
			r.remoteErr, r.remoteDone = nil, false
			if err != nil {
				return refusal(400, err.Error(), "messages", "")
			}
			return nil
		}
		ids, err := r.workIDs, r.workErr
		r.workIDs, r.workErr = nil, nil
		if err := r.remoteResult(ids, err); err != nil {
			return refusal(400, err.Error(), "messages", "")
		}
	case ErrLarge:
		if !r.workOK {
			return r.refusal(contextLengthError(r.large.limit))
		}
		r.stage(stageTokenize, r.large.t0)
		r.hashTokens()
	}
	if err := r.askIndex(); err != nil {
		r.pending = err
		return err
	}
	return nil
}

// refusal is the answer to a request Prepare or Resume could not turn into routing input.
func (r *Request) refusal(err error) *Refusal {
	var limit contextLengthError
	switch {
	case errors.As(err, &limit):
		r.c.m.tooLong.Inc()
		param := "messages"
		if r.kind == oai.Completions {
			param = "prompt"
		}
		return refusal(400, limit.Error(), param, "context_length_exceeded")
	case errors.Is(err, errNoTokenizer):
		return &Refusal{Status: 503, Message: err.Error(), Code: "no_worker", RetryAfter: r.c.retryAfterNoWorker(unsafeString(r.oreq.Model), nanotime())}
	}
	return refusal(400, err.Error(), "messages", "")
}

func (r *Request) prepare() error {
	c := r.c
	o := &r.oreq
	rr := &r.rreq
	rr.Reset()
	rr.Timed = r.timed // Now is set by Decide, at each routing attempt's time
	rr.Model = unsafeString(o.Model)
	r.prio = 0
	if p, ok := o.Priority(); ok {
		r.prio = p
	} else if r.hasPrio {
		r.prio = r.hdrPrio
	}
	rr.Priority = r.prio
	rr.OSL = r.hdrOSL
	rr.SLOTPOT = r.sloTPOT / 1e3
	if o.Hints.HasOSL {
		rr.OSL = o.Hints.OSL
	}
	switch {
	case len(r.session) > 0:
		rr.SessionID = unsafeString(r.session)
	case len(o.Hints.SessionID) > 0:
		rr.SessionID = unsafeString(o.Hints.SessionID)
	}
	if (r.kind != oai.ChatCompletions && r.kind != oai.Completions) || !c.usesIndex() {
		// Nothing to match against an index: the prompt's length is all routing needs.
		rr.PromptTokens = (o.TextBytes + bytesPerToken - 1) / bytesPerToken
		if o.PromptIsTokens {
			rr.PromptTokens = len(o.PromptTokens)
		}
		return nil
	}
	cd := c.codecFor(o.Model)
	t0 := r.clock()
	r.toks = r.toks[:0]
	r.extraTokens = 0
	switch {
	case r.kind == oai.Completions && o.PromptIsTokens:
		for _, t := range o.PromptTokens {
			r.toks = append(r.toks, uint32(t))
		}
	case cd.mode == TokenizerRemote:
		r.tokStart = t0
		if err := r.tokenizeRemote(); err != nil {
			return err // ErrRemote: Work fetches r.pend and Resume goes on in remoteResult
		}
	case cd.mode == TokenizerEstimate:
		text, err := r.promptText(cd)
		if err != nil {
			return err
		}
		r.estimate(text)
		r.stage(stageTokenize, t0)
		return nil
	default:
		text := unsafeString(o.Prompt)
		if r.kind != oai.Completions {
			var err error
			if text, err = r.promptText(cd); err != nil {
				return err
			}
		}
		limit := c.kv.Pool().MaxModelLen(rr.Model)
		if len(text) >= offLoopBytes {
			r.large = largePrompt{cd: cd, text: text, limit: limit, t0: t0}
			return ErrLarge
		}
		var ok bool
		if r.toks, ok = tokenizer.AppendEncodeLimit(cd.tok, r.toks, text, limit); !ok {
			return contextLengthError(limit)
		}
	}
	if limit := c.kv.Pool().MaxModelLen(rr.Model); limit > 0 && len(r.toks) > limit {
		return contextLengthError(limit) // prompt token ids
	}
	r.stage(stageTokenize, t0)
	r.hashTokens()
	return nil
}

// hashTokens turns r.toks into the prompt's block chain with each block's extra keys
// (blockhash.Keys, as vLLM keys its blocks): the LoRA adapter the request names, its
// non-text parts, and on the first block its cache salt.
func (r *Request) hashTokens() {
	c := r.c
	o := &r.oreq
	rr := &r.rreq
	t1 := r.clock()
	k := &r.keys
	k.LoRA, k.Salt, k.MM = "", o.CacheSalt, k.MM[:0]
	if _, ok := c.kv.Pool().Adapter(unsafeString(o.Model)); ok {
		k.LoRA = unsafeString(o.Model)
	}
	r.extra = slices.Grow(r.extra[:0], 16*len(o.Parts))
	for _, p := range o.Parts {
		// A part's identifier is the hash of its JSON: the same image sent again keys
		// the same blocks; an engine's own identifiers never match it.
		start := len(r.extra)
		h := xxh3.Hash128(p.Raw).Bytes()
		r.extra = append(r.extra, h[:]...)
		k.MM = append(k.MM, r.extra[start:len(r.extra):len(r.extra)])
	}
	rr.PromptTokens = len(r.toks) + r.extraTokens
	rr.Hashes = r.hasher.AppendSeqKeys(rr.Hashes[:0], 0, false, r.toks, c.cfg.BlockSize, k, 0)
	r.stage(stageHash, t1)
}

// clock reads the time for a sampled stage measurement (0 when this request is not timed).
func (r *Request) clock() int64 {
	if !r.timed {
		return 0
	}
	return nanotime()
}

// stage records the time since t0 for a sampled request.
func (r *Request) stage(st int, t0 int64) {
	if r.timed {
		r.c.m.stages[st].Observe(seconds(nanotime() - t0))
	}
}

// promptText renders the chat messages with the model's template, into r.text when the
// template can. The strings handed to the template alias the request body and the parser's
// buffer, both alive for this call; the returned string may alias r.text and is valid until
// the next request.
func (r *Request) promptText(cd *codec) (string, error) {
	o := &r.oreq
	if r.kind == oai.Completions {
		return unsafeString(o.Prompt), nil
	}
	if cd.tmpl == nil {
		return "", errors.New("no chat template for this model")
	}
	r.msgs = r.msgs[:0]
	for i := range o.Messages {
		m := &o.Messages[i]
		r.msgs = append(r.msgs, tokenizer.Message{
			Role:       unsafeString(m.Role),
			Content:    unsafeString(m.Content),
			Name:       unsafeString(m.Name),
			ToolCallID: unsafeString(m.ToolCallID),
			Reasoning:  unsafeString(m.Reasoning),
		})
		if len(m.ToolCalls) > 0 {
			// An agent's assistant turns carry their function calls, which the template
			// renders (and a tool message after one needs). Decoded in place: a local
			// Message whose field escaped would cost every message an allocation.
			if err := json.Unmarshal(m.ToolCalls, &r.msgs[len(r.msgs)-1].ToolCalls); err != nil {
				return "", fmt.Errorf("messages[%d].tool_calls: %w", i, err)
			}
		}
	}
	opts := tokenizer.RenderOptions{AddGenerationPrompt: o.AddGenerationPrompt && !o.ContinueFinalMessage}
	if len(o.Tools) > 0 {
		opts.Tools = o.Tools
	}
	if len(o.ReasoningEffort) > 0 {
		opts.ReasoningEffort = unsafeString(o.ReasoningEffort)
	}
	if ar, ok := cd.tmpl.(tokenizer.AppendRenderer); ok {
		text, err := ar.AppendRender(r.text[:0], r.msgs, opts)
		r.text = text
		if err != nil {
			return "", err
		}
		return unsafeString(text), nil
	}
	return cd.tmpl.Render(r.msgs, opts)
}

// estimate counts the prompt's tokens from its text and hashes it in fixed byte blocks of
// block size tokens at about four bytes each.
func (r *Request) estimate(text string) {
	rr := &r.rreq
	bs := r.c.cfg.BlockSize
	rr.PromptTokens = (len(text) + bytesPerToken - 1) / bytesPerToken
	chunk := bs * bytesPerToken
	var parent uint64
	for i := 0; i+chunk <= len(text); i += chunk {
		local := r.hasher.Local(nil, unsafeBytes(text[i:i+chunk]))
		h := local
		if i > 0 {
			h = blockhash.Chain(parent, local)
		}
		rr.Hashes = append(rr.Hashes, h)
		parent = h
	}
}

// Pin asks for the worker of id worker (a stored response's), falling back to any other
// should it be gone.
func (r *Request) Pin(worker string) { r.rreq.Pin = worker }

// PinOnly makes r a request of model for the worker of id worker and no other (a stored
// response it holds: GET /v1/responses/{id}); its input is nothing else.
func (r *Request) PinOnly(model, worker string) {
	r.oreq = oai.Request{}
	r.oreq.Model = []byte(model)
	r.model = r.c.ModelLabel(r.oreq.Model)
	r.rreq.Reset()
	r.rreq.Model = model
	r.rreq.Pin, r.rreq.PinOnly = worker, true
}

// Shrink drops the buffers the last request grew past KeepBytes (its rendered prompt) or a
// million tokens, so that a carrier that once took a huge prompt does not keep their memory.
// bodyBig says the carrier's body buffer, which the parsed request points into, is past
// KeepBytes. It reports whether the carrier must drop its body buffer too (the parse that
// pointed into it is gone).
func (r *Request) Shrink(bodyBig bool) bool {
	drop := bodyBig || cap(r.text) > KeepBytes
	if drop {
		r.body, r.text = nil, nil
		r.oreq.Release()
		r.parser.Release()
		clear(r.msgs[:cap(r.msgs)])
		r.msgs = nil
	}
	if cap(r.toks) > keepToks {
		r.toks = nil
	}
	if cap(r.rreq.Hashes) > keepToks/16 {
		r.rreq.Hashes = nil
	}
	return drop
}

// Release drops r's references to the carrier's body, for a Request put back in a pool.
func (r *Request) Release() {
	r.body = nil
	r.oreq = oai.Request{}
}

// Core is the routing core r decides through.
func (r *Request) Core() *Core { return r.c }

// Kind is the request's route (0: none, a request its carrier answers itself).
func (r *Request) Kind() oai.Kind { return r.kind }

// PromptTokens is the prompt's length in tokens, as the request was prepared (counted, or
// estimated from its text).
func (r *Request) PromptTokens() int { return r.rreq.PromptTokens }

// Model is the request's model as its metrics label it ("" before Validate).
func (r *Request) Model() string { return r.model }

// OpenAI is the parsed request; it points into the body Parse was given.
func (r *Request) OpenAI() *oai.Request { return &r.oreq }

// Priority is the request's priority (higher is more urgent), once prepared.
func (r *Request) Priority() int { return r.prio }

// Decision is the last decision: the worker, how it was chosen, its prediction.
func (r *Request) Decision() *route.Decision { return &r.dec }

// Disaggregated reports whether the request goes across prefill and decode pools;
// PrefillWorker is the prefill worker Decide chose for its prefill leg (nil: the decode
// worker prefills it).
func (r *Request) Disaggregated() bool          { return r.pd.on }
func (r *Request) PrefillWorker() *route.Worker { return r.pd.prefill }

// PrefillSource is the peer the prefill worker is to pull the prompt's prefix from before it
// prefills the rest (the prefill pool's policy predicted that cheaper than computing it), nil
// when it computes the whole prompt. Only a prefill worker that can pull gets one
// (route.Engine.Fetches), and only a carrier that sends the prefill leg in a form with room
// for it (vLLM's p2p form) passes it on.
func (r *Request) PrefillSource() *route.Worker { return r.pd.source }

// Arm is the version of the policy that decided the request (a rollout's stable or
// candidate arm; "local" for a static proxy's policy), "" before Decide.
func (r *Request) Arm() string {
	if r.arm == nil {
		return ""
	}
	return r.arm.version
}

// BlockHashes are the prompt's block chain, once prepared (none under a policy that does
// not match prompts); they must not be altered.
func (r *Request) BlockHashes() []uint64 { return r.rreq.Hashes }

// Result is what the answer said so far (Feed).
func (r *Request) Result() *oai.Observation { return r.obs.Result() }

// Worker is the worker the request was last dispatched to (nil before Dispatch): its
// current attempt's, which stays while the carrier handles that attempt's end.
func (r *Request) Worker() *route.Worker {
	if r.t.ws == nil {
		return nil
	}
	return r.t.ws.W
}

// unsafeString views b as a string without copying; the caller keeps b unchanged while the
// string is in use.
func unsafeString(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

func unsafeBytes(s string) []byte {
	if s == "" {
		return nil
	}
	return unsafe.Slice(unsafe.StringData(s), len(s))
}
