package sim

import (
	"encoding/json"
	"errors"
	"testing"
	"time"
	"unicode/utf8"
)

func TestParsePrompt(t *testing.T) {
	cases := []struct {
		name, raw string
		text      string
		ids       []uint32
		ok        bool
	}{
		{"string", `"hi there"`, "hi there", nil, true},
		{"one string in a list", `["hi"]`, "hi", nil, true},
		{"token ids", `[1, 2, 200006]`, "", []uint32{1, 2, 200006}, true},
		{"token ids with whitespace", "[ 7 ,\n8\t]", "", []uint32{7, 8}, true},
		{"leading zero id", `[01]`, "", nil, false},
		{"id too large", `[4294967296]`, "", nil, false},
		{"exponent id", `[1e3]`, "", nil, false},
		{"one list of ids", `[[5, 6]]`, "", []uint32{5, 6}, true},
		{"batch", `["a", "b"]`, "", nil, false},
		{"empty list", `[]`, "", nil, false},
		{"negative id", `[-1]`, "", nil, false},
		{"float id", `[1.5]`, "", nil, false},
		{"object", `{"a":1}`, "", nil, false},
		{"number", `7`, "", nil, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, err := parsePrompt(json.RawMessage(tc.raw))
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v, want ok=%v", err, tc.ok)
			}
			if !tc.ok {
				return
			}
			if p.text != tc.text || len(p.tokens) != len(tc.ids) {
				t.Fatalf("got %+v", p)
			}
			for i := range tc.ids {
				if p.tokens[i] != tc.ids[i] {
					t.Fatalf("got %+v", p)
				}
			}
		})
	}
}

func TestMessageText(t *testing.T) {
	cases := []struct {
		name, raw, want string
		ok              bool
	}{
		{"string", `"hello"`, "hello", true},
		{"null", `null`, "", true},
		{"parts", `[{"type":"text","text":"a"},{"type":"text","text":"b"}]`, "ab", true},
		{"image", `[{"type":"image_url","image_url":{"url":"x"}}]`, "", false},
		{"part without text", `[{"type":"text"}]`, "", false},
		{"number", `42`, "", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := messageText(json.RawMessage(tc.raw))
			if (err == nil) != tc.ok || got != tc.want {
				t.Fatalf("got %q, %v", got, err)
			}
		})
	}
}

func TestAppendJSONStringMatchesEncodingJSON(t *testing.T) {
	for _, s := range []string{"plain", "quote\" back\\slash", "ctl\x00\x1f\n\r\t", "<html>&", "snow ☃ and 🎉", "bad \xff utf8", "sep \u2028\u2029"} {
		want, _ := json.Marshal(s)
		if got := appendJSONString(nil, s); string(got) != string(want) {
			t.Errorf("appendJSONString(%q) = %s, want %s", s, got, want)
		}
	}
}

// FuzzDecodeRequest feeds arbitrary bodies through everything a completion request goes
// through before it reaches the engine: it must never panic, and what it accepts must be
// well-formed.
func FuzzDecodeRequest(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"prompt":[1,2,3],"max_tokens":0}`,
		`{"prompt":[[1,2]],"min_tokens":2,"ignore_eos":true,"priority":-1}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"n":1}`,
		`{"prompt":"x"} trailing`,
		`{not json`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}`,
		`{"prompt":"x","nvext":{"cache_control":{"type":"ephemeral","ttl":"5m"},"agent_hints":{"ephemeral_output":true}}}`,
		`{"prompt":"x","nvext":{"cache_control":{"type":"ephemeral","ttl":-3}}}`,
	} {
		f.Add([]byte(seed), true)
		f.Add([]byte(seed), false)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		req, err := decodeRequest(body, chat)
		if err != nil {
			if _, ok := err.(*apiError); !ok {
				t.Fatalf("error %T is not an API error", err)
			}
			return
		}
		if req.maxTokens() < 0 || req.MinTokens < 0 {
			t.Fatal("accepted a negative token count")
		}
		if d, aerr := req.pinTTL(); aerr != nil || d < 0 {
			t.Fatalf("accepted a pin it cannot read: %v, %v", d, aerr)
		}
		if chat {
			for _, m := range req.Messages {
				_, _ = messageText(m.Content)
			}
			return
		}
		p, err := parsePrompt(req.Prompt)
		if err == nil && !p.isIDs && !utf8.ValidString(p.text) && json.Valid(req.Prompt) {
			// encoding/json replaces invalid UTF-8; a prompt string is always valid text.
			t.Fatalf("prompt text %q is not valid UTF-8", p.text)
		}
	})
}

