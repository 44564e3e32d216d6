package route

import (
	"math"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/clock"
	"github.com/kvrelay/kvrelay/dataplane/latency"
)

// Role is what a worker does in a disaggregated deployment.
type Role uint8

// Worker roles.
const (
	RoleBoth Role = iota
	RolePrefill
	RoleDecode
)

// Worker is one upstream engine as the router sees it. The identity fields are set before the
// worker joins a Pool and never change; the load and health fields are atomics that every
// event loop updates.
type Worker struct {
	// ID names the worker in metrics, logs and the x-kvrelay-worker header.
	ID string
	// Index is the worker's position in its Pool; scorers index caller-owned slices by it.
	Index int
	// URL is the engine's base URL (scheme://host:port) and Addr its host:port.
	URL, Addr string
	// Model is the model the worker serves; "" serves any.
	Model string
	// LoRAs are the LoRA adapters the worker serves beside Model: a request naming one is
	// routed among the workers that list it, its blocks keyed by the adapter.
	LoRAs []string
	// MaxModelLen is the engine's context length in tokens (0: unknown).
	MaxModelLen int
	Role        Role
	// BlockSize is the engine's KV block size in tokens.
	BlockSize int
	// Capacity is the engine's KV cache size in blocks, 0 when unknown.
	Capacity int
	// Engine is what the latency policy knows of the engine's scheduler: its concurrency
	// limit and step budget (zero: unknown; the limit is then learned from reports).
	Engine latency.Engine
	// Pins: the engine keeps a prompt a request pins (nvext.cache_control), so the proxy's
	// own index may keep it matched for the pin's time (engines.Kind.Pins).
	Pins bool
	// P2PPort is the engine's P2P side channel (vLLM's OffloadingConnector p2p tier): a
	// peer pull from it names this port, and a disaggregated request's legs take the p2p
	// form; 0: NixlConnector's form, and peers pulled from at Addr.
	P2PPort int

	inflight      atomic.Int64
	interactive   atomic.Int64 // this proxy's requests here with a priority above 0
	prefillTokens atomic.Int64
	decodeBlocks  atomic.Int64
	cachedBlocks  atomic.Int64
	reported      atomic.Pointer[Reported]
	// ownAtReport is this proxy's requests in flight on the worker when the last report
	// arrived: the report's running and waiting counts beyond them are other proxies'.
	ownAtReport atomic.Int64

	// The prefill backlog model (PrefillBacklog): this proxy's uncached tokens still to
	// compute, backlog tokens at backlogAt, drained at the learned rate (float64 bits,
	// tokens per second; 0 until learned). bl guards the writes and the rate's sums.
	bl         sync.Mutex
	backlog    atomic.Int64
	backlogAt  atomic.Int64
	rate       atomic.Uint64
	lastFirst  int64   // when the last of this proxy's requests here got its first token
	rateTokens float64 // decayed sums of prefill tokens and the time they took
	rateNanos  float64
	// decoding holds, for each of this proxy's requests here that is past its first token,
	// when it got it (Clock time) and the output expected of it, for the slot wait
	// (DecodingLeft); guarded by bl.
	decoding []decodingReq

	ejectedUntil atomic.Int64 // unix nanos
	lastHeard    atomic.Int64 // when the worker last sent bytes (Heard)
	failures     atomic.Int32
	draining     atomic.Bool

	// lat is the worker's part of the latency model (policy latency), tied to the Model
	// that the workers of its model and role share (NewPoolIndexed); latOnce ties it, once.
	lat      latency.Worker
	latOnce  sync.Once
	latModel atomic.Pointer[latency.Model]
	latAlone atomic.Bool // latModel is the worker's own, not a pool's
}

// Latency returns the worker's latency model. A worker outside any pool gets a model of its
// own, until a pool ties it to its model's shared one (NewPool): what it learned alone
// (from a report before it joined, say) of itself stays; what its lone model learned is
// dropped.
func (w *Worker) Latency() *latency.Worker {
	w.attachModel(nil)
	return &w.lat
}

// attachModel ties the worker to m (nil: a new model of its own), unless it is tied
// already: to a model of its own, it is tied to m instead. A pool ties its workers before
// it is published, while no other goroutine routes over them.
func (w *Worker) attachModel(m *latency.Model) {
	w.latOnce.Do(func() {
		alone := m == nil
		if alone {
			m = new(latency.Model)
			m.Init()
		}
		w.lat.Init(m)
		w.latModel.Store(m)
		w.latAlone.Store(alone)
	})
	if m != nil && w.latAlone.Load() && w.latModel.Load() != m {
		w.lat.Retie(m)
		w.latModel.Store(m)
		w.latAlone.Store(false)
	}
}

