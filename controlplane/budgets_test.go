package controlplane_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// budgetKeys writes a keys file of one tenant, a, with the budget given (such as rps=10).
func budgetKeys(t *testing.T, budget string) string {
	t.Helper()
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-a tenant=a,"+budget+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return keys
}

// A fleet budget checkFleetBudget measures: a limit per second, and what one admitted
// request counts against it (1 for requests, the prompt tokens its answer reports for prompt
// tokens).
type fleetBudget struct {
	limit float64
	cost  func(usage promptUsage) float64
}

type promptUsage struct {
	Usage struct {
		PromptTokens int `json:"prompt_tokens"`
	} `json:"usage"`
}

var (
	tenRequests = fleetBudget{limit: 10, cost: func(promptUsage) float64 { return 1 }}
	// promptTokens: "hello" in the simulated engines' chat template is about 80 tokens, so
	// 200 tokens/s is two or three requests a second.
	promptTokens = fleetBudget{limit: 200, cost: func(u promptUsage) float64 { return float64(u.Usage.PromptTokens) }}
)

// checkFleetBudget sends tenant a's requests open loop, 30 a second at the first proxy and
// 10 at the second, for a warm-up of 3 s and a window of 5 s, and fails t unless the proxies
// admitted between them within the window about the tenant's limit of 10 a second. Each
// proxy on its own would admit its whole limit: 10/s at the first and all 10/s of the
// second's, twice the fleet's limit. The shares follow the demand within a second or two;
// the bounds allow a bucket's burst besides.
func checkFleetBudget(t *testing.T, ps [2]*proxy.Server, b fleetBudget) {
	t.Helper()
	limit := b.limit
	const warmup, window = 3 * time.Second, 5 * time.Second
	start := time.Now()
	measureFrom, end := start.Add(warmup), start.Add(warmup+window)
	var mu sync.Mutex
	var admitted float64
	var refused, other atomic.Int64
	var wg sync.WaitGroup
	for i, rate := range []float64{30, 10} {
		base := "http://" + ps[i].Addr()
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
			defer tick.Stop()
			for now := range tick.C {
				if now.After(end) {
					return
				}
				counted := now.After(measureFrom)
				wg.Add(1)
				go func() {
					defer wg.Done()
					req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions",
						strings.NewReader(`{"model":"`+model+`","max_tokens":1,"messages":[{"role":"user","content":"hello"}]}`))
					req.Header.Set("Authorization", "Bearer sk-a")
					req.Header.Set("Content-Type", "application/json")
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						other.Add(1)
						return
					}
					var u promptUsage
					_ = json.NewDecoder(resp.Body).Decode(&u)
					resp.Body.Close()
					if !counted {
						return
					}
					switch resp.StatusCode {
					case http.StatusOK:
						mu.Lock()
						admitted += b.cost(u)
						mu.Unlock()
					case http.StatusTooManyRequests:
						refused.Add(1)
					default:
						other.Add(1)
					}
				}()
			}
		}()
	}
	wg.Wait()
	want := limit * window.Seconds()
	got := admitted
	t.Logf("admitted %v in %v (the fleet's limit: %v), refused %d, failed %d", got, window, want, refused.Load(), other.Load())
	if other.Load() > 0 {
		t.Errorf("%d requests failed otherwise than 429", other.Load())
	}
	if got > 1.3*want || got < 0.6*want {
		t.Fatalf("the two proxies admitted %v in %v; the fleet's limit is %v", got, window, want)
	}
}

// A tenant's limit is the fleet's: two proxies following one control plane admit the limit
// between them, not twice it, though one of them is asked three times what the other is.
func TestFleetBudgetAcrossProxies(t *testing.T) {
	for _, tc := range []struct {
		name, budget string
		b            fleetBudget
	}{{"requests", "rps=10", tenRequests}, {"prompt tokens", "prompt_tps=200", promptTokens}} {
		t.Run(tc.name, func(t *testing.T) {
			keys := budgetKeys(t, tc.budget)
			c := newCluster(t, 2)
			var ps [2]*proxy.Server
			for i := range ps {
				ps[i] = c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.APIKeysFile = keys })
				waitWorkers(t, ps[i], 2)
			}
			checkFleetBudget(t, ps, tc.b)
			checkTenantsView(t, c)
		})
	}
}

