package benchharness

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// TestLLMDCodec checks llmdCodec against llm-d-inference-sim's own rendering of the agentic
// golden transcript (tool calls and tool messages included), token for token. It needs the
// simulator: LLMD_SIM names its binary; without it the test is skipped.
func TestLLMDCodec(t *testing.T) {
	bin := os.Getenv("LLMD_SIM")
	if bin == "" {
		t.Skip("LLMD_SIM not set")
	}
	// A free loopback port (KVRELAY_TEST_PORT overrides).
	port := os.Getenv("KVRELAY_TEST_PORT")
	if port == "" {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port = strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
		l.Close()
	}
	cmd := exec.Command(bin, "--port", port, "--model", "Qwen/Qwen3-8B", "--force-dummy-tokenizer", "--max-model-len", "32768")
	cmd.Env = append(os.Environ(), "POD_IP=127.0.0.1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url := "http://127.0.0.1:" + port + "/v1/chat/completions/render"
	for deadline := time.Now().Add(10 * time.Second); ; {
		if resp, err := http.Get("http://127.0.0.1:" + port + "/v1/models"); err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("llm-d-inference-sim did not start")
		}
		time.Sleep(100 * time.Millisecond)
	}

	f, err := os.Open("../../cmd/kvrelay/bench/workload/testdata/golden/agentic.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	base, err := tokenizer.New(tokenizer.O200kBase)
	if err != nil {
		t.Fatal(err)
	}
	codec := newLLMDCodec(base)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	n := 0
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "#") {
			continue
		}
		var rec struct {
			Body struct {
				Messages []tokenizer.Message `json:"messages"`
			} `json:"body"`
		}
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatal(err)
		}
		mine, err := codec.EncodeChat(rec.Body.Messages, tokenizer.RenderOptions{AddGenerationPrompt: true})
		if err != nil {
			t.Fatal(err)
		}
		body, _ := json.Marshal(map[string]any{"model": "Qwen/Qwen3-8B", "messages": rec.Body.Messages})
		resp, err := http.Post(url, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var theirs struct {
			TokenIDs []uint32 `json:"token_ids"`
		}
		err = json.NewDecoder(resp.Body).Decode(&theirs)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(mine, theirs.TokenIDs) {
			t.Errorf("request %d: %d tokens here, %d from llm-d-inference-sim", n, len(mine), len(theirs.TokenIDs))
		}
		n++
	}
	if n == 0 {
		t.Fatal("no requests in the golden transcript")
	}
}
