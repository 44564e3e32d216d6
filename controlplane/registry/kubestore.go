package registry

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
)

// The custom resources a KubeStore keeps the control plane's state in (group kvrelay.io,
// version v1alpha1; their definitions are the Helm chart's crds/). Every resource of one
// control plane carries StoreLabel with its name, so several control planes may share a
// namespace.
var (
	PolicyResource  = schema.GroupVersionResource{Group: "kvrelay.io", Version: "v1alpha1", Resource: "kvrelaypolicies"}
	RolloutResource = schema.GroupVersionResource{Group: "kvrelay.io", Version: "v1alpha1", Resource: "kvrelayrollouts"}
	WorkerResource  = schema.GroupVersionResource{Group: "kvrelay.io", Version: "v1alpha1", Resource: "kvrelayworkers"}
	APIKeyResource  = schema.GroupVersionResource{Group: "kvrelay.io", Version: "v1alpha1", Resource: "kvrelayapikeys"}
)

// WatchedResources are the resources every replica watches (and the leader writes); a
// replica needs get, list, watch, create, update and delete on each. KvrelayShares
// (ShareResource) are listed when needed, not watched.
var WatchedResources = []schema.GroupVersionResource{PolicyResource, WorkerResource, RolloutResource, APIKeyResource}

// StoreLabel names the control plane a resource belongs to.
const StoreLabel = "kvrelay.io/control-plane"

// TermAnnotation is the leader term a resource was last written in (a KvrelayPolicy's
// status says it in status.leaderTerm too: a status write carries no annotations).
const TermAnnotation = "kvrelay.io/leader-term"

// ErrStaleTerm: a write refused because the resource was written in a later leader term
// than the writer's: another replica has led since, and its changes stand.
var ErrStaleTerm = errors.New("the resource was written by a later leader")

// MaxKubeHistory is the number of policy changes a KubeStore keeps in its KvrelayPolicy's
// status (an object must stay well under etcd's size limit).
const MaxKubeHistory = 100

// ErrNotSynced: the store's watches have not listed their resources within the time given.
var ErrNotSynced = errors.New("kubernetes store: resources not listed in time")

// Backend keeps what the control plane must keep across restarts and share between its
// replicas: the workers added through the operator API, explicit drain settings, the
// routing policy with its history, the rollouts and the API keys given through the operator
// API. Store (bbolt, one process) and KubeStore (custom resources, every replica) implement
// it.
type Backend interface {
	Workers() ([]Worker, error)
	PutWorker(w Worker) error
	DeleteWorker(id string) error
	Drains() (map[string]bool, error)
	SetDrain(id string, draining bool) error
	ClearDrain(id string) error
	Policy() (Policy, error)
	SetPolicy(p Policy, cause string, at time.Time) (Policy, error)
	PolicyHistory(limit int) ([]PolicyChange, error)
	PutRollout(id uint64, record []byte) error
	LastRollout() ([]byte, error)
	// APIKeys returns the API keys given through the operator API, sorted by id; PutAPIKey
	// stores one by its id, DeleteAPIKey deletes one.
	APIKeys() ([]APIKey, error)
	PutAPIKey(k APIKey) error
	DeleteAPIKey(id string) error
	Close() error
}

var (
	_ Backend = (*Store)(nil)
	_ Backend = (*KubeStore)(nil)
)

