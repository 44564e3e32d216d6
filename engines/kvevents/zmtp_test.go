package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// zmtpGreeting is what a ZMTP 3.0 peer with the NULL mechanism sends first, and
// zmtpReady its READY command as a PUB socket, with meta after its socket type.
func zmtpGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	return g
}

func zmtpReady(meta []byte) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, 11)
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, 3)
	body = append(body, "PUB"...)
	body = append(body, meta...)
	if len(body) > 255 {
		return append(binary.BigEndian.AppendUint64([]byte{0x06}, uint64(len(body))), body...)
	}
	return append([]byte{0x04, byte(len(body))}, body...)
}

// zmtpPeer accepts one connection and speaks ZMTP 3.0 as a PUB socket with the NULL
// mechanism, its READY command carrying meta as its metadata, then writes after: a stand-in
// for a publisher that sends what a ZMQ library would not.
func zmtpPeer(t *testing.T, meta, after []byte) (addr string, done <-chan struct{}) {
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
		if _, err := c.Write(zmtpGreeting()); err != nil {
			return
		}
		if _, err := io.ReadFull(c, make([]byte, 64)); err != nil {
			return
		}
		if _, err := c.Write(append(zmtpReady(meta), after...)); err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c) // until the subscriber hangs up
	}()
	return ln.Addr().String(), ch
}

// TestOversizedFrame: a publisher that announces a frame larger than any batch (here 2^40
// bytes) is cut off, and the subscriber neither allocates it nor dies.
func TestOversizedFrame(t *testing.T) {
	hangsUp(t, "a publisher that announced a 1 TiB frame", nil, binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40))
}

// TestEmptyFramesFlood: a publisher that sends empty frames, each marked "more", for ever is
// cut off too (each frame is charged for what holding it costs).
func TestEmptyFramesFlood(t *testing.T) {
	flood := bytes.Repeat([]byte{0x01, 0x00}, 4<<20) // 4M frames, 8 MiB: past the bound
	hangsUp(t, "a publisher sending a message of endless empty frames", nil, flood)
}

// TestMalformedMetadata: a READY command whose metadata ends inside a property (a name length
// and nothing after it) is refused, not read past its end.
func TestMalformedMetadata(t *testing.T) {
	for _, meta := range [][]byte{{0x00}, {0x01}, {0x03, 'a', 'b', 'c', 0, 0}} {
		hangsUp(t, fmt.Sprintf("a publisher whose READY metadata is %x", meta), meta, nil)
	}
}

// hangsUp runs a subscriber against a zmtpPeer and waits for it to close the connection.
func hangsUp(t *testing.T, what string, meta, after []byte) {
	t.Helper()
	addr, done := zmtpPeer(t, meta, after)
	s, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://" + addr, RetryInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	go func() { _ = s.Run(ctx, func(uint64, *Batch) {}) }()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatalf("the subscriber kept the connection of %s", what)
	}
}

