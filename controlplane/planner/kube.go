package planner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"time"

	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// PodDeletionCostAnnotation is the annotation the ReplicaSet controller reads to choose
// which pods go first when a Deployment shrinks (lower cost goes first).
const PodDeletionCostAnnotation = "controller.kubernetes.io/pod-deletion-cost"

// Drainer drains workers in the control plane's registry (registry.Registry satisfies it).
type Drainer interface {
	SetDraining(id string, draining bool) error
}

// KubeActuator scales one Deployment per pool through its scale subresource. New pods become
// workers through the registry's EndpointSlices source (Registry.WatchEndpointSlices); before
// a shrink it picks the pods to go, marks them with a low pod-deletion-cost so the
// ReplicaSet controller removes those, drains them in the registry (no new requests) and waits
// until their in-flight requests finish or DrainTimeout passes. A failed scale call is
// retried (Attempts, with Backoff doubling) and then returned; the drained pods are undrained.
//
// It needs RBAC: get/update on deployments/scale, get on deployments, list/patch on pods
// (hack/deploy/planner-rbac.yaml).
type KubeActuator struct {
	Client    kubernetes.Interface
	Namespace string
	// Deployments names each pool's Deployment.
	Deployments map[Pool]string
	// Drainer, when set, drains the pods that go (by worker id, WorkerID(pod)).
	Drainer Drainer
	// WorkerID maps a pod to its registry worker id (default: the pod's name, as the
	// EndpointSlices source names workers when watching one namespace).
	WorkerID func(pod *corev1.Pod) string
	// Inflight reports a worker's in-flight requests (running + waiting); with nil, drains
	// only wait DrainGrace.
	Inflight func(ctx context.Context, id string) (int, error)
	// DrainGrace is the least time between draining and scaling (the proxies must learn of
	// the drain first; default 1 s); DrainTimeout the most (default 2 min).
	DrainGrace, DrainTimeout time.Duration
	// Attempts and Backoff retry failed scale calls (default 5 and 200 ms).
	Attempts int
	Backoff  time.Duration
	Logger   *slog.Logger
}

func (k *KubeActuator) log() *slog.Logger {
	if k.Logger == nil {
		return slog.Default()
	}
	return k.Logger
}

// Replicas reads each pool's Deployment's scale (spec.replicas).
func (k *KubeActuator) Replicas(ctx context.Context) (map[Pool]int, error) {
	out := map[Pool]int{}
	for pool, name := range k.Deployments {
		s, err := k.Client.AppsV1().Deployments(k.Namespace).GetScale(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("reading the scale of deployment %s/%s: %w", k.Namespace, name, err)
		}
		out[pool] = int(s.Spec.Replicas)
	}
	return out, nil
}

// Scale sets pool's Deployment to n replicas, draining the pods that go first.
func (k *KubeActuator) Scale(ctx context.Context, pool Pool, n int) error {
	name, ok := k.Deployments[pool]
	if !ok {
		return fmt.Errorf("scaling pool %s: no deployment configured for it", pool)
	}
	if n < 0 {
		return fmt.Errorf("scaling pool %s: %d replicas", pool, n)
	}
	cur, err := k.retry(ctx, func() (*autoscalingv1.Scale, error) {
		return k.Client.AppsV1().Deployments(k.Namespace).GetScale(ctx, name, metav1.GetOptions{})
	})
	if err != nil {
		return fmt.Errorf("scaling deployment %s/%s: reading its scale: %w", k.Namespace, name, err)
	}
	var drained []string
	if n < int(cur.Spec.Replicas) {
		if drained, err = k.drainVictims(ctx, name, int(cur.Spec.Replicas)-n); err != nil {
			k.undrain(drained)
			return fmt.Errorf("scaling deployment %s/%s down to %d: %w", k.Namespace, name, n, err)
		}
	}
	_, err = k.retry(ctx, func() (*autoscalingv1.Scale, error) {
		s, err := k.Client.AppsV1().Deployments(k.Namespace).GetScale(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, err
		}
		if int(s.Spec.Replicas) == n {
			return s, nil
		}
		s.Spec.Replicas = int32(n)
		return k.Client.AppsV1().Deployments(k.Namespace).UpdateScale(ctx, name, s, metav1.UpdateOptions{})
	})
	if err != nil {
		k.undrain(drained)
		return fmt.Errorf("scaling deployment %s/%s to %d: %w", k.Namespace, name, n, err)
	}
	return nil
}