// KubeStore is a Backend in Kubernetes custom resources, for control planes of several
// replicas: each replica watches them and reads from its watch cache, the leader writes.
//
//   - KvrelayPolicy <name>: spec.policy is the policy wanted, status.policy the policy in
//     force with the versions the control plane gave it, status.observedGeneration the spec
//     it answers, status.history the latest changes, status.error why a spec was refused.
//     The operator API writes both; a spec edited by other means (kubectl, a GitOps tool)
//     takes effect when the leader reconciles it (Reconcile): until then every replica keeps
//     status.policy.
//   - KvrelayWorker <name>-<id>: spec.id, spec.worker (an API worker) and spec.draining (an
//     explicit drain, for a worker of any source); one resource holds either or both.
//   - KvrelayRollout <name>-<rollout id>: spec.id and spec.record, the rollout controller's
//     record of one rollout (its state machine included), written at every step.
//   - KvrelayAPIKey <name>-key-<id>: spec is an APIKey (id, sha256, tenant, weight, budgets,
//     cache region). One written by other means (kubectl, a GitOps tool) is read all the
//     same; one that does not validate is skipped.
//
// Writes go to the API server with optimistic concurrency and into the watch cache at once,
// so a read after a write sees it. OnChange's callback runs after every change the watches
// deliver, this replica's own writes included. A KubeStore is safe for concurrent use.
type KubeStore struct {
	dyn       dynamic.Interface
	namespace string
	name      string
	log       *slog.Logger
	factory   dynamicinformer.DynamicSharedInformerFactory
	policies  cache.SharedIndexInformer
	workers   cache.SharedIndexInformer
	rollouts  cache.SharedIndexInformer
	keys      cache.SharedIndexInformer
	cancel    context.CancelFunc

	// newer holds, per resource, what this replica knows of objects beyond its watch
	// cache: its own writes and Refresh's reads, until the watch has caught up with them.
	newer map[schema.GroupVersionResource]*kubeOverlay

	mu    sync.Mutex // serialises writes
	fence func(context.Context) (int64, error)
	// shareOwner is the ownerReferences of this replica's shares (SetShareOwner), nil: none.
	shareOwner []any
	onChange   func()
	cbMu       sync.Mutex

	// shareWriters are PutShare's writers by head name; wholeSharesSince is when the
	// KvrelayShare CRD was last found to drop the fields of split and compressed shares.
	// Both under mu.
	shareWriters     map[string]*shareWriter
	wholeSharesSince time.Time

	// The informers' watch errors: when the current streak of them began, the latest and
	// its time (WatchFailing).
	watchMu                     sync.Mutex
	watchErrSince, watchErrLast time.Time
	watchErr                    error
}

// How long watch errors must go on, each within watchErrGap of the last, before
// WatchFailing reports them (a replica whose watch is failing serves a stale state).
var (
	watchErrAfter = 30 * time.Second
	watchErrGap   = 45 * time.Second
)

// watchError records an informer's watch error (cache.WatchErrorHandler).
func (s *KubeStore) watchError(err error) {
	now := time.Now()
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	if s.watchErrLast.IsZero() || now.Sub(s.watchErrLast) > watchErrGap {
		s.watchErrSince = now
	}
	s.watchErrLast, s.watchErr = now, err
}

// WatchFailing returns the latest watch error when the informers' watches have failed for
// watchErrAfter without a pause of watchErrGap (the replica no longer follows the shared
// state: its policy may be stale), nil otherwise.
func (s *KubeStore) WatchFailing() error {
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	now := time.Now()
	if s.watchErrLast.IsZero() || now.Sub(s.watchErrLast) > watchErrGap || s.watchErrLast.Sub(s.watchErrSince) < watchErrAfter {
		return nil
	}
	return s.watchErr
}

// kubeOverlay is what a replica knows of a resource's objects that its watch cache may not
// show yet, by namespace/name: the object (nil: deleted) and the resourceVersion of that
// knowledge. A cached object at that version or later replaces it: reads never go back to
// an older state (the watch delivering an earlier write after this replica's later one).
type kubeOverlay struct {
	mu   sync.Mutex
	objs map[string]kubeOverlaid
}

type kubeOverlaid struct {
	obj *unstructured.Unstructured // nil: deleted
	rv  uint64
}

// rvOf is u's resourceVersion as a number (etcd's revision), 0 when it is not one (then the
// kubeOverlay keeps nothing of it and the cache alone answers).
func rvOf(u *unstructured.Unstructured) uint64 {
	if u == nil {
		return 0
	}
	v, _ := strconv.ParseUint(u.GetResourceVersion(), 10, 64)
	return v
}

// note records obj (nil: deleted) as known at version rv for key.
func (o *kubeOverlay) note(key string, obj *unstructured.Unstructured, rv uint64) {
	if rv == 0 {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if cur, ok := o.objs[key]; !ok || rv > cur.rv {
		o.objs[key] = kubeOverlaid{obj, rv}
	}
}

// resolve is the newest of cached (the watch cache's object for key, nil if none) and what
// the kubeOverlay knows.
func (o *kubeOverlay) resolve(key string, cached *unstructured.Unstructured) *unstructured.Unstructured {
	o.mu.Lock()
	defer o.mu.Unlock()
	cur, ok := o.objs[key]
	if !ok {
		return cached
	}
	if crv := rvOf(cached); crv >= cur.rv {
		delete(o.objs, key) // the watch has caught up
		return cached
	}
	return cur.obj
}

// keys are the keys the kubeOverlay holds.
func (o *kubeOverlay) keys() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make([]string, 0, len(o.objs))
	for k := range o.objs {
		out = append(out, k)
	}
	return out
}

