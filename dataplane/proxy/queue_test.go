package proxy_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestQueueKeepAliveRequestsOwnDeadline: a request that queued and was served, then a second
// one that queues on the same keep-alive connection: the second waits its own full queue
// timeout, not what was left of the first's.
func TestQueueKeepAliveRequestsOwnDeadline(t *testing.T) {
	const timeout = 2 * time.Second
	c := startCluster(t, 1, func(cfg *proxy.Config) {
		cfg.BusyDecodeBlocks = 1 // any request running makes the worker busy
		cfg.QueueTimeout = timeout
	}, func(w *sim.WorkerConfig) { w.Engine.Timing.Speedup = 0.05 }) // ~0.1 s a decode step
	hold := func(tokens int) *http.Response {
		// ignore_eos: a natural stop depends on the prompt, whose chat template carries
		// today's date, so without it the hold ended early on some days.
		body := strings.Replace(chatBody("hold", "the worker", tokens, true), `{`, `{"ignore_eos":true,`, 1)
		resp, err := http.Post(c.base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	conn, err := net.Dial("tcp", c.proxy.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rd := bufio.NewReader(conn)
	body := chatBody("queued", "request", 2, false)
	send := func() (int, time.Duration) {
		t0 := time.Now()
		fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		resp, err := http.ReadResponse(rd, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, time.Since(t0)
	}

	first := hold(10) // busy for about a second
	go func() { _, _ = io.Copy(io.Discard, first.Body); first.Body.Close() }()
	time.Sleep(100 * time.Millisecond)
	if code, waited := send(); code != 200 || waited < 500*time.Millisecond {
		t.Fatalf("the first queued request: %d after %v, want 200 once the worker is free", code, waited)
	}
	second := hold(4000) // busy for the rest of the test
	defer second.Body.Close()
	time.Sleep(100 * time.Millisecond)
	if code, waited := send(); code != 503 || waited < timeout*9/10 {
		t.Fatalf("the second queued request on the connection: %d after %v, want 503 after the full %v", code, waited, timeout)
	}
}
