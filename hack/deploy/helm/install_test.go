//go:build linux

package helm_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/internal/kubetest"
	"github.com/kvrelay/kvrelay/internal/testbin"
)

// engines is the namespace of the engines' EndpointSlices (and Deployments) in TestInstall,
// apart from the release's, as where one control plane serves a namespace of engines.
const engines = "engines"

// TestInstall installs the chart on a real kube-apiserver (no controller-manager, scheduler
// or kubelet: the Deployments' pods never start), checks the objects it made, exercises its
// RBAC as the control plane's ServiceAccount, runs the control plane and a proxy here with
// the installed Deployments' arguments and that ServiceAccount's credentials, and upgrades
// the release.
func TestInstall(t *testing.T) {
	needHelm(t)
	env := kubetest.Start(t)
	cs := env.Clientset(t)
	ctx := t.Context()

	// The template tests render for the release hack/kube-testenv builds: this one.
	kv := kubetest.Release
	if v, err := cs.Discovery().ServerVersion(); err != nil || v.GitVersion != kv {
		t.Fatalf("kube-apiserver version %v (%v); the template tests render for %s", v, err, kv)
	}

	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: engines}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", engines, err)
	}
	values := valuesFile(t, "discovery: {namespace: "+engines+"}\n")
	kubeconfig := env.Kubeconfig(t)
	begin := time.Now()
	helm(t, "install", release, chart, "--namespace", namespace, "--create-namespace", "--kubeconfig", kubeconfig, "-f", values)
	t.Logf("helm install in %v", time.Since(begin).Round(time.Millisecond))

	checkInstalled(t, cs)
	sec, err := cs.CoreV1().Secrets(namespace).Get(ctx, tokenSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get API token secret: %v", err)
	}
	token := string(sec.Data["token"])
	if len(token) != 32 {
		t.Fatalf("generated API token %q, want 32 characters", token)
	}

	sa := "system:serviceaccount:" + namespace + ":" + cpName
	saGroups := []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace}
	t.Run("rbac", func(t *testing.T) { checkRBAC(t, cs, env.ClientsetFor(t, sa, saGroups...)) })
	t.Run("run", func(t *testing.T) {
		runInstalled(t, env, cs, env.KubeconfigFor(t, sa, saGroups...), token)
	})

	t.Run("upgrade", func(t *testing.T) {
		helm(t, "upgrade", release, chart, "--namespace", namespace, "--kubeconfig", kubeconfig, "-f", values, "--set", "proxy.policy=kv",
			"--set", "controlplane.extraArgs={--planner}")
		// With the planner on, its rights come with it.
		checkPlannerRBAC(t, cs, env.ClientsetFor(t, sa, saGroups...), true)
		sec, err := cs.CoreV1().Secrets(namespace).Get(ctx, tokenSecret, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get API token secret: %v", err)
		}
		if got := string(sec.Data["token"]); got != token {
			t.Errorf("API token after upgrade %q, was %q", got, token)
		}
		d, err := cs.AppsV1().Deployments(namespace).Get(ctx, proxyName, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get proxy deployment: %v", err)
		}
		wantArgs(t, container(t, d, "proxy"), "--policy=kv")
	})
}