// P2PAddr is where a peer pulls KV from this worker (host:port): its P2P side channel when
// it has one, else its own address.
func (w *Worker) P2PAddr() string {
	if w.P2PPort <= 0 {
		return w.Addr
	}
	host, _, err := net.SplitHostPort(w.Addr)
	if err != nil {
		host = w.Addr
	}
	return net.JoinHostPort(host, strconv.Itoa(w.P2PPort))
}

// Interactive is the number of this proxy's requests on the worker with a priority above 0.
func (w *Worker) Interactive() int64 { return w.interactive.Load() }

// Reported is what the engine itself (through a control plane or a metrics scrape) says of
// its load. A nil report means nothing is known beyond this proxy's own requests.
type Reported struct {
	Running, Waiting int
	// KVUsage is the fraction of the KV cache in use.
	KVUsage float64
	// PrefillTokens and DecodeBlocks are in flight from other proxies.
	PrefillTokens int
	DecodeBlocks  int
}

// SetReported replaces the engine-reported load; nil clears it. A report teaches the latency
// model the engine's concurrency limit: at least what runs, and what runs while requests
// wait.
func (w *Worker) SetReported(r *Reported) {
	w.ownAtReport.Store(w.inflight.Load())
	w.reported.Store(r)
	if r != nil {
		w.Latency().ObserveReport(r.Running, r.Waiting)
	}
}

// FadeReported replaces the engine-reported load with a faded copy of the last report (its
// source has gone quiet); unlike SetReported it teaches the latency model nothing.
func (w *Worker) FadeReported(r *Reported) { w.reported.Store(r) }

// Inflight is the number of this proxy's requests on the worker.
func (w *Worker) Inflight() int64 { return w.inflight.Load() }

// PrefillTokens is the uncached prompt tokens of this proxy's requests not yet past their
// first token, plus what the engine reports from others.
func (w *Worker) PrefillTokens() int64 {
	n := w.prefillTokens.Load()
	if r := w.reported.Load(); r != nil {
		n += int64(r.PrefillTokens)
	}
	return n
}

// Clock is the router's monotonic clock in nanoseconds (package clock's Mono). Tests replace
// it to drive the calls that read it (Begin, FirstToken, a Request without Now); a call given
// a time (ClockAt with now != 0) converts that time instead and never reads Clock.
var Clock = clock.Mono

// Rand, when set, is the routers' randomness (exploration, the random and weighted pickers,
// the power of two choices' draw) in place of math/rand/v2's global source: a replay that
// runs every decision on one goroutine sets a seeded one to make the same decisions every
// time. A *rand.Rand is not safe for concurrent use: never set it where event loops route.
var Rand *rand.Rand

func randFloat64() float64 {
	if Rand != nil {
		return Rand.Float64()
	}
	return rand.Float64()
}

func randIntN(n int) int {
	if Rand != nil {
		return Rand.IntN(n)
	}
	return rand.IntN(n)
}

// Now is the data plane's time of day in Unix nanoseconds (package clock). Every absolute
// time the router and the proxy compare (ejections, sessions, the proxy loops' now, queue
// deadlines) comes from it.
func Now() int64 { return clock.Now() }

// ClockAt converts now, a time of day from Now, to the router's Clock; 0 reads Clock. An
// event loop reads the clock once per event and hands that time down (Request.Now,
// Usage.BeginAt, Usage.FirstTokenAt), so routing a request reads no clock of its own.
func ClockAt(now int64) int64 {
	if now == 0 {
		return Clock()
	}
	return clock.MonoAt(now)
}

// rateDecay weighs each new sample of a worker's prefill rate against the ones before: the
// estimate follows the last ~50 first tokens.
const rateDecay = 0.98

// PrefillBacklog is the uncached prompt tokens the worker still has to compute before a new
// request's prefill can start, as this proxy estimates it at now: its own requests' tokens
// not yet past their first token, less what the engine has computed since, at the rate this
// worker was seen to prefill (learned from the time between first tokens; until then nothing
// is taken off), plus what the engine reports from other proxies. PrefillTokens counts a
// request's whole prompt until its first token; an engine computes prefill first come, first
// served, one chunk a step, so a long prompt that started seconds ago has mostly been
// computed, and the backlog says so.
func (w *Worker) PrefillBacklog(now int64) int64 {
	n := w.ownBacklog(now)
	if r := w.reported.Load(); r != nil {
		n += int64(r.PrefillTokens)
	}
	return n
}

