package registry

import (
	"encoding/binary"
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
	bucketWorkers = []byte("workers")        // id → JSON Worker (API workers only)
	bucketDrains  = []byte("drains")         // id → 1 (drained) or 0 (undrained)
	bucketPolicy  = []byte("policy")         // keyCurrent → JSON Policy
	bucketHistory = []byte("policy_history") // big-endian sequence → JSON PolicyChange
	bucketRollout = []byte("rollouts")       // big-endian rollout id → the rollout's JSON
	bucketKeys    = []byte("api_keys")       // id → JSON APIKey
	keyCurrent    = []byte("current")
)

// MaxHistory is the number of policy changes a store keeps; older ones are dropped.
const MaxHistory = 1000

// PolicyChange is one change of the routing policy: the policy as it became, when, and by
// what ("api", "rollout 3 rolled_back", ...).
type PolicyChange struct {
	Policy Policy    `json:"policy"`
	At     time.Time `json:"at"`
	Cause  string    `json:"cause"`
}

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
		for _, b := range [][]byte{bucketWorkers, bucketDrains, bucketPolicy, bucketHistory, bucketRollout, bucketKeys} {
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

// SetPolicy validates p, gives it its version (see Registry.SetPolicy) and stores it with
// its history entry (cause, at), in one transaction. A non-zero p.Version must be the
// stored version (ErrVersionConflict otherwise). It returns the policy as stored.
func (s *Store) SetPolicy(p Policy, cause string, at time.Time) (Policy, error) {
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
		if err := tx.Bucket(bucketPolicy).Put(keyCurrent, v); err != nil {
			return err
		}
		return appendHistory(tx.Bucket(bucketHistory), PolicyChange{Policy: next, At: at, Cause: cause})
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

// appendHistory adds c under the next sequence number and drops the entries past MaxHistory.
func appendHistory(b *bbolt.Bucket, c PolicyChange) error {
	seq, err := b.NextSequence()
	if err != nil {
		return err
	}
	v, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("encoding policy change: %w", err)
	}
	if err := b.Put(binary.BigEndian.AppendUint64(nil, seq), v); err != nil {
		return err
	}
	if seq > MaxHistory {
		return b.Delete(binary.BigEndian.AppendUint64(nil, seq-MaxHistory))
	}
	return nil
}

// PolicyHistory returns at most limit policy changes, the latest first.
func (s *Store) PolicyHistory(limit int) ([]PolicyChange, error) {
	var out []PolicyChange
	err := s.db.View(func(tx *bbolt.Tx) error {
		c := tx.Bucket(bucketHistory).Cursor()
		for k, v := c.Last(); k != nil && len(out) < limit; k, v = c.Prev() {
			var pc PolicyChange
			if err := json.Unmarshal(v, &pc); err != nil {
				return fmt.Errorf("decoding policy change %x: %w", k, err)
			}
			out = append(out, pc)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("reading policy history: %w", err)
	}
	return out, nil
}

// PutRollout stores a rollout's record (the control plane's JSON) under its id.
func (s *Store) PutRollout(id uint64, record []byte) error {
	err := s.db.Update(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketRollout).Put(binary.BigEndian.AppendUint64(nil, id), record)
	})
	if err != nil {
		return fmt.Errorf("storing rollout %d: %w", id, err)
	}
	return nil
}

// LastRollout returns the record of the rollout with the highest id, nil if none was
// stored.
func (s *Store) LastRollout() ([]byte, error) {
	var out []byte
	err := s.db.View(func(tx *bbolt.Tx) error {
		if _, v := tx.Bucket(bucketRollout).Cursor().Last(); v != nil {
			out = append([]byte(nil), v...)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("reading rollouts: %w", err)
	}
	return out, nil
}
