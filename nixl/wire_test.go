package nixl

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

func frame(t frameType, flags uint8, id uint64, body []byte) []byte {
	b := make([]byte, hdrSize, hdrSize+len(body))
	putHeader(b, frameHeader{length: uint32(len(body)), typ: t, flags: flags, id: id})
	return append(b, body...)
}

func dataFrame(t frameType, id, off uint64, last bool, payload []byte) []byte {
	var flags uint8
	if last {
		flags = flagLast
	}
	return frame(t, flags, id, append(binary.LittleEndian.AppendUint64(nil, off), payload...))
}

func TestParseHeader(t *testing.T) {
	raw := func(length uint32, typ, flags, r0 byte) []byte {
		b := make([]byte, hdrSize)
		binary.LittleEndian.PutUint32(b, length)
		b[4], b[5], b[6] = typ, flags, r0
		return b
	}
	tests := []struct {
		name string
		b    []byte
		ok   bool
	}{
		{"ack", raw(0, byte(frAck), 0, 0), true},
		{"last data", raw(8+4096, byte(frRData), flagLast, 0), true},
		{"short", raw(0, byte(frAck), 0, 0)[:10], false},
		{"type zero", raw(0, 0, 0, 0), false},
		{"unknown type", raw(0, 200, 0, 0), false},
		{"reserved set", raw(0, byte(frAck), 0, 1), false},
		{"flag on control frame", raw(0, byte(frAck), flagLast, 0), false},
		{"unknown flag", raw(8, byte(frWData), 2, 0), false},
		{"body on empty frame", raw(1, byte(frCancel), 0, 0), false},
		{"data without offset", raw(4, byte(frRData), 0, 0), false},
		{"oversized data", raw(8+maxDataChunk+1, byte(frWData), 0, 0), false},
		{"oversized notif", raw(maxNotif+1, byte(frNotif), 0, 0), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseHeader(tt.b)
			if (err == nil) != tt.ok {
				t.Fatalf("err = %v, want ok=%v", err, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrProtocol) {
				t.Errorf("err %v does not wrap ErrProtocol", err)
			}
		})
	}
}

func TestDecodeRequests(t *testing.T) {
	segs := []wireSeg{{region: 1, off: 0, len: 10}, {region: 2, off: 5, len: 7}}
	got, total, err := decodeReadReq(encodeReadReq(segs))
	if err != nil || total != 17 || len(got) != 2 || got[1] != segs[1] {
		t.Fatalf("read request round trip = %v, %d, %v", got, total, err)
	}
	notif, got, total, err := decodeWriteReq(encodeWriteReq([]byte("n"), segs))
	if err != nil || string(notif) != "n" || total != 17 || got[0] != segs[0] {
		t.Fatalf("write request round trip = %q %v, %d, %v", notif, got, total, err)
	}
	bad := [][]byte{
		nil,
		encodeReadReq(nil),
		encodeReadReq([]wireSeg{{region: 1, len: 0}}),
		encodeReadReq([]wireSeg{{region: 1, off: ^uint64(0), len: 2}}),
		encodeReadReq([]wireSeg{{region: 1, len: maxTransfer}, {region: 1, len: 1}}),
		encodeReadReq(segs)[:20],
		append(encodeReadReq(segs), 0),
	}
	for i, b := range bad {
		if _, _, err := decodeReadReq(b); !errors.Is(err, ErrProtocol) {
			t.Errorf("bad read request %d: err = %v", i, err)
		}
	}
	if _, _, _, err := decodeWriteReq([]byte{0xff, 0xff, 0xff, 0x7f}); !errors.Is(err, ErrProtocol) {
		t.Errorf("write request with huge notification: %v", err)
	}
}

