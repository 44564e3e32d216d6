package registry

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/kvrelay/kvrelay/internal/kubetest"
)

// crdFile is the chart's definition of the kvrelay.io resources, which the tests install.
const crdFile = "../../hack/deploy/helm/kvrelay/crds/kvrelay.io.yaml"

// kubeStoreEnv starts an API server with the kvrelay.io CRDs and a namespace "kvrelay".
func kubeStoreEnv(t *testing.T) dynamic.Interface {
	t.Helper()
	env := kubetest.Start(t)
	env.InstallCRDs(t, crdFile)
	if _, err := env.Clientset(t).CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kvrelay"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(env.Config())
	if err != nil {
		t.Fatal(err)
	}
	return dyn
}

func openKube(t *testing.T, dyn dynamic.Interface, name string) *KubeStore {
	t.Helper()
	s, err := OpenKube(dyn, "kvrelay", name, 10*time.Second, discard())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestKubeStore runs the Backend tests that the bbolt Store passes against custom resources
// in a real API server, each on a control plane of its own name in one namespace.
func TestKubeStore(t *testing.T) {
	dyn := kubeStoreEnv(t)
	t.Run("reopen", func(t *testing.T) {
		testBackendReopen(t, func() Backend { return openKube(t, dyn, "reopen") })
	})
	t.Run("default policy", func(t *testing.T) {
		s := openKube(t, dyn, "default")
		defer s.Close()
		testBackendDefaultPolicy(t, s)
	})
	t.Run("refuses", func(t *testing.T) {
		s := openKube(t, dyn, "refuses")
		defer s.Close()
		testBackendRefuses(t, s)
	})
	t.Run("history", func(t *testing.T) {
		s := openKube(t, dyn, "history")
		defer s.Close()
		testBackendHistory(t, s, MaxKubeHistory)
	})
	t.Run("worker ids", func(t *testing.T) {
		// Ids that are not DNS labels get resources of their own all the same.
		s := openKube(t, dyn, "ids")
		defer s.Close()
		ids := []string{"Worker_1", "worker-1", "w/1", "a.b:8000", strings.Repeat("x", 300)}
		for _, id := range ids {
			if err := s.PutWorker(Worker{ID: id, URL: "http://h:1"}); err != nil {
				t.Fatalf("PutWorker(%q): %v", id, err)
			}
		}
		ws, err := s.Workers()
		if err != nil || len(ws) != len(ids) {
			t.Fatalf("Workers() = %d workers, %v; want %d", len(ws), err, len(ids))
		}
	})
	t.Run("shares", func(t *testing.T) {
		// A replica's share is listed by replica and owned by its pod, so that it goes when
		// the pod does.
		s := openKube(t, dyn, "shares")
		defer s.Close()
		s.SetShareOwner("cp-0", "0b6c4bb5-6a10-4d9a-9e3e-5d0b1c2a3f40")
		for _, v := range []string{`{"v":1}`, `{"v":2}`} {
			if err := s.PutShare("arms", "cp-0", []byte(v)); err != nil {
				t.Fatal(err)
			}
		}
		got, err := s.Shares(t.Context(), "arms")
		if err != nil || string(got["cp-0"]) != `{"v":2}` || len(got) != 1 {
			t.Fatalf("Shares = %q, %v; want cp-0's latest", got, err)
		}
		cms, err := dyn.Resource(ShareResource).Namespace("kvrelay").List(t.Context(), metav1.ListOptions{LabelSelector: ShareLabel + "=arms," + StoreLabel + "=shares"})
		if err != nil || len(cms.Items) != 1 {
			t.Fatalf("KvrelayShares: %v, %v", cms, err)
		}
		if refs := cms.Items[0].GetOwnerReferences(); len(refs) != 1 || refs[0].Kind != "Pod" || refs[0].Name != "cp-0" || string(refs[0].UID) != "0b6c4bb5-6a10-4d9a-9e3e-5d0b1c2a3f40" {
			t.Fatalf("share owned by %+v, want pod cp-0", refs)
		}
	})
	t.Run("api keys", func(t *testing.T) {
		s := openKube(t, dyn, "keys")
		defer s.Close()
		testBackendAPIKeys(t, s)
		// Each key is a KvrelayAPIKey <name>-key-<id> of the store, its spec the key's fields.
		u, err := dyn.Resource(APIKeyResource).Namespace("kvrelay").Get(t.Context(), "keys-key-laptop", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var spec APIKey
		if _, err := field(u.Object, &spec, "spec"); err != nil || spec.ID != "laptop" || spec.PromptTPS != 200 || u.GetLabels()[StoreLabel] != "keys" {
			t.Fatalf("KvrelayAPIKey keys-key-laptop: %v (%v)", u.Object, err)
		}
		// An id that is no DNS label gets a resource all the same.
		odd := APIKey{ID: "CI_key/2", SHA256: sumA, Tenant: "acme"}
		if err := s.PutAPIKey(odd); err != nil {
			t.Fatal(err)
		}
		if got, err := s.APIKeys(); err != nil || len(got) != 2 || got[0] != odd {
			t.Fatalf("keys with an odd id: %v, %v", got, err)
		}
		if err := s.DeleteAPIKey(odd.ID); err != nil {
			t.Fatal(err)
		}
		if got, err := s.APIKeys(); err != nil || len(got) != 1 || got[0].ID != "laptop" {
			t.Fatalf("keys after deleting the odd id: %v, %v", got, err)
		}
		if err := s.PutAPIKey(APIKey{ID: "bad", SHA256: "abc", Tenant: "acme"}); !errors.Is(err, ErrInvalidKey) {
			t.Fatalf("PutAPIKey of a short SHA-256 = %v, want ErrInvalidKey", err)
		}
	})
	t.Run("api key replicas", func(t *testing.T) { testKubeAPIKeyReplicas(t, dyn) })
	t.Run("fenced", func(t *testing.T) {
		// Two replicas of one control plane: old led term 3, new leads term 4. What new wrote
		// old cannot overwrite, whatever its own Lease check said; a refused fence writes
		// nothing.
		old, cur := openKube(t, dyn, "fenced"), openKube(t, dyn, "fenced")
		defer old.Close()
		defer cur.Close()
		old.SetFence(func(context.Context) (int64, error) { return 3, nil })
		cur.SetFence(func(context.Context) (int64, error) { return 4, nil })
		if err := old.PutRollout(1, []byte(`{"by":"old"}`)); err != nil {
			t.Fatal(err)
		}
		if err := cur.PutRollout(1, []byte(`{"by":"new"}`)); err != nil {
			t.Fatalf("a later term overwriting an earlier one's rollout: %v", err)
		}
		if err := old.PutRollout(1, []byte(`{"by":"old again"}`)); !errors.Is(err, ErrStaleTerm) {
			t.Fatalf("the earlier term overwrote a later one's rollout: %v", err)
		}
		if _, err := cur.SetPolicy(Policy{Name: "kv"}, "api", time.Now()); err != nil {
			t.Fatal(err)
		}
		if _, err := old.SetPolicy(Policy{Name: "round-robin"}, "api", time.Now()); !errors.Is(err, ErrStaleTerm) {
			t.Fatalf("the earlier term set the policy over a later one's: %v", err)
		}
		if err := cur.PutWorker(Worker{ID: "w1", URL: "http://h:1"}); err != nil {
			t.Fatal(err)
		}
		if err := old.SetDrain("w1", true); !errors.Is(err, ErrStaleTerm) {
			t.Fatalf("the earlier term drained a worker a later one wrote: %v", err)
		}
		key := APIKey{ID: "ci", SHA256: sumA, Tenant: "acme"}
		if err := old.PutAPIKey(key); err != nil {
			t.Fatal(err)
		}
		key.Tenant = "later"
		if err := cur.PutAPIKey(key); err != nil {
			t.Fatalf("a later term replacing an earlier one's key: %v", err)
		}
		if err := old.PutAPIKey(APIKey{ID: "ci", SHA256: sumA, Tenant: "earlier"}); !errors.Is(err, ErrStaleTerm) {
			t.Fatalf("the earlier term replaced a later one's key: %v", err)
		}
		if err := old.DeleteAPIKey("ci"); !errors.Is(err, ErrStaleTerm) {
			t.Fatalf("the earlier term deleted a later one's key: %v", err)
		}
		deposed := openKube(t, dyn, "fenced")
		defer deposed.Close()
		refused := errors.New("the Lease has another holder")
		deposed.SetFence(func(context.Context) (int64, error) { return 0, refused })
		if err := deposed.PutRollout(2, []byte(`{"by":"deposed"}`)); !errors.Is(err, refused) {
			t.Fatalf("a refused fence: PutRollout = %v", err)
		}
		if _, err := deposed.SetPolicy(Policy{Name: "random"}, "api", time.Now()); !errors.Is(err, refused) {
			t.Fatalf("a refused fence: SetPolicy = %v", err)
		}
		if err := deposed.PutAPIKey(APIKey{ID: "deposed", SHA256: sumB, Tenant: "acme"}); !errors.Is(err, refused) {
			t.Fatalf("a refused fence: PutAPIKey = %v", err)
		}
		if err := deposed.DeleteAPIKey("ci"); !errors.Is(err, refused) {
			t.Fatalf("a refused fence: DeleteAPIKey = %v", err)
		}
		// What stands is the later term's, stamped with it.
		ctx := t.Context()
		ro, err := dyn.Resource(RolloutResource).Namespace("kvrelay").Get(ctx, "fenced-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if rec, _, _ := unstructured.NestedMap(ro.Object, "spec", "record"); rec["by"] != "new" || ro.GetAnnotations()[TermAnnotation] != "4" {
			t.Fatalf("rollout 1 is %v, term %q; want new's, term 4", rec, ro.GetAnnotations()[TermAnnotation])
		}
		if _, err := dyn.Resource(RolloutResource).Namespace("kvrelay").Get(ctx, "fenced-2", metav1.GetOptions{}); err == nil {
			t.Fatal("a refused fence created rollout 2")
		}
		ko, err := dyn.Resource(APIKeyResource).Namespace("kvrelay").Get(ctx, "fenced-key-ci", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if tenant, _, _ := unstructured.NestedString(ko.Object, "spec", "tenant"); tenant != "later" || ko.GetAnnotations()[TermAnnotation] != "4" {
			t.Fatalf("key ci is tenant %q, term %q; want later, term 4", tenant, ko.GetAnnotations()[TermAnnotation])
		}
		if keys, err := cur.APIKeys(); err != nil || len(keys) != 1 || keys[0] != key {
			t.Fatalf("keys after the refused writes: %v, %v; want %v", keys, err, key)
		}
		po, err := dyn.Resource(PolicyResource).Namespace("kvrelay").Get(ctx, "fenced", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		st, err := policyStatus(po)
		if err != nil || st.Policy == nil || st.Policy.Name != "kv" || st.LeaderTerm != 4 {
			t.Fatalf("policy status %+v (%v), want kv in term 4", st, err)
		}
	})
	t.Run("candidate", func(t *testing.T) {
		// A rollout's candidate is stored beside the stable policy (the schema has it: the
		// API server keeps it instead of pruning it as an unknown field), in the policy in
		// force and its history: another replica reads it back.
		s := openKube(t, dyn, "candidate")
		defer s.Close()
		p, c := DefaultPolicy(), DefaultPolicy()
		c.Name, c.Temperature = PolicySession, 0.5
		p.Candidate, p.CandidateShare = &c, 0.25
		set, err := s.SetPolicy(p, "rollout 1 started", time.Now())
		if err != nil || set.Candidate == nil {
			t.Fatalf("SetPolicy with a candidate = %+v, %v", set, err)
		}
		other := openKube(t, dyn, "candidate")
		defer other.Close()
		got, err := other.Policy()
		if err != nil || got.Candidate == nil || got.Candidate.Name != PolicySession || got.Candidate.Temperature != 0.5 ||
			got.Candidate.Version != set.Candidate.Version || got.CandidateShare != 0.25 {
			t.Fatalf("another replica reads the policy as %+v (%v), want the candidate at version %d", got, err, set.Candidate.Version)
		}
		if h, err := other.PolicyHistory(1); err != nil || len(h) != 1 || h[0].Policy.Candidate == nil {
			t.Fatalf("history = %+v, %v; want the change with its candidate", h, err)
		}
	})
	t.Run("not installed", func(t *testing.T) {
		if _, err := OpenKube(dyn, "kvrelay", "Not-A-Label", time.Second, discard()); !errors.Is(err, ErrInvalid) {
			t.Fatalf("OpenKube with a bad name = %v, want ErrInvalid", err)
		}
	})
}

// testKubeAPIKeyReplicas: two replicas of one control plane. What the leader writes of the
// keys reaches the other through its watch, which calls its OnChange; a key written with
// kubectl is read too, and its schema is typed: a misspelt field is refused under strict
// field validation, text for a number whatever the validation. Of two resources giving one
// id, the one named for it stands; a key the API server takes but the control plane does not
// (a SHA-256 that is not 64 hex digits) is skipped; deleting a key deletes every resource
// giving its id.
func testKubeAPIKeyReplicas(t *testing.T, dyn dynamic.Interface) {
	leader, follower := openKube(t, dyn, "keyring"), openKube(t, dyn, "keyring")
	defer leader.Close()
	defer follower.Close()
	var news atomic.Int64
	follower.OnChange(func() { news.Add(1) })
	// sees waits until the follower's keys are want, having heard of a change since before.
	sees := func(what string, before int64, want ...APIKey) {
		t.Helper()
		eventually(t, what, func() bool {
			got, err := follower.APIKeys()
			return err == nil && slices.Equal(got, want) && news.Load() > before
		})
	}
	a := APIKey{ID: "ci", SHA256: sumA, Tenant: "acme", Weight: 2, RPS: 5, Cache: "public"}
	b := APIKey{ID: "laptop", SHA256: sumB, Tenant: "acme", Weight: 2, RPS: 5, Cache: "public"}
	before := news.Load()
	for _, k := range []APIKey{b, a} {
		if err := leader.PutAPIKey(k); err != nil {
			t.Fatal(err)
		}
	}
	sees("the follower has both keys, by id", before, a, b)
	before = news.Load()
	b.Tenant, b.OutputTPM = "dev", 6000
	if err := leader.PutAPIKey(b); err != nil {
		t.Fatal(err)
	}
	sees("the follower has the replaced key", before, a, b)
	before = news.Load()
	if err := leader.DeleteAPIKey("ci"); err != nil {
		t.Fatal(err)
	}
	sees("the follower has dropped the deleted key", before, b)

	keys := dyn.Resource(APIKeyResource).Namespace("kvrelay")
	gitops := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "kvrelay.io/v1alpha1", "kind": "KvrelayAPIKey",
		"metadata": map[string]any{"name": "keyring-key-gitops", "labels": map[string]any{StoreLabel: "keyring"}},
		"spec":     map[string]any{"id": "gitops", "sha256": sumA, "tenant": "ops", "prompt_tps": int64(100)},
	}}
	before = news.Load()
	if _, err := keys.Create(t.Context(), gitops, metav1.CreateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatal(err)
	}
	ops := APIKey{ID: "gitops", SHA256: sumA, Tenant: "ops", PromptTPS: 100}
	sees("the follower has the key written with kubectl", before, ops, b)

	// Another resource giving a stored key's id: the one named for the id stands.
	dup := gitops.DeepCopy()
	dup.SetName("keyring-a-copy")
	if err := unstructured.SetNestedMap(dup.Object, map[string]any{"id": "laptop", "sha256": sumA, "tenant": "intruder"}, "spec"); err != nil {
		t.Fatal(err)
	}
	before = news.Load()
	if _, err := keys.Create(t.Context(), dup, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sees("the follower keeps the key named for its id", before, ops, b)

	u, err := keys.Get(t.Context(), "keyring-key-laptop", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for what, set := range map[string]func(spec map[string]any){
		"a misspelt field":  func(spec map[string]any) { spec["tenat"] = "other" },
		"text for a number": func(spec map[string]any) { spec["rps"] = "fast" },
		"a list for a name": func(spec map[string]any) { spec["tenant"] = []any{"a", "b"} },
	} {
		bad := u.DeepCopy()
		spec, _, _ := unstructured.NestedMap(bad.Object, "spec")
		set(spec)
		if err := unstructured.SetNestedMap(bad.Object, spec, "spec"); err != nil {
			t.Fatal(err)
		}
		if _, err := keys.Update(t.Context(), bad, metav1.UpdateOptions{FieldValidation: "Strict"}); err == nil {
			t.Errorf("the API server took %s in a KvrelayAPIKey's spec", what)
		}
	}
	bad := u.DeepCopy()
	if err := unstructured.SetNestedField(bad.Object, "not-a-sum", "spec", "sha256"); err != nil {
		t.Fatal(err)
	}
	before = news.Load()
	if _, err := keys.Update(t.Context(), bad, metav1.UpdateOptions{FieldValidation: "Strict"}); err != nil {
		t.Fatal(err)
	}
	// The copy, valid, now gives laptop's key.
	intruder := APIKey{ID: "laptop", SHA256: sumA, Tenant: "intruder"}
	sees("the follower skips a key that does not validate", before, ops, intruder)
	eventually(t, "the leader skips it too", func() bool {
		got, err := leader.APIKeys()
		return err == nil && slices.Equal(got, []APIKey{ops, intruder})
	})
	// Deleting laptop deletes every resource giving its id.
	before = news.Load()
	if err := leader.DeleteAPIKey("laptop"); err != nil {
		t.Fatal(err)
	}
	if got, err := leader.APIKeys(); err != nil || !slices.Equal(got, []APIKey{ops}) {
		t.Fatalf("the leader's keys after deleting laptop: %v, %v", got, err)
	}
	sees("the follower has no laptop key left", before, ops)
	if l, err := keys.List(t.Context(), metav1.ListOptions{LabelSelector: StoreLabel + "=keyring"}); err != nil || len(l.Items) != 1 || l.Items[0].GetName() != "keyring-key-gitops" {
		t.Fatalf("KvrelayAPIKeys left: %v, %v", l, err)
	}
}

// TestKubeStoreReplicas: two control-plane replicas on one KubeStore state. What the leader
// writes through its registry reaches the other's registry through the watch; a policy
// edited with kubectl (the spec alone) takes effect when the leader reconciles it, with the
// next version and a history entry, and one that does not validate is refused in the
// resource's status while the policy in force stays.
func TestKubeStoreReplicas(t *testing.T) {
	dyn := kubeStoreEnv(t)
	type replica struct {
		store *KubeStore
		reg   *Registry
		news  atomic.Int64
	}
	open := func() *replica {
		r := &replica{store: openKube(t, dyn, "kvrelay")}
		t.Cleanup(func() { r.store.Close() })
		var err error
		if r.reg, err = New(r.store, nil, discard()); err != nil {
			t.Fatal(err)
		}
		r.store.OnChange(func() {
			if err := r.reg.Reload(); err != nil {
				t.Errorf("Reload: %v", err)
			}
			r.news.Add(1)
		})
		return r
	}
	leader, follower := open(), open()

	w := Worker{ID: "vllm-0", URL: "http://10.0.0.1:8000", Engine: "vllm", Model: "m"}
	if err := leader.reg.Upsert(w); err != nil {
		t.Fatal(err)
	}
	if err := leader.reg.SetDraining("vllm-0", true); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the follower sees the API worker, drained", func() bool {
		got, ok := follower.reg.Get("vllm-0")
		return ok && got.URL == w.URL && got.Draining
	})
	p := DefaultPolicy()
	p.Name, p.Temperature = PolicySession, 0.25
	set, err := leader.reg.SetPolicy(p)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the follower has the leader's policy", func() bool {
		got := follower.reg.Policy()
		return got.Version == set.Version && got.Name == PolicySession && got.Temperature == 0.25
	})
	if h, err := follower.reg.PolicyHistory(10); err != nil || len(h) == 0 || h[0].Policy.Version != set.Version {
		t.Fatalf("the follower's history = %+v, %v", h, err)
	}

	// kubectl edit: spec.policy.temperature 0.5. Nothing changes until the leader
	// reconciles; then both have it, at the next version.
	policies := dyn.Resource(PolicyResource).Namespace("kvrelay")
	// edit changes spec.policy as kubectl would and waits until the leader's watch has it.
	edit := func(f func(pol map[string]any)) {
		t.Helper()
		u, err := policies.Get(t.Context(), "kvrelay", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		pol, _, _ := unstructured.NestedMap(u.Object, "spec", "policy")
		f(pol)
		if err := unstructured.SetNestedMap(u.Object, pol, "spec", "policy"); err != nil {
			t.Fatal(err)
		}
		if u, err = policies.Update(t.Context(), u, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the leader's watch has the edit", func() bool {
			c := leader.store.cached(PolicyResource, "kvrelay")
			return c != nil && c.GetGeneration() >= u.GetGeneration()
		})
	}
	before := follower.news.Load()
	edit(func(pol map[string]any) { pol["temperature"] = 0.5 })
	eventually(t, "the follower hears of the edit", func() bool { return follower.news.Load() > before })
	if got := follower.reg.Policy(); got.Temperature != 0.25 {
		t.Fatalf("an edit no leader applied is in force: %+v", got)
	}
	reconcile := func() bool {
		t.Helper()
		changed, err := leader.store.Reconcile("kubernetes", time.Now())
		if err != nil {
			t.Fatal(err)
		}
		return changed
	}
	if !reconcile() {
		t.Fatal("Reconcile of a changed spec reported no change")
	}
	eventually(t, "both have the edited policy at the next version", func() bool {
		a, b := leader.reg.Policy(), follower.reg.Policy()
		return a.Temperature == 0.5 && b.Temperature == 0.5 && b.Version == set.Version+1 && a.Version == b.Version
	})
	if h, _ := follower.reg.PolicyHistory(1); len(h) != 1 || h[0].Cause != "kubernetes" {
		t.Fatalf("history after the edit: %+v", h)
	}

	// An edit that does not validate: refused in status.error, the policy stays.
	edit(func(pol map[string]any) { pol["cache_threshold"] = 2.0 })
	if reconcile() {
		t.Fatal("an invalid spec changed the policy")
	}
	u, err := policies.Get(context.Background(), "kvrelay", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if msg, _, _ := unstructured.NestedString(u.Object, "status", "error"); !strings.Contains(msg, "cache_threshold") && !strings.Contains(msg, "cache threshold") {
		t.Fatalf("status.error = %q, want the refusal", msg)
	}
	if got := follower.reg.Policy(); got.Temperature != 0.5 || got.Version != set.Version+1 {
		t.Fatalf("after a refused edit the policy is %+v", got)
	}

	// The schema is typed: a misspelt field is refused under kubectl's strict field
	// validation, a number written as text whatever the validation; the spec stays.
	u, err = policies.Get(t.Context(), "kvrelay", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for what, set := range map[string]func(pol map[string]any){
		"a misspelt field":  func(pol map[string]any) { pol["cache_treshold"] = 0.3 },
		"text for a number": func(pol map[string]any) { pol["temperature"] = "hot" },
		"a misspelt profile field": func(pol map[string]any) {
			pol["profile"] = map[string]any{"picker": map[string]any{"name": "latency", "weigth": 1.0}}
		},
	} {
		bad := u.DeepCopy()
		pol, _, _ := unstructured.NestedMap(bad.Object, "spec", "policy")
		set(pol)
		if err := unstructured.SetNestedMap(bad.Object, pol, "spec", "policy"); err != nil {
			t.Fatal(err)
		}
		if _, err := policies.Update(t.Context(), bad, metav1.UpdateOptions{FieldValidation: "Strict"}); err == nil {
			t.Errorf("the API server took %s in spec.policy", what)
		}
	}

	// Removing the worker through the leader's API removes it on the follower; its drain
	// setting goes with it (no other source has the id).
	if err := leader.reg.Remove("vllm-0"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the follower drops the removed worker", func() bool {
		_, ok := follower.reg.Get("vllm-0")
		return !ok
	})
	if ws, err := follower.store.Workers(); err != nil || len(ws) != 0 {
		t.Fatalf("stored workers after Remove: %v, %v", ws, err)
	}
}

// The overlay answers with the newest state this replica knows: its own write until the
// watch cache shows that version or a later one, never an earlier object the watch delivers
// after it, and a deletion until the cache has caught up with it.
func TestKubeOverlay(t *testing.T) {
	obj := func(rv string) *unstructured.Unstructured {
		u := &unstructured.Unstructured{Object: map[string]any{}}
		u.SetResourceVersion(rv)
		return u
	}
	o := &kubeOverlay{objs: map[string]kubeOverlaid{}}
	o.note("ns/a", obj("12"), 12)
	if got := o.resolve("ns/a", obj("10")); got.GetResourceVersion() != "12" {
		t.Fatalf("an older cached object won over this replica's write: %s", got.GetResourceVersion())
	}
	o.note("ns/a", obj("11"), 11) // an older read does not replace a newer write
	if got := o.resolve("ns/a", nil); got.GetResourceVersion() != "12" {
		t.Fatalf("got %s, want the write at 12", got.GetResourceVersion())
	}
	if got := o.resolve("ns/a", obj("13")); got.GetResourceVersion() != "13" || len(o.keys()) != 0 {
		t.Fatalf("the cache caught up: got %s, overlay %v", got.GetResourceVersion(), o.keys())
	}
	o.note("ns/b", nil, 21) // deleted after version 20
	if got := o.resolve("ns/b", obj("20")); got != nil {
		t.Fatalf("a deleted object came back from the cache: %v", got)
	}
	if got := o.resolve("ns/b", obj("25")); got == nil {
		t.Fatal("an object made again after the deletion is hidden")
	}
	o.note("ns/c", obj("x"), rvOf(obj("x"))) // not a number: the cache alone answers
	if len(o.keys()) != 0 {
		t.Fatalf("an unnumbered version was kept: %v", o.keys())
	}
}
