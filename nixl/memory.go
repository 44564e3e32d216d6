package nixl

import (
	"fmt"
	"sync"
	"unsafe"
)

// HostMem is host memory that same-host peers can map: on Linux it is an anonymous
// memory file (memfd) mapped shared into this process, and the shared-memory backend hands
// the file to a peer that asks, so the peer copies straight into or out of it. Registering a
// HostMem (Agent.RegisterHostMem) is what makes a region reachable over shared memory; plain
// []byte regions are reachable over TCP only. Where memfd is not available, AllocHostMem
// returns ordinary memory and Shareable reports false.
//
// A HostMem is safe for concurrent use; its bytes are the caller's to synchronise.
type HostMem struct {
	buf []byte
	fd  int // memory file descriptor, -1 when not shareable

	mu    sync.Mutex
	regs  int // live registrations
	freed bool
}

// AllocHostMem allocates size bytes of zeroed, shareable host memory. Free releases it.
func AllocHostMem(size int) (*HostMem, error) {
	if size <= 0 {
		return nil, fmt.Errorf("allocating host memory of %d bytes: %w", size, ErrInvalidDesc)
	}
	buf, fd, err := allocShared(size)
	if err != nil {
		return nil, fmt.Errorf("allocating host memory of %d bytes: %w", size, err)
	}
	return &HostMem{buf: buf, fd: fd}, nil
}

// Bytes returns the memory. The slice is valid until Free.
func (m *HostMem) Bytes() []byte { return m.buf }

// Len is the size in bytes.
func (m *HostMem) Len() int { return len(m.buf) }

// Shareable reports whether same-host peers can map this memory.
func (m *HostMem) Shareable() bool { return m.fd >= 0 }

// Free unmaps the memory. It fails with ErrRegionInUse while a region registered from it
// is still registered with some agent. Freeing twice is a no-op.
func (m *HostMem) Free() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.freed {
		return nil
	}
	if m.regs > 0 {
		return fmt.Errorf("freeing host memory: %w", ErrRegionInUse)
	}
	m.freed = true
	err := freeShared(m.buf, m.fd)
	m.buf = nil
	return err
}

func (m *HostMem) addReg() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.freed {
		return fmt.Errorf("registering freed host memory: %w", ErrInvalidDesc)
	}
	m.regs++
	return nil
}

func (m *HostMem) dropReg() {
	m.mu.Lock()
	m.regs--
	m.mu.Unlock()
}

// Region is memory registered with an agent. Transfers address it through descriptors
// (Desc) inside it; peers learn about it from the agent's metadata. A Region stays valid
// until Agent.DeregisterMem, which waits for transfers using it to finish.
type Region struct {
	desc RegionDesc
	buf  []byte   // host memory; nil for device memory
	host *HostMem // set when registered from shareable host memory
	dev  *deviceRegion

	uses useCount // transfers using the region
}

// useCount counts users of something that can be retired: acquire fails once kill has
// been called, and kill's channel closes when the last user releases.
type useCount struct {
	mu      sync.Mutex
	refs    int
	dead    bool
	drained chan struct{}
}

// acquire adds a user; false once killed.
func (u *useCount) acquire() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.dead {
		return false
	}
	u.refs++
	return true
}

// release ends a use begun by acquire.
func (u *useCount) release() {
	u.mu.Lock()
	u.refs--
	if u.refs == 0 && u.dead {
		close(u.drained)
	}
	u.mu.Unlock()
}

// kill stops new uses and returns a channel closed once current uses have ended.
func (u *useCount) kill() <-chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.dead {
		u.dead = true
		u.drained = make(chan struct{})
		if u.refs == 0 {
			close(u.drained)
		}
	}
	return u.drained
}

// Desc returns the region's metadata description.
func (r *Region) Desc() RegionDesc { return r.desc }

// ID returns the region's id, unique within its agent.
func (r *Region) ID() uint32 { return r.desc.ID }

// Bytes returns the registered host memory (nil for device memory).
func (r *Region) Bytes() []byte { return r.buf }

// Blocks is shorthand for r.Desc().Blocks.
func (r *Region) Blocks(blockSize uint64, ids []int) (DescList, error) {
	return r.desc.Blocks(blockSize, ids)
}

func (r *Region) acquire() bool         { return r.uses.acquire() }
func (r *Region) release()              { r.uses.release() }
func (r *Region) kill() <-chan struct{} { return r.uses.kill() }

// slice returns the host bytes [off, off+n) of the region.
func (r *Region) slice(off, n uint64) []byte { return r.buf[off : off+n : off+n] }

// sliceAddr is the numeric address of a slice's first byte; it identifies memory in
// descriptors and is never turned back into a pointer.
func sliceAddr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// RegisterOption configures one registration.
type RegisterOption func(*RegionDesc)

// WithRegionName labels a region; peers can look it up by name (Peer.Region).
func WithRegionName(name string) RegisterOption {
	return func(d *RegionDesc) { d.Name = name }
}
