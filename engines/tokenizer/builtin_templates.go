package tokenizer

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/ardanlabs/jinja"
)

// The built-in templates are Go ports of real chat templates, used on the proxy's hot path
// instead of the Jinja engine. Each is tested against the original template's output for the
// conversations in testdata/chat.

// harmonyTemplate renders the harmony format of gpt-oss, as the gpt-oss chat_template.jinja
// does: a system message (model identity, knowledge cutoff, current date, reasoning effort,
// built-in tools, channels), a developer message (instructions from the first system or developer
// message, and function tools as a TypeScript namespace), then the turns.
type harmonyTemplate struct{}

func (harmonyTemplate) Name() string { return TemplateHarmony }

// ErrTemplate marks messages a template refuses (as the original raises an exception).
var ErrTemplate = errors.New("chat template rejected the conversation")

func (harmonyTemplate) AppendRender(dst []byte, msgs []Message, opts RenderOptions) ([]byte, error) {
	b := textBuilder{buf: dst}
	b.Grow(512 + 64*len(msgs))
	b.WriteString("<|start|>system<|message|>")
	identity := opts.ModelIdentity
	if identity == "" {
		identity = "You are ChatGPT, a large language model trained by OpenAI."
	}
	b.WriteString(identity)
	b.WriteString("\nKnowledge cutoff: 2024-06\nCurrent date: ")
	b.WriteString(opts.date())
	effort := opts.ReasoningEffort
	if effort == "" {
		effort = "medium"
	}
	b.WriteString("\n\nReasoning: ")
	b.WriteString(effort)
	b.WriteString("\n\n")
	if len(opts.BuiltinTools) > 0 {
		b.WriteString("# Tools\n\n")
		var browser, python bool
		for _, t := range opts.BuiltinTools {
			browser = browser || t == "browser"
			python = python || t == "python"
		}
		writeHarmonyBuiltinTools(&b, browser, python)
	}
	b.WriteString("# Valid channels: analysis, commentary, final. Channel must be included for every message.\n")
	b.WriteString("Calls to these tools must go to the commentary channel: 'functions'.<|end|>")

	loop := msgs
	developer := ""
	if len(msgs) > 0 && (msgs[0].Role == "developer" || msgs[0].Role == "system") {
		developer = msgs[0].Content
		loop = msgs[1:]
	}
	tools, err := toolsValue(opts)
	if err != nil {
		return dst, err
	}
	hasTools := tools.IsList() && tools.AsList().Len() > 0
	if developer != "" || hasTools {
		b.WriteString("<|start|>developer<|message|>")
		if developer != "" {
			b.WriteString("# Instructions\n\n")
			b.WriteString(developer)
		}
		if hasTools {
			b.WriteString("\n\n# Tools\n\n")
			if err := writeHarmonyNamespace(&b, "functions", tools.AsList().Items); err != nil {
				return dst, err
			}
		}
		b.WriteString("<|end|>")
	}

	lastCall := ""
	for i := range loop {
		m := &loop[i]
		switch m.Role {
		case "assistant":
			for _, s := range []string{m.Content, m.Reasoning} {
				if strings.Contains(s, "<|channel|>analysis<|message|>") || strings.Contains(s, "<|channel|>final<|message|>") {
					return dst, fmt.Errorf("rendering harmony: %w: assistant message holds <|channel|> tags; pass analysis as reasoning and the final answer as content", ErrTemplate)
				}
			}
			switch {
			case len(m.ToolCalls) > 0:
				tc := m.ToolCalls[0]
				switch {
				case m.Content != "" && m.Reasoning != "":
					return dst, fmt.Errorf("rendering harmony: %w: assistant tool-call message has both content and reasoning", ErrTemplate)
				case m.Content != "":
					writeAll(&b, "<|start|>assistant<|channel|>analysis<|message|>", m.Content, "<|end|>")
				case m.Reasoning != "":
					writeAll(&b, "<|start|>assistant<|channel|>analysis<|message|>", m.Reasoning, "<|end|>")
				}
				args, err := toJSON(argumentsValue(tc.Function.Arguments))
				if err != nil {
					return dst, fmt.Errorf("rendering harmony: encoding tool-call arguments: %w", err)
				}
				writeAll(&b, "<|start|>assistant to=functions.", tc.Function.Name, "<|channel|>commentary json<|message|>", args, "<|end|>")
				lastCall = tc.Function.Name
			case i == len(loop)-1 && !opts.AddGenerationPrompt:
				if m.Reasoning != "" {
					writeAll(&b, "<|start|>assistant<|channel|>analysis<|message|>", m.Reasoning, "<|end|>")
				}
				writeAll(&b, "<|start|>assistant<|channel|>final<|message|>", m.Content, "<|return|>")
			default:
				writeAll(&b, "<|start|>assistant<|channel|>final<|message|>", m.Content, "<|end|>")
				lastCall = ""
			}
		case "tool":
			if lastCall == "" {
				return dst, fmt.Errorf("rendering harmony: %w: tool message without a preceding assistant tool call", ErrTemplate)
			}
			content, err := toJSON(jinja.NewString(m.Content))
			if err != nil {
				return dst, fmt.Errorf("rendering harmony: encoding tool output: %w", err)
			}
			writeAll(&b, "<|start|>functions.", lastCall, " to=assistant<|channel|>commentary<|message|>", content, "<|end|>")
		case "user":
			writeAll(&b, "<|start|>user<|message|>", m.Content, "<|end|>")
		}
	}
	if opts.AddGenerationPrompt {
		b.WriteString("<|start|>assistant")
	}
	return b.buf, nil
}

