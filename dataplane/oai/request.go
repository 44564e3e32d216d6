package oai

import (
	"math"
	"time"
)

// Kind is the OpenAI endpoint a body was posted to; it selects which fields Parse reads.
type Kind uint8

// The endpoints the proxy parses.
const (
	ChatCompletions Kind = iota + 1 // POST /v1/chat/completions
	Completions                     // POST /v1/completions
	Embeddings                      // POST /v1/embeddings
	Responses                       // POST /v1/responses
)

// String returns the endpoint path.
func (k Kind) String() string {
	switch k {
	case ChatCompletions:
		return "/v1/chat/completions"
	case Completions:
		return "/v1/completions"
	case Embeddings:
		return "/v1/embeddings"
	case Responses:
		return "/v1/responses"
	}
	return "unknown"
}

// KindForPath maps a request path (query string already removed) to its Kind, or 0.
func KindForPath(path []byte) Kind {
	switch string(path) {
	case "/v1/chat/completions":
		return ChatCompletions
	case "/v1/completions":
		return Completions
	case "/v1/embeddings":
		return Embeddings
	case "/v1/responses":
		return Responses
	}
	return 0
}

// Message is one chat message, or one item of a Responses API input. Byte slices point into
// the body passed to Parse (text without escapes, raw JSON) or into the Request's own buffer
// (unescaped or joined text); all of them are read-only and valid until the Request is parsed
// into again or the body is reused, whichever comes first.
type Message struct {
	Role []byte // "system", "user", "assistant", "tool", …; empty for Responses items without one

	// Content is the text of content. A string is taken as is. An array of parts keeps the text
	// of its text parts ("text", "input_text", "output_text", and "refusal" parts) joined with
	// "\n", as vLLM renders it for templates that take string content. Nil when content is
	// absent, null or holds no text part.
	Content    []byte
	HasContent bool // content present and not null
	TextParts  int  // text parts in a content array (0 when content is a string)
	Parts      int  // non-text parts (images, audio, files, …); see Request.Parts

	Name       []byte // name (chat) or the function name (Responses function_call)
	ToolCallID []byte // tool_call_id (chat) or call_id (Responses)
	ToolCalls  []byte // raw JSON of tool_calls (chat); nil when absent or null
	Reasoning  []byte // reasoning_content, or reasoning when reasoning_content is absent
	Type       []byte // Responses item type ("message", "function_call", …); nil for chat
}

// Part is a content part that is not text: an image, audio clip, file or anything else the
// proxy cannot tokenize. Raw is the whole part object, so the proxy can hash it into the
// prefix (as engines hash multimodal inputs) or reject the request.
type Part struct {
	Message int    // index into Request.Messages
	Index   int    // position in that message's content array
	Type    []byte // the part's "type"; nil when it has none
	Raw     []byte // the part's raw JSON
}

// Hints are Dynamo-compatible agent hints from nvext.agent_hints and nvext.session_id.
type Hints struct {
	// Priority is nvext.agent_hints.priority: higher is more urgent (Dynamo's convention).
	Priority    int
	HasPriority bool
	// LatencySensitivity is nvext.agent_hints.latency_sensitivity, Dynamo's older hint: a
	// jump, in seconds, of the request's effective arrival time in the router queue. It is an
	// alias of Priority on the same scale: when priority is absent, Request.Priority uses
	// LatencySensitivity rounded half away from zero.
	LatencySensitivity    float64
	HasLatencySensitivity bool
	// OSL is the expected output length in tokens (nvext.agent_hints.osl).
	OSL    int
	HasOSL bool
	// SpeculativePrefill asks for the next turn's prefix to be prefilled after this one.
	SpeculativePrefill bool
	// SessionID is nvext.session_id (read-only; see Request for aliasing).
	SessionID []byte
	// PinTTL is nvext.cache_control {"type": "ephemeral", "ttl": ...} (Dynamo's pin): the
	// engine keeps the prompt's blocks that long after their last use (5m when the ttl is
	// absent). 0 without a pin, or for a type or ttl kvrelay does not read (the engine
	// decides what to make of those).
	PinTTL time.Duration
}

