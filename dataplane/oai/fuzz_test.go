package oai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
)

// runePool mixes what makes JSON strings hard: quotes, backslashes, control characters,
// multi-byte and astral runes, separators some encoders escape, and plain text.
var runePool = []rune{
	'a', 'b', 'z', ' ', '0', '<', '>', '&', '\'', '/', '"', '\\',
	0x00, 0x01, '\b', '\f', '\n', '\r', '\t', 0x1f, 0x7f,
	'é', 'ß', '中', '文', 0x2028, 0x2029, 0xFEFF, 0xFFFD, 0xFFFF,
	'😀', '𝄞', 0x10FFFF,
}

func randText(rng *rand.Rand) string {
	var sb strings.Builder
	for range rng.IntN(24) {
		sb.WriteRune(runePool[rng.IntN(len(runePool))])
	}
	return sb.String()
}

// encodeString writes s as a JSON string, choosing for each rune among the forms Python's
// json.loads accepts: raw, a short escape, or \uXXXX (a surrogate pair past the BMP), in
// either case of hex digit.
func encodeString(rng *rand.Rand, s string) string {
	if rng.IntN(4) == 0 {
		b, _ := json.Marshal(s)
		return string(b)
	}
	var sb strings.Builder
	sb.WriteByte('"')
	hex := "%04x"
	if rng.IntN(2) == 0 {
		hex = "%04X"
	}
	for _, r := range s {
		mustEscape := r < 0x20 || r == '"' || r == '\\'
		switch pick := rng.IntN(3); {
		case !mustEscape && pick == 0:
			sb.WriteRune(r)
		case pick == 1 && strings.ContainsRune("\"\\/\b\f\n\r\t", r):
			sb.WriteByte('\\')
			sb.WriteByte(map[rune]byte{'"': '"', '\\': '\\', '/': '/', '\b': 'b', '\f': 'f', '\n': 'n', '\r': 'r', '\t': 't'}[r])
		case r > 0xFFFF:
			r -= 0x10000
			fmt.Fprintf(&sb, `\u`+hex+`\u`+hex, 0xD800+(r>>10), 0xDC00+(r&0x3FF))
		default:
			fmt.Fprintf(&sb, `\u`+hex, r)
		}
	}
	sb.WriteByte('"')
	return sb.String()
}

func randWS(rng *rand.Rand) string {
	return [...]string{"", "", "", " ", "\n", "\t", "\r\n  "}[rng.IntN(7)]
}

// TestParseMatchesEncodingJSON builds random chat bodies, parses them, and compares the model
// and every message's role and text with the strings they were built from and with what
// encoding/json decodes from the same bytes.
func TestParseMatchesEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var p Parser
	var r Request
	n := 3000
	if testing.Short() || raceEnabled {
		n = 500
	}
	for iter := range n {
		model := "m" + randText(rng)
		type msg struct {
			role  string
			parts []string // nil: content is a string (parts[0] in text)
			text  string
		}
		msgs := make([]msg, 1+rng.IntN(4))
		var b strings.Builder
		ws := func() { b.WriteString(randWS(rng)) }
		b.WriteString("{")
		ws()
		b.WriteString(`"model":`)
		ws()
		b.WriteString(encodeString(rng, model))
		if rng.IntN(2) == 0 {
			b.WriteString(`,"extra":{"k":[` + encodeString(rng, randText(rng)) + `,1.5e-3,null,true]}`)
		}
		b.WriteString(`,"messages":[`)
		for i := range msgs {
			m := &msgs[i]
			m.role = randText(rng)
			if i > 0 {
				b.WriteString(",")
			}
			ws()
			b.WriteString(`{"role":` + encodeString(rng, m.role) + `,`)
			ws()
			b.WriteString(`"content":`)
			ws()
			if rng.IntN(2) == 0 {
				m.text = randText(rng)
				b.WriteString(encodeString(rng, m.text))
			} else {
				b.WriteString("[")
				k := 1 + rng.IntN(3)
				for j := range k {
					part := randText(rng)
					m.parts = append(m.parts, part)
					if j > 0 {
						b.WriteString(",")
					}
					if rng.IntN(2) == 0 {
						b.WriteString(`{"type":"text","text":` + encodeString(rng, part) + `}`)
					} else {
						b.WriteString(`{"text":` + encodeString(rng, part) + `,` + randWS(rng) + `"type":"text"}`)
					}
				}
				b.WriteString("]")
				m.text = strings.Join(m.parts, "\n")
			}
			ws()
			b.WriteString("}")
		}
		b.WriteString("]}")
		body := []byte(b.String())

		if err := p.Parse(body, ChatCompletions, &r); err != nil {
			t.Fatalf("%d: %v\n%s", iter, err, body)
		}
		var std struct {
			Model    string
			Messages []struct {
				Role    string
				Content json.RawMessage
			}
		}
		if err := json.Unmarshal(body, &std); err != nil {
			t.Fatalf("%d: encoding/json: %v\n%s", iter, err, body)
		}
		if string(r.Model) != model || std.Model != model {
			t.Fatalf("%d: model = %q, encoding/json %q, want %q", iter, r.Model, std.Model, model)
		}
		if len(r.Messages) != len(msgs) {
			t.Fatalf("%d: %d messages, want %d", iter, len(r.Messages), len(msgs))
		}
		for i, m := range msgs {
			got := r.Messages[i]
			if string(got.Role) != m.role || std.Messages[i].Role != m.role {
				t.Fatalf("%d/%d: role = %q, encoding/json %q, want %q", iter, i, got.Role, std.Messages[i].Role, m.role)
			}
			if string(got.Content) != m.text {
				t.Fatalf("%d/%d: content = %q, want %q\n%s", iter, i, got.Content, m.text, body)
			}
			if m.parts == nil {
				var s string
				if err := json.Unmarshal(std.Messages[i].Content, &s); err != nil || s != m.text {
					t.Fatalf("%d/%d: encoding/json content %q %v", iter, i, s, err)
				}
			}
		}
	}
}

