package proxy

import (
	"context"
	"strconv"

	"github.com/panjf2000/gnet/v2"

	"github.com/kvrelay/kvrelay/dataplane/decide"
)

// A request that finds every eligible worker busy waits in the routing core's admission
// queue (decide.Request.Enqueue); its connection is the decide.Waiter that resumes it on
// its loop.

// retryAfterHeader formats a Retry-After header line of secs seconds.
func retryAfterHeader(secs int) string {
	return "Retry-After: " + strconv.Itoa(secs) + "\r\n"
}

// enqueue makes the request wait for capacity (slo: for a worker predicted to meet its
// latency targets), or answers the core's refusal (429).
func (cc *clientConn) enqueue(slo bool) {
	if err := cc.in.Enqueue(cc, cc.lp.now, slo); err != nil {
		cc.refuse(err)
		return
	}
	cc.state = stQueued
	cc.queuedAt = cc.lp.now
}

// Wake implements decide.Waiter: the request is decided again on its loop.
func (cc *clientConn) Wake(it *decide.QueueItem) {
	_ = cc.lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
		if cc.state == stQueued && cc.in.Waiting(it) {
			cc.lp.now = nanotime()
			cc.dequeued()
		}
		return nil
	}))
}

// Late implements decide.Waiter: the request is answered 429 (its latency targets passed) or
// 503 (the queue timeout did), on its loop.
func (cc *clientConn) Late(it *decide.QueueItem) {
	_ = cc.lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
		if cc.state == stQueued && cc.in.Waiting(it) {
			cc.lp.now = nanotime()
			cc.refuse(cc.in.Late(cc.lp.now))
		}
		return nil
	}))
}

// dequeued decides again a request the queue released.
func (cc *clientConn) dequeued() {
	cc.state = stForward
	cc.waited += cc.lp.now - cc.queuedAt
	cc.in.Woken()
	retry := cc.ex.active
	cc.route(retry)
}

var _ decide.Waiter = (*clientConn)(nil)
