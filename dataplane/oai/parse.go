package oai

import (
	"bytes"
	"math"
	"strconv"
	"time"
)

// field identifies a top-level field for per-field error slots: when a key repeats, the later
// value replaces the earlier one, error included, as in Python's json.loads.
type field uint8

const (
	fNone field = iota
	fModel
	fMessages
	fStream
	fStreamOptions
	fMaxTokens
	fMaxCompletionTokens
	fMaxOutputTokens
	fTemperature
	fN
	fIgnoreEOS
	fMinTokens
	fReasoningEffort
	fReasoning
	fAddGenerationPrompt
	fContinueFinalMessage
	fCacheSalt
	fPrompt
	fInput
	fInstructions
	fPreviousResponseID
	fNvext
	fPriority
	numFields
)

// Release drops what p holds of the last body it parsed (the body itself, its request), so
// that their memory can go; p stays usable.
func (p *Parser) Release() { p.b, p.req, p.keybuf, p.spans = nil, nil, nil, nil }

// Parser parses OpenAI request bodies. The zero value is ready to use; it keeps scratch
// buffers between calls, so one Parser per connection (or per event loop) parses without
// allocating once warmed up. A Parser is not safe for concurrent use.
type Parser struct {
	// ModelOptional accepts a body without a model (vLLM then serves its only model). By
	// default a missing or empty model is rejected.
	ModelOptional bool

	b   []byte
	i   int
	req *Request
	cur field
	s   strScan

	errs  [numFields]*Error
	errAt [numFields]int

	maxTok, maxCompl, maxOut          int
	hasMaxTok, hasMaxCompl, hasMaxOut bool
	extraText                         int // text bytes of batch prompts after the first

	keybuf []byte
	spans  []strScan
	stk    [MaxDepth/64 + 1]uint64 // bit d: the container at depth d is an object
}

// Parse parses body, posted to the endpoint kind, into req. It returns nil, or an *Error
// wrapping ErrInvalidJSON or ErrInvalidRequest; after an error req holds partial results.
// req's byte slices alias body (see Request); body must not change while they are in use.
func (p *Parser) Parse(body []byte, kind Kind, req *Request) error {
	req.reset(kind, len(body))
	p.b, p.i, p.req, p.cur = body, 0, req, fNone
	p.errs = [numFields]*Error{}
	p.maxTok, p.maxCompl, p.maxOut = 0, 0, 0
	p.hasMaxTok, p.hasMaxCompl, p.hasMaxOut = false, false, false
	p.extraText = 0
	if len(body) >= 3 && body[0] == 0xEF && body[1] == 0xBB && body[2] == 0xBF {
		p.i = 3 // Python decodes a body that starts with a UTF-8 byte order mark as utf-8-sig
	}
	p.ws()
	if p.i >= len(body) {
		return syntaxError(p.i, "empty body")
	}
	if body[p.i] != '{' {
		if err := p.skipValue(0); err != nil {
			return err
		}
		if err := p.end(); err != nil {
			return err
		}
		return fieldError("", "the request body must be a JSON object", CodeInvalidType)
	}
	if err := p.top(); err != nil {
		return err
	}
	if err := p.end(); err != nil {
		return err
	}
	var first *Error
	at := 0
	for f, e := range p.errs {
		if e != nil && (first == nil || p.errAt[f] < at) {
			first, at = e, p.errAt[f]
		}
	}
	if first != nil {
		return first
	}
	return p.finish()
}

func (p *Parser) end() error {
	p.ws()
	if p.i != len(p.b) {
		return syntaxError(p.i, "extra data after the JSON value")
	}
	return nil
}

// fail records a field error in the current top-level field's slot unless it holds one.
func (p *Parser) fail(param, msg, code string) {
	if p.errs[p.cur] == nil {
		p.errs[p.cur] = fieldError(param, msg, code)
		p.errAt[p.cur] = p.i
	}
}

func (p *Parser) failed() bool { return p.errs[p.cur] != nil }

func (p *Parser) top() error {
	r := p.req
	p.i++
	first := true
	for {
		key, ok, err := p.nextKey(&first)
		if err != nil || !ok {
			return err
		}
		p.cur = fNone
		switch string(key) {
		case "model":
			p.begin(fModel)
			err = p.str(&r.Model, "model")
		case "stream":
			p.begin(fStream)
			err = p.boolean(&r.Stream, false, "stream")
		case "stream_options":
			p.begin(fStreamOptions)
			err = p.streamOptions()
		case "temperature":
			p.begin(fTemperature)
			err = p.float(&r.Temperature, &r.HasTemperature, "temperature")
		case "n":
			p.begin(fN)
			var has bool
			if err = p.integer(&r.N, &has, "n"); !has {
				r.N = 1
			}
		case "ignore_eos":
			p.begin(fIgnoreEOS)
			err = p.boolean(&r.IgnoreEOS, false, "ignore_eos")
		case "min_tokens":
			p.begin(fMinTokens)
			var has bool
			err = p.integer(&r.MinTokens, &has, "min_tokens")
		case "priority":
			p.begin(fPriority)
			err = p.integer(&r.EnginePriority, &r.HasEnginePriority, "priority")
		case "kv_transfer_params":
			err = p.raw(&r.KVTransferParams)
		case "logprobs", "top_logprobs":
			var v []byte
			if err = p.raw(&v); err == nil {
				switch string(bytes.TrimSpace(v)) {
				case "", "null", "false", "0":
				default:
					r.Logprobs = true
				}
			}
		case "cache_salt":
			p.begin(fCacheSalt)
			err = p.str(&r.CacheSalt, "cache_salt")
		case "user":
			err = p.raw(&r.User)
		case "nvext":
			p.begin(fNvext)
			err = p.nvext()
		default:
			if reservedFold(key) {
				// A spelling that folds to kv_transfer_params (KV_TRANSFER_PARAMS, a long s, a
				// Kelvin sign): an engine decoding JSON case-insensitively takes it as the real
				// one, so it is the real one here too, and refused as such.
				err = p.raw(&r.KVTransferParams)
				break
			}
			err = p.kindField(key)
		}
		if err != nil {
			return err
		}
	}
}