func writeAll(b *textBuilder, parts ...string) {
	for _, p := range parts {
		b.WriteString(p)
	}
}

func toolsValue(opts RenderOptions) (jinja.Value, error) {
	if isNull(opts.Tools) {
		return jinja.None(), nil
	}
	v, err := jsonValue(opts.Tools)
	if err != nil {
		return jinja.None(), fmt.Errorf("rendering chat template: decoding tools: %w", err)
	}
	return v, nil
}

// get returns d[key] for a dict value, or Undefined.
func get(v jinja.Value, key string) jinja.Value {
	if !v.IsDict() {
		return jinja.Undefined()
	}
	if x, ok := v.AsDict().Get(key); ok {
		return x
	}
	return jinja.Undefined()
}

// str renders a value the way string concatenation in a template would.
func str(v jinja.Value) string {
	switch {
	case v.IsUndefined() || v.IsNone():
		return ""
	case v.IsString():
		return v.AsString()
	}
	return v.String()
}

func inList(list jinja.Value, s string) bool {
	if !list.IsList() {
		return false
	}
	for _, it := range list.AsList().Items {
		if it.IsString() && it.AsString() == s {
			return true
		}
	}
	return false
}

// writeHarmonyNamespace renders function tools as the TypeScript-like namespace gpt-oss reads.
func writeHarmonyNamespace(b *textBuilder, ns string, tools []jinja.Value) error {
	writeAll(b, "## ", ns, "\n\nnamespace ", ns, " {\n\n")
	for _, tool := range tools {
		fn := get(tool, "function")
		writeAll(b, "// ", str(get(fn, "description")), "\n", "type ", str(get(fn, "name")), " = (")
		params := get(fn, "parameters")
		props := get(params, "properties")
		if props.IsTruthy() && props.IsDict() {
			b.WriteString("_: {\n")
			required := get(params, "required")
			d := props.AsDict()
			for i, name := range d.Keys {
				spec := d.Data[name]
				writeAll(b, "// ", str(get(spec, "description")), "\n", name)
				if !inList(required, name) {
					b.WriteString("?")
				}
				b.WriteString(": ")
				t, err := typescriptType(spec)
				if err != nil {
					return err
				}
				b.WriteString(t)
				if def := get(spec, "default"); !def.IsUndefined() {
					if get(spec, "oneOf").IsTruthy() {
						writeAll(b, "// default: ", str(def))
					} else {
						j, err := toJSON(def)
						if err != nil {
							return fmt.Errorf("rendering harmony: encoding default of %s: %w", name, err)
						}
						writeAll(b, ", // default: ", j)
					}
				}
				if i < len(d.Keys)-1 {
					b.WriteString(",\n")
				}
			}
			b.WriteString(",\n}) => any;\n")
		} else {
			b.WriteString("\n}) => any;\n")
		}
	}
	writeAll(b, "\n} // namespace ", ns)
	return nil
}

