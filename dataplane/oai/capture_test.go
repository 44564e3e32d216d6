package oai

import (
	"bytes"
	"context"
	"flag"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

var (
	update  = flag.Bool("update", false, "recapture the simulated engine's transcripts under testdata/")
	simAddr = flag.String("sim-addr", "", "with -update: a running `kvrelay sim` to capture from (default: start one on 127.0.0.1:18001)")
)

// simCaptures are the requests whose responses from kvrelay's simulated engine are stored
// verbatim under testdata/. The engine's ids and timestamps change on every capture; what the
// observer reports must not.
var simCaptures = []struct {
	file, path, body string
}{
	{"sim_chat_stream.sse", "/v1/chat/completions", `{"model":"gpt-oss-120b","messages":[{"role":"user","content":"Say hello"}],"max_tokens":8,"stream":true}`},
	{"sim_chat_stream_usage.sse", "/v1/chat/completions", `{"model":"gpt-oss-120b","messages":[{"role":"user","content":"Say hello"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}`},
	{"sim_completions_stream_usage.sse", "/v1/completions", `{"model":"gpt-oss-120b","prompt":"Once upon a time","max_tokens":6,"stream":true,"stream_options":{"include_usage":true}}`},
	{"sim_chat.json", "/v1/chat/completions", `{"model":"gpt-oss-120b","messages":[{"role":"user","content":"Say hello"}],"max_tokens":8}`},
	{"sim_completions.json", "/v1/completions", `{"model":"gpt-oss-120b","prompt":"Once upon a time","max_tokens":6}`},
	{"sim_error.json", "/v1/chat/completions", `{"model":"gpt-oss-120b","messages":[]}`},
}

// TestCaptureSim refreshes the simulated engine's transcripts when run with -update:
//
//	go test ./dataplane/oai -run TestCaptureSim -update
func TestCaptureSim(t *testing.T) {
	if !*update {
		t.Skip("run with -update to recapture the simulated engine's transcripts")
	}
	addr := *simAddr
	if addr == "" {
		addr = "127.0.0.1:18001"
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		cmd := exec.CommandContext(ctx, "go", "run", "../../cmd/kvrelay", "sim", "--listen", addr, "--speedup-ratio", "100")
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
		if err := cmd.Start(); err != nil {
			t.Fatalf("start the simulated engine: %v", err)
		}
		defer func() { cancel(); _ = cmd.Wait() }()
	}
	base := "http://" + addr
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := http.Get(base + "/v1/models")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the simulated engine did not come up on %s: %v", addr, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, c := range simCaptures {
		resp, err := http.Post(base+c.path, "application/json", bytes.NewReader([]byte(c.body)))
		if err != nil {
			t.Fatalf("%s: %v", c.file, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatalf("%s: %v", c.file, err)
		}
		if err := os.WriteFile(filepath.Join("testdata", c.file), b, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("captured %s (%d bytes)", c.file, len(b))
	}
}