// OpenKube watches the custom resources of control plane name in namespace and returns once
// they are listed (at most within timeout: ErrNotSynced). Close stops the watches.
func OpenKube(dyn dynamic.Interface, namespace, name string, timeout time.Duration, log *slog.Logger) (*KubeStore, error) {
	if dyn == nil || namespace == "" || name == "" {
		return nil, fmt.Errorf("kubernetes store: %w: a client, a namespace and a name are required", ErrInvalid)
	}
	if errs := validName(name); errs != "" {
		return nil, fmt.Errorf("kubernetes store: %w: name %q: %s", ErrInvalid, name, errs)
	}
	if log == nil {
		log = slog.Default()
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &KubeStore{dyn: dyn, namespace: namespace, name: name, log: log, cancel: cancel, newer: map[schema.GroupVersionResource]*kubeOverlay{}}
	for _, r := range WatchedResources {
		s.newer[r] = &kubeOverlay{objs: map[string]kubeOverlaid{}}
	}
	s.factory = dynamicinformer.NewFilteredDynamicSharedInformerFactory(dyn, 0, namespace,
		func(o *metav1.ListOptions) { o.LabelSelector = StoreLabel + "=" + name })
	s.policies = s.factory.ForResource(PolicyResource).Informer()
	s.workers = s.factory.ForResource(WorkerResource).Informer()
	s.rollouts = s.factory.ForResource(RolloutResource).Informer()
	s.keys = s.factory.ForResource(APIKeyResource).Informer()
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.changed() },
		UpdateFunc: func(a, b any) { s.changed() },
		DeleteFunc: func(any) { s.changed() },
	}
	for _, inf := range []cache.SharedIndexInformer{s.policies, s.workers, s.rollouts, s.keys} {
		if _, err := inf.AddEventHandler(h); err != nil {
			cancel()
			return nil, fmt.Errorf("kubernetes store: %w", err)
		}
		if err := inf.SetWatchErrorHandler(func(r *cache.Reflector, err error) {
			cache.DefaultWatchErrorHandler(ctx, r, err)
			s.watchError(err)
		}); err != nil {
			cancel()
			return nil, fmt.Errorf("kubernetes store: %w", err)
		}
	}
	s.factory.Start(ctx.Done())
	wait, wcancel := context.WithTimeout(ctx, timeout)
	defer wcancel()
	if !cache.WaitForCacheSync(wait.Done(), s.policies.HasSynced, s.workers.HasSynced, s.rollouts.HasSynced, s.keys.HasSynced) {
		cancel()
		s.factory.Shutdown()
		return nil, fmt.Errorf("%w (%s in namespace %s: are the kvrelay.io CRDs installed, and may this service account list them?)", ErrNotSynced, timeout, namespace)
	}
	log.Info("state in Kubernetes", "namespace", namespace, "control_plane", name)
	return s, nil
}

// SetFence makes every write call fence first, within the write's deadline: it returns the
// writer's leader term, or an error that refuses the write (leader.Elector.Fence: the Lease
// still held in the term this replica won). Each write stamps the term into what it writes
// (TermAnnotation) and refuses, with ErrStaleTerm, to overwrite what a later term wrote. Set
// it before the first write; without it writes are neither fenced nor stamped.
func (s *KubeStore) SetFence(fence func(context.Context) (int64, error)) {
	s.mu.Lock()
	s.fence = fence
	s.mu.Unlock()
}

// fenced is the write's term (0 and no error when unfenced): the fence's answer, refused
// when cur (the resource as read, nil when there is none) was written in a later term, or
// its status says so (statusTerm, 0 when it has none). The caller holds s.mu.
func (s *KubeStore) fenced(ctx context.Context, cur *unstructured.Unstructured, statusTerm int64) (int64, error) {
	if s.fence == nil {
		return 0, nil
	}
	term, err := s.fence(ctx)
	if err != nil {
		return 0, errFenced{err}
	}
	if cur == nil {
		return term, nil
	}
	written := statusTerm
	if t, err := strconv.ParseInt(cur.GetAnnotations()[TermAnnotation], 10, 64); err == nil {
		written = max(written, t)
	}
	if written > term {
		return 0, errFenced{fmt.Errorf("%w: %s %s was written in term %d, this replica leads term %d", ErrStaleTerm, cur.GetKind(), cur.GetName(), written, term)}
	}
	return term, nil
}

// stamp records term in obj's annotations, when writes are fenced.
func (s *KubeStore) stamp(obj *unstructured.Unstructured, term int64) {
	if s.fence == nil || obj == nil {
		return
	}
	a := obj.GetAnnotations()
	if a == nil {
		a = map[string]string{}
	}
	a[TermAnnotation] = strconv.FormatInt(term, 10)
	obj.SetAnnotations(a)
}

