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

	"github.com/kvrelay/kvrelay/ebpf/probes"
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
// collector closes (after moving the processes it moved in back where they came from);
// children left behind by a process that is gone are removed when the next one is made
// beside them.

const dialPrefix = "kvrelay-dial."

type dialScope struct {
	parent, dir string
	from        map[int]string // the processes moved in, and the cgroup each came from
}

// newDialScope makes the dial scope under parent, a cgroup v2 directory. A directory of that
// name left behind (same PID, an earlier process) is taken over if it is empty; one in use
// (another PID namespace) is an error.
func newDialScope(parent string) (*dialScope, error) {
	sweepDialScopes(parent)
	dir := filepath.Join(parent, dialPrefix+strconv.Itoa(os.Getpid()))
	err := os.Mkdir(dir, 0o755)
	if errors.Is(err, fs.ErrExist) && os.Remove(dir) == nil {
		err = os.Mkdir(dir, 0o755)
	}
	if err != nil {
		return nil, fmt.Errorf("making cgroup %s: %w", dir, err)
	}
	return &dialScope{parent: parent, dir: dir, from: map[int]string{}}, nil
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

// enter moves process pid (all its threads) into the scope, remembering where it was.
func (d *dialScope) enter(pid int) error {
	from, err := probes.CgroupV2Of(pid)
	if err != nil {
		return fmt.Errorf("finding the cgroup of process %d: %w", pid, err)
	}
	if err := moveProcess(d.dir, pid); err != nil {
		return err
	}
	d.from[pid] = from
	return nil
}

func moveProcess(dir string, pid int) error {
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
		return fmt.Errorf("moving process %d into cgroup %s: %w", pid, dir, err)
	}
	return nil
}

// close moves the processes it moved in, those still inside, back where they came from, and
// removes the scope. Sockets made inside may outlive it: the kernel frees the cgroup once
// the last of them closes.
func (d *dialScope) close() error {
	var errs []error
	for pid, from := range d.from {
		if at, err := probes.CgroupV2Of(pid); err != nil || at != d.dir {
			continue // gone, or moved elsewhere since
		}
		if err := moveProcess(from, pid); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, err)
		}
	}
	d.from = map[int]string{}
	if err := os.Remove(d.dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing cgroup %s: %w", d.dir, err))
	}
	return errors.Join(errs...)
}
