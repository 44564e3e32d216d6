package workload

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"sync"
	"time"
)

var agenticOwnParams = []param{
	{"sessions", "8", "interactive agent sessions"},
	{"rate", "0", "sessions starting per second (Poisson), each sending its first request as it starts; 0: every session starts at time 0 and sends its first request after a think time"},
	{"preamble", "6000", "tokens of the system message (instructions and the tools list), the same in every session"},
	{"task", "200", "tokens of each user message (the task, then follow-ups)"},
	{"turns", "2", "user turns per session"},
	{"rounds", "6", "tool-call rounds per turn; each turn makes rounds+1 model calls, the last one answering the user"},
	{"tool", "400", "mean tokens of a tool output (uniform in [tool/2, 3·tool/2])"},
	{"subagents", "2", "subagents each session forks, in parallel, at round rounds/2 of its first turn"},
	{"sub_task", "100", "tokens of a subagent's task message"},
	{"sub_rounds", "3", "tool-call rounds of a subagent before its final report"},
	{"reasoning", "256", "reasoning tokens of every model call: generated, never sent back"},
	{"osl", "128", "final-text tokens of every model call: the tool call or the answer, sent back"},
	{"think", "5s", "mean user think time before each turn (exponential)"},
	{"tool_time", "300ms", "mean tool execution time before the next round (exponential)"},
	{"priority", "1", "nvext.agent_hints.priority of the interactive session's calls"},
	{"sub_priority", "-1", "nvext.agent_hints.priority of subagent calls"},
	{"toolcalls", "true", "send tool calls as assistant tool_calls and results as tool messages; false: both as plain text (assistant and user messages)"},
	{"session_ids", "true", "send each session's id (nvext.session_id, x-session-id), which binds it to a worker; false: a client that names no session"},
	{"preambles", "1", "distinct shared preambles (system messages of preamble tokens each), session i using preamble i mod preambles"},
	{"pin", "0s", "send nvext.cache_control {\"type\": \"ephemeral\", \"ttl\": pin} with every call (0: never), pinning its prompt on engines that understand it"},
	{"ephemeral", "true", "send nvext.agent_hints.ephemeral_output with calls that generate reasoning (never sent back: their generated blocks are never read again)"},
	{"client_errors", "0", "share of model calls sent with a field the server refuses (max_tokens -1: a 400 answer, a client's bug), the session going on after it"},
}

var agenticParams = append(agenticOwnParams, burstParams...)

// agentConfig is shared, read-only, by every session of an agentic workload.
type agentConfig struct {
	tok                                 Tokenizer
	v                                   *vocab
	seed                                uint64
	preambles                           []string
	task, turns, rounds, tool           int
	subagents, subTask, subRounds, fork int
	reasoning, osl                      int
	think, toolTime                     time.Duration
	rate                                float64 // sessions started per second; 0: all at time 0
	priority, subPriority               int
	toolCalls                           bool
	anonymous                           bool // session_ids=false
	pin                                 time.Duration
	ephemeral                           bool
	clientErrors                        float64 // client_errors
}

