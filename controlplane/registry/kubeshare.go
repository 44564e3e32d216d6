package registry

import (
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
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

// A replica's share of one thing is one KvrelayShare, its head <name>-<what>-<replica>
// (shareName), while its data fits in sharePartBytes, and several beyond. Data longer than
// shareCompressAbove is compressed (spec.encoding gzip+base64: the base64 text of its gzip);
// shorter data, such as an operator API's address, stays the plain JSON that kubectl shows.
// The result is cut into parts of at most sharePartBytes: the first in the head, part i in
// <head>.<write>-<i>. Every object of one write carries its stamp (spec.write and the label
// kvrelay.io/share-write), the head the count of parts (spec.parts), each other part its
// index (spec.part). PutShare creates a write's other parts first, then rewrites the head,
// then deletes the parts of earlier writes: a reader's List, one snapshot, finds the head of
// one write with that write's parts all there, never parts of two writes, and no part the
// head does not name. A head without spec.parts is a share written whole, as plain JSON (by
// a control plane that did not split shares, or under a CRD that drops the fields).
const (
	// maxShareParts bounds the objects of one share (32 MiB of encoded data): PutShare
	// refuses a bigger share rather than load the API server and etcd with it.
	maxShareParts = 64
	// shareCompressAbove is the length of data compressed; shorter data is stored as is.
	shareCompressAbove = 1 << 10
	// maxShareBytes bounds a share's data decompressed.
	maxShareBytes = 1 << 30
	// shareGzip is spec.encoding of compressed data.
	shareGzip = "gzip+base64"
	// wholeSharesRecheck is how long PutShare writes shares whole after finding that the
	// KvrelayShare CRD drops the fields of split shares, before it tries again.
	wholeSharesRecheck = 10 * time.Minute
)

// sharePartBytes bounds spec.data of one KvrelayShare: with its metadata the object stays
// well below the API server's limit (etcd's requests of at most 1.5 MiB by default). A
// variable for tests.
var sharePartBytes = 512 << 10

// The labels of split shares: shareOfLabel holds a hash of the head's name, shareWriteLabel
// the write's stamp, so that one request deletes the parts of a replica's earlier writes.
const (
	shareOfLabel    = "kvrelay.io/share-of"
	shareWriteLabel = "kvrelay.io/share-write"
)

// shareName is the KvrelayShare holding replica's share of what (its head).
func (s *KubeStore) shareName(what, replica string) string {
	return s.workerName(what + "-" + replica)
}

// sharePartName is the KvrelayShare holding part i (from 1) of write stamp of the share
// whose head is head. Heads have no dot after the control plane's name, so a part is never
// another replica's head.
func (s *KubeStore) sharePartName(head, stamp string, i int) string {
	suffix := "." + stamp + "-" + strconv.Itoa(i)
	if len(head)+len(suffix) > 253 {
		return s.name + "-" + shareOf(head) + suffix
	}
	return head + suffix
}

// shareOf is shareOfLabel's value for the share whose head is head.
func shareOf(head string) string {
	sum := sha256.Sum256([]byte(head))
	return hex.EncodeToString(sum[:16])
}

// shareWriter is the state of PutShare for one share (one head).
type shareWriter struct {
	mu sync.Mutex // serialises the share's writes
	// seq is the time of the latest write's stamp, in nanoseconds: each next one is later.
	seq int64
	// head is the stamp of the write the head holds, as this writer last wrote it.
	head string
	// stray: objects of writes other than the latest may be left (parts, or parts and a
	// head not yet written, or whatever an earlier process left).
	stray bool
	// cleanErr is the latest failure to delete them, until one succeeds.
	cleanErr error
}

// stamp is the stamp of a new write: later than the writer's earlier ones, and random
// against another process's.
func (w *shareWriter) stamp() string {
	w.seq = max(time.Now().UnixNano(), w.seq+1)
	return strconv.FormatInt(w.seq, 36) + fmt.Sprintf("%04x", rand.N(1<<16))
}

// shareWriter is the writer of the share whose head is head.
func (s *KubeStore) shareWriter(head string) *shareWriter {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shareWriters == nil {
		s.shareWriters = map[string]*shareWriter{}
	}
	w := s.shareWriters[head]
	if w == nil {
		w = &shareWriter{stray: true}
		s.shareWriters[head] = w
	}
	return w
}

// encodeShare is data as spec.data holds it, and its spec.encoding ("": plain).
func encodeShare(data []byte) (string, string) {
	if len(data) <= shareCompressAbove {
		return string(data), ""
	}
	var b strings.Builder
	b64 := base64.NewEncoder(base64.StdEncoding, &b)
	z := gzip.NewWriter(b64)
	_, _ = z.Write(data) // a strings.Builder takes every write
	_ = z.Close()
	_ = b64.Close()
	return b.String(), shareGzip
}

// decodeShare is the data that spec.data (joined across parts) holds in encoding.
func decodeShare(data, encoding string) ([]byte, error) {
	switch encoding {
	case "":
		return []byte(data), nil
	case shareGzip:
		z, err := gzip.NewReader(base64.NewDecoder(base64.StdEncoding, strings.NewReader(data)))
		if err != nil {
			return nil, err
		}
		b, err := io.ReadAll(io.LimitReader(z, maxShareBytes+1))
		if err != nil {
			return nil, err
		}
		if len(b) > maxShareBytes {
			return nil, fmt.Errorf("more than %d bytes decompressed", maxShareBytes)
		}
		return b, nil
	}
	return nil, fmt.Errorf("unknown encoding %q", encoding)
}

// splitShare cuts encoded data into parts of at most sharePartBytes (one, empty, for none).
func splitShare(data string) []string {
	parts := []string{}
	for len(data) > sharePartBytes {
		parts = append(parts, data[:sharePartBytes])
		data = data[sharePartBytes:]
	}
	return append(parts, data)
}

// SetShareOwner makes the pod named pod (its UID uid) the owner of this replica's shares,
// so that Kubernetes' garbage collector deletes them with the pod instead of leaving one
// behind per replica that ever ran. Call it before the first PutShare.
func (s *KubeStore) SetShareOwner(pod, uid string) {
	s.mu.Lock()
	s.shareOwner = []any{map[string]any{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}}
	s.mu.Unlock()
}

// PutShare stores this replica's share of what (data, a JSON document) in the KvrelayShares
// of this control plane named after what and replica (above), labelled with StoreLabel and
// ShareLabel, for the others to read (Shares): compressed when longer than 1 KiB, split
// across objects of at most 512 KiB beyond. Unlike the other resources they are not watched:
// a reader lists the shares when it needs them. PutShare refuses a share of more than
// maxShareParts objects.
func (s *KubeStore) PutShare(what, replica string, data []byte) error {
	head := s.shareName(what, replica)
	w := s.shareWriter(head)
	w.mu.Lock()
	defer w.mu.Unlock()
	stamp := w.stamp()
	s.mu.Lock()
	owner := s.shareOwner
	whole := !s.wholeSharesSince.IsZero() && time.Since(s.wholeSharesSince) < wholeSharesRecheck
	s.mu.Unlock()
	labels := map[string]string{StoreLabel: s.name, ShareLabel: what, shareOfLabel: shareOf(head), shareWriteLabel: stamp}
	wholeSpec := map[string]any{"replica": replica, "what": what, "data": string(data)}
	if whole {
		if _, err := s.putShareObject(head, labels, owner, wholeSpec, false); err != nil {
			return err
		}
		s.cleanShare(w, head, stamp, false)
		return nil
	}
	enc, encoding := encodeShare(data)
	parts := splitShare(enc)
	if len(parts) > maxShareParts {
		return fmt.Errorf("the %s share of %d bytes takes %d KvrelayShares of %d KiB, more than %d", what, len(data), len(parts), sharePartBytes>>10, maxShareParts)
	}
	if len(parts) > 1 && w.cleanErr != nil && w.head != "" {
		// The parts of earlier writes are still there: delete them before writing more.
		if err := s.deleteShareParts(head, w.head); err != nil {
			return fmt.Errorf("the %s share's earlier parts not deleted, no more written: %w", what, err)
		}
		w.cleanErr = nil
	}
	for i := 1; i < len(parts); i++ {
		w.stray = true
		spec := map[string]any{"replica": replica, "what": what, "write": stamp, "part": int64(i), "data": parts[i]}
		if _, err := s.putShareObject(s.sharePartName(head, stamp, i), labels, owner, spec, true); err != nil {
			return err
		}
	}
	spec := map[string]any{"replica": replica, "what": what, "write": stamp, "parts": int64(len(parts)), "data": parts[0]}
	if encoding != "" {
		spec["encoding"] = encoding
	}
	got, err := s.putShareObject(head, labels, owner, spec, false)
	if err != nil {
		return err
	}
	if _, kept, _ := unstructured.NestedInt64(got.Object, "spec", "parts"); !kept {
		// A KvrelayShare CRD from before split shares, which the API server prunes the
		// fields of: write the share whole, as before.
		s.mu.Lock()
		s.wholeSharesSince = time.Now()
		s.mu.Unlock()
		s.log.Warn("the KvrelayShare CRD drops spec.parts: this replica's shares are written whole and uncompressed, and fail beyond the API server's object size; apply the chart's crds/", "share", what)
		w.stray = true // this write's parts, which the whole one's stamp leaves out
		stamp = w.stamp()
		labels[shareWriteLabel] = stamp
		if _, err := s.putShareObject(head, labels, owner, wholeSpec, false); err != nil {
			return err
		}
		s.cleanShare(w, head, stamp, false)
		return nil
	}
	s.cleanShare(w, head, stamp, len(parts) > 1)
	return nil
}

// cleanShare deletes the objects of the share whose head is head written before the write
// stamp, which the head now holds, if any may be left; split says that write has parts
// besides the head, which the next write deletes. A failure is logged, not returned: the
// share is written, and readers take no part of another write.
func (s *KubeStore) cleanShare(w *shareWriter, head, stamp string, split bool) {
	w.head = stamp
	if w.stray {
		if err := s.deleteShareParts(head, stamp); err != nil {
			if w.cleanErr == nil {
				s.log.Warn("the parts of a share's earlier writes not deleted", "share", head, "err", err)
			}
			w.cleanErr = err
			return
		}
		w.cleanErr = nil
	}
	w.stray = split
}

// deleteShareParts deletes the objects of the share whose head is head that are not of the
// write keep.
func (s *KubeStore) deleteShareParts(head, keep string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return s.dyn.Resource(ShareResource).Namespace(s.namespace).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{
		LabelSelector: StoreLabel + "=" + s.name + "," + shareOfLabel + "=" + shareOf(head) + "," + shareWriteLabel + "!=" + keep})
}

