package registry

import (
	"errors"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

func openStore(t *testing.T, dir string) *Store {
	t.Helper()
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestStoreReopen(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data") // Open creates it
	s := openStore(t, dir)
	if got, want := s.Path(), filepath.Join(dir, FileName); got != want {
		t.Errorf("Path() = %q, want %q", got, want)
	}
	s.Close()
	testBackendReopen(t, func() Backend { return openStore(t, dir) })
}

// testBackendReopen: what a Backend stores is there when it is opened again, and its
// policy versions and history go on from where they were.
func testBackendReopen(t *testing.T, open func() Backend) {
	s := open()
	a := Worker{ID: "a", URL: "http://h:1", Role: RoleDecode, Engine: "sim", Metrics: "http://h:1/metrics", Source: SourceAPI}
	b := Worker{ID: "b", URL: "http://h:2", KVEvents: "tcp://h:5557", Role: RoleBoth, Engine: "vllm", Metrics: "http://h:2/metrics", Source: SourceAPI}
	for _, w := range []Worker{b, a, {ID: "gone", URL: "http://h:3"}} {
		if err := s.PutWorker(w); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.DeleteWorker("gone"); err != nil {
		t.Fatal(err)
	}
	for id, d := range map[string]bool{"a": true, "flag-worker": true, "undrained": false, "cleared": true} {
		if err := s.SetDrain(id, d); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.ClearDrain("cleared"); err != nil {
		t.Fatal(err)
	}
	p := DefaultPolicy()
	p.Name = PolicySession
	p.Version = 0 // no compare-and-set
	var last Policy
	for range 3 {
		var err error
		if last, err = s.SetPolicy(p, "api", time.Unix(1, 0)); err != nil {
			t.Fatal(err)
		}
	}
	// The first set changed the policy (version 2); setting it again as it is keeps that.
	if last.Version != 2 {
		t.Fatalf("third SetPolicy of one policy gave version %d, want 2 (default is 1)", last.Version)
	}
	if err := s.PutRollout(1, []byte(`{"r":1}`)); err != nil {
		t.Fatal(err)
	}
	if err := s.PutRollout(2, []byte(`{"r":2}`)); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s = open()
	defer s.Close()
	ws, err := s.Workers()
	if err != nil {
		t.Fatal(err)
	}
	if want := []Worker{a, b}; !slices.EqualFunc(ws, want, Worker.Equal) {
		t.Fatalf("Workers() after reopen:\n got %+v\nwant %+v", ws, want)
	}
	drains, err := s.Drains()
	if err != nil {
		t.Fatal(err)
	}
	if len(drains) != 3 || !drains["a"] || !drains["flag-worker"] || drains["undrained"] {
		t.Fatalf("Drains() after reopen = %v", drains)
	}
	if d, set := drains["undrained"]; !set || d {
		t.Fatalf("an explicit undrain was lost: %v", drains)
	}
	got, err := s.Policy()
	if err != nil {
		t.Fatal(err)
	}
	if got.Version != 2 || got.Name != PolicySession {
		t.Fatalf("Policy() after reopen = %+v, want session at version 2", got)
	}
	p.Temperature = 0.5 // a change: the version after the stored one
	next, err := s.SetPolicy(p, "rollout 2 promoted", time.Unix(2, 0))
	if err != nil || next.Version != 3 {
		t.Fatalf("SetPolicy after reopen = %+v, %v; want version 3", next, err)
	}
	// Every set is in the history, the latest first, across the reopen.
	h, err := s.PolicyHistory(10)
	if err != nil || len(h) != 4 || h[0].Policy.Version != 3 || h[0].Cause != "rollout 2 promoted" || h[3].Policy.Version != 2 || !h[3].At.Equal(time.Unix(1, 0)) {
		t.Fatalf("PolicyHistory = %+v, %v", h, err)
	}
	if rec, err := s.LastRollout(); err != nil || string(rec) != `{"r":2}` {
		t.Fatalf("LastRollout = %s, %v", rec, err)
	}
}

// TestStoreHistoryIsBounded: the history keeps the last MaxHistory changes.
func TestStoreHistoryIsBounded(t *testing.T) {
	s := openStore(t, t.TempDir())
	defer s.Close()
	testBackendHistory(t, s, MaxHistory)
}

func testBackendHistory(t *testing.T, s Backend, MaxHistory int) {
	p := DefaultPolicy()
	p.Version = 0
	for i := range MaxHistory + 5 {
		p.Temperature = float64(i%2) / 2
		if _, err := s.SetPolicy(p, "api", time.Unix(int64(i), 0)); err != nil {
			t.Fatal(err)
		}
	}
	h, err := s.PolicyHistory(2 * MaxHistory)
	if err != nil || len(h) != MaxHistory || !h[0].At.Equal(time.Unix(int64(MaxHistory+4), 0)) || !h[MaxHistory-1].At.Equal(time.Unix(5, 0)) {
		t.Fatalf("history of %d entries from %v to %v, %v", len(h), h[0].At, h[len(h)-1].At, err)
	}
}

func TestStoreDefaultPolicy(t *testing.T) {
	s := openStore(t, t.TempDir())
	defer s.Close()
	testBackendDefaultPolicy(t, s)
}

func testBackendDefaultPolicy(t *testing.T, s Backend) {
	p, err := s.Policy()
	if err != nil {
		t.Fatal(err)
	}
	if p.Version != 1 || p.Name != DefaultPolicy().Name {
		t.Fatalf("Policy() of a new store = %+v, want DefaultPolicy", p)
	}
}

func TestStoreSetPolicyRefuses(t *testing.T) {
	s := openStore(t, t.TempDir())
	defer s.Close()
	testBackendRefuses(t, s)
}

func testBackendRefuses(t *testing.T, s Backend) {
	bad := DefaultPolicy()
	bad.CacheThreshold = 2
	if _, err := s.SetPolicy(bad, "api", time.Now()); !errors.Is(err, ErrInvalid) {
		t.Fatalf("SetPolicy(invalid) = %v, want ErrInvalid", err)
	}
	stale := DefaultPolicy()
	stale.Version = 9
	if _, err := s.SetPolicy(stale, "api", time.Now()); !errors.Is(err, ErrVersionConflict) {
		t.Fatalf("SetPolicy(stale) = %v, want ErrVersionConflict", err)
	}
	if p, _ := s.Policy(); p.Version != 1 {
		t.Fatalf("a refused policy changed the version to %d", p.Version)
	}
}

func TestStoreLocked(t *testing.T) {
	dir := t.TempDir()
	s := openStore(t, dir)
	defer s.Close()
	if s2, err := Open(dir); err == nil {
		s2.Close()
		t.Fatal("a second Open of a store in use succeeded")
	}
}
