//go:build !nixl_cuda

package nixl

// deviceRegion is the device-memory state of a VRAM region. This build has no device
// support: a build that adds it (the nixl_cuda tag) supplies deviceRegion and
// registerDevice together, with staging copies between device and host for the TCP
// backend, and leaves callers unchanged.
type deviceRegion struct{}

// deviceSupport reports whether this build can register and move device memory.
const deviceSupport = false

// registerDevice would pin and describe device memory; without device support it fails.
func registerDevice(devID uint32, ptr uintptr, size uint64) (*deviceRegion, error) {
	return nil, ErrDeviceMemoryUnavailable
}

// deregisterDevice releases what registerDevice set up.
func (d *deviceRegion) deregister() {}
