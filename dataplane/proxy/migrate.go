package proxy

import (
	"bytes"
	"encoding/json"
	"strconv"

	"github.com/kvrelay/kvrelay/dataplane/oai"
)

// Request migration: when the engine serving a streamed chat or text completion fails after
// its first token (the connection reset or closed, or silent past the stream idle timeout),
// the proxy sends the request again to another worker with what was already streamed as the
// answer's beginning (an assistant message to continue for chat, appended text for
// completions, the token limits less what was sent), and keeps streaming the new worker's
// events to the client as the same response: its id and created time, no second role chunk,
// usage counting the tokens of both legs. The client sees one uninterrupted stream.

// maxMigrationRecord bounds the streamed bytes kept to rebuild the request from; a longer
// answer cannot migrate.
const maxMigrationRecord = 1 << 20

type migration struct {
	ok   bool   // this stream may migrate (decided when it starts)
	raw  []byte // the SSE payload forwarded so far, whole events only
	tail []byte // bytes of an event not complete yet, held back from the client
	legs int    // migrations done
	leg  bool   // the current attempt continues a migrated stream: its events are rewritten
	body []byte // the continuation's request body

	id, created []byte // of the original stream's events
	sent        int    // content chunks the client got before this leg
	roleSeen    bool   // the continuation's role chunk was dropped
	pend        []byte // a continuation event not complete yet
}

// migratable reports whether this request may migrate: a streamed chat or text completion
// of one choice without logprobs, within the migration limit, not opted out.
func (cc *clientConn) migratable() bool {
	o := cc.in.OpenAI()
	if cc.srv.cfg.MigrationLimit <= 0 || !o.Stream || o.N > 1 || cc.noMigrate {
		return false
	}
	if k := cc.in.Kind(); k != oai.ChatCompletions && k != oai.Completions {
		return false
	}
	return !o.Logprobs
}

// forward passes the payload of a migratable stream on in whole events, keeping a copy to
// rebuild the request from; out is the client's pending output.
func (ex *exchange) forwardEvents(out, data []byte) []byte {
	m := &ex.mig
	buf := data
	if len(m.tail) > 0 {
		// Only an event split across reads is gathered; the usual whole-event read is not
		// copied on its way.
		m.tail = append(m.tail, data...)
		buf = m.tail
	}
	end := eventsEnd(buf)
	if end == 0 {
		if len(buf) > maxHeldEvent {
			// Not an event stream this proxy can cut into events: pass it on, unmigratable.
			m.ok = false
			out = ex.payload(out, buf)
			m.tail = m.tail[:0]
		} else if len(m.tail) == 0 {
			m.tail = append(m.tail, data...)
		}
		return out
	}
	whole := buf[:end]
	if m.ok && len(m.raw)+len(whole) <= maxMigrationRecord {
		m.raw = append(m.raw, whole...)
	} else {
		m.ok = false
	}
	out = ex.payload(out, whole)
	m.tail = append(m.tail[:0], buf[end:]...)
	return out
}

// maxHeldEvent bounds the bytes of one event held back from the client.
const maxHeldEvent = 64 << 10

// eventsEnd is the length of b's whole events: up to the last blank line ("\n\n" or
// "\r\n\r\n"), 0 when b holds none.
func eventsEnd(b []byte) int {
	end := 0
	if k := bytes.LastIndex(b, []byte("\n\n")); k >= 0 {
		end = k + 2
	}
	if k := bytes.LastIndex(b, []byte("\n\r\n")); k >= 0 && k+3 > end {
		end = k + 3
	}
	return end
}

