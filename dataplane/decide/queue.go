package decide

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/route"
)

// admissionQueue holds requests that found every eligible worker busy, most urgent first:
// by priority, then by fair share of tokens in two levels (virtual token counters: each
// request let go adds its prompt and expected output to what its tenant and its flow were
// served), then arrival. First the tenant served the fewest tokens for its weight, then,
// within it, the flow (an agent program's fairness id, or the tenant's requests without one)
// served the fewest tokens: tenants share the queue by their weights and a tenant's flows share
// its part equally, so a tenant gains nothing by spreading its requests over many fairness
// ids. A flow without a tenant (no API keys) stands alone at the first level, weighed as
// itself. So one tenant's or flow's burst waits behind the others' requests of its priority,
// not in front of them. It is shared by all carriers; a request waiting in it is resumed by its
// Waiter, on the carrier's own goroutine.
type admissionQueue struct {
	// n mirrors len(items) so that the common case, an empty queue, costs every finishing
	// request one atomic load instead of a lock shared by all carriers.
	n     atomic.Int64
	mu    sync.Mutex
	items []*QueueItem // in no order: next picks (index is each one's place)
	seq   uint64
	max   int
	m     *metrics
	// The drain rate, for Retry-After: when the last request left the queue and a moving
	// average of the time between departures.
	lastOut int64
	gap     float64
	// tenants is each tenant's virtual service: the tokens its released requests carried,
	// over its weight. served is each flow's: within a tenant, the tokens its released
	// requests carried; for a flow without a tenant, the tokens over its weight (it is its own
	// first level). A tenant or flow that had nothing queued starts again at the least any of
	// its level's queued peers has (lift), so that idling builds it no credit.
	tenants map[string]float64
	served  map[string]float64
}

// maxFlows bounds the flows (and the tenants) the queue remembers the service of; past it,
// those with nothing queued are forgotten.
const maxFlows = 4096

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
	// flow is the request's fair-queuing flow ("" : the default one) and tenant its tenant
	// ("": none); service and tokens are what letting it go counts for them (flow.service,
	// flow.tokens).
	flow, tenant    string
	service, tokens float64
	// released: the queue let it go (and counted its service) since it was last pushed.
	released bool
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
	return &admissionQueue{max: max, m: m, tenants: map[string]float64{}, served: map[string]float64{}}
}

// push queues w's request at priority prio; false when the queue is full. *item is w's
// place in line: nil for a request new to the queue (push sets it), kept for one queued again
// (it keeps its place among equals). slo marks a request waiting for a worker that meets its
// latency targets.
func (q *admissionQueue) push(w Waiter, item **QueueItem, prio int, deadline int64, slo bool, f flow) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) >= q.max {
		return false
	}
	it := *item
	switch {
	case it == nil:
		q.seq++
		it = &QueueItem{w: w, seq: q.seq}
		*item = it
		q.lift(f)
	case it.released:
		// Let go and back again (the capacity it was woken for went to another): the service
		// counted for it was not given.
		q.unserve(it.tenant, it.flow, it.service, it.tokens)
	}
	it.released = false
	it.prio, it.deadline, it.slo = prio, deadline, slo
	it.flow, it.tenant, it.service, it.tokens = f.name, f.tenant, f.service(), f.tokens()
	it.index = len(q.items)
	q.items = append(q.items, it)
	q.n.Store(int64(len(q.items)))
	q.m.queueDepth.Set(float64(len(q.items)))
	return true
}

// remove takes the request whose place is *item out of the queue, if it is there.
func (q *admissionQueue) remove(item **QueueItem) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if it := *item; it != nil && it.index >= 0 && it.index < len(q.items) && q.items[it.index] == it {
		q.removeAt(it.index)
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
	it := q.removeAt(q.next())
	q.serve(it.tenant, it.flow, it.service, it.tokens)
	it.released = true
	if len(q.served) > maxFlows {
		for f := range q.served {
			if !q.queued(f) {
				delete(q.served, f)
			}
		}
	}
	if len(q.tenants) > maxFlows {
		for t := range q.tenants {
			if !q.tenantQueued(t) {
				delete(q.tenants, t)
			}
		}
	}
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

// admitDirect reports whether a request of flow f, new to the queue, may take a free slot
// while others wait: when it would be let go first (first), or anyway (a tenant below its
// share, whose headroom the others leave free). Its service is then counted (refund gives it
// back if it queues after all).
func (q *admissionQueue) admitDirect(f flow, anyway bool) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !anyway && !q.first(f) {
		return false
	}
	q.serve(f.tenant, f.name, f.service(), f.tokens())
	return true
}

// refund gives back the service admitDirect counted for a request of flow f.
func (q *admissionQueue) refund(f flow) {
	q.mu.Lock()
	q.unserve(f.tenant, f.name, f.service(), f.tokens())
	q.mu.Unlock()
}

