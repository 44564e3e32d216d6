package oai

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func parse(t testing.TB, kind Kind, body string) (*Request, error) {
	t.Helper()
	var p Parser
	var r Request
	err := p.Parse([]byte(body), kind, &r)
	return &r, err
}

func mustParse(t *testing.T, kind Kind, body string) *Request {
	t.Helper()
	r, err := parse(t, kind, body)
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return r
}

func eq[T comparable](t *testing.T, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Errorf("%s = %v, want %v", what, got, want)
	}
}

func eqs(t *testing.T, what string, got []byte, want string) {
	t.Helper()
	if string(got) != want {
		t.Errorf("%s = %q, want %q", what, got, want)
	}
}

func TestParseFields(t *testing.T) {
	cases := []struct {
		name  string
		kind  Kind
		body  string
		check func(t *testing.T, r *Request)
	}{
		{"chat with every field", ChatCompletions, `{
			"model": "meta-llama/Llama-3.1-8B-Instruct",
			"messages": [
				{"role": "system", "content": "You are terse."},
				{"role": "user", "content": "Hi", "name": "ann"}
			],
			"stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": false},
			"max_tokens": 64, "temperature": 0.7, "n": 2, "ignore_eos": true, "min_tokens": 3,
			"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
			"tool_choice": "auto", "reasoning_effort": "low",
			"add_generation_prompt": false, "continue_final_message": true,
			"cache_salt": "tenant-7", "chat_template_kwargs": {"enable_thinking": false},
			"kv_transfer_params": {"do_remote_decode": true},
			"priority": -5,
			"nvext": {"session_id": "s-1", "agent_hints": {"priority": 9, "latency_sensitivity": 1.5, "osl": 512, "speculative_prefill": true}},
			"unknown": {"deep": [1, {"x": null}]}
		}`, func(t *testing.T, r *Request) {
			eqs(t, "model", r.Model, "meta-llama/Llama-3.1-8B-Instruct")
			eq(t, "messages", len(r.Messages), 2)
			eqs(t, "role0", r.Messages[0].Role, "system")
			eqs(t, "content0", r.Messages[0].Content, "You are terse.")
			eqs(t, "name1", r.Messages[1].Name, "ann")
			eq(t, "stream", r.Stream, true)
			eq(t, "include_usage", r.IncludeUsage, true)
			eq(t, "max_tokens", r.MaxTokens, 64)
			eq(t, "has max_tokens", r.HasMaxTokens, true)
			eq(t, "temperature", r.Temperature, 0.7)
			eq(t, "has temperature", r.HasTemperature, true)
			eq(t, "n", r.N, 2)
			eq(t, "ignore_eos", r.IgnoreEOS, true)
			eq(t, "min_tokens", r.MinTokens, 3)
			eqs(t, "tools", r.Tools, `[{"type": "function", "function": {"name": "f", "parameters": {}}}]`)
			eqs(t, "tool_choice", r.ToolChoice, `"auto"`)
			eqs(t, "reasoning_effort", r.ReasoningEffort, "low")
			eq(t, "add_generation_prompt", r.AddGenerationPrompt, false)
			eq(t, "continue_final_message", r.ContinueFinalMessage, true)
			eqs(t, "cache_salt", r.CacheSalt, "tenant-7")
			eqs(t, "chat_template_kwargs", r.ChatTemplateKwargs, `{"enable_thinking": false}`)
			eqs(t, "kv_transfer_params", r.KVTransferParams, `{"do_remote_decode": true}`)
			eq(t, "engine priority", r.EnginePriority, -5)
			eq(t, "hint priority", r.Hints.Priority, 9)
			eq(t, "latency_sensitivity", r.Hints.LatencySensitivity, 1.5)
			eq(t, "osl", r.Hints.OSL, 512)
			eq(t, "has osl", r.Hints.HasOSL, true)
			eq(t, "speculative_prefill", r.Hints.SpeculativePrefill, true)
			eqs(t, "session_id", r.Hints.SessionID, "s-1")
			p, ok := r.Priority()
			eq(t, "priority", p, 9)
			eq(t, "priority ok", ok, true)
			eq(t, "text bytes", r.TextBytes, len("You are terse.")+len("Hi")+len(r.Tools))
		}},
		{"defaults", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}]}`, func(t *testing.T, r *Request) {
			eq(t, "n", r.N, 1)
			eq(t, "add_generation_prompt", r.AddGenerationPrompt, true)
			eq(t, "has max_tokens", r.HasMaxTokens, false)
			eq(t, "has temperature", r.HasTemperature, false)
			_, ok := r.Priority()
			eq(t, "priority ok", ok, false)
		}},
		{"max_completion_tokens wins (after)", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":7}`,
			func(t *testing.T, r *Request) { eq(t, "max", r.MaxTokens, 7) }},
		{"max_completion_tokens wins (before)", ChatCompletions, `{"model":"m","max_completion_tokens":7,"messages":[{"role":"user","content":"x"}],"max_tokens":5}`,
			func(t *testing.T, r *Request) { eq(t, "max", r.MaxTokens, 7) }},
		{"max_completion_tokens null falls back", ChatCompletions, `{"model":"m","max_completion_tokens":null,"messages":[{"role":"user","content":"x"}],"max_tokens":5}`,
			func(t *testing.T, r *Request) { eq(t, "max", r.MaxTokens, 5) }},
		{"every escape kind", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"q\" b\\ s\/ \b\f\n\r\t A=\u0041 é=\u00e9 中=\u4E2D 😀=\ud83d\ude00 nul=\u0000 raw=é中😀"}]}`,
			func(t *testing.T, r *Request) {
				eqs(t, "content", r.Messages[0].Content, "q\" b\\ s/ \b\f\n\r\t A=A é=é 中=中 😀=😀 nul=\x00 raw=é中😀")
			}},
		{"escaped keys match", ChatCompletions, `{"mod\u0065l":"m","m\u0065ssages":[{"r\u006fle":"user","content":"x"}]}`,
			func(t *testing.T, r *Request) {
				eqs(t, "model", r.Model, "m")
				eqs(t, "role", r.Messages[0].Role, "user")
			}},
		{"content parts", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":[
				{"type":"text","text":"Look:"},
				{"type":"image_url","image_url":{"url":"https://x/y.png"}},
				"bare",
				{"text":"typed \"last\"","type":"text"},
				{"type":"input_audio","input_audio":{"data":"AAA","format":"wav"}}]}]}`,
			func(t *testing.T, r *Request) {
				m := r.Messages[0]
				eqs(t, "content", m.Content, "Look:\nbare\ntyped \"last\"")
				eq(t, "text parts", m.TextParts, 3)
				eq(t, "parts", m.Parts, 2)
				eq(t, "request parts", len(r.Parts), 2)
				eqs(t, "part0 type", r.Parts[0].Type, "image_url")
				eqs(t, "part0 raw", r.Parts[0].Raw, `{"type":"image_url","image_url":{"url":"https://x/y.png"}}`)
				eq(t, "part0 index", r.Parts[0].Index, 1)
				eqs(t, "part1 type", r.Parts[1].Type, "input_audio")
				eq(t, "part1 index", r.Parts[1].Index, 4)
			}},
		{"one text part aliases the body", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"only"}]}]}`,
			func(t *testing.T, r *Request) {
				eqs(t, "content", r.Messages[0].Content, "only")
				eq(t, "text parts", r.Messages[0].TextParts, 1)
			}},
		{"refusal and other text types", ChatCompletions, `{"model":"m","messages":[{"role":"assistant","content":[{"type":"refusal","refusal":"No."},{"type":"output_text","text":"ok"},{"type":"input_text","text":"in"}]}]}`,
			func(t *testing.T, r *Request) { eqs(t, "content", r.Messages[0].Content, "No.\nok\nin") }},
		{"null and absent content, tool calls", ChatCompletions, `{"model":"m","messages":[
				{"role":"user","content":"call it"},
				{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
				{"role":"tool","tool_call_id":"c1","content":"42"},
				{"role":"assistant"}]}`,
			func(t *testing.T, r *Request) {
				eq(t, "has content 1", r.Messages[1].HasContent, false)
				eqs(t, "content 1", r.Messages[1].Content, "")
				eqs(t, "tool_calls", r.Messages[1].ToolCalls, `[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]`)
				eqs(t, "tool_call_id", r.Messages[2].ToolCallID, "c1")
				eq(t, "has content 3", r.Messages[3].HasContent, false)
			}},
		{"reasoning_content wins over reasoning", ChatCompletions, `{"model":"m","messages":[{"role":"assistant","reasoning":"r","content":"c","reasoning_content":"rc"},{"role":"assistant","reasoning":"only"}]}`,
			func(t *testing.T, r *Request) {
				eqs(t, "reasoning 0", r.Messages[0].Reasoning, "rc")
				eqs(t, "reasoning 1", r.Messages[1].Reasoning, "only")
			}},
		{"duplicate keys: the last wins", ChatCompletions, `{"model":"a","messages":[{"role":"user","content":"old"}],"stream":true,"max_tokens":-1,
				"model":"b","messages":[{"role":"user","content":"new","content":"newer"}],"stream":null,"max_tokens":5,"temperature":"x","temperature":1}`,
			func(t *testing.T, r *Request) {
				eqs(t, "model", r.Model, "b")
				eq(t, "messages", len(r.Messages), 1)
				eqs(t, "content", r.Messages[0].Content, "newer")
				eq(t, "stream", r.Stream, false)
				eq(t, "max", r.MaxTokens, 5)
				eq(t, "temperature", r.Temperature, 1.0)
			}},
		{"duplicate content drops earlier parts", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}],"content":"text"}]}`,
			func(t *testing.T, r *Request) {
				eq(t, "parts", len(r.Parts), 0)
				eq(t, "msg parts", r.Messages[0].Parts, 0)
				eqs(t, "content", r.Messages[0].Content, "text")
			}},
		{"pydantic lax coercions", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":"1_000","n":2.0,"min_tokens":true,
				"stream":"YES","ignore_eos":1,"temperature":"0.5","stream_options":{"include_usage":"on"},"priority":" -3 "}`,
			func(t *testing.T, r *Request) {
				eq(t, "max", r.MaxTokens, 1000)
				eq(t, "n", r.N, 2)
				eq(t, "min_tokens", r.MinTokens, 1)
				eq(t, "stream", r.Stream, true)
				eq(t, "ignore_eos", r.IgnoreEOS, true)
				eq(t, "temperature", r.Temperature, 0.5)
				eq(t, "include_usage", r.IncludeUsage, true)
				eq(t, "priority", r.EnginePriority, -3)
			}},
		{"nulls leave defaults", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x","name":null}],"max_tokens":null,"n":null,"temperature":null,
				"stream":null,"add_generation_prompt":null,"stream_options":null,"nvext":null,"tools":null,"kv_transfer_params":null,"priority":null}`,
			func(t *testing.T, r *Request) {
				eq(t, "has max", r.HasMaxTokens, false)
				eq(t, "n", r.N, 1)
				eq(t, "has temperature", r.HasTemperature, false)
				eq(t, "add_generation_prompt", r.AddGenerationPrompt, true)
				eq(t, "tools nil", r.Tools == nil, true)
				eq(t, "kv nil", r.KVTransferParams == nil, true)
				eq(t, "has engine priority", r.HasEnginePriority, false)
			}},
		{"numbers in every form", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1e3,"temperature":1E-1,"min_tokens":-0,"n":10.0}`,
			func(t *testing.T, r *Request) {
				eq(t, "max", r.MaxTokens, 1000)
				eq(t, "temperature", r.Temperature, 0.1)
				eq(t, "n", r.N, 10)
			}},
		{"latency_sensitivity maps to priority", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":{"agent_hints":{"latency_sensitivity":2.5}},"priority":4}`,
			func(t *testing.T, r *Request) {
				p, _ := r.Priority()
				eq(t, "priority", p, 3)
			}},
		{"vLLM priority is negated", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"priority":4}`,
			func(t *testing.T, r *Request) {
				p, ok := r.Priority()
				eq(t, "priority", p, -4)
				eq(t, "ok", ok, true)
			}},
		{"BOM and whitespace", ChatCompletions, "\xef\xbb\xbf \r\n\t{ \"model\" : \"m\" ,\n \"messages\" : [ { \"role\" : \"user\" , \"content\" : [ ] } ] } \n",
			func(t *testing.T, r *Request) {
				eqs(t, "model", r.Model, "m")
				eq(t, "has content", r.Messages[0].HasContent, true)
				eq(t, "content nil", r.Messages[0].Content == nil, true)
			}},
		{"deep nesting in an unknown field", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"x":` + strings.Repeat("[", MaxDepth-1) + strings.Repeat("]", MaxDepth-1) + `}`,
			func(t *testing.T, r *Request) { eqs(t, "model", r.Model, "m") }},
		{"lone surrogate outside read text is kept by Python", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"user":"\ud800"}`,
			func(t *testing.T, r *Request) { eqs(t, "model", r.Model, "m") }},
		{"NaN and Infinity are JSON to Python", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"top_p":NaN,"x":[Infinity,-Infinity]}`,
			func(t *testing.T, r *Request) { eqs(t, "model", r.Model, "m") }},
		{"kind-specific fields are ignored elsewhere", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"}],"prompt":5,"input":{},"instructions":1}`,
			func(t *testing.T, r *Request) { eq(t, "prompt nil", r.Prompt == nil, true) }},

		{"completions text", Completions, `{"model":"m","prompt":"Once upon","max_tokens":16,"stream":true}`, func(t *testing.T, r *Request) {
			eqs(t, "prompt", r.Prompt, "Once upon")
			eq(t, "num", r.NumPrompts, 1)
			eq(t, "is tokens", r.PromptIsTokens, false)
			eq(t, "max", r.MaxTokens, 16)
		}},
		{"completions token ids", Completions, `{"model":"m","prompt":[1,2,200006]}`, func(t *testing.T, r *Request) {
			eq(t, "tokens", slices.Equal(r.PromptTokens, []int32{1, 2, 200006}), true)
			eq(t, "num", r.NumPrompts, 1)
			eq(t, "is tokens", r.PromptIsTokens, true)
			eq(t, "text bytes", r.TextBytes, 12)
		}},
		{"completions token ids in every form", Completions, "{\"model\":\"m\",\"prompt\":[0, 1 ,2,\n3,999999999,2147483647,1.0,1e2,true]}", func(t *testing.T, r *Request) {
			eq(t, "tokens", slices.Equal(r.PromptTokens, []int32{0, 1, 2, 3, 999999999, 2147483647, 1, 100, 1}), true)
		}},
		{"completions batch of id lists with spaces", Completions, `{"model":"m","prompt":[ [ 5 , 6,7 ] , [8] ]}`, func(t *testing.T, r *Request) {
			eq(t, "tokens", slices.Equal(r.PromptTokens, []int32{5, 6, 7}), true)
			eq(t, "num", r.NumPrompts, 2)
		}},
		{"completions one list of ids", Completions, `{"model":"m","prompt":[[7,8]]}`, func(t *testing.T, r *Request) {
			eq(t, "tokens", slices.Equal(r.PromptTokens, []int32{7, 8}), true)
			eq(t, "num", r.NumPrompts, 1)
		}},
		{"completions one string in a list", Completions, `{"model":"m","prompt":["a\tb"]}`, func(t *testing.T, r *Request) {
			eqs(t, "prompt", r.Prompt, "a\tb")
			eq(t, "num", r.NumPrompts, 1)
		}},
		{"completions batch of strings", Completions, `{"model":"m","prompt":["first","second","third"]}`, func(t *testing.T, r *Request) {
			eqs(t, "prompt", r.Prompt, "first")
			eq(t, "num", r.NumPrompts, 3)
			eq(t, "text bytes", r.TextBytes, len("firstsecondthird"))
		}},
		{"completions batch of ids", Completions, `{"model":"m","prompt":[[1,2],[3],[4,5,6]]}`, func(t *testing.T, r *Request) {
			eq(t, "tokens", slices.Equal(r.PromptTokens, []int32{1, 2}), true)
			eq(t, "num", r.NumPrompts, 3)
		}},
		{"completions prompt_embeds", Completions, `{"model":"m","prompt_embeds":"AAAA"}`, func(t *testing.T, r *Request) {
			eq(t, "embeds", r.PromptEmbeds, true)
			eq(t, "num", r.NumPrompts, 0)
		}},
		{"completions ignores max_completion_tokens", Completions, `{"model":"m","prompt":"x","max_completion_tokens":3}`, func(t *testing.T, r *Request) {
			eq(t, "has max", r.HasMaxTokens, false)
		}},

		{"embeddings string", Embeddings, `{"model":"e5","input":"hello world","encoding_format":"float"}`, func(t *testing.T, r *Request) {
			eqs(t, "input", r.Prompt, "hello world")
			eq(t, "num", r.NumPrompts, 1)
			eq(t, "text bytes", r.TextBytes, 11)
		}},
		{"embeddings batch", Embeddings, `{"model":"e5","input":["a","bb"]}`, func(t *testing.T, r *Request) {
			eqs(t, "input", r.Prompt, "a")
			eq(t, "num", r.NumPrompts, 2)
			eq(t, "text bytes", r.TextBytes, 3)
		}},

		{"responses string input", Responses, `{"model":"gpt-oss-120b","input":"Tell me a joke","instructions":"Be brief.","max_output_tokens":50,"reasoning":{"effort":"high"},"previous_response_id":"resp_1","stream":true}`,
			func(t *testing.T, r *Request) {
				eq(t, "messages", len(r.Messages), 1)
				eqs(t, "role", r.Messages[0].Role, "user")
				eqs(t, "content", r.Messages[0].Content, "Tell me a joke")
				eqs(t, "instructions", r.Instructions, "Be brief.")
				eq(t, "max", r.MaxTokens, 50)
				eqs(t, "effort", r.ReasoningEffort, "high")
				eqs(t, "previous", r.PreviousResponseID, "resp_1")
				eq(t, "text bytes", r.TextBytes, len("Tell me a joke")+len("Be brief."))
			}},
		{"responses items", Responses, `{"model":"m","input":[
				{"role":"developer","content":"Rules."},
				{"type":"message","role":"user","content":[{"type":"input_text","text":"What is in"},{"type":"input_image","image_url":"data:image/png;base64,AAAA"},{"type":"input_text","text":"this?"}]},
				{"type":"function_call","call_id":"call_1","name":"lookup","arguments":"{\"q\":\"x\"}"},
				{"type":"function_call_output","call_id":"call_1","output":"found"},
				{"type":"reasoning","id":"rs_1","summary":[]}]}`,
			func(t *testing.T, r *Request) {
				eq(t, "messages", len(r.Messages), 5)
				eqs(t, "role0", r.Messages[0].Role, "developer")
				eqs(t, "content1", r.Messages[1].Content, "What is in\nthis?")
				eqs(t, "type1", r.Messages[1].Type, "message")
				eq(t, "parts", len(r.Parts), 1)
				eqs(t, "part type", r.Parts[0].Type, "input_image")
				eq(t, "part message", r.Parts[0].Message, 1)
				eqs(t, "type2", r.Messages[2].Type, "function_call")
				eqs(t, "name2", r.Messages[2].Name, "lookup")
				eqs(t, "args", r.Messages[2].Content, `{"q":"x"}`)
				eqs(t, "call id", r.Messages[3].ToolCallID, "call_1")
				eqs(t, "output", r.Messages[3].Content, "found")
				eqs(t, "type4", r.Messages[4].Type, "reasoning")
			}},
		{"responses continuation without input", Responses, `{"model":"m","previous_response_id":"resp_9"}`,
			func(t *testing.T, r *Request) { eq(t, "messages", len(r.Messages), 0) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := mustParse(t, tc.kind, tc.body)
			eq(t, "kind", r.Kind, tc.kind)
			tc.check(t, r)
		})
	}
}