// checkInstalled checks that helm made every object the chart renders by default, the
// discovery Role and RoleBinding in the engines' namespace.
func checkInstalled(t *testing.T, cs *kubernetes.Clientset) {
	t.Helper()
	ctx := t.Context()
	gets := []struct {
		kind, ns, name string
		get            func(ctx context.Context, name string, o metav1.GetOptions) error
	}{
		{"Deployment", namespace, cpName, dropObj(cs.AppsV1().Deployments(namespace).Get)},
		{"Deployment", namespace, proxyName, dropObj(cs.AppsV1().Deployments(namespace).Get)},
		{"Service", namespace, cpName, dropObj(cs.CoreV1().Services(namespace).Get)},
		{"Service", namespace, proxyName, dropObj(cs.CoreV1().Services(namespace).Get)},
		{"Service", namespace, proxyAdmin, dropObj(cs.CoreV1().Services(namespace).Get)},
		{"ServiceAccount", namespace, cpName, dropObj(cs.CoreV1().ServiceAccounts(namespace).Get)},
		{"Role", namespace, cpName, dropObj(cs.RbacV1().Roles(namespace).Get)},
		{"RoleBinding", namespace, cpName, dropObj(cs.RbacV1().RoleBindings(namespace).Get)},
		{"Role", engines, discoveryRBAC, dropObj(cs.RbacV1().Roles(engines).Get)},
		{"RoleBinding", engines, discoveryRBAC, dropObj(cs.RbacV1().RoleBindings(engines).Get)},
		{"PodDisruptionBudget", namespace, cpName, dropObj(cs.PolicyV1().PodDisruptionBudgets(namespace).Get)},
		{"PodDisruptionBudget", namespace, proxyName, dropObj(cs.PolicyV1().PodDisruptionBudgets(namespace).Get)},
		{"HorizontalPodAutoscaler", namespace, proxyName, dropObj(cs.AutoscalingV2().HorizontalPodAutoscalers(namespace).Get)},
		{"NetworkPolicy", namespace, cpName, dropObj(cs.NetworkingV1().NetworkPolicies(namespace).Get)},
		{"NetworkPolicy", namespace, proxyName, dropObj(cs.NetworkingV1().NetworkPolicies(namespace).Get)},
		{"Secret", namespace, tokenSecret, dropObj(cs.CoreV1().Secrets(namespace).Get)},
		{"Secret", namespace, xdsSecret, dropObj(cs.CoreV1().Secrets(namespace).Get)},
		{"Secret", namespace, metricsSecret, dropObj(cs.CoreV1().Secrets(namespace).Get)},
		{"ServiceAccount", namespace, proxyName, dropObj(cs.CoreV1().ServiceAccounts(namespace).Get)},
		{"ClusterRoleBinding", "", tokenReview, dropObj(cs.RbacV1().ClusterRoleBindings().Get)},
	}
	for _, g := range gets {
		if err := g.get(ctx, g.name, metav1.GetOptions{}); err != nil {
			t.Errorf("%s %s/%s: %v", g.kind, g.ns, g.name, err)
		}
	}
	cp, err := cs.AppsV1().Deployments(namespace).Get(ctx, cpName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if r := cp.Spec.Replicas; r == nil || *r != 2 {
		t.Errorf("control plane replicas %v, want 2", r)
	}
	wantArgs(t, container(t, cp, "controlplane"), "--leader-elect", "--k8s-namespace="+engines)
}

// dropObj drops a typed Get's object.
func dropObj[T any](get func(context.Context, string, metav1.GetOptions) (T, error)) func(context.Context, string, metav1.GetOptions) error {
	return func(ctx context.Context, name string, o metav1.GetOptions) error {
		_, err := get(ctx, name, o)
		return err
	}
}

// checkRBAC checks, as the control plane's ServiceAccount (sa), that the chart's Roles allow
// what the control plane does (the Lease in its namespace; EndpointSlices and the planner's
// scaling in the engines') and nothing beside.
func checkRBAC(t *testing.T, admin, sa *kubernetes.Clientset) {
	ctx := t.Context()
	// The authorizer's informers see helm's bindings a moment after they are stored.
	eventually(t, 10*time.Second, func() error {
		_, err := sa.DiscoveryV1().EndpointSlices(engines).List(ctx, metav1.ListOptions{})
		return err
	})
	leases := sa.CoordinationV1().Leases(namespace)
	lease, err := leases.Create(ctx, &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: "rbac-check"},
		Spec:       coordinationv1.LeaseSpec{HolderIdentity: new("a")},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create lease: %v", err)
	}
	lease.Spec.HolderIdentity = new("b")
	if _, err := leases.Update(ctx, lease, metav1.UpdateOptions{}); err != nil {
		t.Errorf("update lease: %v", err)
	}
	if _, err := leases.Get(ctx, "rbac-check", metav1.GetOptions{}); err != nil {
		t.Errorf("get lease: %v", err)
	}

	checkStateRBAC(t, sa)
	checkPlannerRBAC(t, admin, sa, false)
	deployments := sa.AppsV1().Deployments(engines)
	// The proxies' xDS tokens are checked with TokenReviews.
	if _, err := sa.AuthenticationV1().TokenReviews().Create(ctx, &authv1.TokenReview{Spec: authv1.TokenReviewSpec{Token: "not-a-token"}}, metav1.CreateOptions{}); err != nil {
		t.Errorf("create a TokenReview: %v", err)
	}

	for what, err := range map[string]error{
		"list secrets":                         errOnly(sa.CoreV1().Secrets(namespace).List(ctx, metav1.ListOptions{})),
		"list configmaps":                      errOnly(sa.CoreV1().ConfigMaps(namespace).List(ctx, metav1.ListOptions{})),
		"create a lease in the engines' space": errOnly(sa.CoordinationV1().Leases(engines).Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "x"}}, metav1.CreateOptions{})),
		"list endpointslices of the release":   errOnly(sa.DiscoveryV1().EndpointSlices(namespace).List(ctx, metav1.ListOptions{})),
		"delete the engines' deployment":       deployments.Delete(ctx, "vllm", metav1.DeleteOptions{}),
		"delete the lease":                     leases.Delete(ctx, "rbac-check", metav1.DeleteOptions{}),
	} {
		if !apierrors.IsForbidden(err) {
			t.Errorf("%s: got %v, want forbidden", what, err)
		}
	}
}

