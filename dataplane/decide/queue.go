package decide

import (
	"container/heap"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// admissionQueue holds requests that found every eligible worker busy, most urgent first
// (priority, then arrival). It is shared by all carriers; a request waiting in it is
// resumed by its Waiter, on the carrier's own goroutine.
type admissionQueue struct {
	// n mirrors len(items) so that the common case, an empty queue, costs every finishing
	// request one atomic load instead of a lock shared by all carriers.
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

// retryAfter is the Retry-After, in seconds, of a request refused now: the time the queue
// takes to drain as many requests as it holds plus one, at its recent rate (the last 30 s);
// one second when it has none; never past maxRetryAfter.
func (q *admissionQueue) retryAfter(now int64) int {
	q.mu.Lock()
	depth, gap, last := len(q.items), q.gap, q.lastOut
	q.mu.Unlock()
	secs := 1
	if gap > 0 && now-last < int64(30*time.Second) {
		secs = int(math.Ceil(float64(depth+1) * gap / 1e9))
	}
	return clampRetryAfter(secs)
}

// QueueItem is a request's place in the admission queue.
type QueueItem struct {
	w        Waiter
	prio     int
	seq      uint64
	deadline int64
	index    int
	// slo: the request waits for a worker predicted to meet its latency targets, and its
	// deadline is the TTFT target's.
	slo bool
}

// Waiter is a request's carrier while it waits in the admission queue: a client connection
// of the proxy, resumed on its event loop, or a pick, resumed on its stream's goroutine.
// Both methods are called from any goroutine, without the queue's lock, and must hand the
// request back to its carrier's own goroutine (which checks Request.Waiting(it) first: the
// request may have moved on meanwhile).
type Waiter interface {
	// Wake: capacity freed; the carrier calls Request.Woken and decides again.
	Wake(it *QueueItem)
	// Late: the request waited past its deadline; the carrier answers Request.Late's
	// refusal.
	Late(it *QueueItem)
}

func newAdmissionQueue(max int, m *metrics) *admissionQueue {
	return &admissionQueue{max: max, m: m}
}

// push queues w's request at priority prio; false when the queue is full. *item is w's
// place in line: nil for a request new to the queue (push sets it), kept for one queued again
// (it keeps its place among equals). slo marks a request waiting for a worker that meets its
// latency targets.
func (q *admissionQueue) push(w Waiter, item **QueueItem, prio int, deadline int64, slo bool) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) >= q.max {
		return false
	}
	it := *item
	if it == nil {
		q.seq++
		it = &QueueItem{w: w, seq: q.seq}
		*item = it
	}
	it.prio, it.deadline, it.slo = prio, deadline, slo
	heap.Push(&q.items, it)
	q.n.Store(int64(len(q.items)))
	q.m.queueDepth.Set(float64(len(q.items)))
	return true
}

// remove takes the request whose place is *item out of the queue, if it is there.
func (q *admissionQueue) remove(item **QueueItem) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if it := *item; it != nil && it.index >= 0 && it.index < len(q.items) && q.items[it.index] == it {
		heap.Remove(&q.items, it.index)
	}
	*item = nil
	q.n.Store(int64(len(q.items)))
	q.m.queueDepth.Set(float64(len(q.items)))
}

// release is called when capacity frees: the most urgent waiting request is woken.
func (q *admissionQueue) release() {
	if q.n.Load() == 0 {
		return
	}
	q.mu.Lock()
	if len(q.items) == 0 {
		q.mu.Unlock()
		return
	}
	it := heap.Pop(&q.items).(*QueueItem)
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
	it.w.Wake(it)
}

// expire answers requests that waited past their deadline, and nudges the queue in case
// load reports freed capacity without a request finishing here.
func (q *admissionQueue) expire(now int64) {
	var late []*QueueItem
	q.mu.Lock()
	for len(q.items) > 0 {
		var oldest *QueueItem
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
		it.w.Late(it)
	}
	if n > 0 {
		q.release()
	}
}

// Enqueue makes the request wait in the admission queue, by its priority, for a worker
// under its busy thresholds (slo: for one predicted to meet its latency targets, at most
// until its TTFT target passes), woken or told it is late through w; a request queued
// again keeps its place among equals and its deadline (the queue timeout from its first
// wait). A *Refusal when it cannot wait: the queue is full, or for slo, it has only a TPOT
// target or there is no queue.
func (r *Request) Enqueue(w Waiter, now int64, slo bool) error {
	c := r.c
	if slo && (r.sloTTFT == 0 || c.cfg.QueueSize == 0) {
		return r.sloUnmet(now)
	}
	if r.qitem == nil {
		r.queuedAt = now // first time in the queue; re-queues keep their deadline
	}
	deadline := r.queuedAt + int64(c.cfg.QueueTimeout)
	if slo {
		deadline = min(deadline, r.arrived+int64(r.sloTTFT*1e6))
	}
	if !c.queue.push(w, &r.qitem, r.prio, deadline, slo) {
		if slo {
			return r.sloUnmet(now)
		}
		r.qitem = nil
		c.m.queued.WithLabelValues("rejected").Inc()
		return &Refusal{Status: 429, Message: "every worker is busy and the admission queue is full", Code: "queue_full", RetryAfter: c.queue.retryAfter(now)}
	}
	return nil
}

// Waiting reports whether it is the request's place in the queue: a Waiter's word about it
// is news to the request.
func (r *Request) Waiting(it *QueueItem) bool { return r.qitem == it && it != nil }

// Woken counts a request the queue let go; its carrier decides it again.
func (r *Request) Woken() { r.c.m.queued.WithLabelValues("dispatched").Inc() }

// Late is the answer to a request that waited past its deadline: 503, or 429 when it
// waited for its latency targets.
func (r *Request) Late(now int64) *Refusal {
	it := r.qitem
	r.qitem = nil
	if it != nil && it.slo {
		return r.sloUnmet(now)
	}
	r.c.m.queued.WithLabelValues("timeout").Inc()
	return &Refusal{Status: 503, Message: "no worker had capacity within the queue timeout", Code: "queue_timeout", RetryAfter: r.c.queue.retryAfter(now)}
}

// Abandon takes a request whose client left out of the queue.
func (r *Request) Abandon() {
	r.c.queue.remove(&r.qitem)
	r.c.m.queued.WithLabelValues("abandoned").Inc()
}

// Shed refuses a sheddable request (below the default priority) at once instead of
// queueing it, as a gateway's endpoint picker does: the client retries later.
func (r *Request) Shed(now int64) *Refusal {
	r.c.m.queued.WithLabelValues("rejected").Inc()
	return &Refusal{Status: 429, Message: "every worker is busy; sheddable requests are not queued", Code: "shed", RetryAfter: r.c.queue.retryAfter(now)}
}

// sloUnmet is the answer to a request no worker is predicted to serve within its latency
// targets: 429.
func (r *Request) sloUnmet(now int64) *Refusal {
	r.qitem = nil
	r.c.m.queued.WithLabelValues("slo_unmet").Inc()
	return &Refusal{Status: 429, Message: "no worker is predicted to meet the request's latency targets (x-slo-ttft-ms, x-slo-tpot-ms)", Code: "slo_unmet", RetryAfter: r.c.queue.retryAfter(now)}
}

type queueHeap []*QueueItem

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
	it := x.(*QueueItem)
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
