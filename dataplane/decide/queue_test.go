package decide

import (
	"strconv"
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
		if !q.push(wakeLog{name, &out}, &it, prio, 1<<62, false, flow{name: fl, weight: weight, cost: cost}) {
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
		if !q.push(wakeLog{name, &out}, &it, 0, deadline, slo, flow{weight: 1, cost: 100}) {
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
	q.push(wakeLog{"a", &out}, &it, 0, 1<<62, false, flow{name: "a", weight: 1, cost: 100})
	q.served["a"] = 500
	if !q.admitDirect(flow{name: "b", weight: 1, cost: 100}, false) || q.served["b"] != 100 {
		t.Fatalf("a flow served less than the waiting one: refused, or not charged (%v)", q.served)
	}
	if q.admitDirect(flow{name: "a", weight: 1, cost: 100}, false) {
		t.Fatal("a new request of the waiting flow went ahead of it")
	}
	q.served["b"] = 600
	if q.admitDirect(flow{name: "b", weight: 1, cost: 100}, false) {
		t.Fatal("a flow served more than the waiting one went ahead")
	}
	if !q.admitDirect(flow{name: "b", weight: 1, cost: 100}, true) || q.served["b"] != 700 {
		t.Fatalf("a tenant below its share: refused, or not charged (%v)", q.served)
	}
	q.refund(flow{name: "b", weight: 1, cost: 100})
	if q.served["b"] != 600 {
		t.Fatalf("refund: %v", q.served)
	}
}

// tokenLog is a Waiter that adds up, by name, the tokens of the requests let go.
type tokenLog struct {
	name   string
	tokens float64
	out    map[string]float64
}

func (w tokenLog) Wake(*QueueItem) { w.out[w.name] += w.tokens }
func (w tokenLog) Late(*QueueItem) {}

// TestQueueIsFairAcrossTenantsThenFlows: tenants share the queue by their weights and, within
// a tenant, its flows (fairness ids, and its requests without one) share its part equally:
// a tenant spreading its requests over ten fairness ids gets no more than one with a single
// flow; weights 3:1 still split 3:1; a tenant's two flows split its tokens 1:1 whatever their
// requests' sizes. Without tenants (no API keys) each fairness id is a flow of its own.
func TestQueueIsFairAcrossTenantsThenFlows(t *testing.T) {
	var q *admissionQueue
	var out map[string]float64
	reset := func() {
		q = newAdmissionQueue(100000, newMetrics(prometheus.NewRegistry()))
		out = map[string]float64{}
	}
	// push queues n requests of cost tokens of flow fl of tenant ten, logged as name.
	push := func(n int, name, ten, fl string, weight, cost float64) {
		for range n {
			var it *QueueItem
			if !q.push(tokenLog{name, cost, out}, &it, 0, 1<<62, false, flow{name: fl, tenant: ten, weight: weight, cost: cost}) {
				t.Fatal("queue full")
			}
		}
	}
	// backlog queues 100 requests of 100 tokens for each of ids fairness ids of tenant ten,
	// logged as the tenant.
	backlog := func(ten string, ids int, weight float64) {
		for i := range ids {
			push(100, ten, ten, ten+"/agent-"+strconv.Itoa(i), weight, 100)
		}
	}
	release := func(n int) {
		for range n {
			q.release()
		}
	}
	within := func(what string, got, want float64) {
		t.Helper()
		if got < want*0.95 || got > want*1.05 {
			t.Fatalf("%s: %.0f, want %.0f within 5%% (%v)", what, got, want, out)
		}
	}

	// Equal weights, tenant a's requests over ten fairness ids, b's over one, both
	// backlogged: 1:1.
	reset()
	backlog("a", 10, 1)
	backlog("b", 1, 1)
	push(900, "b", "b", "b/agent-0", 1, 100)
	release(1000)
	within("tenant a's tokens of 100000, at equal weights over 10 fairness ids against 1", out["a"], 50000)

	// Weights 3:1 (a 3 over ten ids, b 1 over one): 3:1.
	reset()
	backlog("a", 10, 3)
	push(1000, "b", "b", "b", 1, 100)
	release(800)
	within("tenant a's tokens of 80000 at weights 3:1", out["a"], 60000)

	// Within one tenant, two fairness ids, one asking 3× the tokens a request, the other's
	// burst queued first: their tokens split 1:1, and the tenant still has half the queue.
	reset()
	push(300, "a/x", "a", "a/x", 1, 100)
	push(100, "a/y", "a", "a/y", 1, 300)
	push(300, "b", "b", "b", 1, 100)
	release(300)
	within("fairness id x's tokens of tenant a's", out["a/x"], (out["a/x"]+out["a/y"])/2)
	within("tenant a's tokens against b's", out["a/x"]+out["a/y"], out["b"])

	// A fairness id back from idle starts at the least of its tenant's waiting ids: it gets
	// about half of its tenant's part, not all of it until it has caught up.
	reset()
	push(100, "a/x", "a", "a/x", 1, 100)
	push(100, "b", "b", "b", 1, 100)
	release(80)
	push(20, "a/y", "a", "a/y", 1, 100)
	clear(out)
	release(40)
	within("tenant a's tokens of 4000 after its second id came", out["a/x"]+out["a/y"], 2000)
	if y := out["a/y"]; y < 800 || y > 1200 {
		t.Fatalf("a fairness id back from idle got %.0f of its tenant's %.0f tokens, want about half", y, out["a/x"]+y)
	}

	// Without tenants, the same eleven fairness ids are eleven flows: a's ten get 10/11.
	reset()
	for i := range 10 {
		push(100, "a", "", "a/agent-"+strconv.Itoa(i), 1, 100)
	}
	push(1000, "b", "", "b", 1, 100)
	release(1100)
	within("a's tokens of 110000 over 10 fairness ids without tenants", out["a"], 100000)
}

// TestQueueAdmitDirectByTenant: a request new to the waiting queue takes a free slot ahead of
// it only when it would go first at both levels: a new fairness id of a tenant served more
// than a waiting one does not, though its own flow has been served nothing; one of the tenant
// served least does, when its flow is served less than the tenant's waiting ones; refund and
// a request queued again give back what was counted, at both levels.
func TestQueueAdmitDirectByTenant(t *testing.T) {
	q := newAdmissionQueue(100, newMetrics(prometheus.NewRegistry()))
	var out []string
	var ia, ib *QueueItem
	q.push(wakeLog{"a", &out}, &ia, 0, 1<<62, false, flow{name: "a/x", tenant: "a", weight: 1, cost: 100})
	q.push(wakeLog{"b", &out}, &ib, 0, 1<<62, false, flow{name: "b", tenant: "b", weight: 1, cost: 100})
	q.tenants["a"], q.served["a/x"] = 500, 500
	q.tenants["b"], q.served["b"] = 300, 300
	if q.admitDirect(flow{name: "a/new", tenant: "a", weight: 1, cost: 100}, false) {
		t.Fatal("a new fairness id of a tenant served more than a waiting one went ahead")
	}
	if !q.admitDirect(flow{name: "b/new", tenant: "b", weight: 1, cost: 100}, false) ||
		q.tenants["b"] != 400 || q.served["b/new"] != 100 {
		t.Fatalf("a new fairness id of the least served tenant: refused, or not charged (%v %v)", q.tenants, q.served)
	}
	if q.admitDirect(flow{name: "b", tenant: "b", weight: 1, cost: 100}, false) {
		t.Fatal("a new request of a waiting flow went ahead of it")
	}
	q.refund(flow{name: "b/new", tenant: "b", weight: 1, cost: 100})
	if q.tenants["b"] != 300 || q.served["b/new"] != 0 {
		t.Fatalf("refund: %v %v", q.tenants, q.served)
	}
	// Let go and queued again (the capacity went to another): what was counted for it is
	// given back at both levels, and it keeps its place.
	q.release()
	if len(out) != 1 || out[0] != "b" || q.tenants["b"] != 400 || q.served["b"] != 400 {
		t.Fatalf("released %v, counted %v %v", out, q.tenants, q.served)
	}
	q.push(wakeLog{"b", &out}, &ib, 0, 1<<62, false, flow{name: "b", tenant: "b", weight: 1, cost: 100})
	if q.tenants["b"] != 300 || q.served["b"] != 300 || ib.seq != 2 {
		t.Fatalf("queued again: %v %v, seq %d", q.tenants, q.served, ib.seq)
	}
}