// errFenced carries a fence's refusal through write's retries: it is never retried.
type errFenced struct{ err error }

func (e errFenced) Error() string { return e.err.Error() }
func (e errFenced) Unwrap() error { return e.err }

// OnChange sets the function called after each change the watches see; nil clears it. It
// runs on the watch's goroutine: keep it short.
func (s *KubeStore) OnChange(f func()) {
	s.cbMu.Lock()
	s.onChange = f
	s.cbMu.Unlock()
}

func (s *KubeStore) changed() {
	s.cbMu.Lock()
	f := s.onChange
	s.cbMu.Unlock()
	if f != nil {
		f()
	}
}

// Close stops the watches.
func (s *KubeStore) Close() error {
	s.cancel()
	s.factory.Shutdown()
	return nil
}

// Refresh reads every resource of the store from the API server into the watch cache,
// for a replica about to act on them (one that has just become the leader): the watch may
// not have delivered the last writes yet. The watch then goes on from there.
func (s *KubeStore) Refresh(ctx context.Context) error {
	for _, x := range []struct {
		inf cache.SharedIndexInformer
		res schema.GroupVersionResource
	}{{s.policies, PolicyResource}, {s.workers, WorkerResource}, {s.rollouts, RolloutResource}, {s.keys, APIKeyResource}} {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		list, err := s.client(x.res).List(ctx, metav1.ListOptions{LabelSelector: StoreLabel + "=" + s.name})
		cancel()
		if err != nil {
			return fmt.Errorf("refreshing %s: %w", x.res.Resource, err)
		}
		ov := s.newer[x.res]
		listed := map[string]bool{}
		for i := range list.Items {
			u := &list.Items[i]
			key := u.GetNamespace() + "/" + u.GetName()
			listed[key] = true
			ov.note(key, u, rvOf(u))
		}
		listRV, _ := strconv.ParseUint(list.GetResourceVersion(), 10, 64)
		for _, key := range x.inf.GetStore().ListKeys() {
			if !listed[key] {
				ov.note(key, nil, listRV) // gone since the watch said otherwise
			}
		}
	}
	return nil
}

// Where names the store in logs and errors.
func (s *KubeStore) Where() string { return s.namespace + "/" + s.name }

var dnsUnsafe = regexp.MustCompile(`[^a-z0-9-]+`)

// validName says why name cannot prefix resource names ("" when it can).
func validName(name string) string {
	if len(name) > 40 {
		return "longer than 40 characters"
	}
	if dnsUnsafe.MatchString(name) || strings.HasPrefix(name, "-") || strings.HasSuffix(name, "-") {
		return "not a DNS label (lower-case letters, digits, '-')"
	}
	return ""
}

// workerName is the KvrelayWorker resource for worker id: the id when it is a DNS label,
// else its safe characters and a hash of it.
func (s *KubeStore) workerName(id string) string {
	safe := strings.Trim(dnsUnsafe.ReplaceAllString(strings.ToLower(id), "-"), "-")
	if safe != id || len(s.name)+1+len(safe) > 253 {
		sum := sha256.Sum256([]byte(id))
		safe = strings.Trim(safe[:min(len(safe), 180)], "-") + "-" + hex.EncodeToString(sum[:5])
	}
	return s.name + "-" + strings.TrimPrefix(safe, "-")
}

func (s *KubeStore) rolloutName(id uint64) string { return s.name + "-" + strconv.FormatUint(id, 10) }

func (s *KubeStore) client(r schema.GroupVersionResource) dynamic.ResourceInterface {
	return s.dyn.Resource(r).Namespace(s.namespace)
}

// newObject is a resource of this control plane, kind and name, with spec.
func (s *KubeStore) newObject(kind, name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "kvrelay.io/v1alpha1",
		"kind":       kind,
		"metadata":   map[string]any{"name": name, "namespace": s.namespace, "labels": map[string]any{StoreLabel: s.name}},
		"spec":       spec,
	}}
}

// informer is the watch of resource r.
func (s *KubeStore) informer(r schema.GroupVersionResource) cache.SharedIndexInformer {
	switch r {
	case PolicyResource:
		return s.policies
	case WorkerResource:
		return s.workers
	case APIKeyResource:
		return s.keys
	}
	return s.rollouts
}

// cached returns the newest object name of resource r this replica knows of (nil if none):
// the watch cache's, or its own later write.
func (s *KubeStore) cached(r schema.GroupVersionResource, name string) *unstructured.Unstructured {
	key := s.namespace + "/" + name
	var u *unstructured.Unstructured
	if o, ok, err := s.informer(r).GetStore().GetByKey(key); err == nil && ok {
		u, _ = o.(*unstructured.Unstructured)
	}
	return s.newer[r].resolve(key, u)
}