// typescriptType ports the template's render_typescript_type macro.
func typescriptType(spec jinja.Value) (string, error) {
	typ := get(spec, "type")
	nullable := get(spec, "nullable").IsTruthy()
	switch {
	case typ.IsString() && typ.AsString() == "array":
		items := get(spec, "items")
		var s string
		if items.IsTruthy() {
			switch str(get(items, "type")) {
			case "string":
				s = "string[]"
			case "number", "integer":
				s = "number[]"
			case "boolean":
				s = "boolean[]"
			default:
				inner, err := typescriptType(items)
				if err != nil {
					return "", err
				}
				if inner == "object | object" || len([]rune(inner)) > 50 {
					s = "any[]"
				} else {
					s = inner + "[]"
				}
			}
		} else {
			s = "any[]"
		}
		if nullable {
			s += " | null"
		}
		return s, nil
	case typ.IsList() && typ.AsList().Len() > 0:
		parts := make([]string, 0, typ.AsList().Len())
		for _, it := range typ.AsList().Items {
			parts = append(parts, str(it))
		}
		return strings.Join(parts, " | "), nil
	case get(spec, "oneOf").IsTruthy():
		// The Jinja macro walks the variants; the built-in leaves such unions to the Jinja
		// engine (load the model's chat_template.jinja) rather than guess its whitespace.
		return "", fmt.Errorf("rendering harmony: %w: oneOf parameter schemas", ErrUnsupported)
	case typ.IsString() && typ.AsString() == "string":
		if enum := get(spec, "enum"); enum.IsTruthy() && enum.IsList() {
			parts := make([]string, 0, enum.AsList().Len())
			for _, it := range enum.AsList().Items {
				parts = append(parts, str(it))
			}
			return `"` + strings.Join(parts, `" | "`) + `"`, nil
		}
		if nullable {
			return "string | null", nil
		}
		return "string", nil
	case typ.IsString() && (typ.AsString() == "number" || typ.AsString() == "integer"):
		return "number", nil
	case typ.IsString() && typ.AsString() == "boolean":
		return "boolean", nil
	case typ.IsString() && typ.AsString() == "object":
		props := get(spec, "properties")
		if !props.IsTruthy() || !props.IsDict() {
			return "object", nil
		}
		var b strings.Builder
		b.WriteString("{\n")
		required := get(spec, "required")
		d := props.AsDict()
		for i, name := range d.Keys {
			b.WriteString(name)
			if !inList(required, name) {
				b.WriteString("?")
			}
			// The macro prints the nested type with a plain {{ }} after a newline and
			// indentation that the template keeps.
			b.WriteString(": \n                ")
			inner, err := typescriptType(d.Data[name])
			if err != nil {
				return "", err
			}
			b.WriteString(inner)
			if i < len(d.Keys)-1 {
				b.WriteString(", ")
			}
		}
		b.WriteString("}")
		return b.String(), nil
	}
	return "any", nil
}