// putShareObject writes the KvrelayShare name with labels, owner and spec, creating it or
// replacing its spec; fresh says it is most likely new. It returns the object as stored.
func (s *KubeStore) putShareObject(name string, labels map[string]string, owner []any, spec map[string]any, fresh bool) (*unstructured.Unstructured, error) {
	c := s.dyn.Resource(ShareResource).Namespace(s.namespace)
	var out *unstructured.Unstructured
	err := write(func(ctx context.Context) error {
		var cur *unstructured.Unstructured
		var err error = apierrors.NewNotFound(ShareResource.GroupResource(), name)
		if !fresh {
			cur, err = c.Get(ctx, name, metav1.GetOptions{})
		}
		switch {
		case apierrors.IsNotFound(err):
			meta := map[string]any{"name": name, "namespace": s.namespace}
			if owner != nil {
				meta["ownerReferences"] = owner
			}
			obj := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "kvrelay.io/v1alpha1", "kind": "KvrelayShare",
				"metadata": meta,
				"spec":     spec,
			}}
			obj.SetLabels(labels)
			out, err = c.Create(ctx, obj, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				fresh = false // written before: replace it (write tries again)
			}
			return err
		case err != nil:
			return err
		}
		cur.Object["spec"] = spec
		l := cur.GetLabels()
		if l == nil {
			l = map[string]string{}
		}
		maps.Copy(l, labels)
		cur.SetLabels(l)
		if owner != nil {
			// A pod of the same name restarted (a StatefulSet's) is another owner.
			_ = unstructured.SetNestedSlice(cur.Object, owner, "metadata", "ownerReferences")
		}
		out, err = c.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
	return out, err
}