// checkTenantsView fails t unless the control plane's operator API shows tenant a served by
// two proxies, with requests admitted and refused.
func checkTenantsView(t *testing.T, c *cluster) {
	t.Helper()
	code, out := c.api("GET", "/v1/tenants", "", true)
	ts, _ := out["tenants"].([]any)
	if code != 200 || len(ts) != 1 {
		t.Fatalf("GET /v1/tenants: %d %v", code, out)
	}
	a, _ := ts[0].(map[string]any)
	if a["name"] != "a" || jsonUint(a["proxies"]) != 2 || jsonUint(a["admitted"]) == 0 || jsonUint(a["refused"]) == 0 {
		t.Fatalf("tenant a as the control plane sees it: %v", a)
	}
}

// And across control-plane replicas: the two proxies follow two replicas on a real API
// server, which share what their proxies' tenants asked.
func TestFleetBudgetAcrossReplicas(t *testing.T) {
	keys := budgetKeys(t, "rps=10")
	lead, follow := haPair(t, 3*time.Second)
	var ps [2]*proxy.Server
	for i, r := range []haReplica{lead, follow} {
		ps[i] = r.c.addProxyWith(r.c.cp.XDSAddr(), func(cfg *proxy.Config) {
			cfg.APIKeysFile = keys
			cfg.NodeID = "proxy-of-" + r.e.Identity() // each replica's harness names its first proxy proxy-0
		})
		waitWorkers(t, ps[i], 4)
	}
	checkFleetBudget(t, ps, tenRequests)
	checkTenantsView(t, follow.c) // the other replica's proxy too
}

// askAs sends a chat completion to the proxy at base with the API key given ("": none) and
// returns the status.
func askAs(t *testing.T, base, key string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions",
		strings.NewReader(`{"model":"`+model+`","max_tokens":1,"messages":[{"role":"user","content":"hello"}]}`))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// eventuallyStatus waits until the proxy at base answers key's request with want.