// TestStalledHandshake: a subscriber that binds (engines connect out to it) keeps taking
// publishers while one connection says nothing at all, and drops that one after the
// handshake's timeout.
func TestStalledHandshake(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	sub, rec := boundSubscriber(t, ctx)
	silent, err := net.Dial("tcp", strings.TrimPrefix(sub.Endpoint(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	pub := startPublisher(t, ctx, PublisherConfig{Endpoint: sub.Endpoint(), Connect: true})
	for i := 0; rec.len() == 0; i++ {
		if ctx.Err() != nil {
			t.Fatal("no batch arrived from a publisher connecting beside a silent connection")
		}
		_ = pub.Publish(testBatch(i))
		time.Sleep(20 * time.Millisecond)
	}
	_ = silent.SetReadDeadline(time.Now().Add(zmq4.HandshakeTimeout + 5*time.Second))
	buf := make([]byte, 256)
	for {
		if _, err := silent.Read(buf); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatal("the silent connection was kept past the handshake's timeout")
			}
			return // closed by the subscriber
		}
	}
}

// TestPooledFrames: the subscriber reads frames into pooled arenas it reuses once a message
// is handled; batches of every size, small ones sharing an arena and large ones past it
// (allocated on their own), all arrive whole and in order.
func TestPooledFrames(t *testing.T) {
	t.Run("short topic", func(t *testing.T) { pooledFrames(t, "") })
	// A first frame larger than an arena, read on its own before the others take one.
	t.Run("20 KB topic", func(t *testing.T) { pooledFrames(t, strings.Repeat("t", 20000)) })
}

func pooledFrames(t *testing.T, topic string) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	pub := startPublisher(t, ctx, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", HWM: 1 << 16, QueueSize: 1 << 12, Topic: topic})
	_, rec := startSubscriber(t, ctx, SubscriberConfig{Endpoint: pub.Endpoint()})
	waitFor(t, ctx, "the subscription", pub.HasSubscribers)
	var want []any
	for i := range 600 {
		b := testBatch(i)
		b.HasDPRank = true // as the publisher stamps it
		// Every seventh batch carries 8,000 tokens (about 40 KB): past an arena's 16 KB.
		if i%7 == 0 {
			b.Events[0].TokenIDs = make([]uint32, 8000)
			for j := range b.Events[0].TokenIDs {
				b.Events[0].TokenIDs[j] = uint32(i*8000 + j)
			}
		}
		want = append(want, canonical(t, b))
		for pub.Publish(b) != nil {
			time.Sleep(time.Millisecond)
		}
	}
	waitFor(t, ctx, "every batch", func() bool { return rec.len() == len(want) })
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for i, got := range rec.batches {
		if !reflect.DeepEqual(got, want[i]) {
			t.Fatalf("batch %d arrived as %v, want %v", i, got, want[i])
		}
		if i > 0 && rec.seqs[i] != rec.seqs[i-1]+1 {
			t.Fatalf("batch %d numbered %d after %d", i, rec.seqs[i], rec.seqs[i-1])
		}
	}
}

// TestHandshakeCap: a bound subscriber shakes hands with at most 256 connections at once;
// one more, while 256 say nothing, is closed at once instead of holding a descriptor.
func TestHandshakeCap(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	sub, _ := boundSubscriber(t, ctx)
	addr := strings.TrimPrefix(sub.Endpoint(), "tcp://")
	var silent []net.Conn
	defer func() {
		for _, c := range silent {
			c.Close()
		}
	}()
	read := func(c net.Conn) error { // until the subscriber closes c or 3 s pass
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		buf := make([]byte, 256)
		for {
			if _, err := c.Read(buf); err != nil {
				return err
			}
		}
	}
	for range 256 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		silent = append(silent, c)
	}
	// The 256 are taken (each has the subscriber's greeting to read) before one more comes.
	for _, c := range silent {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 10)); err != nil {
			t.Fatalf("a silent connection got no greeting: %v", err)
		}
	}
	extra, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	if err := read(extra); errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("a connection past 256 handshakes in flight was kept")
	}
	if err := read(silent[0]); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a silent connection within the cap was closed before the handshake timeout: %v", err)
	}
}