func writeHarmonyBuiltinTools(b *textBuilder, browser, python bool) {
	if browser {
		b.WriteString("## browser\n\n" +
			"// Tool for browsing.\n" +
			"// The `cursor` appears in brackets before each browsing display: `[{cursor}]`.\n" +
			"// Cite information from the tool using the following format:\n" +
			"// `【{cursor}†L{line_start}(-L{line_end})?】`, for example: `【6†L9-L11】` or `【8†L3】`.\n" +
			"// Do not quote more than 10 words directly from the tool output.\n" +
			"// sources=web (default: web)\n" +
			"namespace browser {\n\n" +
			"// Searches for information related to `query` and displays `topn` results.\n" +
			"type search = (_: {\n" +
			"query: string,\n" +
			"topn?: number, // default: 10\n" +
			"source?: string,\n" +
			"}) => any;\n\n" +
			"// Opens the link `id` from the page indicated by `cursor` starting at line number `loc`, showing `num_lines` lines.\n" +
			"// Valid link ids are displayed with the formatting: `【{id}†.*】`.\n" +
			"// If `cursor` is not provided, the most recent page is implied.\n" +
			"// If `id` is a string, it is treated as a fully qualified URL associated with `source`.\n" +
			"// If `loc` is not provided, the viewport will be positioned at the beginning of the document or centered on the most relevant passage, if available.\n" +
			"// Use this function without `id` to scroll to a new location of an opened page.\n" +
			"type open = (_: {\n" +
			"id?: number | string, // default: -1\n" +
			"cursor?: number, // default: -1\n" +
			"loc?: number, // default: -1\n" +
			"num_lines?: number, // default: -1\n" +
			"view_source?: boolean, // default: false\n" +
			"source?: string,\n" +
			"}) => any;\n\n" +
			"// Finds exact matches of `pattern` in the current page, or the page given by `cursor`.\n" +
			"type find = (_: {\n" +
			"pattern: string,\n" +
			"cursor?: number, // default: -1\n" +
			"}) => any;\n\n" +
			"} // namespace browser\n\n")
	}
	if python {
		b.WriteString("## python\n\n" +
			"Use this tool to execute Python code in your chain of thought. The code will not be shown to the user. This tool should be used for internal reasoning, but not for code that is intended to be visible to the user (e.g. when creating plots, tables, or files).\n\n" +
			"When you send a message containing Python code to python, it will be executed in a stateful Jupyter notebook environment. python will respond with the output of the execution or time out after 120.0 seconds. The drive at '/mnt/data' can be used to save and persist user files. Internet access for this session is UNKNOWN. Depends on the cluster.\n\n")
	}
}

// chatMLTemplate renders ChatML the way Qwen3's chat template does: <|im_start|>role\n…<|im_end|>
// turns, tools in the system turn as JSON lines, <tool_call>/<tool_response> blocks, reasoning
// in <think> for turns after the last user query, and enable_thinking=false.
type chatMLTemplate struct{}

func (chatMLTemplate) Name() string { return TemplateChatML }

