//go:build nvml

package gpu

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// dgx is the library's DGX H100 mock with utilization, power and temperature answered
// (the mock answers memory, UUIDs and names itself).
func dgx() *server.Server {
	s := dgxh100.New()
	for i, d := range s.Devices {
		dev := d.(*server.Device)
		dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			return nvml.Utilization{Gpu: uint32(10 * i), Memory: 5}, nvml.SUCCESS
		}
		dev.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 350000, nvml.SUCCESS }
		dev.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 61, nvml.SUCCESS }
	}
	return s
}

func TestDGXH100(t *testing.T) {
	g, err := OpenLib(dgx())
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if g.Devices() != 8 {
		t.Fatalf("devices = %d, want 8", g.Devices())
	}
	for name, want := range map[string]int{
		"kvrelay_gpu_utilization_ratio": 8, "kvrelay_gpu_memory_used_bytes": 8, "kvrelay_gpu_memory_total_bytes": 8,
		"kvrelay_gpu_power_watts": 8, "kvrelay_gpu_temperature_celsius": 8,
	} {
		if n := testutil.CollectAndCount(g, name); n != want {
			t.Errorf("%s: %d series, want %d", name, n, want)
		}
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(g)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		m := mf.GetMetric()[3] // gpu="3"
		v := m.GetGauge().GetValue()
		switch mf.GetName() {
		case "kvrelay_gpu_utilization_ratio":
			if v != 0.3 {
				t.Errorf("gpu 3 utilization %v, want 0.3", v)
			}
		case "kvrelay_gpu_memory_total_bytes":
			if v < 80e9 {
				t.Errorf("H100 80GB total memory %v", v)
			}
		case "kvrelay_gpu_power_watts":
			if v != 350 {
				t.Errorf("power %v W, want 350", v)
			}
		case "kvrelay_gpu_temperature_celsius":
			if v != 61 {
				t.Errorf("temperature %v, want 61", v)
			}
		}
		if mf.GetName() == "kvrelay_gpu_memory_total_bytes" {
			var name string
			for _, l := range m.GetLabel() {
				if l.GetName() == "name" {
					name = l.GetValue()
				}
			}
			if name == "" {
				t.Error("no device name label")
			}
		}
	}
	// After Close nothing is read.
	g.Close()
	if n := testutil.CollectAndCount(g); n != 0 {
		t.Errorf("%d series after Close", n)
	}
}

// TestInitFailureMakesNoOtherCall: without a driver Init fails, and any further NVML call
// would kill the process; the mock's nil funcs panic if called, which proves none is.
func TestInitFailureMakesNoOtherCall(t *testing.T) {
	lib := &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
	if _, err := OpenLib(lib); err == nil {
		t.Fatal("OpenLib succeeded with a failing Init")
	}
	if n := len(lib.InitCalls()); n != 1 {
		t.Errorf("Init called %d times", n)
	}
}

// TestSystem opens the machine's NVML: it fails cleanly without a driver and reports the
// devices with one.
func TestSystem(t *testing.T) {
	g, err := Open()
	if err != nil {
		t.Skipf("no NVML here: %v", err)
	}
	defer g.Close()
	n := testutil.CollectAndCount(g, "kvrelay_gpu_memory_total_bytes")
	t.Logf("devices with memory metrics: %d", n)
	if n == 0 {
		t.Error("NVML initialised but no device reported its memory")
	}
}