// serve counts a request of flow f of tenant t let go: service s to its tenant and tokens n
// to its flow within it; s to a flow without a tenant. The caller holds q.mu.
func (q *admissionQueue) serve(t, f string, s, n float64) {
	if t == "" {
		q.served[f] += s
		return
	}
	q.tenants[t] += s
	q.served[f] += n
}

// unserve takes back what serve counted. The caller holds q.mu.
func (q *admissionQueue) unserve(t, f string, s, n float64) {
	if t == "" {
		q.served[f] = max(q.served[f]-s, 0)
		return
	}
	q.tenants[t] = max(q.tenants[t]-s, 0)
	q.served[f] = max(q.served[f]-n, 0)
}

// levels is the service of flow f of tenant t at each level: its tenant's and its own
// within the tenant; a flow without a tenant stands alone at both. The caller holds q.mu.
func (q *admissionQueue) levels(t, f string) (tenant, flow float64) {
	flow = q.served[f]
	if t == "" {
		return flow, flow
	}
	return q.tenants[t], flow
}

// removeAt takes the request at i out of the queue and returns it. The caller holds q.mu.
func (q *admissionQueue) removeAt(i int) *QueueItem {
	it, last := q.items[i], len(q.items)-1
	q.items[i] = q.items[last]
	q.items[i].index = i
	q.items[last] = nil
	q.items = q.items[:last]
	it.index = -1
	return it
}

// flow is a request's fair-queuing flow, its tenant ("": none), the weight (its tenant's, or
// its own without a tenant) and the request's cost (QueueItem).
type flow struct {
	name, tenant string
	weight, cost float64
}

// service is what letting a request of f go counts for its tenant (for a flow without a
// tenant, for the flow): its tokens over the weight.
func (f flow) service() float64 { return max(f.cost, 1) / max(f.weight, minWeight) }

// tokens is what letting a request of f go counts for its flow among its tenant's: its
// tokens, the tenant's flows sharing its part equally.
func (f flow) tokens() float64 { return max(f.cost, 1) }

// minWeight floors a flow's weight.
const minWeight = 1e-3

// next is the index of the request release lets go: the most urgent priority, then the
// tenant served least for its weight, then its flow served least, then a request with a TTFT
// target (x-slo-ttft-ms) by earliest deadline, then the earliest. The caller holds q.mu and
// the queue is not empty.
func (q *admissionQueue) next() int {
	best, b := 0, q.items[0]
	bt, bf := q.levels(b.tenant, b.flow)
	for i := 1; i < len(q.items); i++ {
		it := q.items[i]
		if it.prio != b.prio {
			if it.prio > b.prio {
				best, b = i, it
				bt, bf = q.levels(it.tenant, it.flow)
			}
			continue
		}
		t, f := q.levels(it.tenant, it.flow)
		var first bool
		switch {
		case t != bt:
			first = t < bt
		case f != bf:
			first = f < bf
		case it.slo != b.slo:
			// A request with a TTFT target before one without (its deadline is near).
			first = it.slo
		case it.slo && it.deadline != b.deadline:
			// Earliest deadline first among requests with targets.
			first = it.deadline < b.deadline
		default:
			first = it.seq < b.seq
		}
		if first {
			best, b, bt, bf = i, it, t, f
		}
	}
	return best
}

// lift starts a tenant that had nothing waiting (or a flow without a tenant) at the least
// service of the tenants and lone flows waiting, and a flow that had nothing waiting at the
// least service of its tenant's flows waiting, so that idling builds no credit at either
// level. The caller holds q.mu.
func (q *admissionQueue) lift(f flow) {
	var lt, lf float64 // the least service waiting: of tenants, of f's tenant's flows
	var anyT, anyF, waitsT bool
	for _, it := range q.items {
		if it.flow == f.name && it.tenant == f.tenant {
			return // f waits: so does its tenant
		}
		if it.tenant != "" && it.tenant == f.tenant {
			waitsT = true
			if v := q.served[it.flow]; !anyF || v < lf {
				lf, anyF = v, true
			}
		}
		if v, _ := q.levels(it.tenant, it.flow); !anyT || v < lt {
			lt, anyT = v, true
		}
	}
	switch {
	case f.tenant == "":
		if anyT {
			q.served[f.name] = max(q.served[f.name], lt)
		}
	default:
		if anyT && !waitsT {
			q.tenants[f.tenant] = max(q.tenants[f.tenant], lt)
		}
		if anyF {
			q.served[f.name] = max(q.served[f.name], lf)
		}
	}
}

// queued reports whether a request of flow f waits. The caller holds q.mu.
func (q *admissionQueue) queued(f string) bool {
	for _, it := range q.items {
		if it.flow == f {
			return true
		}
	}
	return false
}

