package kvevents

import (
	"bufio"
	"context"
	"net"
	"strings"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// bufferedTCP is the zmq4 transport the subscriber and the replay client use for tcp://
// endpoints: zmq4 reads each frame's header and body straight from the connection, two or
// three read syscalls a frame and seven or more for one KV event message; this transport
// reads through a buffer, so that a syscall takes in as many messages as have arrived. At
// loopback rates the syscalls were a third of the control plane's ingest CPU
// (BenchmarkPipeline in controlplane/ingest).
const bufferedTCP = "kvrelay-tcp"

// readBuffer is each connection's read buffer: a few engine steps' batches, and small
// enough for a control plane that follows thousands of engines (a frame longer than it is
// read straight into its message).
const readBuffer = 16 << 10

func init() {
	if err := zmq4.RegisterTransport(bufferedTCP, bufferedTransport{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

// zmqEndpoint is the endpoint to hand zmq4 for a user's ep: tcp:// through the buffered
// transport, anything else as it is.
func zmqEndpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return bufferedTCP + "://" + rest
	}
	return ep
}

type bufferedTransport struct{ transport.Transport }

func (t bufferedTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.Transport.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newBufferedConn(c), nil
}

func (t bufferedTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.Transport.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return bufferedListener{l}, nil
}

// bufferedConn reads through a buffer and writes straight through. zmq4 reads a connection
// from one goroutine at a time (its handshake, then its reader).
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func newBufferedConn(c net.Conn) *bufferedConn {
	return &bufferedConn{Conn: c, r: bufio.NewReaderSize(c, readBuffer)}
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

type bufferedListener struct{ net.Listener }

func (l bufferedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newBufferedConn(c), nil
}
