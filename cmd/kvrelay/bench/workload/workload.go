package workload

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// Message is one chat message, in the OpenAI shape (the JSON tags are the wire names).
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
	// Name is the participant name; on tool messages, the function name.
	Name string `json:"name,omitempty"`
	// ToolCalls are an assistant message's function calls.
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
	// ToolCallID links a tool message to the call it answers.
	ToolCallID string `json:"tool_call_id,omitempty"`
}

// ToolCall is one function call of an assistant message.
type ToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"` // "function"
	Function FunctionCall `json:"function"`
}

// FunctionCall names the function and carries its arguments as a JSON text.
type FunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// Request is one request to send. Generators fill it; the runner encodes it (Body does it
// the canonical way) and never modifies it.
type Request struct {
	// At: for open-loop workloads, the send time from the start of the run (the runner divides
	// it by --speedup). For a session's turns, the think time to wait after the previous
	// turn's answer (for the first turn, after the session starts).
	At time.Duration
	// Session is "" for open-loop requests. Sessions run closed-loop: turn k+1 after turn k
	// is answered. Body sends it as nvext.session_id (and the runner as x-session-id) unless
	// Anonymous is set.
	Session string
	// Anonymous keeps Session off the wire: the calls still run as a session, from a client
	// that names none (an OpenAI SDK client without kvrelay's hints), so the gateway cannot
	// bind them.
	Anonymous bool
	// Chat selects chat completions (Messages) over text completions (Prompt).
	Chat     bool
	Messages []Message
	Prompt   string
	// MaxTokens is sent as max_tokens; IgnoreEOS as ignore_eos, so the engine generates
	// exactly MaxTokens tokens.
	MaxTokens int
	IgnoreEOS bool
	// Priority is sent as nvext.agent_hints.priority when HasPriority (higher is more urgent).
	Priority    int
	HasPriority bool
	// OSL is sent as nvext.agent_hints.osl when > 0: the output length the client expects.
	OSL int
	// PinTTL, when positive, is sent as nvext.cache_control {"type": "ephemeral", "ttl"}:
	// keep the prompt's KV that long after its last use. EphemeralOutput is sent as
	// nvext.agent_hints.ephemeral_output: the answer will not come back token for token.
	PinTTL          time.Duration
	EphemeralOutput bool
	// Tag names the request's class for per-class reporting: "trace", "group", "chat",
	// "interactive", "tool", "fork" (a subagent's first call), "subagent", "fixed", "rag".
	Tag string
	// Spawn lists sessions to start once this request has been answered: subagents forked
	// from the conversation. Each runs its own closed loop, and its first Next receives this
	// request's answer. The session that returned this request is asked for its next turn only
	// after all of them have ended (its next turn reads their results), the way an agent waits
	// on parallel subagent tool calls. Spawned sessions are not listed in Workload.Sessions.
	Spawn []Session
	// Invalid sends the request with max_tokens -1, which servers refuse (400): a client's
	// error, which a gateway must not count as its own.
	Invalid bool
}

// Session is a closed-loop conversation. The runner calls Next from one goroutine at a time
// per session (different sessions may run concurrently): first with "", then with the answer
// to the request it last returned, until ok is false. The answer is the full text the model
// generated for that turn; where an engine returns reasoning separately (reasoning_content),
// pass reasoning followed by content. A session owns its random stream, so its requests do
// not depend on how the runner interleaves sessions, only on the answers it is given.
type Session interface {
	Next(prevAnswer string) (req Request, ok bool)
}

// Workload is a generated set of requests.
type Workload struct {
	// Name is the workload kind: "mooncake", "prefix-groups", "multi-turn", "agentic",
	// "fixed" or "mixed".
	Name string
	// Spec is the canonical spec with every parameter, defaults included, so that a result
	// file names exactly what was run (Parse(Spec, seed, tok) regenerates the same workload).
	Spec string
	// Open holds the open-loop requests, sorted by At.
	Open []Request
	// Sessions holds the closed-loop sessions, all started at time 0; each waits its first
	// request's At before sending it.
	Sessions []Session
}

