package probes

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// FirstByte is the firstbyte object: cgroup_skb egress and ingress programs on a cgroup that
// time each request on a connection to a watched endpoint from its last byte sent to the
// first byte of the answer.
type FirstByte struct {
	objs            firstbyteObjects
	egress, ingress link.Link

	mu    sync.Mutex
	slots slotTable
	// After a failed write to the kernel, every slot's generation is written again next time,
	// and the slots still to be zeroed are remembered.
	stale   bool
	toClear map[uint32]bool
}

// AttachFirstByte loads firstbyte and attaches it to the cgroup v2 at cgroupPath.
func AttachFirstByte(cgroupPath string) (*FirstByte, error) {
	removeMemlock()
	p := &FirstByte{}
	if err := loadFirstbyteObjects(&p.objs, nil); err != nil {
		return nil, loadErr("firstbyte", err)
	}
	var err error
	if p.egress, err = attachCgroup(cgroupPath, ebpf.AttachCGroupInetEgress, p.objs.KvrelayFbEgress); err != nil {
		_ = p.Close()
		return nil, err
	}
	if p.ingress, err = attachCgroup(cgroupPath, ebpf.AttachCGroupInetIngress, p.objs.KvrelayFbIngress); err != nil {
		_ = p.Close()
		return nil, err
	}
	return p, nil
}

// MoveTo attaches the programs to the cgroup v2 at path and then detaches them from the one
// they were on (the maps, and with them the histograms and stamps, stay).
func (p *FirstByte) MoveTo(path string) error {
	e, err := attachCgroup(path, ebpf.AttachCGroupInetEgress, p.objs.KvrelayFbEgress)
	if err != nil {
		return err
	}
	i, err := attachCgroup(path, ebpf.AttachCGroupInetIngress, p.objs.KvrelayFbIngress)
	if err != nil {
		_ = e.Close()
		return err
	}
	oldE, oldI := p.egress, p.ingress
	p.egress, p.ingress = e, i
	return closeAll(oldE, oldI)
}

// SetTargets makes the probe watch exactly the connections to eps (IPv4; others ignored; at
// most MaxSlots).
func (p *FirstByte) SetTargets(eps []netip.AddrPort) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	changes, serr := p.slots.set(eps)
	if p.toClear == nil {
		p.toClear = map[uint32]bool{}
	}
	for _, c := range changes {
		if c.zero {
			p.toClear[c.idx] = true
		}
	}
	if p.stale {
		changes = make([]slotChange, 0, len(p.slots.gen))
		for idx, gen := range p.slots.gen {
			changes = append(changes, slotChange{idx: uint32(idx), gen: gen})
		}
	}
	// A slot's new generation is written first, so that connections remembering the old one
	// stop counting into it, then its histogram is zeroed, and only then does a target name
	// it. (A program already past the generation check may still add one observation.)
	p.stale = true
	for _, c := range changes {
		if err := p.objs.Gens.Put(c.idx, c.gen); err != nil {
			return fmt.Errorf("writing first-byte slot %d: %w", c.idx, err)
		}
		if p.toClear[c.idx] {
			if err := p.objs.Hists.Put(c.idx, &Hist{}); err != nil {
				return fmt.Errorf("clearing first-byte slot %d: %w", c.idx, err)
			}
			delete(p.toClear, c.idx)
		}
	}
	p.stale = false
	var ports [1024]uint64
	want := map[firstbyteEndpoint]firstbyteSlot{}
	for ep := range p.slots.live {
		k, err := endpointKey(ep)
		if err != nil {
			continue
		}
		ports[ep.Port()>>6] |= 1 << (ep.Port() & 63)
		idx := p.slots.of[ep]
		want[firstbyteEndpoint(k)] = firstbyteSlot{Idx: idx, Gen: p.slots.gen[idx]}
	}
	if err := p.objs.Ports.Put(uint32(0), &ports); err != nil {
		return fmt.Errorf("watching ports: %w", err)
	}
	if err := syncMap(p.objs.Targets, want); err != nil {
		return fmt.Errorf("watching first-byte endpoints: %w", err)
	}
	return serr
}

// Read returns the first-byte histogram per endpoint since it was first watched (endpoints
// no longer watched included, until their slot goes to another).
func (p *FirstByte) Read() (map[netip.AddrPort]*Hist, error) {
	// Held throughout, so that no slot changes hands between naming its owner and reading it.
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[netip.AddrPort]*Hist, len(p.slots.owner))
	var errs []error
	for idx, ap := range p.slots.owner {
		h := &Hist{}
		if err := p.objs.Hists.Lookup(uint32(idx), h); err != nil {
			errs = append(errs, err)
			continue
		}
		out[ap] = h
	}
	if err := errors.Join(errs...); err != nil {
		return out, fmt.Errorf("reading first-byte histograms: %w", err)
	}
	return out, nil
}

// Close detaches and unloads the probe.
func (p *FirstByte) Close() error { return closeAll(p.egress, p.ingress, &p.objs) }
