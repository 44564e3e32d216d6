package proxy

import (
	"bytes"

	"github.com/prometheus/common/expfmt"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/http1"
)

// reply writes a complete response the proxy answers itself.
func (cc *clientConn) reply(status int, contentType string, body []byte) {
	cc.replyHeader(status, contentType, body, "")
}

func (cc *clientConn) replyHeader(status int, contentType string, body []byte, extra string) {
	keep := cc.keepAlive && !cc.srv.core.Draining()
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
	} else {
		// Refused before any worker answered (queue full, timed out, no worker): the
		// routing policy's arm counts it too.
		cc.in.Refused(status)
	}
	body := decide.AppendErrorJSON(nil, status, msg, param, code)
	cc.replyHeader(status, "application/json", body, extra)
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
