package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"
)

// completionRequest is the part of an OpenAI chat or text completion request the simulated
// engine acts on, with vLLM's extensions. Unknown fields are ignored, as vLLM ignores them.
type completionRequest struct {
	Model               string          `json:"model"`
	Messages            []chatMessage   `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	MaxTokens           *laxInt         `json:"max_tokens"`
	MaxCompletionTokens *laxInt         `json:"max_completion_tokens"`
	MinTokens           laxInt          `json:"min_tokens"`
	IgnoreEOS           laxBool         `json:"ignore_eos"`
	N                   *laxInt         `json:"n"`
	Stream              laxBool         `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage laxBool `json:"include_usage"`
	} `json:"stream_options"`
	Priority             laxInt          `json:"priority"`
	CacheSalt            string          `json:"cache_salt"`
	Tools                json.RawMessage `json:"tools"`
	ReasoningEffort      string          `json:"reasoning_effort"`
	AddGenerationPrompt  *laxBool        `json:"add_generation_prompt"`
	ContinueFinalMessage laxBool         `json:"continue_final_message"`
	KVTransferParams     json.RawMessage `json:"kv_transfer_params"`
	NVExt                *struct {
		// CacheControl is Dynamo's pin: {"type": "ephemeral", "ttl": "5m"} keeps the
		// request's prompt blocks (evicted last) for ttl after their last hit.
		CacheControl *struct {
			Type string          `json:"type"`
			TTL  json.RawMessage `json:"ttl"`
		} `json:"cache_control"`
		AgentHints *struct {
			// EphemeralOutput says the client will not send this answer back token for
			// token (it keeps only part of it, or re-renders it): its generated blocks are
			// ephemeral to the GPU tier's WORM eviction.
			EphemeralOutput laxBool `json:"ephemeral_output"`
		} `json:"agent_hints"`
	} `json:"nvext"`
}

// defaultPinTTL is the pin of a cache_control without a ttl (Anthropic's and Dynamo's 5m).
const defaultPinTTL = 5 * time.Minute

// pinTTL reads nvext.cache_control: 0 when absent; the ttl as a Go duration ("5m", "1h",
// "90s") or a number of seconds; a 400 for another type or a ttl that is not positive.
func (r *completionRequest) pinTTL() (time.Duration, *apiError) {
	if r.NVExt == nil || r.NVExt.CacheControl == nil {
		return 0, nil
	}
	cc := r.NVExt.CacheControl
	bad := func(format string, args ...any) *apiError {
		e := badRequest("nvext.cache_control: "+format, args...)
		e.param = "nvext.cache_control"
		return e
	}
	if cc.Type != "ephemeral" {
		return 0, bad("type must be \"ephemeral\", got %q", cc.Type)
	}
	raw := bytes.TrimSpace(cc.TTL)
	if len(raw) == 0 || string(raw) == "null" {
		return defaultPinTTL, nil
	}
	var d time.Duration
	var str string
	var secs float64
	switch {
	case json.Unmarshal(raw, &str) == nil:
		var err error
		if d, err = time.ParseDuration(str); err != nil {
			return 0, bad("ttl %q is not a duration like 5m or 1h", str)
		}
	case json.Unmarshal(raw, &secs) == nil:
		if secs > 1e9 {
			return 0, bad("ttl %v seconds is too long", secs)
		}
		d = time.Duration(secs * float64(time.Second))
	default:
		return 0, bad("ttl must be a duration string or a number of seconds")
	}
	if d <= 0 {
		return 0, bad("ttl must be positive")
	}
	return d, nil
}

// ephemeralOutput reports nvext.agent_hints.ephemeral_output.
func (r *completionRequest) ephemeralOutput() bool {
	return r.NVExt != nil && r.NVExt.AgentHints != nil && bool(r.NVExt.AgentHints.EphemeralOutput)
}

// chatMessage is one OpenAI message; content is a string, an array of parts or null.
type chatMessage struct {
	Role             string          `json:"role"`
	Content          json.RawMessage `json:"content"`
	Name             string          `json:"name"`
	ToolCalls        json.RawMessage `json:"tool_calls"`
	ToolCallID       string          `json:"tool_call_id"`
	ReasoningContent string          `json:"reasoning_content"`
	Reasoning        string          `json:"reasoning"`
}

