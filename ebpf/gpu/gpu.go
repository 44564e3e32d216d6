//go:build nvml

package gpu

import (
	"fmt"
	"strconv"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"
)

// Collector is a prometheus.Collector of GPU metrics that must be closed.
type Collector interface {
	prometheus.Collector
	Close() error
}

// NVML reads the devices of one initialised NVML library. Safe for concurrent use.
type NVML struct {
	mu      sync.Mutex
	lib     nvml.Interface
	devices []device
	closed  bool

	util, memUsed, memTotal, power, temp *prometheus.Desc
}

type device struct {
	d                 nvml.Device
	index, uuid, name string
}

// Open initialises the system's NVML (libnvidia-ml.so through the driver).
func Open() (Collector, error) { return OpenLib(nvml.New()) }

// OpenLib initialises lib and lists its devices. When Init fails it returns the error and
// makes no other call on lib.
func OpenLib(lib nvml.Interface) (*NVML, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu metrics: nvml init: %s", nvml.ErrorString(ret))
	}
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		_ = lib.Shutdown()
		return nil, fmt.Errorf("gpu metrics: counting devices: %s", nvml.ErrorString(ret))
	}
	labels := []string{"gpu", "uuid", "name"}
	g := &NVML{
		lib: lib,
		util: prometheus.NewDesc("kvrelay_gpu_utilization_ratio",
			"Fraction of the last sample period in which a kernel ran on the GPU (NVML utilization.gpu / 100).", labels, nil),
		memUsed:  prometheus.NewDesc("kvrelay_gpu_memory_used_bytes", "GPU memory in use.", labels, nil),
		memTotal: prometheus.NewDesc("kvrelay_gpu_memory_total_bytes", "GPU memory installed.", labels, nil),
		power:    prometheus.NewDesc("kvrelay_gpu_power_watts", "GPU power draw.", labels, nil),
		temp:     prometheus.NewDesc("kvrelay_gpu_temperature_celsius", "GPU core temperature.", labels, nil),
	}
	for i := range n {
		d, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		dev := device{d: d, index: strconv.Itoa(i)}
		if s, ret := d.GetUUID(); ret == nvml.SUCCESS {
			dev.uuid = s
		}
		if s, ret := d.GetName(); ret == nvml.SUCCESS {
			dev.name = s
		}
		g.devices = append(g.devices, dev)
	}
	return g, nil
}

// Devices is the number of devices found.
func (g *NVML) Devices() int { return len(g.devices) }

// Describe implements prometheus.Collector.
func (g *NVML) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{g.util, g.memUsed, g.memTotal, g.power, g.temp} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: it reads every device now; a value NVML cannot
// give (not supported on the device, say) is left out.
func (g *NVML) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return
	}
	for _, dev := range g.devices {
		l := []string{dev.index, dev.uuid, dev.name}
		if u, ret := dev.d.GetUtilizationRates(); ret == nvml.SUCCESS {
			ch <- prometheus.MustNewConstMetric(g.util, prometheus.GaugeValue, float64(u.Gpu)/100, l...)
		}
		if m, ret := dev.d.GetMemoryInfo(); ret == nvml.SUCCESS {
			ch <- prometheus.MustNewConstMetric(g.memUsed, prometheus.GaugeValue, float64(m.Used), l...)
			ch <- prometheus.MustNewConstMetric(g.memTotal, prometheus.GaugeValue, float64(m.Total), l...)
		}
		if mw, ret := dev.d.GetPowerUsage(); ret == nvml.SUCCESS {
			ch <- prometheus.MustNewConstMetric(g.power, prometheus.GaugeValue, float64(mw)/1000, l...)
		}
		if c, ret := dev.d.GetTemperature(nvml.TEMPERATURE_GPU); ret == nvml.SUCCESS {
			ch <- prometheus.MustNewConstMetric(g.temp, prometheus.GaugeValue, float64(c), l...)
		}
	}
}

// Close shuts NVML down; Collect reports nothing afterwards.
func (g *NVML) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	if ret := g.lib.Shutdown(); ret != nvml.SUCCESS {
		return fmt.Errorf("gpu metrics: nvml shutdown: %s", nvml.ErrorString(ret))
	}
	return nil
}

var _ Collector = (*NVML)(nil)
