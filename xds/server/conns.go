package server

import (
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// peerListener accepts at most max connections from one peer host at once, closing the
// excess as soon as it is accepted, so that one address cannot hold thousands of idle
// connections (each costs the control plane about 20 KB and a goroutine).
type peerListener struct {
	net.Listener
	max         int
	userTimeout time.Duration
	refused     *atomic.Uint64

	mu    sync.Mutex
	conns map[string]int
	// total is the connections open from every peer, at most maxTotal: many addresses
	// (a pod's, or a client's many loopback addresses) each under its own cap cannot
	// together hold the server without bound.
	total, maxTotal int
}

func newPeerListener(l net.Listener, max, maxTotal int, userTimeout time.Duration, refused *atomic.Uint64) *peerListener {
	return &peerListener{Listener: l, max: max, maxTotal: maxTotal, userTimeout: userTimeout, refused: refused, conns: map[string]int{}}
}

func (l *peerListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		host := peerHost(c.RemoteAddr())
		l.mu.Lock()
		if l.conns[host] >= l.max || l.total >= l.maxTotal {
			l.mu.Unlock()
			l.refused.Add(1)
			_ = c.Close()
			continue
		}
		l.conns[host]++
		l.total++
		l.mu.Unlock()
		// gRPC sets TCP_USER_TIMEOUT itself only on a *net.TCPConn, which the wrapper
		// hides: set it here, so that a peer whose socket stops taking data is still cut
		// off by the kernel within the keepalive timeout.
		if tc, ok := c.(*net.TCPConn); ok && l.userTimeout > 0 {
			setUserTimeout(tc, l.userTimeout)
		}
		return &peerConn{Conn: c, release: func() { l.release(host) }}, nil
	}
}

func (l *peerListener) release(host string) {
	l.mu.Lock()
	if l.conns[host]--; l.conns[host] <= 0 {
		delete(l.conns, host)
	}
	l.total--
	l.mu.Unlock()
}

func peerHost(a net.Addr) string {
	if a == nil {
		return "unknown"
	}
	h, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return h
}

func setUserTimeout(tc *net.TCPConn, d time.Duration) {
	raw, err := tc.SyscallConn()
	if err != nil {
		return
	}
	_ = raw.Control(func(fd uintptr) {
		_ = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d/time.Millisecond))
	})
}

// peerConn gives its peer's place back once, when it closes.
type peerConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *peerConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
