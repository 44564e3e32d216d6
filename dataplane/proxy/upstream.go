package proxy

import (
	"github.com/panjf2000/gnet/v2"

	"github.com/kvrelay/kvrelay/dataplane/http1"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// Upstream connection states.
const (
	upDialing uint8 = iota
	upIdle
	upBusy
	upClosed
)

// upstream is one keep-alive connection to an engine, registered on the event loop of the
// client connections it serves. It carries one exchange at a time.
type upstream struct {
	c         gnet.Conn
	lp        *loop
	w         *route.Worker
	ex        *exchange
	state     uint8
	reused    bool
	idleSince int64

	resp      http1.Response
	headDone  bool
	gotBytes  bool
	remaining int64
	scan      http1.ChunkScanner
}

// attach binds the connection to an exchange; reused says it came from the idle pool.
func (up *upstream) attach(ex *exchange, reused bool) {
	up.ex = ex
	up.state = upBusy
	up.reused = reused
	up.headDone, up.gotBytes, up.remaining = false, false, 0
}

// detach unbinds the exchange.
func (up *upstream) detach() {
	if up.ex != nil && up.ex.up == up {
		up.ex.up = nil
	}
	up.ex = nil
}

// kill closes the connection (or, while dialing, makes it close as soon as it opens).
func (up *upstream) kill() {
	if up.state == upClosed {
		return
	}
	if up.state == upIdle {
		up.lp.dropIdle(up)
	}
	up.state = upClosed
	if up.c != nil {
		_ = up.c.Close()
	}
}

// opened runs on the loop when a dialled connection is registered.
func (up *upstream) opened(c gnet.Conn) {
	up.c = c
	if up.state == upClosed {
		_ = c.Close()
		return
	}
	if up.ex == nil {
		up.lp.putIdle(up)
		return
	}
	up.attach(up.ex, false)
	_, _ = c.Write(up.ex.out)
}

// dialFailed runs on the loop when the dial did not succeed.
func (up *upstream) dialFailed(error) {
	prev := up.state
	up.state = upClosed
	if ex := up.ex; ex != nil && prev != upClosed {
		up.detach()
		ex.fail(up, failConnect)
	}
}

func (up *upstream) traffic() gnet.Action {
	if up.ex == nil {
		// Bytes on an idle connection answer nothing: the framing is lost.
		up.kill()
		return gnet.None
	}
	up.ex.data(up)
	return gnet.None
}

func (up *upstream) closed(error) {
	prev := up.state
	up.state = upClosed
	if prev == upIdle {
		up.lp.dropIdle(up)
	}
	if ex := up.ex; ex != nil {
		ex.upstreamClosed(up)
	}
}
