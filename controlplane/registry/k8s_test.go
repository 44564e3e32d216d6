package registry

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

type endpoint struct {
	pod   string // "" for no target
	addrs []string
	ready *bool
}

func slice(name string, lbls map[string]string, ports []discoveryv1.EndpointPort, eps ...endpoint) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "llm", Labels: lbls},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       ports,
	}
	for _, e := range eps {
		ep := discoveryv1.Endpoint{Addresses: e.addrs, Conditions: discoveryv1.EndpointConditions{Ready: e.ready}}
		if e.pod != "" {
			ep.TargetRef = &corev1.ObjectReference{Kind: "Pod", Name: e.pod, Namespace: "llm"}
		}
		s.Endpoints = append(s.Endpoints, ep)
	}
	return s
}

func port(name string, p int32) discoveryv1.EndpointPort {
	proto := corev1.ProtocolTCP
	return discoveryv1.EndpointPort{Name: &name, Port: &p, Protocol: &proto}
}

func ptr[T any](v T) *T { return &v }

// watchSlices starts WatchEndpointSlices on a fake clientset and returns once the informer
// watches, so that later changes are not lost between its list and its watch.
func watchSlices(t *testing.T, r *Registry, client *fake.Clientset, ns, sel string, tmpl Worker) {
	t.Helper()
	watching := make(chan struct{})
	var once sync.Once
	client.PrependWatchReactor("endpointslices", func(k8stesting.Action) (bool, watch.Interface, error) {
		once.Do(func() { close(watching) })
		return false, nil, nil // the default reactor serves it, under the same lock
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := r.WatchEndpointSlices(ctx, client, ns, sel, tmpl); err != nil {
			t.Error(err)
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })
	<-watching
}

func TestWatchEndpointSlices(t *testing.T) {
	g := notReadyGrace
	t.Cleanup(func() { notReadyGrace = g }) // after the watch's cleanup, which stops it
	notReadyGrace = 500 * time.Millisecond
	app := map[string]string{"app": "vllm"}
	existing := slice("vllm-a", app, []discoveryv1.EndpointPort{port("metrics", 9090), port("http", 8000)},
		endpoint{pod: "vllm-0", addrs: []string{"10.0.0.1"}},
		endpoint{pod: "vllm-1", addrs: []string{"10.0.0.2"}, ready: ptr(true)},
		endpoint{pod: "vllm-2", addrs: []string{"10.0.0.3"}, ready: ptr(false)},
	)
	other := slice("other", map[string]string{"app": "redis"}, []discoveryv1.EndpointPort{port("", 6379)},
		endpoint{pod: "redis-0", addrs: []string{"10.0.9.9"}})
	client := fake.NewClientset(existing, other)
	r, err := New(nil, []Worker{mustParse(t, "id=vllm-1,url=http://static:1")}, discard())
	if err != nil {
		t.Fatal(err)
	}
	tmpl := Worker{Model: "openai/gpt-oss-20b", Engine: "vllm", BlockSize: 16, Role: RoleDecode,
		KVEvents: "tcp://*:5557", KVEventsReplay: "tcp://*:5558", ID: "ignored", URL: "http://ignored:1", Draining: true}
	watchSlices(t, r, client, "llm", "app=vllm", tmpl)

	eventually(t, "the listed slice", func() bool { return summary(r.Workers()) == "vllm-0:k8s vllm-1:flag" })
	w0, _ := r.Get("vllm-0")
	want := Worker{ID: "vllm-0", URL: "http://10.0.0.1:8000", Model: "openai/gpt-oss-20b", Role: RoleDecode,
		BlockSize: 16, KVEvents: "tcp://10.0.0.1:5557", KVEventsReplay: "tcp://10.0.0.1:5558",
		Metrics: "http://10.0.0.1:8000/metrics", Engine: "vllm", Source: SourceK8s}
	if !w0.Equal(want) {
		t.Fatalf("vllm-0:\n got %+v\nwant %+v", w0, want)
	}
	// vllm-1 from Kubernetes is hidden by the flag's; removing it there is not possible here.
	if err := r.Remove("vllm-0"); !errors.Is(err, ErrNotRemovable) {
		t.Fatalf("Remove(vllm-0) = %v, want ErrNotRemovable", err)
	}

	ctx := context.Background()
	slices := client.DiscoveryV1().EndpointSlices("llm")
	// A new slice without a pod target and with an unnamed port.
	added := slice("vllm-b", app, []discoveryv1.EndpointPort{port("", 8001)},
		endpoint{addrs: []string{"10.0.1.1"}})
	if _, err := slices.Create(ctx, added, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the created slice", func() bool {
		return summary(r.Workers()) == "vllm-0:k8s vllm-1:flag vllm-b/10.0.1.1:k8s"
	})
	if w, _ := r.Get("vllm-b/10.0.1.1"); w.URL != "http://10.0.1.1:8001" {
		t.Fatalf("vllm-b/10.0.1.1 = %+v", w)
	}

	// vllm-0 turns not ready, vllm-2 ready: vllm-0 stays, draining (its index kept), for
	// the grace, then goes.
	existing = existing.DeepCopy()
	existing.Endpoints[0].Conditions.Ready = ptr(false)
	existing.Endpoints[2].Conditions.Ready = ptr(true)
	if _, err := slices.Update(ctx, existing, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the readiness update", func() bool {
		return summary(r.Workers()) == "vllm-0:k8s:drained vllm-1:flag vllm-2:k8s vllm-b/10.0.1.1:k8s"
	})
	eventually(t, "the grace's end", func() bool {
		return summary(r.Workers()) == "vllm-1:flag vllm-2:k8s vllm-b/10.0.1.1:k8s"
	})
	// vllm-2 blips: not ready, ready again within the grace: back, never gone.
	existing = existing.DeepCopy()
	existing.Endpoints[2].Conditions.Ready = ptr(false)
	if _, err := slices.Update(ctx, existing, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the blip", func() bool { return summary(r.Workers()) == "vllm-1:flag vllm-2:k8s:drained vllm-b/10.0.1.1:k8s" })
	existing = existing.DeepCopy()
	existing.Endpoints[2].Conditions.Ready = ptr(true)
	if _, err := slices.Update(ctx, existing, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the blip's end", func() bool { return summary(r.Workers()) == "vllm-1:flag vllm-2:k8s vllm-b/10.0.1.1:k8s" })
	// A terminating endpoint goes at once.
	existing = existing.DeepCopy()
	existing.Endpoints[2].Conditions.Ready, existing.Endpoints[2].Conditions.Terminating = ptr(false), ptr(true)
	if _, err := slices.Update(ctx, existing, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the terminating endpoint", func() bool { return summary(r.Workers()) == "vllm-1:flag vllm-b/10.0.1.1:k8s" })

	// Deleting the slices takes their workers away; the flag's vllm-1 stays.
	if err := slices.Delete(ctx, "vllm-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deleted slice", func() bool {
		return summary(r.Workers()) == "vllm-1:flag vllm-b/10.0.1.1:k8s"
	})
	if err := slices.Delete(ctx, "vllm-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "no discovered workers", func() bool { return summary(r.Workers()) == "vllm-1:flag" })
}

func TestWatchEndpointSlicesAllNamespaces(t *testing.T) {
	s := slice("vllm", nil, []discoveryv1.EndpointPort{port("http", 8000)},
		endpoint{pod: "vllm-0", addrs: []string{"fd00::1"}},
		endpoint{addrs: []string{"10.0.0.1", "10.0.0.2"}, pod: "multi"},
	)
	client := fake.NewClientset(s)
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	watchSlices(t, r, client, "", "", Worker{Metrics: "http://any:9100/metrics", Engine: "sglang"})
	eventually(t, "the slice", func() bool {
		return summary(r.Workers()) == "llm/vllm-0:k8s vllm/10.0.0.1:k8s vllm/10.0.0.2:k8s"
	})
	w, _ := r.Get("llm/vllm-0")
	if w.URL != "http://[fd00::1]:8000" || w.Metrics != "http://[fd00::1]:9100/metrics" || w.Engine != "sglang" {
		t.Fatalf("IPv6 worker = %+v", w)
	}
}

func TestWatchEndpointSlicesRefuses(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset()
	for name, tc := range map[string]struct {
		sel  string
		tmpl Worker
	}{
		"bad selector":     {sel: "app in (", tmpl: Worker{}},
		"shared topic":     {tmpl: Worker{KVEventsBind: "tcp://*:5557", KVEventsTopic: "kv@x@m"}},
		"ipc events":       {tmpl: Worker{KVEvents: "ipc:///tmp/x"}},
		"events sans port": {tmpl: Worker{KVEvents: "tcp://host"}},
		"bad engine":       {tmpl: Worker{Engine: "tgi"}},
		"bad metrics":      {tmpl: Worker{Metrics: "ftp://x/m"}},
	} {
		t.Run(name, func(t *testing.T) {
			err := r.WatchEndpointSlices(context.Background(), client, "llm", tc.sel, tc.tmpl)
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("WatchEndpointSlices = %v, want ErrInvalid", err)
			}
		})
	}
}
