// Copyright (c) 2026 the kvrelay authors
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

//go:build linux

package io

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// RawRead and RawWrite read from and write to a connected socket: recvfrom(2) and sendto(2)
// with no address, made as raw system calls, without telling the Go runtime (no
// entersyscall/exitsyscall). They are for gnet's non-blocking sockets only, whose calls never
// wait: the runtime bookkeeping costs more than such a call's own work on a loaded event
// loop, and a P marked as in a system call invites sysmon to hand it to another thread. The
// socket calls rather than read(2) and write(2) skip the file layer (position lock,
// permission hooks, the file's read/write iterators) that a socket does not need, as nginx
// does with recv and writev; sendto passes MSG_NOSIGNAL, so a write to a connection the peer
// has reset returns EPIPE without raising SIGPIPE first. Errors are returned as unix.Errno
// values, as unix.Read and unix.Write do.
func RawRead(fd int, p []byte) (int, error) { return rawIO(unix.SYS_RECVFROM, fd, p, 0) }

// RawWrite: see RawRead.
func RawWrite(fd int, p []byte) (int, error) {
	return rawIO(unix.SYS_SENDTO, fd, p, unix.MSG_NOSIGNAL)
}

// rawIO makes the raw system call trap(fd, p, len(p), flags, NULL, 0).
func rawIO(trap uintptr, fd int, p []byte, flags uintptr) (int, error) {
	var ptr unsafe.Pointer
	if len(p) > 0 {
		ptr = unsafe.Pointer(&p[0])
	}
	n, _, e := unix.RawSyscall6(trap, uintptr(fd), uintptr(ptr), uintptr(len(p)), flags, 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(n), nil
}
