//go:build linux

package registry

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/kvrelay/kvrelay/internal/kubetest"
)

// inferencePoolCRD is the InferencePool CustomResourceDefinition, as much of its schema as
// the API server needs to serve it (the Gateway API Inference Extension's own CRD validates
// more; kvrelay reads only what parsePool does).
const inferencePoolCRD = `{
  "apiVersion": "apiextensions.k8s.io/v1",
  "kind": "CustomResourceDefinition",
  "metadata": {"name": "inferencepools.inference.networking.k8s.io",
    "annotations": {"api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173"}},
  "spec": {
    "group": "inference.networking.k8s.io",
    "names": {"kind": "InferencePool", "listKind": "InferencePoolList", "plural": "inferencepools", "singular": "inferencepool"},
    "scope": "Namespaced",
    "versions": [{"name": "v1", "served": true, "storage": true,
      "schema": {"openAPIV3Schema": {"type": "object", "properties": {
        "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}}}]
  }
}`

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// installInferencePool creates the CRD and waits until the API server serves it.
func installInferencePool(t *testing.T, dyn dynamic.Interface) {
	t.Helper()
	var crd unstructured.Unstructured
	if err := json.Unmarshal([]byte(inferencePoolCRD), &crd.Object); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := dyn.Resource(crdResource).Create(ctx, &crd, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := dyn.Resource(InferencePoolResource).Namespace("default").List(ctx, metav1.ListOptions{})
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("InferencePool CRD not served: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func pool(name string, sel map[string]any, ports ...int64) *unstructured.Unstructured {
	var tp []any
	for _, p := range ports {
		tp = append(tp, map[string]any{"number": p})
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": name, "namespace": "llm"},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": sel},
			"targetPorts":       tp,
			"endpointPickerRef": map[string]any{"name": "kvrelay-epp", "port": map[string]any{"number": int64(9002)}},
		},
	}}
}

// runPod creates a pod and gives it the status a kubelet would (there is none here).
func runPod(t *testing.T, c kubernetes.Interface, name, ip string, lbls, ann map[string]string, ready bool) {
	t.Helper()
	ctx := t.Context()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "llm", Labels: lbls, Annotations: ann},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "engine", Image: "vllm/vllm-openai"}}}}
	p, err := c.CoreV1().Pods("llm").Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}}
	if _, err := c.CoreV1().Pods("llm").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// Against a real API server: an InferencePool's ready pods become workers with the pool's
