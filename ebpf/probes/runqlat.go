package probes

import (
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// RunQLat is the runqlat object: tp_btf programs on sched_wakeup, sched_wakeup_new and
// sched_switch that time how long the threads of watched processes wait to run.
//
// The programs run on every context switch of the machine, watched processes or not, so they
// are attached only while there is a process to watch (SetPIDs): a proxy that watches none
// (its engines run elsewhere) pays nothing for them.
type RunQLat struct {
	objs  runqlatObjects
	links []link.Link // nil while detached

	mu    sync.Mutex
	slots [MaxPIDs]uint32 // slot → the process it watches (0: free)
}

// AttachRunQLat loads runqlat and attaches its three tracing programs, which proves that they
// can attach; they stay detached until SetPIDs gives them a process to watch.
func AttachRunQLat() (*RunQLat, error) {
	removeMemlock()
	p := &RunQLat{}
	if err := loadRunqlatObjects(&p.objs, nil); err != nil {
		return nil, loadErr("runqlat", err)
	}
	if err := p.attach(); err != nil {
		_ = p.Close()
		return nil, err
	}
	p.detach()
	return p, nil
}

// Attached says whether the programs are attached (there are processes to watch).
func (p *RunQLat) Attached() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.links != nil
}

func (p *RunQLat) attach() error {
	if p.links != nil {
		return nil
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return fmt.Errorf("reading the clock: %w", err)
	}
	if err := p.objs.Since.Set(uint64(ts.Nano())); err != nil {
		return fmt.Errorf("setting runqlat's start: %w", err)
	}
	var links []link.Link
	for _, prog := range []struct {
		name string
		p    *ebpf.Program
	}{{"sched_wakeup", p.objs.KvrelayWakeup}, {"sched_wakeup_new", p.objs.KvrelayWakeupNew}, {"sched_switch", p.objs.KvrelaySwitch}} {
		l, err := link.AttachTracing(link.TracingOptions{Program: prog.p})
		if err != nil {
			for _, l := range links {
				_ = l.Close()
			}
			return fmt.Errorf("attaching tp_btf/%s: %w", prog.name, err)
		}
		links = append(links, l)
	}
	p.links = links
	return nil
}

func (p *RunQLat) detach() {
	for _, l := range p.links {
		_ = l.Close()
	}
	p.links = nil
}

// MaxPIDs is how many processes one RunQLat watches.
const MaxPIDs = 16

// SetPIDs makes the probe watch exactly the processes (thread group ids) in pids, at most
// MaxPIDs (zeros are skipped). A process keeps its slot, and so its histogram, while it is
// watched; a freed slot's histogram is zeroed before another process gets it.
func (p *RunQLat) SetPIDs(pids []uint32) error {
	want := map[uint32]bool{}
	for _, pid := range pids {
		if pid != 0 {
			want[pid] = true
		}
	}
	if len(want) > MaxPIDs {
		return fmt.Errorf("watching %d processes: at most %d", len(want), MaxPIDs)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	slots := p.slots
	var freed []int
	for i, pid := range slots {
		if pid != 0 && !want[pid] {
			slots[i] = 0
			freed = append(freed, i)
		}
		delete(want, pid)
	}
	// The departed leave first, so that no histogram is zeroed while its process still counts.
	if err := p.write(slots); err != nil {
		return err
	}
	for _, i := range freed {
		if err := p.objs.Hists.Put(uint32(i), &Hist{}); err != nil {
			return fmt.Errorf("clearing run-queue slot %d: %w", i, err)
		}
	}
	news := slices.Sorted(maps.Keys(want))
	for i := range slots {
		if slots[i] == 0 && len(news) > 0 {
			slots[i], news = news[0], news[1:]
		}
	}
	return p.write(slots)
}

// write stores slots in the kernel and remembers them.
func (p *RunQLat) write(slots [MaxPIDs]uint32) error {
	n := used(slots)
	if n > 0 {
		// Attached first: a failure changes nothing.
		if err := p.attach(); err != nil {
			return err
		}
	}
	// A growing range is published after the slots it covers, a shrinking one before.
	if n < used(p.slots) {
		if err := p.objs.Nslots.Set(n); err != nil {
			return fmt.Errorf("watching pids: %w", err)
		}
	}
	if err := p.objs.WatchedTgids.Set(slots); err != nil {
		return fmt.Errorf("watching pids %v: %w", slots, err)
	}
	if err := p.objs.Nslots.Set(n); err != nil {
		return fmt.Errorf("watching pids: %w", err)
	}
	p.slots = slots
	if n == 0 {
		p.detach()
	}
	return nil
}

// used is how many slots the kernel compares: up to the last one in use.
func used(slots [MaxPIDs]uint32) uint32 {
	n := uint32(0)
	for i, pid := range slots {
		if pid != 0 {
			n = uint32(i) + 1
		}
	}
	return n
}

// Read returns the run-queue latency histogram per watched process since it was last given a
// slot (a process that leaves and comes back starts from zero).
func (p *RunQLat) Read() (map[uint32]*Hist, error) {
	// Held throughout, so that no slot changes hands between naming its process and reading it.
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[uint32]*Hist{}
	for i, pid := range p.slots {
		if pid == 0 {
			continue
		}
		h := &Hist{}
		if err := p.objs.Hists.Lookup(uint32(i), h); err != nil {
			return nil, fmt.Errorf("reading run-queue histogram of pid %d: %w", pid, err)
		}
		out[pid] = h
	}
	return out, nil
}

// Close detaches and unloads the probe.
func (p *RunQLat) Close() error {
	p.mu.Lock()
	p.detach()
	p.mu.Unlock()
	return p.objs.Close()
}
