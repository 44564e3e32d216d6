package planner_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kvrelay/kvrelay/controlplane/planner"
	"github.com/kvrelay/kvrelay/controlplane/planner/plannertest"
)

type drains struct {
	mu sync.Mutex
	m  map[string]bool
}

func (d *drains) SetDraining(id string, v bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.m == nil {
		d.m = map[string]bool{}
	}
	d.m[id] = v
	return nil
}

func deployment(name string, replicas int32) *appsv1.Deployment {
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "llm"},
		Spec: appsv1.DeploymentSpec{Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}}},
	}
}

func pod(name, app string, created time.Time) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "llm", Labels: map[string]string{"app": app}, CreationTimestamp: metav1.NewTime(created)},
		Status:     corev1.PodStatus{Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
}

func kubeFixture(t *testing.T) (*planner.KubeActuator, *drains, []runtime.Object) {
	t0 := time.Unix(1000, 0)
	objs := []runtime.Object{
		deployment("prefill", 1), deployment("decode", 3),
		pod("decode-a", "decode", t0), pod("decode-b", "decode", t0.Add(time.Minute)), pod("decode-c", "decode", t0.Add(2*time.Minute)),
	}
	d := &drains{}
	return &planner.KubeActuator{
		Namespace:   "llm",
		Deployments: map[planner.Pool]string{planner.PoolPrefill: "prefill", planner.PoolDecode: "decode"},
		Drainer:     d,
		Inflight:    func(context.Context, string) (int, error) { return 0, nil },
		DrainGrace:  time.Millisecond,
		Backoff:     time.Millisecond,
		Logger:      quiet(),
	}, d, objs
}

func TestKubeActuatorScales(t *testing.T) {
	k, d, objs := kubeFixture(t)
	c := plannertest.NewKube(objs...)
	k.Client = c
	ctx := context.Background()
	got, err := k.Replicas(ctx)
	if err != nil || got[planner.PoolPrefill] != 1 || got[planner.PoolDecode] != 3 {
		t.Fatalf("Replicas = %v, %v", got, err)
	}
	if err := k.Scale(ctx, planner.PoolPrefill, 4); err != nil {
		t.Fatal(err)
	}
	if err := k.Scale(ctx, planner.PoolDecode, 2); err != nil {
		t.Fatal(err)
	}
	got, _ = k.Replicas(ctx)
	if got[planner.PoolPrefill] != 4 || got[planner.PoolDecode] != 2 {
		t.Errorf("after scaling: %v, want prefill 4, decode 2", got)
	}
	// The newest decode pod was drained and marked to go first.
	if !d.m["decode-c"] || d.m["decode-a"] || d.m["decode-b"] {
		t.Errorf("drained %v, want decode-c only", d.m)
	}
	p, err := c.CoreV1().Pods("llm").Get(ctx, "decode-c", metav1.GetOptions{})
	if err != nil || p.Annotations[planner.PodDeletionCostAnnotation] != "-1000" {
		t.Errorf("decode-c annotations %v, %v", p.GetAnnotations(), err)
	}
}

func failScaleUpdates(c interface {
	PrependReactor(verb, resource string, r k8stesting.ReactionFunc)
}, n *int) {
	c.PrependReactor("update", "deployments", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "scale" || *n == 0 {
			return false, nil, nil
		}
		*n--
		return true, nil, errors.New("etcdserver: request timed out")
	})
}

func TestKubeActuatorRetriesFailedScale(t *testing.T) {
	k, _, objs := kubeFixture(t)
	c := plannertest.NewKube(objs...)
	k.Client, k.Attempts = c, 3
	fails := 2
	failScaleUpdates(c, &fails)
	if err := k.Scale(context.Background(), planner.PoolPrefill, 2); err != nil {
		t.Fatalf("two failures then success: %v", err)
	}
	got, _ := k.Replicas(context.Background())
	if got[planner.PoolPrefill] != 2 {
		t.Errorf("prefill %d, want 2", got[planner.PoolPrefill])
	}
}

func TestKubeActuatorReportsPersistentFailure(t *testing.T) {
	k, d, objs := kubeFixture(t)
	c := plannertest.NewKube(objs...)
	k.Client, k.Attempts = c, 3
	fails := 100
	failScaleUpdates(c, &fails)
	err := k.Scale(context.Background(), planner.PoolDecode, 2)
	if err == nil || !strings.Contains(err.Error(), "3 attempts") || !strings.Contains(err.Error(), "timed out") {
		t.Fatalf("err = %v, want the failure after 3 attempts", err)
	}
	if fails != 97 {
		t.Errorf("%d update calls, want 3", 100-fails)
	}
	if d.m["decode-c"] {
		t.Error("decode-c still drained after the scale failed")
	}
	// Through the planner: the failure is a decision with its error, not dropped.
	cfg := disaggConfig()
	cfg.ScaleAttempts = 1
	p, err := planner.New(cfg, nil, k)
	if err != nil {
		t.Fatal(err)
	}
	ds := p.Step(context.Background(), obs(time.Unix(1000, 0), 30, 1000, 100))
	var failed bool
	for _, dd := range ds {
		failed = failed || dd.Error != "" && strings.Contains(dd.Error, "attempts")
	}
	if !failed {
		t.Errorf("decisions %+v: want a reported failure", ds)
	}
}
