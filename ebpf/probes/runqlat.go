package probes

import (
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// RunQLat is the runqlat object: tp_btf programs on sched_wakeup, sched_wakeup_new and
// sched_switch that time how long the threads of watched processes wait to run.
type RunQLat struct {
	objs  runqlatObjects
	links []link.Link
}

// AttachRunQLat loads runqlat and attaches its three tracing programs.
func AttachRunQLat() (*RunQLat, error) {
	removeMemlock()
	p := &RunQLat{}
	if err := loadRunqlatObjects(&p.objs, nil); err != nil {
		return nil, loadErr("runqlat", err)
	}
	for _, prog := range []struct {
		name string
		p    *ebpf.Program
	}{{"sched_wakeup", p.objs.KvrelayWakeup}, {"sched_wakeup_new", p.objs.KvrelayWakeupNew}, {"sched_switch", p.objs.KvrelaySwitch}} {
		l, err := link.AttachTracing(link.TracingOptions{Program: prog.p})
		if err != nil {
			_ = p.Close()
			return nil, fmt.Errorf("attaching tp_btf/%s: %w", prog.name, err)
		}
		p.links = append(p.links, l)
	}
	return p, nil
}

// MaxPIDs is how many processes one RunQLat watches.
const MaxPIDs = 16

// SetPIDs makes the probe watch exactly the processes (thread group ids) in pids, at most
// MaxPIDs (zeros are skipped).
func (p *RunQLat) SetPIDs(pids []uint32) error {
	// Packed at the front: the program stops at the first empty slot.
	var slots [MaxPIDs]uint32
	n := 0
	for _, pid := range pids {
		if pid == 0 {
			continue
		}
		if n == MaxPIDs {
			return fmt.Errorf("watching %d processes: at most %d", len(pids), MaxPIDs)
		}
		slots[n] = pid
		n++
	}
	if err := p.objs.WatchedTgids.Set(slots); err != nil {
		return fmt.Errorf("watching pids %v: %w", pids, err)
	}
	return nil
}

// Read returns the run-queue latency histogram per watched process since attach.
func (p *RunQLat) Read() (map[uint32]*Hist, error) {
	out := map[uint32]*Hist{}
	var (
		k uint32
		v Hist
	)
	it := p.objs.Hists.Iterate()
	for it.Next(&k, &v) {
		h := v
		out[k] = &h
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("reading runqlat histograms: %w", err)
	}
	return out, nil
}

// Close detaches and unloads the probe.
func (p *RunQLat) Close() error {
	for _, l := range p.links {
		_ = l.Close()
	}
	return p.objs.Close()
}
