// Package kubeauth checks proxies' Kubernetes ServiceAccount tokens for the control plane's
// xDS listener, as istiod checks its sidecars': each proxy pod presents a token the kubelet
// projected for it with the control plane's audience, the control plane asks the API server
// about it (a TokenReview), admits only the ServiceAccounts it was told to, and binds the
// stream to the pod the token was issued to, whose name is the proxy's node id.
package kubeauth

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kvrelay/kvrelay/xds/auth"
)

// DefaultAudience is the audience the proxies' projected tokens are issued for: a token for
// the API server (the pod's default one) is refused, so that a token stolen from any pod
// does not open the xDS port, and one issued for the xDS port is no good elsewhere.
const DefaultAudience = "kvrelay-xds"

// podNameExtra is where a TokenReview names the pod a bound token was issued to.
const podNameExtra = "authentication.kubernetes.io/pod-name"

// Reviewer is an auth.TokenReviewer on a Kubernetes API server.
type Reviewer struct {
	client   kubernetes.Interface
	audience string
	allowed  []string // "namespace/serviceaccount"
	ttl      time.Duration
	now      func() time.Time

	mu    sync.Mutex
	cache map[[sha256.Size]byte]verdict
}

// verdict is a review kept for a while: the nodes a token names, or why it was refused.
type verdict struct {
	nodes   []string
	refused error
	until   time.Time
}

// CacheTTL is how long a review is kept: a proxy opens several streams and reconnects, and
// each need not cost a TokenReview; a token revoked (its pod deleted) is refused within it.
const CacheTTL = time.Minute

// maxCache bounds the reviews kept (tokens of proxies that left, and refused tokens a
// client keeps sending).
const maxCache = 4096

// New returns a Reviewer that admits tokens for audience (DefaultAudience when empty)
// issued to the ServiceAccounts named "namespace/name" in serviceAccounts and bound to a
// pod, through client (which needs create on tokenreviews.authentication.k8s.io).
func New(client kubernetes.Interface, audience string, serviceAccounts []string) (*Reviewer, error) {
	if client == nil {
		return nil, errors.New("kubeauth: no Kubernetes client")
	}
	if audience == "" {
		audience = DefaultAudience
	}
	if len(serviceAccounts) == 0 {
		return nil, errors.New("kubeauth: no ServiceAccount to admit (namespace/name)")
	}
	for _, sa := range serviceAccounts {
		ns, name, ok := strings.Cut(sa, "/")
		if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
			return nil, fmt.Errorf("kubeauth: ServiceAccount %q is not namespace/name", sa)
		}
	}
	return &Reviewer{client: client, audience: audience, allowed: slices.Clone(serviceAccounts), ttl: CacheTTL, now: time.Now,
		cache: map[[sha256.Size]byte]verdict{}}, nil
}

// Name implements auth.TokenReviewer.
func (r *Reviewer) Name() string {
	return fmt.Sprintf("Kubernetes ServiceAccount tokens (audience %s; %s)", r.audience, strings.Join(r.allowed, ", "))
}

// Review implements auth.TokenReviewer: the pod's name, once the API server has
// authenticated the token for the audience as a ServiceAccount admitted, bound to a pod.
func (r *Reviewer) Review(ctx context.Context, token string) ([]string, error) {
	h := sha256.Sum256([]byte(token))
	now := r.now()
	r.mu.Lock()
	v, ok := r.cache[h]
	r.mu.Unlock()
	if ok && now.Before(v.until) {
		return v.nodes, v.refused
	}
	tr, err := r.client.AuthenticationV1().TokenReviews().Create(ctx, &authv1.TokenReview{
		Spec: authv1.TokenReviewSpec{Token: token, Audiences: []string{r.audience}},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("TokenReview: %w", err) // not cached: the API server may answer next time
	}
	v = r.judge(tr.Status)
	v.until = now.Add(r.ttl)
	r.mu.Lock()
	if len(r.cache) >= maxCache {
		for k, old := range r.cache {
			if !now.Before(old.until) || len(r.cache) >= maxCache {
				delete(r.cache, k)
			}
		}
	}
	r.cache[h] = v
	r.mu.Unlock()
	return v.nodes, v.refused
}

// judge turns a TokenReview's status into a verdict.
func (r *Reviewer) judge(st authv1.TokenReviewStatus) verdict {
	refuse := func(format string, args ...any) verdict {
		return verdict{refused: fmt.Errorf("%w: %s", auth.ErrTokenRefused, fmt.Sprintf(format, args...))}
	}
	if !st.Authenticated {
		if st.Error != "" {
			return refuse("the API server did not authenticate it: %s", st.Error)
		}
		return refuse("the API server did not authenticate it")
	}
	if !slices.Contains(st.Audiences, r.audience) {
		return refuse("not issued for audience %s", r.audience)
	}
	ns, sa, ok := strings.Cut(strings.TrimPrefix(st.User.Username, "system:serviceaccount:"), ":")
	if !ok || !strings.HasPrefix(st.User.Username, "system:serviceaccount:") {
		return refuse("%s is not a ServiceAccount", st.User.Username)
	}
	if !slices.Contains(r.allowed, ns+"/"+sa) {
		return refuse("ServiceAccount %s/%s is not a proxy's", ns, sa)
	}
	pods := st.User.Extra[podNameExtra]
	if len(pods) != 1 || pods[0] == "" {
		return refuse("the token of %s/%s is not bound to a pod (a projected ServiceAccount token is)", ns, sa)
	}
	return verdict{nodes: []string{pods[0]}}
}

var _ auth.TokenReviewer = (*Reviewer)(nil)