func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "a\"b", "\xff\xfe", "☃\u2028", "\x00<>&"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		out := appendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatalf("%q encoded to invalid JSON %s: %v", s, out, err)
		}
		if utf8.ValidString(s) && back != s {
			t.Fatalf("round trip %q → %s → %q", s, out, back)
		}
	})
}

// FuzzScanIDs checks the token-id fast path against encoding/json: whatever it accepts,
// encoding/json reads as the same ids.
func FuzzScanIDs(f *testing.F) {
	for _, s := range []string{"[1,2,3]", "[ 0 ]", "[2147483648]", "[1,]", "[01]", "[1 2]", "[]", "[1]x"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if len(raw) == 0 || raw[0] != '[' {
			return
		}
		got, ok := scanIDs(raw)
		if !ok {
			return
		}
		var want []uint32
		if err := json.Unmarshal(raw, &want); err != nil {
			t.Fatalf("scanIDs accepted %q, which encoding/json rejects: %v", raw, err)
		}
		if len(got) != len(want) {
			t.Fatalf("%q: %v vs %v", raw, got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%q: %v vs %v", raw, got, want)
			}
		}
	})
}

// TestCacheControlPin: nvext.cache_control reads as a pin of its ttl (5m when absent);
// another type or a ttl that is not a positive duration is a 400 naming the field.
func TestCacheControlPin(t *testing.T) {
	for _, tc := range []struct {
		nvext string
		want  time.Duration
		ok    bool
	}{
		{`{}`, 0, true},
		{`{"cache_control":{"type":"ephemeral"}}`, 5 * time.Minute, true},
		{`{"cache_control":{"type":"ephemeral","ttl":"1h"}}`, time.Hour, true},
		{`{"cache_control":{"type":"ephemeral","ttl":90}}`, 90 * time.Second, true},
		{`{"cache_control":{"type":"persistent","ttl":"5m"}}`, 0, false},
		{`{"cache_control":{"type":"ephemeral","ttl":"soon"}}`, 0, false},
		{`{"cache_control":{"type":"ephemeral","ttl":"-5m"}}`, 0, false},
		{`{"cache_control":{"type":"ephemeral","ttl":[1]}}`, 0, false},
	} {
		req, err := decodeRequest([]byte(`{"prompt":"x","nvext":`+tc.nvext+`}`), false)
		if !tc.ok {
			var ae *apiError
			if !errors.As(err, &ae) || ae.status != 400 || ae.param != "nvext.cache_control" {
				t.Errorf("%s: got %v, want a 400 on nvext.cache_control", tc.nvext, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", tc.nvext, err)
		}
		if d, _ := req.pinTTL(); d != tc.want {
			t.Errorf("%s: pin %v, want %v", tc.nvext, d, tc.want)
		}
	}
}

// TestKVTransferParamsKeyIsExact: only the exact key kv_transfer_params says where to move
// KV blocks, as in vLLM's server; spellings Go's JSON decoding would fold onto it (other
// letter cases, a long s, a Kelvin sign) are unknown fields.
func TestKVTransferParamsKeyIsExact(t *testing.T) {
	for key, want := range map[string]bool{"kv_transfer_params": true, "KV_TRANSFER_PARAMS": false, "Kv_Transfer_Params": false,
		"kv_tranſfer_params": false, "\u212av_transfer_params": false} {
		body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"` + key + `":{"remote_host":"10.1.2.3","remote_port":5600}}`
		req, err := decodeRequest([]byte(body), true)
		if err != nil {
			t.Fatalf("%s: %v", key, err)
		}
		if got := req.KVTransferParams != nil; got != want {
			t.Errorf("%q: kv_transfer_params taken %v, want %v", key, got, want)
		}
	}
}
