package proxy

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/zeebo/xxh3"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// input is one request's routing input and the scratch space that derives it from the
// parsed OpenAI request: priority, expected output length, session, latency targets, and for
// completions the prompt's token ids and block hashes. A client connection of the proxy
// embeds one and reuses it for each of its requests, on its loop's goroutine; a pick of the
// endpoint picker (pick.go) owns one on its stream's goroutine. It is not safe for
// concurrent use.
type input struct {
	srv *Server
	// inline makes prepare do everything where it is called: a large prompt is tokenized
	// and a remote tokenizer asked in place, never left pending (a pick runs on a goroutine
	// of its own; a connection's loop must not block).
	inline bool

	// The routing hints of the request's head: x-session-id, x-kvrelay-priority,
	// x-kvrelay-osl, x-slo-ttft-ms and x-slo-tpot-ms.
	session []byte
	hdrPrio int
	hasPrio bool
	hdrOSL  int
	sloTTFT float64 // x-slo-ttft-ms, 0 when absent
	sloTPOT float64 // x-slo-tpot-ms

	// The OpenAI request and the routing input derived from it.
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
	decID    uint64 // its sampled decision in the server's decisionLog (0: none)
	tokStart int64  // when a timed request's tokenization began
	// convKeys are the request's conversation keys for the remote tokenizer's cache;
	// extraTokens the estimated tokens of messages past a cached conversation prefix, which
	// routing counts beside the prefix's.
	convKeys    []xxh3.Uint128
	extraTokens int

	// pend is the remote tokenization prepare left to its caller (errPending), large the
	// prompt it left to be tokenized off the loop (errLarge).
	pend  remotePending
	large largePrompt
}

// largePrompt is a prompt prepare left to be tokenized off the event loop.
type largePrompt struct {
	cd    *codec
	text  string // aliases the connection's buffers
	limit int
	t0    int64
}

// errLarge reports that a prompt is large enough to be tokenized off the event loop
// (input.large): the request resumes on its loop when its ids are ready.
var errLarge = errors.New("tokenization of a large prompt pending")

// prepare turns the parsed request into routing input: priority, expected output length,
// session, and for completions the prompt's token ids and block hashes.
func (in *input) prepare() error {
	s := in.srv
	o := &in.oreq
	r := &in.rreq
	r.Reset()
	r.Timed = in.timed // Now is set by route, at each routing attempt's event
	r.Model = unsafeString(o.Model)
	in.prio = 0
	if p, ok := o.Priority(); ok {
		in.prio = p
	} else if in.hasPrio {
		in.prio = in.hdrPrio
	}
	r.Priority = in.prio
	r.OSL = in.hdrOSL
	r.SLOTPOT = in.sloTPOT / 1e3
	if o.Hints.HasOSL {
		r.OSL = o.Hints.OSL
	}
	switch {
	case len(in.session) > 0:
		r.SessionID = unsafeString(in.session)
	case len(o.Hints.SessionID) > 0:
		r.SessionID = unsafeString(o.Hints.SessionID)
	}
	if (in.kind != oai.ChatCompletions && in.kind != oai.Completions) || !s.usesIndex() {
		// Nothing to match against an index: the prompt's length is all routing needs.
		r.PromptTokens = (o.TextBytes + bytesPerToken - 1) / bytesPerToken
		if o.PromptIsTokens {
			r.PromptTokens = len(o.PromptTokens)
		}
		return nil
	}
	cd := s.codecFor(o.Model)
	t0 := in.clock()
	in.toks = in.toks[:0]
	in.extraTokens = 0
	switch {
	case in.kind == oai.Completions && o.PromptIsTokens:
		for _, t := range o.PromptTokens {
			in.toks = append(in.toks, uint32(t))
		}
	case cd.mode == TokenizerRemote:
		in.tokStart = t0
		if err := in.tokenizeRemote(); err != nil {
			if !errors.Is(err, errPending) || !in.inline {
				return err // errPending: the caller fetches in.pend and goes on in remoteResult
			}
			return in.remoteResult(in.fetchPending())
		}
	case cd.mode == TokenizerEstimate:
		text, err := in.promptText(cd)
		if err != nil {
			return err
		}
		in.estimate(text)
		in.stage(stageTokenize, t0)
		return nil
	default:
		text := unsafeString(o.Prompt)
		if in.kind != oai.Completions {
			var err error
			if text, err = in.promptText(cd); err != nil {
				return err
			}
		}
		limit := s.kv.Pool().MaxModelLen(r.Model)
		if len(text) >= offLoopBytes && !in.inline {
			in.large = largePrompt{cd: cd, text: text, limit: limit, t0: t0}
			return errLarge
		}
		var ok bool
		if in.toks, ok = tokenizer.AppendEncodeLimit(cd.tok, in.toks, text, limit); !ok {
			return contextLengthError(limit)
		}
	}
	if limit := s.kv.Pool().MaxModelLen(r.Model); limit > 0 && len(in.toks) > limit {
		return contextLengthError(limit) // prompt token ids
	}
	in.stage(stageTokenize, t0)
	in.hashTokens()
	return nil
}

