package proxy_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// lines is a prompt of about n bytes in lines of numbered words.
func lines(n int) string {
	var sb strings.Builder
	for i := 0; sb.Len() < n; i++ {
		fmt.Fprintf(&sb, "word%d ", i)
		if i%16 == 15 {
			sb.WriteString("\n")
		}
	}
	return sb.String()
}

func chatOf(content string) string {
	b, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 2, "messages": []map[string]string{{"role": "user", "content": content}}})
	return string(b)
}

// TestPromptPastTheContextIsRefusedAtOnce: a prompt longer than the workers' context (which
// the proxy learned from their /v1/models) gets vLLM's 400 from the proxy itself (code
// context_length_exceeded, which the engine's answer does not carry), counted; a prompt large enough to be parsed and tokenized off the event loop but
// within the context is served, and its repeat hits the cache the first one left.
func TestPromptPastTheContextIsRefusedAtOnce(t *testing.T) {
	w := startWorker(t, func(c *sim.WorkerConfig) { c.Engine.MaxModelLen = 200_000; c.Engine.NumGPUBlocks = 16384 })
	p := startProxy(t, nil, func(c *proxy.Config) {
		c.Upstreams = []proxy.Upstream{{ID: "w0", URL: w.URL()}} // model and context asked of the engine
		c.MaxBodyBytes = 8 << 20
	})
	base := "http://" + p.Addr()

	for _, size := range []int{1 << 20, 4 << 20} { // about 300k and 1.2M tokens
		r, b := post(t, base+"/v1/chat/completions", chatOf(lines(size)))
		var e struct {
			Error struct{ Code, Param, Message string }
		}
		_ = json.Unmarshal(b, &e)
		if r.StatusCode != 400 || e.Error.Code != "context_length_exceeded" || e.Error.Param != "messages" || !strings.Contains(e.Error.Message, "200000") {
			t.Fatalf("a %d-byte prompt: %d %s", size, r.StatusCode, b)
		}
	}

	body := chatOf(lines(500 << 10)) // about 150k tokens: within the context
	var cached []int
	for range 2 {
		r, b := post(t, base+"/v1/chat/completions", body)
		var out struct {
			Usage struct {
				PromptTokens        int `json:"prompt_tokens"`
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			}
		}
		_ = json.Unmarshal(b, &out)
		if r.StatusCode != 200 || out.Usage.PromptTokens < 100_000 {
			t.Fatalf("a prompt within the context: %d %s", r.StatusCode, b[:min(len(b), 300)])
		}
		cached = append(cached, out.Usage.PromptTokensDetails.CachedTokens)
	}
	if cached[1] < 100_000 {
		t.Errorf("the repeat of a large prompt had %d cached tokens", cached[1])
	}
	_, m := get(t, base+"/metrics")
	for _, want := range []string{"kvrelay_proxy_context_length_exceeded_total 2", "kvrelay_proxy_off_loop_steps_total"} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// TestLargeBodiesStreamInAndPipeline: a large body sent in pieces, a chunked one, and a
// small request pipelined behind a large one on the same connection are each answered, in
// order.
func TestLargeBodiesStreamInAndPipeline(t *testing.T) {
	w := startWorker(t, nil)
	p := startProxy(t, []string{w.URL()}, nil)
	conn, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	rd := bufio.NewReader(conn)
	read := func(what string) {
		t.Helper()
		resp, err := http.ReadResponse(rd, nil)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), `"choices"`) {
			t.Fatalf("%s: %d %s", what, resp.StatusCode, b)
		}
	}
	big := chatOf(lines(300 << 10))
	head := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(big))
	// In pieces, with pauses: the body moves out of the inbound buffer as it comes.
	msg := head + big
	for i := 0; i < len(msg); i += 50 << 10 {
		if _, err := io.WriteString(conn, msg[i:min(len(msg), i+50<<10)]); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	read("a large body in pieces")

	// Chunked, in chunks of 64 KiB.
	var sb strings.Builder
	sb.WriteString("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
	for i := 0; i < len(big); i += 64 << 10 {
		c := big[i:min(len(big), i+64<<10)]
		fmt.Fprintf(&sb, "%x\r\n%s\r\n", len(c), c)
	}
	sb.WriteString("0\r\n\r\n")
	if _, err := io.WriteString(conn, sb.String()); err != nil {
		t.Fatal(err)
	}
	read("a large chunked body")

	// A large request and a small one in one write.
	small := chatBody("You are terse.", "hi", 2, false)
	both := head + big + fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(small), small)
	if _, err := io.WriteString(conn, both); err != nil {
		t.Fatal(err)
	}
	read("the large request of a pipelined pair")
	read("the small request pipelined behind it")
}

// TestClaimedBodySizeIsNotReserved: heads claiming 30 MB bodies that never come cost the
// proxy what arrived, not what was claimed.
func TestClaimedBodySizeIsNotReserved(t *testing.T) {
	p := startProxy(t, []string{"http://127.0.0.1:1"}, func(c *proxy.Config) { c.MaxBodyBytes = 32 << 20 })
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	var conns []net.Conn
	for range 8 {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 31457280\r\n\r\n{"); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	time.Sleep(300 * time.Millisecond) // the proxy reads the heads
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 32<<20 {
		t.Fatalf("8 heads claiming 30 MB each grew the heap by %d MB", grew>>20)
	}
	_ = conns
}