// apiError is an error a client sees as an OpenAI error object with an HTTP status.
type apiError struct {
	status  int
	typ     string
	message string
	param   string
}

func (e *apiError) Error() string { return e.message }

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf(format, args...)}
}

// appendJSON appends the OpenAI error body {"error": {...}}.
func (e *apiError) appendJSON(dst []byte) []byte {
	dst = append(dst, `{"error":{"message":`...)
	dst = appendJSONString(dst, e.message)
	dst = append(dst, `,"type":`...)
	dst = appendJSONString(dst, e.typ)
	dst = append(dst, `,"param":`...)
	if e.param == "" {
		dst = append(dst, "null"...)
	} else {
		dst = appendJSONString(dst, e.param)
	}
	dst = append(dst, `,"code":`...)
	dst = strconv.AppendInt(dst, int64(e.status), 10)
	return append(dst, "}}"...)
}

// decodeRequest parses and checks a completion request body. chat selects the chat API
// (messages) over the text API (prompt).
func decodeRequest(body []byte, chat bool) (*completionRequest, error) {
	var req completionRequest
	// Python's json.loads, which vLLM's server reads bodies with, skips a UTF-8 byte order mark.
	body = bytes.TrimPrefix(body, []byte("\xEF\xBB\xBF"))
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&req); err != nil {
		return nil, badRequest("the request body is not valid JSON: %v", err)
	}
	if dec.More() {
		return nil, badRequest("the request body has data after its JSON object")
	}
	if req.KVTransferParams != nil {
		// encoding/json matches keys case-insensitively (KV_TRANSFER_PARAMS, a long s, a
		// Kelvin sign); vLLM's server does not: only the exact key says where to move KV.
		var exact map[string]json.RawMessage
		if json.Unmarshal(body, &exact) != nil {
			return nil, badRequest("the request body is not a JSON object")
		}
		req.KVTransferParams = exact["kv_transfer_params"]
	}
	if req.N != nil && *req.N != 1 {
		return nil, badRequest("n must be 1 on this engine, got %d", *req.N)
	}
	if chat {
		if len(req.Messages) == 0 {
			return nil, &apiError{status: 400, typ: "BadRequestError", message: "messages must be a non-empty array", param: "messages"}
		}
	} else if len(req.Prompt) == 0 || string(req.Prompt) == "null" {
		return nil, &apiError{status: 400, typ: "BadRequestError", message: "prompt is required", param: "prompt"}
	}
	for _, m := range []struct {
		v     *laxInt
		param string
	}{{req.MaxTokens, "max_tokens"}, {req.MaxCompletionTokens, "max_completion_tokens"}} {
		if m.v != nil && *m.v < 1 {
			// vLLM's SamplingParams: a request must ask for at least one token.
			return nil, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf("%s must be at least 1, got %d.", m.param, *m.v), param: m.param}
		}
	}
	if req.MinTokens < 0 {
		return nil, &apiError{status: 400, typ: "BadRequestError", message: "min_tokens must be at least 0", param: "min_tokens"}
	}
	if _, aerr := req.pinTTL(); aerr != nil {
		return nil, aerr
	}
	return &req, nil
}

// maxTokens is the output cap the client asked for (max_completion_tokens wins, as in the
// OpenAI API), 0 when it gave none.
func (r *completionRequest) maxTokens() int {
	switch {
	case r.MaxCompletionTokens != nil:
		return int(*r.MaxCompletionTokens)
	case r.MaxTokens != nil:
		return int(*r.MaxTokens)
	}
	return 0
}

// messageText flattens a message's content: a string, or the text parts of an array of
// content parts. Non-text parts (images, audio) are refused: the engine has no encoder.
func messageText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badRequest("message content is not a valid string: %v", err)
		}
		return s, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest("message content must be a string or an array of content parts")
	}
	var b []byte
	for _, p := range parts {
		if p.Type != "text" && p.Type != "input_text" {
			return "", badRequest("content part of type %q is not supported by this text-only model", p.Type)
		}
		if p.Text == nil {
			return "", badRequest("a text content part has no text")
		}
		b = append(b, *p.Text...)
	}
	return string(b), nil
}

