//go:build linux

package kubetest

import (
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
)

// The cache Start looks in is keyed by Release, so Release must be the version that
// hack/kube-testenv/go.mod builds. This runs without the binaries.
func TestReleaseMatchesWrapper(t *testing.T) {
	gomod, err := os.ReadFile("../../hack/kube-testenv/go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*k8s\.io/kubernetes (v\S+)$`).FindSubmatch(gomod)
	if m == nil {
		t.Fatal("hack/kube-testenv/go.mod requires no k8s.io/kubernetes")
	}
	if got := string(m[1]); got != Release {
		t.Fatalf("hack/kube-testenv/go.mod builds k8s.io/kubernetes %s; kubetest.Release is %s", got, Release)
	}
}

// A process that loses its port to another between freePort and its bind is started again on
// others: here etcd's first client port is held by the test.
func TestLaunchRetriesALostPort(t *testing.T) {
	etcdBin := filepath.Join(BinDir(), "etcd")
	if _, err := os.Stat(etcdBin); err != nil {
		t.Skipf("no %s: run hack/kube-testenv.sh", etcdBin)
	}
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	dir := t.TempDir()
	starts := 0
	launch(t, "etcd", http.DefaultClient, func(attempt int) (*proc, string) {
		starts++
		port := freePort(t)
		if attempt == 1 {
			port = held.Addr().(*net.TCPAddr).Port
		}
		url := "http://127.0.0.1:" + strconv.Itoa(port)
		peer := "http://127.0.0.1:" + strconv.Itoa(freePort(t))
		name := attemptName("etcd", attempt)
		return startProc(t, dir, name, etcdBin, etcdArgs(dir, name, url, peer)...), url + "/health"
	})
	if starts != 2 {
		t.Fatalf("etcd started %d times; want 2 (the first on the held port)", starts)
	}
}

// TestCluster exercises, against one real API server, what the fake clientset cannot show:
// optimistic concurrency on a Lease, the scale subresource, a watch from a resourceVersion,
// and RBAC for a second user.
func TestCluster(t *testing.T) {
	env := Start(t)
	cs := env.Clientset(t)
	ctx := t.Context()
	const ns = "kubetest"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace: %v", err)
	}

	t.Run("lease", func(t *testing.T) {
		leases := cs.CoordinationV1().Leases(ns)
		lease, err := leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: "leader"},
			Spec: coordinationv1.LeaseSpec{
				HolderIdentity:       new("a"),
				LeaseDurationSeconds: new(int32(15)),
				AcquireTime:          &metav1.MicroTime{Time: time.Now()},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create lease: %v", err)
		}
		// b takes the lease over; a, still holding the old resourceVersion, must then lose.
		stale := lease.DeepCopy()
		lease.Spec.HolderIdentity = new("b")
		if _, err := leases.Update(ctx, lease, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("update lease: %v", err)
		}
		stale.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
		if _, err := leases.Update(ctx, stale, metav1.UpdateOptions{}); !apierrors.IsConflict(err) {
			t.Fatalf("update from a stale resourceVersion: got %v, want a conflict", err)
		}
		got, err := leases.Get(ctx, "leader", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get lease: %v", err)
		}
		if h := got.Spec.HolderIdentity; h == nil || *h != "b" {
			t.Fatalf("lease holder after takeover: %v, want b", h)
		}
	})

	t.Run("scale", func(t *testing.T) {
		labels := map[string]string{"app": "engine"}
		deployments := cs.AppsV1().Deployments(ns)
		_, err := deployments.Create(ctx, &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Name: "engine"},
			Spec: appsv1.DeploymentSpec{
				Replicas: new(int32(1)),
				Selector: &metav1.LabelSelector{MatchLabels: labels},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: labels},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "engine", Image: "engine:test"}}},
				},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create deployment: %v", err)
		}
		scale, err := deployments.GetScale(ctx, "engine", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get scale: %v", err)
		}
		if scale.Spec.Replicas != 1 {
			t.Fatalf("scale: %d replicas, want 1", scale.Spec.Replicas)
		}
		scale.Spec.Replicas = 3
		if _, err := deployments.UpdateScale(ctx, "engine", scale, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("update scale: %v", err)
		}
		d, err := deployments.Get(ctx, "engine", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get deployment: %v", err)
		}
		if r := d.Spec.Replicas; r == nil || *r != 3 {
			t.Fatalf("deployment after scaling: %v replicas, want 3", r)
		}
	})

	t.Run("endpointslice watch", func(t *testing.T) {
		slices := cs.DiscoveryV1().EndpointSlices(ns)
		const selector = discoveryv1.LabelServiceName + "=engine"
		// Watch from the list's resourceVersion: no event between the two can be missed.
		list, err := slices.List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			t.Fatalf("list endpointslices: %v", err)
		}
		w, err := slices.Watch(ctx, metav1.ListOptions{LabelSelector: selector, ResourceVersion: list.ResourceVersion})
		if err != nil {
			t.Fatalf("watch endpointslices: %v", err)
		}
		defer w.Stop()
		_, err = slices.Create(ctx, &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: "engine-1", Labels: map[string]string{discoveryv1.LabelServiceName: "engine"}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Endpoints: []discoveryv1.Endpoint{{
				Addresses:  []string{"10.1.0.7"},
				Conditions: discoveryv1.EndpointConditions{Ready: new(true)},
			}},
			Ports: []discoveryv1.EndpointPort{{Name: new("http"), Port: new(int32(8000))}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create endpointslice: %v", err)
		}
		select {
		case ev := <-w.ResultChan():
			s, ok := ev.Object.(*discoveryv1.EndpointSlice)
			if ev.Type != watch.Added || !ok || s.Name != "engine-1" || len(s.Endpoints) != 1 || s.Endpoints[0].Addresses[0] != "10.1.0.7" {
				t.Fatalf("watch event %s %#v; want engine-1 added", ev.Type, ev.Object)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no watch event for the created endpointslice")
		}
	})

	t.Run("rbac", func(t *testing.T) {
		alice := env.ClientsetFor(t, "alice", "kvrelay:testers")
		if _, err := alice.CoordinationV1().Leases(ns).Get(ctx, "leader", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
			t.Fatalf("alice without a role: got %v, want forbidden", err)
		}
		rbac := cs.RbacV1()
		if _, err := rbac.Roles(ns).Create(ctx, &rbacv1.Role{
			ObjectMeta: metav1.ObjectMeta{Name: "lease-reader"},
			Rules:      []rbacv1.PolicyRule{{APIGroups: []string{coordinationv1.GroupName}, Resources: []string{"leases"}, Verbs: []string{"get"}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create role: %v", err)
		}
		if _, err := rbac.RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: "testers-read-leases"},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.GroupKind, APIGroup: rbacv1.GroupName, Name: "kvrelay:testers"}},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "lease-reader"},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create rolebinding: %v", err)
		}
		// The authorizer's informers see the binding a moment after it is stored.
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, err := alice.CoordinationV1().Leases(ns).Get(ctx, "leader", metav1.GetOptions{})
			if err == nil {
				break
			}
			if !apierrors.IsForbidden(err) || time.Now().After(deadline) {
				t.Fatalf("alice with the lease-reader role: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}