// Request is what Parse extracts from one OpenAI request body. A Request is reused: Parse
// resets every field (keeping slice capacity; a text buffer grown past 256 KiB by an
// exceptional body is let go when a much smaller body comes) before it fills it. Every byte slice is
// read-only and points either into the body given to Parse or into the Request's own buffer,
// so it is valid until the next Parse into the same Request and only while the body is
// unchanged. A Request is not safe for concurrent use.
type Request struct {
	Kind  Kind
	Model []byte

	Stream       bool
	IncludeUsage bool // stream_options.include_usage

	// MaxTokens is the output limit: max_completion_tokens when present, else max_tokens
	// (max_output_tokens for Responses).
	MaxTokens    int
	HasMaxTokens bool

	Temperature    float64
	HasTemperature bool
	N              int // n; 1 when absent
	IgnoreEOS      bool
	MinTokens      int

	// Chat (and Responses input items).
	Messages             []Message
	Parts                []Part // non-text content parts of all messages, in order
	Tools                []byte // raw JSON of tools
	ToolChoice           []byte // raw JSON of tool_choice
	ReasoningEffort      []byte // reasoning_effort (chat) or reasoning.effort (Responses)
	AddGenerationPrompt  bool   // add_generation_prompt; true when absent
	ContinueFinalMessage bool
	CacheSalt            []byte
	// User is the raw JSON of the request's user field (OpenAI's end-user id), nil when
	// absent: what keeps one user's requests together where no session id does.
	User []byte
	// Logprobs is set when the request asks for log probabilities (logprobs or
	// top_logprobs present and not null, false or 0).
	Logprobs           bool
	ChatTemplateKwargs []byte // raw JSON of chat_template_kwargs

	// Completions prompt and Embeddings input. A batch holds NumPrompts prompts; Prompt or
	// PromptTokens holds the first one (the proxy rejects a batch or routes by its first).
	Prompt         []byte  // text of the first prompt
	PromptTokens   []int32 // token ids of the first prompt, when given as ids
	PromptIsTokens bool
	NumPrompts     int
	PromptEmbeds   bool // prompt_embeds present (the prompt cannot be tokenized)

	// Responses API.
	Instructions       []byte
	PreviousResponseID []byte

	Hints Hints
	// EnginePriority is vLLM's own top-level priority (lower runs first), as sent.
	EnginePriority    int
	HasEnginePriority bool
	KVTransferParams  []byte // raw JSON of kv_transfer_params

	// TextBytes is a rough length: the bytes of all text the engine renders into the prompt
	// (message text, reasoning, tool calls, tools, prompts, inputs, instructions). About four
	// bytes make a token in English text.
	TextBytes int

	buf []byte // unescaped and joined text; cap ≥ len(body) so appends never move it
}

// Priority returns the request's priority in Dynamo's convention (higher is more urgent):
// nvext.agent_hints.priority if present, else latency_sensitivity rounded, else the negated
// top-level vLLM priority, else 0. ok reports whether any of them was present.
func (r *Request) Priority() (p int, ok bool) {
	switch {
	case r.Hints.HasPriority:
		return r.Hints.Priority, true
	case r.Hints.HasLatencySensitivity:
		return roundToInt(r.Hints.LatencySensitivity), true
	case r.HasEnginePriority:
		if r.EnginePriority == math.MinInt {
			return math.MaxInt, true
		}
		return -r.EnginePriority, true
	}
	return 0, false
}

func roundToInt(f float64) int {
	switch {
	case f != f:
		return 0
	case f >= math.MaxInt32:
		return math.MaxInt32
	case f <= math.MinInt32:
		return math.MinInt32
	}
	return int(math.Round(f))
}

// Release drops r's buffers, for a caller done with an exceptionally large body that would
// otherwise keep their capacity until a much smaller body comes.
func (r *Request) Release() { *r = Request{} }

// retainLimit is the text buffer capacity a Request keeps whatever the next body's size.
const retainLimit = 256 << 10

// reset clears r for a new body of n bytes, keeping the capacity of its slices.
func (r *Request) reset(kind Kind, n int) {
	msgs, parts, toks, buf := r.Messages[:0], r.Parts[:0], r.PromptTokens[:0], r.buf[:0]
	*r = Request{}
	r.Kind = kind
	r.N = 1
	r.AddGenerationPrompt = true
	r.Messages, r.Parts, r.PromptTokens = msgs, parts, toks
	// The buffer only grows, except that one left large by an exceptional body is dropped
	// when a much smaller one comes, so a keep-alive connection does not hold it for good.
	if cap(buf) < n || cap(buf) > retainLimit && cap(buf) > 8*n {
		buf = make([]byte, 0, n+n/4)
	}
	r.buf = buf
}