// boundSubscriber runs a subscriber bound to a loopback port, recording what it receives,
// until the test ends; it returns once the subscriber is bound.
func boundSubscriber(t *testing.T, ctx context.Context) (*Subscriber, *recorder) {
	t.Helper()
	sub, rec := startSubscriber(t, ctx, SubscriberConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	<-sub.Ready()
	return sub, rec
}

// startSubscriber runs a subscriber of cfg, recording what it receives, until the test ends.
func startSubscriber(t *testing.T, ctx context.Context, cfg SubscriberConfig) (*Subscriber, *recorder) {
	t.Helper()
	sub, err := NewSubscriber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{t: t}
	t.Cleanup(runSubscriber(t, ctx, sub, rec))
	return sub, rec
}

// TestSlowLargeFrame: publishers that announce a frame within the bound (60 MiB) and send
// none of it hold about a megabyte each, not the frame: the reader's buffer grows as bytes
// arrive.
func TestSlowLargeFrame(t *testing.T) {
	const peers = 8
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var subs []*Subscriber
	for range peers {
		addr, _ := zmtpPeer(t, nil, binary.BigEndian.AppendUint64([]byte{0x02}, 60<<20))
		s, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://" + addr, RetryInterval: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		subs = append(subs, s)
		go func() { _ = s.Run(ctx, func(uint64, *Batch) {}) }()
	}
	for _, s := range subs {
		<-s.Ready()
	}
	time.Sleep(300 * time.Millisecond) // each reader is now waiting inside its frame
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > peers*8<<20 {
		t.Fatalf("the heap grew by %d MiB for %d publishers that announced 60 MiB and sent nothing", grew>>20, peers)
	}
}

// FuzzZMTPRead: whatever a publisher sends as its READY command's metadata and then as
// messages, the subscriber's side of the connection (zmq4's handshake and frame reader)
// answers with a message or an error, never a panic, and never holds more than the bound.
func FuzzZMTPRead(f *testing.F) {
	f.Add([]byte{}, []byte{0x00, 0x00})
	f.Add([]byte{0x00}, []byte{})
	f.Add([]byte{0x01, 'a', 0, 0, 0, 9}, []byte{0x01, 0x00, 0x00, 0x01, 'x'})
	f.Add([]byte{}, binary.BigEndian.AppendUint64([]byte{0x02}, 1<<40))
	f.Add([]byte{}, []byte{0x04, 0x05, 4, 'P', 'I', 'N', 'G'})
	f.Fuzz(func(t *testing.T, meta, after []byte) {
		// A synchronous pipe: the peer drains what the subscriber's side writes while it
		// writes its own greeting, READY and messages, and hangs up once they are read.
		local, peer := net.Pipe()
		defer local.Close()
		go func() { _, _ = io.Copy(io.Discard, peer) }()
		go func() {
			defer peer.Close()
			_, _ = peer.Write(append(append(zmtpGreeting(), zmtpReady(meta)...), after...))
		}()
		c, err := zmq4.Open(local, null.Security(), zmq4.Sub, zmq4.SocketIdentity("fuzz"), false, nil)
		if err != nil {
			return // a handshake refused
		}
		for range 64 {
			msg, err := c.RecvMsg()
			if err != nil {
				return
			}
			n := 0
			for _, fr := range msg.Frames {
				n += len(fr)
			}
			if n > zmq4.DefaultMaxMessageSize {
				t.Fatalf("a message of %d bytes read past the bound", n)
			}
		}
	})
}

// TestBacklogHoldsBytes: a subscriber whose receiver is behind holds the messages waiting in
// its sockets' queues at their size, not a 16 KiB receive arena apiece. 200 sockets, each
// with a queue of small messages it has not received: about 7 MB live, where arenas would
// hold 35 MB (11 a socket).
func TestBacklogHoldsBytes(t *testing.T) {
	if testing.Short() {
		t.Skip("opens 200 sockets")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	addr := "tcp://" + pub.Addr().String()
	const socks, msgs = 200, 40
	subs := make([]zmq4.Socket, socks)
	for i := range subs {
		subs[i] = zmq4.NewSub(ctx, zmq4.WithRecvArenas())
		defer subs[i].Close()
		if err := subs[i].Dial(addr); err != nil {
			t.Fatal(err)
		}
		if err := subs[i].SetOption(zmq4.OptionSubscribe, ""); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond) // every subscription reaches the publisher
	live := func() uint64 {
		runtime.GC()
		runtime.GC() // the pool's victims too
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := live()
	payload := bytes.Repeat([]byte{7}, 300)
	for range msgs {
		if err := pub.Send(zmq4.NewMsgFrom([]byte("kv"), payload)); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(time.Second) // the messages reach every socket's queue, unreceived
	grown := int64(live()) - int64(before)
	t.Logf("%d sockets, %d messages of %d bytes each unreceived: heap grew %d KB", socks, msgs, len(payload), grown>>10)
	if grown > 18<<20 {
		t.Fatalf("the backlog holds %d MB: its messages wait in their arenas", grown>>20)
	}
	// And every message arrives whole, in order.
	for i, s := range subs[:3] {
		for j := range msgs {
			m, err := s.Recv()
			if err != nil {
				t.Fatalf("socket %d, message %d: %v", i, j, err)
			}
			if len(m.Frames) != 2 || !bytes.Equal(m.Frames[1], payload) {
				t.Fatalf("socket %d, message %d: %d frames", i, j, len(m.Frames))
			}
			m.Release()
		}
	}
}