// list returns the newest objects of resource r this replica knows of.
func (s *KubeStore) list(r schema.GroupVersionResource) []*unstructured.Unstructured {
	byKey := map[string]*unstructured.Unstructured{}
	for _, o := range s.informer(r).GetStore().List() {
		if u, ok := o.(*unstructured.Unstructured); ok {
			byKey[u.GetNamespace()+"/"+u.GetName()] = u
		}
	}
	ov := s.newer[r]
	for _, key := range ov.keys() {
		if _, ok := byKey[key]; !ok {
			byKey[key] = nil
		}
	}
	out := make([]*unstructured.Unstructured, 0, len(byKey))
	for key, u := range byKey {
		if u = ov.resolve(key, u); u != nil {
			out = append(out, u)
		}
	}
	return out
}

// remember records what the API server answered a write of resource r with, so that the
// next read sees the write whatever the watch has delivered yet.
func (s *KubeStore) remember(r schema.GroupVersionResource, u *unstructured.Unstructured) {
	if u != nil {
		s.newer[r].note(u.GetNamespace()+"/"+u.GetName(), u, rvOf(u))
	}
}

// field decodes obj's field at path (JSON through the unstructured map) into out; a missing
// field leaves out alone and is no error.
func field(obj map[string]any, out any, path ...string) (bool, error) {
	v, ok, err := unstructured.NestedFieldNoCopy(obj, path...)
	if err != nil || !ok || v == nil {
		return false, err
	}
	b, err := json.Marshal(v)
	if err != nil {
		return false, err
	}
	return true, json.Unmarshal(b, out)
}

// asMap is v as the unstructured form of its JSON.
func asMap(v any) (any, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var m any
	err = json.Unmarshal(b, &m)
	return m, err
}

// kubeWorker is a KvrelayWorker's spec.
type kubeWorker struct {
	ID       string  `json:"id"`
	Worker   *Worker `json:"worker,omitempty"`
	Draining *bool   `json:"draining,omitempty"`
}

func (s *KubeStore) workerSpecs() ([]kubeWorker, error) {
	var out []kubeWorker
	for _, u := range s.list(WorkerResource) {
		var kw kubeWorker
		if _, err := field(u.Object, &kw, "spec"); err != nil {
			return nil, fmt.Errorf("decoding KvrelayWorker %s: %w", u.GetName(), err)
		}
		if kw.ID == "" {
			s.log.Warn("skipping a KvrelayWorker without spec.id", "name", u.GetName())
			continue
		}
		out = append(out, kw)
	}
	return out, nil
}

// Workers returns the API workers, sorted by id, with Source SourceAPI; not validated.
func (s *KubeStore) Workers() ([]Worker, error) {
	specs, err := s.workerSpecs()
	if err != nil {
		return nil, fmt.Errorf("reading workers: %w", err)
	}
	var ws []Worker
	for _, kw := range specs {
		if kw.Worker != nil {
			w := *kw.Worker
			w.ID, w.Source = kw.ID, SourceAPI
			ws = append(ws, w)
		}
	}
	slices.SortFunc(ws, func(a, b Worker) int { return strings.Compare(a.ID, b.ID) })
	return ws, nil
}

// Drains returns the explicit drain settings by worker id.
func (s *KubeStore) Drains() (map[string]bool, error) {
	specs, err := s.workerSpecs()
	if err != nil {
		return nil, fmt.Errorf("reading drains: %w", err)
	}
	drains := map[string]bool{}
	for _, kw := range specs {
		if kw.Draining != nil {
			drains[kw.ID] = *kw.Draining
		}
	}
	return drains, nil
}

// editWorker applies edit to the spec of worker id's resource (a fresh one when there is
// none), then creates, updates or, when the spec holds neither a worker nor a drain,
// deletes it; a conflict with another writer is retried on a fresh read.
func (s *KubeStore) editWorker(id string, edit func(*kubeWorker)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	name := s.workerName(id)
	c := s.client(WorkerResource)
	err := write(func(ctx context.Context) error {
		cur, err := readObject(ctx, c, name)
		if err != nil {
			return err
		}
		term, err := s.fenced(ctx, cur, 0)
		if err != nil {
			return err
		}
		kw := kubeWorker{ID: id}
		if cur != nil {
			if _, err := field(cur.Object, &kw, "spec"); err != nil {
				return fmt.Errorf("decoding KvrelayWorker %s: %w", name, err)
			}
			kw.ID = id
		}
		edit(&kw)
		if kw.Worker != nil {
			w := *kw.Worker
			w.ID, w.Source = "", ""
			kw.Worker = &w
		}
		if kw.Worker == nil && kw.Draining == nil {
			return s.deleteRead(ctx, WorkerResource, c, cur)
		}
		spec, err := asMap(kw)
		if err != nil {
			return err
		}
		return s.createOrUpdate(ctx, WorkerResource, c, cur, "KvrelayWorker", name, spec.(map[string]any), term)
	})
	if err != nil {
		return fmt.Errorf("writing KvrelayWorker %s/%s: %w", s.namespace, name, err)
	}
	return nil
}

