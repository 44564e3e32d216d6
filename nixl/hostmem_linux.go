//go:build linux

package nixl

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// allocShared creates a memfd of size bytes and maps it shared.
func allocShared(size int) ([]byte, int, error) {
	fd, err := unix.MemfdCreate("kvrelay-nixl", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, -1, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("ftruncate memfd: %w", err)
	}
	buf, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("mmap memfd: %w", err)
	}
	return buf, fd, nil
}

func freeShared(buf []byte, fd int) error {
	err := unix.Munmap(buf)
	if cerr := unix.Close(fd); err == nil {
		err = cerr
	}
	return err
}