// reservedFold reports whether key, other than kv_transfer_params itself, equals it under
// Unicode simple case folding (as Go's encoding/json and other case-insensitive decoders
// match keys).
func reservedFold(key []byte) bool {
	return len(key) >= len("kv_transfer_params")-2 && len(key) <= 3*len("kv_transfer_params") && bytes.EqualFold(key, []byte("kv_transfer_params"))
}

// begin starts a top-level field: a repeated key drops what the earlier value recorded.
func (p *Parser) begin(f field) {
	p.cur = f
	p.errs[f] = nil
}

// kindField parses the fields that only some endpoints read; others are skipped.
func (p *Parser) kindField(key []byte) error {
	r := p.req
	switch r.Kind {
	case ChatCompletions:
		switch string(key) {
		case "messages":
			p.begin(fMessages)
			return p.messages("messages")
		case "max_tokens":
			p.begin(fMaxTokens)
			return p.integer(&p.maxTok, &p.hasMaxTok, "max_tokens")
		case "max_completion_tokens":
			p.begin(fMaxCompletionTokens)
			return p.integer(&p.maxCompl, &p.hasMaxCompl, "max_completion_tokens")
		case "tools":
			return p.raw(&r.Tools)
		case "tool_choice":
			return p.raw(&r.ToolChoice)
		case "reasoning_effort":
			p.begin(fReasoningEffort)
			return p.str(&r.ReasoningEffort, "reasoning_effort")
		case "add_generation_prompt":
			p.begin(fAddGenerationPrompt)
			return p.boolean(&r.AddGenerationPrompt, true, "add_generation_prompt")
		case "continue_final_message":
			p.begin(fContinueFinalMessage)
			return p.boolean(&r.ContinueFinalMessage, false, "continue_final_message")
		case "chat_template_kwargs":
			return p.raw(&r.ChatTemplateKwargs)
		}
	case Completions:
		switch string(key) {
		case "prompt":
			p.begin(fPrompt)
			return p.prompt("prompt")
		case "max_tokens":
			p.begin(fMaxTokens)
			return p.integer(&p.maxTok, &p.hasMaxTok, "max_tokens")
		case "prompt_embeds":
			var raw []byte
			err := p.raw(&raw)
			r.PromptEmbeds = raw != nil
			return err
		}
	case Embeddings:
		if string(key) == "input" {
			p.begin(fInput)
			return p.prompt("input")
		}
	case Responses:
		switch string(key) {
		case "input":
			p.begin(fInput)
			return p.responsesInput()
		case "instructions":
			p.begin(fInstructions)
			return p.str(&r.Instructions, "instructions")
		case "previous_response_id":
			p.begin(fPreviousResponseID)
			return p.str(&r.PreviousResponseID, "previous_response_id")
		case "max_output_tokens":
			p.begin(fMaxOutputTokens)
			return p.integer(&p.maxOut, &p.hasMaxOut, "max_output_tokens")
		case "tools":
			return p.raw(&r.Tools)
		case "tool_choice":
			return p.raw(&r.ToolChoice)
		case "reasoning":
			p.begin(fReasoning)
			return p.reasoning()
		}
	}
	return p.skipValue(1)
}

// finish resolves fields that depend on each other and checks what needs the final values.
func (p *Parser) finish() error {
	r := p.req
	maxParam := ""
	switch {
	case p.hasMaxCompl:
		r.MaxTokens, r.HasMaxTokens, maxParam = p.maxCompl, true, "max_completion_tokens"
	case p.hasMaxTok:
		r.MaxTokens, r.HasMaxTokens, maxParam = p.maxTok, true, "max_tokens"
	case p.hasMaxOut:
		r.MaxTokens, r.HasMaxTokens, maxParam = p.maxOut, true, "max_output_tokens"
	}
	if len(r.Model) == 0 && !p.ModelOptional {
		return fieldError("model", "model is required", CodeMissingParameter)
	}
	switch r.Kind {
	case ChatCompletions:
		if len(r.Messages) == 0 {
			return fieldError("messages", "messages must be a non-empty array", CodeEmptyArray)
		}
	case Completions:
		if r.NumPrompts == 0 && !r.PromptEmbeds {
			return fieldError("prompt", "prompt is required", CodeMissingParameter)
		}
	case Embeddings:
		if r.NumPrompts == 0 {
			return fieldError("input", "input is required", CodeMissingParameter)
		}
	case Responses:
		if len(r.Messages) == 0 && r.PreviousResponseID == nil {
			return fieldError("input", "input is required", CodeMissingParameter)
		}
	}
	if min := maxTokensFloor(r.Kind); r.HasMaxTokens && r.MaxTokens < min {
		// vLLM's SamplingParams refuses a completion of no tokens (max_tokens 0 is not "unset").
		return fieldError(maxParam, maxParam+" must be at least "+strconv.Itoa(min)+", got "+strconv.Itoa(r.MaxTokens)+".", CodeBelowMinimum)
	}
	if r.N < 1 {
		return fieldError("n", "n must be at least 1", CodeBelowMinimum)
	}
	if r.MinTokens < 0 {
		return fieldError("min_tokens", "min_tokens must be at least 0", CodeBelowMinimum)
	}
	if r.HasTemperature && !(r.Temperature >= 0 && r.Temperature <= math.MaxFloat64) {
		return fieldError("temperature", "temperature must be a finite number of at least 0", CodeInvalidValue)
	}
	if r.Hints.HasOSL && r.Hints.OSL < 0 {
		return fieldError("nvext.agent_hints.osl", "nvext.agent_hints.osl must be at least 0", CodeBelowMinimum)
	}
	n := p.extraText + len(r.Tools) + len(r.Prompt) + 4*len(r.PromptTokens) + len(r.Instructions)
	for i := range r.Messages {
		m := &r.Messages[i]
		n += len(m.Content) + len(m.Reasoning) + len(m.ToolCalls)
	}
	r.TextBytes = n
	return nil
}