// buildAgentic: sessions of an agent harness. Each session starts from the shared preamble and
// its task; every turn runs tool-call rounds (the model's call, then the tool's large, unique
// output appended) and a final answer; the first turn forks subagents that continue from the
// session's context with their own task, at lower priority, and report back as tool results.
// Every call generates reasoning+osl tokens (ignore_eos) and sends that as the osl hint; only
// the last osl tokens of an answer (the final text) go back into the history, so reasoning is
// never reused, as gpt-oss clients drop the analysis channel.
func buildAgentic(p *params, seed uint64, v *vocab, tok Tokenizer) (*Workload, error) {
	c := &agentConfig{
		tok:          tok,
		v:            v,
		seed:         seed,
		task:         p.int("task", 1, 1<<22),
		turns:        p.int("turns", 1, 1<<16),
		rounds:       p.int("rounds", 0, 1<<16),
		tool:         p.int("tool", 2, 1<<22),
		subagents:    p.int("subagents", 0, 1<<10),
		subTask:      p.int("sub_task", 1, 1<<22),
		subRounds:    p.int("sub_rounds", 0, 1<<16),
		reasoning:    p.int("reasoning", 0, 1<<22),
		osl:          p.int("osl", 1, 1<<22),
		think:        p.duration("think"),
		toolTime:     p.duration("tool_time"),
		priority:     p.int("priority", -1<<20, 1<<20),
		subPriority:  p.int("sub_priority", -1<<20, 1<<20),
		toolCalls:    p.bool("toolcalls"),
		anonymous:    !p.bool("session_ids"),
		rate:         p.float("rate", 0, 1e6),
		pin:          p.duration("pin"),
		ephemeral:    p.bool("ephemeral"),
		clientErrors: p.float("client_errors", 0, 1),
	}
	nPreambles := p.int("preambles", 1, 64)
	preamble := p.int("preamble", 1, 1<<22)
	sessions := p.int("sessions", 0, 1<<20)
	b := burstOf(p)
	if p.err != nil {
		return nil, p.err
	}
	if c.rate == 0 {
		if err := b.needRate("agentic"); err != nil {
			return nil, err
		}
	}
	if c.subagents > 0 && c.rounds == 0 {
		return nil, fmt.Errorf("parsing workload agentic: %w: subagents need rounds >= 1 (they are forked by a tool call)", ErrSpec)
	}
	c.fork = c.rounds / 2
	for k := range nPreambles {
		// The first preamble is the one a single-preamble workload always had; the others
		// are other agents' (another first line), so they share no block with it.
		r, header := newRNG(seed, streamPreamble), preambleHeader()
		if k > 0 {
			r, header = newRNG(seed, streamPreamble, uint64(k)), fmt.Sprintf("Agent profile %d.\n", k)+header
		}
		pre, err := exactText(tok, v, r, header, preamble)
		if err != nil {
			return nil, fmt.Errorf("building the agent preamble: %w", err)
		}
		c.preambles = append(c.preambles, pre)
	}
	w := &Workload{Sessions: make([]Session, sessions)}
	arrivals := newRNG(seed, streamSessionArrivals)
	var at time.Duration
	for i := range w.Sessions {
		if c.rate > 0 {
			at += arrivals.exp(time.Duration(float64(time.Second) / c.rate))
		}
		w.Sessions[i] = &agentSession{
			c:     c,
			idx:   i,
			id:    fmt.Sprintf("agent-%d", i),
			r:     newRNG(seed, streamAgentic, uint64(i)),
			start: b.at(at),
		}
	}
	return w, nil
}

// agentTool is one function of the tools list in the preamble.
type agentTool struct {
	Type     string      `json:"type"`
	Function agentToolFn `json:"function"`
}

type agentToolFn struct {
	Name        string     `json:"name"`
	Description string     `json:"description"`
	Parameters  toolSchema `json:"parameters"`
}

type toolSchema struct {
	Type       string               `json:"type"`
	Properties map[string]toolParam `json:"properties"`
	Required   []string             `json:"required"`
}

type toolParam struct {
	Type        string `json:"type"`
	Description string `json:"description"`
}