func TestParseErrors(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"x"}]`
	deep := strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth)
	cases := []struct {
		name  string
		kind  Kind
		body  string
		sent  error
		param string
		msg   string // substring of the message
	}{
		{"empty body", ChatCompletions, "", ErrInvalidJSON, "", "empty body"},
		{"blank body", ChatCompletions, " \n", ErrInvalidJSON, "", "empty body"},
		{"unterminated object", ChatCompletions, `{"model":"m"`, ErrInvalidJSON, "", "unexpected end"},
		{"missing value", ChatCompletions, `{"model":}`, ErrInvalidJSON, "", "expected a value"},
		{"trailing comma", ChatCompletions, `{"model":"m",}`, ErrInvalidJSON, "", "property name"},
		{"trailing comma in array", ChatCompletions, `{"model":"m","x":[1,]}`, ErrInvalidJSON, "", "expected a value"},
		{"single quotes", ChatCompletions, `{'model':'m'}`, ErrInvalidJSON, "", "property name"},
		{"invalid escape", ChatCompletions, `{"model":"m\x"}`, ErrInvalidJSON, "", `invalid \escape at byte 11`},
		{"short unicode escape", ChatCompletions, `{"model":"\u12"}`, ErrInvalidJSON, "", `\uXXXX`},
		{"non-hex unicode escape", ChatCompletions, `{"model":"\u12G4"}`, ErrInvalidJSON, "", `\uXXXX`},
		{"raw control character", ChatCompletions, "{\"model\":\"a\tb\"}", ErrInvalidJSON, "", "control character"},
		{"invalid UTF-8", ChatCompletions, "{\"model\":\"\xff\"}", ErrInvalidJSON, "", "UTF-8"},
		{"encoded surrogate", ChatCompletions, "{\"model\":\"\xed\xa0\x80\"}", ErrInvalidJSON, "", "UTF-8"},
		{"truncated UTF-8", ChatCompletions, "{\"model\":\"\xe4\xb8\"}", ErrInvalidJSON, "", "UTF-8"},
		{"leading zero", ChatCompletions, `{"x":01}`, ErrInvalidJSON, "", "expected ','"},
		{"bare fraction dot", ChatCompletions, `{"x":1.}`, ErrInvalidJSON, "", "expected a value"},
		{"bare exponent", ChatCompletions, `{"x":1e}`, ErrInvalidJSON, "", "expected a value"},
		{"lone minus", ChatCompletions, `{"x":-}`, ErrInvalidJSON, "", "expected a value"},
		{"bad literal", ChatCompletions, `{"x":nul}`, ErrInvalidJSON, "", "expected a value"},
		{"extra data", ChatCompletions, `{"model":"m",` + msgs + `} {}`, ErrInvalidJSON, "", "extra data"},
		{"too deep", ChatCompletions, `{"model":"m",` + msgs + `,"x":` + deep + `}`, ErrInvalidJSON, "", "nesting too deep"},
		{"syntax error after a field error", ChatCompletions, `{"model":5,` + msgs + `,"x":[}`, ErrInvalidJSON, "", "expected a value"},
		{"not an object", ChatCompletions, `[1,2]`, ErrInvalidRequest, "", "must be a JSON object"},
		{"a string", ChatCompletions, `"hi"`, ErrInvalidRequest, "", "must be a JSON object"},

		{"model missing", ChatCompletions, `{` + msgs + `}`, ErrInvalidRequest, "model", "model is required"},
		{"model null", ChatCompletions, `{"model":null,` + msgs + `}`, ErrInvalidRequest, "model", "model is required"},
		{"model empty", ChatCompletions, `{"model":"",` + msgs + `}`, ErrInvalidRequest, "model", "model is required"},
		{"model not a string", ChatCompletions, `{"model":5,` + msgs + `}`, ErrInvalidRequest, "model", "model must be a string"},
		{"model lone surrogate", ChatCompletions, `{"model":"\udc00",` + msgs + `}`, ErrInvalidRequest, "model", "unpaired UTF-16 surrogate"},

		{"messages missing", ChatCompletions, `{"model":"m"}`, ErrInvalidRequest, "messages", "messages must be a non-empty array"},
		{"messages empty", ChatCompletions, `{"model":"m","messages":[]}`, ErrInvalidRequest, "messages", "messages must be a non-empty array"},
		{"messages a string", ChatCompletions, `{"model":"m","messages":"hi"}`, ErrInvalidRequest, "messages", "messages must be a non-empty array"},
		{"message not an object", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"x"},5]}`, ErrInvalidRequest, "messages[1]", "messages[1] must be an object"},
		{"role missing", ChatCompletions, `{"model":"m","messages":[{"content":"x"}]}`, ErrInvalidRequest, "messages[0].role", "messages[0].role is required"},
		{"role not a string", ChatCompletions, `{"model":"m","messages":[{"role":1,"content":"x"}]}`, ErrInvalidRequest, "messages[0].role", "must be a string"},
		{"content a number", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":5}]}`, ErrInvalidRequest, "messages[0].content", "must be a string, an array of content parts, or null"},
		{"content part a number", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":[5]}]}`, ErrInvalidRequest, "messages[0].content[0]", "must be an object"},
		{"text part without text", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}`, ErrInvalidRequest, "messages[0].content[0].text", "must be a string"},
		{"text part with a number", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":1}]}]}`, ErrInvalidRequest, "messages[0].content[0].text", "must be a string"},
		{"content lone surrogate", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":"a\ud83dz"}]}`, ErrInvalidRequest, "messages[0].content", "unpaired UTF-16 surrogate"},
		{"part lone surrogate", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"\ude00"}]}]}`, ErrInvalidRequest, "messages[0].content", "unpaired"},
		{"first error in body order", ChatCompletions, `{"model":"m","messages":[{"role":"user","content":5}],"stream":"maybe"}`, ErrInvalidRequest, "messages[0].content", ""},

		{"max_tokens negative", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":-1}`, ErrInvalidRequest, "max_tokens", "max_tokens must be at least 1, got -1."},
		{"max_tokens zero", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":0}`, ErrInvalidRequest, "max_tokens", "max_tokens must be at least 1, got 0."},
		{"max_tokens zero, text", Completions, `{"model":"m","prompt":"p","max_tokens":"0"}`, ErrInvalidRequest, "max_tokens", "max_tokens must be at least 1, got 0."},
		{"max_completion_tokens negative", ChatCompletions, `{"model":"m",` + msgs + `,"max_completion_tokens":-3}`, ErrInvalidRequest, "max_completion_tokens", "max_completion_tokens must be at least 1, got -3."},
		{"max_tokens a word", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":"many"}`, ErrInvalidRequest, "max_tokens", "must be a number"},
		{"max_tokens fractional", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":1.5}`, ErrInvalidRequest, "max_tokens", "must be an integer"},
		{"max_tokens an array", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":[1]}`, ErrInvalidRequest, "max_tokens", "must be a number"},
		{"max_tokens huge", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":99999999999999999999}`, ErrInvalidRequest, "max_tokens", "out of range"},
		{"max_tokens 1e400", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":1e400}`, ErrInvalidRequest, "max_tokens", "must be an integer"},
		{"max_tokens NaN", ChatCompletions, `{"model":"m",` + msgs + `,"max_tokens":NaN}`, ErrInvalidRequest, "max_tokens", "must be an integer"},
		{"n zero", ChatCompletions, `{"model":"m",` + msgs + `,"n":0}`, ErrInvalidRequest, "n", "n must be at least 1"},
		{"min_tokens negative", ChatCompletions, `{"model":"m",` + msgs + `,"min_tokens":-1}`, ErrInvalidRequest, "min_tokens", "at least 0"},
		{"temperature negative", ChatCompletions, `{"model":"m",` + msgs + `,"temperature":-0.5}`, ErrInvalidRequest, "temperature", "finite number of at least 0"},
		{"temperature infinite", ChatCompletions, `{"model":"m",` + msgs + `,"temperature":1e999}`, ErrInvalidRequest, "temperature", "finite"},
		{"temperature a word", ChatCompletions, `{"model":"m",` + msgs + `,"temperature":"hot"}`, ErrInvalidRequest, "temperature", "must be a number"},
		{"stream a word", ChatCompletions, `{"model":"m",` + msgs + `,"stream":"maybe"}`, ErrInvalidRequest, "stream", "must be a boolean"},
		{"stream two", ChatCompletions, `{"model":"m",` + msgs + `,"stream":2}`, ErrInvalidRequest, "stream", "must be a boolean"},
		{"stream an object", ChatCompletions, `{"model":"m",` + msgs + `,"stream":{}}`, ErrInvalidRequest, "stream", "must be a boolean"},
		{"stream_options not an object", ChatCompletions, `{"model":"m",` + msgs + `,"stream_options":true}`, ErrInvalidRequest, "stream_options", "must be an object"},
		{"include_usage a word", ChatCompletions, `{"model":"m",` + msgs + `,"stream_options":{"include_usage":"x"}}`, ErrInvalidRequest, "stream_options.include_usage", "must be a boolean"},
		{"nvext not an object", ChatCompletions, `{"model":"m",` + msgs + `,"nvext":[]}`, ErrInvalidRequest, "nvext", "must be an object"},
		{"agent_hints not an object", ChatCompletions, `{"model":"m",` + msgs + `,"nvext":{"agent_hints":1}}`, ErrInvalidRequest, "nvext.agent_hints", "must be an object"},
		{"hint priority a word", ChatCompletions, `{"model":"m",` + msgs + `,"nvext":{"agent_hints":{"priority":"high"}}}`, ErrInvalidRequest, "nvext.agent_hints.priority", "must be a number"},
		{"hint osl negative", ChatCompletions, `{"model":"m",` + msgs + `,"nvext":{"agent_hints":{"osl":-1}}}`, ErrInvalidRequest, "nvext.agent_hints.osl", "at least 0"},
		{"cache_control type a number", ChatCompletions, `{"model":"m",` + msgs + `,"nvext":{"cache_control":{"type":1}}}`, ErrInvalidRequest, "nvext.cache_control.type", "must be a string"},
		{"cache_control ttl a list", ChatCompletions, `{"model":"m",` + msgs + `,"nvext":{"cache_control":{"type":"ephemeral","ttl":[]}}}`, ErrInvalidRequest, "nvext.cache_control.ttl", "must be a number"},
		{"hint speculative_prefill a list", ChatCompletions, `{"model":"m",` + msgs + `,"nvext":{"agent_hints":{"speculative_prefill":[]}}}`, ErrInvalidRequest, "nvext.agent_hints.speculative_prefill", "must be a boolean"},
		{"priority fractional", ChatCompletions, `{"model":"m",` + msgs + `,"priority":0.5}`, ErrInvalidRequest, "priority", "must be an integer"},
		{"cache_salt a number", ChatCompletions, `{"model":"m",` + msgs + `,"cache_salt":1}`, ErrInvalidRequest, "cache_salt", "must be a string"},

		{"prompt missing", Completions, `{"model":"m"}`, ErrInvalidRequest, "prompt", "prompt is required"},
		{"prompt empty list", Completions, `{"model":"m","prompt":[]}`, ErrInvalidRequest, "prompt", "must not be empty"},
		{"prompt mixed", Completions, `{"model":"m","prompt":[1,"a"]}`, ErrInvalidRequest, "prompt", "array of token ids"},
		{"prompt an object", Completions, `{"model":"m","prompt":{}}`, ErrInvalidRequest, "prompt", "must be a string"},
		{"prompt negative id", Completions, `{"model":"m","prompt":[-1]}`, ErrInvalidRequest, "prompt", "token ids must be integers between 0 and 2147483647"},
		{"prompt id too large", Completions, `{"model":"m","prompt":[3000000000]}`, ErrInvalidRequest, "prompt", "between 0 and"},
		{"prompt id leading zero", Completions, `{"model":"m","prompt":[1,01]}`, ErrInvalidJSON, "", "expected ','"},
		{"prompt id past int32", Completions, `{"model":"m","prompt":[1,2147483648]}`, ErrInvalidRequest, "prompt", "between 0 and"},
		{"prompt id fractional", Completions, `{"model":"m","prompt":[1.5]}`, ErrInvalidRequest, "prompt", "between 0 and"},
		{"prompt list with a string", Completions, `{"model":"m","prompt":[[1],"a"]}`, ErrInvalidRequest, "prompt", "array of arrays"},
		{"input missing", Embeddings, `{"model":"m"}`, ErrInvalidRequest, "input", "input is required"},
		{"responses input missing", Responses, `{"model":"m"}`, ErrInvalidRequest, "input", "input is required"},
		{"responses input a number", Responses, `{"model":"m","input":5}`, ErrInvalidRequest, "input", "string or an array of input items"},
		{"responses item content a number", Responses, `{"model":"m","input":[{"role":"user","content":1}]}`, ErrInvalidRequest, "input[0].content", "must be a string"},
		{"max_output_tokens negative", Responses, `{"model":"m","input":"x","max_output_tokens":-2}`, ErrInvalidRequest, "max_output_tokens", "at least 0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parse(t, tc.kind, tc.body)
			if !errors.Is(err, tc.sent) {
				t.Fatalf("err = %v, want %v", err, tc.sent)
			}
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("err is %T, want *Error", err)
			}
			if e.Param != tc.param {
				t.Errorf("param = %q, want %q", e.Param, tc.param)
			}
			if !strings.Contains(e.Message, tc.msg) {
				t.Errorf("message = %q, want it to contain %q", e.Message, tc.msg)
			}
			if e.Status() != 400 || e.Code == "" || !strings.HasPrefix(e.Error(), "parse openai request: ") {
				t.Errorf("status %d code %q error %q", e.Status(), e.Code, e.Error())
			}
			if (e.Offset >= 0) != (tc.sent == ErrInvalidJSON) {
				t.Errorf("offset = %d for %v", e.Offset, tc.sent)
			}
			// The client body is valid JSON with the OpenAI shape.
			var body struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Param   *string `json:"param"`
					Code    *string `json:"code"`
				} `json:"error"`
			}
			out := e.AppendJSON(nil)
			if err := json.Unmarshal(out, &body); err != nil {
				t.Fatalf("AppendJSON: %v: %s", err, out)
			}
			if body.Error.Message != e.Message || body.Error.Type != "invalid_request_error" ||
				(body.Error.Param == nil) != (e.Param == "") || body.Error.Code == nil || *body.Error.Code != e.Code {
				t.Errorf("AppendJSON = %s", out)
			}
		})
	}
}