// ---- structural helpers ----

func (p *Parser) ws() {
	b := p.b
	for p.i < len(b) && isWS(b[p.i]) {
		p.i++
	}
}

func (p *Parser) eof() error { return syntaxError(p.i, "unexpected end of body") }

// peek returns the byte at p.i, which the caller has moved past whitespace.
func (p *Parser) peek() (byte, error) {
	if p.i >= len(p.b) {
		return 0, p.eof()
	}
	return p.b[p.i], nil
}

// nextKey moves to the next member of an object whose '{' has been consumed, and returns its
// key (unescaped; valid until the next call) with the position at the value. ok is false at
// the closing brace, which it consumes.
func (p *Parser) nextKey(first *bool) (key []byte, ok bool, err error) {
	p.ws()
	c, err := p.peek()
	if err != nil {
		return nil, false, err
	}
	if *first {
		*first = false
		if c == '}' {
			p.i++
			return nil, false, nil
		}
	} else {
		switch c {
		case '}':
			p.i++
			return nil, false, nil
		case ',':
			p.i++
			p.ws()
		default:
			return nil, false, syntaxError(p.i, "expected ',' or '}'")
		}
	}
	if p.i >= len(p.b) || p.b[p.i] != '"' {
		return nil, false, syntaxError(p.i, "expected a property name in double quotes")
	}
	if err := p.scanStr(); err != nil {
		return nil, false, err
	}
	key = p.b[p.s.start:p.s.end]
	if p.s.esc {
		p.keybuf = appendUnescaped(p.keybuf[:0], key)
		key = p.keybuf
	}
	p.ws()
	if p.i >= len(p.b) || p.b[p.i] != ':' {
		return nil, false, syntaxError(p.i, "expected ':'")
	}
	p.i++
	p.ws()
	return key, true, nil
}

// nextElem moves to the next element of an array whose '[' has been consumed. ok is false
// at the closing bracket, which it consumes.
func (p *Parser) nextElem(first *bool) (ok bool, err error) {
	p.ws()
	c, err := p.peek()
	if err != nil {
		return false, err
	}
	if *first {
		*first = false
		if c == ']' {
			p.i++
			return false, nil
		}
		return true, nil
	}
	switch c {
	case ']':
		p.i++
		return false, nil
	case ',':
		p.i++
		p.ws()
		return true, nil
	}
	return false, syntaxError(p.i, "expected ',' or ']'")
}

// scanStr scans the string at p.i into p.s and moves past it, or reports a syntax error.
func (p *Parser) scanStr() error {
	end, reason := scanString(p.b, p.i, &p.s)
	if end < 0 {
		if end == -1 {
			return syntaxError(len(p.b), reason)
		}
		return syntaxError(-end-1, reason)
	}
	p.i = end
	return nil
}

// text returns the text of a scanned string: the raw bytes when it has no escapes, else its
// unescaped copy in the Request's buffer.
func (p *Parser) text(s *strScan) []byte {
	if !s.esc {
		return p.b[s.start:s.end:s.end]
	}
	r := p.req
	n := len(r.buf)
	r.buf = appendUnescaped(r.buf, p.b[s.start:s.end])
	return r.buf[n:len(r.buf):len(r.buf)]
}

// skipValue validates and skips the value at p.i, found inside a container at depth depth.
func (p *Parser) skipValue(depth int) error {
	base := depth
	b := p.b
	for {
		p.ws()
		c, err := p.peek()
		if err != nil {
			return err
		}
		switch c {
		case '{', '[':
			depth++
			if depth > MaxDepth {
				return syntaxError(p.i, "nesting too deep")
			}
			w, bit := uint(depth)>>6, uint64(1)<<(uint(depth)&63)
			if c == '{' {
				p.stk[w] |= bit
			} else {
				p.stk[w] &^= bit
			}
			p.i++
			p.ws()
			if p.i < len(b) && b[p.i] == c+2 { // '}' or ']'
				p.i++
				depth--
				break
			}
			if c == '{' {
				if err := p.skipKey(); err != nil {
					return err
				}
			}
			continue
		case '"':
			if err := p.scanStr(); err != nil {
				return err
			}
		default:
			if err := p.skipScalar(); err != nil {
				return err
			}
		}
		// After a complete value: close containers or move to the next value.
		for {
			if depth == base {
				return nil
			}
			p.ws()
			c, err := p.peek()
			if err != nil {
				return err
			}
			w, bit := uint(depth)>>6, uint64(1)<<(uint(depth)&63)
			obj := p.stk[w]&bit != 0
			if c == ',' {
				p.i++
				if obj {
					if err := p.skipKey(); err != nil {
						return err
					}
				}
				break
			}
			if obj && c == '}' || !obj && c == ']' {
				p.i++
				depth--
				continue
			}
			if obj {
				return syntaxError(p.i, "expected ',' or '}'")
			}
			return syntaxError(p.i, "expected ',' or ']'")
		}
	}
}

// skipKey consumes `"key" :` inside an object being skipped.
func (p *Parser) skipKey() error {
	p.ws()
	if p.i >= len(p.b) || p.b[p.i] != '"' {
		return syntaxError(p.i, "expected a property name in double quotes")
	}
	if err := p.scanStr(); err != nil {
		return err
	}
	p.ws()
	if p.i >= len(p.b) || p.b[p.i] != ':' {
		return syntaxError(p.i, "expected ':'")
	}
	p.i++
	return nil
}

