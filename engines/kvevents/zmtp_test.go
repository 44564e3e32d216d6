package kvevents

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"
)

// zmtpPeer accepts one connection and speaks ZMTP 3.0 as a PUB socket with the NULL
// mechanism, then writes after: a stand-in for a publisher that sends what a ZMQ library
// would not.
func zmtpPeer(t *testing.T, after []byte) (addr string, done <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		greeting := make([]byte, 64)
		greeting[0], greeting[9], greeting[10] = 0xff, 0x7f, 3
		copy(greeting[12:], "NULL")
		if _, err := c.Write(greeting); err != nil {
			return
		}
		if _, err := io.ReadFull(c, make([]byte, 64)); err != nil {
			return
		}
		body := append([]byte{5}, "READY"...)
		body = append(body, 11)
		body = append(body, "Socket-Type"...)
		body = binary.BigEndian.AppendUint32(body, 3)
		body = append(body, "PUB"...)
		cmd := append([]byte{0x04, byte(len(body))}, body...)
		if _, err := c.Write(append(cmd, after...)); err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c) // until the subscriber hangs up
	}()
	return ln.Addr().String(), ch
}

// TestOversizedFrame: a publisher that announces a frame larger than any batch (here 2^40
// bytes) is cut off, and the subscriber neither allocates it nor dies.
func TestOversizedFrame(t *testing.T) {
	frame := binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40)
	addr, done := zmtpPeer(t, frame)
	s, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://" + addr, RetryInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	go func() { _ = s.Run(ctx, func(uint64, *Batch) {}) }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("the subscriber kept the connection of a publisher that announced a 1 TiB frame")
	}
}