// tenantQueued reports whether a request of tenant t waits. The caller holds q.mu.
func (q *admissionQueue) tenantQueued(t string) bool {
	for _, it := range q.items {
		if it.tenant == t {
			return true
		}
	}
	return false
}

// first reports whether a request of flow f would be let go before every waiting one, but
// for priority and deadlines (next): its tenant served less than every other tenant waiting
// and its flow less than every flow of its tenant waiting. The caller holds q.mu.
func (q *admissionQueue) first(f flow) bool {
	t, fl := q.levels(f.tenant, f.name)
	for _, it := range q.items {
		if vt, vf := q.levels(it.tenant, it.flow); t > vt || (t == vt && fl >= vf) {
			return false
		}
	}
	return true
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
		q.removeAt(oldest.index)
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
	if r.charged {
		c.queue.refund(r.queueFlow()) // it was let in directly, and waits after all
		r.charged = false
	}
	if !c.queue.push(w, &r.qitem, r.prio, deadline, slo, r.queueFlow()) {
		if slo {
			return r.sloUnmet(now)
		}
		r.qitem = nil
		c.m.queued.WithLabelValues("rejected").Inc()
		return &Refusal{Status: 429, Message: "every worker is busy and the admission queue is full", Code: "queue_full", RetryAfter: c.queue.retryAfter(now)}
	}
	return nil
}

// SetFlow names the request's fair-queuing flow in the admission queue (an agent program's
// fairness id, or its tenant's requests without one) and its weight: its tenant's, set by
// SetTenant, whose flows share the tenant's part of the queue equally; without a tenant, the
// flow's own. The default flow, "", weighs 1.
func (r *Request) SetFlow(name string, weight float64) { r.flow, r.flowWeight = name, weight }

// SetTenant names the request's tenant and its share of the fleet (its weight over every
// tenant's): a tenant running that share of the workers' requests (Config.BusyRequests) or
// more may not take their last TenantHeadroom slots, which stay for the tenants below theirs.
func (r *Request) SetTenant(name string, share float64) { r.tenant, r.tenantShare = name, share }

// headroom is the slots of each worker the request may not take: TenantHeadroom when its
// tenant runs its share of the pool's requests or more, else none. It also counts the request
// among its tenant's running ones in the same step, so that two requests routed at once on
// two event loops cannot both find their tenant below its share (Decide undoes it when the
// request does not go).
func (r *Request) headroom(pool *route.Pool) int64 {
	c := r.c
	if !c.keepsHeadroom() || r.tenant == "" {
		return 0
	}
	c.tenantMu.Lock()
	running := c.tenantRunning[r.tenant]
	if r.running {
		running-- // itself, counted by an earlier attempt
	} else {
		c.addRunning(r.tenant, 1)
		r.running = true
	}
	c.tenantMu.Unlock()
	if float64(running) < r.tenantShare*float64(int64(len(pool.Workers))*c.cfg.BusyRequests) {
		return 0
	}
	return c.cfg.TenantHeadroom
}

// countRunning adds d to the request's tenant's running requests (once each way).
func (r *Request) countRunning(d int64) {
	c := r.c
	if !c.keepsHeadroom() || r.tenant == "" || (d > 0) == r.running {
		return
	}
	r.running = d > 0
	c.tenantMu.Lock()
	c.addRunning(r.tenant, d)
	c.tenantMu.Unlock()
}

// keepsHeadroom reports whether tenants' headroom is kept: only then are their running
// requests counted.
func (c *Core) keepsHeadroom() bool { return c.cfg.TenantHeadroom > 0 && c.cfg.BusyRequests > 0 }

// addRunning adds d to tenant's running requests. The caller holds c.tenantMu.
func (c *Core) addRunning(tenant string, d int64) {
	if c.tenantRunning == nil {
		c.tenantRunning = map[string]int64{}
	}
	if n := c.tenantRunning[tenant] + d; n > 0 {
		c.tenantRunning[tenant] = n
	} else {
		delete(c.tenantRunning, tenant)
	}
}

// queueFlow is the request's flow, weight and cost in the admission queue: its prompt and
// expected output in tokens.
func (r *Request) queueFlow() flow {
	out := r.rreq.OSL
	if o := &r.oreq; o.HasMaxTokens && o.MaxTokens > 0 {
		out = o.MaxTokens
	}
	if out <= 0 {
		out = defaultFlowOutput
	}
	w := r.flowWeight
	if w <= 0 {
		w = 1
	}
	return flow{name: r.flow, tenant: r.tenant, weight: w, cost: float64(r.rreq.PromptTokens + out)}
}

// defaultFlowOutput is the output assumed of a request that states none, for its cost in the
// admission queue.
const defaultFlowOutput = 256

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