// skipScalar consumes a number or literal at p.i.
func (p *Parser) skipScalar() error {
	if n := literal(p.b, p.i); n > 0 {
		p.i += n
		return nil
	}
	end, _ := scanNumber(p.b, p.i)
	if end < 0 {
		return syntaxError(p.i, "expected a value")
	}
	p.i = end
	return nil
}

// raw stores the raw JSON of the value at p.i (nil for null).
func (p *Parser) raw(dst *[]byte) error {
	start := p.i
	if err := p.skipValue(1); err != nil {
		return err
	}
	if v := p.b[start:p.i]; string(v) != "null" {
		*dst = v[:len(v):len(v)]
	} else {
		*dst = nil
	}
	return nil
}

// ---- typed values ----

// str reads a string field (nil for null). A string holding an unpaired surrogate escape is
// refused: Python keeps it, but no tokenizer can encode it, so the engine would fail.
func (p *Parser) str(dst *[]byte, param string) error {
	c, err := p.peek()
	if err != nil {
		return err
	}
	switch c {
	case '"':
		if err := p.scanStr(); err != nil {
			return err
		}
		if p.s.lone {
			p.fail(param, param+" contains an unpaired UTF-16 surrogate", CodeInvalidValue)
			*dst = nil
			return nil
		}
		*dst = p.text(&p.s)
		return nil
	case 'n':
		if literal(p.b, p.i) == 4 {
			p.i += 4
			*dst = nil
			return nil
		}
	}
	p.fail(param, param+" must be a string", CodeInvalidType)
	return p.skipValue(1)
}

// boolean reads a bool field with pydantic's lax coercions (as vLLM validates it): true,
// false, the numbers 0 and 1, and the strings 0/1/f/t/n/y/no/yes/off/on/false/true in any
// case. null restores def.
func (p *Parser) boolean(dst *bool, def bool, param string) error {
	c, err := p.peek()
	if err != nil {
		return err
	}
	b := p.b
	switch c {
	case 't':
		if literal(b, p.i) == 4 {
			p.i += 4
			*dst = true
			return nil
		}
	case 'f':
		if literal(b, p.i) == 5 {
			p.i += 5
			*dst = false
			return nil
		}
	case 'n':
		if literal(b, p.i) == 4 {
			p.i += 4
			*dst = def
			return nil
		}
	case '"':
		if err := p.scanStr(); err != nil {
			return err
		}
		if v, ok := laxBool(b[p.s.start:p.s.end]); ok && !p.s.esc {
			*dst = v
			return nil
		}
		p.fail(param, param+" must be a boolean", CodeInvalidType)
		return nil
	default:
		start := p.i
		if end, _ := scanNumber(b, p.i); end > 0 {
			p.i = end
			f, err := strconv.ParseFloat(string(b[start:end]), 64)
			if err == nil && (f == 0 || f == 1) {
				*dst = f == 1
				return nil
			}
			p.fail(param, param+" must be a boolean", CodeInvalidType)
			return nil
		}
	}
	p.fail(param, param+" must be a boolean", CodeInvalidType)
	return p.skipValue(1)
}

func laxBool(s []byte) (v, ok bool) {
	if len(s) > 5 {
		return false, false
	}
	var l [5]byte
	for i, c := range s {
		if c >= 'A' && c <= 'Z' {
			c += 'a' - 'A'
		}
		l[i] = c
	}
	switch string(l[:len(s)]) {
	case "1", "t", "y", "on", "yes", "true":
		return true, true
	case "0", "f", "n", "no", "off", "false":
		return false, true
	}
	return false, false
}

// numKind classifies what number() found.
type numKind uint8

const (
	numAbsent numKind = iota // null
	numInt                   // an integer value in i (also f)
	numFloat                 // a non-integral or non-finite value in f
	numBad                   // wrong type (recorded with fail)
	numRange                 // an integral value beyond int64
)

// number reads a numeric value with pydantic's lax coercions: JSON numbers (NaN and
// ±Infinity included), booleans (1 and 0) and numeric strings.
func (p *Parser) number(param string) (i int64, f float64, k numKind, err error) {
	c, err := p.peek()
	if err != nil {
		return 0, 0, 0, err
	}
	b := p.b
	switch c {
	case 'n':
		if literal(b, p.i) == 4 {
			p.i += 4
			return 0, 0, numAbsent, nil
		}
	case 't', 'f':
		if n := literal(b, p.i); n > 0 {
			p.i += n
			if c == 't' {
				return 1, 1, numInt, nil
			}
			return 0, 0, numInt, nil
		}
	case 'N', 'I':
		if n := literal(b, p.i); n > 0 {
			p.i += n
			if c == 'N' {
				return 0, math.NaN(), numFloat, nil
			}
			return 0, math.Inf(1), numFloat, nil
		}
	case '"':
		if err := p.scanStr(); err != nil {
			return 0, 0, 0, err
		}
		if !p.s.esc {
			if i, f, k := laxNumber(b[p.s.start:p.s.end]); k != numBad {
				return i, f, k, nil
			}
		}
		p.fail(param, param+" must be a number", CodeInvalidType)
		return 0, 0, numBad, nil
	case '{', '[':
	default:
		if c == '-' && literal(b, p.i) > 0 {
			p.i += len("-Infinity")
			return 0, math.Inf(-1), numFloat, nil
		}
		start := p.i
		end, isInt := scanNumber(b, p.i)
		if end < 0 {
			return 0, 0, 0, syntaxError(p.i, "expected a value")
		}
		p.i = end
		if isInt {
			if v, ok := parseInt(b[start:end]); ok {
				return v, float64(v), numInt, nil
			}
			return 0, 0, numRange, nil
		}
		f, _ := strconv.ParseFloat(string(b[start:end]), 64)
		return floatKind(f)
	}
	p.fail(param, param+" must be a number", CodeInvalidType)
	return 0, 0, numBad, p.skipValue(1)
}

