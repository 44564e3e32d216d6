package nixl

// deviceRegion is the device-memory state of a VRAM region. The package has no device
// support, and no build tag adds it: this file is the seam where it would go, replacing
// deviceRegion, deviceSupport and registerDevice together (with staging copies between
// device and host for the TCP backend) and leaving callers unchanged.
type deviceRegion struct{}

// deviceSupport reports whether this build can register and move device memory.
const deviceSupport = false

// registerDevice would pin and describe device memory; without device support it fails.
func registerDevice(devID uint32, ptr uintptr, size uint64) (*deviceRegion, error) {
	return nil, ErrDeviceMemoryUnavailable
}

// deregisterDevice releases what registerDevice set up.
func (d *deviceRegion) deregister() {}
