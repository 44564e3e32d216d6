package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/nixl"
)

// pdPair is a prefill worker and a decode worker on loopback, each with its nixl agent.
type pdPair struct {
	pre, dec *Worker
}

// awaitFreedByRead waits until the prefill worker holds no blocks, and fails when the
// timeout freed any: the decoder's read must have.
func (p pdPair) awaitFreedByRead(t *testing.T) {
	t.Helper()
	eventually(t, "the prefill worker to free the blocks", func() bool {
		reqs, blocks := p.pre.Engine().HeldKV()
		return reqs == 0 && blocks == 0
	})
	if metric(t, p.pre, "kvrelay_sim_kv_freed_requests_total", `by="timeout"`) != 0 {
		t.Fatal("blocks were freed by the timeout, not by the decoder's read")
	}
}

func startPD(t *testing.T, mut func(role Role, c *WorkerConfig)) pdPair {
	t.Helper()
	var p pdPair
	for _, role := range []Role{RolePrefill, RoleDecode} {
		w := startWorker(t, func(c *WorkerConfig) {
			c.Engine.Role = role
			c.Engine.NumGPUBlocks = 1024
			if mut != nil {
				mut(role, c)
			}
		})
		if role == RolePrefill {
			p.pre = w
		} else {
			p.dec = w
		}
	}
	return p
}

// prefillBody is the prefill leg of a chat request as vLLM's toy proxy sends it.
func prefillBody(prompt string) string {
	return `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":1,"stream":false,` +
		`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`
}

// decodeBody is the decode leg: the request with the prefill response's kv_transfer_params.
func decodeBody(prompt string, params json.RawMessage, maxTokens int, stream bool) string {
	return `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":` + strconv.Itoa(maxTokens) +
		`,"stream":` + strconv.FormatBool(stream) + `,"min_tokens":null,"min_completion_tokens":null,"kv_transfer_params":` + string(params) + `}`
}