// offLoopBytes is the prompt size from which tokenizing moves off the event loop: about 15
// ms of BPE, long enough to delay every other connection of the loop noticeably.
const offLoopBytes = 256 << 10

// contextLengthError is a prompt longer than the model's context, refused as vLLM refuses
// it (400) but before the whole prompt is tokenized or any engine sees it.
type contextLengthError int

func (e contextLengthError) Error() string {
	return fmt.Sprintf("This model's maximum context length is %d tokens. However, your request has more input tokens than that. Please reduce the length of the input messages.", int(e))
}

// hashTokens turns in.toks into the prompt's block chain with each block's extra keys
// (blockhash.Keys, as vLLM keys its blocks): the LoRA adapter the request names, its
// non-text parts, and on the first block its cache salt.
func (in *input) hashTokens() {
	s := in.srv
	o := &in.oreq
	r := &in.rreq
	t1 := in.clock()
	k := &in.keys
	k.LoRA, k.Salt, k.MM = "", o.CacheSalt, k.MM[:0]
	if _, ok := s.kv.Pool().Adapter(unsafeString(o.Model)); ok {
		k.LoRA = unsafeString(o.Model)
	}
	in.extra = slices.Grow(in.extra[:0], 16*len(o.Parts))
	for _, p := range o.Parts {
		// A part's identifier is the hash of its JSON: the same image sent again keys
		// the same blocks; an engine's own identifiers never match it.
		start := len(in.extra)
		h := xxh3.Hash128(p.Raw).Bytes()
		in.extra = append(in.extra, h[:]...)
		k.MM = append(k.MM, in.extra[start:len(in.extra):len(in.extra)])
	}
	r.PromptTokens = len(in.toks) + in.extraTokens
	r.Hashes = in.hasher.AppendSeqKeys(r.Hashes[:0], 0, false, in.toks, s.cfg.BlockSize, k, 0)
	in.stage(stageHash, t1)
}

// clock reads the time for a sampled stage measurement (0 when this request is not timed).
func (in *input) clock() int64 {
	if !in.timed {
		return 0
	}
	return nanotime()
}

// stage records the time since t0 for a sampled request.
func (in *input) stage(st int, t0 int64) {
	if in.timed {
		in.srv.metrics.stages[st].Observe(seconds(nanotime() - t0))
	}
}

// promptText renders the chat messages with the model's template, into in.text when the
// template can. The strings handed to the template alias the request body and the parser's
// buffer, both alive for this call; the returned string may alias in.text and is valid until
// the next request.
func (in *input) promptText(cd *codec) (string, error) {
	o := &in.oreq
	if in.kind == oai.Completions {
		return unsafeString(o.Prompt), nil
	}
	if cd.tmpl == nil {
		return "", errors.New("no chat template for this model")
	}
	in.msgs = in.msgs[:0]
	for i := range o.Messages {
		m := &o.Messages[i]
		in.msgs = append(in.msgs, tokenizer.Message{
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
			if err := json.Unmarshal(m.ToolCalls, &in.msgs[len(in.msgs)-1].ToolCalls); err != nil {
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
		text, err := ar.AppendRender(in.text[:0], in.msgs, opts)
		in.text = text
		if err != nil {
			return "", err
		}
		return unsafeString(text), nil
	}
	return cd.tmpl.Render(in.msgs, opts)
}

// estimateBytes is the block of text hashed as one block in estimate mode: block size
// tokens at about four bytes each.
const bytesPerToken = 4

func (in *input) estimate(text string) {
	r := &in.rreq
	bs := in.srv.cfg.BlockSize
	r.PromptTokens = (len(text) + bytesPerToken - 1) / bytesPerToken
	chunk := bs * bytesPerToken
	var parent uint64
	for i := 0; i+chunk <= len(text); i += chunk {
		local := in.hasher.Local(nil, unsafeBytes(text[i:i+chunk]))
		h := local
		if i > 0 {
			h = blockhash.Chain(parent, local)
		}
		r.Hashes = append(r.Hashes, h)
		parent = h
	}
}

// observeRoute records a routing attempt's match and (timed) score stages and, for a first
// attempt (first), whether a pinned request got its worker.
func (in *input) observeRoute(d *route.Decision, first bool) {
	m := in.srv.metrics
	if d.Match > 0 {
		m.stages[stageMatch].Observe(d.Match.Seconds())
	}
	if in.timed {
		m.stages[stageScore].Observe(d.Score.Seconds())
	}
	if in.rreq.Pin != "" && first {
		if in.rreq.Pinned {
			m.affinity.WithLabelValues("pinned").Inc()
		} else {
			m.affinity.WithLabelValues("fallback").Inc()
		}
	}
}
