//go:build linux

package controlplane_test

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/internal/testbin"
)

// The failovers an operator cares about, on a real API server with the leader in a kvrelay
// process of its own: killed with SIGKILL (no Lease release, no deferred cleanup), and
// frozen with SIGSTOP past its Lease, then continued.

// TestMain removes the kvrelay binary the failover tests built.
func TestMain(m *testing.M) {
	code := m.Run()
	testbin.Remove()
	os.Exit(code)
}

// cpProcess is a control-plane replica run as `kvrelay controlplane`: a process a test can
// kill or freeze.
type cpProcess struct {
	id       string
	pid      int
	xds, api string
	out      *testbin.Output
	exited   chan struct{}
	client   *http.Client // for its operator API: a frozen process answers nothing
}

// startProcess runs replica id as a kvrelay process with the flags of a chart's replica:
// its state in kvrelay.io resources (--store kubernetes) and the Lease electing the leader
// (--leader-elect) with the environment's Lease duration, the environment's workers, the
// operator API token "secret". It reaches the API server with kubeconfig ("": the
// environment's). It returns once the process serves.
func (h *haEnv) startProcess(id, kubeconfig string) *cpProcess {
	t := h.t
	t.Helper()
	if kubeconfig == "" {
		kubeconfig = h.env.Kubeconfig(t)
	}
	bin, err := testbin.Kvrelay()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	token := filepath.Join(dir, "api-token")
	if err := os.WriteFile(token, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	args := []string{"controlplane", "--kubeconfig", kubeconfig,
		"--store", "kubernetes", "--store-namespace", "kvrelay", "--store-name", "kvrelay",
		"--leader-elect", "--leader-elect-namespace", "kvrelay", "--leader-elect-identity", id,
		"--leader-elect-lease-duration", h.lease.String(), "--leader-elect-renew-deadline", "2s", "--leader-elect-retry-period", "250ms",
		"--xds-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0", "--api-token-file", token,
		"--scrape-interval", "50ms", "--ebpf", "off"}
	for _, w := range h.specs {
		args = append(args, "--worker", fmt.Sprintf("id=%s,url=%s,block-size=%d,engine=%s,kv-events=%s,kv-events-replay=%s",
			w.ID, w.URL, w.BlockSize, w.Engine, w.KVEvents, w.KVEventsReplay))
	}
	p := &cpProcess{id: id, out: new(testbin.Output), exited: make(chan struct{}), client: &http.Client{Timeout: 10 * time.Second}}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = p.out, p.out
	// Gone with the test, whatever becomes of the test.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting replica %s: %v", id, err)
	}
	p.pid = cmd.Process.Pid
	go func() { _ = cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		// A frozen process is continued first, so that it can stop.
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			t.Logf("replica %s (pid %d) output:\n%s", id, p.pid, p.out)
		}
	})
	// The line it prints once serving names its listeners.
	serving := regexp.MustCompile(`kvrelay control plane: xds (\S+)\s+api http://(\S+)`)
	deadline := time.Now().Add(60 * time.Second)
	for {
		if m := serving.FindStringSubmatch(p.out.String()); m != nil {
			p.xds, p.api = m[1], m[2]
			return p
		}
		select {
		case <-p.exited:
			t.Fatalf("replica %s exited before serving:\n%s", id, p.out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica %s not serving within a minute:\n%s", id, p.out)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// call calls the replica's operator API with the token; an error is its own (the replica
// killed, or frozen past the client's timeout).
func (p *cpProcess) call(method, path, body string, h map[string]string) (int, map[string]any, error) {
	if h == nil {
		h = map[string]string{}
	}
	if _, ok := h["Authorization"]; !ok {
		h["Authorization"] = "Bearer secret"
	}
	return callAPI(p.client, p.api, method, path, body, h)
}

// signal sends sig to the replica's process.
func (p *cpProcess) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(p.pid, sig); err != nil {
		t.Fatalf("%v to replica %s (pid %d): %v", sig, p.id, p.pid, err)
	}
}

// stopped reports whether the replica's process is stopped (SIGSTOP took effect).
func (p *cpProcess) stopped() bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(p.pid) + "/stat")
	if err != nil {
		return false
	}
	// pid (comm) state ...: the command may hold spaces and parentheses, the state follows
	// the last ')'.
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && len(b) > i+2 && b[i+2] == 'T'
}