type pdResponse struct {
	ID               string          `json:"id"`
	Usage            usage           `json:"usage"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	Choices          []struct {
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
}

// prefillLeg runs the prefill leg and returns its response.
func prefillLeg(t *testing.T, w *Worker, prompt string) pdResponse {
	t.Helper()
	code, b := post(t, w.URL()+"/v1/chat/completions", prefillBody(prompt))
	if code != 200 {
		t.Fatalf("prefill leg: %d %s", code, b)
	}
	var r pdResponse
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("prefill leg: %v: %s", err, b)
	}
	return r
}

// metric sums the samples of one metric (all label sets, or those containing the label
// filter) in a worker's /metrics.
func metric(t *testing.T, w *Worker, name, filter string) float64 {
	t.Helper()
	resp, err := http.Get(w.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	re := regexp.MustCompile(`^` + regexp.QuoteMeta(name) + `(\{[^}]*\})? (\S+)$`)
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		m := re.FindStringSubmatch(sc.Text())
		if m == nil || !strings.Contains(m[1], filter) {
			continue
		}
		v, _ := strconv.ParseFloat(m[2], 64)
		sum += v
	}
	return sum
}

// eventually polls cond for up to 10 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestDisaggTwoLegs(t *testing.T) {
	for _, backends := range [][]nixl.BackendKind{nil, {nixl.BackendTCP}} {
		t.Run(fmt.Sprint("backends=", backends), func(t *testing.T) {
			testTwoLegs(t, startPD(t, func(_ Role, c *WorkerConfig) { c.KVTransferBackends = backends }))
		})
	}
}

func testTwoLegs(t *testing.T, pd pdPair) {
	const bs = 16
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			prompt := fmt.Sprint("stream ", stream) + longText(310) // 300+ tokens: 20 blocks, the last partial
			pre := prefillLeg(t, pd.pre, prompt)
			promptTokens := pre.Usage.PromptTokens
			nBlocks := (promptTokens + bs - 1) / bs
			if promptTokens%bs == 0 {
				t.Fatalf("want a partial last block, prompt has %d tokens", promptTokens)
			}
			if pre.Usage.CompletionTokens != 1 || pre.Choices[0].FinishReason != "length" {
				t.Fatalf("prefill leg usage %+v, finish %q", pre.Usage, pre.Choices[0].FinishReason)
			}

			// The exact fields of vLLM's NixlConnector.request_finished, with their types.
			var fields map[string]any
			dec := json.NewDecoder(bytes.NewReader(pre.KVTransferParams))
			dec.UseNumber()
			if err := dec.Decode(&fields); err != nil {
				t.Fatalf("kv_transfer_params %s: %v", pre.KVTransferParams, err)
			}
			var keys []string
			for k := range fields {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			want := []string{"do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_request_id", "tp_size"}
			if !slices.Equal(keys, want) {
				t.Fatalf("kv_transfer_params keys %v, want %v", keys, want)
			}
			_, port, _ := net.SplitHostPort(pd.pre.KVTransferAddr())
			ids, _ := fields["remote_block_ids"].([]any)
			if fields["do_remote_prefill"] != true || fields["do_remote_decode"] != false ||
				fields["remote_engine_id"] != pd.pre.EngineID() || fields["remote_request_id"] != pre.ID ||
				fields["remote_host"] != "127.0.0.1" || fields["remote_port"] != json.Number(port) ||
				fields["tp_size"] != json.Number("1") || len(ids) != nBlocks {
				t.Fatalf("kv_transfer_params %s (engine %s, nixl %s, %d blocks)", pre.KVTransferParams, pd.pre.EngineID(), pd.pre.KVTransferAddr(), nBlocks)
			}
			if reqs, blocks := pd.pre.Engine().HeldKV(); reqs != 1 || blocks != nBlocks {
				t.Fatalf("prefill holds %d requests, %d blocks; want 1, %d", reqs, blocks, nBlocks)
			}

			pulledBefore := metric(t, pd.dec, "kvrelay_sim_kv_pulled_blocks_total", "")
			body := decodeBody(prompt, pre.KVTransferParams, 8, stream)
			code, b := post(t, pd.dec.URL()+"/v1/chat/completions", body)
			if code != 200 {
				t.Fatalf("decode leg: %d %s", code, b)
			}
			if stream {
				if !bytes.Contains(b, []byte("data: [DONE]")) || bytes.Contains(b, []byte("kv_transfer_params")) || bytes.Count(b, []byte(`"content":" `)) != 8 {
					t.Fatalf("decode stream: %s", b)
				}
			} else {
				var d pdResponse
				if err := json.Unmarshal(b, &d); err != nil {
					t.Fatal(err)
				}
				// vLLM's decode leg answers kv_transfer_params: null; the prompt's KV came from
				// the prefill worker except the last token, which decode recomputes.
				if string(d.KVTransferParams) != "null" || !bytes.Contains(b, []byte(`"kv_transfer_params":null`)) ||
					d.Usage.CompletionTokens != 8 || d.Usage.PromptTokens != promptTokens || d.Usage.PromptTokensDetails.CachedTokens != promptTokens-1 {
					t.Fatalf("decode leg: %s", b)
				}
			}
			if got := metric(t, pd.dec, "kvrelay_sim_kv_pulled_blocks_total", "") - pulledBefore; got != float64(nBlocks) {
				t.Fatalf("decode pulled %v blocks, want %d", got, nBlocks)
			}
			if n := metric(t, pd.dec, "kvrelay_sim_kv_checksum_errors_total", ""); n != 0 {
				t.Fatalf("%v checksum errors", n)
			}
			// The READ's notification frees the blocks on the prefill worker.
			pd.awaitFreedByRead(t)
		})
	}
	if n := metric(t, pd.pre, "kvrelay_sim_kv_freed_requests_total", `by="notification"`); n != 2 {
		t.Fatalf("prefill freed %v requests by notification, want 2", n)
	}
	if n := metric(t, pd.pre, "vllm:kv_cache_usage_perc", ""); n != 0 {
		t.Fatalf("prefill KV usage %v after the pulls", n)
	}
	// Decode stored the pulled blocks in its prefix cache (and announced them).
	if n := metric(t, pd.dec, "vllm:prefix_cache_hits_total", ""); n != 0 {
		t.Fatalf("decode prefix hits %v", n)
	}
	// Plain requests still work on both roles.
	for _, w := range []*Worker{pd.pre, pd.dec} {
		if code, b := post(t, w.URL()+"/v1/completions", `{"prompt":"a b c","max_tokens":2}`); code != 200 || bytes.Contains(b, []byte("kv_transfer_params")) {
			t.Fatalf("plain request: %d %s", code, b)
		}
	}
}

