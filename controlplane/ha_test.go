//go:build linux

package controlplane_test

import (
	"io"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/leader"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/internal/kubetest"
)

// haReplica is one control-plane replica of haPair.
type haReplica struct {
	c    *cluster
	e    *leader.Elector
	kube kubernetes.Interface // the API server both replicas share
	st   *registry.KubeStore  // its store of the shared state
}

// haEnv is what control-plane replicas share in these tests: a real API server with
// kvrelay.io's resources and the namespace kvrelay, and four simulated workers.
type haEnv struct {
	t       *testing.T
	env     *kubetest.Env
	lease   time.Duration
	kube    kubernetes.Interface
	dyn     dynamic.Interface
	workers []*sim.Worker
	specs   []registry.Worker
}

// newHAEnv starts the API server and the workers, for replicas whose Lease lasts lease.
func newHAEnv(t *testing.T, lease time.Duration) *haEnv {
	t.Helper()
	env := kubetest.Start(t)
	klog.SetOutput(io.Discard)
	klog.LogToStderr(false)
	env.InstallCRDs(t, "../hack/deploy/helm/kvrelay/crds/kvrelay.io.yaml")
	cs := env.Clientset(t)
	if _, err := cs.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kvrelay"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(env.Config())
	if err != nil {
		t.Fatal(err)
	}
	h := &haEnv{t: t, env: env, lease: lease, kube: cs, dyn: dyn, workers: startWorkers(t, 4)}
	for i, w := range h.workers {
		h.specs = append(h.specs, specOf(i, w.URL(), w.EventsEndpoint(), w.ReplayEndpoint()))
	}
	return h
}