func floatKind(f float64) (int64, float64, numKind, error) {
	if f == math.Trunc(f) && f >= -(1<<63) && f < 1<<63 {
		return int64(f), f, numInt, nil
	}
	if f == math.Trunc(f) && !math.IsInf(f, 0) {
		return 0, f, numRange, nil
	}
	return 0, f, numFloat, nil
}

// parseInt parses an optionally negative run of decimal digits into an int64.
func parseInt(s []byte) (int64, bool) {
	neg := false
	if len(s) > 0 && s[0] == '-' {
		neg, s = true, s[1:]
	}
	if len(s) == 0 {
		return 0, false
	}
	var u uint64
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0, false
		}
		if u > (math.MaxUint64-9)/10 {
			return 0, false
		}
		u = u*10 + uint64(c-'0')
	}
	if neg {
		if u > 1<<63 {
			return 0, false
		}
		return -int64(u), true
	}
	if u > math.MaxInt64 {
		return 0, false
	}
	return int64(u), true
}

// laxNumber parses a numeric string as pydantic does for int and float fields: surrounding
// whitespace, a sign, and underscores between digits; a float form ("1.5", "1e3", "inf").
func laxNumber(s []byte) (int64, float64, numKind) {
	for len(s) > 0 && isWS(s[0]) {
		s = s[1:]
	}
	for len(s) > 0 && isWS(s[len(s)-1]) {
		s = s[:len(s)-1]
	}
	var digits [40]byte
	n := 0
	for k, c := range s {
		if c == '_' {
			if k == 0 || k == len(s)-1 || s[k-1] < '0' || s[k-1] > '9' || s[k+1] < '0' || s[k+1] > '9' {
				return 0, 0, numBad
			}
			continue
		}
		if n == len(digits) {
			return 0, 0, numBad
		}
		digits[n] = c
		n++
	}
	t := digits[:n]
	if len(t) > 0 && t[0] == '+' {
		t = t[1:]
	}
	if v, ok := parseInt(t); ok {
		return v, float64(v), numInt
	}
	f, err := strconv.ParseFloat(string(t), 64)
	if err != nil {
		return 0, 0, numBad
	}
	i, f, k, _ := floatKind(f)
	return i, f, k
}

// integer reads an int field: an integral number (5, 5.0, 1e3, "5", true); null clears has.
func (p *Parser) integer(dst *int, has *bool, param string) error {
	i, _, k, err := p.number(param)
	if err != nil {
		return err
	}
	switch k {
	case numAbsent, numBad:
		*dst, *has = 0, false
	case numInt:
		*dst, *has = int(i), true
	case numFloat:
		*dst, *has = 0, false
		p.fail(param, param+" must be an integer", CodeInvalidType)
	case numRange:
		*dst, *has = 0, false
		p.fail(param, param+" is out of range", CodeInvalidValue)
	}
	return nil
}

// float reads a float field; null clears has.
func (p *Parser) float(dst *float64, has *bool, param string) error {
	_, f, k, err := p.number(param)
	if err != nil {
		return err
	}
	switch k {
	case numInt, numFloat, numRange:
		*dst, *has = f, true
	default:
		*dst, *has = 0, false
	}
	return nil
}

// ---- objects ----

// object enters the object at p.i; ok is false (and the value skipped) for null, or for
// another type, which is recorded as an error for param.
func (p *Parser) object(param string) (ok bool, err error) {
	c, err := p.peek()
	if err != nil {
		return false, err
	}
	if c == '{' {
		p.i++
		return true, nil
	}
	if c != 'n' || literal(p.b, p.i) != 4 {
		p.fail(param, param+" must be an object", CodeInvalidType)
	}
	return false, p.skipValue(1)
}

func (p *Parser) streamOptions() error {
	r := p.req
	r.IncludeUsage = false
	ok, err := p.object("stream_options")
	if !ok || err != nil {
		return err
	}
	first := true
	for {
		key, ok, err := p.nextKey(&first)
		if err != nil || !ok {
			return err
		}
		if string(key) == "include_usage" {
			err = p.boolean(&r.IncludeUsage, false, "stream_options.include_usage")
		} else {
			err = p.skipValue(2)
		}
		if err != nil {
			return err
		}
	}
}

func (p *Parser) reasoning() error {
	r := p.req
	r.ReasoningEffort = nil
	ok, err := p.object("reasoning")
	if !ok || err != nil {
		return err
	}
	first := true
	for {
		key, ok, err := p.nextKey(&first)
		if err != nil || !ok {
			return err
		}
		if string(key) == "effort" {
			err = p.str(&r.ReasoningEffort, "reasoning.effort")
		} else {
			err = p.skipValue(2)
		}
		if err != nil {
			return err
		}
	}
}

func (p *Parser) nvext() error {
	h := &p.req.Hints
	*h = Hints{}
	ok, err := p.object("nvext")
	if !ok || err != nil {
		return err
	}
	first := true
	for {
		key, ok, err := p.nextKey(&first)
		if err != nil || !ok {
			return err
		}
		switch string(key) {
		case "agent_hints":
			err = p.agentHints(h)
		case "session_id":
			err = p.str(&h.SessionID, "nvext.session_id")
		case "cache_control":
			err = p.cacheControl(h)
		default:
			err = p.skipValue(2)
		}
		if err != nil {
			return err
		}
	}
}

// defaultPinTTL is a cache_control pin's ttl when it names none (Dynamo's and Anthropic's).
const defaultPinTTL = 5 * time.Minute