func TestDisaggDecodePrefixHits(t *testing.T) {
	pd := startPD(t, nil)
	shared := longText(160) // 10 full blocks of shared prefix (with the chat framing)
	// Warm the decode worker's prefix cache with the shared prefix.
	if code, b := post(t, pd.dec.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":`+strconv.Quote(shared+" warm")+`}],"max_tokens":1}`); code != 200 {
		t.Fatalf("warm: %d %s", code, b)
	}
	prompt := shared + longText(100)[:300]
	pre := prefillLeg(t, pd.pre, prompt)
	nBlocks := (pre.Usage.PromptTokens + 15) / 16
	code, b := post(t, pd.dec.URL()+"/v1/chat/completions", decodeBody(prompt, pre.KVTransferParams, 2, false))
	if code != 200 {
		t.Fatalf("decode: %d %s", code, b)
	}
	hits := metric(t, pd.dec, "vllm:prefix_cache_hits_total", "")
	pulled := metric(t, pd.dec, "kvrelay_sim_kv_pulled_blocks_total", "")
	if hits < 16*8 || pulled != float64(nBlocks)-hits/16 {
		t.Fatalf("decode: %v prefix-hit tokens, %v blocks pulled of %d", hits, pulled, nBlocks)
	}
	eventually(t, "prefill to free", func() bool { r, _ := pd.pre.Engine().HeldKV(); return r == 0 })

	// Every full block cached on decode: only the partial last block is read (vLLM reads
	// every block past the local prefix hit, and the hit never covers the last token).
	pre = prefillLeg(t, pd.pre, prompt)
	code, b = post(t, pd.dec.URL()+"/v1/chat/completions", decodeBody(prompt, pre.KVTransferParams, 2, false))
	if code != 200 {
		t.Fatalf("decode: %d %s", code, b)
	}
	if got := metric(t, pd.dec, "kvrelay_sim_kv_pulled_blocks_total", ""); got != pulled+1 {
		t.Fatalf("a prompt cached but for its last block pulled %v blocks", got-pulled)
	}
	eventually(t, "prefill to free", func() bool { r, _ := pd.pre.Engine().HeldKV(); return r == 0 })

	// Remote blocks that the prefix cache covers entirely: nothing to read, the notification
	// alone frees them (vLLM's full prefix hit), and the rest of the prompt prefills here.
	pre = prefillLeg(t, pd.pre, prompt)
	var params map[string]any
	json.Unmarshal(pre.KVTransferParams, &params)
	params["remote_block_ids"] = params["remote_block_ids"].([]any)[:3]
	few, _ := json.Marshal(params)
	code, b = post(t, pd.dec.URL()+"/v1/chat/completions", decodeBody(prompt, few, 2, false))
	if code != 200 {
		t.Fatalf("decode: %d %s", code, b)
	}
	if got := metric(t, pd.dec, "kvrelay_sim_kv_pulled_blocks_total", ""); got != pulled+1 {
		t.Fatalf("pulled %v blocks the prefix cache held", got-pulled-1)
	}
	eventually(t, "prefill to free on the notification alone", func() bool { r, _ := pd.pre.Engine().HeldKV(); return r == 0 })
	if metric(t, pd.pre, "kvrelay_sim_kv_freed_requests_total", `by="notification"`) != 3 {
		t.Fatal("not freed by notification")
	}
}

func TestDisaggTTFTIncludesModelledTransfer(t *testing.T) {
	const speedup, bs, bytesPerToken = 50, 16, 73728
	prompt := longText(400)
	var tokens int
	for _, slow := range []bool{false, true} {
		t.Run(fmt.Sprint("slow=", slow), func(t *testing.T) {
			bw := 50e9
			var modelled time.Duration
			if slow {
				// A bandwidth at which this prompt's blocks take 400 ms to move (after the speedup).
				blocks := (tokens + bs - 1) / bs
				bw = float64(blocks*bs*bytesPerToken) / (0.4 * speedup)
				modelled = 400 * time.Millisecond
			}
			pd := startPD(t, func(_ Role, c *WorkerConfig) {
				c.Engine.Timing.Speedup = speedup
				c.Engine.KVTransferBandwidth = bw
			})
			pre := prefillLeg(t, pd.pre, prompt)
			tokens = pre.Usage.PromptTokens
			start := time.Now()
			resp, err := http.Post(pd.dec.URL()+"/v1/chat/completions", "application/json", strings.NewReader(decodeBody(prompt, pre.KVTransferParams, 4, true)))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var ttft time.Duration
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if strings.Contains(sc.Text(), `"content":" `) {
					ttft = time.Since(start)
					break
				}
			}
			io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != 200 || ttft == 0 {
				t.Fatalf("decode stream: %d, ttft %v", resp.StatusCode, ttft)
			}
			engineTTFT := metric(t, pd.dec, "vllm:time_to_first_token_seconds_sum", "")
			modelledSum := metric(t, pd.dec, "kvrelay_sim_kv_pull_modelled_seconds_sum", "")
			t.Logf("bandwidth %.3g B/s: client TTFT %v, engine TTFT %.3fs, modelled transfer %.4fs", bw, ttft, engineTTFT, modelledSum)
			if slow {
				if ttft < modelled || engineTTFT < modelled.Seconds() || modelledSum < 0.39 || modelledSum > 0.41 {
					t.Fatalf("TTFT %v (engine %.3fs) with a modelled transfer of %.3fs: want at least %v", ttft, engineTTFT, modelledSum, modelled)
				}
			} else if modelledSum > 0.01 || engineTTFT > 0.3 {
				t.Fatalf("fast link: modelled %.4fs, engine TTFT %.3fs", modelledSum, engineTTFT)
			}
		})
	}
}

func TestDisaggPrefillTimeoutFreesBlocks(t *testing.T) {
	pd := startPD(t, func(_ Role, c *WorkerConfig) { c.Engine.KVTransferTimeout = 300 * time.Millisecond })
	pre := prefillLeg(t, pd.pre, longText(100))
	if r, b := pd.pre.Engine().HeldKV(); r != 1 || b == 0 {
		t.Fatalf("held %d requests, %d blocks", r, b)
	}
	if u := metric(t, pd.pre, "vllm:kv_cache_usage_perc", ""); u == 0 {
		t.Fatal("held blocks do not count as used")
	}
	start := time.Now()
	eventually(t, "the timeout to free the blocks", func() bool { r, _ := pd.pre.Engine().HeldKV(); return r == 0 })
	if waited := time.Since(start); waited > 2*time.Second {
		t.Fatalf("freed after %v with a 300ms timeout", waited)
	}
	if metric(t, pd.pre, "kvrelay_sim_kv_freed_requests_total", `by="timeout"`) != 1 || metric(t, pd.pre, "kvrelay_sim_kv_held_blocks", "") != 0 ||
		metric(t, pd.pre, "vllm:kv_cache_usage_perc", "") != 0 {
		t.Fatal("metrics do not show the timeout's release")
	}
	// A decoder that comes too late still reads the (unchanged) blocks; its notification
	// names nothing held, as vLLM logs "may have expired".
	if code, b := post(t, pd.dec.URL()+"/v1/chat/completions", decodeBody(longText(100), pre.KVTransferParams, 2, false)); code != 200 {
		t.Fatalf("late decode: %d %s", code, b)
	}
	eventually(t, "the late notification", func() bool {
		return metric(t, pd.pre, "kvrelay_sim_kv_unknown_notifications_total", "") == 1
	})
}

