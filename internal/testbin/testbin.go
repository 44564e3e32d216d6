// Package testbin is for tests that run kvrelay as a process: it builds cmd/kvrelay once
// per test binary (Kvrelay; the test's TestMain calls Remove after its tests) and keeps a
// process's output for reading while the process writes it (Output).
package testbin

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
)

var (
	dirMu sync.Mutex
	dir   string // the built binary's directory, once built
)

// Kvrelay returns the path of cmd/kvrelay built once per test binary.
var Kvrelay = sync.OnceValues(func() (string, error) {
	d, err := os.MkdirTemp("", "kvrelay-test-bin-")
	if err != nil {
		return "", err
	}
	dirMu.Lock()
	dir = d
	dirMu.Unlock()
	bin := filepath.Join(d, "kvrelay")
	// Without the symbol table and DWARF: a smaller binary, linked sooner (the link is most
	// of a build whose packages the cache holds).
	out, err := exec.Command("go", "build", "-buildvcs=false", "-ldflags=-s -w", "-o", bin, "github.com/kvrelay/kvrelay/cmd/kvrelay").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/kvrelay: %w\n%s", err, out)
	}
	return bin, nil
})

// Remove deletes the binary Kvrelay built, if it built one.
func Remove() {
	dirMu.Lock()
	defer dirMu.Unlock()
	if dir != "" {
		os.RemoveAll(dir)
	}
}

// Output is a process's output, read while the process writes it.
type Output struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (o *Output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.Write(p)
}

func (o *Output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}
