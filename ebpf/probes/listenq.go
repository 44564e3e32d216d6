package probes

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net/netip"

	"github.com/cilium/ebpf/link"
)

// Listener is one listening TCP socket as the iterator saw it.
type Listener struct {
	// Addr is the bound address: an IPv4 address, or the unspecified IPv6 address for any
	// IPv6 listener (the iterator does not copy IPv6 addresses).
	Addr       netip.AddrPort
	Backlog    uint32 // connections waiting in the accept queue
	MaxBacklog uint32 // the queue's limit (listen's backlog, capped by somaxconn)
}

// listenRecord mirrors listenq.c's struct kvrelay_listener.
type listenRecord struct {
	Addr       uint32
	Port       uint16
	Family     uint16
	Backlog    uint32
	MaxBacklog uint32
}

// ListenQ is the listenq object: a bpf_iter/tcp program that reports every TCP listener's
// accept queue on each Sample.
type ListenQ struct {
	objs listenqObjects
	iter *link.Iter
}

// AttachListenQ loads listenq and attaches its iterator.
func AttachListenQ() (*ListenQ, error) {
	removeMemlock()
	p := &ListenQ{}
	if err := loadListenqObjects(&p.objs, nil); err != nil {
		return nil, loadErr("listenq", err)
	}
	it, err := link.AttachIter(link.IterOptions{Program: p.objs.KvrelayListenq})
	if err != nil {
		_ = p.Close()
		return nil, fmt.Errorf("attaching iter/tcp: %w", err)
	}
	p.iter = it
	// One run now, so that a kernel that attaches but cannot run the iterator fails here.
	if _, err := p.Sample(); err != nil {
		_ = p.Close()
		return nil, err
	}
	return p, nil
}

// Sample runs the iterator once and returns every TCP listener of this network namespace.
func (p *ListenQ) Sample() ([]Listener, error) {
	r, err := p.iter.Open()
	if err != nil {
		return nil, fmt.Errorf("running iter/tcp: %w", err)
	}
	defer r.Close()
	b, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("reading iter/tcp: %w", err)
	}
	var rec listenRecord
	size := binary.Size(rec)
	out := make([]Listener, 0, len(b)/size)
	rd := bytes.NewReader(b)
	for rd.Len() >= size {
		if err := binary.Read(rd, binary.NativeEndian, &rec); err != nil {
			return nil, fmt.Errorf("decoding iter/tcp: %w", err)
		}
		l := Listener{Backlog: rec.Backlog, MaxBacklog: rec.MaxBacklog}
		if rec.Family == 2 {
			l.Addr = addrPort(rec.Addr, rec.Port)
		} else {
			l.Addr = netip.AddrPortFrom(netip.IPv6Unspecified(), rec.Port)
		}
		out = append(out, l)
	}
	return out, nil
}

// Close detaches and unloads the probe.
func (p *ListenQ) Close() error {
	if p.iter != nil {
		_ = p.iter.Close()
	}
	return p.objs.Close()
}