// ownBacklog is the backlog model at now: the backlog of the last update less what the
// learned rate computed since, never below 0 nor above this proxy's tokens still pending.
// Without a rate it is the pending tokens. Writers (Begin, FirstToken) hold w.bl.
func (w *Worker) ownBacklog(now int64) int64 {
	// backlog before backlogAt: writers store the time first, so a concurrent update pairs
	// an old backlog with a newer time at worst, which drains too little.
	b := w.backlog.Load()
	if r := math.Float64frombits(w.rate.Load()); r > 0 {
		b -= int64(r * float64(max(0, now-w.backlogAt.Load())) / 1e9)
	}
	return min(max(b, 0), w.prefillTokens.Load())
}

// DecodeBlocks is the KV blocks this proxy's requests hold or are predicted to hold on the
// worker, plus what the engine reports from others.
func (w *Worker) DecodeBlocks() int64 {
	n := w.decodeBlocks.Load()
	if r := w.reported.Load(); r != nil {
		n += int64(r.DecodeBlocks)
	}
	return n
}

// Load is the number of requests on the worker: this proxy's in flight now, plus the
// engine's running and waiting requests that were not this proxy's when it last reported.
// A report is up to a load interval old; this proxy's own count is current, so a request of
// its own that finished since is gone at once, and one it sent since counts at once, where
// the report alone would hold the worker's load where it was.
func (w *Worker) Load() int64 {
	n := w.inflight.Load()
	if r := w.reported.Load(); r != nil {
		if others := int64(r.Running+r.Waiting) - w.ownAtReport.Load(); others > 0 {
			n += others
		}
	}
	return n
}

// SetCachedBlocks records how many blocks the proxy's prefix index believes the worker
// caches beyond what its requests in flight hold.
func (w *Worker) SetCachedBlocks(n int64) { w.cachedBlocks.Store(n) }

// KVInUse is the fraction of the worker's KV cache in use: the engine's report, or this
// proxy's view (blocks its requests hold plus blocks its index believes cached) over the
// capacity, or (capacity unknown) those blocks themselves, which still order workers
// correctly against each other. Counting cached blocks makes new prefixes go to the
// workers whose caches hold least, so that they evict least.
func (w *Worker) KVInUse() float64 {
	if r := w.reported.Load(); r != nil {
		return r.KVUsage
	}
	n := float64(w.decodeBlocks.Load() + w.cachedBlocks.Load())
	if w.Capacity > 0 {
		return n / float64(w.Capacity)
	}
	return n
}

// Healthy reports whether the worker takes new requests at time now: not ejected after
// failures and not draining.
func (w *Worker) Healthy(now int64) bool {
	return !w.draining.Load() && w.ejectedUntil.Load() <= now
}

// SetDraining marks the worker as draining (no new requests) or not.
func (w *Worker) SetDraining(d bool) { w.draining.Store(d) }

// Draining reports whether the worker is draining.
func (w *Worker) Draining() bool { return w.draining.Load() }

