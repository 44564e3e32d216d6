package proxy_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

var fuzzProxy struct {
	once sync.Once
	addr string
}

// FuzzConnection sends arbitrary bytes on a client connection of a live proxy (in front of
// an engine that answers every request): whatever they are, the proxy answers well-formed
// HTTP or closes, and keeps serving others.
func FuzzConnection(f *testing.F) {
	for _, seed := range []string{
		"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
		"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 60\r\n\r\n{\"model\":\"gpt-oss-120b\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
		"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n0\r\n\r\n",
		"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n{bad}",
		"GET / HTTP/1.0\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
		"\x00\xff garbage\r\n\r\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		fuzzProxy.once.Do(func() {
			// One proxy for the whole fuzzing process: it outlives each input's t.
			cfg := proxy.DefaultConfig()
			cfg.Listen = "127.0.0.1:0"
			cfg.ReadTimeout = time.Second
			cfg.Upstreams = []proxy.Upstream{{URL: fakeEngineF(t), Model: model}}
			p, err := proxy.New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Start(context.Background()); err != nil {
				t.Fatal(err)
			}
			fuzzProxy.addr = p.Addr()
		})
		conn, err := net.Dial("tcp", fuzzProxy.addr)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(2 * time.Second))
		conn.Write(raw)
		if tc, ok := conn.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		br := bufio.NewReader(conn)
		for {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				break // closed, timed out, or nothing more
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode < 100 || resp.StatusCode > 599 {
				t.Fatalf("status %d", resp.StatusCode)
			}
		}
		conn.Close()
		resp, err := http.Get("http://" + fuzzProxy.addr + "/health")
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("the proxy stopped serving after %q: %v", raw, err)
		}
		resp.Body.Close()
	})
}

// fakeEngineF is an engine that answers every request with a small chat completion.
func fakeEngineF(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	}))
	return "http://" + ln.Addr().String()
}
