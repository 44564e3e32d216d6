package probes

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// FirstByte is the firstbyte object: cgroup_skb egress and ingress programs on a cgroup that
// time each request on a connection to a watched endpoint from its last byte sent to the
// first byte of the answer.
type FirstByte struct {
	objs            firstbyteObjects
	egress, ingress link.Link
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

// SetTargets makes the probe watch exactly the connections to eps (IPv4; others ignored).
func (p *FirstByte) SetTargets(eps []netip.AddrPort) error {
	var ports [1024]uint64
	for _, ep := range eps {
		ports[ep.Port()>>6] |= 1 << (ep.Port() & 63)
	}
	// Ports first when adding, last when removing, so the bitmap never hides a target.
	if err := p.objs.Ports.Put(uint32(0), &ports); err != nil {
		return fmt.Errorf("watching ports: %w", err)
	}
	return setTargets(p.objs.Targets, eps)
}

// Read returns the first-byte histogram per endpoint since attach.
func (p *FirstByte) Read() (map[netip.AddrPort]*Hist, error) {
	out := map[netip.AddrPort]*Hist{}
	var (
		k firstbyteHistKey
		v Hist
	)
	it := p.objs.Hists.Iterate()
	for it.Next(&k, &v) {
		if k.Kind != kindFirstByte {
			continue
		}
		ap := addrPort(k.Ep.Addr, k.Ep.Port)
		if out[ap] == nil {
			out[ap] = &Hist{}
		}
		out[ap].Add(&v)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("reading firstbyte histograms: %w", err)
	}
	return out, nil
}

// Close detaches and unloads the probe.
func (p *FirstByte) Close() error { return closeAll(p.egress, p.ingress, &p.objs) }
