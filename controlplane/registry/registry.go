package registry

import (
	"cmp"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"
)

// precedence lists the sources from the one that wins a shared id to the one that loses.
var precedence = [...]string{SourceAPI, SourceFile, SourceFlag, SourceK8s}

// sourceIndex returns src's place in precedence.
func sourceIndex(src string) int {
	for i, s := range precedence {
		if s == src {
			return i
		}
	}
	panic("registry: unknown source " + src)
}

// where says where an operator removes a worker of src.
func where(src string) string {
	switch src {
	case SourceFile:
		return "the workers file"
	case SourceFlag:
		return "the --worker flags (restart without it)"
	case SourceK8s:
		return "Kubernetes (it follows the EndpointSlices)"
	}
	return src
}

// Registry merges the workers of every source (see the package documentation for the
// precedence), applies drain settings, and holds the routing policy. Its methods are safe
// for concurrent use.
type Registry struct {
	store   Backend // nil: memory only
	log     *slog.Logger
	changes chan struct{}

	mu        sync.Mutex
	sources   [len(precedence)]map[string]Worker // by precedence index, then id
	drains    map[string]bool                    // explicit settings by id
	policy    Policy
	history   []PolicyChange      // without a store
	effective []Worker            // resolved, drains applied, sorted by id
	shadowed  map[string][]string // id → sources hidden by the winner, for logging news only
	stats     Stats

	// fileMu serialises file loads; fileSum is the content last parsed (or refused).
	fileMu   sync.Mutex
	fileSeen bool
	fileSum  [sha256.Size]byte
	fileErr  error
}

// Stats count the workers file's reloads.
type Stats struct {
	// FileReloads counts workers files parsed and applied; FileErrors those refused (a
	// parse error, or a file that could not be read) while the previous workers stayed.
	FileReloads, FileErrors uint64
}

// New returns a registry holding the flag workers (from ParseWorker; their Source becomes
// SourceFlag) and what store keeps: API workers, drains and the policy. A nil store keeps
// all of it in memory only. Invalid or duplicate flag workers are errors; stored workers
// that no longer validate are logged and skipped (they stay in the store). A nil log
// means slog.Default(). New starts no goroutine.
func New(store Backend, flags []Worker, log *slog.Logger) (*Registry, error) {
	if log == nil {
		log = slog.Default()
	}
	r := &Registry{
		store:    store,
		log:      log,
		changes:  make(chan struct{}, 1),
		drains:   map[string]bool{},
		policy:   DefaultPolicy(),
		shadowed: map[string][]string{},
	}
	for i := range r.sources {
		r.sources[i] = map[string]Worker{}
	}
	fl := r.sources[sourceIndex(SourceFlag)]
	for _, w := range flags {
		w = w.WithDefaults()
		w.Source = SourceFlag
		if err := w.Validate(); err != nil {
			return nil, fmt.Errorf("new registry: --worker %s: %w", w, err)
		}
		if _, dup := fl[w.ID]; dup {
			return nil, fmt.Errorf("new registry: %w: --worker id %q given twice", ErrInvalid, w.ID)
		}
		fl[w.ID] = w
	}
	if store != nil {
		if err := r.loadLocked(); err != nil {
			return nil, fmt.Errorf("new registry: %w", err)
		}
	}
	r.rebuildLocked()
	return r, nil
}

// loadLocked reads the API workers, the drains and the policy from the store. Stored workers
// that no longer validate are logged and skipped.
func (r *Registry) loadLocked() error {
	api, err := r.store.Workers()
	if err != nil {
		return err
	}
	m := map[string]Worker{}
	for _, w := range api {
		w = w.WithDefaults()
		if err := w.Validate(); err != nil {
			r.log.Warn("skipping a stored worker that is no longer valid", "id", w.ID, "err", err)
			continue
		}
		m[w.ID] = w
	}
	drains, err := r.store.Drains()
	if err != nil {
		return err
	}
	pol, err := r.store.Policy()
	if err != nil {
		return err
	}
	r.sources[sourceIndex(SourceAPI)], r.drains, r.policy = m, drains, pol
	return nil
}