// checkStateRBAC asks the API server, as the control plane's ServiceAccount (sa), for each of
// its rights on the kvrelay.io resources of the shared state (--store kubernetes) in the
// release's namespace, and for some it must not have: every right on the resources the
// replicas watch (registry.WatchedResources), a KvrelayPolicy's status, its own
// KvrelayShares (no delete: their pods own them), none in the engines' namespace.
func checkStateRBAC(t *testing.T, sa *kubernetes.Clientset) {
	ctx := t.Context()
	type right struct{ namespace, verb, resource, subresource string }
	var want, refused []right
	for _, r := range registry.WatchedResources {
		for _, verb := range []string{"get", "list", "watch", "create", "update", "delete"} {
			want = append(want, right{namespace, verb, r.Resource, ""})
		}
		refused = append(refused, right{engines, "list", r.Resource, ""}, right{namespace, "deletecollection", r.Resource, ""})
	}
	want = append(want, right{namespace, "update", "kvrelaypolicies", "status"})
	for _, verb := range []string{"get", "list", "create", "update"} {
		want = append(want, right{namespace, verb, registry.ShareResource.Resource, ""})
	}
	refused = append(refused, right{namespace, "delete", registry.ShareResource.Resource, ""},
		right{namespace, "update", "kvrelayworkers", "status"})
	can := func(r right) bool {
		t.Helper()
		review, err := sa.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authzv1.SelfSubjectAccessReview{
			Spec: authzv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authzv1.ResourceAttributes{
				Namespace: r.namespace, Verb: r.verb, Group: "kvrelay.io", Resource: r.resource, Subresource: r.subresource,
			}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("SelfSubjectAccessReview %+v: %v", r, err)
		}
		return review.Status.Allowed
	}
	name := func(r right) string { return strings.TrimSuffix(r.resource+"/"+r.subresource, "/") }
	for _, r := range want {
		if !can(r) {
			t.Errorf("the control plane may not %s %s in %s", r.verb, name(r), r.namespace)
		}
	}
	for _, r := range refused {
		if can(r) {
			t.Errorf("the control plane may %s %s in %s", r.verb, name(r), r.namespace)
		}
	}
}

