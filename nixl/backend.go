package nixl

import (
	"context"
)

// BackendKind names a transport. It is the key of the backend's entry in metadata, so two
// agents share a backend when both list the same kind.
type BackendKind string

const (
	// BackendTCP moves bytes over the agents' persistent TCP connection. It is always on:
	// the same connection carries metadata requests and notifications.
	BackendTCP BackendKind = "tcp"
	// BackendSHM copies bytes directly between this process and a same-host peer's shared
	// memory (regions registered from HostMem), mapped into both processes.
	BackendSHM BackendKind = "shm"
)

// Backend moves the bytes of prepared transfers. An agent builds its backends in NewAgent
// (from Config.Backends, in that order of preference), publishes each one's Info in its
// metadata, and for every posted transfer calls CanCarry on each backend in order and
// Transfer on the first that accepts. Transfer is called from the goroutine running the
// transfer, for many transfers at once; ForgetPeer and Close may run concurrently with it.
//
// A binding to another transport (for example the NIXL library itself, behind a build tag)
// implements this interface and adds its kind to backendFactories; callers of Agent do
// not change.
type Backend interface {
	// Kind names the backend.
	Kind() BackendKind
	// Info returns the connection info published in the local metadata.
	Info() []byte
	// CanCarry reports, without moving bytes or blocking on the network, whether this
	// backend can carry req to its peer (both sides speak it, memory types fit).
	CanCarry(req *Request) bool
	// Transfer moves the bytes of req and then delivers req.Notif to the peer (if any).
	// It returns nil when all bytes have moved, or an error: ErrBackendUnavailable when
	// it found it could not serve the peer before any byte moved (the agent then tries the
	// next backend), context.Cause(ctx) when ctx ended first, or another error. Once it
	// returns, the backend no longer touches req's local memory.
	Transfer(ctx context.Context, req *Request) error
	// ForgetPeer drops what the backend holds for the named peer (connections, mappings),
	// waiting for transfers that use it to finish. The agent calls it from
	// InvalidateRemoteMD.
	ForgetPeer(name string)
	// Close releases the backend. The agent calls it once, from Close, after in-flight
	// transfers have ended.
	Close() error
}

// backendFactories builds the backends an agent may use, by kind. The order of use comes
// from Config.Backends.
var backendFactories = map[BackendKind]func(a *Agent) (Backend, error){
	BackendTCP: newTCPBackend,
	BackendSHM: newSHMBackend,
}

// Op is the direction of a transfer, seen from the initiator.
type Op uint8

const (
	// Read copies remote memory into local memory.
	Read Op = iota + 1
	// Write copies local memory into remote memory.
	Write
)

// String returns "READ" or "WRITE".
func (o Op) String() string {
	switch o {
	case Read:
		return "READ"
	case Write:
		return "WRITE"
	}
	return "Op(?)"
}

// Request is one transfer as a backend sees it: validated, with every descriptor resolved
// to a region and an offset. Local[i] pairs with Remote[i] and has the same length.
// Backends must not modify it.
type Request struct {
	Op     Op
	Peer   string    // remote agent name
	PeerMD *Metadata // remote agent's metadata as loaded
	Local  []Segment
	Remote []RemoteSegment
	Notif  []byte // delivered to the peer after the bytes moved; empty for none
	Total  uint64 // sum of the lengths
}

// Segment is a resolved local descriptor: Len bytes at Off within Region.
type Segment struct {
	Region *Region
	Off    uint64
	Len    uint64
}

// Bytes returns the segment's host memory.
func (s Segment) Bytes() []byte { return s.Region.slice(s.Off, s.Len) }

// RemoteSegment is a resolved remote descriptor: Len bytes at Off within the peer's
// region.
type RemoteSegment struct {
	Region RegionDesc
	Off    uint64
	Len    uint64
}
