// Package plannertest holds fakes for testing the planner: an in-memory Kubernetes API
// that serves Deployments' scale subresource over client-go's fake clientset, and a
// recording actuator.
package plannertest

import (
	"context"
	"fmt"
	"sync"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kvrelay/kvrelay/controlplane/planner"
)

var deployments = schema.GroupVersionResource{Group: "apps", Version: "v1", Resource: "deployments"}

// NewKube returns a fake clientset holding objs whose Deployments serve the scale
// subresource (get and update read and write spec.replicas), which the fake's object
// tracker alone does not. Prepend reactors to inject failures.
func NewKube(objs ...runtime.Object) *fake.Clientset {
	c := fake.NewClientset(objs...)
	c.PrependReactor("get", "deployments", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "scale" {
			return false, nil, nil
		}
		g := a.(k8stesting.GetAction)
		d, err := getDeployment(c, g.GetNamespace(), g.GetName())
		if err != nil {
			return true, nil, err
		}
		return true, scaleOf(d), nil
	})
	c.PrependReactor("update", "deployments", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "scale" {
			return false, nil, nil
		}
		u := a.(k8stesting.UpdateAction)
		s := u.GetObject().(*autoscalingv1.Scale)
		d, err := getDeployment(c, u.GetNamespace(), s.Name)
		if err != nil {
			return true, nil, err
		}
		r := s.Spec.Replicas
		d.Spec.Replicas = &r
		if err := c.Tracker().Update(deployments, d, d.Namespace); err != nil {
			return true, nil, err
		}
		return true, scaleOf(d), nil
	})
	return c
}

func getDeployment(c *fake.Clientset, ns, name string) (*appsv1.Deployment, error) {
	o, err := c.Tracker().Get(deployments, ns, name)
	if err != nil {
		return nil, err
	}
	return o.(*appsv1.Deployment).DeepCopy(), nil
}

func scaleOf(d *appsv1.Deployment) *autoscalingv1.Scale {
	var r int32 = 1
	if d.Spec.Replicas != nil {
		r = *d.Spec.Replicas
	}
	return &autoscalingv1.Scale{
		ObjectMeta: metav1.ObjectMeta{Name: d.Name, Namespace: d.Namespace, ResourceVersion: d.ResourceVersion},
		Spec:       autoscalingv1.ScaleSpec{Replicas: r},
		Status:     autoscalingv1.ScaleStatus{Replicas: d.Status.Replicas},
	}
}

// Actuator records Scale calls and applies them to its sizes; Fail makes the next calls fail.
type Actuator struct {
	mu    sync.Mutex
	Sizes map[planner.Pool]int
	Calls []string
	Fail  int // the next Fail calls fail
}

func (a *Actuator) Replicas(context.Context) (map[planner.Pool]int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[planner.Pool]int{}
	for k, v := range a.Sizes {
		out[k] = v
	}
	return out, nil
}

func (a *Actuator) Scale(_ context.Context, pool planner.Pool, n int) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.Calls = append(a.Calls, fmt.Sprintf("%s=%d", pool, n))
	if a.Fail > 0 {
		a.Fail--
		return fmt.Errorf("injected failure scaling %s", pool)
	}
	if a.Sizes == nil {
		a.Sizes = map[planner.Pool]int{}
	}
	a.Sizes[pool] = n
	return nil
}

var _ planner.Actuator = (*Actuator)(nil)
