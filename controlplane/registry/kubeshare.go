package registry

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// ShareLabel marks the KvrelayShares in which replicas share what only they see (their
// proxies' rollout figures, their operator API's address) with the others; its value names
// what is shared.
const ShareLabel = "kvrelay.io/share"

// ShareResource holds one replica's share of one thing (PutShare): a resource of its own
// rather than ConfigMaps, so that the control plane needs no right on the namespace's
// ConfigMaps.
var ShareResource = schema.GroupVersionResource{Group: "kvrelay.io", Version: "v1alpha1", Resource: "kvrelayshares"}

// shareName is the KvrelayShare holding replica's share of what.
func (s *KubeStore) shareName(what, replica string) string {
	return s.workerName(what + "-" + replica)
}

// SetShareOwner makes the pod named pod (its UID uid) the owner of this replica's shares,
// so that Kubernetes' garbage collector deletes them with the pod instead of leaving one
// behind per replica that ever ran. Call it before the first PutShare.
func (s *KubeStore) SetShareOwner(pod, uid string) {
	s.mu.Lock()
	s.shareOwner = []any{map[string]any{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}}
	s.mu.Unlock()
}

// PutShare stores this replica's share of what (data, a JSON document) in a KvrelayShare of
// this control plane, <name>-<what>-<replica>, labelled with StoreLabel and ShareLabel, for
// the others to read (Shares). Unlike the other resources it is not watched: a reader lists
// the shares when it needs them.
func (s *KubeStore) PutShare(what, replica string, data []byte) error {
	name := s.shareName(what, replica)
	c := s.dyn.Resource(ShareResource).Namespace(s.namespace)
	s.mu.Lock()
	owner := s.shareOwner
	s.mu.Unlock()
	spec := map[string]any{"replica": replica, "what": what, "data": string(data)}
	return write(func(ctx context.Context) error {
		cur, err := c.Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			meta := map[string]any{"name": name, "namespace": s.namespace,
				"labels": map[string]any{StoreLabel: s.name, ShareLabel: what}}
			if owner != nil {
				meta["ownerReferences"] = owner
			}
			obj := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "kvrelay.io/v1alpha1", "kind": "KvrelayShare",
				"metadata": meta,
				"spec":     spec,
			}}
			_, err = c.Create(ctx, obj, metav1.CreateOptions{})
			return err
		case err != nil:
			return err
		}
		cur.Object["spec"] = spec
		if owner != nil {
			// A pod of the same name restarted (a StatefulSet's) is another owner.
			_ = unstructured.SetNestedSlice(cur.Object, owner, "metadata", "ownerReferences")
		}
		_, err = c.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
}

// Shares lists every replica's share of what (PutShare), by replica.
func (s *KubeStore) Shares(ctx context.Context, what string) (map[string][]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	l, err := s.dyn.Resource(ShareResource).Namespace(s.namespace).List(ctx, metav1.ListOptions{
		LabelSelector: StoreLabel + "=" + s.name + "," + ShareLabel + "=" + what})
	if err != nil {
		return nil, fmt.Errorf("listing the replicas' %s shares in %s: %w", what, s.namespace, err)
	}
	out := map[string][]byte{}
	for _, u := range l.Items {
		replica, _, _ := unstructured.NestedString(u.Object, "spec", "replica")
		data, _, _ := unstructured.NestedString(u.Object, "spec", "data")
		if replica != "" {
			out[replica] = []byte(data)
		}
	}
	return out, nil
}
