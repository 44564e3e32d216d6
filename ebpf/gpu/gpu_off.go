//go:build !nvml

package gpu

import "github.com/prometheus/client_golang/prometheus"

// Open reports ErrNotBuilt: this build has no NVML.
func Open() (Collector, error) { return nil, ErrNotBuilt }

// Collector is a prometheus.Collector of GPU metrics that must be closed.
type Collector interface {
	prometheus.Collector
	Close() error
}
