package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"

	"github.com/kvrelay/kvrelay/dataplane/route"
)

// Speculative prefill (agent hint nvext.agent_hints.speculative_prefill): when a chat turn
// ends, the proxy sends the conversation so far, the answer included, to the worker that
// served it as a max_tokens 1 request, off the client's critical path, so that the next
// turn (the same conversation plus a new message) finds its prefix computed. The answer is
// collected from the response as it streams by, up to maxSpeculativeAnswer bytes.

var errNoAnswer = errors.New("no answer in the response")

// maxSpeculativeAnswer bounds the response bytes kept for a speculative prefill.
const maxSpeculativeAnswer = 1 << 20

// specState is one request's speculative-prefill state, reset per request.
type specState struct {
	want   bool   // the request asked for it
	answer []byte // the response payload as the engine sent it (SSE or JSON)
}

// speculativePrefill warms worker w with the finished turn.
func (cc *clientConn) speculativePrefill(w *route.Worker) {
	s := cc.srv
	body, err := speculativeBody(cc.body, cc.spec.answer)
	if err != nil {
		s.metrics.speculative.WithLabelValues("skipped").Inc()
		return
	}
	url := w.URL + string(cc.path)
	hdr := forwardedHeaders(cc.fwd)
	timeout := s.cfg.PrefillTimeout
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		if _, err := postJSON(ctx, s.pdClient.c, url, hdr, body, maxPrefillResponse); err != nil {
			s.metrics.speculative.WithLabelValues("failed").Inc()
			s.log.Debug("speculative prefill failed", "worker", w.ID, "err", err)
			return
		}
		s.metrics.speculative.WithLabelValues("sent").Inc()
	}()
}

// speculativeBody is the warm-up request for the turn a chat request and its response
// make: the request's messages plus the answer as an assistant message, one output token,
// no streaming, and without the hint (the warm-up must not warm again).
func speculativeBody(request, response []byte) ([]byte, error) {
	answer, err := answerText(response)
	if err != nil {
		return nil, err
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(request, &m); err != nil {
		return nil, err
	}
	var msgs []json.RawMessage
	if err := json.Unmarshal(m["messages"], &msgs); err != nil {
		return nil, err
	}
	a, _ := json.Marshal(map[string]string{"role": "assistant", "content": answer})
	msgs = append(msgs, a)
	m["messages"], _ = json.Marshal(msgs)
	oneToken(m)
	delete(m, "nvext")
	delete(m, "kv_transfer_params")
	return json.Marshal(m)
}

// answerText extracts the assistant's content from a chat completion: a JSON response's
// choices[0].message.content, or the concatenated choices[0].delta.content of an SSE stream.
func answerText(response []byte) (string, error) {
	type choice struct {
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	}
	var one struct {
		Choices []choice `json:"choices"`
	}
	trimmed := bytes.TrimSpace(response)
	if len(trimmed) > 0 && trimmed[0] == '{' {
		if err := json.Unmarshal(trimmed, &one); err != nil {
			return "", err
		}
		if len(one.Choices) == 0 {
			return "", errNoAnswer
		}
		return one.Choices[0].Message.Content, nil
	}
	var b strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(response))
	sc.Buffer(make([]byte, 64<<10), maxSpeculativeAnswer)
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
		data = bytes.TrimSpace(data)
		if !ok || len(data) == 0 || data[0] != '{' {
			continue
		}
		one.Choices = one.Choices[:0]
		if json.Unmarshal(data, &one) == nil && len(one.Choices) > 0 {
			b.WriteString(one.Choices[0].Delta.Content)
		}
	}
	if b.Len() == 0 {
		return "", errNoAnswer
	}
	return b.String(), nil
}
