//go:build !linux

package nixl

// allocShared falls back to ordinary memory where memfd is not available; such memory is
// reachable over TCP only.
func allocShared(size int) ([]byte, int, error) { return make([]byte, size), -1, nil }

func freeShared([]byte, int) error { return nil }
