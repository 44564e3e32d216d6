package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"time"

	"github.com/ardanlabs/jinja"
)

// Jinja engine choice. HuggingFace chat templates are rendered with github.com/ardanlabs/jinja
// (v1.8.0; later releases need a newer Go). Both candidates were run over the real Qwen3,
// gpt-oss and Llama 3 templates against @huggingface/jinja's output (testdata/chat):
//
//   - ardanlabs/jinja rendered every case byte-identically. It is built for chat templates:
//     ordered dicts (tool schemas keep their key order), Python-style tojson (", " and ": "),
//     namespace(), loop.*, macros, string methods (strip, split, startswith, …), is-tests such
//     as "is iterable/mapping/string", raise_exception. Compiled templates are safe for
//     concurrent rendering, and it has no dependencies.
//   - nikolalohinski/gonja/v2 (v2.9.1) rendered the plain conversations but not the tool ones:
//     Go maps lose JSON key order and its tojson formats differently; it also pulls in logrus,
//     json-iterator and x/exp.
//
// Writing a focused interpreter was not needed.

// jinjaTemplate renders a HuggingFace chat_template.
type jinjaTemplate struct {
	name     string
	tmpl     *jinja.Template
	specials map[string]jinja.Value
}

// NewJinjaTemplate compiles a HuggingFace chat template. specials are the tokenizer's named
// special tokens (bos_token, eos_token, …) that templates may print.
func NewJinjaTemplate(name, src string, specials map[string]string) (Template, error) {
	t, err := jinja.Compile(src)
	if err != nil {
		return nil, fmt.Errorf("compiling chat template %s: %w", name, err)
	}
	jt := &jinjaTemplate{name: name, tmpl: t, specials: map[string]jinja.Value{}}
	for k, v := range specials {
		jt.specials[k] = jinja.NewString(v)
	}
	return jt, nil
}

func (t *jinjaTemplate) Name() string { return t.name }

// Render renders msgs with the context a serving engine gives HuggingFace templates: messages,
// tools, add_generation_prompt, the special tokens, strftime_now, and the harmony and Qwen3
// kwargs that opts sets (reasoning_effort, model_identity, builtin_tools, enable_thinking).
func (t *jinjaTemplate) Render(msgs []Message, opts RenderOptions) (out string, err error) {
	defer func() {
		if r := recover(); r != nil { // the engine is third-party code; never take the proxy down
			err = fmt.Errorf("rendering chat template %s: panic: %v", t.name, r)
		}
	}()
	data := make(map[string]jinja.Value, 16)
	for k, v := range t.specials {
		data[k] = v
	}
	data["messages"] = messagesValue(msgs)
	data["add_generation_prompt"] = jinja.NewBool(opts.AddGenerationPrompt)
	if !isNull(opts.Tools) {
		tools, err := jsonValue(opts.Tools)
		if err != nil {
			return "", fmt.Errorf("rendering chat template %s: decoding tools: %w", t.name, err)
		}
		data["tools"] = tools
	}
	date := opts.date()
	data["strftime_now"] = jinja.NewCallable("strftime_now", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
		return jinja.NewString(strftime(date, args)), nil
	})
	if opts.ReasoningEffort != "" {
		data["reasoning_effort"] = jinja.NewString(opts.ReasoningEffort)
	}
	if opts.ModelIdentity != "" {
		data["model_identity"] = jinja.NewString(opts.ModelIdentity)
	}
	if len(opts.BuiltinTools) > 0 {
		items := make([]jinja.Value, len(opts.BuiltinTools))
		for i, s := range opts.BuiltinTools {
			items[i] = jinja.NewString(s)
		}
		data["builtin_tools"] = jinja.NewList(items)
	}
	if opts.EnableThinking != nil {
		data["enable_thinking"] = jinja.NewBool(*opts.EnableThinking)
	}
	keys := make([]string, 0, len(opts.Kwargs))
	for k := range opts.Kwargs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		data[k] = goValue(opts.Kwargs[k])
	}
	out, err = t.tmpl.RenderValues(data)
	if err != nil {
		return "", fmt.Errorf("rendering chat template %s: %w", t.name, err)
	}
	return out, nil
}

// strftime formats date (YYYY-MM-DD) with a Python strftime format, for the directives chat
// templates use (%Y %y %m %d %e %b %B %a %A %H %M %S %%); the time of day is midnight.
func strftime(date string, args []jinja.Value) string {
	d, err := time.Parse("2006-01-02", date)
	if len(args) == 0 || !args[0].IsString() || err != nil {
		return date
	}
	f := args[0].AsString()
	var b []byte
	for i := 0; i < len(f); i++ {
		if f[i] != '%' || i+1 == len(f) {
			b = append(b, f[i])
			continue
		}
		i++
		switch f[i] {
		case 'Y':
			b = d.AppendFormat(b, "2006")
		case 'y':
			b = d.AppendFormat(b, "06")
		case 'm':
			b = d.AppendFormat(b, "01")
		case 'd':
			b = d.AppendFormat(b, "02")
		case 'e':
			b = d.AppendFormat(b, "_2")
		case 'b':
			b = d.AppendFormat(b, "Jan")
		case 'B':
			b = d.AppendFormat(b, "January")
		case 'a':
			b = d.AppendFormat(b, "Mon")
		case 'A':
			b = d.AppendFormat(b, "Monday")
		case 'H':
			b = d.AppendFormat(b, "15")
		case 'M':
			b = d.AppendFormat(b, "04")
		case 'S':
			b = d.AppendFormat(b, "05")
		case '%':
			b = append(b, '%')
		default:
			b = append(b, '%', f[i])
		}
	}
	return string(b)
}

