package registry

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }

func mustParse(t *testing.T, s string) Worker {
	t.Helper()
	w, err := ParseWorker(s)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// summary is "id:source[:drained]" per worker, in Workers order.
func summary(ws []Worker) string {
	var parts []string
	for _, w := range ws {
		s := w.ID + ":" + w.Source
		if w.Draining {
			s += ":drained"
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, " ")
}

// writeFile replaces path's content atomically, as a careful operator (or a ConfigMap
// update) does, so that a poller never reads half a file.
func writeFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// eventually fails the test unless cond holds within a few seconds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func drainChanges(r *Registry) bool {
	select {
	case <-r.Changes():
		return true
	default:
		return false
	}
}

func TestRegistryPrecedence(t *testing.T) {
	flags := []Worker{
		mustParse(t, "id=w1,url=http://flag:1"),
		mustParse(t, "id=w2,url=http://flag:2"),
	}
	r, err := New(nil, flags, discard())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "workers.yaml")
	writeFile(t, path, "workers:\n  - {id: w2, url: 'http://file:2'}\n  - {id: w3, url: 'http://file:3'}\n")
	if err := r.ReloadFile(path); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"id=w3,url=http://api:3", "id=w4,url=http://api:4"} {
		if err := r.Upsert(mustParse(t, s)); err != nil {
			t.Fatal(err)
		}
	}
	r.replace(SourceK8s, map[string]Worker{
		"w4": {ID: "w4", URL: "http://k8s:4", Source: SourceK8s},
		"w5": {ID: "w5", URL: "http://k8s:5", Source: SourceK8s},
	})
	if got, want := summary(r.Workers()), "w1:flag w2:file w3:api w4:api w5:k8s"; got != want {
		t.Fatalf("Workers() = %s, want %s", got, want)
	}
	if w, ok := r.Get("w2"); !ok || w.URL != "http://file:2" {
		t.Fatalf("Get(w2) = %+v, %v", w, ok)
	}

	// Removing an API worker shows what it hid.
	if err := r.Remove("w3"); err != nil {
		t.Fatal(err)
	}
	if w, _ := r.Get("w3"); w.Source != SourceFile || w.URL != "http://file:3" {
		t.Fatalf("after removing the API w3, Get(w3) = %+v, want the file's", w)
	}
	for id, src := range map[string]string{"w1": "--worker", "w2": "workers file", "w5": "Kubernetes"} {
		err := r.Remove(id)
		if !errors.Is(err, ErrNotRemovable) || !strings.Contains(err.Error(), src) {
			t.Errorf("Remove(%s) = %v, want ErrNotRemovable naming %q", id, err, src)
		}
	}
	if err := r.Remove("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Remove(nope) = %v, want ErrNotFound", err)
	}
	if _, ok := r.Get("nope"); ok {
		t.Error("Get(nope) found a worker")
	}
}

func TestRegistryWorkersIsACopy(t *testing.T) {
	r, err := New(nil, []Worker{mustParse(t, "id=w1,url=http://h:1")}, discard())
	if err != nil {
		t.Fatal(err)
	}
	ws := r.Workers()
	ws[0].ID = "changed"
	if r.Workers()[0].ID != "w1" {
		t.Fatal("changing Workers()' result changed the registry")
	}
}

func TestNewRefusesBadFlags(t *testing.T) {
	w := mustParse(t, "id=w1,url=http://h:1")
	if _, err := New(nil, []Worker{w, w}, discard()); !errors.Is(err, ErrInvalid) {
		t.Errorf("New with a duplicate flag id: %v, want ErrInvalid", err)
	}
	bad := w
	bad.Role = "leader"
	if _, err := New(nil, []Worker{bad}, discard()); !errors.Is(err, ErrInvalid) {
		t.Errorf("New with an invalid flag worker: %v, want ErrInvalid", err)
	}
	// A worker literal without defaults is fine: New fills them in.
	r, err := New(nil, []Worker{{ID: "w2", URL: "http://h:2"}}, discard())
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Workers()[0]; got.Source != SourceFlag || got.Engine != "vllm" || got.Role != RoleBoth {
		t.Errorf("flag worker = %+v, want defaults and source flag", got)
	}
}

