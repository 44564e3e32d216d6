// Package probes loads and attaches kvrelay's eBPF programs (C sources beside this file,
// compiled by bpf2go into the committed *_bpfel.go and *_bpfel.o) and reads what they
// aggregate. It knows endpoints, PIDs and histograms, not workers: attribution and export
// live in package ebpf.
//
// Each Attach function loads one object and attaches its programs; on any error it releases
// what it made and returns the error (the caller logs it and marks the probe inactive).
// The returned probes are safe for concurrent use; Close detaches them.
package probes

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
)

// HistSlots is the number of log2 buckets of a kernel histogram: slot i counts values of
// [2^i, 2^(i+1)) nanoseconds (slot 0 also counts 0, the last slot everything above).
const HistSlots = 48

// Hist is a kernel histogram of nanosecond values.
type Hist struct {
	Count uint64
	SumNs uint64
	Slots [HistSlots]uint64
}

// Add adds o into h.
func (h *Hist) Add(o *Hist) {
	h.Count += o.Count
	h.SumNs += o.SumNs
	for i := range h.Slots {
		h.Slots[i] += o.Slots[i]
	}
}

// Quantile estimates the q-quantile in nanoseconds: the upper bound of the slot holding it.
func (h *Hist) Quantile(q float64) uint64 {
	if h.Count == 0 {
		return 0
	}
	rank := uint64(q*float64(h.Count) + 0.5)
	if rank < 1 {
		rank = 1
	}
	var n uint64
	for i, c := range h.Slots {
		n += c
		if n >= rank {
			return 1 << (i + 1)
		}
	}
	return 1 << HistSlots
}

var memlockOnce sync.Once

func removeMemlock() {
	// Kernels ≥ 5.11 account BPF memory to the cgroup and ignore RLIMIT_MEMLOCK; older ones
	// need it lifted. A failure here shows up as a load error later.
	memlockOnce.Do(func() { _ = rlimit.RemoveMemlock() })
}

// endpointKey is the kernel's struct endpoint for ap (IPv4 only).
func endpointKey(ap netip.AddrPort) (tcpconnEndpoint, error) {
	a := ap.Addr().Unmap()
	if !a.Is4() {
		return tcpconnEndpoint{}, fmt.Errorf("endpoint %s: only IPv4 endpoints are watched", ap)
	}
	b := a.As4()
	return tcpconnEndpoint{Addr: binary.NativeEndian.Uint32(b[:]), Port: ap.Port()}, nil
}

// addrPort is the inverse of endpointKey.
func addrPort(addr uint32, port uint16) netip.AddrPort {
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], addr)
	return netip.AddrPortFrom(netip.AddrFrom4(b), port)
}

// setTargets makes m (struct endpoint → u8) hold exactly eps.
func setTargets(m *ebpf.Map, eps []netip.AddrPort) error {
	want := map[tcpconnEndpoint]bool{}
	for _, ep := range eps {
		k, err := endpointKey(ep)
		if err != nil {
			continue
		}
		want[k] = true
	}
	var (
		k    tcpconnEndpoint
		v    uint8
		drop []tcpconnEndpoint
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			drop = append(drop, k)
		}
		delete(want, k)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading watched endpoints: %w", err)
	}
	for _, k := range drop {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("unwatching %s: %w", addrPort(k.Addr, k.Port), err)
		}
	}
	for k := range want {
		if err := m.Put(k, uint8(1)); err != nil {
			return fmt.Errorf("watching %s: %w", addrPort(k.Addr, k.Port), err)
		}
	}
	return nil
}

// closeAll closes what is not nil, in order.
func closeAll(cs ...interface{ Close() error }) error {
	var errs []error
	for _, c := range cs {
		if c != nil {
			errs = append(errs, c.Close())
		}
	}
	return errors.Join(errs...)
}

// loadErr adds the verifier's log to a load error.
func loadErr(what string, err error) error {
	var ve *ebpf.VerifierError
	if errors.As(err, &ve) {
		return fmt.Errorf("loading %s: %+v", what, ve)
	}
	return fmt.Errorf("loading %s: %w", what, err)
}

// attachCgroup attaches prog to the cgroup v2 at path.
func attachCgroup(path string, typ ebpf.AttachType, prog *ebpf.Program) (link.Link, error) {
	l, err := link.AttachCgroup(link.CgroupOptions{Path: path, Attach: typ, Program: prog})
	if err != nil {
		return nil, fmt.Errorf("attaching %s to cgroup %s: %w", typ, path, err)
	}
	return l, nil
}

// CgroupV2 returns where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup on a unified
// host, /sys/fs/cgroup/unified on a hybrid one), or an error when it is not.
func CgroupV2() (string, error) {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return "", fmt.Errorf("finding cgroup v2: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[2] == "cgroup2" {
			return f[1], nil
		}
	}
	return "", errors.New("finding cgroup v2: not mounted")
}

// OwnCgroupV2 returns the cgroup v2 directory this process belongs to (from /proc/self/cgroup's
// "0::" line under the cgroup2 mount), or the hierarchy's root when the line is missing.
func OwnCgroupV2() (string, error) {
	root, err := CgroupV2()
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return root, nil
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rel, ok := strings.CutPrefix(line, "0::"); ok {
			dir := filepath.Join(root, filepath.Clean("/"+rel))
			if st, err := os.Stat(dir); err == nil && st.IsDir() {
				return dir, nil
			}
			break
		}
	}
	return root, nil
}