func TestDisaggPullFailures(t *testing.T) {
	pd := startPD(t, nil)
	prompt := longText(120)
	pre := prefillLeg(t, pd.pre, prompt)

	var params map[string]any
	json.Unmarshal(pre.KVTransferParams, &params)
	with := func(k string, v any) json.RawMessage {
		p := maps(params)
		p[k] = v
		b, _ := json.Marshal(p)
		return b
	}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	_, deadPort, _ := net.SplitHostPort(ln.Addr().String())
	ln.Close()
	dead, _ := strconv.Atoi(deadPort)

	cases := []struct {
		name   string
		prompt string
		params json.RawMessage
		stream bool
		status int
		reason string
	}{
		{"nobody listens", prompt, with("remote_port", dead), false, 503, "peer"},
		{"nobody listens, streaming", prompt, with("remote_port", dead), true, 503, "peer"},
		{"another engine at the address", prompt, with("remote_engine_id", "not-that-engine"), false, 503, "peer"},
		{"unknown host", prompt, with("remote_host", "no-such-host.invalid"), false, 400, "resolve"},
		{"blocks of another prompt", longText(121)[:len(prompt)-3] + "zzz", pre.KVTransferParams, false, 500, "checksum"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := metric(t, pd.dec, "kvrelay_sim_kv_pull_failures_total", `reason="`+c.reason+`"`)
			start := time.Now()
			code, b := post(t, pd.dec.URL()+"/v1/chat/completions", decodeBody(c.prompt, c.params, 4, c.stream))
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if code != c.status || json.Unmarshal(b, &e) != nil || e.Error.Code != c.status || e.Error.Message == "" {
				t.Fatalf("got %d %s, want %d with an OpenAI error", code, b, c.status)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("failing took %v", d)
			}
			if got := metric(t, pd.dec, "kvrelay_sim_kv_pull_failures_total", `reason="`+c.reason+`"`); got != before+1 {
				t.Fatalf("failures{reason=%q} went from %v to %v: %s", c.reason, before, got, b)
			}
			t.Logf("%d %s", code, e.Error.Message)
		})
	}
	if n := metric(t, pd.dec, "kvrelay_sim_kv_checksum_errors_total", ""); n != 1 {
		t.Fatalf("checksum errors %v", n)
	}
	// Failed requests give their blocks back.
	eventually(t, "decode blocks freed", func() bool { return metric(t, pd.dec, "vllm:kv_cache_usage_perc", "") == 0 })

	// A prefill worker that went away before the decode worker first reached it: the decode
	// leg fails at once and cleanly.
	gone := startWorker(t, func(c *WorkerConfig) { c.Engine.Role = RolePrefill })
	pre2 := prefillLeg(t, gone, longText(90))
	gone.Close()
	start := time.Now()
	code, b := post(t, pd.dec.URL()+"/v1/chat/completions", decodeBody(longText(90), pre2.KVTransferParams, 4, false))
	if code != 503 || time.Since(start) > 5*time.Second {
		t.Fatalf("dead prefill worker: %d %s after %v", code, b, time.Since(start))
	}
	// One that went away after the decode worker had mapped its memory (shared memory):
	// the READ may still succeed, from pages the mapping keeps alive, checked as always;
	// or the loss is seen and the request fails. Either way at once.
	pre3 := prefillLeg(t, pd.pre, longText(95))
	pd.pre.Close()
	start = time.Now()
	code, b = post(t, pd.dec.URL()+"/v1/chat/completions", decodeBody(longText(95), pre3.KVTransferParams, 4, false))
	if code != 503 && code != 200 || time.Since(start) > 5*time.Second {
		t.Fatalf("prefill worker closed after the decode connected: %d %s after %v", code, b, time.Since(start))
	}
	if n := metric(t, pd.dec, "kvrelay_sim_kv_checksum_errors_total", ""); n != 1 {
		t.Fatalf("checksum errors %v", n)
	}
}