// write runs one read-modify-write against the API server, each try within its own 10 s,
// again on a fresh read when another writer got there first (a conflict, or a create that
// lost the race), at most five times more.
func write(try func(ctx context.Context) error) error {
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := try(ctx)
		cancel()
		if (apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)) && attempt < 5 {
			continue
		}
		return err
	}
}

// putSpec creates resource r's object name of kind with spec, or replaces the spec of the
// one there, stamped with the writer's term and fenced as every write is; a conflict with
// another writer is retried on a fresh read.
func (s *KubeStore) putSpec(r schema.GroupVersionResource, kind, name string, spec map[string]any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.client(r)
	return write(func(ctx context.Context) error {
		cur, err := readObject(ctx, c, name)
		if err != nil {
			return err
		}
		term, err := s.fenced(ctx, cur, 0)
		if err != nil {
			return err
		}
		return s.createOrUpdate(ctx, r, c, cur, kind, name, spec, term)
	})
}

// deleteObject deletes resource r's object name, if there is one, fenced as every write is
// (a later term's object stays) and at the version read, so that a write after the read is
// not lost unseen.
func (s *KubeStore) deleteObject(r schema.GroupVersionResource, name string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.client(r)
	return write(func(ctx context.Context) error {
		cur, err := readObject(ctx, c, name)
		if err != nil {
			return err
		}
		if _, err := s.fenced(ctx, cur, 0); err != nil {
			return err
		}
		return s.deleteRead(ctx, r, c, cur)
	})
}

// readObject reads object name through c: nil, and no error, when there is none.
func readObject(ctx context.Context, c dynamic.ResourceInterface, name string) (*unstructured.Unstructured, error) {
	cur, err := c.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	return cur, err
}

// createOrUpdate writes spec, stamped with term, into cur (as read through c, resource r's
// client), or creates object name of kind with it when cur is nil. The caller holds s.mu
// and has fenced the write.
func (s *KubeStore) createOrUpdate(ctx context.Context, r schema.GroupVersionResource, c dynamic.ResourceInterface, cur *unstructured.Unstructured, kind, name string, spec map[string]any, term int64) error {
	if cur == nil {
		obj := s.newObject(kind, name, spec)
		s.stamp(obj, term)
		out, err := c.Create(ctx, obj, metav1.CreateOptions{})
		s.remember(r, out)
		return err
	}
	cur.Object["spec"] = spec
	s.stamp(cur, term)
	out, err := c.Update(ctx, cur, metav1.UpdateOptions{})
	s.remember(r, out)
	return err
}

// deleteRead deletes cur (nil: nothing to delete) at the version read, so that a write
// after the read is not lost unseen, and has later reads not show it. The caller holds s.mu
// and has fenced the write.
func (s *KubeStore) deleteRead(ctx context.Context, r schema.GroupVersionResource, c dynamic.ResourceInterface, cur *unstructured.Unstructured) error {
	if cur == nil {
		return nil
	}
	rv := cur.GetResourceVersion()
	err := c.Delete(ctx, cur.GetName(), metav1.DeleteOptions{Preconditions: &metav1.Preconditions{ResourceVersion: &rv}})
	if err == nil || apierrors.IsNotFound(err) {
		// Deleted after the version we read: a later read must not show it.
		s.newer[r].note(cur.GetNamespace()+"/"+cur.GetName(), nil, rvOf(cur)+1)
		return nil
	}
	return err
}

// PutWorker stores w (by its id), replacing any worker stored with that id.
func (s *KubeStore) PutWorker(w Worker) error {
	return s.editWorker(w.ID, func(kw *kubeWorker) { kw.Worker = &w })
}

// DeleteWorker deletes the worker stored with id, if any (its drain setting stays).
func (s *KubeStore) DeleteWorker(id string) error {
	return s.editWorker(id, func(kw *kubeWorker) { kw.Worker = nil })
}