// start starts the replica id, its state in kvrelay.io resources and the Lease electing the
// leader, with its options changed by opts (when not nil).
func (h *haEnv) start(id string, opts func(*controlplane.Options)) haReplica {
	t := h.t
	t.Helper()
	e, err := leader.New(leader.Config{Client: h.kube, Namespace: "kvrelay", Name: "kvrelay-controlplane", Identity: id,
		LeaseDuration: h.lease, RenewDeadline: 2 * time.Second, RetryPeriod: 250 * time.Millisecond, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	st, err := registry.OpenKube(h.dyn, "kvrelay", "kvrelay", 10*time.Second, quiet())
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, workers: h.workers, specs: h.specs, cpOpts: func(o *controlplane.Options) {
		o.Store, o.Leader, o.RolloutInterval = st, e, 100*time.Millisecond
		if opts != nil {
			opts(o)
		}
	}}
	c.startControlPlane("127.0.0.1:0")
	return haReplica{c, e, h.kube, st}
}

// haPair starts two control-plane replicas on a real API server, their state in kvrelay.io
// resources and a Lease (of duration lease) electing the leader, over four simulated
// workers, and returns them once one leads: the leader first.
func haPair(t *testing.T, lease time.Duration) (lead, follow haReplica) {
	t.Helper()
	h := newHAEnv(t, lease)
	a, b := h.start("cp-0", nil), h.start("cp-1", nil)
	deadline := time.Now().Add(2 * lease)
	for !a.e.Leading() && !b.e.Leading() {
		if time.Now().After(deadline) {
			t.Fatal("no replica leads")
		}
		time.Sleep(20 * time.Millisecond)
	}
	lead, follow = a, b
	if b.e.Leading() {
		lead, follow = b, a
	}
	// The leader takes changes once it has taken over (read the shared state afresh).
	for !lead.c.cp.Acting() {
		if time.Now().After(deadline) {
			t.Fatalf("%s leads but never took over", lead.e.Identity())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return lead, follow
}

// TestLeaderHandoverSharesState: two control-plane replicas on a real API server, their
// state in kvrelay.io resources (--store kubernetes) and a Lease electing the leader, one
// proxy behind a Service relay. The follower refuses writes and shows what the leader
// wrote: the policy, a running rollout. The leader is stopped under traffic: the follower
// takes over within the Lease duration, goes on with the rollout the old leader started
// (and can abort it), and no request through the proxy fails.
func TestLeaderHandoverSharesState(t *testing.T) {
	const lease = 3 * time.Second
	lead, follow := haPair(t, lease)
	p := lead.c.addProxy(serviceRelay(t, lead.c.cp.XDSAddr(), follow.c.cp.XDSAddr()))
	waitWorkers(t, p, 4)

	// Changes are the leader's: one sent to the follower is forwarded there (the leader
	// shared its operator API's address), a forwarded one is not forwarded again.
	eventually := func(what string, within time.Duration, ok func() bool) {
		t.Helper()
		deadline := time.Now().Add(within)
		for !ok() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within %s", what, within)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	var code int
	var out map[string]any
	eventually("the leader's operator API address shared", 5*time.Second, func() bool {
		code, out = follow.c.api("PUT", "/v1/policy", `{"policy": "round-robin"}`, true)
		return code != 503
	})
	if code != 200 || out["policy"] != "round-robin" {
		t.Fatalf("a change sent to the follower, forwarded: %d %v", code, out)
	}
	if code, out := follow.c.apiWith("PUT", "/v1/policy", `{"policy": "random"}`, map[string]string{"X-Kvrelay-Forwarded-By": "cp-x"}); code != 503 {
		t.Fatalf("the follower took a change already forwarded: %d %v", code, out)
	}
	if code, out := follow.c.api("PUT", "/v1/policy", `{"policy": "round-robin"}`, false); code != 401 {
		t.Fatalf("a change without the token, forwarded: %d %v", code, out)
	}
	code, out = lead.c.api("PUT", "/v1/policy", `{"policy": "kv", "overlap_weight": 32, "queue_weight": 4, "cache_threshold": 0.2, "tier_weights": [1, 0.75, 0.25]}`, true)
	if code != 200 {
		t.Fatalf("PUT /v1/policy on the leader: %d %v", code, out)
	}
	version := jsonUint(out["version"])
	waitPolicy(t, p, version)
	eventually("the follower has the leader's policy", 5*time.Second, func() bool {
		_, got := follow.c.api("GET", "/v1/policy", "", true)
		return jsonUint(got["version"]) == version && num(got["overlap_weight"]) == 32
	})
	// A rollout whose shadow step outlasts the test.
	code, out = lead.c.api("POST", "/v1/rollout", `{"candidate": {"policy": "latency", "overlap_weight": 64, "queue_weight": 8, "cache_threshold": 0.1, "tier_weights": [1, 0.75, 0.25]},
		"spec": {"shadow_ms": 600000, "steps": [0.5, 1], "step_duration_ms": 600000, "min_requests": 40}}`, true)
	if code != 200 || out["state"] != "shadow" {
		t.Fatalf("starting a rollout: %d %v", code, out)
	}
	rolloutID := jsonUint(out["id"])
	eventually("the follower shows the leader's rollout", 5*time.Second, func() bool {
		code, got := follow.c.api("GET", "/v1/rollout", "", true)
		return code == 200 && jsonUint(got["id"]) == rolloutID && got["state"] == "shadow"
	})

	// Requests all along, from two clients: none may fail.
	load := clients(t, "http://"+p.Addr(), "the handover")
	load.await(10, "before the leader stopped")
	stopped := time.Now()
	_ = lead.c.cp.Close()
	eventually("the follower takes over", lease+time.Second, follow.e.Leading)
	t.Logf("leadership moved %s after the leader stopped (lease %s)", time.Since(stopped).Round(time.Millisecond), lease)

	// The new leader goes on with the rollout and the policy the old one left.
	eventually("the new leader resumes the rollout", 5*time.Second, func() bool {
		code, got := follow.c.api("GET", "/v1/rollout", "", true)
		return code == 200 && jsonUint(got["id"]) == rolloutID && got["state"] == "shadow"
	})
	// It takes changes once it has taken over; until then it answers 503, as a follower.
	var abortCode int
	var abortOut map[string]any
	eventually("the new leader takes the abort", 5*time.Second, func() bool {
		abortCode, abortOut = follow.c.api("POST", "/v1/rollout/abort", "", true)
		return abortCode != 503
	})
	if abortCode != 200 || abortOut["state"] != "aborted" {
		t.Fatalf("aborting the rollout on the new leader: %d %v", abortCode, abortOut)
	}
	_, pol := follow.c.api("GET", "/v1/policy", "", true)
	if pol["candidate"] != nil || jsonUint(pol["version"]) != version || num(pol["overlap_weight"]) != 32 {
		t.Fatalf("after the abort the policy is %v, want the stable one at version %d", pol, version)
	}
	waitPolicy(t, p, version)
	load.await(10, "after the abort")
	sent, failed := load.stop()
	if failed != 0 {
		t.Fatalf("%d of %d requests failed across the handover", failed, sent)
	}
	t.Logf("%d requests through the handover, none failed", sent)
}

// TestReplicasShareArms: a proxy that follows the follower reports its rollout figures
// there; the leader judges the rollout with them (the follower shares its proxies' arms in a
// KvrelayShare), and the follower shows the same step figures.
func TestReplicasShareArms(t *testing.T) {
	lead, follow := haPair(t, 3*time.Second)
	p := follow.c.addProxy(follow.c.cp.XDSAddr())
	waitWorkers(t, p, 4)
	code, out := lead.c.api("POST", "/v1/rollout", `{"candidate": {"policy": "latency", "overlap_weight": 64, "queue_weight": 8, "cache_threshold": 0.1, "tier_weights": [1, 0.75, 0.25]},
		"spec": {"shadow_ms": 600000, "steps": [0.5, 1], "step_duration_ms": 600000, "min_requests": 40}}`, true)
	if code != 200 || out["state"] != "shadow" {
		t.Fatalf("starting a rollout: %d %v", code, out)
	}
	load := clients(t, "http://"+p.Addr(), "the rollout")
	stableRequests := func(r haReplica) uint64 {
		code, got := r.c.api("GET", "/v1/rollout", "", true)
		cur, _ := got["current"].(map[string]any)
		if code != 200 || cur == nil {
			return 0
		}
		return jsonUint(cur["stable_requests"])
	}
	deadline := time.Now().Add(20 * time.Second)
	for stableRequests(lead) < 20 {
		if time.Now().After(deadline) {
			t.Fatalf("the leader counts %d stable requests of the follower's proxy", stableRequests(lead))
		}
		time.Sleep(100 * time.Millisecond)
	}
	sent, failed := load.stop()
	if failed != 0 {
		t.Fatalf("%d of %d requests failed", failed, sent)
	}
	if n := stableRequests(follow); n < 20 {
		t.Fatalf("the follower shows %d stable requests", n)
	}
	t.Logf("the leader judges the rollout on %d requests it heard of from the follower (%d sent)", stableRequests(lead), sent)
}

// TestDeposedLeaderIsFenced: the leader pauses past its Lease (here: another holder takes
// the Lease behind its back) and, still believing it leads, takes a policy change. The
// write is fenced by the Lease on the API server: the client gets 503, the policy stays what
// it was, and nothing the old leader does reaches the shared state.
func TestDeposedLeaderIsFenced(t *testing.T) {
	lead, _ := haPair(t, 3*time.Second)
	code, out := lead.c.api("PUT", "/v1/policy", `{"policy": "kv", "overlap_weight": 32, "queue_weight": 4, "cache_threshold": 0.2, "tier_weights": [1, 0.75, 0.25]}`, true)
	if code != 200 {
		t.Fatalf("PUT /v1/policy on the leader: %d %v", code, out)
	}
	version := jsonUint(out["version"])

	// Another holder takes the Lease, on a fresh read each time the leader's renewal (every
	// 250 ms) got there first.
	leases := lead.kube.CoordinationV1().Leases("kvrelay")
	for attempt := 0; ; attempt++ {
		l, err := leases.Get(t.Context(), "kvrelay-controlplane", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		other, next, now := "cp-9", *l.Spec.LeaseTransitions+1, metav1.NewMicroTime(time.Now())
		l.Spec.HolderIdentity, l.Spec.LeaseTransitions, l.Spec.AcquireTime, l.Spec.RenewTime = &other, &next, &now, &now
		_, err = leases.Update(t.Context(), l, metav1.UpdateOptions{})
		if err == nil {
			break
		}
		if !apierrors.IsConflict(err) || attempt == 20 {
			t.Fatal(err)
		}
	}
	if !lead.e.Leading() {
		t.Fatal("the deposed leader noticed at once; the test needs it unaware")
	}
	code, out = lead.c.api("PUT", "/v1/policy", `{"policy": "round-robin"}`, true)
	if code != 503 {
		t.Fatalf("a deposed leader took a policy change: %d %v", code, out)
	}
	t.Logf("the deposed leader's write: %d %v", code, out)
	_, got := lead.c.api("GET", "/v1/policy", "", true)
	if jsonUint(got["version"]) != version || got["policy"] != "kv" {
		t.Fatalf("after the fenced write the policy is %v, want kv at version %d", got, version)
	}
}