// maxPinTTL bounds a pin kvrelay believes.
const maxPinTTL = 24 * time.Hour

// cacheControl reads nvext.cache_control into h.PinTTL: type "ephemeral" with a ttl that is
// a Go duration string ("5m") or a number of seconds, 5m when absent. Anything else leaves
// no pin; only a type or ttl of a JSON type no engine reads (not a string; a ttl neither a
// string nor a number) is an error.
func (p *Parser) cacheControl(h *Hints) error {
	h.PinTTL = 0
	ok, err := p.object("nvext.cache_control")
	if !ok || err != nil {
		return err
	}
	var typ, ttl []byte
	var secs float64
	hasSecs, hasTTL := false, false
	first := true
	for {
		key, ok, err := p.nextKey(&first)
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		switch string(key) {
		case "type":
			err = p.str(&typ, "nvext.cache_control.type")
		case "ttl":
			c, perr := p.peek()
			if perr != nil {
				return perr
			}
			hasTTL = true
			if c == '"' || c == 'n' {
				err = p.str(&ttl, "nvext.cache_control.ttl")
			} else {
				err = p.float(&secs, &hasSecs, "nvext.cache_control.ttl")
			}
		default:
			err = p.skipValue(3)
		}
		if err != nil {
			return err
		}
	}
	if string(typ) != "ephemeral" {
		return nil
	}
	d := defaultPinTTL
	switch {
	case hasSecs:
		d = time.Duration(min(secs, maxPinTTL.Seconds()) * float64(time.Second))
	case hasTTL && ttl != nil:
		if d, err = time.ParseDuration(string(ttl)); err != nil {
			return nil
		}
	}
	if d > 0 {
		h.PinTTL = min(d, maxPinTTL)
	}
	return nil
}

func (p *Parser) agentHints(h *Hints) error {
	sid, pin := h.SessionID, h.PinTTL
	*h = Hints{SessionID: sid, PinTTL: pin}
	ok, err := p.object("nvext.agent_hints")
	if !ok || err != nil {
		return err
	}
	first := true
	for {
		key, ok, err := p.nextKey(&first)
		if err != nil || !ok {
			return err
		}
		switch string(key) {
		case "priority":
			err = p.integer(&h.Priority, &h.HasPriority, "nvext.agent_hints.priority")
		case "latency_sensitivity":
			err = p.float(&h.LatencySensitivity, &h.HasLatencySensitivity, "nvext.agent_hints.latency_sensitivity")
		case "osl":
			err = p.integer(&h.OSL, &h.HasOSL, "nvext.agent_hints.osl")
		case "speculative_prefill":
			err = p.boolean(&h.SpeculativePrefill, false, "nvext.agent_hints.speculative_prefill")
		default:
			err = p.skipValue(3)
		}
		if err != nil {
			return err
		}
	}
}

// ---- messages ----

// idxParam builds "base[i].field" (only on the error path).
func idxParam(base string, i int, field string) string {
	s := base + "[" + strconv.Itoa(i) + "]"
	if field != "" {
		s += "." + field
	}
	return s
}

// messages parses the chat messages array (param "messages").
func (p *Parser) messages(param string) error {
	r := p.req
	r.Messages, r.Parts = r.Messages[:0], r.Parts[:0]
	c, err := p.peek()
	if err != nil {
		return err
	}
	if c != '[' {
		p.fail(param, param+" must be a non-empty array", CodeInvalidType)
		return p.skipValue(1)
	}
	p.i++
	first := true
	for idx := 0; ; idx++ {
		ok, err := p.nextElem(&first)
		if err != nil || !ok {
			return err
		}
		if err := p.message(param, idx, false); err != nil {
			return err
		}
	}
}

var roleUser = []byte("user")

// responsesInput parses the Responses API input: a string (one user message) or an array of
// input items.
func (p *Parser) responsesInput() error {
	r := p.req
	r.Messages, r.Parts = r.Messages[:0], r.Parts[:0]
	c, err := p.peek()
	if err != nil {
		return err
	}
	switch c {
	case '"':
		var text []byte
		if err := p.str(&text, "input"); err != nil || p.failed() {
			return err
		}
		r.Messages = append(r.Messages, Message{Role: roleUser[:4:4], Content: text, HasContent: true})
		return nil
	case '[':
		p.i++
		first := true
		for idx := 0; ; idx++ {
			ok, err := p.nextElem(&first)
			if err != nil || !ok {
				return err
			}
			if err := p.message("input", idx, true); err != nil {
				return err
			}
		}
	}
	p.fail("input", "input must be a string or an array of input items", CodeInvalidType)
	return p.skipValue(1)
}

// message parses messages[idx] (or a Responses input item when resp is set).
func (p *Parser) message(base string, idx int, resp bool) error {
	c, err := p.peek()
	if err != nil {
		return err
	}
	if c != '{' {
		if !p.failed() {
			p.fail(idxParam(base, idx, ""), idxParam(base, idx, "")+" must be an object", CodeInvalidType)
		}
		return p.skipValue(2)
	}
	p.i++
	r := p.req
	r.Messages = append(r.Messages, Message{})
	mi := len(r.Messages) - 1
	var reasoning, reasoningContent []byte
	first := true
	for {
		key, ok, err := p.nextKey(&first)
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		m := &r.Messages[mi]
		switch string(key) {
		case "role":
			err = p.msgStr(&m.Role, base, idx, "role")
		case "content":
			err = p.content(m, base, idx, "content")
		case "name":
			err = p.msgStr(&m.Name, base, idx, "name")
		case "tool_call_id":
			err = p.msgStr(&m.ToolCallID, base, idx, "tool_call_id")
		case "tool_calls":
			err = p.raw(&m.ToolCalls)
		case "reasoning_content":
			err = p.msgStr(&reasoningContent, base, idx, "reasoning_content")
		case "reasoning":
			if resp {
				err = p.skipValue(3)
			} else {
				err = p.msgStr(&reasoning, base, idx, "reasoning")
			}
		default:
			if !resp {
				err = p.skipValue(3)
				break
			}
			switch string(key) {
			case "type":
				err = p.msgStr(&m.Type, base, idx, "type")
			case "call_id":
				err = p.msgStr(&m.ToolCallID, base, idx, "call_id")
			case "arguments":
				m.HasContent = true
				err = p.msgStr(&m.Content, base, idx, "arguments")
			case "output":
				err = p.content(m, base, idx, "output")
			default:
				err = p.skipValue(3)
			}
		}
		if err != nil {
			return err
		}
	}
	m := &r.Messages[mi]
	m.Reasoning = reasoningContent
	if m.Reasoning == nil {
		m.Reasoning = reasoning
	}
	if m.Role == nil && !resp && !p.failed() {
		p.fail(idxParam(base, idx, "role"), idxParam(base, idx, "role")+" is required", CodeMissingParameter)
	}
	return nil
}

