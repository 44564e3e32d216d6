package registry

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"unicode"

	"go.etcd.io/bbolt"
)

// APIKey is an API key given through the operator API: the operator's name for it (id),
// the key's SHA-256 (the key itself is never stored), and the tenant it maps to with the
// tenant's weight, budgets and cache region, as a line of a proxy's keys file gives them.
// Proxies take the control plane's keys beside their own file's.
//
// The field comments' first sentences describe the fields of a KvrelayAPIKey's spec too
// (hack/gencrd).
type APIKey struct {
	// ID is the operator's name for the key, unique among the control plane's keys: at most
	// 128 characters, no spaces, quotes, commas, equals signs or #.
	ID string `json:"id"`
	// SHA256 is the SHA-256 of the key as 64 hex digits (the key itself is never stored).
	SHA256 string `json:"sha256"`
	// Tenant is the tenant the key's requests are counted to, named like an id.
	Tenant string `json:"tenant"`
	// Weight is the tenant's share when tenants contend (0: 1).
	Weight float64 `json:"weight,omitempty"`
	// RPS is the tenant's budget of requests per second (0: none).
	RPS float64 `json:"rps,omitempty"`
	// PromptTPS is the tenant's budget of prompt tokens per second (0: none).
	PromptTPS float64 `json:"prompt_tps,omitempty"`
	// OutputTPM is the tenant's budget of generated tokens per minute (0: none).
	OutputTPM float64 `json:"output_tpm,omitempty"`
	// Cache is the tenant's cache region, whose salt its requests share with the region's
	// other tenants ("": the tenant's own salt).
	Cache string `json:"cache,omitempty"`
}

// ErrInvalidKey is wrapped by every error APIKey.Validate and CheckAPIKeys return.
var ErrInvalidKey = errors.New("invalid API key")

// maxKeyName bounds ids, tenant and region names; names hold no spaces, quotes, commas,
// equals signs or control characters (a keys file line's syntax).
const maxKeyName = 128

func keyName(what, v string, empty bool) error {
	switch {
	case v == "" && !empty:
		return fmt.Errorf("%w: no %s", ErrInvalidKey, what)
	case len(v) > maxKeyName || strings.ContainsAny(v, " \t\"',=#") || strings.ContainsFunc(v, unicode.IsControl):
		return fmt.Errorf("%w: %s %q: at most %d characters, no spaces, quotes, commas, equals signs, # or control characters", ErrInvalidKey, what, v, maxKeyName)
	}
	return nil
}

// Validate checks k's fields: an id, a SHA-256 of 64 hex digits, a tenant, names a keys
// file can hold, weight and budgets finite and not negative.
func (k APIKey) Validate() error {
	if err := keyName("id", k.ID, false); err != nil {
		return err
	}
	if err := keyName("tenant", k.Tenant, false); err != nil {
		return err
	}
	if err := keyName("cache region", k.Cache, true); err != nil {
		return err
	}
	if b, err := hex.DecodeString(k.SHA256); err != nil || len(b) != 32 {
		return fmt.Errorf("%w: sha256 %q: want 64 hex digits", ErrInvalidKey, k.SHA256)
	}
	for _, f := range []struct {
		name string
		v    float64
	}{{"weight", k.Weight}, {"rps", k.RPS}, {"prompt_tps", k.PromptTPS}, {"output_tpm", k.OutputTPM}} {
		if !(f.v >= 0) || math.IsInf(f.v, 0) {
			return fmt.Errorf("%w: %s %v: want a finite number, not negative", ErrInvalidKey, f.name, f.v)
		}
	}
	return nil
}

// CheckAPIKeys checks that keys can stand together: ids and SHA-256s each once, and the
// keys of one tenant agreeing on its weight, budgets and cache region (a tenant's keys share
// them).
func CheckAPIKeys(keys []APIKey) error {
	ids, sums := map[string]bool{}, map[string]string{}
	tenants := map[string]APIKey{}
	for _, k := range keys {
		if ids[k.ID] {
			return fmt.Errorf("%w: id %q twice", ErrInvalidKey, k.ID)
		}
		ids[k.ID] = true
		sum := strings.ToLower(k.SHA256)
		if other, ok := sums[sum]; ok {
			return fmt.Errorf("%w: key %q is key %q again", ErrInvalidKey, k.ID, other)
		}
		sums[sum] = k.ID
		if t, ok := tenants[k.Tenant]; ok && (t.Weight != k.Weight || t.RPS != k.RPS || t.PromptTPS != k.PromptTPS || t.OutputTPM != k.OutputTPM || t.Cache != k.Cache) {
			return fmt.Errorf("%w: key %q gives tenant %s other limits or another cache region than key %q", ErrInvalidKey, k.ID, k.Tenant, t.ID)
		}
		tenants[k.Tenant] = k
	}
	return nil
}

// KeysFile writes keys as a proxy's keys file (sorted by id): one `sha256:<hex> tenant=…`
// line a key, the weight, budgets and region the key gives.
func KeysFile(keys []APIKey) string {
	keys = append([]APIKey(nil), keys...)
	sort.Slice(keys, func(i, j int) bool { return keys[i].ID < keys[j].ID })
	var b strings.Builder
	num := func(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) }
	for _, k := range keys {
		fmt.Fprintf(&b, "sha256:%s tenant=%s", strings.ToLower(k.SHA256), k.Tenant)
		for _, f := range []struct {
			name string
			v    float64
		}{{"weight", k.Weight}, {"rps", k.RPS}, {"prompt_tps", k.PromptTPS}, {"output_tpm", k.OutputTPM}} {
			if f.v > 0 {
				b.WriteString("," + f.name + "=" + num(f.v))
			}
		}
		if k.Cache != "" {
			b.WriteString(",cache=" + k.Cache)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// APIKeys returns the stored API keys, sorted by id.
func (s *Store) APIKeys() ([]APIKey, error) {
	var out []APIKey
	err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketKeys).ForEach(func(_, v []byte) error {
			var k APIKey
			if err := json.Unmarshal(v, &k); err != nil {
				return err
			}
			out = append(out, k)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("reading API keys from store: %w", err)
	}
	return out, nil
}

// PutAPIKey stores k by its id, replacing any key stored with that id.
func (s *Store) PutAPIKey(k APIKey) error {
	v, err := json.Marshal(k)
	if err != nil {
		return fmt.Errorf("encoding API key %q: %w", k.ID, err)
	}
	if err := s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(bucketKeys).Put([]byte(k.ID), v) }); err != nil {
		return fmt.Errorf("storing API key %q: %w", k.ID, err)
	}
	return nil
}

// DeleteAPIKey deletes the API key stored with id, if any.
func (s *Store) DeleteAPIKey(id string) error {
	if err := s.db.Update(func(tx *bbolt.Tx) error { return tx.Bucket(bucketKeys).Delete([]byte(id)) }); err != nil {
		return fmt.Errorf("deleting API key %q from store: %w", id, err)
	}
	return nil
}
