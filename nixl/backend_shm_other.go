//go:build !linux

package nixl

import "fmt"

// defaultBackends is TCP alone where shared memory is not supported.
var defaultBackends = []BackendKind{BackendTCP}

// newSHMBackend fails where memory files cannot be passed between processes; configure
// Backends without BackendSHM on such systems.
func newSHMBackend(*Agent) (Backend, error) {
	return nil, fmt.Errorf("shared memory backend needs Linux: %w", ErrBackendUnavailable)
}
