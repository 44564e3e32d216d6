// Package ebpf will hold kvrelay's kernel probes (C sources with their committed bpf2go
// output) and the collectors that attribute what they measure to workers and pools, plus GPU
// metrics from NVML where GPUs exist.
package ebpf