func maps(m map[string]any) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func TestDisaggAbortDuringPull(t *testing.T) {
	const speedup = 50
	pd := startPD(t, func(_ Role, c *WorkerConfig) {
		c.Engine.Timing.Speedup = speedup
		c.Engine.KVTransferBandwidth = 1e6 // seconds of modelled transfer
	})
	pre := prefillLeg(t, pd.pre, longText(200))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", pd.dec.URL()+"/v1/chat/completions", strings.NewReader(decodeBody(longText(200), pre.KVTransferParams, 4, true)))
	req.Header.Set("Content-Type", "application/json")
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	eventually(t, "the pull to start", func() bool { return metric(t, pd.dec, "vllm:kv_cache_usage_perc", "") > 0 })
	cancel()
	<-done
	eventually(t, "the aborted pull's blocks to be freed", func() bool {
		return metric(t, pd.dec, "vllm:kv_cache_usage_perc", "") == 0 && metric(t, pd.dec, "vllm:num_requests_waiting", "") == 0
	})
	if n := metric(t, pd.dec, "vllm:request_abort_total", ""); n != 1 {
		t.Fatalf("aborts %v", n)
	}
}

func TestKVTransferParamsRejected(t *testing.T) {
	pd := startPD(t, nil)
	prompt := longText(40)
	ok := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}`
	huge := `[` + strings.Repeat("1,", 20000) + `1]`
	cases := map[string]string{
		"array":                `[]`,
		"string":               `"do_remote_prefill"`,
		"number":               `5`,
		"bool as string":       strings.Replace(ok, `"do_remote_prefill":true`, `"do_remote_prefill":"yes"`, 1),
		"decode as number":     `{"do_remote_decode":1}`,
		"both directions":      `{"do_remote_decode":true,"do_remote_prefill":true}`,
		"ids not an array":     strings.Replace(ok, `[0,1]`, `"0,1"`, 1),
		"string id":            strings.Replace(ok, `[0,1]`, `["a"]`, 1),
		"float id":             strings.Replace(ok, `[0,1]`, `[1.5]`, 1),
		"negative id":          strings.Replace(ok, `[0,1]`, `[-1]`, 1),
		"id beyond int32":      strings.Replace(ok, `[0,1]`, `[4294967296]`, 1),
		"huge id list":         strings.Replace(ok, `[0,1]`, huge, 1),
		"nested ids":           strings.Replace(ok, `[0,1]`, `[[0]]`, 1),
		"port as string":       strings.Replace(ok, `5600`, `"5600"`, 1),
		"port out of range":    strings.Replace(ok, `5600`, `70000`, 1),
		"port zero":            strings.Replace(ok, `5600`, `0`, 1),
		"port float":           strings.Replace(ok, `5600`, `5600.5`, 1),
		"host as number":       strings.Replace(ok, `"127.0.0.1"`, `127`, 1),
		"host with a path":     strings.Replace(ok, `"127.0.0.1"`, `"a/b"`, 1),
		"missing host":         strings.Replace(ok, `"remote_host":"127.0.0.1",`, ``, 1),
		"null engine id":       strings.Replace(ok, `"e"`, `null`, 1),
		"engine id as object":  strings.Replace(ok, `"e"`, `{}`, 1),
		"tp size zero":         strings.Replace(ok, `"tp_size":1`, `"tp_size":0`, 1),
		"unknown host":         strings.Replace(ok, `"127.0.0.1"`, `"no-such-host.invalid"`, 1),
		"truncated":            `{"do_remote_prefill":true,`,
		"request id too long":  strings.Replace(ok, `"r"`, strconv.Quote(strings.Repeat("r", 2000)), 1),
		"request id with NUL":  strings.Replace(ok, `"r"`, `"a\u0000b"`, 1),
		"ids as object":        strings.Replace(ok, `[0,1]`, `{"0":1}`, 1),
		"ids with trailing ,":  strings.Replace(ok, `[0,1]`, `[0,1,]`, 1),
		"remote_port negative": strings.Replace(ok, `5600`, `-1`, 1),
		"kv source not object": `{"remote_kv_source":"http://h:1"}`,
		"kv source no host":    `{"remote_kv_source":{"kv_request_id":"x","remote_port":1}}`,
		"kv source bad host":   `{"remote_kv_source":{"kv_request_id":"x","remote_host":"a/b","remote_port":1}}`,
		"kv source port 0":     `{"remote_kv_source":{"kv_request_id":"x","remote_host":"h","remote_port":0}}`,
		"kv source and P/D":    `{"do_remote_decode":true,"remote_kv_source":{"kv_request_id":"x","remote_host":"h","remote_port":1}}`,
		"max load negative":    `{"max_load_tokens":-1}`,
		"max load float":       `{"max_load_tokens":2.5}`,
	}
	names := make([]string, 0, len(cases))
	for n := range cases {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			body := `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":2,"kv_transfer_params":` + cases[name] + `}`
			for _, w := range []*Worker{pd.pre, pd.dec} {
				code, b := post(t, w.URL()+"/v1/chat/completions", body)
				if code != 400 || !bytes.Contains(b, []byte(`"code":400`)) {
					t.Fatalf("%s: %d %s", w.eng.cfg.Role, code, b)
				}
			}
		})
	}
	// A worker in role both ignores kv_transfer_params, as vLLM without a KV connector does.
	both := startWorker(t, nil)
	if code, b := post(t, both.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"kv_transfer_params":[]}`); code != 200 || bytes.Contains(b, []byte("kv_transfer_params")) {
		t.Fatalf("role both: %d %s", code, b)
	}
	// Null and absent remote fields with no blocks to pull prefill locally (vLLM does too).
	code, b := post(t, pd.dec.URL()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x y"}],"max_tokens":1,"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[]}}`)
	if code != 200 || !bytes.Contains(b, []byte(`"kv_transfer_params":null`)) {
		t.Fatalf("empty remote_block_ids: %d %s", code, b)
	}
}