func TestRegistryUpsert(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Upsert(Worker{ID: "a", URL: "ftp://h:1"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Upsert(invalid) = %v, want ErrInvalid", err)
	}
	if drainChanges(r) {
		t.Fatal("a refused Upsert notified")
	}
	w := Worker{ID: "a", URL: "http://h:1", Source: SourceFlag}
	if err := r.Upsert(w); err != nil {
		t.Fatal(err)
	}
	if !drainChanges(r) {
		t.Fatal("Upsert did not notify")
	}
	if got, _ := r.Get("a"); got.Source != SourceAPI || got.Metrics != "http://h:1/metrics" {
		t.Fatalf("upserted worker = %+v, want source api and defaults", got)
	}
	if err := r.Upsert(w); err != nil {
		t.Fatal(err)
	}
	if drainChanges(r) {
		t.Fatal("an Upsert that changed nothing notified")
	}
	w.Model = "m"
	if err := r.Upsert(w); err != nil {
		t.Fatal(err)
	}
	if got, _ := r.Get("a"); got.Model != "m" || !drainChanges(r) {
		t.Fatalf("replacing Upsert: %+v", got)
	}
}

func TestRegistryDraining(t *testing.T) {
	r, err := New(nil, []Worker{mustParse(t, "id=w1,url=http://h:1")}, discard())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "workers.yaml")
	writeFile(t, path, "workers:\n  - {id: f1, url: 'http://h:2', draining: true}\n")
	if err := r.ReloadFile(path); err != nil {
		t.Fatal(err)
	}
	drainChanges(r)
	if got, want := summary(r.Workers()), "f1:file:drained w1:flag"; got != want {
		t.Fatalf("Workers() = %s, want %s", got, want)
	}
	if err := r.SetDraining("w1", true); err != nil {
		t.Fatal(err)
	}
	if !drainChanges(r) {
		t.Fatal("SetDraining did not notify")
	}
	if err := r.SetDraining("w1", true); err != nil || drainChanges(r) {
		t.Fatalf("a repeated SetDraining: %v, or it notified", err)
	}
	// An explicit undrain overrides the file's draining: true.
	if err := r.SetDraining("f1", false); err != nil {
		t.Fatal(err)
	}
	if got, want := summary(r.Workers()), "f1:file w1:flag:drained"; got != want {
		t.Fatalf("Workers() = %s, want %s", got, want)
	}
	if err := r.SetDraining("nope", true); !errors.Is(err, ErrNotFound) {
		t.Fatalf("SetDraining(nope) = %v, want ErrNotFound", err)
	}
}

func TestRegistryPolicy(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	p := r.Policy()
	if p.Version != 1 {
		t.Fatalf("first Policy() = %+v, want DefaultPolicy", p)
	}
	p.TierWeights[0] = 0.5 // the caller's copy
	if r.Policy().TierWeights[0] != 1 {
		t.Fatal("Policy() shares TierWeights with the registry")
	}
	p.Name = PolicyLeastLoaded
	got, err := r.SetPolicy(p)
	if err != nil {
		t.Fatal(err)
	}
	if got.Version != 2 || got.Name != PolicyLeastLoaded || !drainChanges(r) {
		t.Fatalf("SetPolicy = %+v; want version 2, with a notification", got)
	}
	if _, err := r.SetPolicy(p); !errors.Is(err, ErrVersionConflict) {
		t.Fatalf("SetPolicy from version 1 after 2: %v, want ErrVersionConflict", err)
	}
	p.Name = "nope"
	p.Version = 0
	if _, err := r.SetPolicy(p); !errors.Is(err, ErrInvalid) {
		t.Fatalf("SetPolicy(invalid) = %v, want ErrInvalid", err)
	}
	if drainChanges(r) || r.Policy().Version != 2 {
		t.Fatal("a refused policy changed something")
	}
}

// TestRegistryRestart runs a registry on a store, then a new one on the reopened store: API
// workers, drains (of any source) and the policy version survive.
func TestRegistryRestart(t *testing.T) {
	dir := t.TempDir()
	flags := []Worker{mustParse(t, "id=f1,url=http://h:1")}

	s := openStore(t, dir)
	r, err := New(s, flags, discard())
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"id=a1,url=http://h:2,model=m", "id=a2,url=http://h:3", "id=f1,url=http://h:4"} {
		if err := r.Upsert(mustParse(t, w)); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Remove("a2"); err != nil {
		t.Fatal(err)
	}
	if err := r.Remove("f1"); err != nil { // the API's f1; the flag's remains
		t.Fatal(err)
	}
	if err := r.SetDraining("f1", true); err != nil {
		t.Fatal(err)
	}
	if err := r.SetDraining("a1", true); err != nil {
		t.Fatal(err)
	}
	p := r.Policy()
	p.Temperature = 0.2
	if p, err = r.SetPolicy(p); err != nil || p.Version != 2 {
		t.Fatalf("SetPolicy = %+v, %v", p, err)
	}
	before := r.Workers()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s = openStore(t, dir)
	defer s.Close()
	r, err = New(s, flags, discard())
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Workers(); !slices.EqualFunc(got, before, Worker.Equal) {
		t.Fatalf("Workers() after restart:\n got %+v\nwant %+v", got, before)
	}
	if got, want := summary(r.Workers()), "a1:api:drained f1:flag:drained"; got != want {
		t.Fatalf("Workers() after restart = %s, want %s", got, want)
	}
	if got := r.Policy(); got.Version != 2 || got.Temperature != 0.2 {
		t.Fatalf("Policy() after restart = %+v", got)
	}
	again := r.Policy()
	if got, err := r.SetPolicy(again); err != nil || got.Version != 2 {
		t.Fatalf("setting the policy as it is after restart = %+v, %v; want version 2 kept", got, err)
	}
	again.Temperature = 0.3
	got, err := r.SetPolicy(again)
	if err != nil || got.Version != 3 {
		t.Fatalf("SetPolicy after restart = %+v, %v; want version 3", got, err)
	}
	// Removing an API worker forgets its drain.
	if err := r.Remove("a1"); err != nil {
		t.Fatal(err)
	}
	if d, err := s.Drains(); err != nil || len(d) != 1 || !d["f1"] {
		t.Fatalf("drains after removing a1 = %v, %v; want only f1", d, err)
	}
}

