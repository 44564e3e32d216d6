package proxy

import (
	"context"
	"net"
	"strconv"
	"testing"

	"github.com/panjf2000/gnet/v2"
)

// fakeConn is the part of a gnet.Conn the request path uses, over byte slices: what a test
// puts in in is read by the proxy, what it writes is counted. The embedded interface is nil:
// any other method panics.
type fakeConn struct {
	gnet.Conn
	in      []byte
	written int
}

func (c *fakeConn) Peek(n int) ([]byte, error) {
	if n < 0 || n > len(c.in) {
		return c.in, nil
	}
	return c.in[:n], nil
}

func (c *fakeConn) Discard(n int) (int, error) {
	if n < 0 || n > len(c.in) {
		n = len(c.in)
	}
	c.in = c.in[n:]
	return n, nil
}

func (c *fakeConn) InboundBuffered() int          { return len(c.in) }
func (c *fakeConn) OutboundBuffered() int         { return 0 }
func (c *fakeConn) Write(b []byte) (int, error)   { c.written += len(b); return len(b), nil }
func (c *fakeConn) Close() error                  { return nil }
func (c *fakeConn) Wake(gnet.AsyncCallback) error { return nil }
func (c *fakeConn) RemoteAddr() net.Addr          { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1} }
func (c *fakeConn) LocalAddr() net.Addr           { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 2} }

// hotRequest and hotResponse are p-proxy-overhead's exchange: a small chat completion and
// a fixed engine answer.
const (
	hotBody   = `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Say ok."}]}`
	hotAnswer = `{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`
)

var (
	hotRequest  = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(hotBody)) + "\r\n\r\n" + hotBody
	hotResponse = "HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(hotAnswer)) + "\r\nConnection: keep-alive\r\n\r\n" + hotAnswer
)

// hotPath is a proxy with one loop, one client connection and one pooled upstream connection,
// all over fakeConns, driven by hand: one round trips a request through the proxy's request
// path (framing, parsing, routing, the exchange, the tally) without sockets.
type hotPath struct {
	s      *Server
	lp     *loop
	cc     *clientConn
	client *fakeConn
	engine *fakeConn
	up     *upstream
	// The bytes each round trip reads (the proxy never writes into what it reads).
	request, response []byte
}

func newHotPath(tb testing.TB, policy string) *hotPath {
	tb.Helper()
	cfg := DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.Policy = policy
	cfg.Upstreams = []Upstream{{ID: "w0", URL: "http://127.0.0.1:9", Model: "m"}}
	s, err := New(cfg, nil)
	if err != nil {
		tb.Fatal(err)
	}
	if err := s.setup(context.Background()); err != nil {
		tb.Fatal(err)
	}
	h := &hotPath{s: s, lp: newLoop(s, nil), client: &fakeConn{}, engine: &fakeConn{},
		request: []byte(hotRequest), response: []byte(hotResponse)}
	h.lp.now = nanotime()
	h.cc = h.lp.newClient(h.client)
	h.up = &upstream{lp: h.lp, w: s.core.Pool().Workers[0], c: h.engine}
	h.lp.putIdle(h.up)
	return h
}

// roundTrip sends one request through and checks that its answer reached the client.
func (h *hotPath) roundTrip(tb testing.TB) {
	h.client.in = h.request
	h.client.written = 0
	h.lp.now = nanotime()
	h.cc.traffic()
	if h.cc.state != stForward {
		tb.Fatalf("state %d after the request", h.cc.state)
	}
	h.engine.in = h.response
	h.lp.now = nanotime()
	h.up.traffic()
	if h.cc.state != stIdle || h.client.written < len(hotAnswer) {
		tb.Fatalf("state %d, %d bytes to the client", h.cc.state, h.client.written)
	}
}

// BenchmarkProxyRequest is the user-space cost of one small chat completion through the
// proxy's request path (p-proxy-overhead's exchange, without the sockets), per policy.
func BenchmarkProxyRequest(b *testing.B) {
	for _, policy := range []string{"round-robin", "kv"} {
		b.Run(policy, func(b *testing.B) {
			h := newHotPath(b, policy)
			h.roundTrip(b)
			b.ReportAllocs()
			for b.Loop() {
				h.roundTrip(b)
			}
		})
	}
}

// TestProxyRequestAllocs: a request through the proxy's request path allocates nothing
// once its connection's buffers have grown, under a policy with and without an index.
func TestProxyRequestAllocs(t *testing.T) {
	for _, policy := range []string{"round-robin", "kv"} {
		t.Run(policy, func(t *testing.T) {
			h := newHotPath(t, policy)
			for range 16 {
				h.roundTrip(t)
			}
			if n := testing.AllocsPerRun(200, func() { h.roundTrip(t) }); n > 0 {
				t.Fatalf("%v allocations per request", n)
			}
		})
	}
}