func FuzzParseKVTransferParams(f *testing.F) {
	for _, s := range []string{
		`null`, `{}`, `[]`, `"x"`,
		`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`,
		`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1,2],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}`,
		`{"remote_block_ids":[1e3]}`, `{"remote_port":1e2}`, `{"do_remote_prefill":true,"remote_block_ids":[0],"remote_host":"[::1]","remote_port":1,"remote_engine_id":"e","remote_request_id":"r"}`,
		`{"remote_kv_source":{"kv_request_id":"p","remote_host":"10.0.0.2","remote_port":8000},"max_load_tokens":0}`,
		`{"remote_kv_source":{"remote_host":"[::1]","remote_port":1}}`,
		`{"remote_decoder":{"kv_request_id":"a"},"remote_kv_source":{"kv_request_id":"b","remote_host":"10.0.0.2","remote_port":5710}}`,
		`{"remote_prefiller":{"kv_request_id":"a","remote_host":"10.0.0.3","remote_port":5710}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, aerr := parseKVTransferParams(raw, 64)
		if aerr != nil {
			if p != nil || aerr.status != 400 {
				t.Fatalf("error %+v with params %+v", aerr, p)
			}
			return
		}
		if p == nil {
			return
		}
		if len(p.RemoteBlockIDs) > 64 || p.DoRemoteDecode && p.DoRemotePrefill || p.RemotePort < 0 || p.RemotePort > 65535 || p.TPSize < 1 ||
			p.FromPrefiller && (p.PeerFetch == "" || p.KVRequestID == "" || p.DoRemoteDecode) || p.ForDecoder && !p.DoRemoteDecode {
			t.Fatalf("accepted %+v from %q", p, raw)
		}
		for _, id := range p.RemoteBlockIDs {
			if id < 0 {
				t.Fatalf("negative id from %q", raw)
			}
		}
		if p.DoRemotePrefill && len(p.RemoteBlockIDs) > 0 && (p.RemoteHost == "" || p.RemotePort == 0 || p.RemoteEngineID == "" || p.RemoteRequestID == "") {
			t.Fatalf("a pull without its address from %q", raw)
		}
		if p.PeerFetch != "" {
			u, err := url.Parse(p.PeerFetch)
			if err != nil || u.Scheme != "http" || u.Hostname() == "" || u.Port() == "" || u.Path != "" {
				t.Fatalf("peer %q from %q is not http://host:port", p.PeerFetch, raw)
			}
		}
		if p.HasMaxLoad && p.MaxLoadTokens < 0 {
			t.Fatalf("negative max_load_tokens from %q", raw)
		}
	})
}

// jsonShape describes a JSON value's structure: object keys (recursively) and value types,
// array element shapes taken from the first element.
func jsonShape(v any) string {
	switch x := v.(type) {
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var b strings.Builder
		b.WriteString("{")
		for _, k := range keys {
			b.WriteString(k + ":" + jsonShape(x[k]) + ",")
		}
		return b.String() + "}"
	case []any:
		if len(x) == 0 {
			return "[]"
		}
		return "[" + jsonShape(x[0]) + "]"
	case string:
		return "string"
	case json.Number:
		if strings.ContainsAny(string(x), ".eE") {
			return "float"
		}
		return "int"
	case bool:
		return "bool"
	case nil:
		return "null"
	}
	return fmt.Sprintf("%T", v)
}

func readFixture(t *testing.T, name string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "nixl", name))
	if err != nil {
		t.Fatal(err)
	}
	return decodeJSON(t, b)
}

func decodeJSON(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
	return m
}

// TestNixlFixtures runs vLLM-shaped legs (testdata/nixl) through a prefill and a decode
// worker: the sim accepts the requests and answers with the fixtures' fields and types.
func TestNixlFixtures(t *testing.T) {
	// The decode request carries what vLLM's prefill answered; the sim reads every field.
	raw, _ := os.ReadFile(filepath.Join("testdata", "nixl", "decode_request.json"))
	req, err := decodeRequest(raw, true)
	if err != nil {
		t.Fatal(err)
	}
	p, aerr := parseKVTransferParams(req.KVTransferParams, 8192)
	if aerr != nil {
		t.Fatal(aerr)
	}
	want := kvTransferParams{DoRemotePrefill: true, RemoteEngineID: "3c1e6a52-7d0b-4f4e-9a51-2b8f0c6d9e13", RemoteRequestID: "chatcmpl-9f0c3a54a1e04d3b8a3c7d2e5b6f1a20",
		RemoteBlockIDs: []int{0, 1, 2, 3, 4}, RemoteHost: "127.0.0.1", RemotePort: 5600, TPSize: 1}
	if !slices.Equal(p.RemoteBlockIDs, want.RemoteBlockIDs) || p.RemoteEngineID != want.RemoteEngineID || p.RemoteRequestID != want.RemoteRequestID ||
		p.RemoteHost != want.RemoteHost || p.RemotePort != want.RemotePort || p.TPSize != 1 || !p.DoRemotePrefill || p.DoRemoteDecode {
		t.Fatalf("decode fixture parsed as %+v", p)
	}
	// The decode request's kv_transfer_params is the prefill response's.
	if a, b := jsonShape(readFixture(t, "prefill_response.json")["kv_transfer_params"]), jsonShape(readFixture(t, "decode_request.json")["kv_transfer_params"]); a != b {
		t.Fatalf("fixtures disagree: %s vs %s", a, b)
	}

	pd := startPD(t, nil)
	preReq, _ := os.ReadFile(filepath.Join("testdata", "nixl", "prefill_request.json"))
	code, body := post(t, pd.pre.URL()+"/v1/chat/completions", string(preReq))
	if code != 200 {
		t.Fatalf("prefill fixture: %d %s", code, body)
	}
	got, fixture := decodeJSON(t, body), readFixture(t, "prefill_response.json")
	for _, k := range []string{"id", "object", "model", "choices", "usage", "kv_transfer_params"} {
		if a, b := jsonShape(got[k]), jsonShape(fixture[k]); a != b {
			t.Errorf("prefill response %s: %s, fixture %s", k, a, b)
		}
	}

	decReq := readFixture(t, "decode_request.json")
	decReq["kv_transfer_params"] = got["kv_transfer_params"] // the live prefill worker's
	b, _ := json.Marshal(decReq)
	code, body = post(t, pd.dec.URL()+"/v1/chat/completions", string(b))
	if code != 200 {
		t.Fatalf("decode fixture: %d %s", code, body)
	}
	got, fixture = decodeJSON(t, body), readFixture(t, "decode_response.json")
	for _, k := range []string{"id", "object", "model", "choices", "usage", "kv_transfer_params"} {
		if a, b := jsonShape(got[k]), jsonShape(fixture[k]); a != b {
			t.Errorf("decode response %s: %s, fixture %s", k, a, b)
		}
	}
	if _, ok := got["kv_transfer_params"]; !ok {
		t.Error("decode response lacks kv_transfer_params: null")
	}
	eventually(t, "prefill to free", func() bool { r, _ := pd.pre.Engine().HeldKV(); return r == 0 })
}

func TestSlotContent(t *testing.T) {
	for _, n := range []int{1, 7, 8, 9, 64, 18432} {
		buf := make([]byte, n)
		fillSlot(buf, 42)
		if !checkSlot(buf, 42) || checkSlot(buf, 43) {
			t.Fatalf("size %d: content does not check against its own key only", n)
		}
		buf[n/2] ^= 1
		if checkSlot(buf, 42) {
			t.Fatalf("size %d: a flipped bit passes", n)
		}
	}
	// Keys: full blocks are their sequence hashes, a partial last block gets its own key
	// that depends on its tokens and the prefix.
	e, _, _ := newTestEngine(t, nil)
	p := prompt(40, 1)
	h := e.mustHashes(t, p)
	keys := blockKeys(nil, p, h, 16, &blockhash.Keys{}, 0, 3)
	if keys[0] != h[0] || keys[1] != h[1] || len(keys) != 3 || slices.Contains(h, keys[2]) {
		t.Fatalf("keys %x, hashes %x", keys, h)
	}
	q := slices.Clone(p)
	q[39]++
	if blockKeys(nil, q, h, 16, &blockhash.Keys{}, 2, 3)[0] == keys[2] || blockKeys(nil, p, h, 16, &blockhash.Keys{LoRA: "adapter"}, 2, 3)[0] == keys[2] {
		t.Fatal("a partial block's key ignores its tokens or extra keys")
	}
}

func TestCappedRegionSlots(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Role = RolePrefill
	cfg.NumGPUBlocks = 64
	cfg.KVRegionMaxBytes = int64(8 * cfg.SlotBytes()) // 8 slots for 64 blocks
	if cfg.RegionSlots() != 8 {
		t.Fatalf("slots %d", cfg.RegionSlots())
	}
	c := newKVConnector(cfg, "e", "127.0.0.1:0", "", nil)
	if err := c.start(); err != nil {
		t.Fatal(err)
	}
	defer c.close()
	if !c.pin([]int32{1, 2}, []uint64{10, 20}) {
		t.Fatal("pin")
	}
	if !c.pin([]int32{9}, []uint64{10}) { // slot 1 again, same content: shared
		t.Fatal("pinning the same content twice")
	}
	if c.pin([]int32{3, 10}, []uint64{30, 99}) { // slot 2 holds other content
		t.Fatal("pinned a slot held for other content")
	}
	if c.pins[3] != 0 {
		t.Fatal("a failed pin left slot 3 pinned")
	}
	if !c.publish([]int32{1, 2}, []uint64{10, 20}) || !checkSlot(c.mem.Bytes()[2*c.slotBytes:3*c.slotBytes], 20) {
		t.Fatal("publish")
	}
	// Pulls go to their block's slot, or any free one when it is taken.
	dest := c.reserve([]int32{4, 12, 1})
	if len(dest) != 3 || dest[0] != 4 || dest[1] == 4 || dest[2] == 1 || c.pins[dest[2]] != 0 {
		t.Fatalf("reserve: %v", dest)
	}
	if c.reserve([]int32{0, 1, 2, 3, 4, 5, 6, 7}) != nil {
		t.Fatal("reserved more slots than are free")
	}
	c.unreserve(dest, []uint64{1, 2, 3}, false)
	c.unpin([]int32{1, 2})
	c.unpin([]int32{9})
	if !c.pin([]int32{10}, []uint64{99}) {
		t.Fatal("slot 2 still pinned after unpin")
	}
}

func TestParseScale(t *testing.T) {
	for in, want := range map[string]float64{"1/64": 1.0 / 64, "0.015625": 1.0 / 64, " 1 / 2 ": 0.5, "1": 1} {
		if got, err := ParseScale(in); err != nil || got != want {
			t.Errorf("ParseScale(%q) = %v, %v", in, got, err)
		}
	}
	for _, in := range []string{"0", "2", "1/0", "-1/64", "x", "", "NaN"} {
		if _, err := ParseScale(in); err == nil {
			t.Errorf("ParseScale(%q) accepted", in)
		}
	}
	for name, mut := range map[string]func(*Config){
		"scale 0":        func(c *Config) { c.KVBytesScale = 0 },
		"scale 2":        func(c *Config) { c.KVBytesScale = 2 },
		"bytes 0":        func(c *Config) { c.KVBytesPerToken = 0 },
		"bandwidth 0":    func(c *Config) { c.KVTransferBandwidth = 0 },
		"timeout 0":      func(c *Config) { c.KVTransferTimeout = 0 },
		"region max 0":   func(c *Config) { c.KVRegionMaxBytes = 0 },
		"bandwidth -Inf": func(c *Config) { c.KVTransferBandwidth = math.Inf(-1) },
	} {
		c := DefaultConfig()
		c.Role = RoleDecode
		mut(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: accepted for role decode", name)
		}
		c.Role = RoleBoth // no connector: the settings are unused
		if err := c.Validate(); err != nil {
			t.Errorf("%s: role both: %v", name, err)
		}
	}
	c := DefaultConfig()
	if c.SlotBytes() != 16*73728/64 || c.RegionSlots() != c.NumGPUBlocks {
		t.Fatalf("default slot %d bytes, %d slots", c.SlotBytes(), c.RegionSlots())
	}
	c.Timing.Speedup = 10
	if d := c.ModelledTransfer(100); d < 235929*time.Nanosecond || d > 235930*time.Nanosecond { // 100 blocks of 1.18 MB at 50 GB/s, /10
		t.Fatalf("modelled transfer %v", d)
	}
}

// A prefill worker restarted on the same nixl port is a new engine: the old
// kv_transfer_params fail with 503 (their blocks died with it), the new ones work at once,
// although the decode worker had cached a connection to the old engine at that address.
// TCP only: over shared memory the decode worker's mapping of the old engine's memory
// outlives it, and a READ of it may still succeed (checked) until the loss is seen.
func TestDisaggPrefillRestart(t *testing.T) {
	tcp := []nixl.BackendKind{nixl.BackendTCP}
	dec := startWorker(t, func(c *WorkerConfig) {
		c.Engine.Role = RoleDecode
		c.KVTransferBackends = tcp
	})
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	prompt := longText(80)

	cfg := DefaultConfig()
	cfg.Role = RolePrefill
	cfg.Timing.Speedup = 50
	first, err := NewWorker(WorkerConfig{Engine: cfg, Listen: "127.0.0.1:0", Codec: &wordCodec{}, KVTransferListen: addr, KVTransferBackends: tcp})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := first.Start(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	pre := prefillLeg(t, first, prompt)
	if code, b := post(t, dec.URL()+"/v1/chat/completions", decodeBody(prompt, pre.KVTransferParams, 2, false)); code != 200 {
		t.Fatalf("decode from the first prefill engine: %d %s", code, b)
	}
	stale := prefillLeg(t, first, prompt+" again")
	cancel()
	<-done
	first.Close()

	second := startWorker(t, func(c *WorkerConfig) {
		c.Engine.Role = RolePrefill
		c.KVTransferListen = addr
		c.KVTransferBackends = tcp
	})
	if second.KVTransferAddr() != addr || second.EngineID() == first.EngineID() {
		t.Fatalf("restarted at %s as %s (was %s)", second.KVTransferAddr(), second.EngineID(), first.EngineID())
	}
	if code, b := post(t, dec.URL()+"/v1/chat/completions", decodeBody(prompt+" again", stale.KVTransferParams, 2, false)); code != 503 {
		t.Fatalf("params of the engine that left: %d %s", code, b)
	}
	pre = prefillLeg(t, second, prompt+" third")
	if code, b := post(t, dec.URL()+"/v1/chat/completions", decodeBody(prompt+" third", pre.KVTransferParams, 2, false)); code != 200 {
		t.Fatalf("decode from the restarted prefill engine: %d %s", code, b)
	}
}