// retry calls f until it succeeds, Attempts are spent or ctx ends; Backoff doubles.
func (k *KubeActuator) retry(ctx context.Context, f func() (*autoscalingv1.Scale, error)) (*autoscalingv1.Scale, error) {
	attempts, backoff := k.Attempts, k.Backoff
	if attempts <= 0 {
		attempts = 5
	}
	if backoff <= 0 {
		backoff = 200 * time.Millisecond
	}
	var err error
	for i := range attempts {
		var s *autoscalingv1.Scale
		if s, err = f(); err == nil {
			return s, nil
		}
		if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) || apierrors.IsInvalid(err) {
			return nil, err // retrying cannot help
		}
		k.log().Warn("kubernetes actuator: call failed, retrying", "attempt", i+1, "of", attempts, "err", err)
		if i < attempts-1 {
			select {
			case <-ctx.Done():
				return nil, errors.Join(err, ctx.Err())
			case <-time.After(backoff << i):
			}
		}
	}
	return nil, fmt.Errorf("%d attempts: %w", attempts, err)
}

// drainVictims picks count pods of the Deployment to go (not ready first, then the
// newest), lowers their deletion cost, drains them and waits for them to empty. It returns
// the worker ids it drained.
func (k *KubeActuator) drainVictims(ctx context.Context, deployment string, count int) ([]string, error) {
	d, err := k.Client.AppsV1().Deployments(k.Namespace).Get(ctx, deployment, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("reading the deployment: %w", err)
	}
	sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	if err != nil {
		return nil, fmt.Errorf("the deployment's selector: %w", err)
	}
	pods, err := k.Client.CoreV1().Pods(k.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return nil, fmt.Errorf("listing the deployment's pods: %w", err)
	}
	ps := slices.DeleteFunc(pods.Items, func(p corev1.Pod) bool { return p.DeletionTimestamp != nil })
	slices.SortStableFunc(ps, func(a, b corev1.Pod) int {
		if ra, rb := podReady(&a), podReady(&b); ra != rb {
			if !ra {
				return -1
			}
			return 1
		}
		return b.CreationTimestamp.Compare(a.CreationTimestamp.Time)
	})
	ps = ps[:min(count, len(ps))]
	var ids []string
	for i := range ps {
		p := &ps[i]
		patch := []byte(`{"metadata":{"annotations":{"` + PodDeletionCostAnnotation + `":"` + strconv.Itoa(-1000) + `"}}}`)
		if _, err := k.Client.CoreV1().Pods(k.Namespace).Patch(ctx, p.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return ids, fmt.Errorf("marking pod %s to go first: %w", p.Name, err)
		}
		if k.Drainer != nil {
			id := p.Name
			if k.WorkerID != nil {
				id = k.WorkerID(p)
			}
			if err := k.Drainer.SetDraining(id, true); err != nil {
				k.log().Warn("kubernetes actuator: draining a worker before it goes", "id", id, "err", err)
				continue
			}
			ids = append(ids, id)
		}
	}
	return ids, k.waitDrained(ctx, ids)
}

func (k *KubeActuator) waitDrained(ctx context.Context, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	grace, timeout := k.DrainGrace, k.DrainTimeout
	if grace <= 0 {
		grace = time.Second
	}
	if timeout <= 0 {
		timeout = 2 * time.Minute
	}
	return waitIdle(ctx, ids, k.Inflight, grace, timeout, k.log())
}

// waitIdle waits at least grace, then until every worker reports no requests in flight or
// timeout passes (logged, not an error: a stuck request must not block scaling forever).
func waitIdle(ctx context.Context, ids []string, inflight func(context.Context, string) (int, error), grace, timeout time.Duration, log *slog.Logger) error {
	deadline := time.Now().Add(timeout)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(grace):
	}
	if inflight == nil {
		return nil
	}
	for _, id := range ids {
		for {
			n, err := inflight(ctx, id)
			if err == nil && n == 0 {
				break
			}
			if time.Now().After(deadline) {
				log.Warn("drain timed out: removing the worker with requests in flight", "id", id, "inflight", n, "err", err)
				break
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}

func (k *KubeActuator) undrain(ids []string) {
	for _, id := range ids {
		if err := k.Drainer.SetDraining(id, false); err != nil {
			k.log().Warn("kubernetes actuator: undraining a worker after a failed scale", "id", id, "err", err)
		}
	}
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

var _ Actuator = (*KubeActuator)(nil)