// messagesValue converts messages to the dicts templates read. Keys come in the order an OpenAI
// request carries them; optional fields are present only when set, so "x in message" and
// "message.x is defined" behave as with vLLM.
func messagesValue(msgs []Message) jinja.Value {
	items := make([]jinja.Value, len(msgs))
	for i := range msgs {
		items[i] = messageValue(&msgs[i])
	}
	return jinja.NewList(items)
}

func messageValue(m *Message) jinja.Value {
	v := jinja.NewDict()
	d := v.AsDict()
	d.Set("role", jinja.NewString(m.Role))
	d.Set("content", jinja.NewString(m.Content))
	if m.Reasoning != "" {
		d.Set("reasoning_content", jinja.NewString(m.Reasoning))
		d.Set("thinking", jinja.NewString(m.Reasoning))
	}
	if len(m.ToolCalls) > 0 {
		calls := make([]jinja.Value, len(m.ToolCalls))
		for i, tc := range m.ToolCalls {
			c := jinja.NewDict()
			cd := c.AsDict()
			if tc.ID != "" {
				cd.Set("id", jinja.NewString(tc.ID))
			}
			typ := tc.Type
			if typ == "" {
				typ = "function"
			}
			cd.Set("type", jinja.NewString(typ))
			f := jinja.NewDict()
			f.AsDict().Set("name", jinja.NewString(tc.Function.Name))
			f.AsDict().Set("arguments", argumentsValue(tc.Function.Arguments))
			cd.Set("function", f)
			calls[i] = c
		}
		d.Set("tool_calls", jinja.NewList(calls))
	}
	if m.ToolCallID != "" {
		d.Set("tool_call_id", jinja.NewString(m.ToolCallID))
	}
	if m.Name != "" {
		d.Set("name", jinja.NewString(m.Name))
	}
	return v
}

// argumentsValue decodes tool-call arguments into an object, as vLLM does before rendering;
// arguments that are not a JSON object stay a string.
func argumentsValue(args string) jinja.Value {
	if v, err := jsonValue([]byte(args)); err == nil && v.IsDict() {
		return v
	}
	return jinja.NewString(args)
}

// jsonValue decodes JSON into template values, keeping object key order.
func jsonValue(data []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	v, err := decodeValue(dec, 0)
	if err != nil {
		return jinja.Undefined(), err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return jinja.Undefined(), errors.New("trailing data after JSON value")
	}
	return v, nil
}

const maxJSONDepth = 64

func decodeValue(dec *json.Decoder, depth int) (jinja.Value, error) {
	if depth > maxJSONDepth {
		return jinja.Undefined(), errors.New("JSON nested too deeply")
	}
	tok, err := dec.Token()
	if err != nil {
		return jinja.Undefined(), err
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			out := jinja.NewDict()
			for dec.More() {
				k, err := dec.Token()
				if err != nil {
					return jinja.Undefined(), err
				}
				key, _ := k.(string)
				val, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Undefined(), err
				}
				out.AsDict().Set(key, val)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Undefined(), err
			}
			return out, nil
		case '[':
			var items []jinja.Value
			for dec.More() {
				val, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Undefined(), err
				}
				items = append(items, val)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Undefined(), err
			}
			return jinja.NewList(items), nil
		}
	case string:
		return jinja.NewString(v), nil
	case json.Number:
		return jinja.FromGoValue(v), nil
	case bool:
		return jinja.NewBool(v), nil
	case nil:
		return jinja.None(), nil
	}
	return jinja.Undefined(), fmt.Errorf("unexpected JSON token %v", tok)
}

// goValue converts a decoded Go value (from encoding/json or literal Go) to a template value.
func goValue(v any) jinja.Value {
	if raw, ok := v.(json.RawMessage); ok {
		if jv, err := jsonValue(raw); err == nil {
			return jv
		}
		return jinja.Undefined()
	}
	return jinja.FromGoValue(v)
}

// toJSON renders v with the template engine's tojson filter (Python json.dumps formatting).
var toJSONTemplate = func() *jinja.Template {
	t, err := jinja.Compile("{{ v|tojson }}")
	if err != nil {
		panic(err)
	}
	return t
}()

func toJSON(v jinja.Value) (string, error) {
	return toJSONTemplate.RenderValues(map[string]jinja.Value{"v": v})
}

var _ Template = (*jinjaTemplate)(nil)