// target ports and what their labels and annotations say; they follow pods' readiness,
// the pool's selector and ports, and the pool's deletion.
func TestWatchInferencePool(t *testing.T) {
	g := notReadyGrace
	t.Cleanup(func() { notReadyGrace = g }) // after the watch's cleanup, which stops it
	notReadyGrace = time.Second
	env := kubetest.Start(t)
	client := env.Clientset(t)
	dyn, err := dynamic.NewForConfig(env.Config())
	if err != nil {
		t.Fatal(err)
	}
	installInferencePool(t, dyn)
	ctx := t.Context()
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "llm"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	app := map[string]string{"app": "vllm"}
	runPod(t, client, "vllm-0", "10.1.0.1", map[string]string{"app": "vllm", RoleLabel: "prefill"}, nil, true)
	runPod(t, client, "vllm-1", "10.1.0.2", map[string]string{"app": "vllm", RoleLabel: "decode"},
		map[string]string{WorkerAnnotation: "engine=sglang,kv-events=tcp://*:5600,max-num-seqs=64"}, true)
	runPod(t, client, "vllm-2", "10.1.0.3", app, nil, false)                                                  // not ready
	runPod(t, client, "vllm-3", "10.1.0.4", app, map[string]string{WorkerAnnotation: "url=http://x:1"}, true) // refused
	runPod(t, client, "redis-0", "10.1.0.9", map[string]string{"app": "redis"}, nil, true)
	pools := dyn.Resource(InferencePoolResource).Namespace("llm")
	if _, err := pools.Create(ctx, pool("gpt-oss", map[string]any{"app": "vllm"}, 8000), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	tmpl := Worker{Model: "openai/gpt-oss-120b", Engine: "vllm", BlockSize: 16, KVEvents: "tcp://*:5557"}
	wctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := r.WatchInferencePool(wctx, client, dyn, "llm", "gpt-oss", tmpl); err != nil {
			t.Error(err)
		}
	})
	t.Cleanup(func() { cancel(); wg.Wait() })

	eventually(t, "the pool's ready pods", func() bool { return summary(r.Workers()) == "vllm-0:k8s vllm-1:k8s" })
	w0, _ := r.Get("vllm-0")
	want := Worker{ID: "vllm-0", URL: "http://10.1.0.1:8000", Model: "openai/gpt-oss-120b", Role: RolePrefill, BlockSize: 16,
		KVEvents: "tcp://10.1.0.1:5557", Metrics: "http://10.1.0.1:8000/metrics", Engine: "vllm", Source: SourceK8s}
	if !w0.Equal(want) {
		t.Fatalf("vllm-0:\n got %+v\nwant %+v", w0, want)
	}
	w1, _ := r.Get("vllm-1")
	if w1.Role != RoleDecode || w1.Engine != "sglang" || w1.KVEvents != "tcp://10.1.0.2:5600" || w1.MaxNumSeqs != 64 {
		t.Fatalf("vllm-1 does not carry its label and annotation: %+v", w1)
	}

	// A pod turning ready joins; one deleted leaves.
	p2, err := client.CoreV1().Pods("llm").Get(ctx, "vllm-2", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p2.Status.Conditions[0].Status = corev1.ConditionTrue
	if _, err := client.CoreV1().Pods("llm").UpdateStatus(ctx, p2, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := client.CoreV1().Pods("llm").Delete(ctx, "vllm-0", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "readiness and deletion", func() bool { return summary(r.Workers()) == "vllm-1:k8s vllm-2:k8s" })

	// vllm-2 blips not ready: it stays, draining, its index kept; past the grace it goes,
	// and ready again it is back.
	setReady := func(name string, ready bool) {
		t.Helper()
		p, err := client.CoreV1().Pods("llm").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Status.Conditions[0].Status = map[bool]corev1.ConditionStatus{true: corev1.ConditionTrue, false: corev1.ConditionFalse}[ready]
		if _, err := client.CoreV1().Pods("llm").UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setReady("vllm-2", false)
	eventually(t, "the blip", func() bool { return summary(r.Workers()) == "vllm-1:k8s vllm-2:k8s:drained" })
	eventually(t, "the grace's end", func() bool { return summary(r.Workers()) == "vllm-1:k8s" })
	setReady("vllm-2", true)
	eventually(t, "ready again", func() bool { return summary(r.Workers()) == "vllm-1:k8s vllm-2:k8s" })

	// Two target ports (data-parallel ranks): a worker per pod and port.
	u, err := pools.Get(ctx, "gpt-oss", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := unstructured.SetNestedSlice(u.Object, []any{map[string]any{"number": int64(8000)}, map[string]any{"number": int64(8001)}}, "spec", "targetPorts"); err != nil {
		t.Fatal(err)
	}
	if u, err = pools.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "two ports", func() bool {
		return summary(r.Workers()) == "vllm-1-8000:k8s vllm-1-8001:k8s vllm-2-8000:k8s vllm-2-8001:k8s"
	})
	if w, _ := r.Get("vllm-2-8001"); w.URL != "http://10.1.0.3:8001" {
		t.Fatalf("vllm-2-8001: %+v", w)
	}

	// A new selector picks other pods.
	if err := unstructured.SetNestedStringMap(u.Object, map[string]string{"app": "redis"}, "spec", "selector", "matchLabels"); err != nil {
		t.Fatal(err)
	}
	if err := unstructured.SetNestedSlice(u.Object, []any{map[string]any{"number": int64(6379)}}, "spec", "targetPorts"); err != nil {
		t.Fatal(err)
	}
	if u, err = pools.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the new selector", func() bool { return summary(r.Workers()) == "redis-0:k8s" })

	// A pool edited into something kvrelay cannot read keeps its workers; a deleted one
	// takes them away.
	unstructured.RemoveNestedField(u.Object, "spec", "targetPorts")
	if _, err = pools.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if got := summary(r.Workers()); got != "redis-0:k8s" {
		t.Fatalf("a pool without ports changed the workers to %q", got)
	}
	if err := pools.Delete(ctx, "gpt-oss", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the pool's deletion", func() bool { return summary(r.Workers()) == "" })
}

func TestParsePool(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec map[string]any
		want string // error substring, "" for none
	}{
		{"ok", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "vllm"}}, "targetPorts": []any{map[string]any{"number": int64(8000)}}}, ""},
		{"no selector", map[string]any{"targetPorts": []any{map[string]any{"number": int64(8000)}}}, "matchLabels is empty"},
		{"no ports", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "vllm"}}}, "targetPorts is empty"},
		{"bad port", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "vllm"}}, "targetPorts": []any{map[string]any{"number": int64(70000)}}}, "want a port"},
		{"port not an object", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "vllm"}}, "targetPorts": []any{"8000"}}, "not an object"},
		{"labels not strings", map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": int64(1)}}, "targetPorts": []any{map[string]any{"number": int64(8000)}}}, "matchLabels"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parsePool(&unstructured.Unstructured{Object: map[string]any{"spec": tc.spec}})
			if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("parsePool = %v, want %q", err, tc.want)
			}
		})
	}
}

// FuzzParsePool: any JSON object as an InferencePool is read or refused, never a panic.
func FuzzParsePool(f *testing.F) {
	f.Add(`{"spec":{"selector":{"matchLabels":{"app":"vllm"}},"targetPorts":[{"number":8000},{"number":8001}]}}`)
	f.Add(`{"spec":{"selector":{"matchLabels":{}},"targetPorts":[{"number":-1}]}}`)
	f.Add(`{"spec":{"selector":[],"targetPorts":{"number":1}}}`)
	f.Fuzz(func(t *testing.T, s string) {
		var u unstructured.Unstructured
		if json.Unmarshal([]byte(s), &u.Object) != nil {
			return
		}
		p, err := parsePool(&u)
		if err == nil && (len(p.selector) == 0 || len(p.ports) == 0) {
			t.Fatalf("accepted a pool without selector or ports: %+v", p)
		}
	})
}
