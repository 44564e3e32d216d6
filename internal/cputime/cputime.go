// Package cputime reads the CPU time this process has used, for benchmarks that report CPU
// beside wall time.
package cputime

import (
	"syscall"
	"time"
)

// Self is the process's user plus system CPU time so far (0 where the system does not say).
func Self() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
