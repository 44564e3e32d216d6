package auth

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
)

// recheck is how often a credential file's modification time is looked at again: a
// renewed certificate or a rotated token takes effect within it, without a restart.
const recheck = time.Second

// watched holds what was parsed from a set of files, parsed again when any of them
// changes (size or modification time). A file that stops parsing keeps the last good
// value and reports the error once per change.
type watched[T any] struct {
	paths []string
	parse func(contents [][]byte) (T, error)

	mu      sync.Mutex
	checked time.Time
	stamp   string
	val     T
	ok      bool
	err     error
	onError func(error)
}

func newWatched[T any](parse func([][]byte) (T, error), onError func(error), paths ...string) (*watched[T], error) {
	w := &watched[T]{paths: paths, parse: parse, onError: onError}
	if _, err := w.get(); err != nil {
		return nil, err
	}
	return w, nil
}

// get returns the current value, reloading the files when they changed.
func (w *watched[T]) get() (T, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	if w.ok && now.Sub(w.checked) < recheck {
		return w.val, nil
	}
	w.checked = now
	var stamp strings.Builder
	for _, p := range w.paths {
		fi, err := os.Stat(p)
		if err != nil {
			return w.fail(err)
		}
		fmt.Fprintf(&stamp, "%s:%d:%d;", p, fi.Size(), fi.ModTime().UnixNano())
	}
	if w.ok && stamp.String() == w.stamp {
		return w.val, nil
	}
	contents := make([][]byte, len(w.paths))
	for i, p := range w.paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return w.fail(err)
		}
		contents[i] = b
	}
	v, err := w.parse(contents)
	if err != nil {
		return w.fail(fmt.Errorf("%s: %w", strings.Join(w.paths, ", "), err))
	}
	w.stamp, w.val, w.ok, w.err = stamp.String(), v, true, nil
	return v, nil
}

// fail keeps the last good value when there is one.
func (w *watched[T]) fail(err error) (T, error) {
	if w.ok {
		if w.err == nil || w.err.Error() != err.Error() {
			w.err = err
			if w.onError != nil {
				w.onError(err)
			}
		}
		return w.val, nil
	}
	var zero T
	return zero, err
}

func parseKeyPair(c [][]byte) (*tls.Certificate, error) {
	cert, err := tls.X509KeyPair(c[0], c[1])
	if err != nil {
		return nil, err
	}
	return &cert, nil
}

func parsePool(c [][]byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(c[0]) {
		return nil, errors.New("no PEM certificate in the file")
	}
	return pool, nil
}

// tokenTable maps the SHA-256 of each token to the node id it is issued to.
type tokenTable map[[sha256.Size]byte]string

// parseTokens reads a tokens file: one "<node-id> <token>" per line; blank lines and lines
// starting with # are skipped. A token may be given to one node only; a node may hold
// several tokens (while one is rotated out).
func parseTokens(c [][]byte) (tokenTable, error) {
	t := tokenTable{}
	sc := bufio.NewScanner(bytes.NewReader(c[0]))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			return nil, fmt.Errorf("line %d: want \"<node-id> <token>\"", n)
		}
		if len(f[1]) < minTokenLen {
			return nil, fmt.Errorf("line %d: the token of %s is shorter than %d characters", n, f[0], minTokenLen)
		}
		h := sha256.Sum256([]byte(f[1]))
		if prev, dup := t[h]; dup && prev != f[0] {
			return nil, fmt.Errorf("line %d: one token is given to both %s and %s", n, prev, f[0])
		}
		t[h] = f[0]
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(t) == 0 {
		return nil, errors.New("no tokens")
	}
	return t, nil
}

// minTokenLen keeps guessable tokens out of a tokens file.
const minTokenLen = 16

func parseToken(c [][]byte) (string, error) {
	tok := strings.TrimSpace(string(c[0]))
	if tok == "" {
		return "", errors.New("empty token file")
	}
	if strings.ContainsAny(tok, " \t\r\n") {
		return "", errors.New("the token file holds more than one word")
	}
	return tok, nil
}

// CertLoader serves a certificate and key (PEM files) to a TLS server, read again when
// either file changes (a renewal takes effect without a restart; a changed file that does
// not parse keeps the previous pair, reported to onError).
type CertLoader struct{ w *watched[*tls.Certificate] }

// NewCertLoader loads certFile and keyFile; onError hears of a later change that does not
// parse (nil: ignored).
func NewCertLoader(certFile, keyFile string, onError func(error)) (*CertLoader, error) {
	if onError == nil {
		onError = func(error) {}
	}
	w, err := newWatched(parseKeyPair, onError, certFile, keyFile)
	if err != nil {
		return nil, err
	}
	return &CertLoader{w}, nil
}

// GetCertificate is tls.Config's.
func (l *CertLoader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) { return l.w.get() }
