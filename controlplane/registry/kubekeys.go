package registry

import (
	"fmt"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// keyName is the KvrelayAPIKey resource for key id, <name>-key-<id> (made safe as a
// worker's is).
func (s *KubeStore) keyName(id string) string { return s.workerName("key-" + id) }

// APIKeys returns the API keys, sorted by id: the KvrelayAPIKeys this replica knows of,
// those written with kubectl included. A resource whose spec does not validate is skipped
// with a warning. Of resources giving one id, the one named for it (<name>-key-<id>, which
// PutAPIKey writes) is taken, else the first by name, and the others are skipped with a
// warning.
func (s *KubeStore) APIKeys() ([]APIKey, error) {
	objs := s.list(APIKeyResource)
	slices.SortFunc(objs, func(a, b *unstructured.Unstructured) int { return strings.Compare(a.GetName(), b.GetName()) })
	byID := map[string]APIKey{}
	from := map[string]string{} // id → the name of the resource its key comes from
	for _, u := range objs {
		var k APIKey
		if _, err := field(u.Object, &k, "spec"); err != nil {
			return nil, fmt.Errorf("reading API keys: decoding KvrelayAPIKey %s: %w", u.GetName(), err)
		}
		if err := k.Validate(); err != nil {
			s.log.Warn("skipping a KvrelayAPIKey", "name", u.GetName(), "err", err)
			continue
		}
		if other, ok := from[k.ID]; ok {
			skip := u.GetName()
			if skip == s.keyName(k.ID) {
				skip = other
			}
			s.log.Warn("skipping a KvrelayAPIKey that gives the id of another", "name", skip, "id", k.ID)
			if skip == u.GetName() {
				continue
			}
		}
		byID[k.ID], from[k.ID] = k, u.GetName()
	}
	var out []APIKey
	for _, k := range byID {
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b APIKey) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// PutAPIKey validates k and stores it in its KvrelayAPIKey, replacing any key stored with
// its id.
func (s *KubeStore) PutAPIKey(k APIKey) error {
	if err := k.Validate(); err != nil {
		return fmt.Errorf("storing API key %q: %w", k.ID, err)
	}
	spec, err := asMap(k)
	if err != nil {
		return fmt.Errorf("storing API key %q: %w", k.ID, err)
	}
	name := s.keyName(k.ID)
	if err := s.putSpec(APIKeyResource, "KvrelayAPIKey", name, spec.(map[string]any)); err != nil {
		return fmt.Errorf("storing API key %q in KvrelayAPIKey %s/%s: %w", k.ID, s.namespace, name, err)
	}
	return nil
}

// DeleteAPIKey deletes the KvrelayAPIKey of key id, if there is one, and any other resource
// giving that id (one written with kubectl under another name), so that no other key takes
// its place.
func (s *KubeStore) DeleteAPIKey(id string) error {
	names := []string{s.keyName(id)}
	for _, u := range s.list(APIKeyResource) {
		if other, _, _ := unstructured.NestedString(u.Object, "spec", "id"); other == id && !slices.Contains(names, u.GetName()) {
			names = append(names, u.GetName())
		}
	}
	for _, name := range names {
		if err := s.deleteObject(APIKeyResource, name); err != nil {
			return fmt.Errorf("deleting API key %q (KvrelayAPIKey %s/%s): %w", id, s.namespace, name, err)
		}
	}
	return nil
}
