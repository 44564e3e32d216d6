//go:build linux

package kubetest

import (
	"bytes"
	"os"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"
)

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// InstallCRDs creates the CustomResourceDefinitions of the YAML file at path (documents
// separated by ---) and returns once the API server reports each Established.
func (e *Env) InstallCRDs(t testing.TB, path string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(e.Config())
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	var names []string
	for _, doc := range bytes.Split(data, []byte("\n---")) {
		var crd unstructured.Unstructured
		if err := yaml.Unmarshal(doc, &crd.Object); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if len(crd.Object) == 0 {
			continue
		}
		if _, err := dyn.Resource(crdResource).Create(ctx, &crd, metav1.CreateOptions{}); err != nil {
			t.Fatalf("creating %s: %v", crd.GetName(), err)
		}
		names = append(names, crd.GetName())
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, name := range names {
		for {
			u, err := dyn.Resource(crdResource).Get(ctx, name, metav1.GetOptions{})
			if err == nil && established(u) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("CRD %s not established: %v", name, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func established(u *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}