// SetDrain records that worker id is drained (or explicitly not).
func (s *KubeStore) SetDrain(id string, draining bool) error {
	return s.editWorker(id, func(kw *kubeWorker) { kw.Draining = &draining })
}

// ClearDrain forgets worker id's drain setting.
func (s *KubeStore) ClearDrain(id string) error {
	return s.editWorker(id, func(kw *kubeWorker) { kw.Draining = nil })
}

// kubePolicyStatus is a KvrelayPolicy's status.
type kubePolicyStatus struct {
	Policy             *Policy        `json:"policy,omitempty"`
	ObservedGeneration int64          `json:"observedGeneration,omitempty"`
	History            []PolicyChange `json:"history,omitempty"`
	Error              string         `json:"error,omitempty"`
	// LeaderTerm is the leader term the status was last written in (TermAnnotation).
	LeaderTerm int64 `json:"leaderTerm,omitempty"`
}

func policyStatus(u *unstructured.Unstructured) (kubePolicyStatus, error) {
	var st kubePolicyStatus
	if u == nil {
		return st, nil
	}
	if _, err := field(u.Object, &st, "status"); err != nil {
		return st, fmt.Errorf("decoding KvrelayPolicy %s status: %w", u.GetName(), err)
	}
	return st, nil
}

// Policy returns the policy in force (status.policy), DefaultPolicy if none was ever set.
func (s *KubeStore) Policy() (Policy, error) {
	st, err := policyStatus(s.cached(PolicyResource, s.name))
	if err != nil {
		return Policy{}, err
	}
	if st.Policy == nil {
		return DefaultPolicy(), nil
	}
	return *st.Policy, nil
}

// PolicyHistory returns at most limit policy changes, the latest first.
func (s *KubeStore) PolicyHistory(limit int) ([]PolicyChange, error) {
	st, err := policyStatus(s.cached(PolicyResource, s.name))
	if err != nil {
		return nil, err
	}
	var out []PolicyChange
	for i := len(st.History) - 1; i >= 0 && len(out) < limit; i-- {
		out = append(out, st.History[i])
	}
	return out, nil
}

// SetPolicy validates p, gives it its version (see Registry.SetPolicy) and makes it the
// wanted and the applied policy, with its history entry. A non-zero p.Version must be the
// applied version (ErrVersionConflict otherwise).
func (s *KubeStore) SetPolicy(p Policy, cause string, at time.Time) (Policy, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	next, err := s.applyPolicy(func(cur Policy, _ *unstructured.Unstructured) (Policy, bool, error) {
		n, err := nextPolicy(cur, p)
		return n, true, err
	}, cause, at)
	if err != nil {
		return Policy{}, fmt.Errorf("setting policy: %w", err)
	}
	return next, nil
}

// Reconcile applies a KvrelayPolicy spec that was edited outside the control plane (its
// generation ahead of status.observedGeneration), with cause; a spec that does not validate
// is refused in status.error and the applied policy stays. It reports whether the policy
// changed. Only the leader calls it.
func (s *KubeStore) Reconcile(cause string, at time.Time) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cached := s.cached(PolicyResource, s.name)
	if cached == nil {
		return false, nil
	}
	if st, err := policyStatus(cached); err == nil && st.ObservedGeneration >= cached.GetGeneration() {
		return false, nil
	}
	changed := false
	_, err := s.applyPolicy(func(cur Policy, obj *unstructured.Unstructured) (Policy, bool, error) {
		var want Policy
		if _, err := field(obj.Object, &want, "spec", "policy"); err != nil {
			return cur, false, fmt.Errorf("%w: spec.policy: %w", ErrInvalid, err)
		}
		want.Version = 0 // the control plane gives versions
		n, err := nextPolicy(cur, want)
		if err != nil {
			return cur, false, err
		}
		changed = !samePolicy(n, cur)
		return n, false, nil
	}, cause, at)
	return changed, err
}

func samePolicy(a, b Policy) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