// Tokenizer is what generators need to build text of exact token lengths:
// github.com/kvrelay/kvrelay/engines/tokenizer's Tokenizer satisfies it.
type Tokenizer interface {
	Encode(string) []uint32
	Decode([]uint32) string
}

// DefaultTokenizer is the tokenizer Parse uses when given nil: gpt-oss's.
const DefaultTokenizer = "o200k_harmony"

// ErrSpec is returned (wrapped) for a spec that names no workload, an unknown parameter or a
// bad value.
var ErrSpec = errors.New("invalid workload spec")

// generator builds one kind of workload from its parameters.
type generator struct {
	params []param // in canonical order, with defaults
	build  func(p *params, seed uint64, v *vocab, tok Tokenizer) (*Workload, error)
}

// generators is the registry of built-in workloads.
var generators = map[string]generator{
	"mooncake":      {mooncakeParams, buildMooncake},
	"prefix-groups": {prefixGroupParams, buildPrefixGroups},
	"multi-turn":    {multiTurnParams, buildMultiTurn},
	"agentic":       {agenticParams, buildAgentic},
	"fixed":         {fixedParams, buildFixed},
	"mixed":         {mixedParams, buildMixed},
}

// Names returns the built-in workload names.
func Names() []string {
	return []string{"mooncake", "prefix-groups", "multi-turn", "agentic", "fixed", "mixed"}
}

// Parse builds a workload from a spec: a path to a Mooncake JSONL trace, or a built-in name
// with optional parameters after a colon, comma-separated key=value pairs:
//
//	prefix-groups:groups=16,prompt=2048,user=64,requests=400,rate=20,osl=64
//	multi-turn:sessions=32,turns=8,system=1024,user=48,osl=128,think=2s
//	agentic:sessions=8,preamble=6000,rounds=6,tool=400,subagents=2,reasoning=256,osl=128
//	mooncake:path=hack/traces/mooncake-conversation.jsonl.gz,requests=2000,block=512
//	fixed:isl=3000,osl=150,requests=200,rate=2
//	mixed:users=200,user_rate=4,rag=60,rag_rate=1,docs=8,doc=6000
//
// Every parameter is optional; an unknown parameter is an error; a key given twice takes its
// last value, so a caller may append overrides. Durations are Go durations ("2s", "150ms") or
// plain seconds. The same spec, seed and tokenizer give byte-identical requests. tok nil means
// DefaultTokenizer.
func Parse(spec string, seed uint64, tok Tokenizer) (*Workload, error) {
	name, rest, hasParams := strings.Cut(spec, ":")
	g, ok := generators[name]
	if !ok {
		if _, err := os.Stat(spec); err != nil {
			return nil, fmt.Errorf("parsing workload %q: %w: not a built-in (%s) nor a readable trace file",
				spec, ErrSpec, strings.Join(Names(), ", "))
		}
		name, rest, hasParams, g = "mooncake", "", false, generators["mooncake"]
	}
	p, err := parseParams(name, g.params, rest, hasParams)
	if err != nil {
		return nil, err
	}
	if name == "mooncake" && !ok {
		p.vals["path"] = spec // a bare path may hold commas
	}
	if tok == nil {
		t, err := tokenizer.New(DefaultTokenizer)
		if err != nil {
			return nil, fmt.Errorf("parsing workload %q: %w", spec, err)
		}
		tok = t
	}
	v, err := vocabFor(tok)
	if err != nil {
		return nil, fmt.Errorf("parsing workload %q: %w", spec, err)
	}
	w, err := g.build(p, seed, v, tok)
	if err != nil {
		return nil, fmt.Errorf("generating workload %q: %w", spec, err)
	}
	w.Name, w.Spec = name, p.canonical()
	return w, nil
}