// promptInput is the text or the token ids of a text completion's prompt.
type promptInput struct {
	text   string
	tokens []uint32
	isIDs  bool
}

// parsePrompt accepts the forms vLLM accepts for one prompt: a string, a list with one
// string, a list of token ids, or a list with one list of token ids.
func parsePrompt(raw json.RawMessage) (promptInput, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return promptInput{}, badRequest("prompt is required")
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return promptInput{}, badRequest("prompt is not a valid string: %v", err)
		}
		return promptInput{text: s}, nil
	case '[':
		if toks, ok := scanIDs(raw); ok {
			return promptInput{tokens: toks, isIDs: true}, nil
		}
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return promptInput{}, badRequest("prompt is not a valid array: %v", err)
		}
		if len(items) == 0 {
			return promptInput{}, badRequest("prompt must not be empty")
		}
		first := bytes.TrimSpace(items[0])
		if len(first) > 0 && (first[0] == '"' || first[0] == '[') {
			if len(items) != 1 {
				return promptInput{}, badRequest("batched prompts are not supported; send %d requests", len(items))
			}
			return parsePrompt(first)
		}
		var ids []int64
		if err := json.Unmarshal(raw, &ids); err != nil {
			return promptInput{}, badRequest("prompt must be a string or an array of token ids")
		}
		toks := make([]uint32, len(ids))
		for i, id := range ids {
			if id < 0 || id > 1<<31 {
				return promptInput{}, badRequest("token id %d is out of range", id)
			}
			toks[i] = uint32(id)
		}
		return promptInput{tokens: toks, isIDs: true}, nil
	}
	return promptInput{}, badRequest("prompt must be a string or an array of token ids")
}

// appendJSONString appends s as a JSON string literal. Invalid UTF-8 becomes U+FFFD, as
// encoding/json writes it.
func appendJSONString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < 0x80 {
			switch {
			case c == '"' || c == '\\':
				dst = append(dst, '\\', c)
			case c == '\n':
				dst = append(dst, '\\', 'n')
			case c == '\r':
				dst = append(dst, '\\', 'r')
			case c == '\t':
				dst = append(dst, '\\', 't')
			case c < 0x20 || c == '<' || c == '>' || c == '&':
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				dst = append(dst, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == 0xfffd && size == 1 {
			dst = append(dst, `\ufffd`...)
		} else if r == 0x2028 || r == 0x2029 {
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[r&0xf])
		} else {
			dst = append(dst, s[i:i+size]...)
		}
		i += size
	}
	return append(dst, '"')
}

// scanIDs is the fast path of a prompt given as token ids: a flat JSON array of non-negative
// integers below 2^31. Anything else (nested lists, strings, floats, signs, huge values)
// reports false and takes the general path, which gives the precise error.
func scanIDs(raw []byte) ([]uint32, bool) {
	n := 1
	for _, c := range raw {
		if c == ',' {
			n++
		}
	}
	toks := make([]uint32, 0, n)
	i := 1 // past '['
	skip := func() {
		for i < len(raw) && (raw[i] == ' ' || raw[i] == '\t' || raw[i] == '\n' || raw[i] == '\r') {
			i++
		}
	}
	skip()
	if i < len(raw) && raw[i] == ']' {
		return nil, false // empty: the general path reports it
	}
	for {
		skip()
		start := i
		var v uint64
		for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
			v = v*10 + uint64(raw[i]-'0')
			if v > 1<<31 {
				return nil, false
			}
			i++
		}
		if i == start || (raw[start] == '0' && i-start > 1) {
			return nil, false
		}
		toks = append(toks, uint32(v))
		skip()
		if i >= len(raw) {
			return nil, false
		}
		switch raw[i] {
		case ',':
			i++
		case ']':
			i++
			skip()
			return toks, i == len(raw)
		default:
			return nil, false
		}
	}
}
