package kubeauth_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kvrelay/kvrelay/controlplane/kubeauth"
	"github.com/kvrelay/kvrelay/internal/kubetest"
	"github.com/kvrelay/kvrelay/xds/auth"
)

// TestReview against a real API server: a token the kubelet would project into a proxy's
// pod (its ServiceAccount, the xDS audience, bound to the pod) names the pod; a token for
// another audience, of another ServiceAccount, bound to no pod, or forged is refused, and
// so is the proxy's own token once its pod is gone.
func TestReview(t *testing.T) {
	env := kubetest.Start(t)
	cs := env.Clientset(t)
	ctx := t.Context()
	const ns = "kvrelay"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, sa := range []string{"proxy", "other"} {
		if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	pod := func(name, sa string) *corev1.Pod {
		p, err := cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       corev1.PodSpec{ServiceAccountName: sa, Containers: []corev1.Container{{Name: "c", Image: "kvrelay"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	token := func(sa string, p *corev1.Pod, audience string) string {
		tr := &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{Audiences: []string{audience}}}
		if p != nil {
			tr.Spec.BoundObjectRef = &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.Name, UID: p.UID}
		}
		out, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, tr, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return out.Status.Token
	}
	proxy, other := pod("proxy-0", "proxy"), pod("other-0", "other")
	good := token("proxy", proxy, kubeauth.DefaultAudience)

	review := func(tok string) ([]string, error) {
		r, err := kubeauth.New(cs, "", []string{ns + "/proxy"})
		if err != nil {
			t.Fatal(err)
		}
		return r.Review(ctx, tok)
	}
	if nodes, err := review(good); err != nil || !slices.Equal(nodes, []string{"proxy-0"}) {
		t.Fatalf("the proxy's projected token: %v, %v; want its pod proxy-0", nodes, err)
	}
	for _, tc := range []struct{ name, token string }{
		{"a token for the API server", token("proxy", proxy, "https://kubernetes.default.svc")},
		{"another ServiceAccount's", token("other", other, kubeauth.DefaultAudience)},
		{"bound to no pod", token("proxy", nil, kubeauth.DefaultAudience)},
		{"forged", good[:len(good)-8] + "AAAAAAAA"},
		{"not a token", "kvrelay"},
	} {
		if nodes, err := review(tc.token); !errors.Is(err, auth.ErrTokenRefused) {
			t.Errorf("%s: %v, %v; want ErrTokenRefused", tc.name, nodes, err)
		}
	}
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "proxy-0", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	// The API server checks the binding against its own cache of the pods: within seconds
	// (about ten here).
	begin := time.Now()
	deadline := begin.Add(60 * time.Second)
	for {
		nodes, err := review(good)
		if errors.Is(err, auth.ErrTokenRefused) {
			t.Logf("the token of the deleted pod refused %s after the deletion", time.Since(begin).Round(100*time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the token of a deleted pod: %v, %v; want ErrTokenRefused", nodes, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// An API server that cannot be reached is not a refusal: the proxy retries.
func TestReviewUnreachable(t *testing.T) {
	cs, err := kubernetes.NewForConfig(&restConfigUnreachable)
	if err != nil {
		t.Fatal(err)
	}
	r, err := kubeauth.New(cs, "", []string{"kvrelay/proxy"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := r.Review(ctx, "token"); err == nil || errors.Is(err, auth.ErrTokenRefused) {
		t.Fatalf("unreachable API server: %v, want an error other than a refusal", err)
	}
}

func TestNewValidates(t *testing.T) {
	cs, _ := kubernetes.NewForConfig(&restConfigUnreachable)
	for _, sas := range [][]string{nil, {"proxy"}, {"/proxy"}, {"ns/"}, {"a/b/c"}} {
		if _, err := kubeauth.New(cs, "", sas); err == nil {
			t.Errorf("New with ServiceAccounts %q: no error", sas)
		}
	}
	if _, err := kubeauth.New(nil, "", []string{"ns/sa"}); err == nil {
		t.Error("New without a client: no error")
	}
}

var restConfigUnreachable = rest.Config{Host: "https://127.0.0.1:1"}