// checkPlannerRBAC checks, as the control plane's ServiceAccount (sa), whether it may do what
// the planner's kube actuator does in the engines' namespace (scale a Deployment, read and
// mark its pods): allowed only with the planner's rights.
func checkPlannerRBAC(t *testing.T, admin, sa *kubernetes.Clientset, allowed bool) {
	ctx := t.Context()
	podLabels := map[string]string{"app": "vllm"}
	if _, err := admin.AppsV1().Deployments(engines).Create(ctx, &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "vllm"},
		Spec: appsv1.DeploymentSpec{
			Replicas: new(int32(1)),
			Selector: &metav1.LabelSelector{MatchLabels: podLabels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: podLabels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm:test"}}},
			},
		},
	}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create engines deployment: %v", err)
	}
	deployments := sa.AppsV1().Deployments(engines)
	check := func(what string, err error) {
		t.Helper()
		switch {
		case allowed && err != nil:
			t.Errorf("%s: %v", what, err)
		case !allowed && !apierrors.IsForbidden(err):
			t.Errorf("%s without the planner: got %v, want forbidden", what, err)
		}
	}
	if allowed {
		// The authorizer's informers see helm's new rules a moment after they are stored.
		eventually(t, 10*time.Second, func() error { return errOnly(deployments.GetScale(ctx, "vllm", metav1.GetOptions{})) })
	}
	scale, err := deployments.GetScale(ctx, "vllm", metav1.GetOptions{})
	check("get scale", err)
	if err == nil {
		scale.Spec.Replicas = 2
		check("update scale", errOnly(deployments.UpdateScale(ctx, "vllm", scale, metav1.UpdateOptions{})))
	}
	check("get deployment", errOnly(deployments.Get(ctx, "vllm", metav1.GetOptions{})))
	check("list pods", errOnly(sa.CoreV1().Pods(engines).List(ctx, metav1.ListOptions{})))
	if !allowed {
		return
	}
	// Of a pod, the planner may set the deletion cost and nothing else (the chart's
	// ValidatingAdmissionPolicy): not its image, not its labels, no other annotation.
	if _, err := admin.CoreV1().Pods(engines).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "vllm-0", Labels: podLabels, Annotations: map[string]string{"team": "llm"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm:test"}}},
	}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create engine pod: %v", err)
	}
	pods := sa.CoreV1().Pods(engines)
	patch := func(p string) error {
		_, err := pods.Patch(ctx, "vllm-0", types.MergePatchType, []byte(p), metav1.PatchOptions{})
		return err
	}
	image := `{"spec":{"containers":[{"name":"vllm","image":"attacker/vllm:evil"}]}}`
	// The policy takes effect once the API server's informer has it and has compiled it:
	// a second or two, but more than a minute when the whole suite (-race) loads the
	// machine. A change that got through before is undone by the administrator: undone as
	// the control plane, it would be refused once the policy is in force, and each later
	// try would then set the image it already has, a change of nothing that the policy
	// allows.
	begin := time.Now()
	eventually(t, 3*time.Minute, func() error {
		if err := patch(image); err == nil {
			if _, err := admin.CoreV1().Pods(engines).Patch(ctx, "vllm-0", types.MergePatchType,
				[]byte(`{"spec":{"containers":[{"name":"vllm","image":"vllm:test"}]}}`), metav1.PatchOptions{}); err != nil {
				return stopErr{fmt.Errorf("restoring the engine pod's image as the administrator: %w", err)}
			}
			return errors.New("the control plane changed an engine pod's image")
		} else if !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err) {
			return err
		}
		return nil
	})
	t.Logf("the pod patch policy took effect within %v", time.Since(begin).Round(100*time.Millisecond))
	if err := patch(`{"metadata":{"annotations":{"controller.kubernetes.io/pod-deletion-cost":"-100"}}}`); err != nil {
		t.Errorf("setting a pod's deletion cost: %v", err)
	}
	for what, p := range map[string]string{
		"a pod's labels":       `{"metadata":{"labels":{"app":"other"}}}`,
		"another annotation":   `{"metadata":{"annotations":{"team":"attacker"}}}`,
		"a removed annotation": `{"metadata":{"annotations":{"team":null}}}`,
		"a container's image":  image,
	} {
		if err := patch(p); err == nil || !(apierrors.IsInvalid(err) || apierrors.IsForbidden(err)) {
			t.Errorf("changing %s as the control plane: %v, want refused", what, err)
		}
	}
}

// errOnly drops a typed call's object.
func errOnly[T any](_ T, err error) error { return err }