// freeze stops the replica's process with SIGSTOP and waits until it is stopped.
func (p *cpProcess) freeze(t *testing.T) {
	t.Helper()
	p.signal(t, syscall.SIGSTOP)
	waitFor(t, "replica "+p.id+" stopped", 10*time.Second, p.stopped)
}

// waitFor polls ok every 20 ms until it holds, failing the test after within; it returns
// how long that took.
func waitFor(t *testing.T, what string, within time.Duration, ok func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !ok() {
		if time.Since(start) > within {
			t.Fatalf("%s: not within %s", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

// leaseHolder is the holder of the control plane's Lease and its term (leaderTransitions);
// "" and -1 when it has none or cannot be read.
func (h *haEnv) leaseHolder() (string, int64) {
	l, err := h.kube.CoordinationV1().Leases("kvrelay").Get(context.Background(), "kvrelay-controlplane", metav1.GetOptions{})
	if err != nil || l.Spec.HolderIdentity == nil {
		return "", -1
	}
	var term int64
	if l.Spec.LeaseTransitions != nil {
		term = int64(*l.Spec.LeaseTransitions)
	}
	return *l.Spec.HolderIdentity, term
}

// termWrite is one write to the shared state as the API server ordered it: the resource,
// its resourceVersion, and the leader terms it carries (-1: none) in its annotation (a
// write of its spec) and, for the KvrelayPolicy, in status.leaderTerm (a write of its
// status).
type termWrite struct {
	what               string
	rv                 uint64
	annotation, status int64
}

// term is the leader term the write was made in (-1: an unstamped write, a create).
func (w termWrite) term() int64 { return max(w.annotation, w.status) }

// watchTerms records every write to the control plane's policy, rollouts and workers from
// now on; the function it returns stops recording and returns them in the API server's
// order.
func watchTerms(t *testing.T, dyn dynamic.Interface) func() []termWrite {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var (
		mu     sync.Mutex
		writes []termWrite
		errs   []error
		wg     sync.WaitGroup
	)
	sel := metav1.ListOptions{LabelSelector: registry.StoreLabel + "=kvrelay"}
	for _, r := range []schema.GroupVersionResource{registry.PolicyResource, registry.RolloutResource, registry.WorkerResource} {
		c := dyn.Resource(r).Namespace("kvrelay")
		l, err := c.List(ctx, sel)
		if err != nil {
			t.Fatal(err)
		}
		rv := l.GetResourceVersion()
		wg.Go(func() {
			for ctx.Err() == nil {
				opts := sel
				opts.ResourceVersion = rv
				w, err := c.Watch(ctx, opts)
				if err != nil {
					if ctx.Err() == nil {
						mu.Lock()
						errs = append(errs, fmt.Errorf("watching %s: %w", r.Resource, err))
						mu.Unlock()
					}
					return
				}
				for ev := range w.ResultChan() {
					u, ok := ev.Object.(*unstructured.Unstructured)
					if !ok || ev.Type == watch.Error {
						if ctx.Err() == nil { // (not the end of the watch on stop)
							mu.Lock()
							errs = append(errs, fmt.Errorf("watching %s: %v", r.Resource, ev.Object))
							mu.Unlock()
						}
						w.Stop()
						return
					}
					rv = u.GetResourceVersion()
					if ev.Type == watch.Deleted || ev.Type == watch.Bookmark {
						continue
					}
					tw := termWrite{what: u.GetKind() + " " + u.GetName(), annotation: -1, status: -1}
					tw.rv, _ = strconv.ParseUint(rv, 10, 64)
					if v, err := strconv.ParseInt(u.GetAnnotations()[registry.TermAnnotation], 10, 64); err == nil {
						tw.annotation = v
					}
					if v, ok, _ := unstructured.NestedInt64(u.Object, "status", "leaderTerm"); ok {
						tw.status = v
					} else if _, ok := u.Object["status"]; ok && r == registry.PolicyResource {
						tw.status = 0 // written in term 0 (omitted: zero)
					}
					mu.Lock()
					writes = append(writes, tw)
					mu.Unlock()
				}
			}
		})
	}
	stop := sync.OnceValue(func() []termWrite {
		cancel()
		wg.Wait()
		for _, err := range errs {
			t.Error(err)
		}
		slices.SortFunc(writes, func(a, b termWrite) int { return cmp.Compare(a.rv, b.rv) })
		return writes
	})
	t.Cleanup(func() { stop() })
	return stop
}

// checkTerms fails the test when a write of one leader term landed after a write of a later
// one: on the same resource (its annotation or its status) or on any once the later term
// had written. It returns how many writes each term made.
func checkTerms(t *testing.T, writes []termWrite) map[int64]int {
	t.Helper()
	byTerm := map[int64]int{}
	latest := int64(-1)
	last := map[string][2]int64{}
	for _, w := range writes {
		if w.term() < 0 {
			continue
		}
		byTerm[w.term()]++
		if w.term() < latest {
			t.Errorf("%s written in term %d (resourceVersion %d) after a write of term %d", w.what, w.term(), w.rv, latest)
		}
		latest = max(latest, w.term())
		prev, seen := last[w.what]
		if !seen {
			prev = [2]int64{-1, -1}
		}
		if w.annotation >= 0 && w.annotation < prev[0] || w.status >= 0 && w.status < prev[1] {
			t.Errorf("%s written in term %d/%d (annotation/status, resourceVersion %d) over term %d/%d", w.what, w.annotation, w.status, w.rv, prev[0], prev[1])
		}
		last[w.what] = [2]int64{max(prev[0], w.annotation), max(prev[1], w.status)}
	}
	return byTerm
}

// judgedSteps are the steps a rollout of the operator API has judged.
func judgedSteps(r map[string]any) []any {
	s, _ := r["steps"].([]any)
	return s
}

// TestLeaderKilledMidRolloutStep: the leader, a kvrelay process, is killed with SIGKILL in
// the middle of a rollout's canary step, under traffic through a proxy that follows it (a
// Service in front of both replicas). The other replica takes over within about the Lease
// duration, goes on with the rollout from the step the dead leader recorded (the same
// rollout, the same step, its clock not reset) and ends the step when its own rules say so,
// the proxy moves to it and no request fails, and no write of the dead leader's term lands
// after the new leader's.
func TestLeaderKilledMidRolloutStep(t *testing.T) {
	const (
		lease = 3 * time.Second
		// The canary step's duration and timeout: it outlasts the kill and the takeover, then
		// ends inconclusive (its least requests are never reached) and, by the default
		// on_inconclusive, pauses.
		step = 12 * time.Second
	)
	h := newHAEnv(t, lease)
	a := h.startProcess("cp-0", "")
	waitFor(t, "cp-0 holds the Lease", 30*time.Second, func() bool { holder, _ := h.leaseHolder(); return holder == "cp-0" })
	b := h.start("cp-1", nil)
	p := b.c.addProxy(serviceRelay(t, a.xds, b.c.cp.XDSAddr()))
	waitWorkers(t, p, 4)
	load := clients(t, "http://"+p.Addr(), "the leader's death")
	load.await(10, "before the rollout")

	// The rollout, started on the leader (503 until it has taken over): a second of shadow,
	// then half the traffic to the candidate.
	var code int
	var out map[string]any
	waitFor(t, "the leader takes the rollout", 30*time.Second, func() bool {
		var err error
		code, out, err = a.call("POST", "/v1/rollout", fmt.Sprintf(`{"candidate": {"policy": "latency", "overlap_weight": 64, "queue_weight": 8, "cache_threshold": 0.1, "tier_weights": [1, 0.75, 0.25]},
			"spec": {"shadow_ms": 1000, "steps": [0.5, 1], "step_duration_ms": %d, "step_timeout_ms": %[1]d, "min_requests": 1000000}}`, step.Milliseconds()), nil)
		return err == nil && code != 503
	})
	if code != 200 || out["state"] != "shadow" {
		t.Fatalf("starting a rollout: %d %v", code, out)
	}
	id := jsonUint(out["id"])
	var ro map[string]any
	waitFor(t, "the follower shows the leader's canary step", 30*time.Second, func() bool {
		code, ro = b.c.api("GET", "/v1/rollout", "", true)
		return code == 200 && jsonUint(ro["id"]) == id && ro["state"] == "canary"
	})
	stepStart := jsonUint(ro["step_started_unix_ms"])
	if ro["step"] != 0.0 || stepStart == 0 || len(judgedSteps(ro)) != 1 {
		t.Fatalf("the canary step the leader recorded: %v", ro)
	}
	// The proxy routes the candidate's share before the kill.
	var version uint64
	waitFor(t, "the follower has the canary's policy", 10*time.Second, func() bool {
		_, pol := b.c.api("GET", "/v1/policy", "", true)
		version = jsonUint(pol["version"])
		return pol["candidate_share"] == 0.5
	})
	waitPolicy(t, p, version)
	load.await(10, "in the canary step")
	// Well into the step, so that the step's end, judged by either replica, could not be
	// mistaken for one judged from the kill.
	for time.Since(time.UnixMilli(int64(stepStart))) < 2*time.Second {
		load.await(1, "in the canary step")
	}
	holder, deadTerm := h.leaseHolder()
	if holder != "cp-0" || b.e.Leading() {
		t.Fatalf("before the kill the Lease is %s's, want cp-0's (cp-1 leading: %v)", holder, b.e.Leading())
	}
	terms := watchTerms(t, h.dyn)
	before, _ := p.XDSStats()

	killed := time.Now()
	a.signal(t, syscall.SIGKILL)
	<-a.exited
	if end := time.UnixMilli(int64(stepStart)).Add(step); !killed.Before(end) {
		t.Fatalf("the kill came after the step's end (%s): the machine is too slow for this test", end.Format(time.StampMilli))
	}
	took := waitFor(t, "cp-1 takes the lead", 2*lease+2*time.Second, b.e.Leading)
	acting := waitFor(t, "cp-1 takes over", 10*time.Second, b.c.cp.Acting) + took
	newTerm, _ := b.e.Term()
	t.Logf("the leader killed %s into the canary step; cp-1 led %s later and took changes after %s (lease %s), term %d after %d",
		killed.Sub(time.UnixMilli(int64(stepStart))).Round(time.Millisecond), took.Round(time.Millisecond), acting.Round(time.Millisecond), lease, newTerm, deadTerm)
	if newTerm <= deadTerm {
		t.Fatalf("the new leader's term %d is not after the dead leader's %d", newTerm, deadTerm)
	}

	// The new leader has the rollout where the dead one left it: the same rollout, the same
	// step, from the same start.
	code, ro = b.c.api("GET", "/v1/rollout", "", true)
	if code != 200 || jsonUint(ro["id"]) != id || ro["state"] != "canary" || ro["step"] != 0.0 || jsonUint(ro["step_started_unix_ms"]) != stepStart || len(judgedSteps(ro)) != 1 {
		t.Fatalf("after the takeover the rollout is %d %v, want rollout %d in canary step 0 from %d", code, ro, id, stepStart)
	}
	// The proxy follows the survivor, and requests go on through the takeover.
	waitFor(t, "the proxy follows cp-1", 15*time.Second, func() bool {
		st, _ := p.XDSStats()
		return st.ADS.Streams > before.ADS.Streams
	})
	load.await(10, "after the takeover")

	// The step ends when its own clock says, judged by the new leader: inconclusive at its
	// timeout, then paused for an operator.
	waitFor(t, "the canary step ends", step+30*time.Second, func() bool {
		code, ro = b.c.api("GET", "/v1/rollout", "", true)
		return code == 200 && ro["state"] != "canary"
	})
	steps := judgedSteps(ro)
	if jsonUint(ro["id"]) != id || ro["state"] != "paused" || len(steps) != 2 {
		t.Fatalf("the rollout after the step: %v, want rollout %d paused after 2 steps", ro, id)
	}
	judged, _ := steps[1].(map[string]any)
	start, end := jsonUint(judged["start_unix_ms"]), jsonUint(judged["end_unix_ms"])
	if judged["step"] != 0.0 || judged["verdict"] != "inconclusive" || start != stepStart || end < stepStart+uint64(step.Milliseconds()) {
		t.Fatalf("the canary step as judged: %v, want step 0 inconclusive from %d for at least %s", judged, stepStart, step)
	}
	t.Logf("the new leader ended the step %s after its start (duration %s): %s", time.Duration(end-start)*time.Millisecond, step, judged["reason"])
	_, pol := b.c.api("GET", "/v1/policy", "", true)
	if pol["candidate_share"] != 0.5 {
		t.Fatalf("the paused rollout's policy: %v, want the candidate's share held at 0.5", pol)
	}
	load.await(10, "after the step")
	sent, failed := load.stop()
	if failed != 0 {
		t.Fatalf("%d of %d requests failed across the leader's death", failed, sent)
	}

	// Nothing of the dead leader's term landed after the new leader wrote.
	byTerm := checkTerms(t, terms())
	if byTerm[newTerm] == 0 {
		t.Fatalf("no write of the new leader's term %d seen (writes by term: %v)", newTerm, byTerm)
	}
	obj, err := h.dyn.Resource(registry.RolloutResource).Namespace("kvrelay").Get(t.Context(), "kvrelay-"+strconv.FormatUint(id, 10), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := obj.GetAnnotations()[registry.TermAnnotation]; got != strconv.FormatInt(newTerm, 10) {
		t.Fatalf("the rollout's record was last written in term %s, want the new leader's %d", got, newTerm)
	}
	t.Logf("%d requests through the leader's death, none failed; writes seen from the kill on, by term: %v", sent, byTerm)
}

// TestFrozenLeaderCannotOverwrite: the leader, a kvrelay process, is frozen (SIGSTOP) past
// its Lease; the other replica takes over and changes the policy; a change reaches the
// frozen leader meanwhile. Continued (SIGCONT), the old leader does not make that change
// (refused: its fence finds the Lease moved on, or it already follows), steps down and
// follows, and the new leader's policy stands: no write of the old term lands after the new
// leader's.
func TestFrozenLeaderCannotOverwrite(t *testing.T) {
	const lease = 3 * time.Second
	h := newHAEnv(t, lease)
	a := h.startProcess("cp-0", "")
	waitFor(t, "cp-0 holds the Lease", 30*time.Second, func() bool { holder, _ := h.leaseHolder(); return holder == "cp-0" })
	var code int
	var out map[string]any
	waitFor(t, "the leader takes a policy change", 30*time.Second, func() bool {
		var err error
		code, out, err = a.call("PUT", "/v1/policy", `{"policy": "round-robin"}`, nil)
		return err == nil && code != 503
	})
	if code != 200 {
		t.Fatalf("PUT /v1/policy on the leader: %d %v", code, out)
	}
	old := jsonUint(out["version"])
	b := h.start("cp-1", nil)
	waitFor(t, "the follower has the leader's policy", 10*time.Second, func() bool {
		_, got := b.c.api("GET", "/v1/policy", "", true)
		return jsonUint(got["version"]) == old
	})
	_, oldTerm := h.leaseHolder()
	terms := watchTerms(t, h.dyn)

	stopped := time.Now()
	a.freeze(t)
	// A change that reaches the frozen leader, forwarded to it by a replica that still took it
	// for the leader (so it is not forwarded again): it waits in the frozen process's socket.
	type answer struct {
		code int
		out  map[string]any
		err  error
	}
	queued := make(chan answer, 1)
	go func() {
		c := &http.Client{Timeout: time.Minute}
		code, out, err := callAPI(c, a.api, "PUT", "/v1/policy", `{"policy": "random"}`,
			map[string]string{"Authorization": "Bearer secret", "X-Kvrelay-Forwarded-By": "cp-9"})
		queued <- answer{code, out, err}
	}()
	took := waitFor(t, "cp-1 takes the lead", 2*lease+2*time.Second, b.e.Leading)
	waitFor(t, "cp-1 takes over", 10*time.Second, b.c.cp.Acting)
	newTerm, _ := b.e.Term()
	code, out = b.c.api("PUT", "/v1/policy", `{"policy": "kv", "overlap_weight": 32, "queue_weight": 4, "cache_threshold": 0.2, "tier_weights": [1, 0.75, 0.25]}`, true)
	if code != 200 {
		t.Fatalf("PUT /v1/policy on the new leader: %d %v", code, out)
	}
	version := jsonUint(out["version"])
	frozen := time.Since(stopped)
	t.Logf("cp-1 led %s after cp-0 froze (lease %s), term %d after %d; cp-0 continued after %s", took.Round(time.Millisecond), lease, newTerm, oldTerm, frozen.Round(time.Millisecond))

	resumed := time.Now()
	a.signal(t, syscall.SIGCONT)
	var got answer
	select {
	case got = <-queued:
	case <-time.After(time.Minute):
		t.Fatal("the change sent to the frozen leader got no answer within a minute of its continuing")
	}
	if got.err != nil || got.code != 503 {
		t.Fatalf("the change sent to the frozen leader: %d %v (%v), want 503", got.code, got.out, got.err)
	}
	t.Logf("the change sent to the frozen leader, once continued: %d %v", got.code, got.out)
	// It steps down and follows the new leader.
	stepDown := waitFor(t, "cp-0 follows cp-1", 2*lease+5*time.Second, func() bool {
		code, ready, err := a.call("GET", "/readyz", "", nil)
		return err == nil && code == 200 && ready["role"] == "follower" && ready["leader"] == "cp-1"
	})
	t.Logf("cp-0 followed cp-1 %s after it continued", stepDown.Round(time.Millisecond))
	// The new leader's policy stands, on both replicas.
	waitFor(t, "cp-0 shows the new leader's policy", 10*time.Second, func() bool {
		_, pol, err := a.call("GET", "/v1/policy", "", nil)
		return err == nil && jsonUint(pol["version"]) == version
	})
	_, pol := b.c.api("GET", "/v1/policy", "", true)
	if jsonUint(pol["version"]) != version || pol["policy"] != "kv" || num(pol["overlap_weight"]) != 32 {
		t.Fatalf("the new leader's policy after the old one continued: %v, want kv at version %d", pol, version)
	}
	if !b.e.Leading() {
		t.Fatal("cp-1 no longer leads after cp-0 continued")
	}
	if holder, term := h.leaseHolder(); holder != "cp-1" || term != newTerm {
		t.Fatalf("after cp-0 continued the Lease is %s's in term %d, want cp-1's in term %d", holder, term, newTerm)
	}
	// A change sent to the old leader now goes to the new one, in its term.
	// A change sent to the old leader now goes to the new one, in its term (503 for the
	// moment it takes the old leader to stop acting once it follows).
	var err error
	waitFor(t, "a change sent to the old leader is forwarded", 10*time.Second, func() bool {
		code, out, err = a.call("PUT", "/v1/policy", `{"policy": "kv", "overlap_weight": 16, "queue_weight": 4, "cache_threshold": 0.2, "tier_weights": [1, 0.75, 0.25]}`, nil)
		return err != nil || code != 503
	})
	if err != nil || code != 200 || jsonUint(out["version"]) <= version {
		t.Fatalf("a change sent to the old leader after it followed: %d %v (%v), want it made by the new leader", code, out, err)
	}
	byTerm := checkTerms(t, terms())
	if byTerm[newTerm] == 0 {
		t.Fatalf("no write of the new leader's term %d seen (writes by term: %v)", newTerm, byTerm)
	}
	obj, err := h.dyn.Resource(registry.PolicyResource).Namespace("kvrelay").Get(t.Context(), "kvrelay", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if st, _, _ := unstructured.NestedInt64(obj.Object, "status", "leaderTerm"); st != newTerm {
		t.Fatalf("the KvrelayPolicy's status was last written in term %d, want the new leader's %d", st, newTerm)
	}
	t.Logf("writes seen from the freeze on, by term: %v (%s from continuing to following)", byTerm, time.Since(resumed).Round(time.Millisecond))
}

// cutRelay relays TCP connections to an address until cut: then it closes them and refuses
// new ones (a client fails at once, as on a host that lost its route), until restored. A
// replica that reaches the API server through it can be cut off from it.
type cutRelay struct {
	t      *testing.T
	target string
	addr   string
	mu     sync.Mutex
	ln     net.Listener // nil while cut
	conns  []net.Conn
}

func newCutRelay(t *testing.T, target string) *cutRelay {
	t.Helper()
	r := &cutRelay{t: t, target: target, addr: "127.0.0.1:0"}
	r.setCut(false)
	t.Cleanup(func() { r.setCut(true) })
	return r
}

// setCut cuts the relay (true) or restores it (false), on the same address.
func (r *cutRelay) setCut(cut bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cut {
		if r.ln != nil {
			r.ln.Close()
			r.ln = nil
		}
		for _, c := range r.conns {
			c.Close()
		}
		r.conns = nil
		return
	}
	if r.ln != nil {
		return
	}
	ln, err := net.Listen("tcp", r.addr)
	if err != nil {
		r.t.Fatal(err)
	}
	r.ln, r.addr = ln, ln.Addr().String()
	go func() {
		for {
			down, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", r.target)
			r.mu.Lock()
			if err != nil || r.ln != ln {
				r.mu.Unlock()
				down.Close()
				if up != nil {
					up.Close()
				}
				continue
			}
			r.conns = append(r.conns, down, up)
			r.mu.Unlock()
			pipe := func(dst, src net.Conn) { _, _ = io.Copy(dst, src); dst.Close() }
			go pipe(up, down)
			go pipe(down, up)
		}
	}()
}

// TestLeaderFrozenMidRenewalLeavesTheLease: the leader, a kvrelay process, loses the API
// server (a renewal of its Lease fails) and is frozen (SIGSTOP) before its renewal gives up,
// past its Lease; the other replica takes over and changes the policy. Continued (SIGCONT),
// the old leader finds its renewal out of time and stops leading, and it must not then
// release the Lease: the new leader holds it, in the term it won, and goes on taking changes.
func TestLeaderFrozenMidRenewalLeavesTheLease(t *testing.T) {
	const lease = 3 * time.Second
	h := newHAEnv(t, lease)
	// The old leader reaches the API server through a relay that can cut it off.
	api := newCutRelay(t, strings.TrimPrefix(h.env.Config().Host, "https://"))
	kc, err := clientcmd.LoadFromFile(h.env.Kubeconfig(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range kc.Clusters {
		c.Server = "https://" + api.addr // (the API server's certificate names 127.0.0.1)
	}
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		t.Fatal(err)
	}
	a := h.startProcess("cp-0", kubeconfig)
	waitFor(t, "cp-0 holds the Lease", 30*time.Second, func() bool { holder, _ := h.leaseHolder(); return holder == "cp-0" })
	b := h.start("cp-1", nil)

	// Cut off, the leader's renewal fails at once (client-go logs the failed read of the
	// Lease) and goes on trying for its renew deadline: it is frozen meanwhile.
	failures := strings.Count(a.out.String(), "Error retrieving lease lock")
	cut := time.Now()
	api.setCut(true)
	waitFor(t, "cp-0's renewal fails", 10*time.Second, func() bool {
		return strings.Count(a.out.String(), "Error retrieving lease lock") > failures
	})
	stopped := time.Now()
	a.freeze(t)
	t.Logf("cp-0 cut off from the API server, its renewal failed %s later, frozen %s later",
		stopped.Sub(cut).Round(time.Millisecond), time.Since(cut).Round(time.Millisecond))
	if out := a.out.String(); strings.Contains(out, "Failed to renew lease") || strings.Contains(out, "stopped leading") {
		t.Fatalf("cp-0 gave up its renewal before it was frozen (the machine is too slow for this test):\n%s", out)
	}
	api.setCut(false)
	took := waitFor(t, "cp-1 takes the lead", 2*lease+2*time.Second, b.e.Leading)
	waitFor(t, "cp-1 takes over", 10*time.Second, b.c.cp.Acting)
	newTerm, _ := b.e.Term()
	code, out := b.c.api("PUT", "/v1/policy", `{"policy": "kv", "overlap_weight": 32, "queue_weight": 4, "cache_threshold": 0.2, "tier_weights": [1, 0.75, 0.25]}`, true)
	if code != 200 {
		t.Fatalf("PUT /v1/policy on the new leader: %d %v", code, out)
	}
	t.Logf("cp-1 led %s after cp-0 froze mid-renewal (lease %s), term %d", took.Round(time.Millisecond), lease, newTerm)

	resumed := time.Now()
	a.signal(t, syscall.SIGCONT)
	stepDown := waitFor(t, "cp-0 follows cp-1", 2*lease+5*time.Second, func() bool {
		code, ready, err := a.call("GET", "/readyz", "", nil)
		return err == nil && code == 200 && ready["role"] == "follower" && ready["leader"] == "cp-1"
	})
	t.Logf("cp-0 followed cp-1 %s after it continued (frozen %s)", stepDown.Round(time.Millisecond), resumed.Sub(stopped).Round(time.Millisecond))
	// The new leader still holds the Lease in its term, and writes in it.
	code, out = b.c.api("PUT", "/v1/policy", `{"policy": "kv", "overlap_weight": 16, "queue_weight": 4, "cache_threshold": 0.2, "tier_weights": [1, 0.75, 0.25]}`, true)
	holder, term := h.leaseHolder()
	if code != 200 || holder != "cp-1" || term != newTerm || !b.e.Leading() {
		t.Fatalf("after cp-0 continued: a change on cp-1 %d %v; the Lease %q's in term %d (cp-1 leading: %v), want cp-1's in term %d\n%s",
			code, out, holder, term, b.e.Leading(), newTerm, a.out)
	}
	obj, err := h.dyn.Resource(registry.PolicyResource).Namespace("kvrelay").Get(t.Context(), "kvrelay", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if st, _, _ := unstructured.NestedInt64(obj.Object, "status", "leaderTerm"); st != newTerm {
		t.Fatalf("the KvrelayPolicy's status was last written in term %d, want the new leader's %d", st, newTerm)
	}
}
