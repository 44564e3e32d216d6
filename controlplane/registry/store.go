package registry

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"go.etcd.io/bbolt"
)

// FileName is the name of the database file a Store keeps in its data directory.
const FileName = "kvrelay.db"

// Bucket names and keys in the database.
var (
	bucketWorkers = []byte("workers") // id → JSON Worker (API workers only)
	bucketDrains  = []byte("drains")  // id → 1 (drained) or 0 (undrained)
	bucketPolicy  = []byte("policy")  // keyCurrent → JSON Policy
	keyCurrent    = []byte("current")
)

// Store persists what the control plane must keep across restarts: the workers added through
// the operator API, explicit drain settings and the routing policy. It is a bbolt database
// (FileName) in a data directory; one process at a time may hold it open. A Store is safe
// for concurrent use. A Registry is its usual user; the caller that opens a Store closes it.
type Store struct {
	db *bbolt.DB
}

// Open opens (creating if need be) the store in dir, creating dir too. It waits at most a
// second for another process that holds the database open.
func Open(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating data dir: %w", err)
	}
	path := filepath.Join(dir, FileName)
	db, err := bbolt.Open(path, 0o600, &bbolt.Options{Timeout: time.Second})
	if err != nil {
		return nil, fmt.Errorf("opening store %s (is another kvrelay using it?): %w", path, err)
	}
	err = db.Update(func(tx *bbolt.Tx) error {
		for _, b := range [][]byte{bucketWorkers, bucketDrains, bucketPolicy} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return fmt.Errorf("creating bucket %s: %w", b, err)
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("opening store %s: %w", path, err)
	}
	return &Store{db: db}, nil
}

// Close closes the database.
func (s *Store) Close() error {
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("closing store: %w", err)
	}
	return nil
}

// Path is the database file's path.
func (s *Store) Path() string { return s.db.Path() }

// Workers returns the stored API workers, sorted by id, with Source SourceAPI. They are not
// validated: rules may have changed since they were stored.
func (s *Store) Workers() ([]Worker, error) {
	var ws []Worker
	err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketWorkers).ForEach(func(k, v []byte) error {
			var w Worker
			if err := json.Unmarshal(v, &w); err != nil {
				return fmt.Errorf("decoding stored worker %q: %w", k, err)
			}
			w.ID = string(k)
			w.Source = SourceAPI
			ws = append(ws, w)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("reading workers from store: %w", err)
	}
	return ws, nil
}

// PutWorker stores w (by its id), replacing any worker stored with that id.
func (s *Store) PutWorker(w Worker) error {
	v, err := json.Marshal(w)
	if err != nil {
		return fmt.Errorf("encoding worker %q: %w", w.ID, err)
	}
	err = s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketWorkers).Put([]byte(w.ID), v)
	})
	if err != nil {
		return fmt.Errorf("storing worker %q: %w", w.ID, err)
	}
	return nil
}

// DeleteWorker deletes the worker stored with id, if any.
func (s *Store) DeleteWorker(id string) error {
	err := s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketWorkers).Delete([]byte(id))
	})
	if err != nil {
		return fmt.Errorf("deleting worker %q from store: %w", id, err)
	}
	return nil
}

// Drains returns the explicit drain settings by worker id.
func (s *Store) Drains() (map[string]bool, error) {
	drains := map[string]bool{}
	err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketDrains).ForEach(func(k, v []byte) error {
			drains[string(k)] = len(v) == 1 && v[0] == 1
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("reading drains from store: %w", err)
	}
	return drains, nil
}

// SetDrain records that worker id is drained (or explicitly not).
func (s *Store) SetDrain(id string, draining bool) error {
	v := []byte{0}
	if draining {
		v[0] = 1
	}
	err := s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketDrains).Put([]byte(id), v)
	})
	if err != nil {
		return fmt.Errorf("storing drain of worker %q: %w", id, err)
	}
	return nil
}

// ClearDrain forgets worker id's drain setting.
func (s *Store) ClearDrain(id string) error {
	err := s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketDrains).Delete([]byte(id))
	})
	if err != nil {
		return fmt.Errorf("clearing drain of worker %q: %w", id, err)
	}
	return nil
}

// Policy returns the stored routing policy, or DefaultPolicy if none was ever set.
func (s *Store) Policy() (Policy, error) {
	var p Policy
	err := s.db.View(func(tx *bbolt.Tx) error {
		var err error
		p, err = currentPolicy(tx)
		return err
	})
	if err != nil {
		return Policy{}, fmt.Errorf("reading policy from store: %w", err)
	}
	return p, nil
}

// SetPolicy validates p, gives it the next version (the stored one plus one) and stores it,
// in one transaction. A non-zero p.Version must be the stored version (ErrVersionConflict
// otherwise). It returns the policy as stored.
func (s *Store) SetPolicy(p Policy) (Policy, error) {
	var next Policy
	err := s.db.Update(func(tx *bbolt.Tx) error {
		cur, err := currentPolicy(tx)
		if err != nil {
			return err
		}
		if next, err = nextPolicy(cur, p); err != nil {
			return err
		}
		v, err := json.Marshal(next)
		if err != nil {
			return fmt.Errorf("encoding policy: %w", err)
		}
		return tx.Bucket(bucketPolicy).Put(keyCurrent, v)
	})
	if err != nil {
		return Policy{}, fmt.Errorf("setting policy: %w", err)
	}
	return next, nil
}

func currentPolicy(tx *bbolt.Tx) (Policy, error) {
	v := tx.Bucket(bucketPolicy).Get(keyCurrent)
	if v == nil {
		return DefaultPolicy(), nil
	}
	var p Policy
	if err := json.Unmarshal(v, &p); err != nil {
		return Policy{}, fmt.Errorf("decoding stored policy: %w", err)
	}
	return p, nil
}
