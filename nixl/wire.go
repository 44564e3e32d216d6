package nixl

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Wire protocol of the TCP connection between two agents. Every frame starts with a fixed
// 16-byte header, little-endian:
//
//	0  u32 body length (bytes after the header)
//	4  u8  frame type
//	5  u8  flags (flagLast on the final data frame of a transfer)
//	6  u16 reserved, zero
//	8  u64 request id (chosen by the side that starts the request)
//
// There is no checksum (TCP has one); instead every length is checked against the frame
// type's limit and, for data, against what the request announced. A connection is
// symmetric: either agent may start requests on it, and request ids are scoped to the side
// that started them, which the frame type tells apart (RDATA answers our READ, WDATA feeds
// the peer's WRITE, and so on).
const (
	hdrSize      = 16
	protoVersion = 1

	flagLast = 1 << 0

	wireSegSize = 4 + 8 + 8 // region id, offset, length

	maxNotif     = 1 << 20         // notification message
	maxSegs      = 1 << 20         // descriptors in one request
	maxDataChunk = 64 << 20        // payload of one data frame
	maxTransfer  = uint64(1) << 42 // bytes in one transfer
	maxErrMsg    = 4096
)

type frameType uint8

const (
	frHello    frameType = 1  // handshake: u16 version, u64 instance, name (u16 len, bytes)
	frMDReq    frameType = 2  // empty; asks for the peer's metadata
	frMDResp   frameType = 3  // metadata bytes
	frReadReq  frameType = 4  // u32 count, count × segment
	frWriteReq frameType = 5  // u32 notif len, notif, u32 count, count × segment
	frRData    frameType = 6  // READ payload to the initiator: u64 offset, bytes
	frWData    frameType = 7  // WRITE payload to the target: u64 offset, bytes
	frAck      frameType = 8  // empty; the WRITE landed and its notification was delivered
	frError    frameType = 9  // u16 code, message (u16 len, bytes)
	frNotif    frameType = 10 // notification message
	frCancel   frameType = 11 // empty; the initiator gave up on the request
	frLastType           = frCancel
)

// String names the frame type for errors.
func (t frameType) String() string {
	names := [...]string{"", "HELLO", "MD_REQ", "MD_RESP", "READ_REQ", "WRITE_REQ", "RDATA", "WDATA", "ACK", "ERROR", "NOTIF", "CANCEL"}
	if int(t) < len(names) && t != 0 {
		return names[t]
	}
	return fmt.Sprintf("frame(%d)", uint8(t))
}

// maxBody is the largest body a frame of type t may carry.
func maxBody(t frameType) uint32 {
	switch t {
	case frHello:
		return 2 + 8 + 2 + mdMaxName
	case frMDReq, frAck, frCancel:
		return 0
	case frMDResp:
		return maxMetadataBytes
	case frReadReq:
		return 4 + maxSegs*wireSegSize
	case frWriteReq:
		return 4 + maxNotif + 4 + maxSegs*wireSegSize
	case frRData, frWData:
		return 8 + maxDataChunk
	case frError:
		return 2 + 2 + maxErrMsg
	case frNotif:
		return maxNotif
	}
	return 0
}

type frameHeader struct {
	length uint32
	typ    frameType
	flags  uint8
	id     uint64
}

func putHeader(b []byte, h frameHeader) {
	binary.LittleEndian.PutUint32(b[0:4], h.length)
	b[4] = byte(h.typ)
	b[5] = h.flags
	b[6], b[7] = 0, 0
	binary.LittleEndian.PutUint64(b[8:16], h.id)
}

// parseHeader decodes and validates a frame header.
func parseHeader(b []byte) (frameHeader, error) {
	if len(b) < hdrSize {
		return frameHeader{}, fmt.Errorf("frame header of %d bytes: %w", len(b), ErrProtocol)
	}
	h := frameHeader{
		length: binary.LittleEndian.Uint32(b[0:4]),
		typ:    frameType(b[4]),
		flags:  b[5],
		id:     binary.LittleEndian.Uint64(b[8:16]),
	}
	if h.typ == 0 || h.typ > frLastType {
		return h, fmt.Errorf("unknown frame type %d: %w", b[4], ErrProtocol)
	}
	if b[6] != 0 || b[7] != 0 {
		return h, fmt.Errorf("%s frame: reserved bits set: %w", h.typ, ErrProtocol)
	}
	if h.flags&^flagLast != 0 || (h.flags != 0 && h.typ != frRData && h.typ != frWData) {
		return h, fmt.Errorf("%s frame: flags %#x: %w", h.typ, h.flags, ErrProtocol)
	}
	if h.length > maxBody(h.typ) {
		return h, fmt.Errorf("%s frame: body of %d bytes exceeds %d: %w", h.typ, h.length, maxBody(h.typ), ErrProtocol)
	}
	if (h.typ == frRData || h.typ == frWData) && h.length < 8 {
		return h, fmt.Errorf("%s frame: body of %d bytes: %w", h.typ, h.length, ErrProtocol)
	}
	return h, nil
}