// maxNesting returns the deepest bracket nesting of a JSON text, ignoring strings.
func maxNesting(b []byte) int {
	depth, most, inStr := 0, 0, false
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch {
		case inStr && c == '\\':
			i++
		case c == '"':
			inStr = !inStr
		case inStr:
		case c == '{' || c == '[':
			depth++
			most = max(most, depth)
		case c == '}' || c == ']':
			depth--
		}
	}
	return most
}

// stdContent derives a message's text from encoding/json's decoding with the same rules
// Parse applies; ok is false for shapes the comparison leaves out.
func stdContent(v any) (text string, ok bool) {
	switch c := v.(type) {
	case nil:
		return "", true
	case string:
		return c, true
	case []any:
		var texts []string
		for _, p := range c {
			switch p := p.(type) {
			case string:
				texts = append(texts, p)
			case map[string]any:
				typ, hasTyp := p["type"].(string)
				key := "text"
				if hasTyp {
					key = textPartKey([]byte(typ))
				} else if _, isStr := p["text"].(string); !isStr {
					key = ""
				}
				if key == "" {
					continue
				}
				s, isStr := p[key].(string)
				if !isStr {
					return "", false
				}
				texts = append(texts, s)
			default:
				return "", false
			}
		}
		return strings.Join(texts, "\n"), true
	}
	return "", false
}

var fuzzSeeds = []string{
	`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a\n"},{"type":"image_url","image_url":{"url":"x"}},"b"]}],"stream":true,"stream_options":{"include_usage":true}}`,
	`{"model":"m\u00e9","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}],"reasoning_content":"\ud83d\ude00"}],"max_tokens":"5","max_completion_tokens":7.0}`,
	`{"model":"m","prompt":[[1,2],[3]],"nvext":{"agent_hints":{"priority":3,"latency_sensitivity":0.5,"osl":9,"speculative_prefill":"yes"},"session_id":"s"},"priority":-1}`,
	`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"q"}]},{"type":"function_call_output","call_id":"c","output":"o"}],"instructions":"i"}`,
	`{"model":"m","messages":[{"role":"user","content":"x"}],"a":NaN,"b":[-Infinity,{"c":"\udc00"}],"model":"n"}`,
	"\xef\xbb\xbf{\"model\":\"m\",\"messages\":[{\"role\":\"u\",\"content\":\"\\u0000\"}]}",
	`{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":-1,"max_tokens":1e3}`,
	`[1,2,{"x":"y"}]`,
	`{"model":"m","prompt":"x","nvext":{"cache_control":{"type":"ephemeral","ttl":"5m"},"agent_hints":{"osl":3}}}`,
	`{"model":"m","prompt":[0, 1 ,22,	333,4444,2147483647,1.0,1e2]}`,
	`{"model":"m","messages":[{"role":"user","content":"x\q"}]}`,
}

