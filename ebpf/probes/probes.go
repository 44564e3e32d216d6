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
	"slices"
	"strconv"
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
	want := map[tcpconnEndpoint]uint8{}
	for _, ep := range eps {
		if k, err := endpointKey(ep); err == nil {
			want[k] = 1
		}
	}
	return syncMap(m, want)
}

// MaxSlots is how many endpoints a probe with slot-indexed histograms (first_byte) tells
// apart at once: the kernel's MAX_SLOTS.
const MaxSlots = 1024

// slotTable gives each watched endpoint a slot, an index into a probe's array maps, so that
// the kernel finds an endpoint's histogram by index rather than by hashing its address on
// every observation. An endpoint keeps its slot while it is watched and after (its
// histogram stays cumulative when it comes back); a slot goes to another endpoint only once
// every slot has been used, the longest-unwatched first, and then gets a new generation, so
// connections that remember the old endpoint's slot stop being timed into it. Not safe for
// concurrent use.
type slotTable struct {
	of       map[netip.AddrPort]uint32 // endpoint → its slot
	owner    []netip.AddrPort          // slot → endpoint; len is the number of slots ever used
	gen      []uint32                  // slot → its generation (from 1)
	live     map[netip.AddrPort]bool   // the endpoints watched now
	released []uint32                  // slots of endpoints no longer watched, oldest first
}

// slotChange is a slot the kernel must learn about: its new generation, and whether its
// histogram must be zeroed first (it held another endpoint's).
type slotChange struct {
	idx, gen uint32
	zero     bool
}

// set makes eps (IPv4; others ignored) the watched endpoints. It returns the slots whose
// generation changed, and an error when more than MaxSlots endpoints are watched at once
// (the rest are not).
func (t *slotTable) set(eps []netip.AddrPort) ([]slotChange, error) {
	if t.of == nil {
		t.of, t.live = map[netip.AddrPort]uint32{}, map[netip.AddrPort]bool{}
	}
	want := map[netip.AddrPort]bool{}
	for _, ep := range eps {
		if ep.Addr().Unmap().Is4() {
			want[netip.AddrPortFrom(ep.Addr().Unmap(), ep.Port())] = true
		}
	}
	for _, ep := range sortedAddrPorts(t.live) {
		if !want[ep] {
			delete(t.live, ep)
			t.released = append(t.released, t.of[ep])
		}
	}
	var (
		changes []slotChange
		full    int
	)
	for _, ep := range sortedAddrPorts(want) {
		if t.live[ep] {
			continue
		}
		if idx, ok := t.of[ep]; ok { // watched again: its slot is still its own
			t.released = slices.DeleteFunc(t.released, func(i uint32) bool { return i == idx })
			t.live[ep] = true
			continue
		}
		var c slotChange
		switch {
		case len(t.owner) < MaxSlots:
			c.idx = uint32(len(t.owner))
			t.owner = append(t.owner, ep)
			t.gen = append(t.gen, 0)
		case len(t.released) > 0:
			c.idx, c.zero = t.released[0], true
			t.released = t.released[1:]
			delete(t.of, t.owner[c.idx])
			t.owner[c.idx] = ep
		default:
			full++
			continue
		}
		t.gen[c.idx]++
		c.gen = t.gen[c.idx]
		t.of[ep] = c.idx
		t.live[ep] = true
		changes = append(changes, c)
	}
	if full > 0 {
		return changes, fmt.Errorf("watching %d endpoints: at most %d at once; %d not watched", len(want), MaxSlots, full)
	}
	return changes, nil
}

// sortedAddrPorts returns m's keys in order (slots go to new endpoints deterministically).
func sortedAddrPorts(m map[netip.AddrPort]bool) []netip.AddrPort {
	out := make([]netip.AddrPort, 0, len(m))
	for ap := range m {
		out = append(out, ap)
	}
	slices.SortFunc(out, func(a, b netip.AddrPort) int { return a.Compare(b) })
	return out
}

// syncMap makes m hold exactly want: it deletes the keys not in want and writes the values of
// want that m lacks or holds otherwise.
func syncMap[K, V comparable](m *ebpf.Map, want map[K]V) error {
	var (
		k    K
		v    V
		drop []K
	)
	same := map[K]bool{}
	it := m.Iterate()
	for it.Next(&k, &v) {
		w, ok := want[k]
		switch {
		case !ok:
			drop = append(drop, k)
		case w == v:
			same[k] = true
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading %s: %w", m, err)
	}
	for _, k := range drop {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("deleting from %s: %w", m, err)
		}
	}
	for k, v := range want {
		if same[k] {
			continue
		}
		if err := m.Put(k, v); err != nil {
			return fmt.Errorf("writing %s: %w", m, err)
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
func OwnCgroupV2() (string, error) { return cgroupV2Of("self") }

// CgroupV2Of is OwnCgroupV2 for process pid.
func CgroupV2Of(pid int) (string, error) { return cgroupV2Of(strconv.Itoa(pid)) }

func cgroupV2Of(proc string) (string, error) {
	root, err := CgroupV2()
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile("/proc/" + proc + "/cgroup")
	if err != nil {
		if proc != "self" {
			return "", err
		}
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
