// Package ebpf watches the connections between proxies and engines and the queues in front
// of engines from the kernel, attributes what it sees to workers and pools, and exports it to
// Prometheus as kvrelay_ebpf_* metrics.
//
// The programs themselves live in ebpf/probes (C sources, bpf2go output committed); this
// package decides which to attach (Mode), tells them what to watch (SetTargets: engine
// address:port → worker and pool; SetProcesses: PID → worker and pool) and serves as a
// prometheus.Collector that reads the kernel's histograms at each scrape. A probe that cannot
// load or attach (no privileges, a hook missing from the kernel, no cgroup v2) is logged once
// and marked inactive (kvrelay_ebpf_probe_active{probe} = 0); the rest keep running.
//
// GPU metrics from NVML are in ebpf/gpu, behind the nvml build tag.
package ebpf
