package probes

import (
	"errors"
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

// SetPIDs makes the probe watch exactly the processes (thread group ids) in pids.
func (p *RunQLat) SetPIDs(pids []uint32) error {
	want := map[uint32]bool{}
	for _, pid := range pids {
		want[pid] = true
	}
	var (
		k    uint32
		v    uint8
		drop []uint32
	)
	it := p.objs.Pids.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			drop = append(drop, k)
		}
		delete(want, k)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("reading watched pids: %w", err)
	}
	for _, k := range drop {
		if err := p.objs.Pids.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("unwatching pid %d: %w", k, err)
		}
	}
	for k := range want {
		if err := p.objs.Pids.Put(k, uint8(1)); err != nil {
			return fmt.Errorf("watching pid %d: %w", k, err)
		}
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