// wireSeg addresses bytes of a region of the target agent by region id.
type wireSeg struct {
	region uint32
	off    uint64
	len    uint64
}

func appendSegs(b []byte, segs []wireSeg) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(segs)))
	for _, s := range segs {
		b = binary.LittleEndian.AppendUint32(b, s.region)
		b = binary.LittleEndian.AppendUint64(b, s.off)
		b = binary.LittleEndian.AppendUint64(b, s.len)
	}
	return b
}

// decodeSegs reads a segment list that must fill the rest of d, and returns it with the
// sum of the lengths.
func decodeSegs(d *decoder) ([]wireSeg, uint64, error) {
	n := d.u32()
	if d.err != nil || n == 0 || n > maxSegs || uint64(n)*wireSegSize != uint64(d.left()) {
		return nil, 0, fmt.Errorf("segment list of %d entries in %d bytes: %w", n, d.left(), ErrProtocol)
	}
	segs := make([]wireSeg, n)
	var total uint64
	for i := range segs {
		s := wireSeg{region: d.u32(), off: d.u64(), len: d.u64()}
		if s.len == 0 || s.off > math.MaxUint64-s.len {
			return nil, 0, fmt.Errorf("segment %d {region %d off %d len %d}: %w", i, s.region, s.off, s.len, ErrProtocol)
		}
		total += s.len
		if total > maxTransfer {
			return nil, 0, fmt.Errorf("transfer of more than %d bytes: %w", maxTransfer, ErrProtocol)
		}
		segs[i] = s
	}
	return segs, total, nil
}

func encodeReadReq(segs []wireSeg) []byte {
	return appendSegs(make([]byte, 0, 4+len(segs)*wireSegSize), segs)
}

func decodeReadReq(body []byte) ([]wireSeg, uint64, error) {
	d := decoder{b: body}
	return decodeSegs(&d)
}

func encodeWriteReq(notif []byte, segs []wireSeg) []byte {
	b := make([]byte, 0, 4+len(notif)+4+len(segs)*wireSegSize)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(notif)))
	b = append(b, notif...)
	return appendSegs(b, segs)
}

// decodeWriteReq returns the notification (aliasing body), the segments and their total.
func decodeWriteReq(body []byte) ([]byte, []wireSeg, uint64, error) {
	d := decoder{b: body}
	n := d.u32()
	if n > maxNotif {
		return nil, nil, 0, fmt.Errorf("notification of %d bytes: %w", n, ErrProtocol)
	}
	notif := d.bytes(int(n))
	if d.err != nil {
		return nil, nil, 0, fmt.Errorf("truncated WRITE_REQ: %w", ErrProtocol)
	}
	segs, total, err := decodeSegs(&d)
	return notif, segs, total, err
}

func encodeHello(name string, instance uint64) []byte {
	b := binary.LittleEndian.AppendUint16(make([]byte, 0, 12+len(name)), protoVersion)
	b = binary.LittleEndian.AppendUint64(b, instance)
	return appendStr16(b, name)
}

func decodeHello(body []byte) (string, uint64, error) {
	d := decoder{b: body}
	v := d.u16()
	if d.err == nil && v != protoVersion {
		return "", 0, fmt.Errorf("peer speaks protocol version %d, want %d: %w", v, protoVersion, ErrProtocol)
	}
	instance := d.u64()
	name := d.str16(mdMaxName)
	if d.err != nil || d.left() != 0 || name == "" {
		return "", 0, fmt.Errorf("malformed HELLO: %w", ErrProtocol)
	}
	return name, instance, nil
}

func encodeError(err error) []byte {
	msg := err.Error()
	if len(msg) > maxErrMsg {
		msg = msg[:maxErrMsg]
	}
	b := binary.LittleEndian.AppendUint16(make([]byte, 0, 4+len(msg)), errorCode(err))
	return appendStr16(b, msg)
}

func decodeError(peer string, body []byte) error {
	d := decoder{b: body}
	code := d.u16()
	msg := d.str16(maxErrMsg)
	if d.err != nil || d.left() != 0 {
		return fmt.Errorf("malformed ERROR frame: %w", ErrProtocol)
	}
	return &RemoteError{Peer: peer, Code: code, Msg: msg}
}
