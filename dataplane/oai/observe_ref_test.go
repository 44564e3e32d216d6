package oai

import (
	"encoding/json"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
)

// randChunk builds one random chat/completions chunk as a JSON object with members in random
// order, look-alike keys at other depths, nulls, empty and non-empty texts, and escapes.
func randChunk(rng *rand.Rand) string {
	str := func() string {
		switch rng.IntN(4) {
		case 0:
			return `""`
		case 1:
			return `null`
		}
		return encodeString(rng, randText(rng))
	}
	obj := func(members []string) string {
		rng.Shuffle(len(members), func(i, j int) { members[i], members[j] = members[j], members[i] })
		// No line breaks: the object is one SSE data line.
		return "{" + strings.Join(members, ","+[]string{"", " ", "\t"}[rng.IntN(3)]) + "}"
	}
	var delta []string
	for _, k := range []string{"content", "reasoning_content", "reasoning", "role"} {
		if rng.IntN(3) == 0 {
			delta = append(delta, `"`+k+`":`+str())
		}
	}
	switch rng.IntN(4) {
	case 0:
		delta = append(delta, `"tool_calls":[]`)
	case 1:
		delta = append(delta, `"tool_calls":[{"index":0,"function":{"arguments":`+str()+`}}]`)
	case 2:
		delta = append(delta, `"tool_calls":null`)
	}
	if rng.IntN(4) == 0 {
		delta = append(delta, `"x":{"content":"decoy","choices":[{"text":"decoy"}]}`)
	}
	var choices []string
	for range rng.IntN(3) {
		c := []string{`"index":0`, `"logprobs":null`}
		switch rng.IntN(3) {
		case 0:
			c = append(c, `"delta":`+obj(delta))
		case 1:
			c = append(c, `"text":`+str())
		}
		fins := []string{`null`, `"stop"`, `"length"`, `"tool_calls"`}
		c = append(c, `"finish_reason":`+fins[rng.IntN(len(fins))])
		choices = append(choices, obj(c))
	}
	root := []string{`"id":"chatcmpl-1"`, `"object":"chat.completion.chunk"`, `"created":1764000000`,
		`"model":` + encodeString(rng, "m"+randText(rng)), `"choices":[` + strings.Join(choices, ",") + `]`}
	switch rng.IntN(4) {
	case 0:
		root = append(root, `"usage":null`)
	case 1:
		root = append(root, `"usage":`+obj([]string{
			`"prompt_tokens":` + strconv.Itoa(rng.IntN(100000)),
			`"completion_tokens":` + strconv.Itoa(rng.IntN(5000)),
			`"total_tokens":1`,
			`"prompt_tokens_details":` + []string{`null`, `{"cached_tokens":` + strconv.Itoa(rng.IntN(1000)) + `}`}[rng.IntN(2)]}))
	}
	if rng.IntN(10) == 0 {
		root = append(root, `"error":{"message":"boom `+strconv.Itoa(rng.IntN(9))+`","type":"InternalServerError","code":500}`)
	}
	if rng.IntN(5) == 0 {
		root = append(root, `"meta":{"usage":{"prompt_tokens":7},"finish_reason":"decoy","error":{"message":"decoy"}}`)
	}
	return obj(root)
}

// reference computes the observation of one chunk from encoding/json's decoding.
type refObs struct {
	content bool
	finish  string
	usage   *Usage
	err     string
	errSeen bool
}

