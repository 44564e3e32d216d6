package nixl

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strconv"
)

// MemType is the kind of memory a region or descriptor list lives in.
type MemType uint8

const (
	// DRAM is host memory.
	DRAM MemType = iota
	// VRAM is accelerator memory; DevID names the device. This package has no device
	// support and rejects it with ErrDeviceMemoryUnavailable.
	VRAM
)

// String returns "DRAM" or "VRAM".
func (m MemType) String() string {
	switch m {
	case DRAM:
		return "DRAM"
	case VRAM:
		return "VRAM"
	}
	return "MemType(" + strconv.Itoa(int(m)) + ")"
}

// Desc addresses a contiguous range of memory: Addr is the address of its first byte in
// the owning process (a device pointer for VRAM), Len its length, DevID the device (0 for
// host memory). A descriptor is valid when it lies inside one registered region of the
// same memory type and device.
type Desc struct {
	Addr  uint64
	Len   uint64
	DevID uint32
}

// String formats the descriptor for errors and logs.
func (d Desc) String() string {
	return fmt.Sprintf("{addr=%#x len=%d dev=%d}", d.Addr, d.Len, d.DevID)
}

// DescList is an ordered list of descriptors in one memory type. Transfers pair the i-th
// local descriptor with the i-th remote one; their lengths must match.
type DescList struct {
	Mem   MemType
	Descs []Desc
}

// Len is the sum of the descriptors' lengths.
func (l DescList) Len() uint64 {
	var n uint64
	for _, d := range l.Descs {
		n += d.Len
	}
	return n
}

// Append returns l with ds appended.
func (l DescList) Append(ds ...Desc) DescList {
	l.Descs = append(l.Descs, ds...)
	return l
}

// RegionDesc describes a registered region as it appears in metadata: what a peer may
// address. ID is unique within the owning agent and never reused; Name is the optional
// label given at registration; Shared reports that the region is backed by shareable host
// memory (HostMem) that same-host peers can map.
type RegionDesc struct {
	ID     uint32
	Name   string
	Mem    MemType
	DevID  uint32
	Addr   uint64
	Len    uint64
	Shared bool
}

// Whole returns a descriptor covering the entire region.
func (r RegionDesc) Whole() Desc {
	return Desc{Addr: r.Addr, Len: r.Len, DevID: r.DevID}
}

// Range returns the descriptor for [off, off+n) within the region, or an error wrapping
// ErrOutOfRange when it does not fit.
func (r RegionDesc) Range(off, n uint64) (Desc, error) {
	if n == 0 {
		return Desc{}, fmt.Errorf("region range at %d: %w", off, ErrInvalidDesc)
	}
	if off > r.Len || n > r.Len-off {
		return Desc{}, fmt.Errorf("region %d range [%d,+%d) of %d bytes: %w", r.ID, off, n, r.Len, ErrOutOfRange)
	}
	return Desc{Addr: r.Addr + off, Len: n, DevID: r.DevID}, nil
}

// Blocks builds a descriptor list for fixed-size block slots of the region: block id i is
// [Addr + i*blockSize, Addr + (i+1)*blockSize). It is how a KV cache laid out as one region
// of equal slots is addressed by block ids (vLLM's remote_block_ids). Adjacent ids are
// not merged, so the list pairs one-to-one with a peer's list built from its own ids.
func (r RegionDesc) Blocks(blockSize uint64, ids []int) (DescList, error) {
	if blockSize == 0 {
		return DescList{}, fmt.Errorf("blocks of region %d: block size 0: %w", r.ID, ErrInvalidDesc)
	}
	l := DescList{Mem: r.Mem, Descs: make([]Desc, len(ids))}
	slots := r.Len / blockSize
	for i, id := range ids {
		if id < 0 || uint64(id) >= slots {
			return DescList{}, fmt.Errorf("block %d of region %d (%d slots of %d bytes): %w", id, r.ID, slots, blockSize, ErrOutOfRange)
		}
		l.Descs[i] = Desc{Addr: r.Addr + uint64(id)*blockSize, Len: blockSize, DevID: r.DevID}
	}
	return l, nil
}

// locate returns d's offset within r, or the error that says why d is not inside r.
func (r *RegionDesc) locate(d Desc) (off uint64, err error) {
	if d.Addr < r.Addr || d.Addr-r.Addr >= r.Len {
		return 0, ErrUnknownRegion
	}
	off = d.Addr - r.Addr
	if d.Len > r.Len-off {
		return 0, ErrOutOfRange
	}
	return off, nil
}

// checkDesc rejects descriptors that are invalid regardless of registrations.
func checkDesc(d Desc) error {
	if d.Len == 0 || d.Addr > math.MaxUint64-d.Len {
		return ErrInvalidDesc
	}
	return nil
}

// regionSet finds the region holding a descriptor. It is a sorted, immutable snapshot;
// changes build a new set.
type regionSet struct {
	regions []RegionDesc // sorted by (Mem, DevID, Addr); non-overlapping per (Mem, DevID)
}

// find returns the index of the region containing d.Addr, or an error.
func (s *regionSet) find(mem MemType, d Desc) (int, uint64, error) {
	rs := s.regions
	// Binary search for the last region whose key is <= (mem, dev, addr).
	lo, hi := 0, len(rs)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if regionKeyLess(mem, d.DevID, d.Addr, &rs[m]) {
			hi = m
		} else {
			lo = m + 1
		}
	}
	i := lo - 1
	if i < 0 || rs[i].Mem != mem || rs[i].DevID != d.DevID {
		return -1, 0, ErrUnknownRegion
	}
	off, err := rs[i].locate(d)
	if err != nil {
		return -1, 0, err
	}
	return i, off, nil
}

// regionKeyLess reports whether (mem, dev, addr) sorts before r's start.
func regionKeyLess(mem MemType, dev uint32, addr uint64, r *RegionDesc) bool {
	if mem != r.Mem {
		return mem < r.Mem
	}
	if dev != r.DevID {
		return dev < r.DevID
	}
	return addr < r.Addr
}

func newRegionSet(rs []RegionDesc) *regionSet {
	s := &regionSet{regions: append([]RegionDesc(nil), rs...)}
	sortRegions(s.regions)
	return s
}

func sortRegions(rs []RegionDesc) {
	slices.SortFunc(rs, func(a, b RegionDesc) int {
		if c := cmp.Compare(a.Mem, b.Mem); c != 0 {
			return c
		}
		if c := cmp.Compare(a.DevID, b.DevID); c != 0 {
			return c
		}
		return cmp.Compare(a.Addr, b.Addr)
	})
}

// overlapsAny reports whether c overlaps any region of rs in the same memory and device.
func overlapsAny(rs []RegionDesc, c RegionDesc) bool {
	for i := range rs {
		r := &rs[i]
		if r.Mem != c.Mem || r.DevID != c.DevID {
			continue
		}
		if c.Addr < r.Addr+r.Len && r.Addr < c.Addr+c.Len {
			return true
		}
	}
	return false
}
