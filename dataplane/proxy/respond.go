package proxy

import (
	"bytes"
	"encoding/json"

	"github.com/prometheus/common/expfmt"

	"github.com/kvrelay/kvrelay/dataplane/http1"
)

// reply writes a complete response the proxy answers itself.
func (cc *clientConn) reply(status int, contentType string, body []byte) {
	cc.replyHeader(status, contentType, body, "")
}

func (cc *clientConn) replyHeader(status int, contentType string, body []byte, extra string) {
	keep := cc.keepAlive && !cc.srv.draining.Load()
	b := http1.AppendResponseHead(cc.lp.wbuf[:0], status, contentType, int64(len(body)), keep)
	b = append(b, extra...)
	b = http1.AppendEndHead(b)
	if !bytes.Equal(cc.method, []byte("HEAD")) {
		b = append(b, body...)
	}
	_, _ = cc.c.Write(b)
	cc.lp.wbuf = b[:0]
	cc.keepAlive = keep
	if cc.state == stQueued || cc.state == stForward || cc.state == stTokenize || cc.state == stPrefill {
		cc.state = stIdle
	}
	if cc.state == stBody {
		cc.state = stIdle
	}
	cc.done()
}

// errorReply answers with an OpenAI error object.
func (cc *clientConn) errorReply(status int, msg, param, code string) {
	cc.errorReplyHeader(status, msg, param, code, "")
}

func (cc *clientConn) errorReplyHeader(status int, msg, param, code, extra string) {
	if cc.ex.active {
		cc.ex.status = status
		cc.ex.finish()
	} else if cc.kind != 0 {
		cc.srv.metrics.request(cc.modelOrUnknown(), cc.kind, status)
		// Refused before any worker answered (queue full, timed out, no worker): the
		// routing policy's arm counts it too.
		if a := cc.arm; a != nil {
			a.observe(status, 0, false, 0, 0)
			cc.arm = nil
		}
	}
	body := appendErrorJSON(nil, status, msg, param, code)
	cc.replyHeader(status, "application/json", body, extra)
}

func (cc *clientConn) modelOrUnknown() string {
	if cc.model == "" {
		return "unknown"
	}
	return cc.model
}

// appendErrorJSON appends {"error":{"message","type","param","code"}}. Errors are off the
// fast path, so encoding/json does the escaping.
func appendErrorJSON(dst []byte, status int, msg, param, code string) []byte {
	type body struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	}
	e := body{Message: msg, Type: errorType(status)}
	if param != "" {
		e.Param = &param
	}
	if code != "" {
		e.Code = &code
	}
	b, _ := json.Marshal(struct {
		Error body `json:"error"`
	}{e})
	return append(dst, b...)
}

// errorType is the OpenAI error type of a status.
func errorType(status int) string {
	switch {
	case status == 401:
		return "authentication_error"
	case status == 404:
		return "not_found_error"
	case status == 429:
		return "rate_limit_error"
	case status >= 500:
		return "server_error"
	}
	return "invalid_request_error"
}

// modelLabel is the metrics label of a requested model: one of the configured models, so
// client input cannot create series.
func (s *Server) modelLabel(model []byte) string {
	for _, m := range s.kv.Pool().Models() {
		if string(model) == m {
			return m
		}
	}
	return "other"
}

// gatherMetrics renders the registry in the text exposition format.
func (s *Server) gatherMetrics() []byte {
	mfs, err := s.metrics.reg.Gather()
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		_ = enc.Encode(mf)
	}
	if err != nil {
		buf.WriteString("# error gathering metrics: ")
		buf.WriteString(err.Error())
		buf.WriteByte('\n')
	}
	return buf.Bytes()
}