// applyPolicy reads the KvrelayPolicy from the API server, lets next compute the policy to
// apply from the applied one (and whether the spec becomes it), writes the spec if asked and
// then the status, retrying on conflicts. A policy next refuses as invalid on a spec edit is
// recorded in status.error. Called with s.mu held.
func (s *KubeStore) applyPolicy(next func(cur Policy, obj *unstructured.Unstructured) (Policy, bool, error), cause string, at time.Time) (Policy, error) {
	c := s.client(PolicyResource)
	var out Policy
	err := write(func(ctx context.Context) error {
		obj, err := c.Get(ctx, s.name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			if _, err := s.fenced(ctx, nil, 0); err != nil {
				return err
			}
			if obj, err = c.Create(ctx, s.newObject("KvrelayPolicy", s.name, map[string]any{}), metav1.CreateOptions{}); err != nil {
				return err
			}
		} else if err != nil {
			return err
		}
		st, err := policyStatus(obj)
		if err != nil {
			return err
		}
		term, err := s.fenced(ctx, obj, st.LeaderTerm)
		if err != nil {
			return err
		}
		if s.fence != nil {
			st.LeaderTerm = term
		}
		cur := DefaultPolicy()
		if st.Policy != nil {
			cur = *st.Policy
		}
		pol, writeSpec, err := next(cur, obj)
		if err != nil {
			if !writeSpec && errors.Is(err, ErrInvalid) {
				// A spec edited outside the control plane that does not validate: say
				// so where its author looks, and keep the policy in force.
				st.Error = err.Error()
				st.ObservedGeneration = obj.GetGeneration()
				if err := s.writePolicyStatus(ctx, obj, st); err != nil {
					return err
				}
				out = cur
				return nil
			}
			return errPolicy{err}
		}
		if writeSpec {
			want := pol.clone()
			spec, err := asMap(want)
			if err != nil {
				return err
			}
			if err := unstructured.SetNestedField(obj.Object, spec, "spec", "policy"); err != nil {
				return err
			}
			s.stamp(obj, term)
			if obj, err = c.Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
				return err
			}
		}
		// Every set through the API is recorded (as the bbolt Store does); an edit
		// applied, when it changed the policy.
		if writeSpec || !samePolicy(pol, cur) {
			st.History = append(st.History, PolicyChange{Policy: pol, At: at, Cause: cause})
			if len(st.History) > MaxKubeHistory {
				st.History = slices.Delete(st.History, 0, len(st.History)-MaxKubeHistory)
			}
		}
		st.Policy, st.ObservedGeneration, st.Error = &pol, obj.GetGeneration(), ""
		if err := s.writePolicyStatus(ctx, obj, st); err != nil {
			return err
		}
		out = pol
		return nil
	})
	var pe errPolicy
	switch {
	case errors.As(err, &pe):
		return Policy{}, pe.err
	case err != nil:
		return Policy{}, fmt.Errorf("writing KvrelayPolicy %s/%s: %w", s.namespace, s.name, err)
	}
	return out, nil
}

// errPolicy carries the policy's own refusal (invalid, version conflict) through write's
// retries unwrapped.
type errPolicy struct{ err error }

func (e errPolicy) Error() string { return e.err.Error() }

func (s *KubeStore) writePolicyStatus(ctx context.Context, obj *unstructured.Unstructured, st kubePolicyStatus) error {
	m, err := asMap(st)
	if err != nil {
		return err
	}
	obj = obj.DeepCopy()
	obj.Object["status"] = m
	out, err := s.client(PolicyResource).UpdateStatus(ctx, obj, metav1.UpdateOptions{})
	s.remember(PolicyResource, out)
	return err
}

// kubeRollout is a KvrelayRollout's spec.
type kubeRollout struct {
	ID     uint64          `json:"id"`
	Record json.RawMessage `json:"record"`
}

// PutRollout stores a rollout's record (the control plane's JSON) under its id.
func (s *KubeStore) PutRollout(id uint64, record []byte) error {
	if !json.Valid(record) {
		return fmt.Errorf("storing rollout %d: %w: the record is not JSON", id, ErrInvalid)
	}
	spec, err := asMap(kubeRollout{ID: id, Record: record})
	if err != nil {
		return fmt.Errorf("storing rollout %d: %w", id, err)
	}
	name := s.rolloutName(id)
	if err := s.putSpec(RolloutResource, "KvrelayRollout", name, spec.(map[string]any)); err != nil {
		return fmt.Errorf("storing rollout %d in KvrelayRollout %s/%s: %w", id, s.namespace, name, err)
	}
	return nil
}

// LastRollout returns the record of the rollout with the highest id, nil if none was
// stored.
func (s *KubeStore) LastRollout() ([]byte, error) {
	var best *kubeRollout
	for _, u := range s.list(RolloutResource) {
		var kr kubeRollout
		if _, err := field(u.Object, &kr, "spec"); err != nil {
			return nil, fmt.Errorf("decoding KvrelayRollout %s: %w", u.GetName(), err)
		}
		if best == nil || kr.ID > best.ID {
			best = &kr
		}
	}
	if best == nil || len(best.Record) == 0 {
		return nil, nil
	}
	return slices.Clone([]byte(best.Record)), nil
}
