package probes

import (
	"errors"
	"fmt"
	"io"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Histogram kinds of the kernel's struct hist_key.
const (
	kindSRTT      = 0
	kindConnect   = 1
	kindFirstByte = 2
)

// ConnStats is what the kernel has seen of the connections to one endpoint.
type ConnStats struct {
	SRTT        Hist // smoothed RTT samples
	Connect     Hist // SYN_SENT → ESTABLISHED
	Retransmits uint64
	Resets      uint64 // aborts: ESTABLISHED, CLOSE_WAIT or SYN_SENT straight to CLOSE
	Connects    uint64
}

// TCPConn is the tcpconn object: a sock_ops program on a cgroup (RTT, retransmits) and a
// tp_btf program on inet_sock_set_state (connect latency, resets). Either part may fail to
// attach on its own; SockOps and SetState say which are on.
type TCPConn struct {
	objs     tcpconnObjects
	sockops  link.Link
	setState link.Link
	// arm is the iterator that re-arms each followed connection's RTT callback (Arm); nil
	// where it did not attach or run, and then the callback stays on and the program records
	// one sample in eight.
	arm *link.Iter
	// SockOpsErr and SetStateErr say why a part did not attach (nil when it did); ArmErr why
	// the RTT callback is sampled one in eight rather than armed once per Arm.
	SockOpsErr, SetStateErr, ArmErr error
}

// AttachTCPConn loads tcpconn and attaches its sock_ops program to the cgroup v2 at
// cgroupPath and its tracing program to inet_sock_set_state. It fails only when nothing
// attached.
func AttachTCPConn(cgroupPath string) (*TCPConn, error) { return attachTCPConn(cgroupPath, true) }

// attachTCPConn is AttachTCPConn; without rearm it leaves the iterator out, as on a kernel
// where it cannot run (tests of that fallback).
func attachTCPConn(cgroupPath string, rearm bool) (*TCPConn, error) {
	removeMemlock()
	p := &TCPConn{}
	if err := loadTcpconnObjects(&p.objs, nil); err != nil {
		return nil, loadErr("tcpconn", err)
	}
	p.sockops, p.SockOpsErr = attachCgroup(cgroupPath, ebpf.AttachCGroupSockOps, p.objs.KvrelaySockops)
	switch {
	case p.sockops != nil && rearm:
		p.ArmErr = p.attachArm()
	case p.sockops != nil:
		p.ArmErr = errors.New("RTT callback re-arming left out")
	}
	l, err := link.AttachTracing(link.TracingOptions{Program: p.objs.KvrelaySetState})
	if err != nil {
		p.SetStateErr = fmt.Errorf("attaching tp_btf/inet_sock_set_state: %w", err)
	} else {
		p.setState = l
	}
	if p.sockops == nil && p.setState == nil {
		_ = p.Close()
		return nil, fmt.Errorf("%w; %w", p.SockOpsErr, p.SetStateErr)
	}
	return p, nil
}

// attachArm attaches the re-arming iterator, runs it once, and only then has the sock_ops
// program disarm the RTT callback after each sample.
func (p *TCPConn) attachArm() error {
	it, err := link.AttachIter(link.IterOptions{Program: p.objs.KvrelayRttArm})
	if err != nil {
		return fmt.Errorf("attaching iter/tcp (RTT callback re-arming): %w", err)
	}
	p.arm = it
	err = p.Arm()
	if err == nil {
		if err = p.objs.Rearm.Set(uint32(1)); err != nil {
			err = fmt.Errorf("turning on RTT callback re-arming: %w", err)
		}
	}
	if err != nil {
		_ = it.Close()
		p.arm = nil
	}
	return err
}

// Arm turns the RTT callback on again on every connection the probe follows whose last
// sample has been recorded, so that each gives one srtt sample per call (the collector calls
// it once a second) rather than one per ACK. A no-op where the iterator is missing.
func (p *TCPConn) Arm() error {
	if p.arm == nil {
		return nil
	}
	r, err := p.arm.Open()
	if err != nil {
		return fmt.Errorf("running iter/tcp (RTT callback re-arming): %w", err)
	}
	defer r.Close()
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fmt.Errorf("running iter/tcp (RTT callback re-arming): %w", err)
	}
	return nil
}

// SetTargets makes the probe watch exactly the connections to eps (IPv4; others ignored).
func (p *TCPConn) SetTargets(eps []netip.AddrPort) error { return setTargets(p.objs.Targets, eps) }

// Read returns the totals per endpoint since attach.
func (p *TCPConn) Read() (map[netip.AddrPort]*ConnStats, error) {
	out := map[netip.AddrPort]*ConnStats{}
	get := func(ap netip.AddrPort) *ConnStats {
		s := out[ap]
		if s == nil {
			s = &ConnStats{}
			out[ap] = s
		}
		return s
	}
	var (
		hk tcpconnHistKey
		hv Hist
	)
	it := p.objs.Hists.Iterate()
	for it.Next(&hk, &hv) {
		s := get(addrPort(hk.Ep.Addr, hk.Ep.Port))
		switch hk.Kind {
		case kindSRTT:
			s.SRTT.Add(&hv)
		case kindConnect:
			s.Connect.Add(&hv)
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("reading tcpconn histograms: %w", err)
	}
	var (
		ck tcpconnEndpoint
		cv tcpconnConnCounters
	)
	ci := p.objs.Counters.Iterate()
	for ci.Next(&ck, &cv) {
		s := get(addrPort(ck.Addr, ck.Port))
		s.Retransmits += cv.Retransmits
		s.Resets += cv.Resets
		s.Connects += cv.Connects
	}
	if err := ci.Err(); err != nil {
		return nil, fmt.Errorf("reading tcpconn counters: %w", err)
	}
	return out, nil
}

// MoveTo attaches the sock_ops program to the cgroup v2 at path and then detaches it from the
// one it was on. Connections it already follows keep their callbacks and stay followed.
func (p *TCPConn) MoveTo(path string) error {
	if p.sockops == nil {
		return nil
	}
	l, err := attachCgroup(path, ebpf.AttachCGroupSockOps, p.objs.KvrelaySockops)
	if err != nil {
		return err
	}
	old := p.sockops
	p.sockops = l
	return old.Close()
}

// SockOps and SetState say which parts are attached.
func (p *TCPConn) SockOps() bool  { return p.sockops != nil }
func (p *TCPConn) SetState() bool { return p.setState != nil }

// Close detaches and unloads the probe.
func (p *TCPConn) Close() error {
	if p.arm != nil {
		_ = p.arm.Close()
	}
	return closeAll(p.sockops, p.setState, &p.objs)
}
