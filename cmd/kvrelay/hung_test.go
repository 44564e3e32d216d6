package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// startSimProcess runs `kvrelay sim` as a process of its own (this test binary stands in
// for kvrelay) and returns it with its base URL.
func startSimProcess(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"sim", "--listen", "127.0.0.1:0"}, args...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	sc := bufio.NewScanner(stdout)
	re := regexp.MustCompile(`openai (http://127\.0\.0\.1:\d+)/v1`)
	for sc.Scan() {
		if m := re.FindStringSubmatch(sc.Text()); m != nil {
			go io.Copy(io.Discard, stdout)
			return cmd, m[1]
		}
	}
	t.Fatal("the sim printed no address")
	return nil, ""
}

// A worker process frozen with SIGSTOP: requests routed to it get their first byte from
// another worker within the first-byte timeout (and the worker is out at once, so the
// ones after it do not wait at all); a stream it was serving goes silent, and after the
// stream idle timeout continues on the other worker (migration) instead of hanging.
func TestFrozenWorkerIsRoutedAround(t *testing.T) {
	if testing.Short() {
		t.Skip("starts worker processes")
	}
	frozen, urlA := startSimProcess(t, "--speedup-ratio", "2")
	_, urlB := startSimProcess(t, "--speedup-ratio", "2")
	cfg := proxy.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.Policy = "round-robin"
	cfg.ExposeWorkerHeader = true
	cfg.Upstreams = []proxy.Upstream{{ID: "a", URL: urlA}, {ID: "b", URL: urlB}}
	cfg.FirstByteTimeout = 500 * time.Millisecond
	cfg.StreamIdleTimeout = 700 * time.Millisecond
	cfg.EjectFor = time.Minute
	p, err := startProxy(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	base := "http://" + p.Addr()

	// A stream on a: it freezes mid-answer.
	var stream *http.Response
	for stream == nil {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(
			`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"count"}],"max_tokens":200,"ignore_eos":true,"stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		if resp.Header.Get("x-kvrelay-worker") == "a" {
			stream = resp
		} else {
			resp.Body.Close()
		}
	}
	defer stream.Body.Close()
	br := bufio.NewReader(stream.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if err := frozen.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozenAt := time.Now()
	for i := range 6 {
		t0 := time.Now()
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Post(base+"/v1/chat/completions", "application/json", strings.NewReader(
			`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("x-kvrelay-worker") != "b" {
			t.Fatalf("request %d with a frozen: %d from %q: %s", i, resp.StatusCode, resp.Header.Get("x-kvrelay-worker"), body)
		}
		if d := time.Since(t0); d > 3*time.Second {
			t.Fatalf("request %d took %v with a frozen", i, d)
		}
	}
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("the frozen worker's stream did not end cleanly: %v", err)
	}
	if strings.Contains(string(rest), `"error"`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") || strings.Count(string(rest), `"content":`) < 195 {
		t.Fatalf("the frozen worker's stream did not continue whole elsewhere: %.300s … %d bytes", rest, len(rest))
	}
	if d := time.Since(frozenAt); d > 8*time.Second {
		t.Fatalf("the frozen stream took %v to end", d)
	}
	for _, w := range p.Workers() {
		if w.ID == "a" && w.EjectedUntil().IsZero() {
			t.Error("the frozen worker was not taken out")
		}
	}
}

// A worker killed after 20 of 100 streamed tokens costs the client nothing: the proxy
// continues the answer on the other worker, and the official SDK sees one stream of 100
// tokens, one id, usage counting 100, no error; once per stream (migration_limit 1).
func TestStreamMigratesWhenItsWorkerDies(t *testing.T) {
	if testing.Short() {
		t.Skip("starts worker processes")
	}
	simA, urlA := startSimProcess(t, "--speedup-ratio", "1")
	simB, urlB := startSimProcess(t, "--speedup-ratio", "1")
	procs := map[string]*exec.Cmd{"a": simA, "b": simB}
	cfg := proxy.DefaultConfig()
	cfg.Listen = "127.0.0.1:0"
	cfg.Policy = "round-robin"
	cfg.ExposeWorkerHeader = true
	cfg.Upstreams = []proxy.Upstream{{ID: "a", URL: urlA}, {ID: "b", URL: urlB}}
	p, err := startProxy(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	client := openai.NewClient(option.WithBaseURL("http://"+p.Addr()+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(0))
	var hresp *http.Response
	stream := client.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model:         "gpt-oss-120b",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("count for me")},
		MaxTokens:     openai.Int(100),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	}, option.WithJSONSet("ignore_eos", true), option.WithResponseInto(&hresp))
	var acc openai.ChatCompletionAccumulator
	ids := map[string]bool{}
	content, killed := 0, ""
	for stream.Next() {
		c := stream.Current()
		acc.AddChunk(c)
		ids[c.ID] = true
		for _, ch := range c.Choices {
			if ch.Delta.Content != "" {
				content++
			}
		}
		if content == 20 && killed == "" {
			killed = hresp.Header.Get("x-kvrelay-worker")
			_ = procs[killed].Process.Kill()
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("the stream failed after %d chunks (worker %s killed): %v", content, killed, err)
	}
	if killed == "" {
		t.Fatal("no worker was killed")
	}
	if content != 100 || acc.Usage.CompletionTokens != 100 || len(ids) != 1 {
		t.Fatalf("the client got %d content chunks, usage %+v, ids %v; want 100, 100, one id", content, acc.Usage, ids)
	}
	if words := len(strings.Fields(acc.Choices[0].Message.Content)); words < 95 {
		t.Fatalf("the answer has %d words: %q", words, acc.Choices[0].Message.Content)
	}
	resp, err := http.Get("http://" + p.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(m), `kvrelay_proxy_migrations_total{outcome="continued"} 1`) {
		t.Error("the migration was not counted")
	}
}
