package nixl

import "context"

// tcpBackend carries transfers over the persistent connection to the peer: requests and
// data frames multiplexed by id, payload written with vectored writes from registered
// memory and read straight into registered memory. The connections belong to the agent,
// because they also carry metadata requests and notifications for every backend.
type tcpBackend struct {
	a *Agent
}

func newTCPBackend(a *Agent) (Backend, error) { return &tcpBackend{a: a}, nil }

// Kind returns BackendTCP.
func (b *tcpBackend) Kind() BackendKind { return BackendTCP }

// Info returns the advertised host:port.
func (b *tcpBackend) Info() []byte { return []byte(b.a.advertise) }

// CanCarry accepts host memory on this side with a peer that publishes a TCP address or
// is already connected.
func (b *tcpBackend) CanCarry(req *Request) bool {
	for _, s := range req.Local {
		if s.Region.buf == nil {
			return false
		}
	}
	return true
}

// Transfer runs req over the connection to the peer, dialing it if needed.
func (b *tcpBackend) Transfer(ctx context.Context, req *Request) error {
	c, err := b.a.peerConn(ctx, req.Peer)
	if err != nil {
		return err
	}
	segs := make([]wireSeg, len(req.Remote))
	for i, s := range req.Remote {
		segs[i] = wireSeg{region: s.Region.ID, off: s.Off, len: s.Len}
	}
	mem := make([][]byte, len(req.Local))
	for i, s := range req.Local {
		mem[i] = s.Bytes()
	}
	if req.Op == Write {
		return c.write(ctx, segs, mem, req.Total, req.Notif)
	}
	if err := c.read(ctx, segs, mem, req.Total); err != nil {
		return err
	}
	if len(req.Notif) > 0 {
		// The peer learns its memory was read only once all of it arrived here.
		return c.notify(ctx, req.Notif)
	}
	return nil
}

// ForgetPeer does nothing: the agent closes the peer's connections itself.
func (b *tcpBackend) ForgetPeer(string) {}

// Close does nothing: the agent closes the connections itself.
func (b *tcpBackend) Close() error { return nil }

var _ Backend = (*tcpBackend)(nil)