func reference(t *testing.T, chunk string) refObs {
	var m map[string]any
	if err := json.Unmarshal([]byte(chunk), &m); err != nil {
		t.Fatalf("generator produced invalid JSON: %v\n%s", err, chunk)
	}
	var r refObs
	nonEmpty := func(v any) bool {
		switch v := v.(type) {
		case string:
			return v != ""
		case []any:
			return len(v) > 0
		case map[string]any:
			return len(v) > 0
		}
		return false
	}
	choices, _ := m["choices"].([]any)
	for _, c := range choices {
		c, _ := c.(map[string]any)
		if s, ok := c["text"].(string); ok && s != "" {
			r.content = true
		}
		if d, ok := c["delta"].(map[string]any); ok {
			for _, k := range []string{"content", "reasoning_content", "reasoning"} {
				if s, ok := d[k].(string); ok && s != "" {
					r.content = true
				}
			}
			if nonEmpty(d["tool_calls"]) {
				r.content = true
			}
		}
		if f, ok := c["finish_reason"].(string); ok {
			r.finish = f
		}
	}
	if u, ok := m["usage"].(map[string]any); ok {
		r.usage = &Usage{PromptTokens: int64(u["prompt_tokens"].(float64)), CompletionTokens: int64(u["completion_tokens"].(float64)), Has: true}
		if d, ok := u["prompt_tokens_details"].(map[string]any); ok {
			r.usage.CachedTokens, r.usage.HasCached = int64(d["cached_tokens"].(float64)), true
		}
	}
	if e, ok := m["error"].(map[string]any); ok {
		r.errSeen, r.err = true, e["message"].(string)
	}
	return r
}

func TestObserverMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	n := 300
	if testing.Short() || raceEnabled {
		n = 60
	}
	for iter := range n {
		var o Observer
		o.Reset(ModeSSE, 0)
		want := Observation{Mode: ModeSSE}
		var payload strings.Builder
		for k := range 1 + rng.IntN(12) {
			chunk := randChunk(rng)
			ev := "data: " + chunk + "\n\n"
			payload.WriteString(ev)
			ref := reference(t, chunk)
			before := *o.Result()
			// Feed the event in two random pieces.
			cut := rng.IntN(len(ev) + 1)
			o.Feed([]byte(ev[:cut]), int64(k+1))
			o.Feed([]byte(ev[cut:]), int64(k+1))
			got := o.Result()
			if gotContent := got.Chunks > before.Chunks; gotContent != ref.content {
				t.Fatalf("%d/%d: content = %v, reference %v\n%s", iter, k, gotContent, ref.content, chunk)
			}
			if ref.finish != "" && string(got.FinishReason()) != ref.finish {
				t.Fatalf("%d/%d: finish = %q, reference %q\n%s", iter, k, got.FinishReason(), ref.finish, chunk)
			}
			if ref.finish == "" && string(got.FinishReason()) != string(before.FinishReason()) {
				t.Fatalf("%d/%d: finish changed to %q\n%s", iter, k, got.FinishReason(), chunk)
			}
			if ref.usage != nil {
				u := *ref.usage
				if !u.HasCached {
					u.CachedTokens, u.HasCached = before.Usage.CachedTokens, before.Usage.HasCached
				}
				if got.Usage != u {
					t.Fatalf("%d/%d: usage = %+v, reference %+v\n%s", iter, k, got.Usage, u, chunk)
				}
			} else if got.Usage != before.Usage {
				t.Fatalf("%d/%d: usage changed\n%s", iter, k, chunk)
			}
			if ref.errSeen && (!got.Err.Seen || string(got.Err.Message()) != ref.err) {
				t.Fatalf("%d/%d: error = %v %q, reference %q\n%s", iter, k, got.Err.Seen, got.Err.Message(), ref.err, chunk)
			}
			if !ref.errSeen && got.Err != before.Err {
				t.Fatalf("%d/%d: error changed\n%s", iter, k, chunk)
			}
			if got.Malformed != 0 || got.Truncated != 0 {
				t.Fatalf("%d/%d: malformed %d truncated %d\n%s", iter, k, got.Malformed, got.Truncated, chunk)
			}
			want = *got
		}
		// The whole payload at once, at the time of the last event, counts the same.
		whole := observe(1, []byte(payload.String()))
		if whole.Chunks != want.Chunks || whole.Usage != want.Usage || whole.Err != want.Err || string(whole.FinishReason()) != string(want.FinishReason()) {
			t.Fatalf("%d: whole payload %+v\nper event %+v", iter, whole, want)
		}
	}
}
