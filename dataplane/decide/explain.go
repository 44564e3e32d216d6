package decide

import (
	"strconv"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// decisionLog keeps the last decisionLogSize sampled routing decisions (one request in
// SampleEvery), each with every candidate's figures and, once the answer ends, how it went:
// for operators to see why a request went where it did (Decisions), and for the control
// plane's console, to which a load reporter passes each completed one once
// (ReportDecisions). Carriers' requests record into it under its mutex; its slots and their
// candidate slices are reused, so recording allocates only while they grow.
type decisionLog struct {
	mu   sync.Mutex
	ring [decisionLogSize]decisionRecord
	next uint64 // records written; a record's id is its position plus one
}

// decisionLogSize bounds the decisions kept.
const decisionLogSize = 256

type decisionRecord struct {
	id           uint64
	at           int64 // unix nanos, when it was routed
	model        string
	promptTokens int
	priority     int
	sloTTFT      float64
	mode         string
	worker       string
	version      uint64 // the policy version that routed it (0: a static proxy's)
	overlap      float64
	achievable   float64
	candidates   []candidateRecord
	prefixHash   uint64
	prefixBlocks int
	// The answer, once done: its status, TTFT and mean inter-token gap (seconds, 0 when
	// none), the prompt tokens the engine reported cached; reported once sent to the
	// control plane.
	done, reported bool
	status         int
	ttft, itl      float64
	cached         int
}

type candidateRecord struct {
	worker  string
	overlap float64
	load    int64
	pred    latency.Prediction
}

// prefixBlocks is how far into a prompt its prefix hash reaches (decisionRecord.prefixHash):
// 1,024 tokens at vLLM's block size, as the rollout's split.
const prefixBlocks = splitBlocks

// record copies the decision d of request in, made at now by arm's policy, and its
// candidates, and returns its id (for complete).
func (l *decisionLog) record(in *Request, now int64, d *route.Decision, arm *armSeries) uint64 {
	ws, preds := in.rreq.Candidates()
	l.mu.Lock()
	defer l.mu.Unlock()
	r := &l.ring[l.next%decisionLogSize]
	l.next++
	r.id, r.done, r.reported, r.status, r.ttft, r.itl, r.cached = l.next, false, false, 0, 0, 0, 0
	r.at, r.model, r.promptTokens, r.priority = now, in.model, in.rreq.PromptTokens, in.prio
	r.sloTTFT, r.mode, r.worker = in.sloTTFT/1e3, d.Mode, d.Worker.ID
	r.version = 0
	if arm != nil {
		r.version = arm.num
	}
	r.overlap, r.achievable = d.Overlap, max(d.Achievable, d.Overlap)
	r.prefixHash, r.prefixBlocks = 0, 0
	if h := in.rreq.Hashes; len(h) > 0 {
		r.prefixBlocks = min(len(h), prefixBlocks)
		r.prefixHash = h[r.prefixBlocks-1]
	}
	r.candidates = r.candidates[:0]
	if len(ws) == 0 {
		// A policy that predicts nothing: the picked worker alone.
		r.candidates = append(r.candidates, candidateRecord{worker: d.Worker.ID, overlap: d.Overlap, load: d.Worker.Load()})
	}
	for i, w := range ws {
		r.candidates = append(r.candidates, candidateRecord{worker: w.ID, overlap: in.rreq.Overlap(w), load: w.Load(), pred: preds[i]})
	}
	return r.id
}

// complete records how decision id's answer went, if the decision is still kept.
func (l *decisionLog) complete(id uint64, status int, res *oai.Observation) {
	if id == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	r := &l.ring[(id-1)%decisionLogSize]
	if r.id != id || r.done {
		return
	}
	r.done, r.status = true, status
	if ns, ok := res.TTFT(); ok {
		r.ttft = seconds(ns)
	}
	if res.Chunks > 1 {
		r.itl = seconds(res.ITLSum) / float64(res.Chunks-1)
	}
	if res.Usage.HasCached {
		r.cached = int(min(res.Usage.CachedTokens, 1<<30))
	}
}

// ReportDecisions returns the completed decisions not yet reported, oldest first, at most
// maxReportDecisions, and marks them reported: a load reporter's share for the control
// plane, on the reporter's goroutine.
func (c *Core) ReportDecisions() []*xdsv1.DecisionSample { return c.decisions.report() }

func (l *decisionLog) report() []*xdsv1.DecisionSample {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*xdsv1.DecisionSample
	first := l.next - min(l.next, decisionLogSize)
	for i := first; i < l.next && len(out) < maxReportDecisions; i++ {
		r := &l.ring[i%decisionLogSize]
		if !r.done || r.reported {
			continue
		}
		r.reported = true
		ds := &xdsv1.DecisionSample{
			Id: r.id, UnixMs: r.at / 1e6, Model: r.model, PromptTokens: uint32(min(r.promptTokens, 1<<31)), Priority: int32(max(min(r.priority, 1<<30), -1<<30)),
			Mode: r.mode, Worker: r.worker, PolicyVersion: r.version, OverlapBlocks: r.overlap, AchievableBlocks: r.achievable,
			Status: uint32(max(r.status, 0)), Ttft: r.ttft, Itl: r.itl, CachedTokens: uint32(r.cached),
			PrefixHash: r.prefixHash, PrefixBlocks: uint32(r.prefixBlocks),
		}
		for _, c := range r.candidates {
			ds.Candidates = append(ds.Candidates, &xdsv1.CandidateSample{Worker: c.worker, CachedBlocks: c.overlap, Requests: c.load,
				Ttft: c.pred.TTFT, Queue: c.pred.Queue, Prefill: c.pred.Prefill})
		}
		out = append(out, ds)
	}
	return out
}

// maxReportDecisions bounds the decisions one load report carries.
const maxReportDecisions = 32

// DecisionJSON is one sampled decision as an owner's admin endpoint serves it; times in
// milliseconds.
type DecisionJSON struct {
	ID           uint64          `json:"id"`
	Time         time.Time       `json:"time"`
	Model        string          `json:"model"`
	PromptTokens int             `json:"prompt_tokens"`
	Priority     int             `json:"priority"`
	SLOTTFTMs    float64         `json:"slo_ttft_ms,omitempty"`
	Mode         string          `json:"mode"`
	Worker       string          `json:"worker"`
	RegretBlocks float64         `json:"regret_blocks"`
	Candidates   []CandidateJSON `json:"candidates"`
	// The answer, once it ended: its status, TTFT and mean inter-token latency, and the
	// prompt tokens the engine reported cached.
	Done         bool    `json:"done"`
	Status       int     `json:"status,omitempty"`
	TTFTMs       float64 `json:"ttft_ms,omitempty"`
	ITLMs        float64 `json:"itl_ms,omitempty"`
	CachedTokens int     `json:"cached_tokens,omitempty"`
}

// CandidateJSON is one candidate worker of a decision and what the model predicted for it.
type CandidateJSON struct {
	Worker       string  `json:"worker"`
	CachedBlocks float64 `json:"cached_blocks"`
	Requests     int64   `json:"requests"`
	TTFTMs       float64 `json:"ttft_ms"`
	QueueMs      float64 `json:"queue_ms"`
	PrefillMs    float64 `json:"prefill_ms"`
	ITLMs        float64 `json:"itl_ms"`
	// The features before the model's coefficients: the slot wait, and the backlog's and
	// the request's prefill on the worker's curve at its learned speed.
	SlotWaitPrior float64 `json:"slot_wait_prior_ms"`
	QueuePrior    float64 `json:"queue_prior_ms"`
	PrefillPrior  float64 `json:"prefill_prior_ms"`
}

// Decisions returns the sampled decisions, newest first, at most n (0: all kept).
func (c *Core) Decisions(n int) []DecisionJSON {
	l := &c.decisions
	l.mu.Lock()
	defer l.mu.Unlock()
	have := int(min(l.next, decisionLogSize))
	if n <= 0 || n > have {
		n = have
	}
	out := make([]DecisionJSON, 0, n)
	for i := range n {
		r := &l.ring[(l.next-1-uint64(i))%decisionLogSize]
		d := DecisionJSON{ID: r.id, Time: time.Unix(0, r.at), Model: r.model, PromptTokens: r.promptTokens, Priority: r.priority,
			SLOTTFTMs: r.sloTTFT * 1e3, Mode: r.mode, Worker: r.worker, RegretBlocks: r.achievable - r.overlap,
			Done: r.done, Status: r.status, TTFTMs: r.ttft * 1e3, ITLMs: r.itl * 1e3, CachedTokens: r.cached}
		for _, c := range r.candidates {
			d.Candidates = append(d.Candidates, CandidateJSON{
				Worker: c.worker, CachedBlocks: c.overlap, Requests: c.load,
				TTFTMs: c.pred.TTFT * 1e3, QueueMs: c.pred.Queue * 1e3, PrefillMs: c.pred.Prefill * 1e3, ITLMs: c.pred.ITL * 1e3,
				SlotWaitPrior: c.pred.X[latency.FeatSlotWait] * 1e3, QueuePrior: c.pred.X[latency.FeatQueue] * 1e3,
				PrefillPrior: c.pred.X[latency.FeatPrefill] * 1e3,
			})
		}
		out = append(out, d)
	}
	return out
}

// WorkerModelJSON is one worker's latency model as an owner's admin endpoint serves it.
type WorkerModelJSON struct {
	Worker string `json:"worker"`
	// Coefficients of the TTFT model its model's workers share, each a multiple of its
	// feature's seconds: the per-request step overhead idle (bias) and its growth with the
	// share of slots in use (loaded_bias), slot wait, queue, prefill, prefill under load and
	// the decode steps beside the prefill (decode).
	Bias          float64 `json:"bias"`
	LoadedBias    float64 `json:"loaded_bias"`
	SlotWait      float64 `json:"slot_wait"`
	Queue         float64 `json:"queue"`
	Prefill       float64 `json:"prefill"`
	LoadedPrefill float64 `json:"loaded_prefill"`
	Decode        float64 `json:"decode"`
	// ITL is the shared decode step at the batch sizes requests taught, with an empty
	// cache; ITLKV its multipliers with the cache half full and full.
	ITL   []DecodePointJSON `json:"itl"`
	ITLKV [2]float64        `json:"itl_kv_multipliers"`
	// Speed is the worker's prefill time against its model's; Occupancy how long a request
	// holds its slot there, seconds.
	Speed     float64 `json:"speed"`
	Occupancy float64 `json:"occupancy_s"`
	// Observations are the first tokens this worker taught; ModelObservations and Decodes
	// what its model learned from across its workers; MaxNumSeqs the configured or learned
	// concurrency limit (0: unknown).
	Observations      int64 `json:"observations"`
	ModelObservations int64 `json:"model_observations"`
	Decodes           int64 `json:"decodes"`
	MaxNumSeqs        int   `json:"max_num_seqs"`
}

// DecodePointJSON is one batch size of a decode step table.
type DecodePointJSON struct {
	Batch        int     `json:"batch"`
	Seconds      float64 `json:"seconds"`
	Observations int     `json:"observations"`
}

func decodePoints(ps []latency.DecodePoint) []DecodePointJSON {
	out := make([]DecodePointJSON, len(ps))
	for i, p := range ps {
		out[i] = DecodePointJSON(p)
	}
	return out
}

// WorkerModels returns every worker's latency model.
func (c *Core) WorkerModels() []WorkerModelJSON {
	var out []WorkerModelJSON
	for _, w := range c.kv.Pool().Workers {
		st := w.Latency().Stats()
		out = append(out, WorkerModelJSON{
			Worker: w.ID, Bias: st.Theta[latency.FeatBias], SlotWait: st.Theta[latency.FeatSlotWait], Queue: st.Theta[latency.FeatQueue],
			Prefill: st.Theta[latency.FeatPrefill], LoadedPrefill: st.Theta[latency.FeatLoadedPrefill], LoadedBias: st.Theta[latency.FeatLoadedBias],
			Decode: st.Theta[latency.FeatDecode],
			ITL:    decodePoints(st.Decode), ITLKV: st.DecodeKV, Speed: st.Speed, Occupancy: st.Occupancy,
			Observations: st.Observations, ModelObservations: st.ModelObservations, Decodes: st.Decodes,
			MaxNumSeqs: w.Latency().MaxNumSeqs(&w.Engine),
		})
	}
	return out
}

// AppendExplain appends the decision's candidates with their predicted TTFT, queue and
// prefill in milliseconds and their cached blocks, the chosen worker first, as
// "w1 ttft=41.2 queue=3.1 prefill=38.1 cached=375, w0 ttft=…" (the x-kvrelay-decision
// header's value); nothing under a policy that predicts nothing.
func (r *Request) AppendExplain(out []byte) []byte {
	if ws, _ := r.rreq.Candidates(); len(ws) == 0 {
		return out
	}
	return appendDecision(out, &r.rreq, r.dec.Worker)
}

// appendDecision writes the candidates of r's last decision as x-kvrelay-decision carries
// them, chosen first.
func appendDecision(out []byte, r *route.Request, chosen *route.Worker) []byte {
	ws, preds := r.Candidates()
	first := true
	one := func(i int) {
		if !first {
			out = append(out, ", "...)
		}
		first = false
		p := &preds[i]
		out = append(out, ws[i].ID...)
		out = append(out, " ttft="...)
		out = strconv.AppendFloat(out, p.TTFT*1e3, 'f', 1, 64)
		out = append(out, " queue="...)
		out = strconv.AppendFloat(out, p.Queue*1e3, 'f', 1, 64)
		out = append(out, " prefill="...)
		out = strconv.AppendFloat(out, p.Prefill*1e3, 'f', 1, 64)
		out = append(out, " cached="...)
		out = strconv.AppendInt(out, int64(r.Overlap(ws[i])), 10)
	}
	for i, w := range ws {
		if w == chosen {
			one(i)
		}
	}
	for i, w := range ws {
		if w != chosen {
			one(i)
		}
	}
	return out
}
