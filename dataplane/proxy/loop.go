package proxy

import (
	"context"
	"net"

	"github.com/panjf2000/gnet/v2"

	"github.com/kvrelay/kvrelay/dataplane/clock"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// loop is the proxy's state for one gnet event loop. Everything in it is touched only from
// that loop's goroutine: the client connections it owns, its pools of idle upstream
// connections (one per worker) and scratch buffers.
type loop struct {
	srv *Server
	el  gnet.EventLoop
	// shadowReq is the scratch request of its requests' shadow picks (decide.Request.Init).
	shadowReq route.Request
	idle      [][]*upstream // by worker index
	// clients is an intrusive list of this loop's client connections, for housekeeping.
	clients clientConn
	wbuf    []byte
	// now is the time of the event being handled, read once per event (the clock costs
	// tens of nanoseconds a read on virtual machines, and a request reads it often).
	now int64
	// seq counts requests; one in decide.SampleEvery has its decision timed and recorded.
	seq uint64
}

func newLoop(s *Server, el gnet.EventLoop) *loop {
	lp := &loop{srv: s, el: el}
	lp.clients.next, lp.clients.prev = &lp.clients, &lp.clients
	return lp
}

func (lp *loop) newClient(c gnet.Conn) *clientConn {
	cc := &clientConn{srv: lp.srv, c: c, lp: lp, lastActive: lp.now}
	cc.in.Init(lp.srv.core, &lp.shadowReq, true)
	cc.ex.cc = cc
	cc.next, cc.prev = lp.clients.next, &lp.clients
	lp.clients.next.prev = cc
	lp.clients.next = cc
	return cc
}

func (lp *loop) unlinkClient(cc *clientConn) {
	if cc.next == nil {
		return
	}
	cc.prev.next = cc.next
	cc.next.prev = cc.prev
	cc.next, cc.prev = nil, nil
}

// take returns an idle connection to w from this loop's pool, or nil.
func (lp *loop) take(w *route.Worker) *upstream {
	if w.Index >= len(lp.idle) {
		return nil
	}
	pool := lp.idle[w.Index]
	for n := len(pool); n > 0; n = len(pool) {
		up := pool[n-1]
		pool[n-1] = nil
		pool = pool[:n-1]
		lp.idle[w.Index] = pool
		if up.state == upIdle && up.w == w {
			return up
		}
	}
	return nil
}

// putIdle returns a finished upstream connection to the pool.
func (lp *loop) putIdle(up *upstream) {
	i := up.w.Index
	for len(lp.idle) <= i {
		lp.idle = append(lp.idle, nil)
	}
	up.state = upIdle
	up.idleSince = lp.now
	lp.idle[i] = append(lp.idle[i], up)
}

// dropIdle removes a closed idle connection from the pool.
func (lp *loop) dropIdle(up *upstream) {
	i := up.w.Index
	if i >= len(lp.idle) {
		return
	}
	pool := lp.idle[i]
	for j, x := range pool {
		if x == up {
			copy(pool[j:], pool[j+1:])
			pool[len(pool)-1] = nil
			lp.idle[i] = pool[:len(pool)-1]
			return
		}
	}
}

// dial opens a new connection to w for ex: a goroutine dials (with the connect timeout) and
// enrolls the connection on this loop; OnOpen then sends what ex queued. A failed dial comes
// back to the loop as a failure of ex.
func (lp *loop) dial(w *route.Worker, ex *exchange) *upstream {
	up := &upstream{lp: lp, w: w, state: upDialing, ex: ex}
	timeout := lp.srv.cfg.ConnectTimeout
	go func() {
		d := net.Dialer{Timeout: timeout}
		conn, err := d.Dial("tcp", w.Addr)
		if err == nil {
			ch, eerr := lp.el.Enroll(gnet.NewContext(context.Background(), up), conn)
			if eerr == nil {
				res := <-ch
				err = res.Err
			} else {
				err = eerr
			}
			// Enroll duplicated the descriptor; ours is no longer needed.
			conn.Close()
		}
		if err != nil {
			_ = lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
				lp.now = nanotime()
				up.dialFailed(err)
				return nil
			}))
		}
	}()
	return up
}

// housekeeping runs on the loop: it enforces read and idle timeouts on clients and the
// first-byte timeout on upstreams, resumes streams paused for slow clients, and closes
// upstream connections idle for longer than the client idle timeout.
func (lp *loop) housekeeping(context.Context) error {
	now := nanotime()
	lp.now = now
	cfg := &lp.srv.cfg
	for cc := lp.clients.next; cc != &lp.clients; {
		next := cc.next
		cc.tick(now, cfg)
		cc = next
	}
	for _, pool := range lp.idle {
		for _, up := range pool {
			if now-up.idleSince > int64(cfg.IdleTimeout) && up.c != nil {
				_ = up.c.Close()
			}
		}
	}
	return nil
}

// nanotime is the proxy's clock: package clock's Now, the data plane's time of day from the
// monotonic clock, so durations, timeouts and the router's ejection and session times all
// agree. A loop reads it once per event (lp.now) and hands that time to the router and the
// index.
func nanotime() int64 { return clock.Now() }
