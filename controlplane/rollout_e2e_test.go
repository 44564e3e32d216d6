package controlplane_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// rolloutCluster is a cluster of n workers and two proxies whose control plane judges a
// rollout every 100 ms and settles 300 ms after a start, on clock (nil: the real one).
func rolloutCluster(t *testing.T, n int, clock func() time.Time) (*cluster, []string) {
	t.Helper()
	c := &cluster{t: t, workers: startWorkers(t, n), dataDir: t.TempDir(), cpOpts: func(o *controlplane.Options) {
		o.RolloutInterval, o.RolloutSettle, o.RolloutClock = 100*time.Millisecond, 300*time.Millisecond, clock
	}}
	for i, w := range c.workers {
		c.specs = append(c.specs, specOf(i, w.URL(), w.EventsEndpoint(), w.ReplayEndpoint()))
	}
	c.startControlPlane("127.0.0.1:0")
	var bases []string
	for range 2 {
		p := c.addProxy(c.xds)
		waitWorkers(t, p, n)
		bases = append(bases, "http://"+p.Addr())
	}
	return c, bases
}

// stepClock is a rollout clock that moves only when the test advances it: a step then
// ends after the requests the test waited for, however fast the machine serves them.
type stepClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *stepClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *stepClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// conversations sends, until stop closes, conversations of four turns over a fresh system
// prompt each (prompt(f) for the f-th), from one user per conversation (so each stays on
// one arm), each conversation through one proxy and the next through the other; they count
// what failed.
// A conversation keeps to its proxy so that every turn after the first finds its prompt
// in the index of the proxy that placed the first (its own record of the placement), not
// only once the engine's KV events have reached the other proxy: a cache-aware policy's
// hit rate then does not depend on how far those events lag on a loaded machine.
func conversations(t *testing.T, bases []string, prompt func(int) string, stop chan struct{}, failed *int64, mu *sync.Mutex) *sync.WaitGroup {
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for conv := 0; ; conv++ {
				f := 1000*g + conv
				for turn := range 4 {
					select {
					case <-stop:
						return
					default:
					}
					body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4, "user": fmt.Sprintf("user-%d", f),
						"messages": []map[string]string{{"role": "system", "content": prompt(f)}, {"role": "user", "content": fmt.Sprintf("turn %d", turn)}}})
					resp, err := http.Post(bases[f%len(bases)]+"/v1/chat/completions", "application/json", bytes.NewReader(body))
					if err == nil {
						resp.Body.Close()
					}
					if err != nil || resp.StatusCode != 200 {
						mu.Lock()
						*failed++
						mu.Unlock()
					}
				}
			}
		}()
	}
	return &wg
}

// shortPrompt is a system prompt of its own for conversation f, of about 70 blocks: a hit
// still covers nearly all of it, and a loaded machine under the race detector tokenizes and
// hashes it fast enough to serve a step's hundreds of requests in seconds.
func shortPrompt(f int) string {
	var sb strings.Builder
	for i := range 250 {
		fmt.Fprintf(&sb, "conversation%d word%d ", f, i)
	}
	return sb.String()
}

// waitRollout polls the rollout until it ends and returns it.
func (c *cluster) waitRollout(within time.Duration) map[string]any {
	c.t.Helper()
	return c.waitRolloutUntil(within, "end", func(r map[string]any) bool {
		switch r["state"] {
		case "promoted", "rolled_back", "aborted":
			return true
		}
		return false
	})
}

