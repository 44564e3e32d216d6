package registry

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// InferencePoolResource is the Gateway API Inference Extension's InferencePool.
var InferencePoolResource = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// What a pod of an InferencePool says of itself.
const (
	// RoleLabel is the pod label that gives a worker's role, as llm-d labels its pods:
	// prefill, decode, or both (also prefill-decode); unset: the template's.
	RoleLabel = "llm-d.ai/role"
	// WorkerAnnotation holds fields of the pod's workers in --worker form without id and
	// url (engine=sglang,kv-events=tcp://*:5557,max-num-seqs=64), over the template's.
	WorkerAnnotation = "kvrelay.io/worker"
)

// WatchInferencePool makes the registry's Kubernetes workers follow the pods that the
// InferencePool namespace/name selects, until ctx ends; then it returns nil. It returns an
// error at once for a bad template.
//
// The pool's spec.selector.matchLabels picks the pods and spec.targetPorts their ports:
// every ready pod (phase Running, Ready condition true, an IP, not being deleted) gives one
// worker per target port, with ID the pod's name (name-port when the pool has several ports)
// and URL http://podIP:port. The other fields come from tmpl as for EndpointSlices
// (WatchEndpointSlices), then from the pod: its RoleLabel and its WorkerAnnotation. A pod
// whose annotation is malformed gives no worker and a warning. When the pool's selector or
// ports change, its pods are watched anew; when the pool is deleted (or not there yet) its
// workers go. The workers found stay when the watch ends.
func (r *Registry) WatchInferencePool(ctx context.Context, client kubernetes.Interface, dyn dynamic.Interface, namespace, name string, tmpl Worker) error {
	t, err := newSliceTemplate(tmpl)
	if err != nil {
		return fmt.Errorf("watching InferencePool %s/%s: %w", namespace, name, err)
	}
	if namespace == "" || name == "" {
		return fmt.Errorf("watching an InferencePool: %w: namespace and name are required", ErrInvalid)
	}
	pw := &poolWatch{r: r, client: client, namespace: namespace, name: name, base: t.w, tmpls: map[string]poolTemplate{}, grace: newReadiness()}
	defer func() { pw.mu.Lock(); pw.grace.stop(); pw.mu.Unlock() }()
	factory := dynamicinformer.NewFilteredDynamicSharedInformerFactory(dyn, 0, namespace,
		func(o *metav1.ListOptions) { o.FieldSelector = "metadata.name=" + name })
	inf := factory.ForResource(InferencePoolResource).Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    pw.setPool,
		UpdateFunc: func(_, obj any) { pw.setPool(obj) },
		DeleteFunc: func(any) { pw.setPool(nil) },
	}); err != nil {
		return fmt.Errorf("watching InferencePool %s/%s: %w", namespace, name, err)
	}
	r.log.Info("watching an InferencePool", "namespace", namespace, "name", name)
	factory.Start(ctx.Done())
	<-ctx.Done()
	factory.Shutdown()
	pw.mu.Lock()
	pw.stopPods()
	pw.mu.Unlock()
	return nil
}

// poolSpec is what kvrelay reads of an InferencePool.
type poolSpec struct {
	selector map[string]string
	ports    []int32
}

func (a poolSpec) equal(b poolSpec) bool {
	return maps.Equal(a.selector, b.selector) && slices.Equal(a.ports, b.ports)
}

// parsePool reads spec.selector.matchLabels and spec.targetPorts[].number.
func parsePool(u *unstructured.Unstructured) (poolSpec, error) {
	var p poolSpec
	sel, _, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil {
		return p, fmt.Errorf("spec.selector.matchLabels: %w", err)
	}
	if len(sel) == 0 {
		return p, fmt.Errorf("spec.selector.matchLabels is empty: an InferencePool selects its pods by labels")
	}
	p.selector = sel
	ports, _, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil {
		return p, fmt.Errorf("spec.targetPorts: %w", err)
	}
	for i, e := range ports {
		m, ok := e.(map[string]any)
		if !ok {
			return p, fmt.Errorf("spec.targetPorts[%d] is not an object", i)
		}
		n, ok, err := unstructured.NestedInt64(m, "number")
		if err != nil || !ok || n < 1 || n > 65535 {
			return p, fmt.Errorf("spec.targetPorts[%d].number: want a port, 1-65535", i)
		}
		if !slices.Contains(p.ports, int32(n)) {
			p.ports = append(p.ports, int32(n))
		}
	}
	if len(p.ports) == 0 {
		return p, fmt.Errorf("spec.targetPorts is empty")
	}
	return p, nil
}

// poolTemplate is the template a pod's annotation makes, or why it could not.
type poolTemplate struct {
	t   sliceTemplate
	err error
}

// poolWatch follows the pool and, through an informer it restarts when the pool changes,
// its pods. Pool and pod events come from different goroutines: mu serialises them.
type poolWatch struct {
	r               *Registry
	client          kubernetes.Interface
	namespace, name string
	base            Worker
	mu              sync.Mutex
	spec            poolSpec
	hasPool         bool
	pods            cache.Store // the pod informer's, nil while none runs
	synced          cache.InformerSynced
	stop            chan struct{}
	tmpls           map[string]poolTemplate // by annotation
	// grace keeps a pod seen ready that turned not ready, draining, for NotReadyGrace.
	grace *readiness
}

