package tenant

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// Keys is a keys file kept current: read at NewKeys and again when it changes (Watch), a
// tenant's budgets carried over when its limits stay. A file that turns unreadable or
// malformed leaves the keys in force, and says so in the log. Safe for concurrent use.
//
// Keys given through a control plane (SetRemote) count beside the file's: a key in either is
// a key. With neither a file nor remote keys, keys are not checked (Active is false).
type Keys struct {
	file  string
	log   *slog.Logger
	table atomic.Pointer[Table]
	stamp fileStamp

	// mu serialises reloads and SetRemote; text is the file's last good content, remote the
	// control plane's keys in force.
	mu     sync.Mutex
	text   []byte
	remote string
	active atomic.Bool
}

// fileStamp is what tells a changed file: its size and modification time, and which file it
// is: the path its symlinks resolve to, its device and inode. The path and the inode tell a
// file replaced by another, which may have the same size and modification time: a Secret the
// kubelet mounts is <mount>/<key> → ..data/<key>, and an update writes a new timestamped
// directory and swaps the ..data symlink to it, so the path resolves elsewhere.
type fileStamp struct {
	size     int64
	mod      time.Time
	path     string
	dev, ino uint64
}

// stamp is file's fileStamp now.
func stamp(file string) (fileStamp, error) {
	// Resolved before the Stat: a swap in between reads as a change the next time.
	path, err := filepath.EvalSymlinks(file)
	if err != nil {
		return fileStamp{}, err
	}
	fi, err := os.Stat(file)
	if err != nil {
		return fileStamp{}, err
	}
	dev, ino := fileID(fi)
	return fileStamp{size: fi.Size(), mod: fi.ModTime(), path: path, dev: dev, ino: ino}, nil
}

// NewKeys reads file ("": none, keys only from SetRemote); an error names what is wrong
// with it.
func NewKeys(file string, log *slog.Logger) (*Keys, error) {
	if log == nil {
		log = slog.Default()
	}
	k := &Keys{file: file, log: log}
	if file == "" {
		k.table.Store(&Table{keys: map[[sha256.Size]byte]*Tenant{}, tenants: map[string]*Tenant{}})
		return k, nil
	}
	k.active.Store(true)
	if err := k.reload(); err != nil {
		return nil, err
	}
	return k, nil
}

// Active reports whether requests must carry a key: there is a keys file, or keys from a
// control plane.
func (k *Keys) Active() bool { return k.active.Load() }

// CheckRemote reports what is wrong with keys a control plane gives (keys file lines), alone
// or beside the file's, without taking them.
func (k *Keys) CheckRemote(remote string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, err := k.parse(k.text, remote)
	return err
}

// SetRemote takes the keys a control plane gives (keys file lines; "" none) beside the
// file's, or refuses them with what is wrong and keeps those in force.
func (k *Keys) SetRemote(remote string) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	t, err := k.parse(k.text, remote)
	if err != nil {
		return err
	}
	carry(k.table.Load(), t)
	k.table.Store(t)
	k.remote = remote
	k.active.Store(k.file != "" || remote != "")
	return nil
}

// parse parses the file's text and the control plane's keys together.
func (k *Keys) parse(text []byte, remote string) (*Table, error) {
	if remote == "" {
		return Parse(text)
	}
	if _, err := Parse([]byte(remote)); err != nil {
		return nil, fmt.Errorf("the control plane's API keys: %w", err)
	}
	all := append(append(append([]byte(nil), text...), '\n'), remote...)
	t, err := Parse(all)
	if err != nil {
		return nil, fmt.Errorf("the control plane's API keys beside the keys file: %w", err)
	}
	return t, nil
}

// Table is the keys in force.
func (k *Keys) Table() *Table { return k.table.Load() }

// Lookup is Table().Lookup.
func (k *Keys) Lookup(authorization []byte) *Tenant { return k.table.Load().Lookup(authorization) }

// reload reads the file when it changed since the last read.
func (k *Keys) reload() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	st, err := stamp(k.file)
	if err != nil {
		return fmt.Errorf("api keys file: %w", err)
	}
	if k.table.Load() != nil && st == k.stamp {
		return nil
	}
	b, err := os.ReadFile(k.file)
	if err != nil {
		return fmt.Errorf("api keys file: %w", err)
	}
	t, err := k.parse(b, k.remote)
	if err != nil {
		return fmt.Errorf("%s: %w", k.file, err)
	}
	carry(k.table.Load(), t)
	k.table.Store(t)
	k.stamp, k.text = st, b
	return nil
}

// Watch reads the file again every interval while ctx lasts, when it changed.
func (k *Keys) Watch(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			before := k.table.Load()
			if err := k.reload(); err != nil {
				k.log.Error("API keys not read again; the keys in force stay", "err", err)
			} else if k.table.Load() != before {
				k.log.Info("API keys read again", "file", k.file, "tenants", len(k.table.Load().tenants))
			}
		}
	}
}