// waitRolloutUntil polls the rollout until done says what, and returns it.
func (c *cluster) waitRolloutUntil(within time.Duration, what string, done func(r map[string]any) bool) map[string]any {
	c.t.Helper()
	deadline := time.Now().Add(within)
	for {
		code, r := c.api("GET", "/v1/rollout", "", true)
		if code != 200 {
			c.t.Fatalf("GET /v1/rollout: %d %v", code, r)
		}
		if done(r) {
			return r
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("the rollout did not %s within %v: %v", what, within, r)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestRolloutRollsBackACacheBlindCandidate: a candidate that ignores the cache (latency
// policy, overlap weight 0) is tried on half the conversations after a shadow step, loses
// prefix hits against the stable policy, and is rolled back by the control plane alone;
// the shadow step saw it pick workers holding less of the prompt, and the policy is the
// stable one again everywhere.
//
// The rollout runs on a clock the test moves, so that each step is judged on a sample of a
// known least size rather than on what a loaded machine served in a stretch of wall time:
// the shadow step ends once the candidate has made shadowPicks picks, and the canary step,
// its time up at once, waits (inconclusive) for minRequests of each arm. On six workers the
// stable policy hits on three requests in four (every turn after a conversation's first),
// the cache-blind candidate on about one in three (a turn that lands by chance where an
// earlier one ran); on 200 requests of each the rank test at 0.01 misses that drop less
// than once in a million (none in two million draws of the two arms as independent
// requests, at the worst rates seen: 0.75 and 0.38). On three workers, with the 40 of each
// that a starved machine served in a step of 2.5 s of wall time, it missed it about one
// time in three, and the candidate was promoted.
func TestRolloutRollsBackACacheBlindCandidate(t *testing.T) {
	const shadowPicks, minRequests = 60, 200
	clock := &stepClock{now: time.Now()}
	c, bases := rolloutCluster(t, 6, clock.Now)
	_, before := c.api("GET", "/v1/policy", "", true)
	var failed int64
	var mu sync.Mutex
	stop := make(chan struct{})
	wg := conversations(t, bases, shortPrompt, stop, &failed, &mu)
	defer func() { close(stop); wg.Wait() }()
	code, r := c.api("POST", "/v1/rollout", fmt.Sprintf(`{"candidate": {"policy": "latency", "overlap_weight": 0, "queue_weight": 8, "cache_threshold": 0.1, "tier_weights": [1, 0.75, 0.25]},
		"spec": {"shadow_ms": 1000, "steps": [0.5, 1], "step_duration_ms": 1000, "min_requests": %d, "step_timeout_ms": 3600000, "alpha": 0.01}}`, minRequests), true)
	if code != 200 || r["state"] != "shadow" {
		t.Fatalf("starting: %d %v", code, r)
	}
	// While it runs the policy cannot be changed under it.
	if code, _ := c.api("PUT", "/v1/policy", `{"policy": "round-robin"}`, true); code != 409 {
		t.Fatalf("a policy change during a rollout: %d, want 409", code)
	}
	c.waitRolloutUntil(3*time.Minute, fmt.Sprintf("see %d shadow picks", shadowPicks), func(r map[string]any) bool {
		cur, _ := r["current"].(map[string]any)
		return r["state"] == "shadow" && jsonUint(cur["shadow_picks"]) >= shadowPicks
	})
	clock.Advance(time.Second) // the shadow step's time, and the settle after the start
	r = c.waitRolloutUntil(time.Minute, "leave the shadow step", func(r map[string]any) bool { return r["state"] != "shadow" })
	if r["state"] != "canary" || num(r["share"]) != 0.5 {
		t.Fatalf("after the shadow step: %v", r)
	}
	clock.Advance(time.Second) // the canary step's time: it is judged once each arm has minRequests
	r = c.waitRollout(3 * time.Minute)
	steps, _ := r["steps"].([]any)
	if r["state"] != "rolled_back" || len(steps) != 2 {
		t.Fatalf("the cache-blind candidate ended %v after %d steps: %v", r["state"], len(steps), r)
	}
	sh, canary := steps[0].(map[string]any), steps[1].(map[string]any)
	t.Logf("shadow: %v picks, overlap %.0f blocks against the stable's %.0f; canary: %v stable requests hitting %.2f, %v candidate ones %.2f",
		sh["shadow_picks"], num(sh["shadow_candidate_overlap"]), num(sh["shadow_stable_overlap"]),
		canary["stable_requests"], num(canary["stable_hit_rate"]), canary["candidate_requests"], num(canary["candidate_hit_rate"]))
	if jsonUint(sh["shadow_picks"]) < shadowPicks || num(sh["shadow_candidate_overlap"]) >= num(sh["shadow_stable_overlap"]) || num(sh["shadow_disagreement"]) == 0 {
		t.Fatalf("shadow step: %v; want the candidate's picks to hold less of the prompts", sh)
	}
	if reason, _ := canary["reason"].(string); canary["verdict"] != "fail" || !strings.HasPrefix(reason, "prefix hit rate") ||
		num(canary["candidate_hit_rate"]) >= num(canary["stable_hit_rate"]) ||
		jsonUint(canary["stable_requests"]) < minRequests || jsonUint(canary["candidate_requests"]) < minRequests {
		t.Fatalf("canary step: %v; want it failed on the prefix hit rate, judged on at least %d requests of each arm", canary, minRequests)
	}
	_, after := c.api("GET", "/v1/policy", "", true)
	if after["candidate"] != nil || after["version"] != before["version"] || num(after["overlap_weight"]) != num(before["overlap_weight"]) {
		t.Fatalf("after the rollback the policy is %v, was %v", after, before)
	}
	for _, p := range c.proxies {
		waitPolicy(t, p, jsonUint(after["version"]))
	}
	_, h := c.api("GET", "/v1/policy/history?limit=2", "", true)
	changes, _ := h["changes"].([]any)
	if len(changes) != 2 || changes[0].(map[string]any)["cause"] != "rollout 1 rolled_back" {
		t.Fatalf("history: %v", h)
	}
	mu.Lock()
	defer mu.Unlock()
	if failed != 0 {
		t.Fatalf("%d requests failed during the rollout", failed)
	}
}

// TestRolloutPromotesABetterCandidate: against a round-robin stable policy the cache-aware
// default wins its step and becomes the stable policy under its own version.
//
// The workers compute at the modelled speed (speedup 1), so that a prompt's uncached
// prefill takes tens of milliseconds longer than a cached one and the candidate's TTFT is
// lower for the cache it finds. At the harness's speedup of 50 that gain is about a
// millisecond, under the scheduling noise of a loaded machine, where the candidate's
// cache affinity (turns of a conversation queued on one worker) could leave its TTFT p90
// above 1.10 × the stable one's with the rank test calling it slower, and the step failed.
func TestRolloutPromotesABetterCandidate(t *testing.T) {
	defer func(s float64) { workerSpeedup = s }(workerSpeedup)
	workerSpeedup = 1
	c, bases := rolloutCluster(t, 3, nil)
	if code, r := c.api("PUT", "/v1/policy", `{"policy": "round-robin"}`, true); code != 200 {
		t.Fatalf("setting the stable policy: %d %v", code, r)
	}
	var failed int64
	var mu sync.Mutex
	stop := make(chan struct{})
	wg := conversations(t, bases, family, stop, &failed, &mu)
	defer func() { close(stop); wg.Wait() }()
	code, r := c.api("POST", "/v1/rollout", `{"candidate": {"policy": "latency", "overlap_weight": 64, "queue_weight": 8, "cache_threshold": 0.1, "tier_weights": [1, 0.75, 0.25]},
		"spec": {"steps": [0.5, 1], "step_duration_ms": 1500, "min_requests": 15, "step_timeout_ms": 30000}}`, true)
	if code != 200 || r["state"] != "canary" || num(r["share"]) != 0.5 {
		t.Fatalf("starting: %d %v", code, r)
	}
	cv := jsonUint(r["candidate_version"])
	r = c.waitRollout(60 * time.Second)
	if r["state"] != "promoted" {
		t.Fatalf("the better candidate ended %v: %v", r["state"], r)
	}
	_, p := c.api("GET", "/v1/policy", "", true)
	if p["policy"] != "latency" || jsonUint(p["version"]) != cv || p["candidate"] != nil {
		t.Fatalf("after the promotion the policy is %v, want latency at the candidate's version %d", p, cv)
	}
	for _, px := range c.proxies {
		waitPolicy(t, px, cv)
	}
}

// TestRolloutSurvivesAControlPlaneRestart: a control plane closed mid-rollout leaves the
// proxies on the split; the next one, on the same store, resumes the rollout at its step,
// and an abort then sends every request back to the stable policy.
func TestRolloutSurvivesAControlPlaneRestart(t *testing.T) {
	c, _ := rolloutCluster(t, 2, nil)
	code, r := c.api("POST", "/v1/rollout", `{"candidate": {"policy": "round-robin"}, "spec": {"steps": [0.25, 1], "step_duration_ms": 600000, "step_timeout_ms": 600000}}`, true)
	if code != 200 {
		t.Fatalf("starting: %d %v", code, r)
	}
	sv, cv := jsonUint(r["stable_version"]), jsonUint(r["candidate_version"])
	// The proxy had the stable version before the rollout began: wait for the candidate
	// itself, or the control plane may close before the proxy hears of it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if st, _ := c.proxies[0].XDSStats(); st.PolicyVersion == sv && st.CandidateVersion == cv && st.CandidateShare == 0.25 {
			break
		}
		if time.Now().After(deadline) {
			st, _ := c.proxies[0].XDSStats()
			t.Fatalf("the proxy never applied the rollout's split: %+v, want policy %d with candidate %d at 0.25", st, sv, cv)
		}
		time.Sleep(20 * time.Millisecond)
	}
	addr := c.xds
	if err := c.cp.Close(); err != nil {
		t.Fatal(err)
	}
	// Without the control plane the proxies keep the candidate and its share.
	time.Sleep(300 * time.Millisecond)
	if st, _ := c.proxies[0].XDSStats(); st.PolicyVersion != sv || st.CandidateVersion != cv || st.CandidateShare != 0.25 {
		t.Fatalf("without the control plane the proxy follows %+v, want policy %d with candidate %d at 0.25", st, sv, cv)
	}
	c.startControlPlane(addr)
	code, r = c.api("GET", "/v1/rollout", "", true)
	if code != 200 || r["state"] != "canary" || jsonUint(r["id"]) != 1 || num(r["share"]) != 0.25 || jsonUint(r["candidate_version"]) != cv {
		t.Fatalf("after the restart: %d %v", code, r)
	}
	if code, r = c.api("POST", "/v1/rollout/abort", "", true); code != 200 || r["state"] != "aborted" {
		t.Fatalf("abort: %d %v", code, r)
	}
	if code, r = c.api("POST", "/v1/rollout/resume", "", true); code != 409 {
		t.Fatalf("resuming an aborted rollout: %d %v, want 409", code, r)
	}
	_, p := c.api("GET", "/v1/policy", "", true)
	if p["candidate"] != nil || jsonUint(p["version"]) != sv {
		t.Fatalf("after the abort the policy is %v", p)
	}
	deadline = time.Now().Add(10 * time.Second)
	for {
		if st, _ := c.proxies[0].XDSStats(); st.CandidateVersion == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the proxy kept the aborted candidate")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func num(v any) float64 {
	f, _ := v.(float64)
	return f
}

// TestProfilePolicyReachesProxies: a policy given as a profile (filters, a weighted load
// scorer, a picker) is validated against the program's plugin registry, pushed, and built
// by the proxies, which route with it; one naming a plugin nobody registered is refused by
// the control plane, and one a proxy cannot build never replaces the policy it has.
func TestProfilePolicyReachesProxies(t *testing.T) {
	c := &cluster{t: t, workers: startWorkers(t, 2), dataDir: t.TempDir(), cpOpts: func(o *controlplane.Options) {
		o.ValidateProfile = route.Builtins().Validate
	}}
	for i, w := range c.workers {
		c.specs = append(c.specs, specOf(i, w.URL(), w.EventsEndpoint(), w.ReplayEndpoint()))
	}
	c.startControlPlane("127.0.0.1:0")
	p := c.addProxy(c.xds)
	waitWorkers(t, p, 2)
	code, got := c.api("PUT", "/v1/policy", `{"policy": "custom", "profile": {"filters": [{"name": "model"}, {"name": "health"}],
		"scorers": [{"name": "load", "weight": 2}], "picker": {"name": "min-cost", "params": {"temperature": 0}}}}`, true)
	if code != 200 {
		t.Fatalf("setting a profile: %d %v", code, got)
	}
	waitPolicy(t, p, jsonUint(got["version"]))
	if pol := p.RoutingPolicy(); pol.Name != "custom" || len(pol.Scorers) != 1 || pol.Scorers[0].Name() != "load" || pol.Picker.Name() != "min-cost" {
		t.Fatalf("the proxy routes with %+v", pol)
	}
	if r := chat(t, "http://"+p.Addr(), family(1), "profile"); r.status != 200 {
		t.Fatalf("chat under the profile: %d %s", r.status, r.body)
	}
	code, bad := c.api("PUT", "/v1/policy", `{"policy": "custom", "profile": {"scorers": [{"name": "gpu-temperature", "weight": 1}], "picker": {"name": "min-cost"}}}`, true)
	if msg := fmt.Sprint(bad); code != 400 || !strings.Contains(msg, `no scorer \"gpu-temperature\"`) && !strings.Contains(msg, `no scorer "gpu-temperature"`) {
		t.Fatalf("an unknown scorer: %d %v", code, bad)
	}
	if code, bad = c.api("PUT", "/v1/policy", `{"policy": "kv", "profile": {"picker": {"name": "random"}}}`, true); code != 400 {
		t.Fatalf("a profile under a built-in name: %d %v", code, bad)
	}
	_, now := c.api("GET", "/v1/policy", "", true)
	if now["version"] != got["version"] {
		t.Fatalf("a refused profile changed the policy: %v", now)
	}
}