// agentTools is the tool set of a coding agent, the last one the subagent launcher.
var agentTools = []agentToolFn{
	{"read_file", "Read a file from the workspace. Returns the contents with line numbers; use offset and limit for large files.",
		toolSchema{"object", map[string]toolParam{
			"path":   {"string", "Path relative to the workspace root."},
			"offset": {"integer", "First line to read, 1-based."},
			"limit":  {"integer", "Maximum number of lines to read."},
		}, []string{"path"}}},
	{"list_dir", "List the entries of a directory, with sizes and modification times.",
		toolSchema{"object", map[string]toolParam{
			"path": {"string", "Directory relative to the workspace root."},
		}, []string{"path"}}},
	{"grep", "Search file contents with a regular expression. Returns matching lines with file names and line numbers.",
		toolSchema{"object", map[string]toolParam{
			"pattern": {"string", "RE2 regular expression."},
			"path":    {"string", "File or directory to search."},
			"glob":    {"string", "Only search files whose names match this glob."},
		}, []string{"pattern"}}},
	{"run_command", "Run a shell command in the workspace sandbox. Returns the exit status, stdout and stderr.",
		toolSchema{"object", map[string]toolParam{
			"command":   {"string", "The command line, run by bash."},
			"timeout_s": {"integer", "Seconds before the command is killed."},
		}, []string{"command"}}},
	{"edit_file", "Replace one exact occurrence of a string in a file. Fails when the string is missing or not unique.",
		toolSchema{"object", map[string]toolParam{
			"path": {"string", "Path relative to the workspace root."},
			"old":  {"string", "Text to replace, copied exactly."},
			"new":  {"string", "Replacement text."},
		}, []string{"path", "old", "new"}}},
	{"web_fetch", "Fetch a URL and return its main content as text.",
		toolSchema{"object", map[string]toolParam{
			"url": {"string", "The http or https URL."},
		}, []string{"url"}}},
	{"task", "Start a subagent with a copy of this conversation to carry out a self-contained task. Returns its final report.",
		toolSchema{"object", map[string]toolParam{
			"description": {"string", "A short title for the task."},
			"prompt":      {"string", "What the subagent should do and report."},
		}, []string{"description", "prompt"}}},
}

// preambleHeader is the start of the shared system message: instructions and the tools list.
func preambleHeader() string {
	var b strings.Builder
	b.WriteString("You are a coding agent working in a user's repository. Work step by step: inspect files ")
	b.WriteString("before changing them, run the tests after every change, and keep edits minimal. Call one ")
	b.WriteString("tool at a time unless the calls are independent. Delegate self-contained investigations to ")
	b.WriteString("subagents with the task tool. When done, answer the user with a short summary.\n\n# Tools\n\n")
	tools := make([]agentTool, len(agentTools))
	for i, f := range agentTools {
		tools[i] = agentTool{Type: "function", Function: f}
	}
	js, _ := json.MarshalIndent(tools, "", "  ") // maps are sorted: deterministic
	b.Write(js)
	b.WriteString("\n\n# Workspace notes\n")
	return b.String()
}

// agentSession is one interactive agent session.
type agentSession struct {
	c       *agentConfig
	idx     int
	id      string
	r       *rng
	started bool
	// start is when the session begins and sends its first request, when the workload has
	// a rate (Poisson arrivals); without one every session starts at 0, after a think time.
	start   time.Duration
	turn    int // current user turn
	call    int // model call within the turn: < rounds are tool rounds, rounds answers the user
	nCalls  int
	history []Message
	pending []ToolCall         // the tool calls the last request stands for
	forked  []*subagentSession // the subagents the last request spawned
}

func (s *agentSession) Next(prev string) (Request, bool) {
	c := s.c
	if !s.started {
		s.started = true
		s.history = []Message{
			{Role: "system", Content: c.preambles[s.idx%len(c.preambles)]},
			{Role: "user", Content: c.v.text(s.r, c.task)},
		}
		at := s.r.exp(c.think)
		if c.rate > 0 {
			at = s.start
		}
		return s.request("interactive", at), true
	}
	if s.turn >= c.turns {
		return Request{}, false
	}
	final := cutTokens(c.tok, prev, c.reasoning)
	if s.call < c.rounds {
		var results []string
		if s.forked != nil {
			for _, sub := range s.forked {
				results = append(results, sub.report())
			}
		} else {
			results = []string{s.toolOutput(s.pending[0].Function.Name)}
		}
		s.history = c.appendToolRound(s.history, final, s.pending, results)
		s.call++
		s.forked = nil
		return s.request("tool", s.r.exp(c.toolTime)), true
	}
	s.history = append(s.history, Message{Role: "assistant", Content: final})
	s.turn++
	s.call = 0
	if s.turn >= c.turns {
		return Request{}, false
	}
	s.history = append(s.history, Message{Role: "user", Content: c.v.text(s.r, c.task)})
	return s.request("interactive", s.r.exp(c.think)), true
}

