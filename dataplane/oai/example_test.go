package oai_test

import (
	"errors"
	"fmt"

	"github.com/kvrelay/kvrelay/dataplane/oai"
)

func ExampleParser() {
	// One Parser and Request per connection, reused for every request on it.
	var p oai.Parser
	var req oai.Request

	body := []byte(`{"model":"gpt-oss-120b","stream":true,
		"messages":[{"role":"user","content":[{"type":"text","text":"Hi\n"},{"type":"image_url","image_url":{"url":"https://x/cat.png"}}]}],
		"max_tokens":128,"nvext":{"agent_hints":{"priority":5,"osl":128}}}`)
	if err := p.Parse(body, oai.KindForPath([]byte("/v1/chat/completions")), &req); err != nil {
		var e *oai.Error
		if errors.As(err, &e) {
			fmt.Println(e.Status(), string(e.AppendJSON(nil)))
		}
		return
	}
	prio, _ := req.Priority()
	fmt.Printf("model=%s stream=%v max=%d priority=%d\n", req.Model, req.Stream, req.MaxTokens, prio)
	fmt.Printf("%s: %q, %d non-text part %s\n", req.Messages[0].Role, req.Messages[0].Content, req.Messages[0].Parts, req.Parts[0].Type)

	// vLLM runs lower priorities first: forward the hint translated, other bytes unchanged.
	fwd := oai.AppendWithField(nil, body, "priority", -prio)
	fmt.Printf("forwarded: …%s\n", fwd[len(body)-1:])

	err := p.Parse([]byte(`{"model":"m","messages":[]}`), oai.ChatCompletions, &req)
	var e *oai.Error
	if errors.Is(err, oai.ErrInvalidRequest) && errors.As(err, &e) {
		fmt.Println(e.Status(), string(e.AppendJSON(nil)))
	}
	// Output:
	// model=gpt-oss-120b stream=true max=128 priority=5
	// user: "Hi\n", 1 non-text part image_url
	// forwarded: …,"priority":-5}
	// 400 {"error":{"message":"messages must be a non-empty array","type":"invalid_request_error","param":"messages","code":"empty_array"}}
}

// latency records inter-token gaps; a prometheus.Histogram does the same job.
type latency struct{ n int }

func (l *latency) Observe(seconds float64) { l.n++ }

func ExampleObserver() {
	itl := &latency{}
	o := oai.Observer{ITL: itl}
	o.Reset(oai.ModeAuto, 1_000) // request sent at t=1µs

	stream := []string{
		`data: {"choices":[{"delta":{"role":"assistant","content":""}}]}` + "\n\n",
		`data: {"choices":[{"delta":{"content":"Hel`, // events split anywhere
		`lo"}}]}` + "\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"!\"},\"finish_reason\":\"stop\"}]}\n\n",
		`data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}` + "\n\n",
		"data: [DONE]\n\n",
	}
	for i, piece := range stream {
		o.Feed([]byte(piece), int64(1_000+i*250_000))
	}
	r := o.Result()
	ttft, _ := r.TTFT()
	fmt.Printf("ttft=%dns chunks=%d gaps=%d finish=%s\n", ttft, r.Chunks, itl.n, r.FinishReason())
	fmt.Printf("usage=%d/%d cached=%d done=%v\n", r.Usage.PromptTokens, r.Usage.CompletionTokens, r.Usage.CachedTokens, r.Done)
	// Output:
	// ttft=500000ns chunks=2 gaps=1 finish=stop
	// usage=12/2 cached=8 done=true
}
