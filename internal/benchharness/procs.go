package benchharness

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is one process the harness started: its own process group, so that stopping it
// also stops whatever it started.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{}
	err  error // set when done closes
}

// exited reports whether the process has ended, and how.
func (p *proc) exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// supervisor keeps every process the harness started, so that all of them are stopped at
// the end of a run, on a failure and on Ctrl-C.
type supervisor struct {
	mu    sync.Mutex
	procs []*proc
}

var procs supervisor

// start runs bin with args, its output in dir/name.log, in a process group of its own that
// dies with the harness (Pdeathsig).
func (s *supervisor) start(dir, name string, env []string, bin string, args ...string) (*proc, error) {
	f, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(f, "# %s %s\n", bin, shellJoin(args))
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: f, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	return p, nil
}

// stopAll sends SIGTERM to every process group still running, waits up to grace, then sends
// SIGKILL to what is left, forgets them all and returns them (ended: cmd.ProcessState set).
func (s *supervisor) stopAll(grace time.Duration) []*proc {
	s.mu.Lock()
	ps := s.procs
	s.procs = nil
	s.mu.Unlock()
	for _, p := range ps {
		if done, _ := p.exited(); !done {
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		}
	}
	deadline := time.After(grace)
	for _, p := range ps {
		select {
		case <-p.done:
		case <-deadline:
		}
	}
	for _, p := range ps {
		if done, _ := p.exited(); !done {
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		}
	}
	for _, p := range ps {
		select {
		case <-p.done:
		case <-time.After(5 * time.Second):
			fmt.Fprintf(os.Stderr, "warning: %s (pid %d) did not exit after SIGKILL\n", p.name, p.cmd.Process.Pid)
		}
	}
	return ps
}

// cpuSeconds is the user and system CPU time an ended process used (its own, not that of
// children it did not wait for).
func (p *proc) cpuSeconds() float64 {
	select {
	case <-p.done:
	default:
		return 0
	}
	st := p.cmd.ProcessState
	if st == nil {
		return 0
	}
	return (st.UserTime() + st.SystemTime()).Seconds()
}

// dead returns a line for each process that has exited while it should still run.
func (s *supervisor) dead() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, p := range s.procs {
		if done, err := p.exited(); done {
			out = append(out, fmt.Sprintf("%s exited (%v); see %s", p.name, err, p.log.Name()))
		}
	}
	return out
}

// waitHTTP polls url until it answers 200, the context ends, p exits or timeout passes.
func waitHTTP(ctx context.Context, url string, p *proc, timeout time.Duration) error {
	return waitFor(ctx, p, timeout, "GET "+url, func() bool {
		resp, err := httpClient.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// waitTCP polls addr until it accepts a connection.
func waitTCP(ctx context.Context, addr string, p *proc, timeout time.Duration) error {
	return waitFor(ctx, p, timeout, "connect "+addr, func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
}

// waitFor polls ok every 100 ms.
func waitFor(ctx context.Context, p *proc, timeout time.Duration, what string, ok func() bool) error {
	deadline := time.Now().Add(timeout)
	for {
		if ok() {
			return nil
		}
		if p != nil {
			if done, err := p.exited(); done {
				return fmt.Errorf("%s exited (%v) before %s succeeded; see %s", p.name, err, what, p.log.Name())
			}
		}
		if time.Now().After(deadline) {
			name := ""
			if p != nil {
				name = fmt.Sprintf(" (see %s)", p.log.Name())
			}
			return fmt.Errorf("%s: not ready after %s%s", what, timeout, name)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// waitPortsFree waits until every port can be bound on 127.0.0.1 (the previous run's
// processes gone and their listeners closed).
func waitPortsFree(ctx context.Context, ports []int, timeout time.Duration) error {
	var busy []string
	err := waitFor(ctx, nil, timeout, "ports free", func() bool {
		busy = busy[:0]
		for _, port := range ports {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				busy = append(busy, fmt.Sprint(port))
				continue
			}
			l.Close()
		}
		return len(busy) == 0
	})
	if err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("ports still in use after %s: %s (something else on 127.0.0.1 holds them?)", timeout, strings.Join(busy, ", "))
	}
	return err
}

var httpClient = &http.Client{Timeout: 5 * time.Second}

func shellJoin(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " '\"$\\|&;<>()*?[]{}#~`!") {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		} else {
			q[i] = a
		}
	}
	return strings.Join(q, " ")
}