// request builds the session's next model call from its history and decides which tool call
// it stands for.
func (s *agentSession) request(tag string, at time.Duration) Request {
	c := s.c
	req := c.request(s.id, tag, at, s.history, c.priority)
	req.Invalid = c.clientError(s.id, len(s.history))
	s.pending = nil
	if s.call < c.rounds {
		if s.turn == 0 && s.call == c.fork && c.subagents > 0 {
			for k := range c.subagents {
				sub := newSubagent(c, s, k, req.Messages)
				s.forked = append(s.forked, sub)
				s.pending = append(s.pending, s.toolCall("task", sub.args))
				req.Spawn = append(req.Spawn, sub)
			}
		} else {
			name, args := randomCall(c.v, s.r)
			s.pending = []ToolCall{s.toolCall(name, args)}
		}
	}
	return req
}

func (s *agentSession) toolCall(name, args string) ToolCall {
	s.nCalls++
	return ToolCall{ID: fmt.Sprintf("call_%d_%d", s.idx, s.nCalls), Type: "function",
		Function: FunctionCall{Name: name, Arguments: args}}
}

func (s *agentSession) toolOutput(name string) string {
	return s.c.toolOutput(s.r, name)
}

// request is a model call of any session.
// clientError reports whether the call of session whose history holds n messages is sent
// invalid (client_errors): a hash of both, so that the sessions' random draws, and with them
// every other call, stay those of the same workload without client errors.
func (c *agentConfig) clientError(session string, n int) bool {
	if c.clientErrors <= 0 {
		return false
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d", session, n)
	return float64(h.Sum64()>>11)/(1<<53) < c.clientErrors
}

func (c *agentConfig) request(session, tag string, at time.Duration, history []Message, priority int) Request {
	return Request{
		At:              at,
		Session:         session,
		Chat:            true,
		Messages:        slices.Clip(history),
		MaxTokens:       c.reasoning + c.osl,
		IgnoreEOS:       true,
		Priority:        priority,
		HasPriority:     true,
		OSL:             c.reasoning + c.osl,
		Tag:             tag,
		Anonymous:       c.anonymous,
		PinTTL:          c.pin,
		EphemeralOutput: c.ephemeral && c.reasoning > 0,
	}
}

// toolOutput returns a tool result of about c.tool tokens, unique by construction.
func (c *agentConfig) toolOutput(r *rng, name string) string {
	n := r.rangeInt(c.tool/2, c.tool*3/2)
	s, err := exactText(c.tok, c.v, r, name+" result:\n", n)
	if err != nil {
		// The preamble already proved the tokenizer; fall back to plain words.
		return c.v.text(r, n)
	}
	return s
}

// appendToolRound appends the model's answer to a tool round (its final text and the calls
// it stands for) and the results of those calls.
func (c *agentConfig) appendToolRound(h []Message, final string, calls []ToolCall, results []string) []Message {
	if c.toolCalls {
		h = append(h, Message{Role: "assistant", Content: final, ToolCalls: calls})
		for i, call := range calls {
			h = append(h, Message{Role: "tool", Name: call.Function.Name, ToolCallID: call.ID, Content: results[i]})
		}
		return h
	}
	var a, u strings.Builder
	a.WriteString(final)
	for i, call := range calls {
		fmt.Fprintf(&a, "\n\nCALL %s %s", call.Function.Name, call.Function.Arguments)
		if i > 0 {
			u.WriteString("\n\n")
		}
		fmt.Fprintf(&u, "RESULT %s:\n%s", call.Function.Name, results[i])
	}
	return append(h, Message{Role: "assistant", Content: a.String()}, Message{Role: "user", Content: u.String()})
}

// randomCall picks a tool call other than task, with plausible arguments.
func randomCall(v *vocab, r *rng) (name, args string) {
	word := func() string { return strings.TrimPrefix(v.words[r.intn(v.n())], " ") }
	var a map[string]any
	switch k := r.intn(6); k {
	case 0:
		name, a = "read_file", map[string]any{"path": word() + "/" + word() + ".go"}
	case 1:
		name, a = "list_dir", map[string]any{"path": word() + "/" + word()}
	case 2:
		name, a = "grep", map[string]any{"pattern": word() + "\\(", "path": word()}
	case 3:
		name, a = "run_command", map[string]any{"command": "go test ./" + word() + "/..."}
	case 4:
		name, a = "edit_file", map[string]any{"path": word() + ".go", "old": word() + " " + word(), "new": word() + " " + word()}
	default:
		name, a = "web_fetch", map[string]any{"url": "https://" + word() + ".dev/" + word()}
	}
	js, _ := json.Marshal(a)
	return name, string(js)
}

// subagentSession is a subagent forked from an agent session: it starts from a copy of the
// parent's messages at the fork (the spawning request's), adds the parent's answer and its own
// task, runs sub_rounds tool rounds and reports its final text back to the parent.
type subagentSession struct {
	c       *agentConfig
	parent  int
	k       int
	id      string
	r       *rng
	base    []Message
	args    string // the task call's arguments
	task    string
	call    int
	nCalls  int
	started bool
	done    bool
	history []Message
	pending []ToolCall

	mu     sync.Mutex
	result string
	ended  bool
}

func newSubagent(c *agentConfig, parent *agentSession, k int, base []Message) *subagentSession {
	r := newRNG(c.seed, streamSubagent, uint64(parent.idx), uint64(k))
	task := c.v.text(r, c.subTask)
	args, _ := json.Marshal(map[string]string{
		"description": fmt.Sprintf("subtask %d", k+1),
		"prompt":      strings.TrimSpace(task),
	})
	return &subagentSession{
		c: c, parent: parent.idx, k: k, id: fmt.Sprintf("%s/sub-%d", parent.id, k), r: r,
		base: base, args: string(args), task: task,
	}
}

func (s *subagentSession) Next(prev string) (Request, bool) {
	c := s.c
	if s.done {
		return Request{}, false
	}
	final := cutTokens(c.tok, prev, c.reasoning)
	if !s.started {
		s.started = true
		s.history = append(make([]Message, 0, len(s.base)+2+3*c.subRounds), s.base...)
		if final != "" {
			s.history = append(s.history, Message{Role: "assistant", Content: final})
		}
		s.history = append(s.history, Message{Role: "user", Content: s.task})
		return s.request(0), true
	}
	if s.call < c.subRounds {
		s.history = c.appendToolRound(s.history, final, s.pending, []string{c.toolOutput(s.r, s.pending[0].Function.Name)})
		s.call++
		return s.request(s.r.exp(c.toolTime)), true
	}
	s.done = true
	s.mu.Lock()
	s.result, s.ended = final, true
	s.mu.Unlock()
	return Request{}, false
}

func (s *subagentSession) request(at time.Duration) Request {
	tag := "subagent"
	if s.call == 0 {
		tag = "fork" // a subagent's first call: the parent's context, on whichever worker
	}
	req := s.c.request(s.id, tag, at, s.history, s.c.subPriority)
	req.Invalid = s.c.clientError(s.id, len(s.history))
	s.pending = nil
	if s.call < s.c.subRounds {
		name, args := randomCall(s.c.v, s.r)
		s.nCalls++
		s.pending = []ToolCall{{ID: fmt.Sprintf("call_%d_s%d_%d", s.parent, s.k, s.nCalls),
			Type: "function", Function: FunctionCall{Name: name, Arguments: args}}}
	}
	return req
}

// report returns the subagent's final text for the parent's tool result: what it answered, or,
// when it did not finish (the runner did not run spawned sessions, or stopped them), a
// stand-in of osl words so the parent's history keeps its shape.
func (s *subagentSession) report() string {
	s.mu.Lock()
	res, ended := s.result, s.ended
	s.mu.Unlock()
	if ended && res != "" {
		return res
	}
	return s.c.v.text(newRNG(s.c.seed, streamSubagent, uint64(s.parent), uint64(s.k), 1), s.c.osl)
}

var (
	_ Session = (*agentSession)(nil)
	_ Session = (*subagentSession)(nil)
)
