package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/planner"
)

// TestMain lets this test binary stand in for kvrelay where the planner's local actuator
// starts workers as `<this executable> sim ...`, and where a test signals `up` as a process.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && (os.Args[1] == "sim" || os.Args[1] == "up") {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// burstProfile saves a planner profile in which a replica prefills 2000 tokens/s, so that a
// burst of 24 prompts of ~600 tokens within a load interval needs several, and returns its
// path.
func burstProfile(t *testing.T) string {
	t.Helper()
	p := &planner.Profile{Version: planner.ProfileVersion,
		Prefill: []planner.PrefillPoint{{ISL: 600, Concurrency: 1, TTFTMs: 300, Throughput: 2000}},
		Decode:  []planner.DecodePoint{{Context: 600, Concurrency: 8, ITLMs: 10, Throughput: 800}},
	}
	profile := t.TempDir() + "/profile.json"
	if err := p.Save(profile); err != nil {
		t.Fatal(err)
	}
	return profile
}

// `kvrelay up --planner` end to end: a burst of long prompts makes the planner start a
// second worker process, which registers and takes requests; when the traffic stops, the
// planner drains it and stops it again.
func TestUpPlannerScalesUpAndDown(t *testing.T) {
	if testing.Short() {
		t.Skip("starts worker processes")
	}
	profile := burstProfile(t)
	pr, stop := startUp(t, "--expose-worker-header", "--workers", "1", "--speedup-ratio", "20", "--num-gpu-blocks", "4096",
		"--planner", "--planner-profile", profile, "--planner-max", "2",
		"--planner-interval", "2s", "--planner-load-interval", "500ms", "--planner-cooldown", "3s")

	proxyRe := regexp.MustCompile(`^proxy +openai (\S+)/v1 `)
	apiRe := regexp.MustCompile(`^control .* api (http://\S+)`)
	var proxy, api string
	sc := bufio.NewScanner(pr)
	for sc.Scan() && (proxy == "" || api == "") {
		if m := proxyRe.FindStringSubmatch(sc.Text()); m != nil {
			proxy = m[1]
		}
		if m := apiRe.FindStringSubmatch(sc.Text()); m != nil {
			api = m[1]
		}
	}
	if proxy == "" || api == "" {
		t.Fatalf("up printed no proxy (%q) or API (%q) address", proxy, api)
	}
	go io.Copy(io.Discard, pr)

	workers := func() []string {
		var out struct {
			Workers []struct {
				Spec struct {
					ID string `json:"id"`
				} `json:"spec"`
			} `json:"workers"`
		}
		resp, err := http.Get(api + "/v1/workers")
		if err != nil {
			return nil
		}
		defer resp.Body.Close()
		if json.NewDecoder(resp.Body).Decode(&out) != nil {
			return nil
		}
		var ids []string
		for _, w := range out.Workers {
			ids = append(ids, w.Spec.ID)
		}
		return ids
	}
	applied := func(from, to int) *planner.Decision {
		resp, err := http.Get(api + "/v1/planner/decisions?changes=1")
		if err != nil {
			return nil
		}
		defer resp.Body.Close()
		var out struct {
			Decisions []planner.Decision `json:"decisions"`
		}
		if json.NewDecoder(resp.Body).Decode(&out) != nil {
			return nil
		}
		for i := range out.Decisions {
			if d := &out.Decisions[i]; d.Applied && d.From == from && d.To == to {
				return d
			}
		}
		return nil
	}
	// Every prompt is new (a number of its own up front); all share the chat template's
	// first blocks.
	chat := func(i, words int) (string, error) {
		body := fmt.Sprintf(`{"model":"gpt-oss-120b","max_tokens":8,"messages":[{"role":"user","content":"request %d: %s"}]}`,
			i, strings.Repeat("tell me about rivers and stones ", words/6))
		resp, err := http.Post(proxy+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return "", fmt.Errorf("status %d: %s", resp.StatusCode, b)
		}
		return resp.Header.Get("x-kvrelay-worker"), nil
	}
	first := workers()
	if len(first) != 1 {
		t.Fatalf("up --workers 1 registered %v", first)
	}

	// Bursts of 24 concurrent requests until the planner has a second worker.
	var up *planner.Decision
	for i, deadline := 0, time.Now().Add(45*time.Second); up == nil && time.Now().Before(deadline); i++ {
		var wg sync.WaitGroup
		errs := make(chan error, 24)
		for j := 0; j < 24; j++ {
			wg.Add(1)
			go func(n int) {
				defer wg.Done()
				if _, err := chat(n, 600); err != nil {
					errs <- err
				}
			}(i*24 + j)
		}
		time.Sleep(100 * time.Millisecond)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("a request during the scale-up failed: %v", err)
		}
		up = applied(1, 2)
	}
	if up == nil {
		t.Fatal("the planner did not scale 1 -> 2 under bursts of long prompts")
	}
	t.Logf("scale-up: %s (%s)", up.Reason, up.Mode)
	var ids []string
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if ids = workers(); len(ids) == 2 {
			break
		}
	}
	if len(ids) != 2 {
		t.Fatalf("after the scale-up the registry lists %v", ids)
	}
	added := ids[0]
	if added == first[0] {
		added = ids[1]
	}
	// The new worker takes requests once the proxy has it over xDS. Prompts long enough that
	// the template's few shared blocks are below the kv policy's cache threshold are new to
	// every worker, and spread to the idle one.
	served := false
	for i, deadline := 0, time.Now().Add(20*time.Second); !served && time.Now().Before(deadline); i++ {
		w, err := chat(1_000_000+i, 2400)
		if err != nil {
			t.Fatalf("a request after the scale-up failed: %v", err)
		}
		served = w == added
	}
	if !served {
		t.Fatalf("no request reached the added worker %s", added)
	}

	// No traffic: the planner drains and stops it.
	var down *planner.Decision
	for deadline := time.Now().Add(40 * time.Second); down == nil && time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		down = applied(2, 1)
	}
	if down == nil {
		t.Fatal("the planner did not scale 2 -> 1 without traffic")
	}
	t.Logf("scale-down: %s (%s)", down.Reason, down.Mode)
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if ids = workers(); len(ids) == 1 {
			break
		}
	}
	if len(ids) != 1 || ids[0] != first[0] {
		t.Fatalf("after the scale-down the registry lists %v", ids)
	}
	if _, err := chat(2_000_000, 600); err != nil {
		t.Fatalf("a request after the scale-down failed: %v", err)
	}
	stop(20 * time.Second)
}
