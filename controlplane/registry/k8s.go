package registry

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// HTTPPortName is the EndpointSlice port name WatchEndpointSlices prefers for a worker's URL.
const HTTPPortName = "http"

// WatchEndpointSlices makes the registry's Kubernetes workers follow the EndpointSlices in
// namespace (all namespaces if "") that match labelSelector (all if ""), with a client-go
// informer, until ctx ends; then it returns nil. It returns an error at once for a bad
// selector or template.
//
// Every ready address (an endpoint whose ready condition is true or unset) of a slice
// becomes one worker:
//
//   - ID: the endpoint's pod name when it has a Pod target and one address (prefixed with
//     "namespace/" when watching all namespaces), otherwise "slice-name/address". Should two
//     slices yield the same id (a dual-stack pod), the slice first by namespace/name wins.
//   - URL: http://address:port, the port being the slice's TCP port named "http" or else its
//     first TCP port. A slice without a port gives no workers.
//   - KVEvents and KVEventsReplay: tcp://address:port with the port of tmpl's (its host is
//     ignored, so tcp://*:5557 will do), when tmpl sets them.
//   - Metrics: tmpl's URL with its host replaced by the address (and its port by the
//     worker's, if it has none); URL + "/metrics" when tmpl has none.
//   - KVEventsBind: tmpl's, one endpoint the control plane binds for every discovered
//     worker's publisher to connect to, each worker's messages told apart by the default
//     topic kv@<address:port>@<model>; a KVEventsTopic in tmpl cannot be shared and is
//     refused.
//   - Model, Role, BlockSize and Engine: tmpl's. tmpl's ID, URL and Draining are ignored.
//
// Workers go away when their endpoint does, turns terminating, or the slice is deleted. An
// endpoint that turns not ready (a readiness probe's blip, an engine restarting) keeps its
// worker, draining (no new requests, its index kept), for NotReadyGrace; ready again within
// it, the worker takes requests again with its cache still indexed; past it, it goes. The
// workers found stay when the watch ends (so that a control plane shutting down does not
// announce an empty fleet).
func (r *Registry) WatchEndpointSlices(ctx context.Context, client kubernetes.Interface, namespace, labelSelector string, tmpl Worker) error {
	sel, err := labels.Parse(labelSelector)
	if err != nil {
		return fmt.Errorf("watching EndpointSlices: %w: label selector %q: %w", ErrInvalid, labelSelector, err)
	}
	t, err := newSliceTemplate(tmpl)
	if err != nil {
		return fmt.Errorf("watching EndpointSlices: %w", err)
	}
	sw := &sliceWatch{
		r:             r,
		tmpl:          t,
		sel:           sel,
		allNamespaces: namespace == metav1.NamespaceAll,
		slices:        map[string]*discoveryv1.EndpointSlice{},
		grace:         newReadiness(),
		now:           time.Now,
	}
	defer func() { sw.mu.Lock(); sw.grace.stop(); sw.mu.Unlock() }()
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithNamespace(namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = labelSelector }))
	inf := factory.Discovery().V1().EndpointSlices().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    sw.update,
		UpdateFunc: func(_, obj any) { sw.update(obj) },
		DeleteFunc: sw.delete,
	}); err != nil {
		return fmt.Errorf("watching EndpointSlices: %w", err)
	}
	r.log.Info("watching EndpointSlices", "namespace", namespace, "selector", labelSelector)
	factory.Start(ctx.Done())
	<-ctx.Done()
	factory.Shutdown()
	return nil
}

// sliceTemplate is a worker template taken apart for reuse per address.
type sliceTemplate struct {
	w                  Worker
	kvPort, replayPort string
	metrics            *url.URL // nil: the default
}

func newSliceTemplate(tmpl Worker) (sliceTemplate, error) {
	t := sliceTemplate{w: tmpl}
	t.w.ID, t.w.URL, t.w.Draining, t.w.Source = "", "", false, SourceK8s
	if tmpl.KVEventsTopic != "" {
		return t, fmt.Errorf("%w: template: kv-events-topic %q cannot be shared by discovered workers (each has its own default topic)", ErrInvalid, tmpl.KVEventsTopic)
	}
	var err error
	if t.kvPort, err = tcpPort(keyKVEvents, tmpl.KVEvents); err != nil {
		return t, err
	}
	if t.replayPort, err = tcpPort(keyKVEventsReplay, tmpl.KVEventsReplay); err != nil {
		return t, err
	}
	if tmpl.Metrics != "" {
		if err := checkMetricsURL(tmpl.Metrics); err != nil {
			return t, fmt.Errorf("%w: template: %w", ErrInvalid, err)
		}
		t.metrics, _ = url.Parse(tmpl.Metrics)
	}
	// Try it on a sample address to report a bad model, role, engine or block size now.
	if _, err := t.worker("template", "127.0.0.1", 80); err != nil {
		return t, fmt.Errorf("template: %w", err)
	}
	return t, nil
}