// Reload reads what the store keeps (API workers, drains, the policy) again, for a store
// that other replicas write (KubeStore), and notifies Changes when any of it changed. On
// an error the registry stays as it was.
func (r *Registry) Reload() error {
	if r.store == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	oldAPI, oldDrains, oldPolicy := r.sources[sourceIndex(SourceAPI)], r.drains, r.policy
	if err := r.loadLocked(); err != nil {
		r.sources[sourceIndex(SourceAPI)], r.drains, r.policy = oldAPI, oldDrains, oldPolicy
		return fmt.Errorf("reloading the registry: %w", err)
	}
	rebuilt := r.rebuildLocked()
	if rebuilt || !samePolicy(oldPolicy, r.policy) {
		r.notify()
	}
	return nil
}

// Workers returns every worker, one per id, sorted by id, with explicit drain settings
// applied. The slice is the caller's.
func (r *Registry) Workers() []Worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.effective)
}

// Get returns the worker with id, as Workers would.
func (r *Registry) Get(id string) (Worker, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	i, ok := slices.BinarySearchFunc(r.effective, id, func(w Worker, id string) int { return cmp.Compare(w.ID, id) })
	if !ok {
		return Worker{}, false
	}
	return r.effective[i], true
}

// Upsert adds or replaces the API worker w.ID (its defaults filled in, Source SourceAPI) and
// persists it. It wins over a worker of another source with the same id. Invalid workers
// are errors wrapping ErrInvalid.
func (r *Registry) Upsert(w Worker) error {
	w = w.WithDefaults()
	w.Source = SourceAPI
	if err := w.Validate(); err != nil {
		return fmt.Errorf("upserting worker: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	api := r.sources[sourceIndex(SourceAPI)]
	if old, ok := api[w.ID]; ok && old.Equal(w) {
		return nil
	}
	if r.store != nil {
		if err := r.store.PutWorker(w); err != nil {
			return fmt.Errorf("upserting worker: %w", err)
		}
	}
	api[w.ID] = w
	r.changedLocked()
	return nil
}

// Remove deletes the API worker id from the registry and the store. A worker with that id
// from another source then shows again. Workers of other sources cannot be removed here
// (ErrNotRemovable); an unknown id is ErrNotFound.
func (r *Registry) Remove(id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	api := r.sources[sourceIndex(SourceAPI)]
	if _, ok := api[id]; !ok {
		for _, src := range precedence[1:] {
			if _, ok := r.sources[sourceIndex(src)][id]; ok {
				return fmt.Errorf("removing worker %q: %w: it comes from %s; remove it there", id, ErrNotRemovable, where(src))
			}
		}
		return fmt.Errorf("removing worker %q: %w", id, ErrNotFound)
	}
	if r.store != nil {
		if err := r.store.DeleteWorker(id); err != nil {
			return fmt.Errorf("removing worker %q: %w", id, err)
		}
	}
	delete(api, id)
	if _, set := r.drains[id]; set && !r.existsLocked(id) {
		if r.store != nil {
			if err := r.store.ClearDrain(id); err != nil {
				r.log.Warn("worker removed but its drain setting stays", "id", id, "err", err)
			}
		}
		delete(r.drains, id)
	}
	r.changedLocked()
	return nil
}

// SetDraining drains (no new requests) or undrains worker id, whatever its source, and
// persists the setting; it overrides the worker's own Draining field. An unknown id is
// ErrNotFound.
func (r *Registry) SetDraining(id string, draining bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.existsLocked(id) {
		return fmt.Errorf("draining worker %q: %w", id, ErrNotFound)
	}
	if d, set := r.drains[id]; set && d == draining {
		return nil
	}
	if r.store != nil {
		if err := r.store.SetDrain(id, draining); err != nil {
			return fmt.Errorf("draining worker %q: %w", id, err)
		}
	}
	r.drains[id] = draining
	r.changedLocked()
	return nil
}

// Policy returns the current routing policy (DefaultPolicy until one is set). The result is
// the caller's.
func (r *Registry) Policy() Policy {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.policy.clone()
}

// SetPolicy validates p and makes it the current policy with the next version, persisted
// before it is applied. A non-zero p.Version must be the current version (the one the
// caller read and edited), else ErrVersionConflict; zero skips the check. It returns the
// policy as set.
func (r *Registry) SetPolicy(p Policy) (Policy, error) { return r.ChangePolicy(p, "api") }

// ChangePolicy is SetPolicy with the cause its history entry records ("api", "rollout 3
// promoted", ...).
func (r *Registry) ChangePolicy(p Policy, cause string) (Policy, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var (
		next Policy
		err  error
	)
	now := time.Now()
	if r.store != nil {
		next, err = r.store.SetPolicy(p, cause, now)
	} else {
		next, err = nextPolicy(r.policy, p)
		if err == nil {
			r.history = append(r.history, PolicyChange{Policy: next.clone(), At: now, Cause: cause})
			if len(r.history) > MaxHistory {
				r.history = slices.Delete(r.history, 0, len(r.history)-MaxHistory)
			}
		}
	}
	if err != nil {
		return Policy{}, err
	}
	r.policy = next
	r.notify()
	return next.clone(), nil
}

// PolicyHistory returns at most limit changes of the policy, the latest first.
func (r *Registry) PolicyHistory(limit int) ([]PolicyChange, error) {
	if r.store != nil {
		return r.store.PolicyHistory(limit)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []PolicyChange
	for i := len(r.history) - 1; i >= 0 && len(out) < limit; i-- {
		out = append(out, r.history[i])
	}
	return out, nil
}

// Changes returns a channel that receives after every change to the workers, the drains or
// the policy. Notifications coalesce (capacity 1): a receiver reads the current state after
// each and misses nothing. The registry has one such channel; give it one consumer.
func (r *Registry) Changes() <-chan struct{} { return r.changes }

// Stats returns the registry's counters.
func (r *Registry) Stats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stats
}

// replace makes ws the workers of src, reporting whether anything changed.
func (r *Registry) replace(src string, ws map[string]Worker) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	i := sourceIndex(src)
	if maps.EqualFunc(r.sources[i], ws, Worker.Equal) {
		return false
	}
	r.sources[i] = ws
	r.changedLocked()
	return true
}

func (r *Registry) existsLocked(id string) bool {
	for _, m := range r.sources {
		if _, ok := m[id]; ok {
			return true
		}
	}
	return false
}

// changedLocked rebuilds the resolved view and notifies if it changed.
func (r *Registry) changedLocked() {
	if r.rebuildLocked() {
		r.notify()
	}
}

// rebuildLocked resolves the sources into r.effective, logs newly shadowed workers and
// reports whether r.effective changed.
func (r *Registry) rebuildLocked() bool {
	n := 0
	for _, m := range r.sources {
		n += len(m)
	}
	eff := make([]Worker, 0, n)
	shadowed := map[string][]string{}
	for i, m := range r.sources {
	next:
		for id, w := range m {
			for j := range i {
				if winner, ok := r.sources[j][id]; ok {
					shadowed[id] = append(shadowed[id], w.Source)
					if !slices.Contains(r.shadowed[id], w.Source) {
						r.log.Warn("worker id in two sources: the first wins", "id", id,
							"wins", winner.Source, "hidden", w.Source, "precedence", "api > file > flag > k8s")
					}
					continue next
				}
			}
			if d, set := r.drains[id]; set {
				w.Draining = d
			}
			eff = append(eff, w)
		}
	}
	slices.SortFunc(eff, func(a, b Worker) int { return cmp.Compare(a.ID, b.ID) })
	r.shadowed = shadowed
	if slices.EqualFunc(eff, r.effective, Worker.Equal) {
		return false
	}
	r.effective = eff
	return true
}

// notify sends on changes without blocking: a pending notification already covers this one.
func (r *Registry) notify() {
	select {
	case r.changes <- struct{}{}:
	default:
	}
}
