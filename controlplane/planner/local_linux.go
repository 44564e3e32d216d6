package planner

import (
	"os/exec"
	"syscall"
)

// setDeathSignal sends the worker SIGTERM when its parent dies, so that a crashed
// `kvrelay up` leaves no workers behind. (Linux ties it to the thread that started the
// process; the Go runtime only ends threads whose goroutine locked them, which this
// package never does.)
func setDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
}
