package registry

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"time"
)

// DefaultFileInterval is how often WatchFile polls when given no interval.
const DefaultFileInterval = time.Second

// racyWindow: a file modified this recently is read again even if its mtime and size look
// unchanged, since a second write within the filesystem's timestamp granularity that keeps
// the size would otherwise go unseen.
const racyWindow = 2 * time.Second

// ReloadFile reads the workers file at path and makes its workers the registry's file
// workers. On an error (unreadable file, parse error, duplicate ids) the previous file
// workers stay, the error is counted in Stats.FileErrors and returned; the caller decides
// whether to log it or fail (at start, say).
func (r *Registry) ReloadFile(path string) error {
	data, err := readFile(path)
	if err != nil {
		r.fileMu.Lock()
		defer r.fileMu.Unlock()
		r.fileSeen = false
		r.countFileError()
		return err
	}
	return r.applyFile(path, data, true)
}

// WatchFile keeps the file workers in step with the workers file at path until ctx ends,
// then returns nil. It checks the file every interval (DefaultFileInterval if interval ≤ 0),
// starting at once: a changed mtime or size (or a recent mtime) makes it read the file, and
// a changed content hash makes it parse and apply it. A file that cannot be read or parsed
// leaves the previous workers in place; the error is logged and counted once per distinct
// failure. To empty the file source, write `workers: []` rather than deleting the file.
func (r *Registry) WatchFile(ctx context.Context, path string, interval time.Duration) error {
	if interval <= 0 {
		interval = DefaultFileInterval
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	var p filePoll
	for {
		r.pollFile(path, &p)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// filePoll is what WatchFile remembers between polls.
type filePoll struct {
	stamped bool
	mtime   time.Time
	size    int64
	readErr string // the last stat or read error, logged once
}

func (r *Registry) pollFile(path string, p *filePoll) {
	fi, err := os.Stat(path)
	if err == nil && fi.Size() > MaxFileSize {
		err = fmt.Errorf("%w: workers file %s is larger than %d bytes", ErrInvalid, path, MaxFileSize)
	}
	if err != nil {
		r.readFailed(p, err)
		return
	}
	if p.stamped && fi.ModTime().Equal(p.mtime) && fi.Size() == p.size && time.Since(fi.ModTime()) > racyWindow {
		return
	}
	data, err := readFile(path)
	if err != nil {
		r.readFailed(p, err)
		return
	}
	p.stamped, p.mtime, p.size, p.readErr = true, fi.ModTime(), fi.Size(), ""
	_ = r.applyFile(path, data, false) // logged there, once per content
}

func (r *Registry) readFailed(p *filePoll, err error) {
	p.stamped = false
	if p.readErr == err.Error() {
		return
	}
	p.readErr = err.Error()
	r.fileMu.Lock()
	r.fileSeen = false // whatever comes back is parsed afresh
	r.fileMu.Unlock()
	r.countFileError()
	r.log.Error("workers file unreadable; keeping the previous workers", "err", err)
}

// applyFile parses data and applies it as the file source. Unless force, content already
// seen (applied or refused) is skipped, returning the error it had.
func (r *Registry) applyFile(path string, data []byte, force bool) error {
	sum := sha256.Sum256(data)
	r.fileMu.Lock()
	defer r.fileMu.Unlock()
	if !force && r.fileSeen && sum == r.fileSum {
		return r.fileErr
	}
	r.fileSeen, r.fileSum = true, sum
	ws, err := ParseWorkers(data)
	if err != nil {
		r.fileErr = fmt.Errorf("reloading workers file %s: %w", path, err)
		r.countFileError()
		if !force {
			r.log.Error("workers file refused; keeping the previous workers", "path", path, "err", err)
		}
		return r.fileErr
	}
	r.fileErr = nil
	m := make(map[string]Worker, len(ws))
	for _, w := range ws {
		m[w.ID] = w
	}
	changed := r.replace(SourceFile, m)
	r.mu.Lock()
	r.stats.FileReloads++
	r.mu.Unlock()
	r.log.Info("workers file loaded", "path", path, "workers", len(ws), "changed", changed)
	return nil
}

func (r *Registry) countFileError() {
	r.mu.Lock()
	r.stats.FileErrors++
	r.mu.Unlock()
}