// EjectedUntil is when an ejected worker may be probed again (0 when not ejected).
func (w *Worker) EjectedUntil() time.Time {
	if n := w.ejectedUntil.Load(); n > 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Heard records that the worker sent bytes at now (the proxy's clock); LastHeard is when it
// last did, 0 before it ever has. A worker silent on every connection is hung, not busy.
func (w *Worker) Heard(now int64) {
	if w.lastHeard.Load() < now {
		w.lastHeard.Store(now)
	}
}

// LastHeard is when the worker last sent bytes (see Heard).
func (w *Worker) LastHeard() int64 { return w.lastHeard.Load() }

// EjectedFor is how long from now (on the clock Failed was given) the worker stays ejected,
// 0 when it is not.
func (w *Worker) EjectedFor(now int64) time.Duration {
	return time.Duration(max(w.ejectedUntil.Load()-now, 0))
}

// Succeeded records a request that reached the engine and got an answer: the failure streak
// ends and an ejected worker is back.
func (w *Worker) Succeeded() {
	if w.failures.Load() != 0 {
		w.failures.Store(0)
	}
	if w.ejectedUntil.Load() != 0 {
		w.ejectedUntil.Store(0)
	}
}

// Failed records a failure to reach the worker or a 5xx before any response byte. After
// threshold consecutive failures the worker is ejected for backoff, and it reports true the
// moment that happens. A worker past its ejection gets requests again (the probe): one more
// failure ejects it anew.
func (w *Worker) Failed(now int64, threshold int, backoff time.Duration) (ejected bool) {
	n := w.failures.Add(1)
	if int(n) < threshold {
		return false
	}
	w.ejectedUntil.Store(now + int64(backoff))
	w.failures.Store(0)
	return true
}

// Usage is what one request adds to its worker's load; the proxy keeps it in the request's
// state and updates it as the request progresses, and End removes exactly what was added.
// With a latency prediction (Predicted) it also teaches the worker's latency model what
// the request really took.
type Usage struct {
	w             *Worker
	prefillTokens int64
	decodeBlocks  int64
	promptTokens  int
	osl           int
	interactive   bool
	begun         int64 // Clock at Begin
	firstAt       int64 // Clock at the first token, 0 before

	// The latency prediction the request was routed on, when it was.
	pred    latency.Prediction
	hasPred bool
	learn   bool    // the response streams: its first token is its TTFT
	batch   int     // the worker's batch size with this request, at dispatch
	kv      float64 // and its KV usage
	ttft    float64
}

// Begin starts accounting a request on w: uncached prompt tokens to prefill and the blocks
// it will hold (prompt plus expected output, when osl predicts it).
func (u *Usage) Begin(w *Worker, promptTokens, cachedTokens, osl int) {
	u.BeginAt(0, w, promptTokens, cachedTokens, osl)
}

// BeginAt is Begin at now, a time of day from Now (0: read the clock).
func (u *Usage) BeginAt(now int64, w *Worker, promptTokens, cachedTokens, osl int) {
	bs := max(w.BlockSize, 1)
	now = ClockAt(now)
	*u = Usage{w: w, prefillTokens: int64(max(promptTokens-cachedTokens, 0)), promptTokens: promptTokens, osl: osl, begun: now}
	u.decodeBlocks = int64((promptTokens + osl + bs - 1) / bs)
	w.inflight.Add(1)
	w.decodeBlocks.Add(u.decodeBlocks)
	w.bl.Lock()
	b := w.ownBacklog(now)
	w.prefillTokens.Add(u.prefillTokens)
	w.backlogAt.Store(now)
	w.backlog.Store(b + u.prefillTokens)
	w.bl.Unlock()
}

// Predicted attaches the latency prediction the request was routed on (Decision.Prediction)
// and its priority: a streamed request (learn) teaches the worker's model its TTFT at the
// first token and its decode at Completed; a priority above 0 counts as interactive on the
// worker while it runs. Call it right after Begin.
func (u *Usage) Predicted(d *Decision, priority int, learn bool) {
	if u.w == nil {
		return
	}
	if priority > 0 && !u.interactive {
		u.interactive = true
		u.w.interactive.Add(1)
	}
	if d == nil || !d.HasPrediction {
		return
	}
	u.pred, u.hasPred, u.learn = d.Prediction, true, learn
	u.batch = int(u.w.Load())
	if s := u.w.Latency().MaxNumSeqs(&u.w.Engine); s > 0 {
		u.batch = min(u.batch, s)
	}
	u.kv = u.w.KVInUse()
}

// FirstToken ends the request's prefill. It also teaches the worker's backlog model how fast
// the engine prefills: with requests served first come, first served, the engine computed
// this request's uncached tokens between the later of its start and the previous first token
// there, and now.
func (u *Usage) FirstToken() { u.FirstTokenAt(0) }

// FirstTokenAt is FirstToken at now, a time of day from Now (0: read the clock).
func (u *Usage) FirstTokenAt(now int64) {
	if u.w == nil || u.firstAt != 0 {
		return
	}
	w := u.w
	now = ClockAt(now)
	u.firstAt = now
	if u.hasPred && u.learn {
		u.ttft = float64(now-u.begun) / 1e9
		w.Latency().ObserveTTFTAt(now, &u.pred, u.ttft)
	}
	w.bl.Lock()
	w.decoding = append(w.decoding, decodingReq{at: now, osl: u.osl})
	if u.prefillTokens == 0 {
		w.bl.Unlock()
		return
	}
	if took := now - max(u.begun, w.lastFirst); took > 0 {
		w.rateTokens = w.rateTokens*rateDecay + float64(u.prefillTokens)
		w.rateNanos = w.rateNanos*rateDecay + float64(took)
		w.rate.Store(math.Float64bits(w.rateTokens / w.rateNanos * 1e9))
	}
	w.lastFirst = max(w.lastFirst, now)
	// Everything in front of this request has been computed and the ones behind it start
	// now: what is left is the tokens still pending.
	w.backlogAt.Store(now)
	w.backlog.Store(w.prefillTokens.Add(-u.prefillTokens))
	w.bl.Unlock()
	u.prefillTokens = 0
}

// TTFTPrediction returns the TTFT the request was predicted and the one it had, in seconds
// from dispatch, once its first token has come (ok false before, or without a prediction).
func (u *Usage) TTFTPrediction() (predicted, actual float64, ok bool) {
	if !u.hasPred || !u.learn || u.firstAt == 0 {
		return 0, 0, false
	}
	return u.pred.TTFT, u.ttft, true
}

// Generated grows the request's blocks with its output, once the output passes what osl
// predicted.
func (u *Usage) Generated(outputTokens int) {
	if u.w == nil {
		return
	}
	bs := max(u.w.BlockSize, 1)
	want := int64((u.promptTokens + max(outputTokens, u.osl) + bs - 1) / bs)
	if d := want - u.decodeBlocks; d > 0 {
		u.w.decodeBlocks.Add(d)
		u.decodeBlocks = want
	}
}

// CompletedAt records that the response ended well at now (a time of day from Now, 0: read
// the clock) after outputTokens tokens: a streamed request teaches the worker's model its
// time between tokens and how long it held its slot. Call it before End.
func (u *Usage) CompletedAt(now int64, outputTokens int) {
	if u.w == nil || !u.hasPred || !u.learn || u.firstAt == 0 || outputTokens < 2 {
		return
	}
	held := float64(ClockAt(now)-u.firstAt) / 1e9
	u.w.Latency().ObserveDecode(max(u.batch, 1), u.kv, held/float64(outputTokens-1), held)
}

// End removes the request from its worker's load. It is safe to call more than once.
func (u *Usage) End() {
	if u.w == nil {
		return
	}
	u.w.inflight.Add(-1)
	u.w.prefillTokens.Add(-u.prefillTokens)
	u.w.decodeBlocks.Add(-u.decodeBlocks)
	if u.firstAt != 0 {
		w := u.w
		w.bl.Lock()
		if i := slices.Index(w.decoding, decodingReq{at: u.firstAt, osl: u.osl}); i >= 0 {
			last := len(w.decoding) - 1
			w.decoding[i] = w.decoding[last]
			w.decoding = w.decoding[:last]
		}
		w.bl.Unlock()
	}
	if u.interactive {
		u.w.interactive.Add(-1)
	}
	*u = Usage{}
}

// decodingReq is one of this proxy's requests past its first token on a worker.
type decodingReq struct {
	at  int64 // when its first token came (Clock)
	osl int   // the output tokens expected of it, 0 unknown
}

// DecodingLeft appends to dst, for each of this proxy's requests on w past its first token
// (at most cap(dst) of them), the seconds until it is expected to end and free its slot at
// now, and returns it. A request expected to produce osl tokens holds its slot osl − 1 steps
// of perToken seconds after its first token; one of unknown output (or without perToken)
// the worker's mean occupancy occ. One past its expected end is taken to end now.
func (w *Worker) DecodingLeft(now int64, perToken, occ float64, dst []float64) []float64 {
	w.bl.Lock()
	defer w.bl.Unlock()
	for _, d := range w.decoding {
		if len(dst) == cap(dst) {
			break
		}
		hold := occ
		if d.osl > 0 && perToken > 0 {
			hold = float64(d.osl-1) * perToken
		}
		dst = append(dst, max(hold-float64(now-d.at)/1e9, 0))
	}
	return dst
}

// Worker is the worker the usage is accounted on, nil after End.
func (u *Usage) Worker() *Worker { return u.w }

// Own returns this proxy's own load on the worker, without what the engine or a control
// plane reported: requests in flight, their uncached prompt tokens not yet past the first
// token, and the KV blocks they hold or are predicted to hold. It is what a proxy reports
// to its control plane.
func (w *Worker) Own() (inflight, prefillTokens, decodeBlocks int64) {
	return w.inflight.Load(), w.prefillTokens.Load(), w.decodeBlocks.Load()
}
