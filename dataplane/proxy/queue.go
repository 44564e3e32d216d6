package proxy

import (
	"container/heap"
	"context"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/panjf2000/gnet/v2"
)

// admissionQueue holds requests that found every eligible worker busy, most urgent first
// (priority, then arrival). It is shared by all loops; a request waiting in it is resumed on
// its own loop through gnet's Execute.
type admissionQueue struct {
	// n mirrors len(items) so that the common case, an empty queue, costs every finishing
	// request one atomic load instead of a lock shared by all loops.
	n     atomic.Int64
	mu    sync.Mutex
	items queueHeap
	seq   uint64
	max   int
	m     *metrics
	// The drain rate, for Retry-After: when the last request left the queue and a moving
	// average of the time between departures.
	lastOut int64
	gap     float64
}

// maxRetryAfter bounds the Retry-After the proxy sends, in seconds.
const maxRetryAfter = 60

// retryAfter is the Retry-After header for a request refused now: the time the queue takes
// to drain as many requests as it holds plus one, at its recent rate (the last 30 s); one
// second when it has none.
func (q *admissionQueue) retryAfter(now int64) string {
	q.mu.Lock()
	depth, gap, last := len(q.items), q.gap, q.lastOut
	q.mu.Unlock()
	secs := 1
	if gap > 0 && now-last < int64(30*time.Second) {
		secs = int(math.Ceil(float64(depth+1) * gap / 1e9))
	}
	return retryAfterHeader(secs)
}

// retryAfterHeader formats a Retry-After header line of secs seconds, within [1, maxRetryAfter].
func retryAfterHeader(secs int) string {
	return "Retry-After: " + strconv.Itoa(min(max(secs, 1), maxRetryAfter)) + "\r\n"
}

type queueItem struct {
	w        waiter
	prio     int
	seq      uint64
	deadline int64
	index    int
	// slo: the request waits for a worker predicted to meet its latency targets, and its
	// deadline is the TTFT target's.
	slo bool
}

// waiter is a request waiting in the admission queue: a client connection of the proxy,
// resumed on its loop, or a pick of the endpoint picker, resumed on its stream's goroutine.
// Both methods are called without the queue's lock, from any goroutine.
type waiter interface {
	// wake re-routes the request the queue released; it is the waiter's item it.
	wake(it *queueItem)
	// late answers the request whose item it waited past its deadline.
	late(it *queueItem)
}

func newAdmissionQueue(max int, m *metrics) *admissionQueue {
	return &admissionQueue{max: max, m: m}
}

// push queues w's request at priority prio; false when the queue is full. *item is w's
// place in line: nil for a request new to the queue (push sets it), kept for one queued again
// (it keeps its place among equals). slo marks a request waiting for a worker that meets its
// latency targets.
func (q *admissionQueue) push(w waiter, item **queueItem, prio int, deadline int64, slo bool) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) >= q.max {
		return false
	}
	it := *item
	if it == nil {
		q.seq++
		it = &queueItem{w: w, seq: q.seq}
		*item = it
	}
	it.prio, it.deadline, it.slo = prio, deadline, slo
	heap.Push(&q.items, it)
	q.n.Store(int64(len(q.items)))
	q.m.queueDepth.Set(float64(len(q.items)))
	return true
}

// remove takes the request whose place is *item out of the queue, if it is there.
func (q *admissionQueue) remove(item **queueItem) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if it := *item; it != nil && it.index >= 0 && it.index < len(q.items) && q.items[it.index] == it {
		heap.Remove(&q.items, it.index)
	}
	*item = nil
	q.n.Store(int64(len(q.items)))
	q.m.queueDepth.Set(float64(len(q.items)))
}

// release is called when capacity frees: the most urgent waiting request is re-routed on its
// loop.
func (q *admissionQueue) release(*Server) {
	if q.n.Load() == 0 {
		return
	}
	q.mu.Lock()
	if len(q.items) == 0 {
		q.mu.Unlock()
		return
	}
	it := heap.Pop(&q.items).(*queueItem)
	if now := nanotime(); q.lastOut > 0 {
		d := float64(now - q.lastOut)
		if q.gap == 0 {
			q.gap = d
		} else {
			q.gap += 0.2 * (d - q.gap)
		}
		q.lastOut = now
	} else {
		q.lastOut = now
	}
	q.n.Store(int64(len(q.items)))
	q.m.queueDepth.Set(float64(len(q.items)))
	q.mu.Unlock()
	it.w.wake(it)
}

