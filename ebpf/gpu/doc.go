// Package gpu exports per-device GPU metrics from NVML (github.com/NVIDIA/go-nvml):
// utilization, memory used and total, power and temperature, labelled by device index, UUID
// and name.
//
// NVML is cgo and needs the driver's libnvidia-ml.so at run time, so the real implementation
// is behind the nvml build tag (go build -tags nvml); without it Open reports ErrNotBuilt and
// the rest of kvrelay runs unchanged. Every NVML call is gated on a successful Init: without a
// driver Init fails and any further call would kill the process, so Open then returns the
// error and makes no other call.
package gpu

import "errors"

// ErrNotBuilt is what Open returns in a build without the nvml tag.
var ErrNotBuilt = errors.New("gpu metrics: built without the nvml tag")