// runInstalled runs the control plane and then a proxy with the arguments and environment
// of the installed Deployments, moved to loopback ports and temporary files, the control
// plane as its ServiceAccount (kubeconfig): it must take the Lease, follow the EndpointSlices
// in the engines' namespace, and see the proxy under its pod's name.
func runInstalled(t *testing.T, env *kubetest.Env, cs *kubernetes.Clientset, kubeconfig, token string) {
	ctx := t.Context()
	bin, err := testbin.Kvrelay()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}

	cpDep, err := cs.AppsV1().Deployments(namespace).Get(ctx, cpName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cpPod := cpName + "-6d4cf56db6-x7k2p"
	apiAddr, xdsAddr := loopback(t), loopback(t)
	c := container(t, cpDep, "controlplane")
	cpEnv := podEnv(t, c, cpPod)
	// The xDS listener's certificate and CA, as the chart generated them, in files as the
	// pods mount them.
	xdsTLS, err := cs.CoreV1().Secrets(namespace).Get(ctx, xdsSecret, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tlsFiles := map[string]string{}
	for _, k := range []string{"ca.crt", "tls.crt", "tls.key"} {
		tlsFiles[k] = filepath.Join(dir, k)
		if err := os.WriteFile(tlsFiles[k], xdsTLS.Data[k], 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cpArgs := localArgs(t, c.Args, cpEnv, map[string]string{
		"--api-token-file":     tokenFile,
		"--api-listen":         apiAddr,
		"--xds-listen":         xdsAddr,
		"--xds-cert":           tlsFiles["tls.crt"],
		"--xds-key":            tlsFiles["tls.key"],
		"--api-cert":           tlsFiles["tls.crt"],
		"--api-key":            tlsFiles["tls.key"],
		"--api-advertise":      apiAddr,
		"--api-peer-ca":        tlsFiles["ca.crt"],
		"--metrics-token-file": tokenFile,
	})
	// The operator API is HTTPS with the same certificate: a client that trusts the chart's
	// CA, for the Service's name.
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(xdsTLS.Data["ca.crt"])
	apiTransport := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: cpName + "." + namespace + ".svc"}}
	defer apiTransport.CloseIdleConnections()
	apiClient := &http.Client{Transport: apiTransport}
	// eBPF off: this test may run as root, where --ebpf auto would attach the probes.
	cpArgs = append(cpArgs, "--kubeconfig="+kubeconfig, "--ebpf=off")
	cp := startProc(t, "controlplane", bin, cpEnv, cpArgs)
	api := "https://" + apiAddr
	eventually(t, 30*time.Second, func() error { return cp.check(getWith(ctx, apiClient, api+"/readyz", "", "\"ready\"")) })

	lease := argValue(c, "--leader-elect-lease")
	eventually(t, 20*time.Second, func() error {
		l, err := cs.CoordinationV1().Leases(namespace).Get(ctx, lease, metav1.GetOptions{})
		if err != nil {
			return cp.check(err)
		}
		if h := l.Spec.HolderIdentity; h == nil || *h != cpPod {
			return cp.check(fmt.Errorf("lease %s held by %v, want %s", lease, h, cpPod))
		}
		return nil
	})

	// The informer, as the ServiceAccount, sees a slice in the engines' namespace. A slice
	// without a port makes no worker (no address is dialed: the API server refuses loopback
	// ones, and nothing else may be a target here) and a warning that names it.
	if _, err := cs.DiscoveryV1().EndpointSlices(engines).Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "vllm-1", Labels: map[string]string{"app": "vllm", discoveryv1.LabelServiceName: "vllm"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"192.0.2.7"}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create endpointslice: %v", err)
	}
	eventually(t, 20*time.Second, func() error {
		if out := cp.log.String(); !strings.Contains(out, "slice="+engines+"/vllm-1") {
			return cp.check(fmt.Errorf("the control plane has not seen EndpointSlice %s/vllm-1:\n%s", engines, out))
		}
		return nil
	})
	if out := cp.log.String(); strings.Contains(out, "forbidden") {
		t.Errorf("the control plane was refused a Kubernetes call:\n%s", out)
	}

	pxDep, err := cs.AppsV1().Deployments(namespace).Get(ctx, proxyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pxPod := proxyName + "-7f9b8c6d5-q4w8z"
	listen := loopback(t)
	pc := container(t, pxDep, "proxy")
	pxEnv := podEnv(t, pc, pxPod)
	// The token the kubelet would project into the proxy's pod: its ServiceAccount's, for
	// the audience the chart names, bound to the pod.
	xdsToken := podToken(t, cs, pxDep, pc, pxPod)
	pxArgs := localArgs(t, pc.Args, pxEnv, map[string]string{
		"--xds":            xdsAddr,
		"--listen":         listen,
		"--admin-listen":   loopback(t),
		"--xds-ca":         tlsFiles["ca.crt"],
		"--xds-token-file": xdsToken,
	})
	// The proxy dials loopback; the certificate names the Service.
	pxArgs = append(pxArgs, "--xds-server-name="+cpName+"."+namespace+".svc")
	// A proxy whose token is another pod's may not claim this pod's node id.
	intruder := startProc(t, "intruder", bin, pxEnv, append(localArgs(t, pc.Args, pxEnv, map[string]string{
		"--xds":            xdsAddr,
		"--listen":         loopback(t),
		"--admin-listen":   loopback(t),
		"--xds-ca":         tlsFiles["ca.crt"],
		"--xds-token-file": podToken(t, cs, pxDep, pc, proxyName+"-7f9b8c6d5-other"),
	}), "--xds-server-name="+cpName+"."+namespace+".svc", "--ebpf=off"))
	px := startProc(t, "proxy", bin, pxEnv, append(pxArgs, "--ebpf=off"))
	eventually(t, 30*time.Second, func() error { return px.check(get(ctx, "http://"+listen+"/health", "", "ok")) })
	// --node-id=$(POD_NAME): the control plane knows the proxy by its pod's name, which its
	// token was issued to; the intruder's streams were refused.
	eventually(t, 20*time.Second, func() error { return px.check(getWith(ctx, apiClient, api+"/v1/proxies", token, pxPod)) })
	refusedWrongNode := regexp.MustCompile(`kvrelay_controlplane_xds_refused_streams_total\{reason="wrong_node"\} [1-9]`)
	eventually(t, 20*time.Second, func() error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, api+"/metrics", nil)
		resp, err := apiClient.Do(req)
		if err != nil {
			return cp.check(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !refusedWrongNode.Match(body) {
			return intruder.check(fmt.Errorf("no stream refused for a node id its token was not issued for"))
		}
		return nil
	})

	// The state lives in the release's KvrelayPolicy (--store kubernetes): a policy set
	// through the operator API, as the ServiceAccount, is there. The replica takes changes
	// once it has read the shared state on winning the Lease (503 until then: retry).
	eventually(t, 20*time.Second, func() error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPut, api+"/v1/policy", strings.NewReader(`{"policy": "round-robin"}`))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := apiClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			return nil
		case http.StatusServiceUnavailable:
			return cp.check(fmt.Errorf("PUT /v1/policy: %d %s", resp.StatusCode, body))
		}
		t.Fatalf("PUT /v1/policy: %d %s\n%s", resp.StatusCode, body, cp.log.String())
		return nil
	})
	dyn, err := dynamic.NewForConfig(env.Config())
	if err != nil {
		t.Fatal(err)
	}
	storeName := argValue(c, "--store-name")
	u, err := dyn.Resource(registry.PolicyResource).Namespace(namespace).Get(ctx, storeName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the release's KvrelayPolicy: %v", err)
	}
	if name, _, _ := unstructured.NestedString(u.Object, "status", "policy", "name"); name != "round-robin" {
		t.Fatalf("KvrelayPolicy %s status.policy.name %q, want round-robin", storeName, name)
	}
}