// expire answers requests that waited past their deadline with 503, and nudges the queue in
// case load reports freed capacity without a request finishing here.
func (q *admissionQueue) expire(now int64) {
	var late []*queueItem
	q.mu.Lock()
	for len(q.items) > 0 {
		var oldest *queueItem
		for _, it := range q.items {
			if it.deadline <= now && (oldest == nil || it.deadline < oldest.deadline) {
				oldest = it
			}
		}
		if oldest == nil {
			break
		}
		heap.Remove(&q.items, oldest.index)
		late = append(late, oldest)
	}
	n := len(q.items)
	q.n.Store(int64(n))
	q.m.queueDepth.Set(float64(n))
	q.mu.Unlock()
	for _, it := range late {
		it.w.late(it)
	}
	if n > 0 {
		q.release(nil)
	}
}

// enqueue makes the request wait for capacity, or answers 429 when the queue is full.
func (cc *clientConn) enqueue() {
	s := cc.srv
	if cc.qitem == nil {
		cc.queuedAt = cc.lp.now // first time in the queue; re-queues keep their deadline
	}
	if !s.queue.push(cc, &cc.qitem, cc.prio, cc.queuedAt+int64(s.cfg.QueueTimeout), false) {
		s.metrics.queued.WithLabelValues("rejected").Inc()
		if cc.ex.active {
			cc.ex.status = 429
			cc.ex.finish()
		}
		cc.qitem = nil
		cc.errorReplyHeader(429, "every worker is busy and the admission queue is full", "", "queue_full", s.queue.retryAfter(cc.lp.now))
		return
	}
	cc.state = stQueued
}

// enqueueSLO makes a request that no worker is predicted to serve within its latency
// targets wait for one, until its TTFT target (or the queue timeout) passes; without a
// queue, or with it full, or with only a TPOT target, it is refused at once with 429.
func (cc *clientConn) enqueueSLO() {
	s := cc.srv
	if cc.sloTTFT == 0 || s.cfg.QueueSize == 0 {
		cc.sloRefused()
		return
	}
	if cc.qitem == nil {
		cc.queuedAt = cc.lp.now
	}
	deadline := min(cc.queuedAt+int64(s.cfg.QueueTimeout), cc.arrived+int64(cc.sloTTFT*1e6))
	if !s.queue.push(cc, &cc.qitem, cc.prio, deadline, true) {
		cc.sloRefused()
		return
	}
	cc.state = stQueued
}

// sloRefused answers 429: no worker is predicted to meet the request's latency targets.
func (cc *clientConn) sloRefused() {
	s := cc.srv
	s.metrics.queued.WithLabelValues("slo_unmet").Inc()
	if cc.ex.active {
		cc.ex.status = 429
		cc.ex.finish()
	}
	cc.qitem = nil
	cc.errorReplyHeader(429, "no worker is predicted to meet the request's latency targets (x-slo-ttft-ms, x-slo-tpot-ms)", "", "slo_unmet", s.queue.retryAfter(cc.lp.now))
}

// wake implements waiter: the request is re-routed on its loop.
func (cc *clientConn) wake(it *queueItem) {
	_ = cc.lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
		if cc.state == stQueued && cc.qitem == it {
			cc.lp.now = nanotime()
			cc.dequeued()
		}
		return nil
	}))
}

// late implements waiter: the request is answered 429 (its latency targets passed) or
// 503 (the queue timeout did), on its loop.
func (cc *clientConn) late(it *queueItem) {
	s := cc.srv
	_ = cc.lp.el.Execute(context.Background(), gnet.RunnableFunc(func(context.Context) error {
		if cc.state == stQueued && cc.qitem == it {
			cc.lp.now = nanotime()
			cc.qitem = nil
			if it.slo {
				cc.sloRefused()
				return nil
			}
			s.metrics.queued.WithLabelValues("timeout").Inc()
			cc.errorReplyHeader(503, "no worker had capacity within the queue timeout", "", "queue_timeout", s.queue.retryAfter(cc.lp.now))
		}
		return nil
	}))
}

// dequeued re-routes a request the queue released.
func (cc *clientConn) dequeued() {
	cc.state = stForward
	cc.srv.metrics.queued.WithLabelValues("dispatched").Inc()
	retry := cc.ex.active
	cc.route(retry)
}

type queueHeap []*queueItem

func (h queueHeap) Len() int { return len(h) }
func (h queueHeap) Less(i, j int) bool {
	if h[i].prio != h[j].prio {
		return h[i].prio > h[j].prio // higher is more urgent
	}
	return h[i].seq < h[j].seq
}
func (h queueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *queueHeap) Push(x any) {
	it := x.(*queueItem)
	it.index = len(*h)
	*h = append(*h, it)
}
func (h *queueHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	it.index = -1
	return it
}