func (p *Parser) msgStr(dst *[]byte, base string, idx int, field string) error {
	c, err := p.peek()
	if err != nil {
		return err
	}
	if c == '"' {
		if err := p.scanStr(); err != nil {
			return err
		}
		if p.s.lone {
			*dst = nil
			if !p.failed() {
				param := idxParam(base, idx, field)
				p.fail(param, param+" contains an unpaired UTF-16 surrogate", CodeInvalidValue)
			}
			return nil
		}
		*dst = p.text(&p.s)
		return nil
	}
	if c == 'n' && literal(p.b, p.i) == 4 {
		p.i += 4
		*dst = nil
		return nil
	}
	if !p.failed() {
		param := idxParam(base, idx, field)
		p.fail(param, param+" must be a string", CodeInvalidType)
	}
	return p.skipValue(3)
}

// textPartKey returns the key that holds a text part's text, or "" for non-text parts.
func textPartKey(typ []byte) string {
	switch string(typ) {
	case "text", "input_text", "output_text", "summary_text", "reasoning_text":
		return "text"
	case "refusal":
		return "refusal"
	}
	return ""
}

// content parses a message's content (string, null or array of parts) into m.
func (p *Parser) content(m *Message, base string, idx int, field string) error {
	r := p.req
	m.Content, m.HasContent, m.TextParts = nil, false, 0
	// A repeated content key replaces the parts the earlier one recorded.
	for len(r.Parts) > 0 && r.Parts[len(r.Parts)-1].Message == len(r.Messages)-1 {
		r.Parts = r.Parts[:len(r.Parts)-1]
	}
	m.Parts = 0
	c, err := p.peek()
	if err != nil {
		return err
	}
	switch c {
	case '"':
		m.HasContent = true
		return p.msgStr(&m.Content, base, idx, field)
	case 'n':
		if literal(p.b, p.i) == 4 {
			p.i += 4
			return nil
		}
	case '[':
		m.HasContent = true
		return p.parts(m, base, idx, field)
	}
	if !p.failed() {
		param := idxParam(base, idx, field)
		p.fail(param, param+" must be a string, an array of content parts, or null", CodeInvalidType)
	}
	return p.skipValue(3)
}

func (p *Parser) parts(m *Message, base string, idx int, field string) error {
	r := p.req
	mi := len(r.Messages) - 1
	p.i++ // '['
	p.spans = p.spans[:0]
	first := true
	for j := 0; ; j++ {
		ok, err := p.nextElem(&first)
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		c, _ := p.peek()
		switch c {
		case '"':
			if err := p.scanStr(); err != nil {
				return err
			}
			p.spans = append(p.spans, p.s)
			continue
		case '{':
		default:
			if !p.failed() {
				param := idxParam(base, idx, field) + "[" + strconv.Itoa(j) + "]"
				p.fail(param, param+" must be an object", CodeInvalidType)
			}
			if err := p.skipValue(4); err != nil {
				return err
			}
			continue
		}
		start := p.i
		p.i++
		var typ []byte
		var txt, ref strScan
		hasTyp, hasTxt, hasRef, badTxt := false, false, false, false
		pf := true
		for {
			key, ok, err := p.nextKey(&pf)
			if err != nil {
				return err
			}
			if !ok {
				break
			}
			switch string(key) {
			case "type":
				c, _ := p.peek()
				if c == '"' {
					if err := p.scanStr(); err != nil {
						return err
					}
					typ, hasTyp = p.text(&p.s), true
					continue
				}
			case "text", "refusal":
				isText := string(key) == "text"
				c, _ := p.peek()
				if c == '"' {
					if err := p.scanStr(); err != nil {
						return err
					}
					if isText {
						txt, hasTxt, badTxt = p.s, true, false
					} else {
						ref, hasRef = p.s, true
					}
					continue
				}
				if isText {
					hasTxt, badTxt = false, true
				}
			}
			if err := p.skipValue(5); err != nil {
				return err
			}
		}
		k := "text"
		if hasTyp {
			k = textPartKey(typ)
		} else if !hasTxt && !badTxt {
			k = ""
		}
		switch {
		case k == "text" && hasTxt:
			p.spans = append(p.spans, txt)
		case k == "refusal" && hasRef:
			p.spans = append(p.spans, ref)
		case k != "":
			if !p.failed() {
				param := idxParam(base, idx, field) + "[" + strconv.Itoa(j) + "]." + k
				p.fail(param, param+" must be a string", CodeInvalidType)
			}
		default:
			raw := p.b[start:p.i:p.i]
			r.Parts = append(r.Parts, Part{Message: mi, Index: j, Type: typ, Raw: raw})
			m.Parts++
		}
	}
	m.TextParts = len(p.spans)
	for k := range p.spans {
		if p.spans[k].lone {
			if !p.failed() {
				param := idxParam(base, idx, field)
				p.fail(param, param+" contains an unpaired UTF-16 surrogate", CodeInvalidValue)
			}
			return nil
		}
	}
	switch len(p.spans) {
	case 0:
	case 1:
		m.Content = p.text(&p.spans[0])
	default:
		n := len(r.buf)
		for k := range p.spans {
			s := &p.spans[k]
			if k > 0 {
				r.buf = append(r.buf, '\n')
			}
			if s.esc {
				r.buf = appendUnescaped(r.buf, p.b[s.start:s.end])
			} else {
				r.buf = append(r.buf, p.b[s.start:s.end]...)
			}
		}
		m.Content = r.buf[n:len(r.buf):len(r.buf)]
	}
	return nil
}