// FuzzParse: Parse never panics, agrees with encoding/json about what is JSON (apart from the
// documented differences: Python's NaN/Infinity and byte order mark accepted; invalid UTF-8
// and nesting past MaxDepth refused), and where both accept a chat body, reads the same model
// and message text.
func FuzzParse(f *testing.F) {
	for i, s := range fuzzSeeds {
		f.Add([]byte(s), uint8(i))
	}
	var p Parser
	var r Request
	f.Fuzz(func(t *testing.T, body []byte, k uint8) {
		kind := Kind(k%4 + 1)
		err := p.Parse(body, kind, &r)
		if err != nil {
			var e *Error
			if !errors.As(err, &e) || !(errors.Is(err, ErrInvalidJSON) || errors.Is(err, ErrInvalidRequest)) {
				t.Fatalf("error %v (%T) is not a sentinel-wrapped *Error", err, err)
			}
		}
		stdValid := json.Valid(body)
		if errors.Is(err, ErrInvalidJSON) && stdValid && utf8.Valid(body) && maxNesting(body) <= MaxDepth {
			t.Fatalf("Parse refused JSON that encoding/json accepts: %v", err)
		}
		if !errors.Is(err, ErrInvalidJSON) && !stdValid {
			if !bytes.Contains(body, []byte("NaN")) && !bytes.Contains(body, []byte("Infinity")) && !bytes.HasPrefix(body, []byte("\xef\xbb\xbf")) {
				t.Fatalf("Parse accepted what encoding/json refuses (err %v)", err)
			}
		}
		if err != nil || !stdValid {
			return
		}
		var m map[string]any
		if json.Unmarshal(body, &m) != nil {
			return
		}
		if kind == Completions {
			// Token ids of the first prompt, when the prompt is a flat list of integers.
			ids, _ := m["prompt"].([]any)
			if r.PromptIsTokens && len(ids) > 0 {
				if _, isList := ids[0].([]any); !isList && len(ids) != len(r.PromptTokens) {
					t.Fatalf("%d token ids, encoding/json %d", len(r.PromptTokens), len(ids))
				}
				for i, v := range ids {
					if f, ok := v.(float64); ok && i < len(r.PromptTokens) && float64(r.PromptTokens[i]) != f {
						t.Fatalf("token %d = %d, encoding/json %v", i, r.PromptTokens[i], f)
					}
				}
			}
			return
		}
		if kind != ChatCompletions {
			return
		}
		if model, _ := m["model"].(string); model != string(r.Model) {
			t.Fatalf("model = %q, encoding/json %q", r.Model, model)
		}
		msgs, _ := m["messages"].([]any)
		if len(msgs) != len(r.Messages) {
			t.Fatalf("%d messages, encoding/json %d", len(r.Messages), len(msgs))
		}
		for i, v := range msgs {
			mm, _ := v.(map[string]any)
			if role, _ := mm["role"].(string); role != string(r.Messages[i].Role) {
				t.Fatalf("messages[%d].role = %q, encoding/json %q", i, r.Messages[i].Role, role)
			}
			if text, ok := stdContent(mm["content"]); ok && text != string(r.Messages[i].Content) {
				t.Fatalf("messages[%d].content = %q, encoding/json %q", i, r.Messages[i].Content, text)
			}
		}
	})
}

// FuzzObserver: the observer never panics, and splitting the payload anywhere (two cuts taken
// from the input) or feeding it byte by byte observes the same.
func FuzzObserver(f *testing.F) {
	for _, tc := range transcripts {
		b := readTranscript(f, tc.file)
		f.Add(b, uint16(len(b)/3), uint16(len(b)/2))
	}
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"\\\"\"}}]}\r\n\r\ndata: [DONE]\r"), uint16(7), uint16(40))
	f.Add([]byte("{\"error\":{\"message\":\"x\",\"code\":400}}{\"usage\":{\"prompt_tokens\":1}}"), uint16(3), uint16(30))
	f.Fuzz(func(t *testing.T, b []byte, i, j uint16) {
		whole := observe(1, b)
		x, y := int(i)%(len(b)+1), int(j)%(len(b)+1)
		if x > y {
			x, y = y, x
		}
		if got := observe(1, b[:x], b[x:y], b[y:]); got != whole {
			t.Fatalf("cuts at %d, %d: %+v\nwant %+v", x, y, got, whole)
		}
		var o Observer
		o.Reset(ModeAuto, 0)
		for k := range b {
			o.Feed(b[k:k+1], 1)
		}
		if *o.Result() != whole {
			t.Fatalf("byte by byte: %+v\nwant %+v", *o.Result(), whole)
		}
	})
}