func TestParseModelOptional(t *testing.T) {
	p := Parser{ModelOptional: true}
	var r Request
	if err := p.Parse([]byte(`{"messages":[{"role":"user","content":"x"}]}`), ChatCompletions, &r); err != nil {
		t.Fatal(err)
	}
	if r.Model != nil {
		t.Errorf("model = %q", r.Model)
	}
}

// TestParseReuse parses different bodies with one Parser and Request: nothing leaks from one
// request into the next.
func TestParseReuse(t *testing.T) {
	var p Parser
	var r Request
	big := `{"model":"a","messages":[{"role":"user","content":[{"type":"text","text":"x\ny"},{"type":"image_url","image_url":{"url":"u"}}]}],"stream":true,"max_tokens":3,"temperature":1,"n":3,"nvext":{"session_id":"s","agent_hints":{"priority":1}},"priority":2,"tools":[],"cache_salt":"c","add_generation_prompt":false}`
	if err := p.Parse([]byte(big), ChatCompletions, &r); err != nil {
		t.Fatal(err)
	}
	small := `{"model":"b","messages":[{"role":"user","content":"z"}]}`
	if err := p.Parse([]byte(small), ChatCompletions, &r); err != nil {
		t.Fatal(err)
	}
	var fresh Request
	if err := new(Parser).Parse([]byte(small), ChatCompletions, &fresh); err != nil {
		t.Fatal(err)
	}
	r.buf, fresh.buf = nil, nil
	r.Messages, fresh.Messages = slices.Clip(r.Messages), slices.Clip(fresh.Messages)
	r.Parts, fresh.Parts = nil, nil
	r.PromptTokens, fresh.PromptTokens = nil, nil
	if !reflectEqual(r, fresh) {
		t.Errorf("reused request differs from a fresh one:\n%+v\n%+v", r, fresh)
	}
	if len(r.Parts) != 0 {
		t.Errorf("parts = %d", len(r.Parts))
	}
}