func eventuallyStatus(t *testing.T, base, key string, want int, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := askAs(t, base, key)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d, want %d", what, got, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestAPIKeysFromOperator: keys given through the operator API reach every proxy. A proxy
// with no keys file starts checking keys once it has one and stops when the last is taken
// away; a proxy with a keys file takes them beside its file's, and refuses (NACKs) keys that
// contradict its file while keeping those in force. The API never shows a key.
func TestAPIKeysFromOperator(t *testing.T) {
	c := newCluster(t, 1)
	open := c.addProxy(c.xds)
	fileKeys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(fileKeys, []byte("sk-file tenant=files\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	withFile := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.APIKeysFile = fileKeys })
	waitWorkers(t, open, 1)
	waitWorkers(t, withFile, 1)
	a, b := "http://"+open.Addr(), "http://"+withFile.Addr()
	if got := askAs(t, a, ""); got != 200 {
		t.Fatalf("no keys anywhere: %d, want 200", got)
	}

	code, out := c.api("PUT", "/v1/keys/ci", `{"key": "sk-ci", "tenant": "acme", "rps": 100}`, true)
	if sum := sha256.Sum256([]byte("sk-ci")); code != 200 || out["sha256"] != hex.EncodeToString(sum[:]) || (out["key"] != nil && out["key"] != "") {
		t.Fatalf("PUT /v1/keys/ci: %d %v", code, out)
	}
	eventuallyStatus(t, a, "", 401, "the proxy without a keys file, a request without a key, once the control plane has keys")
	if got := askAs(t, a, "sk-ci"); got != 200 {
		t.Fatalf("the operator's key at the proxy without a file: %d", got)
	}
	eventuallyStatus(t, b, "sk-ci", 200, "the operator's key at the proxy with a file")
	if got := askAs(t, b, "sk-file"); got != 200 {
		t.Fatalf("the file's key beside the operator's: %d", got)
	}
	code, out = c.api("GET", "/v1/keys", "", true)
	if keys, _ := out["keys"].([]any); code != 200 || len(keys) != 1 || strings.Contains(fmt.Sprint(out), "sk-ci") {
		t.Fatalf("GET /v1/keys: %d %v", code, out)
	}

	// A key giving tenant files a budget its file does not: the proxy with the file refuses
	// the control plane's keys and keeps those in force; the other takes them.
	if code, out := c.api("PUT", "/v1/keys/files-2", `{"key": "sk-files-2", "tenant": "files", "rps": 5}`, true); code != 200 {
		t.Fatalf("PUT /v1/keys/files-2: %d %v", code, out)
	}
	eventuallyStatus(t, a, "sk-files-2", 200, "the second key at the proxy without a file")
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, _ := withFile.XDSStats()
		if st.ADS.NACKs > 0 && strings.Contains(st.ADS.LastNACK, "API keys") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the proxy with a keys file never refused the contradicting keys: %+v", st.ADS)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := askAs(t, b, "sk-files-2"); got != 401 {
		t.Fatalf("a key contradicting the keys file: %d, want 401 (refused)", got)
	}
	if got := askAs(t, b, "sk-ci"); got != 200 {
		t.Fatalf("after refusing the control plane's new keys, its earlier key: %d, want 200", got)
	}
	// Keys that contradict each other never reach the store.
	if code, _ := c.api("PUT", "/v1/keys/ci-2", `{"key": "sk-ci-2", "tenant": "acme", "rps": 7}`, true); code != 409 {
		t.Fatalf("a key giving acme other budgets than its other key: %d, want 409", code)
	}

	for _, id := range []string{"ci", "files-2"} {
		if code, out := c.api("DELETE", "/v1/keys/"+id, "", true); code != 200 {
			t.Fatalf("DELETE /v1/keys/%s: %d %v", id, code, out)
		}
	}
	eventuallyStatus(t, a, "", 200, "the proxy without a file once the last key is gone")
	eventuallyStatus(t, b, "sk-ci", 401, "a removed key at the proxy with a file")
	if got := askAs(t, b, "sk-file"); got != 200 {
		t.Fatalf("the file's key after the control plane's are gone: %d", got)
	}
}

// TestTenantsSplitTheIndex: the same prompt from two tenants is two chains of blocks in the
// control plane's index (each tenant's salt in every block's hash), and a tenant's repeat
// adds none and is cached.
func TestTenantsSplitTheIndex(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(keys, []byte("sk-a tenant=a\nsk-b tenant=b\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := newCluster(t, 1)
	p := c.addProxyWith(c.xds, func(cfg *proxy.Config) { cfg.APIKeysFile = keys })
	waitWorkers(t, p, 1)
	ask := func(key string) int {
		t.Helper()
		r := chatWith(t, "http://"+p.Addr(), model, "", key, family(3), "the same question")
		if r.status != 200 {
			t.Fatalf("tenant %s: %d %s", key, r.status, r.body)
		}
		return r.cached
	}
	// stable waits until the index holds at least n blocks and stops growing.
	stable := func(n int) int {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for last, same := -1, 0; ; {
			l := c.cp.Index().Len()
			if l >= n && l == last {
				if same++; same >= 3 {
					return l
				}
			} else {
				same = 0
			}
			if time.Now().After(deadline) {
				t.Fatalf("the index holds %d blocks, want at least %d", l, n)
			}
			last = l
			time.Sleep(100 * time.Millisecond)
		}
	}
	ask("sk-a")
	one := stable(100) // a family's prompt is about 180 blocks
	if n := ask("sk-b"); n != 0 {
		t.Fatalf("tenant b's request hit tenant a's cache: %d cached tokens", n)
	}
	two := stable(one + 100)
	if two < 2*one-2 {
		t.Fatalf("the index holds %d blocks after tenant b's request, %d after a's: want two chains", two, one)
	}
	if n := ask("sk-a"); n == 0 {
		t.Fatal("tenant a's repeat: no cached tokens")
	}
	if again := stable(two); again != two {
		t.Fatalf("tenant a's repeat grew the index from %d to %d blocks", two, again)
	}
	t.Logf("the index: %d blocks after tenant a's prompt, %d after tenant b's same prompt", one, two)
}