// ---- prompts ----

// prompt parses a completions prompt or an embeddings input: a string, an array of strings,
// an array of token ids, or an array of arrays of token ids.
func (p *Parser) prompt(param string) error {
	r := p.req
	r.Prompt, r.PromptTokens, r.PromptIsTokens, r.NumPrompts = nil, r.PromptTokens[:0], false, 0
	p.extraText = 0
	c, err := p.peek()
	if err != nil {
		return err
	}
	switch c {
	case '"':
		var text []byte
		if err := p.str(&text, param); err != nil || p.failed() {
			return err
		}
		r.Prompt, r.NumPrompts = text, 1
		return nil
	case 'n':
		if literal(p.b, p.i) == 4 {
			p.i += 4
			return nil
		}
	case '[':
		return p.promptArray(param)
	}
	p.fail(param, param+" must be a string, an array of strings, an array of token ids or an array of arrays of token ids", CodeInvalidType)
	return p.skipValue(1)
}

const (
	promptUnknown = iota
	promptIDs
	promptStrings
	promptLists
)

func (p *Parser) promptArray(param string) error {
	r := p.req
	p.i++
	mode := promptUnknown
	first := true
	n := 0
	for ; ; n++ {
		ok, err := p.nextElem(&first)
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		c, _ := p.peek()
		var m int
		switch {
		case c == '"':
			m = promptStrings
		case c == '[':
			m = promptLists
		default:
			m = promptIDs
		}
		if mode == promptUnknown {
			mode = m
		}
		if m != mode || p.failed() {
			p.fail(param, param+" must be a string, an array of strings, an array of token ids or an array of arrays of token ids", CodeInvalidType)
			if err := p.skipValue(2); err != nil {
				return err
			}
			continue
		}
		switch mode {
		case promptIDs:
			if err := p.tokenID(param); err != nil {
				return err
			}
			p.moreIDs()
		case promptStrings:
			if n == 0 {
				var text []byte
				if err := p.str(&text, param); err != nil {
					return err
				}
				r.Prompt = text
			} else {
				if err := p.scanStr(); err != nil {
					return err
				}
				p.extraText += p.s.end - p.s.start
			}
		case promptLists:
			p.i++
			f := true
			for {
				ok, err := p.nextElem(&f)
				if err != nil {
					return err
				}
				if !ok {
					break
				}
				if n == 0 {
					if err = p.tokenID(param); err == nil {
						p.moreIDs()
					}
				} else {
					p.extraText += 4
					err = p.skipValue(3)
				}
				if err != nil {
					return err
				}
			}
		}
	}
	if n == 0 {
		p.fail(param, param+" must not be empty", CodeEmptyArray)
		return nil
	}
	if mode == promptIDs {
		n = 1
	}
	r.NumPrompts = n
	r.PromptIsTokens = mode != promptStrings
	return nil
}

// plainID parses a token id written as plain decimal digits (no leading zero, below 10^9)
// and followed by a delimiter at b[i:]; end < 0 means it is not one.
func plainID(b []byte, i int) (v int32, end int) {
	j := i
	for j < len(b) && j-i < 10 && b[j] >= '0' && b[j] <= '9' {
		v = v*10 + int32(b[j]-'0')
		j++
	}
	if j == i || j-i == 10 || j == len(b) || b[i] == '0' && j > i+1 {
		return 0, -1
	}
	if c := b[j]; c != ',' && c != ']' && !isWS(c) {
		return 0, -1
	}
	return v, j
}

// moreIDs takes the ", id" pairs that follow a token id in a tight loop (token lists are
// long), stopping before anything the general path must look at.
func (p *Parser) moreIDs() {
	b := p.b
	for !p.failed() && p.i < len(b) && b[p.i] == ',' {
		j := p.i + 1
		for j < len(b) && isWS(b[j]) {
			j++
		}
		v, end := plainID(b, j)
		if end < 0 {
			return
		}
		p.req.PromptTokens = append(p.req.PromptTokens, v)
		p.i = end
	}
}

// tokenID appends one token id of the first prompt.
func (p *Parser) tokenID(param string) error {
	if v, end := plainID(p.b, p.i); end >= 0 {
		p.i = end
		p.req.PromptTokens = append(p.req.PromptTokens, v)
		return nil
	}
	i64, _, k, err := p.number(param)
	if err != nil {
		return err
	}
	if k != numInt || i64 < 0 || i64 > math.MaxInt32 {
		if k != numBad {
			p.fail(param, param+" token ids must be integers between 0 and 2147483647", CodeInvalidValue)
		}
		return nil
	}
	p.req.PromptTokens = append(p.req.PromptTokens, int32(i64))
	return nil
}

// maxTokensFloor is the least output cap an engine accepts for kind: one token for chat and
// text completions (vLLM's SamplingParams), 0 for the routes kvrelay passes through.
func maxTokensFloor(kind Kind) int {
	if kind == ChatCompletions || kind == Completions {
		return 1
	}
	return 0
}