func reflectEqual(a, b Request) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}

func TestParseReleasesHugeBuffer(t *testing.T) {
	var p Parser
	var r Request
	huge := longChat(4 << 20)
	if err := p.Parse(huge, ChatCompletions, &r); err != nil {
		t.Fatal(err)
	}
	if cap(r.buf) < len(huge) {
		t.Fatalf("buffer cap %d < body %d", cap(r.buf), len(huge))
	}
	if err := p.Parse([]byte(smallChat), ChatCompletions, &r); err != nil {
		t.Fatal(err)
	}
	if cap(r.buf) > retainLimit {
		t.Errorf("buffer cap %d kept after a small body", cap(r.buf))
	}
}

func TestKindForPath(t *testing.T) {
	for _, k := range []Kind{ChatCompletions, Completions, Embeddings, Responses} {
		if got := KindForPath([]byte(k.String())); got != k {
			t.Errorf("KindForPath(%s) = %v", k, got)
		}
	}
	if KindForPath([]byte("/v1/models")) != 0 || Kind(0).String() != "unknown" {
		t.Error("unknown path")
	}
}

func TestPriorityEdges(t *testing.T) {
	cases := []struct {
		r    Request
		want int
	}{
		{Request{Hints: Hints{HasLatencySensitivity: true, LatencySensitivity: -2.5}}, -3},
		{Request{Hints: Hints{HasLatencySensitivity: true, LatencySensitivity: math.NaN()}}, 0},
		{Request{Hints: Hints{HasLatencySensitivity: true, LatencySensitivity: math.Inf(1)}}, math.MaxInt32},
		{Request{HasEnginePriority: true, EnginePriority: math.MinInt}, math.MaxInt},
		{Request{Hints: Hints{HasPriority: true, Priority: 1, HasLatencySensitivity: true, LatencySensitivity: 9}, HasEnginePriority: true, EnginePriority: 7}, 1},
	}
	for i, tc := range cases {
		if got, _ := tc.r.Priority(); got != tc.want {
			t.Errorf("%d: priority = %d, want %d", i, got, tc.want)
		}
	}
}

