package decide

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Retry-After follows the queue's drain rate: the time to drain as many requests as wait,
// plus one, at the recent gap between departures; a second without a recent rate; never
// past a minute.
func TestQueueRetryAfterFollowsDrainRate(t *testing.T) {
	q := newAdmissionQueue(16, newMetrics(prometheus.NewRegistry()))
	now := nanotime()
	if got := q.retryAfter(now); got != 1 {
		t.Fatalf("without a drain rate: %d", got)
	}
	for range 3 {
		q.items = append(q.items, &QueueItem{})
	}
	q.gap, q.lastOut = 2e9, now // one departure every 2 s
	if got := q.retryAfter(now); got != 8 {
		t.Fatalf("3 waiting, 2 s apart: %d, want 8", got)
	}
	q.gap = 90e9
	if got := q.retryAfter(now); got != 60 {
		t.Fatalf("a slow queue: %d, want the 60 s bound", got)
	}
	if got := q.retryAfter(now + int64(time.Minute)); got != 1 {
		t.Fatalf("a rate a minute old: %d, want 1", got)
	}
}

// wakeLog is a Waiter that records the order requests were let go in.
type wakeLog struct {
	name string
	out  *[]string
}

func (w wakeLog) Wake(*QueueItem) { *w.out = append(*w.out, w.name) }
func (w wakeLog) Late(*QueueItem) {}

// TestQueueIsFairAcrossFlows: within a priority, the queue lets go the request of the flow
// served fewest tokens for its weight: a flow that queued a burst first does not hold back
// another's requests behind all of it; with weights 3:1 the tokens let go split 3:1; a
// higher priority still goes first; a flow back from idle gets no credit for its idling.
func TestQueueIsFairAcrossFlows(t *testing.T) {
	q := newAdmissionQueue(1000, newMetrics(prometheus.NewRegistry()))
	var out []string
	push := func(name, fl string, weight, cost float64, prio int) {
		var it *QueueItem
		if !q.push(wakeLog{name, &out}, &it, prio, 1<<62, false, flow{fl, weight, cost}) {
			t.Fatal("queue full")
		}
	}
	for i := range 10 {
		push("a"+string(rune('0'+i)), "a", 1, 100, 0)
	}
	push("b0", "b", 1, 100, 0)
	push("b1", "b", 1, 100, 0)
	for range 4 {
		q.release()
	}
	if want := "a0 b0 a1 b1"; strings.Join(out, " ") != want {
		t.Fatalf("released %q, want %q: b's requests interleaved with a's burst", strings.Join(out, " "), want)
	}
	push("urgent", "a", 1, 100, 5)
	q.release()
	if out[len(out)-1] != "urgent" {
		t.Fatalf("a higher priority did not go first: %v", out)
	}

	// Weights 3:1, both backlogged: the tokens let go split 3:1.
	q = newAdmissionQueue(1000, newMetrics(prometheus.NewRegistry()))
	out = nil
	for range 200 {
		push("h", "heavy", 3, 100, 0)
		push("l", "light", 1, 100, 0)
	}
	for range 200 {
		q.release()
	}
	h := 0
	for _, n := range out {
		if n == "h" {
			h++
		}
	}
	if h < 145 || h > 155 {
		t.Fatalf("weights 3:1 let go %d of 200 from the heavier flow, want 150", h)
	}

	// A flow back from idle starts at the least service of those waiting: it does not get
	// every slot until it has caught up with what the busy flow was served meanwhile.
	q = newAdmissionQueue(1000, newMetrics(prometheus.NewRegistry()))
	out = nil
	for range 50 {
		push("busy", "busy", 1, 100, 0)
	}
	for range 40 {
		q.release()
	}
	for range 10 {
		push("back", "back", 1, 100, 0)
	}
	out = nil
	for range 10 {
		q.release()
	}
	if b := count(out, "back"); b < 4 || b > 6 {
		t.Fatalf("a flow back from idle got %d of 10 (%v), want about half", b, out)
	}
}

func count(s []string, x string) int {
	n := 0
	for _, v := range s {
		if v == x {
			n++
		}
	}
	return n
}

// TestQueueEarliestDeadlineFirst: within a priority and a flow, requests with a TTFT target
// go before those without, the nearest deadline first.
func TestQueueEarliestDeadlineFirst(t *testing.T) {
	q := newAdmissionQueue(100, newMetrics(prometheus.NewRegistry()))
	var out []string
	push := func(name string, deadline int64, slo bool) {
		var it *QueueItem
		if !q.push(wakeLog{name, &out}, &it, 0, deadline, slo, flow{"", 1, 100}) {
			t.Fatal("queue full")
		}
	}
	push("plain", 1<<62, false)
	push("slo-late", 3e9, true)
	push("slo-soon", 1e9, true)
	push("plain2", 1<<62, false)
	for range 4 {
		q.release()
	}
	if got, want := strings.Join(out, " "), "slo-soon slo-late plain plain2"; got != want {
		t.Fatalf("released %q, want %q", got, want)
	}
}

// TestQueueAdmitDirect: while requests wait, a new one takes a free slot only when its flow
// has been served less than every waiting flow (it would go first), and that counts as its
// service; a tenant below its share goes anyway; refund gives the service back.
func TestQueueAdmitDirect(t *testing.T) {
	q := newAdmissionQueue(100, newMetrics(prometheus.NewRegistry()))
	var out []string
	var it *QueueItem
	q.push(wakeLog{"a", &out}, &it, 0, 1<<62, false, flow{"a", 1, 100})
	q.served["a"] = 500
	if !q.admitDirect(flow{"b", 1, 100}, false) || q.served["b"] != 100 {
		t.Fatalf("a flow served less than the waiting one: refused, or not charged (%v)", q.served)
	}
	if q.admitDirect(flow{"a", 1, 100}, false) {
		t.Fatal("a new request of the waiting flow went ahead of it")
	}
	q.served["b"] = 600
	if q.admitDirect(flow{"b", 1, 100}, false) {
		t.Fatal("a flow served more than the waiting one went ahead")
	}
	if !q.admitDirect(flow{"b", 1, 100}, true) || q.served["b"] != 700 {
		t.Fatalf("a tenant below its share: refused, or not charged (%v)", q.served)
	}
	q.refund(flow{"b", 1, 100})
	if q.served["b"] != 600 {
		t.Fatalf("refund: %v", q.served)
	}
}