// podToken writes to a file the token the kubelet would project for c of deployment d into
// the pod named pod (created for it), and returns the file's path.
func podToken(t *testing.T, cs *kubernetes.Clientset, d *appsv1.Deployment, c *corev1.Container, pod string) string {
	t.Helper()
	ctx := t.Context()
	var audience, path string
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.Projected == nil {
			continue
		}
		for _, src := range v.Projected.Sources {
			if sat := src.ServiceAccountToken; sat != nil {
				for _, m := range c.VolumeMounts {
					if m.Name == v.Name {
						audience, path = sat.Audience, m.MountPath+"/"+sat.Path
					}
				}
			}
		}
	}
	if audience == "" || path != argValue(c, "--xds-token-file") {
		t.Fatalf("%s: --xds-token-file %s is not a projected ServiceAccount token with an audience", c.Name, argValue(c, "--xds-token-file"))
	}
	sa := d.Spec.Template.Spec.ServiceAccountName
	p, err := cs.CoreV1().Pods(namespace).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod},
		Spec:       corev1.PodSpec{ServiceAccountName: sa, Containers: []corev1.Container{{Name: c.Name, Image: c.Image}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr, err := cs.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, sa, &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		Audiences:      []string{audience},
		BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.Name, UID: p.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("a token for ServiceAccount %s: %v", sa, err)
	}
	f := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(f, []byte(tr.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

// podEnv is the environment the kubelet would give c in pod: the downward API's fields of
// the chart resolved for a pod of that name in the release's namespace.
func podEnv(t *testing.T, c *corev1.Container, pod string) []string {
	t.Helper()
	var env []string
	for _, e := range c.Env {
		v := e.Value
		switch src := e.ValueFrom; {
		case src == nil:
		case src.FieldRef != nil && src.FieldRef.FieldPath == "metadata.name":
			v = pod
		case src.FieldRef != nil && src.FieldRef.FieldPath == "metadata.namespace":
			v = namespace
		case src.FieldRef != nil && src.FieldRef.FieldPath == "status.podIP":
			v = "127.0.0.1"
		case src.FieldRef != nil && src.FieldRef.FieldPath == "metadata.uid":
			v = "6d4cf56d-b6x7-4k2p-9000-000000000001"
		case src.ResourceFieldRef != nil && src.ResourceFieldRef.Resource == "requests.cpu":
			// The kubelet rounds the request up to whole units of the divisor, 1 CPU.
			v = strconv.FormatInt(c.Resources.Requests.Cpu().Value(), 10)
		default:
			t.Fatalf("%s: env %s from %+v, which the test does not resolve", c.Name, e.Name, src)
		}
		env = append(env, e.Name+"="+v)
	}
	return env
}

// localArgs returns args with $(VAR) expanded from env, as the kubelet does, and the value
// of each flag in set replaced; every one of them must be there.
func localArgs(t *testing.T, args, env []string, set map[string]string) []string {
	t.Helper()
	var pairs []string
	for _, kv := range env {
		name, v, _ := strings.Cut(kv, "=")
		pairs = append(pairs, "$("+name+")", v)
	}
	expand := strings.NewReplacer(pairs...)
	out := make([]string, 0, len(args))
	seen := map[string]bool{}
	for _, a := range args {
		a = expand.Replace(a)
		if flag, _, ok := strings.Cut(a, "="); ok {
			if v, ok := set[flag]; ok {
				a = flag + "=" + v
				seen[flag] = true
			}
		}
		out = append(out, a)
	}
	for flag := range set {
		if !seen[flag] {
			t.Fatalf("args %q lack %s", args, flag)
		}
	}
	return out
}

// proc is a kvrelay process the test started.
type proc struct {
	name string
	log  *testbin.Output
	done chan struct{} // closed when it has exited
	err  error
}

// check returns err, or that the process exited (its output with it), or nil.
func (p *proc) check(err error) error {
	select {
	case <-p.done:
		return stopErr{fmt.Errorf("%s exited (%v):\n%s", p.name, p.err, p.log)}
	default:
		return err
	}
}

// stopErr ends eventually at once.
type stopErr struct{ error }

// startProc runs bin with args and env (besides this process's). t.Cleanup stops it with
// SIGTERM, as the kubelet does (the control plane then releases its Lease), and logs its
// output when t failed.
func startProc(t *testing.T, name, bin string, env, args []string) *proc {
	t.Helper()
	p := &proc{name: name, log: new(testbin.Output), done: make(chan struct{})}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = p.log, p.log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("%s %q output:\n%s", name, args, p.log)
		}
	})
	return p
}

// get returns nil when url answers 200 with a body holding each of want, else why not. A
// token, when given, goes as the bearer.
func get(ctx context.Context, url, token string, want ...string) error {
	return getWith(ctx, http.DefaultClient, url, token, want...)
}

// getWith is get through client.
func getWith(ctx context.Context, client *http.Client, url, token string, want ...string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, body)
	}
	for _, w := range want {
		if !bytes.Contains(body, []byte(w)) {
			return fmt.Errorf("GET %s: %s lacks %q", url, body, w)
		}
	}
	return nil
}

// eventually calls f until it returns nil, failing t with its last error after d or at once
// on a stopErr.
func eventually(t *testing.T, d time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if _, stop := err.(stopErr); stop || time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// freePort returns a loopback TCP port nothing listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func loopback(t *testing.T) string { return "127.0.0.1:" + strconv.Itoa(freePort(t)) }
