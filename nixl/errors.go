package nixl

import (
	"errors"
	"fmt"
	"strconv"
)

// Sentinel errors. Every error returned by this package that stems from one of these
// conditions wraps the matching sentinel, so callers test with errors.Is.
var (
	// ErrClosed is returned by every call on an agent after Close, and by transfers that
	// were still running when it closed.
	ErrClosed = errors.New("nixl: agent closed")
	// ErrUnknownAgent is returned when a remote agent's metadata has not been loaded (or
	// was invalidated) on this agent.
	ErrUnknownAgent = errors.New("nixl: unknown remote agent")
	// ErrUnknownRegion is returned when a descriptor does not fall inside any registered
	// region of the right memory type and device, or a region id is not registered.
	ErrUnknownRegion = errors.New("nixl: descriptor outside every registered region")
	// ErrOutOfRange is returned when a descriptor starts inside a registered region but
	// runs past its end, or a block id lies beyond the region.
	ErrOutOfRange = errors.New("nixl: descriptor out of range of its region")
	// ErrLengthMismatch is returned when the local and remote descriptor lists of a transfer
	// differ in count or in the length of a pair of descriptors.
	ErrLengthMismatch = errors.New("nixl: local and remote descriptor lists do not match")
	// ErrInvalidDesc is returned for descriptors that can never be valid: zero length or an
	// address range that overflows.
	ErrInvalidDesc = errors.New("nixl: invalid descriptor")
	// ErrDeviceMemoryUnavailable is returned when device (VRAM) memory is registered or
	// addressed: this package moves host memory only (device.go is where device support
	// would go).
	ErrDeviceMemoryUnavailable = errors.New("nixl: device (VRAM) memory is not supported: this nixl moves host memory only; register host memory and stage device data through it")
	// ErrOverlap is returned when a region being registered overlaps a registered one.
	ErrOverlap = errors.New("nixl: region overlaps a registered region")
	// ErrRegionInUse is returned by HostMem.Free while the memory is still registered.
	ErrRegionInUse = errors.New("nixl: memory is still registered")
	// ErrNoBackend is returned when no backend shared by both agents can carry a transfer.
	ErrNoBackend = errors.New("nixl: no common backend can carry the transfer")
	// ErrBackendUnavailable is returned by a backend that cannot serve a transfer after all
	// (for example shared memory across containers); the agent then tries the next backend.
	// A backend returns it only before any byte has moved.
	ErrBackendUnavailable = errors.New("nixl: backend unavailable for this peer")
	// ErrPeerGone is returned by transfers whose connection to the peer was lost.
	ErrPeerGone = errors.New("nixl: connection to peer lost")
	// ErrTimeout is returned by transfers that ran past their timeout. Such errors also
	// match context.DeadlineExceeded.
	ErrTimeout = errors.New("nixl: transfer timed out")
	// ErrBusy is returned by Post while the transfer is still in progress.
	ErrBusy = errors.New("nixl: transfer already in progress")
	// ErrNotPosted is returned by Wait on a transfer that was never posted.
	ErrNotPosted = errors.New("nixl: transfer not posted")
	// ErrReleased is returned by Post after Release.
	ErrReleased = errors.New("nixl: transfer released")
	// ErrRemote is wrapped by *RemoteError: the peer rejected a request.
	ErrRemote = errors.New("nixl: rejected by peer")
	// ErrProtocol is returned for malformed frames or handshakes on a connection.
	ErrProtocol = errors.New("nixl: protocol error")
	// ErrBadMetadata is returned by the metadata decoder for malformed input.
	ErrBadMetadata = errors.New("nixl: malformed metadata")
	// ErrStaleMetadata is returned when a peer reached at the address in its loaded
	// metadata is a different instance (it restarted): its regions may have changed, so
	// nothing is sent until its metadata is loaded again (Connect does this itself).
	ErrStaleMetadata = errors.New("nixl: peer restarted since its metadata was loaded")
	// ErrNameConflict is returned when remote metadata carries this agent's own name, or
	// a connecting peer announces a name that differs from the one expected.
	ErrNameConflict = errors.New("nixl: agent name conflict")
	// ErrInvalidConfig is returned by Config.Validate and NewAgent for bad settings.
	ErrInvalidConfig = errors.New("nixl: invalid config")
)

// Side tells which descriptor list a DescError refers to.
type Side uint8

const (
	// LocalSide is the initiator's own descriptor list.
	LocalSide Side = iota
	// RemoteSide is the descriptor list addressing the remote agent.
	RemoteSide
)

// String returns "local" or "remote".
func (s Side) String() string {
	if s == LocalSide {
		return "local"
	}
	return "remote"
}

// DescError reports a rejected descriptor: which list, which index, and why (Err is one
// of the sentinel errors above, so errors.Is(err, ErrOutOfRange) works through it).
type DescError struct {
	Side  Side
	Index int
	Desc  Desc
	Err   error
}

// Error implements error.
func (e *DescError) Error() string {
	return "nixl: " + e.Side.String() + " descriptor " + strconv.Itoa(e.Index) + " " + e.Desc.String() + ": " + e.Err.Error()
}

// Unwrap returns the sentinel cause.
func (e *DescError) Unwrap() error { return e.Err }

// Error codes carried in ERROR frames. A peer maps the code back to the sentinel so that a
// rejection on the remote side reads like one on the local side.
const (
	codeInternal      uint16 = 1
	codeUnknownRegion uint16 = 2
	codeOutOfRange    uint16 = 3
	codeProtocol      uint16 = 4
	codeClosed        uint16 = 5
	codeDevice        uint16 = 6
	codeNameConflict  uint16 = 7
)

// RemoteError is a rejection received from the peer: Code says what kind, Msg is the
// peer's description. It wraps ErrRemote and, where the code maps to one, the matching
// sentinel (ErrUnknownRegion, ErrOutOfRange, ...).
type RemoteError struct {
	Peer string
	Code uint16
	Msg  string
}

// Error implements error.
func (e *RemoteError) Error() string {
	return fmt.Sprintf("nixl: rejected by peer %q (code %d): %s", e.Peer, e.Code, e.Msg)
}

// Unwrap lets errors.Is match both ErrRemote and the sentinel the code stands for.
func (e *RemoteError) Unwrap() []error {
	errs := []error{ErrRemote}
	if s := codeSentinel(e.Code); s != nil {
		errs = append(errs, s)
	}
	return errs
}

func codeSentinel(code uint16) error {
	switch code {
	case codeUnknownRegion:
		return ErrUnknownRegion
	case codeOutOfRange:
		return ErrOutOfRange
	case codeProtocol:
		return ErrProtocol
	case codeClosed:
		return ErrClosed
	case codeDevice:
		return ErrDeviceMemoryUnavailable
	case codeNameConflict:
		return ErrNameConflict
	}
	return nil
}

func errorCode(err error) uint16 {
	switch {
	case errors.Is(err, ErrUnknownRegion):
		return codeUnknownRegion
	case errors.Is(err, ErrOutOfRange):
		return codeOutOfRange
	case errors.Is(err, ErrProtocol):
		return codeProtocol
	case errors.Is(err, ErrClosed):
		return codeClosed
	case errors.Is(err, ErrDeviceMemoryUnavailable):
		return codeDevice
	case errors.Is(err, ErrNameConflict):
		return codeNameConflict
	}
	return codeInternal
}
