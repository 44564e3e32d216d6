package tenant

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"
)

// Keys is a keys file kept current: read at NewKeys and again when it changes (Watch), a
// tenant's budgets carried over when its limits stay. A file that turns unreadable or
// malformed leaves the keys in force, and says so in the log. Safe for concurrent use.
type Keys struct {
	file  string
	log   *slog.Logger
	table atomic.Pointer[Table]
	stamp fileStamp
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

// NewKeys reads file; an error names what is wrong with it.
func NewKeys(file string, log *slog.Logger) (*Keys, error) {
	if log == nil {
		log = slog.Default()
	}
	k := &Keys{file: file, log: log}
	if err := k.reload(); err != nil {
		return nil, err
	}
	return k, nil
}

// Table is the keys in force.
func (k *Keys) Table() *Table { return k.table.Load() }

// Lookup is Table().Lookup.
func (k *Keys) Lookup(authorization []byte) *Tenant { return k.table.Load().Lookup(authorization) }

// reload reads the file when it changed since the last read.
func (k *Keys) reload() error {
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
	t, err := Parse(b)
	if err != nil {
		return fmt.Errorf("%s: %w", k.file, err)
	}
	carry(k.table.Load(), t)
	k.table.Store(t)
	k.stamp = st
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
