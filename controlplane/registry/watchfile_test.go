package registry

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func TestWatchFile(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "workers.yaml")
	writeFile(t, path, "workers:\n  - {id: a, url: 'http://h:1'}\n")

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := r.WatchFile(ctx, path, 5*time.Millisecond); err != nil {
			t.Error(err)
		}
	})
	defer func() { cancel(); wg.Wait() }()

	state := func(want string) func() bool {
		return func() bool { return summary(r.Workers()) == want }
	}
	eventually(t, "the first load", state("a:file"))

	writeFile(t, path, "workers:\n  - {id: a, url: 'http://h:1'}\n  - {id: b, url: 'http://h:2'}\n")
	eventually(t, "a second worker", state("a:file b:file"))
	if st := r.Stats(); st.FileReloads != 2 || st.FileErrors != 0 {
		t.Fatalf("Stats() = %+v, want 2 reloads", st)
	}

	// A broken file keeps the previous workers and counts one error, however long it stays.
	writeFile(t, path, "workers:\n  - {id: a, url: 'http://h:1'}\n  - {id: a, url: 'http://h:2'}\n")
	eventually(t, "the duplicate id to be refused", func() bool { return r.Stats().FileErrors == 1 })
	time.Sleep(50 * time.Millisecond) // ten more polls of the same broken content
	if st := r.Stats(); st.FileErrors != 1 || st.FileReloads != 2 {
		t.Fatalf("Stats() = %+v after a broken file stayed, want 1 error", st)
	}
	if got := summary(r.Workers()); got != "a:file b:file" {
		t.Fatalf("Workers() = %s after a broken file, want the previous set", got)
	}

	// A missing file too.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the missing file to count", func() bool { return r.Stats().FileErrors == 2 })
	if got := summary(r.Workers()); got != "a:file b:file" {
		t.Fatalf("Workers() = %s after the file went, want the previous set", got)
	}

	// A fixed file applies.
	writeFile(t, path, "workers:\n  - {id: c, url: 'http://h:3', role: decode}\n")
	eventually(t, "the fixed file", state("c:file"))
	if st := r.Stats(); st.FileErrors != 2 || st.FileReloads != 3 {
		t.Fatalf("Stats() = %+v, want 3 reloads and 2 errors", st)
	}

	// An edit that keeps the size and, on a coarse filesystem, the mtime is still seen.
	writeFile(t, path, "workers:\n  - {id: d, url: 'http://h:3', role: decode}\n")
	eventually(t, "a same-size edit", state("d:file"))

	// An empty list empties the file source.
	writeFile(t, path, "workers: []\n")
	eventually(t, "no workers", state(""))
}

func TestReloadFile(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := r.ReloadFile(filepath.Join(dir, "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("ReloadFile(missing) = %v", err)
	}
	path := filepath.Join(dir, "workers.yaml")
	writeFile(t, path, "workers:\n  - {id: a, url: 'http://h:1'}\n")
	if err := r.ReloadFile(path); err != nil {
		t.Fatal(err)
	}
	writeFile(t, path, "workers:\n  - {id: a, url: 'http://h:1', engine: tgi}\n")
	if err := r.ReloadFile(path); !errors.Is(err, ErrInvalid) {
		t.Fatalf("ReloadFile(bad) = %v, want ErrInvalid", err)
	}
	if got := summary(r.Workers()); got != "a:file" {
		t.Fatalf("Workers() = %s, want a:file kept", got)
	}
	if st := r.Stats(); st.FileReloads != 1 || st.FileErrors != 2 {
		t.Fatalf("Stats() = %+v, want 1 reload, 2 errors", st)
	}
}

// TestWatchFileAfterReloadFile: the watcher's first poll does not parse again what
// ReloadFile just applied.
func TestWatchFileAfterReloadFile(t *testing.T) {
	r, err := New(nil, nil, discard())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "workers.yaml")
	writeFile(t, path, "workers:\n  - {id: a, url: 'http://h:1'}\n")
	if err := r.ReloadFile(path); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := r.WatchFile(ctx, path, 5*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if st := r.Stats(); st.FileReloads != 1 {
		t.Fatalf("Stats() = %+v, want the one reload", st)
	}
}