// joinShares is the shares of what among items (a List's), by replica, and the replicas
// whose head names parts that are not all among them.
func (s *KubeStore) joinShares(what string, items []unstructured.Unstructured) (map[string][]byte, []string) {
	heads := map[string]*unstructured.Unstructured{}
	parts := map[string]string{} // replica, write and index (shareKey) → data
	for i := range items {
		u := &items[i]
		replica, _, _ := unstructured.NestedString(u.Object, "spec", "replica")
		if replica == "" {
			continue
		}
		if u.GetName() == s.shareName(what, replica) {
			heads[replica] = u
			continue
		}
		write, _, _ := unstructured.NestedString(u.Object, "spec", "write")
		data, _, _ := unstructured.NestedString(u.Object, "spec", "data")
		if part, ok, _ := unstructured.NestedInt64(u.Object, "spec", "part"); ok && write != "" {
			parts[shareKey(replica, write, part)] = data
		}
	}
	out := map[string][]byte{}
	var torn []string
	for replica, u := range heads {
		write, _, _ := unstructured.NestedString(u.Object, "spec", "write")
		data, _, _ := unstructured.NestedString(u.Object, "spec", "data")
		encoding, _, _ := unstructured.NestedString(u.Object, "spec", "encoding")
		n, _, _ := unstructured.NestedInt64(u.Object, "spec", "parts")
		var b strings.Builder
		b.WriteString(data)
		whole := true
		for i := int64(1); i < n && whole; i++ {
			var p string
			p, whole = parts[shareKey(replica, write, i)]
			b.WriteString(p)
		}
		if !whole {
			torn = append(torn, replica)
			continue
		}
		d, err := decodeShare(b.String(), encoding)
		if err != nil {
			s.log.Warn("a replica's share not decoded", "share", what, "replica", replica, "err", err)
			continue
		}
		out[replica] = d
	}
	return out, torn
}