func TestAppendWithField(t *testing.T) {
	cases := []struct{ in, want string }{
		{`{}`, `{"priority":-3}`},
		{` { } `, ` { "priority":-3} `},
		{`{"model":"m"}`, `{"model":"m","priority":-3}`},
		{"{\"model\":\"m\",\"x\":{}}\n", "{\"model\":\"m\",\"x\":{},\"priority\":-3}\n"},
		{`{"priority":5,"a":[1,{"b":"}"}]}`, `{"priority":5,"a":[1,{"b":"}"}],"priority":-3}`},
		{`[1]`, `[1]`},
		{`}`, `}`},
		{``, ``},
	}
	for _, tc := range cases {
		got := AppendWithField([]byte("pre:"), []byte(tc.in), "priority", -3)
		if string(got) != "pre:"+tc.want {
			t.Errorf("AppendWithField(%q) = %q, want %q", tc.in, got, "pre:"+tc.want)
		}
		if tc.in != "" && tc.in[0] != '[' && tc.in != "}" {
			// The result parses, and the added member wins as in Python.
			var m map[string]any
			if err := json.Unmarshal(got[4:], &m); err != nil || m["priority"] != -3.0 {
				t.Errorf("%q: %v %v", got, err, m)
			}
		}
	}
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"x"}],"priority":5}`)
	out := AppendWithRawField(nil, body, "kv_transfer_params", []byte(`{"do_remote_decode":true}`))
	r := mustParse(t, ChatCompletions, string(AppendWithField(nil, out, "priority", 1)))
	eq(t, "priority", r.EnginePriority, 1)
	eqs(t, "kv", r.KVTransferParams, `{"do_remote_decode":true}`)
	eqs(t, "quoted name", AppendWithField(nil, []byte(`{}`), `a"b`, 1), `{"a\"b":1}`)

	dst := make([]byte, 0, 256)
	if n := testing.AllocsPerRun(100, func() { dst = AppendWithField(dst[:0], body, "priority", -7) }); n != 0 {
		t.Errorf("AppendWithField allocates %v times", n)
	}
}

func TestAppendJSONString(t *testing.T) {
	for _, s := range []string{"plain", "q\"b\\", "\x00\x1f\n\r\t", "é中😀", "bad\xffutf8", "<&>\u2028"} {
		out := appendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatalf("%q → %s: %v", s, out, err)
		}
		if want := strings.ToValidUTF8(s, "\uFFFD"); back != want {
			t.Errorf("%q → %s → %q", s, out, back)
		}
	}
}

// TestParseMatchesPython replays bodies whose content mixes every escape form, raw UTF-8,
// invalid bytes and control characters (testdata/make_python_vectors.py) against what
// CPython's json.loads made of them: the same text, or an error. Where Python keeps an
// unpaired surrogate (which no tokenizer can encode), Parse must refuse the body.
func TestParseMatchesPython(t *testing.T) {
	f, err := os.ReadFile(filepath.Join("testdata", "python_strings.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var p Parser
	var r Request
	n := 0
	for line := range bytes.Lines(f) {
		var c struct {
			Body          []byte `json:"body"`
			OK            bool   `json:"ok"`
			Content       []byte `json:"content"`
			LoneSurrogate bool   `json:"lone_surrogate"`
		}
		if err := json.Unmarshal(line, &c); err != nil {
			t.Fatal(err)
		}
		n++
		err := p.Parse(c.Body, ChatCompletions, &r)
		switch {
		case !c.OK:
			if !errors.Is(err, ErrInvalidJSON) {
				t.Errorf("%q: Python refuses it, Parse: %v", c.Body, err)
			}
		case c.LoneSurrogate:
			if err == nil {
				t.Errorf("%q: unpaired surrogate accepted", c.Body)
			}
		case err != nil:
			t.Errorf("%q: Parse: %v", c.Body, err)
		case !bytes.Equal(r.Messages[0].Content, c.Content):
			t.Errorf("%q: content %q, Python %q", c.Body, r.Messages[0].Content, c.Content)
		}
	}
	if n < 500 {
		t.Fatalf("only %d vectors", n)
	}
}

func TestParseLogprobs(t *testing.T) {
	msgs := `"messages":[{"role":"user","content":"say \"logprobs\": true"}]`
	for body, want := range map[string]bool{
		`{"model":"m",` + msgs + `}`:                          false,
		`{"model":"m",` + msgs + `,"logprobs":false}`:         false,
		`{"model":"m",` + msgs + `,"logprobs":null}`:          false,
		`{"model":"m",` + msgs + `,"logprobs":true}`:          true,
		`{"model":"m",` + msgs + `,"top_logprobs":3}`:         true,
		`{"model":"m",` + msgs + `,"top_logprobs":0}`:         false,
		`{"model":"m","prompt":"x","logprobs":5}`:             true,
		`{"model":"m","prompt":"x","logprobs":0,"echo":true}`: false,
	} {
		kind := ChatCompletions
		if !strings.Contains(body, "messages") {
			kind = Completions
		}
		var p Parser
		var r Request
		if err := p.Parse([]byte(body), kind, &r); err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if r.Logprobs != want {
			t.Errorf("%s: Logprobs %v, want %v", body, r.Logprobs, want)
		}
	}
}

// TestCacheControlPin: nvext.cache_control reads as a pin of its ttl (a duration or seconds,
// 5m when absent, at most a day), whichever order it comes in beside agent_hints; a type or
// ttl kvrelay does not read leaves no pin and no error (the engine decides).
func TestCacheControlPin(t *testing.T) {
	for _, tc := range []struct {
		nvext string
		want  time.Duration
	}{
		{`{"cache_control":{"type":"ephemeral","ttl":"1h"}}`, time.Hour},
		{`{"cache_control":{"type":"ephemeral"}}`, 5 * time.Minute},
		{`{"cache_control":{"type":"ephemeral","ttl":90},"agent_hints":{"osl":4}}`, 90 * time.Second},
		{`{"agent_hints":{"osl":4},"cache_control":{"ttl":"2m","type":"ephemeral"}}`, 2 * time.Minute},
		{`{"cache_control":{"type":"ephemeral","ttl":"100h"}}`, 24 * time.Hour},
		{`{"cache_control":{"type":"persistent","ttl":"5m"}}`, 0},
		{`{"cache_control":{"type":"ephemeral","ttl":"soon"}}`, 0},
		{`{"cache_control":{"type":"ephemeral","ttl":-5}}`, 0},
		{`{"cache_control":null}`, 0},
	} {
		var p Parser
		var r Request
		body := `{"model":"m","messages":[{"role":"user","content":"x"}],"nvext":` + tc.nvext + `}`
		if err := p.Parse([]byte(body), ChatCompletions, &r); err != nil {
			t.Fatalf("%s: %v", tc.nvext, err)
		}
		if r.Hints.PinTTL != tc.want {
			t.Errorf("%s: pin %v, want %v", tc.nvext, r.Hints.PinTTL, tc.want)
		}
		if strings.Contains(tc.nvext, "osl") && r.Hints.OSL != 4 {
			t.Errorf("%s: osl %d lost beside the pin", tc.nvext, r.Hints.OSL)
		}
	}
}