func (pw *poolWatch) setPool(obj any) {
	pw.mu.Lock()
	defer pw.mu.Unlock()
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	u, _ := obj.(*unstructured.Unstructured)
	if u == nil {
		if pw.hasPool {
			pw.r.log.Warn("InferencePool deleted: its workers go", "namespace", pw.namespace, "name", pw.name)
		}
		pw.hasPool = false
		pw.stopPods()
		pw.r.replace(SourceK8s, nil)
		return
	}
	spec, err := parsePool(u)
	if err != nil {
		// A pool being edited into a bad state keeps the workers it had.
		pw.r.log.Warn("InferencePool not understood; keeping its last workers", "namespace", pw.namespace, "name", pw.name, "err", err)
		return
	}
	if pw.hasPool && spec.equal(pw.spec) {
		return
	}
	pw.spec, pw.hasPool = spec, true
	pw.stopPods()
	sel := labels.SelectorFromSet(spec.selector).String()
	factory := informers.NewSharedInformerFactoryWithOptions(pw.client, 0, informers.WithNamespace(pw.namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = sel }))
	inf := factory.Core().V1().Pods().Informer()
	rebuild := func(any) { pw.mu.Lock(); defer pw.mu.Unlock(); pw.apply() }
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    rebuild,
		UpdateFunc: func(_, obj any) { rebuild(obj) },
		DeleteFunc: rebuild,
	}); err != nil {
		pw.r.log.Error("watching an InferencePool's pods", "err", err)
		return
	}
	stop := make(chan struct{})
	pw.pods, pw.synced, pw.stop = inf.GetStore(), inf.HasSynced, stop
	pw.r.log.Info("InferencePool", "namespace", pw.namespace, "name", pw.name, "selector", sel, "ports", spec.ports)
	factory.Start(stop)
	// The workers change once the new informer has listed every pod, not pod by pod as
	// its first list arrives: a selector that changes but still picks the same pods moves
	// nothing.
	go func() {
		if cache.WaitForCacheSync(stop, inf.HasSynced) {
			pw.mu.Lock()
			defer pw.mu.Unlock()
			if pw.stop == stop {
				pw.apply()
			}
		}
	}()
}

// stopPods stops the pod informer, if one runs. Call with mu held.
func (pw *poolWatch) stopPods() {
	if pw.stop != nil {
		close(pw.stop)
		pw.stop, pw.pods, pw.synced = nil, nil, nil
	}
}

// apply publishes the workers of the ready pods in the store, once it holds them all, and,
// draining, those of pods that were ready and have been not ready (running, addressed, not
// going away) for less than notReadyGrace, as the EndpointSlice source does. Call with mu
// held.
func (pw *poolWatch) apply() {
	if pw.pods == nil || !pw.synced() {
		return
	}
	pw.grace.begin(time.Now())
	sel := labels.SelectorFromSet(pw.spec.selector)
	m := map[string]Worker{}
	for _, obj := range pw.pods.List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || !sel.Matches(labels.Set(pod.Labels)) || !podAlive(pod) {
			continue
		}
		keep, draining := pw.grace.admit(pod.Name, podReady(pod))
		if !keep {
			continue
		}
		t, err := pw.template(pod)
		if err != nil {
			pw.r.log.Warn("skipping an InferencePool pod", "pod", pod.Namespace+"/"+pod.Name, "err", err)
			continue
		}
		for _, port := range pw.spec.ports {
			id := pod.Name
			if len(pw.spec.ports) > 1 {
				id += "-" + strconv.Itoa(int(port))
			}
			w, err := t.worker(id, pod.Status.PodIP, port)
			if err != nil {
				pw.r.log.Warn("skipping an InferencePool pod", "pod", pod.Namespace+"/"+pod.Name, "err", err)
				continue
			}
			w.Draining = draining
			m[id] = w
		}
	}
	pw.grace.end(func() {
		pw.mu.Lock()
		defer pw.mu.Unlock()
		pw.apply()
	})
	pw.r.replace(SourceK8s, m)
}

// template is the base template with the pod's role label and worker annotation over it.
func (pw *poolWatch) template(pod *corev1.Pod) (sliceTemplate, error) {
	role := pod.Labels[RoleLabel]
	ann := strings.TrimSpace(pod.Annotations[WorkerAnnotation])
	key := role + "\x00" + ann
	if c, ok := pw.tmpls[key]; ok {
		return c.t, c.err
	}
	w := pw.base
	switch role {
	case "":
	case "prefill-decode":
		w.Role = RoleBoth
	default:
		w.Role = role
	}
	t, err := overlay(w, ann)
	if err != nil {
		err = fmt.Errorf("label %s=%q, annotation %s=%q: %w", RoleLabel, role, WorkerAnnotation, ann, err)
	}
	if len(pw.tmpls) > 1024 {
		clear(pw.tmpls) // pods of a thousand different annotations: start over
	}
	pw.tmpls[key] = poolTemplate{t, err}
	return t, err
}

// podAlive: running, addressed and not going away.
func podAlive(p *corev1.Pod) bool {
	return p.DeletionTimestamp == nil && p.Status.PodIP != "" && p.Status.Phase == corev1.PodRunning
}

// podReady: alive and ready.
func podReady(p *corev1.Pod) bool {
	if !podAlive(p) {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