// tcpPort returns the port of a tcp://host:port endpoint, "" for "".
func tcpPort(what, ep string) (string, error) {
	if ep == "" {
		return "", nil
	}
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if ok {
		if _, port, err := net.SplitHostPort(rest); err == nil && checkPort(port) == nil {
			return port, nil
		}
	}
	return "", fmt.Errorf("%w: template: %s %q: want tcp://host:port (the host is replaced by each address)", ErrInvalid, what, ep)
}

// worker builds the worker for one address.
func (t sliceTemplate) worker(id, addr string, port int32) (Worker, error) {
	w := t.w
	w.ID = id
	w.URL = "http://" + net.JoinHostPort(addr, strconv.Itoa(int(port)))
	if t.kvPort != "" {
		w.KVEvents = "tcp://" + net.JoinHostPort(addr, t.kvPort)
	}
	if t.replayPort != "" {
		w.KVEventsReplay = "tcp://" + net.JoinHostPort(addr, t.replayPort)
	}
	if t.metrics != nil {
		u := *t.metrics
		mport := u.Port()
		if mport == "" {
			mport = strconv.Itoa(int(port))
		}
		u.Host = net.JoinHostPort(addr, mport)
		w.Metrics = u.String()
	} else {
		w.Metrics = ""
	}
	w = w.WithDefaults()
	if err := w.Validate(); err != nil {
		return Worker{}, err
	}
	return w, nil
}

// sliceWatch turns informer events into the registry's Kubernetes workers. Its methods run
// on the informer's goroutine and on the grace timer's, under mu.
type sliceWatch struct {
	r             *Registry
	tmpl          sliceTemplate
	sel           labels.Selector
	allNamespaces bool
	now           func() time.Time

	mu     sync.Mutex
	slices map[string]*discoveryv1.EndpointSlice // by namespace/name
	grace  *readiness
}

func (sw *sliceWatch) update(obj any) {
	s, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return
	}
	sw.mu.Lock()
	defer sw.mu.Unlock()
	key := s.Namespace + "/" + s.Name
	if sw.sel.Matches(labels.Set(s.Labels)) {
		sw.slices[key] = s
	} else {
		// The server filters by the selector already; this guards clients that do not.
		delete(sw.slices, key)
	}
	sw.apply()
}

func (sw *sliceWatch) delete(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	s, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return
	}
	sw.mu.Lock()
	defer sw.mu.Unlock()
	delete(sw.slices, s.Namespace+"/"+s.Name)
	sw.apply()
}

// apply replaces the registry's Kubernetes workers with those of the slices now.
func (sw *sliceWatch) apply() {
	sw.grace.begin(sw.now())
	m := map[string]Worker{}
	for _, key := range slices.Sorted(maps.Keys(sw.slices)) {
		for _, w := range sw.workersOf(sw.slices[key]) {
			if _, dup := m[w.ID]; !dup {
				m[w.ID] = w
			}
		}
	}
	sw.grace.end(func() {
		sw.mu.Lock()
		defer sw.mu.Unlock()
		sw.apply()
	})
	sw.r.replace(SourceK8s, m)
}

// workersOf is the workers of slice s in the current pass: its ready endpoints', and,
// draining, those of endpoints that were ready and have been not ready (and not terminating)
// for less than NotReadyGrace (sw.grace).
func (sw *sliceWatch) workersOf(s *discoveryv1.EndpointSlice) []Worker {
	port, ok := slicePort(s)
	if !ok {
		sw.r.log.Warn("EndpointSlice has no TCP port; no workers from it", "slice", s.Namespace+"/"+s.Name)
		return nil
	}
	var ws []Worker
	for _, ep := range s.Endpoints {
		notReady := ep.Conditions.Ready != nil && !*ep.Conditions.Ready
		if notReady && ep.Conditions.Terminating != nil && *ep.Conditions.Terminating {
			continue
		}
		for _, addr := range ep.Addresses {
			id := s.Name + "/" + addr
			if ref := ep.TargetRef; ref != nil && ref.Kind == "Pod" && ref.Name != "" && len(ep.Addresses) == 1 {
				id = ref.Name
				if sw.allNamespaces {
					id = cmp.Or(ref.Namespace, s.Namespace) + "/" + id
				}
			}
			keep, draining := sw.grace.admit(id, !notReady)
			if !keep {
				continue
			}
			w, err := sw.tmpl.worker(id, addr, port)
			if err != nil {
				sw.r.log.Warn("skipping an EndpointSlice address", "slice", s.Namespace+"/"+s.Name, "address", addr, "err", err)
				continue
			}
			w.Draining = draining
			ws = append(ws, w)
		}
	}
	return ws
}

// slicePort picks the TCP port named HTTPPortName, or else the first TCP port.
func slicePort(s *discoveryv1.EndpointSlice) (int32, bool) {
	var first *int32
	for _, p := range s.Ports {
		if p.Port == nil || (p.Protocol != nil && *p.Protocol != corev1.ProtocolTCP) {
			continue
		}
		if p.Name != nil && *p.Name == HTTPPortName {
			return *p.Port, true
		}
		if first == nil {
			first = p.Port
		}
	}
	if first == nil {
		return 0, false
	}
	return *first, true
}
