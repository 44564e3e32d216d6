package ebpf

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// The dial scope keeps the socket probes off a proxy's client connections.
//
// cgroup_skb and sock_ops programs run on every socket of the cgroup they are attached to
// (and of its descendants), and a socket belongs to the cgroup its creator was in when it
// was made; a connection accepted from a listener is a clone of the listener and keeps the
// listener's cgroup. So a process that opens its listeners, then moves into a child cgroup
// with the socket probes attached to it, has them run on the connections it dials from then
// on (to its engines) and never on the ones it accepts (from its clients). On a proxy that
// halves first_byte's runs per request: the client's request and the answer to it no longer
// pass through the programs (hack/bench-ebpf.sh measures the difference).
//
// The child is named kvrelay-dial.PID after the process that made it, and removed when the
// collector closes (after moving whatever it holds back to the parent); children left behind
// by a process that is gone are removed when the next one is made beside them.

const dialPrefix = "kvrelay-dial."

type dialScope struct {
	parent, dir string
}

// newDialScope makes the dial scope under parent, a cgroup v2 directory.
func newDialScope(parent string) (*dialScope, error) {
	sweepDialScopes(parent)
	dir := filepath.Join(parent, dialPrefix+strconv.Itoa(os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("making cgroup %s: %w", dir, err)
	}
	return &dialScope{parent: parent, dir: dir}, nil
}

// sweepDialScopes removes the dial scopes under parent whose process is gone (an rmdir,
// which the kernel refuses while a process is still inside).
func sweepDialScopes(parent string) {
	es, err := os.ReadDir(parent)
	if err != nil {
		return
	}
	for _, e := range es {
		rest, ok := strings.CutPrefix(e.Name(), dialPrefix)
		if !ok || !e.IsDir() {
			continue
		}
		pid, err := strconv.Atoi(rest)
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			_ = os.Remove(filepath.Join(parent, e.Name()))
		}
	}
}

// enter moves process pid (all its threads) into the scope.
func (d *dialScope) enter(pid int) error { return moveProcess(d.dir, pid) }

func moveProcess(dir string, pid int) error {
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		return fmt.Errorf("moving process %d into cgroup %s: %w", pid, dir, err)
	}
	return nil
}

// close moves the processes still in the scope back to its parent and removes it. Sockets
// made inside may outlive it: the kernel frees the cgroup once the last of them closes.
func (d *dialScope) close() error {
	var errs []error
	if b, err := os.ReadFile(filepath.Join(d.dir, "cgroup.procs")); err == nil {
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				if err := moveProcess(d.parent, pid); err != nil && !errors.Is(err, syscall.ESRCH) {
					errs = append(errs, err)
				}
			}
		}
	}
	if err := os.Remove(d.dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing cgroup %s: %w", d.dir, err))
	}
	return errors.Join(errs...)
}