// TestServeFramesDirectly drives a connection's reader with hand-made frames: a valid
// WRITE lands in the region, a READ is answered, and violations close the connection.
func TestServeFramesDirectly(t *testing.T) {
	a := newAgent(t, "srv", Config{})
	r := heapRegion(t, a, 4096)
	payload := bytes.Repeat([]byte{0xab}, 100)
	write := encodeWriteReq([]byte("note"), []wireSeg{{region: r.ID(), off: 10, len: 100}})
	in := append(frame(frWriteReq, 0, 1, write), dataFrame(frWData, 1, 0, true, payload)...)
	in = append(in, frame(frReadReq, 0, 2, encodeReadReq([]wireSeg{{region: r.ID(), off: 10, len: 100}}))...)
	ack := frame(frAck, 0, 1, nil)
	rdata := dataFrame(frRData, 2, 0, true, payload)
	out := runReader(t, a, in, func(out []byte) bool {
		return bytes.Contains(out, ack) && bytes.Contains(out, rdata)
	})
	if !bytes.Equal(r.Bytes()[10:110], payload) {
		t.Error("WRITE did not land")
	}
	n := a.GetNotifs()
	if len(n["fuzz-peer"]) != 1 || string(n["fuzz-peer"][0]) != "note" {
		t.Errorf("notifications %q", n)
	}
	if !bytes.Contains(out, ack) || !bytes.Contains(out, rdata) {
		t.Error("no ACK for the WRITE or no RDATA answering the READ")
	}

	// Data beyond what the WRITE announced is a protocol violation: nothing lands.
	before := bytes.Clone(r.Bytes())
	over := append(frame(frWriteReq, 0, 3, encodeWriteReq(nil, []wireSeg{{region: r.ID(), len: 8}})), dataFrame(frWData, 3, 0, true, make([]byte, 16))...)
	runReader(t, a, over, nil)
	if !bytes.Equal(before, r.Bytes()) {
		t.Error("oversized WRITE data landed")
	}
}

// runReader feeds in to a fresh connection reader of a (as if from peer "fuzz-peer"),
// waits until what the agent wrote back satisfies until (nil: no wait), ends the stream,
// and returns the output once the reader has stopped.
func runReader(t testing.TB, a *Agent, in []byte, until func([]byte) bool) []byte {
	near, far := net.Pipe()
	c := newConn(a, near, bufio.NewReader(near), "fuzz-peer", 1)
	if !a.track() {
		t.Fatal("agent closed")
	}
	done := make(chan struct{})
	go func() {
		defer a.wg.Done()
		defer close(done)
		c.readLoop()
	}()
	var out syncBuffer
	copied := make(chan struct{})
	go func() {
		io.Copy(&out, far)
		close(copied)
	}()
	far.SetWriteDeadline(time.Now().Add(5 * time.Second))
	far.Write(in)
	for deadline := time.Now().Add(5 * time.Second); until != nil && !until(out.Bytes()); {
		if time.Now().After(deadline) {
			t.Errorf("reply not seen; output %x", out.Bytes())
			break
		}
		time.Sleep(time.Millisecond)
	}
	far.Close()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("connection reader did not stop")
	}
	<-copied
	return out.Bytes()
}

// syncBuffer is a bytes.Buffer safe for one writer and concurrent readers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Clone(s.b.Bytes())
}

// FuzzFrameDecoder feeds arbitrary bytes to a connection's reader on a live agent with a
// registered region. The agent must never panic or hang, whatever the peer sends.
func FuzzFrameDecoder(f *testing.F) {
	a := newAgent(f, "fuzz-self", Config{})
	r, err := a.RegisterMem(make([]byte, 1<<16))
	if err != nil {
		f.Fatal(err)
	}
	seg := []wireSeg{{region: r.ID(), off: 16, len: 32}}
	f.Add(frame(frAck, 0, 9, nil))
	f.Add(frame(frNotif, 0, 0, []byte("hi")))
	f.Add(frame(frMDReq, 0, 1, nil))
	f.Add(frame(frReadReq, 0, 1, encodeReadReq(seg)))
	f.Add(append(frame(frWriteReq, 0, 1, encodeWriteReq([]byte("n"), seg)), dataFrame(frWData, 1, 0, true, make([]byte, 32))...))
	f.Add(append(frame(frWriteReq, 0, 1, encodeWriteReq(nil, []wireSeg{{region: 99, len: 4}})), dataFrame(frWData, 1, 0, true, make([]byte, 4))...))
	f.Add(dataFrame(frRData, 5, 0, true, []byte("zz")))
	f.Add(frame(frError, 0, 1, encodeError(ErrOutOfRange)))
	f.Add(frame(frHello, 0, 0, encodeHello("x", 7)))
	f.Fuzz(func(t *testing.T, data []byte) {
		runReader(t, a, data, nil)
		a.GetNotifs()
		// The handshake decoder sees the same bytes.
		readHello(bufio.NewReader(bytes.NewReader(data)), "", 0)
		if len(data) >= hdrSize {
			if h, err := parseHeader(data); err == nil {
				body := data[hdrSize:]
				decodeReadReq(body)
				decodeWriteReq(body)
				decodeError("p", body)
				decodeHello(body)
				_ = h
			}
		}
	})
}
