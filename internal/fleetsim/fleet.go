package fleetsim

import (
	"container/heap"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/kvrelay/kvrelay/cmd/kvrelay/bench/workload"
	"github.com/kvrelay/kvrelay/dataplane/clock"
	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// Kind names a modelled engine kind.
type Kind string

const (
	// KindSim is kvrelay's simulated engine (engines/sim): continuous batching with chunked
	// prefill, a paged KV cache with prefix caching, steps priced by its timing model.
	KindSim Kind = "sim"
	// KindLLMD models llm-d-inference-sim's per-token latency calculator.
	KindLLMD Kind = "llmd"
)

// EngineSpec is one engine of the fleet.
type EngineSpec struct {
	Kind Kind
	// Sim configures a KindSim engine (its Model, BlockSize and tokenizer are the fleet's).
	Sim sim.Config
	// LLMD configures a KindLLMD engine.
	LLMD LLMDConfig
}

// Config is one replay.
type Config struct {
	// Model is the served model; it picks the tokenizer and chat template (engines/tokenizer).
	Model string
	// BlockSize is every engine's KV block size in tokens (default 16).
	BlockSize int
	Engines   []EngineSpec
	// Routing is the router's policy. Workers get no scheduler facts beyond what Workers
	// sets: the router learns the rest.
	Routing route.Config
	// Workers, when set, fills in what the router is told of each worker (its Engine
	// limits, capacity); by default it knows each worker's id, model and block size only.
	Workers func(i int, w *route.Worker)
	// Workload is replayed as `kvrelay bench` replays it: open-loop requests at their times,
	// sessions closed-loop, subagents spawned when their parent's call is answered.
	Workload *workload.Workload
	// Speedup divides the workload's arrival and think times.
	Speedup float64
	// ReportEvery is how often the engines' load reaches the router (a control plane's
	// load view); 0: never, the router sees only its own requests.
	ReportEvery time.Duration
	// Exact makes the router's index the engines' caches themselves (a control plane's
	// index); otherwise the proxy's own approximate index of what it routed.
	Exact bool
	// MaxRequests stops sending after that many requests (0: the whole workload).
	MaxRequests int
	// Seed drives the llm-d engines' noise and the router's randomness (route.Rand): a
	// replay of one seed makes the same decisions every time.
	Seed uint64
	// Explain keeps every candidate's prediction in each record.
	Explain bool
	// Alone fills each record's Alone on llm-d engines.
	Alone bool
}

// Record is one request's outcome.
type Record struct {
	Seq     int
	Tag     string
	Worker  int
	Start   time.Duration // when it was sent
	TTFT    time.Duration
	E2E     time.Duration
	Prompt  int // prompt tokens
	Cached  int // prompt tokens the engine found cached
	Output  int
	Mode    string        // the router's rule (Decision.Mode)
	Overlap float64       // the cached blocks the router counted on its worker
	Predict time.Duration // the predicted TTFT (0 without a prediction)
	PredQ   time.Duration // the queue part of Predict
	// Alone is, on an llm-d engine under Config.Alone, the TTFT the request would have had if
	// no request had arrived after its decision and the engine had no noise: what a
	// predictor that knows the engine's state exactly but not the future could say (0 where
	// not computed).
	Alone time.Duration
	// Waited is, on an llm-d engine, how long the request waited there for a slot.
	Waited   time.Duration
	Err      string
	Requeued int // times it waited for a worker (every one busy)
	// Candidates are, under a predicting policy, each candidate's prediction at the
	// decision, when Config.Explain asks for them.
	Candidates []Candidate
}

// Candidate is one worker's figures at a decision.
type Candidate struct {
	Worker      int
	Cost        float64
	TTFT, Queue time.Duration
	// The prediction's other parts the latency policy's cost weighs: its spread, the decode
	// slowdown of joining the batch, the compute it delays others by (busy share × compute)
	// and the slot hold × scarcity, in seconds.
	Spread, Slowdown, BusyCompute, HoldScarcity float64
	Load                                        int64
	Overlap                                     float64
	Running, Wait                               int // the engine's at the decision
}

// Result is a replay's outcome.
type Result struct {
	Records []Record
	// Duration is the virtual time from the first send to the last answer.
	Duration time.Duration
	// PerWorker counts the requests each engine served.
	PerWorker []int
	// Models are the router's latency models of the workers at the end.
	Models []latency.Stats
}

// fleet is one replay's state; everything runs on the caller's goroutine.
type fleet struct {
	cfg    Config
	codec  *tokenizer.Codec
	filler []uint32
	base   int64 // the time of day of virtual time 0
	vt     int64 // virtual nanoseconds
	events evHeap
	seq    int
	sent   int
	eng    []engine
	router *route.Router
	pool   *route.Pool
	index  routeIndex
	recs   []Record
	hasher blockhash.Hasher
	busy   []*flight // requests waiting for a worker (ErrBusy)
	rng    *rand.Rand
	errs   []error
}

// engine is a modelled engine driven by the fleet's clock.
type engine interface {
	// submit hands f to the engine at the fleet's current time.
	submit(f *flight) error
	// next is the time of the engine's next event, math.MaxInt64 when it has none.
	next() int64
	// advance runs the engine's events up to and including t.
	advance(t int64)
	// load is the engine's running and waiting requests and KV usage (0 to 1).
	load() (running, waiting int, kv float64)
}

// flight is one request in flight.
type flight struct {
	fl      *fleet
	rec     int // index in fleet.recs
	req     *workload.Request
	sess    *sessRun
	tokens  []uint32
	hashes  []uint64
	worker  *route.Worker
	wi      int
	usage   route.Usage
	sent    int64
	first   int64
	out     []uint32
	overlap float64 // the cached blocks the router counted on its worker
}

// Run replays cfg's workload and returns every request's record.
func Run(cfg Config) (*Result, error) {
	if cfg.BlockSize <= 0 {
		cfg.BlockSize = 16
	}
	if cfg.Speedup <= 0 {
		cfg.Speedup = 1
	}
	if len(cfg.Engines) == 0 {
		return nil, errors.New("fleetsim: no engines")
	}
	if cfg.Workload == nil {
		return nil, errors.New("fleetsim: no workload")
	}
	fl := &fleet{cfg: cfg, codec: tokenizer.CodecForModel(cfg.Model), base: clock.Now(), rng: rand.New(rand.NewPCG(cfg.Seed, 0x5eed))}
	fl.filler = fillerIDs(fl.codec.Tokenizer)
	prevClock, prevRand := route.Clock, route.Rand
	route.Clock = func() int64 { return clock.MonoAt(fl.base + fl.vt) }
	route.Rand = rand.New(rand.NewPCG(cfg.Seed, 0x7a11))
	defer func() { route.Clock, route.Rand = prevClock, prevRand }()

	var ws []*route.Worker
	for i := range cfg.Engines {
		w := &route.Worker{ID: "e" + strconv.Itoa(i+1), Model: cfg.Model, BlockSize: cfg.BlockSize, URL: "http://127.0.0.1:" + strconv.Itoa(30001+i), Addr: "127.0.0.1:" + strconv.Itoa(30001+i)}
		// The KV cache size the control plane reads from each engine's vllm:cache_config_info
		// (both simulators publish it).
		switch e := cfg.Engines[i]; e.Kind {
		case KindLLMD:
			w.Capacity = e.LLMD.CacheBlocks
		case KindSim:
			w.Capacity = e.Sim.NumGPUBlocks
		}
		if cfg.Workers != nil {
			cfg.Workers(i, w)
		}
		ws = append(ws, w)
	}
	fl.pool = route.NewPool(ws)
	if cfg.Exact {
		fl.index = newExactIndex(len(ws))
	} else {
		fl.index = newApproxIndex(fl)
	}
	var err error
	if fl.router, err = route.NewRouter(cfg.Routing, fl.pool, fl.index); err != nil {
		return nil, fmt.Errorf("fleetsim: %w", err)
	}
	for i, spec := range cfg.Engines {
		var e engine
		switch spec.Kind {
		case KindSim:
			e, err = newSimEngine(fl, i, spec.Sim)
		case KindLLMD:
			e, err = newLLMDEngine(fl, i, spec.LLMD)
		default:
			err = fmt.Errorf("unknown engine kind %q", spec.Kind)
		}
		if err != nil {
			return nil, fmt.Errorf("fleetsim: engine %d: %w", i, err)
		}
		fl.eng = append(fl.eng, e)
	}

	for i := range cfg.Workload.Open {
		r := &cfg.Workload.Open[i]
		fl.at(fl.scale(r.At), func() { fl.send(r, nil) })
	}
	for _, s := range cfg.Workload.Sessions {
		sr := &sessRun{s: s}
		fl.at(0, func() { fl.advanceSession(sr, "") })
	}
	if cfg.ReportEvery > 0 {
		var tick func()
		tick = func() {
			fl.report()
			if fl.live() {
				fl.atTick(fl.vt+int64(cfg.ReportEvery), tick)
			}
		}
		fl.atTick(0, tick)
	}
	fl.loop()
	if len(fl.errs) > 0 {
		return nil, errors.Join(fl.errs...)
	}
	res := &Result{Records: fl.recs, PerWorker: make([]int, len(ws))}
	for _, w := range ws {
		res.Models = append(res.Models, w.Latency().Stats())
	}
	var first, last int64 = math.MaxInt64, 0
	for _, r := range fl.recs {
		first = min(first, int64(r.Start))
		last = max(last, int64(r.Start+r.E2E))
		if r.Err == "" {
			res.PerWorker[r.Worker]++
		}
	}
	if last > first {
		res.Duration = time.Duration(last - first)
	}
	return res, nil
}

func (fl *fleet) scale(d time.Duration) int64 { return int64(float64(d) / fl.cfg.Speedup) }

// tod is the time of day of the current virtual time, as the data plane's clock gives it.
func (fl *fleet) tod() int64 { return fl.base + fl.vt }

// live reports whether anything is still to happen besides report ticks.
func (fl *fleet) live() bool {
	for _, e := range fl.eng {
		if e.next() != math.MaxInt64 {
			return true
		}
	}
	for _, ev := range fl.events {
		if !ev.tick {
			return true
		}
	}
	return len(fl.busy) > 0
}

func (fl *fleet) loop() {
	for {
		t := int64(math.MaxInt64)
		for _, e := range fl.eng {
			t = min(t, e.next())
		}
		if len(fl.events) > 0 {
			t = min(t, fl.events[0].at)
		}
		if t == math.MaxInt64 {
			return
		}
		if t > fl.vt {
			fl.vt = t
		}
		for _, e := range fl.eng {
			if e.next() <= fl.vt {
				e.advance(fl.vt)
			}
		}
		for len(fl.events) > 0 && fl.events[0].at <= fl.vt {
			ev := heap.Pop(&fl.events).(*event)
			ev.fn()
		}
		if !fl.live() {
			return
		}
	}
}

// at schedules fn at virtual time t.
func (fl *fleet) at(t int64, fn func()) {
	heap.Push(&fl.events, &event{at: max(t, fl.vt), seq: fl.seq, fn: fn})
	fl.seq++
}

// atTick schedules a periodic fn, which does not by itself keep the replay going.
func (fl *fleet) atTick(t int64, fn func()) {
	heap.Push(&fl.events, &event{at: max(t, fl.vt), seq: fl.seq, fn: fn, tick: true})
	fl.seq++
}

// report hands every engine's load to its worker, as a control plane's load view does.
func (fl *fleet) report() {
	for i, e := range fl.eng {
		run, wait, kv := e.load()
		fl.pool.Workers[i].SetReported(&route.Reported{Running: run, Waiting: wait, KVUsage: kv})
	}
}

// sessRun is a closed-loop session being replayed.
type sessRun struct {
	s        workload.Session
	parent   *sessRun
	children int
	answer   string // the answer its children started from
}

func (fl *fleet) advanceSession(sr *sessRun, prev string) {
	req, ok := sr.s.Next(prev)
	if !ok || (fl.cfg.MaxRequests > 0 && fl.sent >= fl.cfg.MaxRequests) {
		if p := sr.parent; p != nil {
			p.children--
			if p.children == 0 {
				fl.advanceSession(p, p.answer)
			}
		}
		return
	}
	fl.at(fl.vt+fl.scale(req.At), func() { fl.send(&req, sr) })
}

// send tokenizes, routes and submits one request.
func (fl *fleet) send(req *workload.Request, sr *sessRun) {
	if fl.cfg.MaxRequests > 0 && fl.sent >= fl.cfg.MaxRequests {
		if sr != nil {
			fl.advanceSession(sr, "") // ends the session (Next is not asked again)
		}
		return
	}
	fl.sent++
	f := &flight{fl: fl, req: req, sess: sr, sent: fl.vt, rec: len(fl.recs)}
	fl.recs = append(fl.recs, Record{Seq: len(fl.recs), Tag: req.Tag, Start: time.Duration(fl.vt), Worker: -1})
	var err error
	if req.Chat {
		f.tokens, err = fl.codec.AppendEncodeChat(nil, chatMessages(req.Messages), tokenizer.RenderOptions{AddGenerationPrompt: true})
	} else {
		f.tokens = fl.codec.EncodePrompt(req.Prompt)
	}
	if err != nil {
		fl.fail(f, err)
		return
	}
	f.hashes = fl.hasher.AppendSeqKeys(nil, 0, false, f.tokens, fl.cfg.BlockSize, &blockhash.Keys{}, 0)
	fl.recs[f.rec].Prompt = len(f.tokens)
	fl.dispatch(f)
}

// dispatch routes f and submits it, or parks it until a worker frees (ErrBusy).
func (fl *fleet) dispatch(f *flight) {
	var rr route.Request
	rr.Model = fl.cfg.Model
	rr.Hashes = f.hashes
	rr.PromptTokens = len(f.tokens)
	rr.OSL = f.req.OSL
	if f.req.HasPriority {
		rr.Priority = f.req.Priority
	}
	rr.Now = fl.tod()
	var d route.Decision
	err := fl.router.Route(&rr, &d)
	if errors.Is(err, route.ErrBusy) {
		fl.recs[f.rec].Requeued++
		fl.busy = append(fl.busy, f)
		return
	}
	if err != nil {
		fl.fail(f, err)
		return
	}
	f.worker, f.wi = d.Worker, d.Worker.Index
	rec := &fl.recs[f.rec]
	rec.Worker, rec.Mode, rec.Overlap = f.wi, d.Mode, d.Overlap
	f.overlap = d.Overlap
	if d.HasPrediction {
		rec.Predict = time.Duration(d.Prediction.TTFT * 1e9)
		rec.PredQ = time.Duration(d.Prediction.Queue * 1e9)
	}
	if fl.cfg.Explain {
		ws, preds := rr.Candidates()
		costs := rr.Costs()
		for i, w := range ws {
			run, wait, _ := fl.eng[w.Index].load()
			var c float64
			if i < len(costs) {
				c = costs[i]
			}
			p := &preds[i]
			rec.Candidates = append(rec.Candidates, Candidate{Worker: w.Index, Cost: c, TTFT: time.Duration(p.TTFT * 1e9), Queue: time.Duration(p.Queue * 1e9),
				Spread: p.Spread, Slowdown: p.Slowdown, BusyCompute: p.Busy * p.Compute, HoldScarcity: p.Hold * p.Scarcity,
				Load: w.Load(), Overlap: rr.Overlap(w), Running: run, Wait: wait})
		}
	}
	if e, ok := fl.eng[f.wi].(*llmdEngine); ok && fl.cfg.Alone {
		rec.Alone = time.Duration(fl.vt-f.sent) + e.alone(f)
	}
	f.usage.BeginAt(fl.tod(), d.Worker, len(f.tokens), int(d.Overlap)*fl.cfg.BlockSize, f.req.OSL)
	f.usage.Predicted(&d, rr.Priority, true)
	if err := fl.eng[f.wi].submit(f); err != nil {
		f.usage.End()
		fl.fail(f, err)
	}
}

// retryBusy routes again the requests that found every worker busy.
func (fl *fleet) retryBusy() {
	if len(fl.busy) == 0 {
		return
	}
	waiting := fl.busy
	fl.busy = nil
	for _, f := range waiting {
		fl.dispatch(f)
	}
}

func (fl *fleet) fail(f *flight, err error) {
	fl.recs[f.rec].Err = err.Error()
	if len(fl.errs) < 8 {
		fl.errs = append(fl.errs, fmt.Errorf("request %d: %w", f.rec, err))
	}
}

// firstToken is the engine's word that f's first token came at the current time.
func (f *flight) firstToken() {
	fl := f.fl
	f.first = fl.vt
	fl.recs[f.rec].TTFT = time.Duration(fl.vt - f.sent)
	f.usage.FirstTokenAt(fl.tod())
	fl.index.recordCached(f)
	fl.retryBusy()
}

// done is the engine's word that f finished at the current time with out tokens, cached of
// its prompt tokens found in the cache.
func (f *flight) done(out []uint32, cached int) {
	fl := f.fl
	if f.first == 0 {
		f.firstToken()
	}
	rec := &fl.recs[f.rec]
	rec.E2E = time.Duration(fl.vt - f.sent)
	rec.Cached, rec.Output = cached, len(out)
	f.usage.Generated(len(out))
	f.usage.CompletedAt(fl.tod(), len(out))
	f.usage.End()
	fl.index.correct(f, cached)
	answer := fl.codec.Tokenizer.Decode(out)
	fl.retryBusy()
	if sr := f.sess; sr != nil {
		if len(f.req.Spawn) > 0 {
			sr.children, sr.answer = len(f.req.Spawn), answer
			for _, sub := range f.req.Spawn {
				fl.advanceSession(&sessRun{s: sub, parent: sr}, answer)
			}
			return
		}
		fl.advanceSession(sr, answer)
	}
}

// chatMessages converts a workload's messages to the template's.
func chatMessages(in []workload.Message) []tokenizer.Message {
	out := make([]tokenizer.Message, len(in))
	for i, m := range in {
		out[i] = tokenizer.Message{Role: m.Role, Content: m.Content, Name: m.Name, ToolCallID: m.ToolCallID}
		for _, c := range m.ToolCalls {
			out[i].ToolCalls = append(out[i].ToolCalls, tokenizer.ToolCall{ID: c.ID, Type: c.Type, Function: tokenizer.ToolCallFunction{Name: c.Function.Name, Arguments: c.Function.Arguments}})
		}
	}
	return out
}

// fillerIDs are single-token words the engines generate, so that an answer decoded to text
// and sent back tokenizes to the same ids.
func fillerIDs(t tokenizer.Tokenizer) []uint32 {
	var ids []uint32
	for _, w := range []string{" the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on", " be", " at", " by", " this"} {
		if toks := t.Encode(w); len(toks) == 1 {
			ids = append(ids, toks[0])
		}
	}
	return ids
}

type event struct {
	at   int64
	seq  int
	fn   func()
	tick bool
}

type evHeap []*event

func (h evHeap) Len() int { return len(h) }
func (h evHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h evHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *evHeap) Push(x any)   { *h = append(*h, x.(*event)) }
func (h *evHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