// sseEvent is what migration reads of a streamed chunk.
type sseEvent struct {
	ID      json.RawMessage `json:"id"`
	Created json.RawMessage `json:"created"`
	Choices []struct {
		Text  *string `json:"text"`
		Delta *struct {
			Content *string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
}

// eachData calls f with the JSON of every data event in b, [DONE] excluded.
func eachData(b []byte, f func([]byte)) {
	for len(b) > 0 {
		k := bytes.Index(b, []byte("\n\n"))
		ev := b
		if k >= 0 {
			ev, b = b[:k], b[k+2:]
		} else {
			b = nil
		}
		for _, line := range bytes.Split(ev, []byte("\n")) {
			if d, ok := bytes.CutPrefix(line, []byte("data:")); ok {
				d = bytes.TrimSpace(d)
				if len(d) > 0 && !bytes.Equal(d, []byte("[DONE]")) {
					f(d)
				}
			}
		}
	}
}

// migrate starts a continuation on another worker; false when the stream cannot migrate
// (the caller ends it with an error event). A stream the engine had finished but for its
// [DONE] is simply ended.
func (ex *exchange) migrate() bool {
	cc := ex.cc
	s := cc.srv
	m := &ex.mig
	if !m.ok || !ex.headSent || ex.status != 200 || m.legs >= s.cfg.MigrationLimit || cc.in.Disaggregated() {
		if m.ok {
			s.metrics.migrations.WithLabelValues("failed").Inc()
		}
		return false
	}
	var text []byte
	sent, finished := 0, false
	eachData(m.raw, func(d []byte) {
		var ev sseEvent
		if json.Unmarshal(d, &ev) != nil {
			return
		}
		if m.id == nil && len(ev.ID) > 0 {
			m.id, m.created = append([]byte(nil), ev.ID...), append([]byte(nil), ev.Created...)
		}
		for _, c := range ev.Choices {
			var piece *string
			if c.Delta != nil {
				piece = c.Delta.Content
			} else {
				piece = c.Text
			}
			if piece != nil && *piece != "" {
				text = append(text, *piece...)
				sent++
			}
			if c.FinishReason != nil && *c.FinishReason != "" {
				finished = true
			}
		}
	})
	if finished {
		// Only [DONE] (and perhaps the usage chunk) was missing.
		s.metrics.migrations.WithLabelValues("completed").Inc()
		ex.endStream()
		return true
	}
	body, ok := continuation(cc.body, cc.in.Kind(), text, m.sent+sent)
	if !ok || m.id == nil {
		s.metrics.migrations.WithLabelValues("failed").Inc()
		return false
	}
	m.body, m.sent, m.legs, m.leg, m.roleSeen, m.pend = body, m.sent+sent, m.legs+1, true, false, m.pend[:0]
	m.raw, m.tail = m.raw[:0], m.tail[:0]
	s.metrics.migrations.WithLabelValues("continued").Inc()
	cc.in.Withdraw()
	ex.attempts++
	cc.route(true)
	return true
}

// continuation is the request body that continues an answer after text (tokens of it so
// far): chat gets the text as a final assistant message to continue, completions get it
// appended to the prompt; the output limits shrink by tokens. ok is false when the body
// cannot be continued (a prompt that is not one string, a limit already reached).
func continuation(body []byte, kind oai.Kind, text []byte, tokens int) ([]byte, bool) {
	var req map[string]json.RawMessage
	if json.Unmarshal(bytes.TrimPrefix(body, []byte("\xEF\xBB\xBF")), &req) != nil {
		return nil, false
	}
	str, _ := json.Marshal(string(text))
	switch kind {
	case oai.ChatCompletions:
		var msgs []json.RawMessage
		if json.Unmarshal(req["messages"], &msgs) != nil {
			return nil, false
		}
		msgs = append(msgs, json.RawMessage(`{"role":"assistant","content":`+string(str)+`}`))
		req["messages"], _ = json.Marshal(msgs)
		req["continue_final_message"] = json.RawMessage("true")
		req["add_generation_prompt"] = json.RawMessage("false")
	case oai.Completions:
		var prompt string
		if json.Unmarshal(req["prompt"], &prompt) != nil {
			return nil, false
		}
		req["prompt"], _ = json.Marshal(prompt + string(text))
	default:
		return nil, false
	}
	for _, k := range []string{"max_tokens", "max_completion_tokens"} {
		if raw, ok := req[k]; ok && string(raw) != "null" {
			n, err := strconv.ParseFloat(string(bytes.Trim(raw, `"`)), 64)
			if err != nil {
				return nil, false
			}
			left := int(n) - tokens
			if left < 1 {
				return nil, false
			}
			req[k] = json.RawMessage(strconv.Itoa(left))
		}
	}
	if raw, ok := req["min_tokens"]; ok {
		if n, err := strconv.Atoi(string(raw)); err == nil {
			req["min_tokens"] = json.RawMessage(strconv.Itoa(max(n-tokens, 0)))
		}
	}
	out, err := json.Marshal(req)
	return out, err == nil
}

// continueEvents rewrites a continuation leg's payload into the original stream's events:
// the original id and created time, its role chunk dropped, usage summed over both legs.
func (ex *exchange) continueEvents(out, data []byte, now int64) []byte {
	m := &ex.mig
	m.pend = append(m.pend, data...)
	for {
		k := bytes.Index(m.pend, []byte("\n\n"))
		n := 2
		if j := bytes.Index(m.pend, []byte("\n\r\n")); j >= 0 && (k < 0 || j < k) {
			k, n = j, 3
		}
		if k < 0 {
			if len(m.pend) > maxHeldEvent {
				out = ex.payload(out, m.pend)
				ex.observe(m.pend, now)
				m.pend = m.pend[:0]
			}
			return out
		}
		ev := m.pend[:k+n]
		if re, keep := m.rewrite(ev); keep {
			out = ex.payload(out, re)
			ex.observe(re, now)
		}
		m.pend = append(m.pend[:0], m.pend[k+n:]...)
	}
}

// rewrite turns one continuation event into the original stream's; keep is false for the
// continuation's own opening role chunk.
func (m *migration) rewrite(ev []byte) (out []byte, keep bool) {
	d, ok := bytes.CutPrefix(bytes.TrimSpace(ev), []byte("data:"))
	d = bytes.TrimSpace(d)
	if !ok || bytes.Equal(d, []byte("[DONE]")) {
		return ev, true
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal(d, &obj) != nil {
		return ev, true
	}
	if !m.roleSeen {
		var probe sseEvent
		_ = json.Unmarshal(d, &probe)
		if len(probe.Choices) == 1 && probe.Choices[0].Delta != nil && (probe.Choices[0].Delta.Content == nil || *probe.Choices[0].Delta.Content == "") &&
			probe.Choices[0].FinishReason == nil && bytes.Contains(d, []byte(`"role"`)) {
			m.roleSeen = true
			return nil, false
		}
		m.roleSeen = true
	}
	obj["id"] = m.id
	if len(m.created) > 0 {
		obj["created"] = m.created
	}
	if u, ok := obj["usage"]; ok && string(u) != "null" {
		var usage map[string]json.RawMessage
		if json.Unmarshal(u, &usage) == nil {
			p, _ := strconv.Atoi(string(usage["prompt_tokens"]))
			c, _ := strconv.Atoi(string(usage["completion_tokens"]))
			p, c = max(p-m.sent, 0), c+m.sent
			usage["prompt_tokens"] = json.RawMessage(strconv.Itoa(p))
			usage["completion_tokens"] = json.RawMessage(strconv.Itoa(c))
			usage["total_tokens"] = json.RawMessage(strconv.Itoa(p + c))
			obj["usage"], _ = json.Marshal(usage)
		}
	}
	b, err := json.Marshal(obj)
	if err != nil {
		return ev, true
	}
	return append(append([]byte("data: "), b...), "\n\n"...), true
}