func (chatMLTemplate) AppendRender(dst []byte, msgs []Message, opts RenderOptions) ([]byte, error) {
	b := textBuilder{buf: dst}
	b.Grow(256 + 64*len(msgs))
	tools, err := toolsValue(opts)
	if err != nil {
		return dst, err
	}
	firstSystem := len(msgs) > 0 && msgs[0].Role == "system"
	if tools.IsTruthy() && tools.IsList() {
		b.WriteString("<|im_start|>system\n")
		if firstSystem {
			writeAll(&b, msgs[0].Content, "\n\n")
		}
		b.WriteString("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>")
		for _, t := range tools.AsList().Items {
			j, err := toJSON(t)
			if err != nil {
				return dst, fmt.Errorf("rendering chatml: encoding tool: %w", err)
			}
			writeAll(&b, "\n", j)
		}
		b.WriteString("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
	} else if firstSystem {
		writeAll(&b, "<|im_start|>system\n", msgs[0].Content, "<|im_end|>\n")
	}
	lastQuery := len(msgs) - 1
	for i := len(msgs) - 1; i >= 0; i-- {
		c := msgs[i].Content
		if msgs[i].Role == "user" && !(strings.HasPrefix(c, "<tool_response>") && strings.HasSuffix(c, "</tool_response>")) {
			lastQuery = i
			break
		}
	}
	for i := range msgs {
		m := &msgs[i]
		switch {
		case m.Role == "user" || (m.Role == "system" && i > 0):
			writeAll(&b, "<|im_start|>", m.Role, "\n", m.Content, "<|im_end|>\n")
		case m.Role == "assistant":
			content, reasoning := m.Content, m.Reasoning
			if reasoning == "" && strings.Contains(content, "</think>") {
				parts := strings.Split(content, "</think>")
				content = strings.TrimLeft(parts[len(parts)-1], "\n")
				before := strings.Split(strings.TrimRight(parts[0], "\n"), "<think>")
				reasoning = strings.TrimLeft(before[len(before)-1], "\n")
			}
			if i > lastQuery && (i == len(msgs)-1 || reasoning != "") {
				writeAll(&b, "<|im_start|>assistant\n<think>\n", strings.Trim(reasoning, "\n"), "\n</think>\n\n", strings.TrimLeft(content, "\n"))
			} else {
				writeAll(&b, "<|im_start|>assistant\n", content)
			}
			for j, tc := range m.ToolCalls {
				if j > 0 || content != "" {
					b.WriteString("\n")
				}
				writeAll(&b, "<tool_call>\n{\"name\": \"", tc.Function.Name, "\", \"arguments\": ")
				args := argumentsValue(tc.Function.Arguments)
				if args.IsString() {
					b.WriteString(args.AsString())
				} else {
					j, err := toJSON(args)
					if err != nil {
						return dst, fmt.Errorf("rendering chatml: encoding tool-call arguments: %w", err)
					}
					b.WriteString(j)
				}
				b.WriteString("}\n</tool_call>")
			}
			b.WriteString("<|im_end|>\n")
		case m.Role == "tool":
			if i == 0 || msgs[i-1].Role != "tool" {
				b.WriteString("<|im_start|>user")
			}
			writeAll(&b, "\n<tool_response>\n", m.Content, "\n</tool_response>")
			if i == len(msgs)-1 || msgs[i+1].Role != "tool" {
				b.WriteString("<|im_end|>\n")
			}
		}
	}
	if opts.AddGenerationPrompt {
		b.WriteString("<|im_start|>assistant\n")
		if opts.EnableThinking != nil && !*opts.EnableThinking {
			b.WriteString("<think>\n\n</think>\n\n")
		}
	}
	return b.buf, nil
}

// llama3Template renders the Llama 3 Instruct format: <|begin_of_text|>, then
// <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> per message (content trimmed).
type llama3Template struct{ bos string }

func (llama3Template) Name() string { return TemplateLlama3 }

func (t llama3Template) AppendRender(dst []byte, msgs []Message, opts RenderOptions) ([]byte, error) {
	b := textBuilder{buf: dst}
	b.Grow(64 + 64*len(msgs))
	b.WriteString(t.bos)
	for i := range msgs {
		writeAll(&b, "<|start_header_id|>", msgs[i].Role, "<|end_header_id|>\n\n", strings.TrimSpace(msgs[i].Content), "<|eot_id|>")
	}
	if opts.AddGenerationPrompt {
		b.WriteString("<|start_header_id|>assistant<|end_header_id|>\n\n")
	}
	return b.buf, nil
}

func (t harmonyTemplate) Render(msgs []Message, opts RenderOptions) (string, error) {
	b, err := t.AppendRender(nil, msgs, opts)
	return string(b), err
}

func (t chatMLTemplate) Render(msgs []Message, opts RenderOptions) (string, error) {
	b, err := t.AppendRender(nil, msgs, opts)
	return string(b), err
}

func (t llama3Template) Render(msgs []Message, opts RenderOptions) (string, error) {
	b, err := t.AppendRender(nil, msgs, opts)
	return string(b), err
}

// textBuilder is what the built-in templates write into: a strings.Builder over a
// caller-owned byte slice, so AppendRender can reuse the caller's buffer.
type textBuilder struct{ buf []byte }

func (b *textBuilder) WriteString(s string) { b.buf = append(b.buf, s...) }
func (b *textBuilder) Grow(n int)           { b.buf = slices.Grow(b.buf, n) }
func (b *textBuilder) Len() int             { return len(b.buf) }

var (
	_ Template       = harmonyTemplate{}
	_ Template       = chatMLTemplate{}
	_ Template       = llama3Template{}
	_ AppendRenderer = harmonyTemplate{}
	_ AppendRenderer = chatMLTemplate{}
	_ AppendRenderer = llama3Template{}
)