// shareKey names part i of replica's write in joinShares.
func shareKey(replica, write string, i int64) string {
	return replica + "\x00" + write + "\x00" + strconv.FormatInt(i, 10)
}

// sharesListTries is how many times Shares lists the shares while one's parts are missing.
const sharesListTries = 3

// Shares lists every replica's share of what (PutShare), by replica. A share whose parts
// are not all there (its replica's objects being deleted, or two writers of one name) after
// sharesListTries lists, or that cannot be decoded, is left out, with a warning.
func (s *KubeStore) Shares(ctx context.Context, what string) (map[string][]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var out map[string][]byte
	for try := 1; ; try++ {
		l, err := s.dyn.Resource(ShareResource).Namespace(s.namespace).List(ctx, metav1.ListOptions{
			LabelSelector: StoreLabel + "=" + s.name + "," + ShareLabel + "=" + what})
		if err != nil {
			return nil, fmt.Errorf("listing the replicas' %s shares in %s: %w", what, s.namespace, err)
		}
		var torn []string
		out, torn = s.joinShares(what, l.Items)
		if len(torn) == 0 {
			break
		}
		if try == sharesListTries || ctx.Err() != nil {
			s.log.Warn("replicas' shares left out: parts missing", "share", what, "replicas", torn)
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	return out, nil
}