func TestRegistrySkipsInvalidStoredWorkers(t *testing.T) {
	s := openStore(t, t.TempDir())
	defer s.Close()
	if err := s.PutWorker(Worker{ID: "old", URL: "http://h:1/v1"}); err != nil { // no longer valid
		t.Fatal(err)
	}
	if err := s.PutWorker(Worker{ID: "ok", URL: "http://h:2"}); err != nil {
		t.Fatal(err)
	}
	r, err := New(s, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	if got, want := summary(r.Workers()), "ok:api"; got != want {
		t.Fatalf("Workers() = %s, want %s", got, want)
	}
}

func TestRegistryChangesCoalesce(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if err := r.Upsert(Worker{ID: fmt.Sprint("w", i), URL: "http://h:1"}); err != nil {
			t.Fatal(err)
		}
	}
	if !drainChanges(r) {
		t.Fatal("no notification after 10 changes")
	}
	if drainChanges(r) {
		t.Fatal("10 changes left more than one notification")
	}
	if n := len(r.Workers()); n != 10 {
		t.Fatalf("%d workers after the notification, want 10", n)
	}
}

// TestRegistryConcurrent exercises every method from several goroutines (for -race).
func TestRegistryConcurrent(t *testing.T) {
	s := openStore(t, t.TempDir())
	defer s.Close()
	r, err := New(s, []Worker{mustParse(t, "id=flag,url=http://h:1")}, discard())
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	done := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-r.Changes():
				_ = r.Workers()
				_ = r.Policy()
			case <-done:
				return
			}
		}
	})
	var writers sync.WaitGroup
	for g := range 4 {
		writers.Go(func() {
			for i := range 20 {
				id := fmt.Sprintf("g%d-%d", g, i%5)
				_ = r.Upsert(Worker{ID: id, URL: fmt.Sprintf("http://h:%d", 1+i)})
				_ = r.SetDraining("flag", i%2 == 0)
				_ = r.SetDraining(id, true)
				if i%3 == 0 {
					_ = r.Remove(id)
				}
				p := r.Policy()
				p.Version = 0
				p.Temperature = float64(g*100+i+1) / 1000 // each set a change: a new version
				if _, err := r.SetPolicy(p); err != nil {
					t.Error(err)
				}
				r.replace(SourceK8s, map[string]Worker{id: {ID: id, URL: "http://k:1", Source: SourceK8s}})
				_, _ = r.Get(id)
				_ = r.Stats()
			}
		})
	}
	writers.Wait()
	close(done)
	wg.Wait()
	if v := r.Policy().Version; v != 1+4*20 {
		t.Fatalf("policy version %d after 80 sets, want 81", v)
	}
}

// TestRolloutVersions: a candidate takes the version after the stable one; moving its share
// or turning shadow on changes neither version; changing the candidate gives it a new one;
// a candidate's own candidate, or a share without a candidate, is refused.
func TestRolloutVersions(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	p := r.Policy()
	cand := p
	cand.OverlapWeight = 0
	p.Candidate, p.CandidateShare = &cand, 0.05
	got, err := r.SetPolicy(p)
	if err != nil || got.Version != 1 || got.Candidate.Version != 2 {
		t.Fatalf("start: %+v, %v; want stable 1 kept, candidate 2", got, err)
	}
	p.CandidateShare, p.Shadow = 0.5, false
	if got, err = r.SetPolicy(p); err != nil || got.Version != 1 || got.Candidate.Version != 2 {
		t.Fatalf("share moved: %+v, %v", got, err)
	}
	cand.Temperature = 0.5
	if got, err = r.SetPolicy(p); err != nil || got.Version != 1 || got.Candidate.Version != 3 {
		t.Fatalf("candidate changed: %+v, %v; want candidate 3", got, err)
	}
	bad := p
	inner := cand
	inner.Candidate = &cand
	bad.Candidate = &inner
	if _, err := r.SetPolicy(bad); err == nil {
		t.Error("a candidate's candidate accepted")
	}
	bad = r.Policy()
	bad.Candidate, bad.CandidateShare = nil, 0.5
	if _, err := r.SetPolicy(bad); err == nil {
		t.Error("a share without a candidate accepted")
	}
}
