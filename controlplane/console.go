package controlplane

import (
	"cmp"
	"context"
	"encoding/json"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kvrelay/kvrelay/controlplane/api"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// console keeps what the operator console shows beyond the operator API's workers, policy,
// rollouts and planner: the sampled routing decisions proxies report with their load (the
// last consoleDecisions), each worker's figures over the last statsWindow from them, and
// the prompt prefixes the most requests share. Its methods are safe for concurrent use:
// load report streams add, HTTP handlers read.
type console struct {
	now func() time.Time

	mu       sync.Mutex
	ring     [consoleDecisions]consoleDecision
	next     uint64 // decisions kept so far; a decision's id is its position plus one
	prefixes map[prefixKey]*hotPrefix
	changed  chan struct{} // closed and replaced when a decision arrives
}

// consoleDecisions bounds the decisions kept; maxPrefixes the prefixes tracked.
const (
	consoleDecisions = 1024
	maxPrefixes      = 4096
	statsWindow      = time.Minute
	// prefixHalfLife is how fast a prefix's hits fade: the hottest are those most requests
	// shared lately.
	prefixHalfLife = 5 * time.Minute
)

type consoleDecision struct {
	id      uint64
	node    string
	arrived time.Time
	d       *xdsv1.DecisionSample
}

type prefixKey struct {
	hash  uint64
	model string
}

type hotPrefix struct {
	blocks  int
	hits    float64 // decayed to at
	at      time.Time
	workers map[string]int // where its requests went
}

func newConsole() *console {
	return &console{now: time.Now, prefixes: map[prefixKey]*hotPrefix{}, changed: make(chan struct{})}
}

// add keeps a proxy's sampled decisions.
func (c *console) add(node string, ds []*xdsv1.DecisionSample) {
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, d := range ds {
		c.next++
		c.ring[(c.next-1)%consoleDecisions] = consoleDecision{id: c.next, node: node, arrived: now, d: d}
		if d.GetPrefixBlocks() > 0 {
			c.notePrefix(prefixKey{d.GetPrefixHash(), d.GetModel()}, int(d.GetPrefixBlocks()), d.GetWorker(), now)
		}
	}
	close(c.changed)
	c.changed = make(chan struct{})
}

// notePrefix counts a request of prefix k served by worker.
func (c *console) notePrefix(k prefixKey, blocks int, worker string, now time.Time) {
	p := c.prefixes[k]
	if p == nil {
		if len(c.prefixes) >= maxPrefixes {
			c.evictColdest(now)
		}
		p = &hotPrefix{blocks: blocks, at: now, workers: map[string]int{}}
		c.prefixes[k] = p
	}
	p.hits = decayed(p.hits, p.at, now) + 1
	p.at = now
	if len(p.workers) < 64 || p.workers[worker] > 0 {
		p.workers[worker]++
	}
}

// evictColdest forgets the tenth of the prefixes with the fewest hits now.
func (c *console) evictColdest(now time.Time) {
	type kh struct {
		k prefixKey
		h float64
	}
	all := make([]kh, 0, len(c.prefixes))
	for k, p := range c.prefixes {
		all = append(all, kh{k, decayed(p.hits, p.at, now)})
	}
	slices.SortFunc(all, func(a, b kh) int { return cmp.Compare(a.h, b.h) })
	for _, e := range all[:max(len(all)/10, 1)] {
		delete(c.prefixes, e.k)
	}
}

func decayed(hits float64, at, now time.Time) float64 {
	return hits * math.Exp2(-now.Sub(at).Seconds()/prefixHalfLife.Seconds())
}

// wait returns a channel closed when the next decision arrives.
func (c *console) wait() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.changed
}

// DecisionView is a decision as the console's endpoints serve it; times in milliseconds.
type DecisionView struct {
	ID               uint64          `json:"id"`
	Proxy            string          `json:"proxy"`
	Time             time.Time       `json:"time"`
	Model            string          `json:"model"`
	PromptTokens     uint32          `json:"prompt_tokens"`
	Priority         int32           `json:"priority"`
	Mode             string          `json:"mode"`
	Worker           string          `json:"worker"`
	PolicyVersion    uint64          `json:"policy_version"`
	OverlapBlocks    float64         `json:"overlap_blocks"`
	AchievableBlocks float64         `json:"achievable_blocks"`
	RegretBlocks     float64         `json:"regret_blocks"`
	Status           uint32          `json:"status"`
	TTFTMs           float64         `json:"ttft_ms"`
	ITLMs            float64         `json:"itl_ms"`
	CachedTokens     uint32          `json:"cached_tokens"`
	Prefix           string          `json:"prefix,omitempty"`
	PrefixBlocks     uint32          `json:"prefix_blocks,omitempty"`
	Candidates       []CandidateView `json:"candidates"`
}

// CandidateView is one candidate of a decision: its cached prompt blocks, load and (under a
// policy that predicts) predicted TTFT, queue and prefill.
type CandidateView struct {
	Worker       string  `json:"worker"`
	CachedBlocks float64 `json:"cached_blocks"`
	Requests     int64   `json:"requests"`
	TTFTMs       float64 `json:"ttft_ms"`
	QueueMs      float64 `json:"queue_ms"`
	PrefillMs    float64 `json:"prefill_ms"`
}

func viewOf(e *consoleDecision) DecisionView {
	d := e.d
	v := DecisionView{ID: e.id, Proxy: e.node, Time: time.UnixMilli(d.GetUnixMs()), Model: d.GetModel(), PromptTokens: d.GetPromptTokens(),
		Priority: d.GetPriority(), Mode: d.GetMode(), Worker: d.GetWorker(), PolicyVersion: d.GetPolicyVersion(),
		OverlapBlocks: d.GetOverlapBlocks(), AchievableBlocks: d.GetAchievableBlocks(),
		RegretBlocks: max(d.GetAchievableBlocks()-d.GetOverlapBlocks(), 0),
		Status:       d.GetStatus(), TTFTMs: d.GetTtft() * 1e3, ITLMs: d.GetItl() * 1e3, CachedTokens: d.GetCachedTokens(),
		PrefixBlocks: d.GetPrefixBlocks(), Candidates: []CandidateView{}}
	if d.GetPrefixBlocks() > 0 {
		v.Prefix = strconv.FormatUint(d.GetPrefixHash(), 16)
	}
	for _, c := range d.GetCandidates() {
		v.Candidates = append(v.Candidates, CandidateView{Worker: c.GetWorker(), CachedBlocks: c.GetCachedBlocks(), Requests: c.GetRequests(),
			TTFTMs: c.GetTtft() * 1e3, QueueMs: c.GetQueue() * 1e3, PrefillMs: c.GetPrefill() * 1e3})
	}
	return v
}

// decisions returns the kept decisions after id since, newest first, at most n.
func (c *console) decisions(since uint64, n int) (out []DecisionView, last uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	first := c.next - min(c.next, consoleDecisions)
	for i := c.next; i > first && len(out) < n; i-- {
		e := &c.ring[(i-1)%consoleDecisions]
		if e.id <= since {
			break
		}
		out = append(out, viewOf(e))
	}
	return out, c.next
}

// decision returns decision id, if it is still kept.
func (c *console) decision(id uint64) (DecisionView, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if id == 0 || id > c.next || c.next-id >= consoleDecisions {
		return DecisionView{}, false
	}
	return viewOf(&c.ring[(id-1)%consoleDecisions]), true
}

// WorkerFigures is a worker's figures over the last minute, from the sampled decisions:
// how many, their prefix hit rate (cached over prompt tokens) and their TTFT and ITL p50.
type WorkerFigures struct {
	Samples  int     `json:"samples"`
	HitRate  float64 `json:"hit_rate"`
	TTFTP50  float64 `json:"ttft_p50_ms"`
	ITLP50   float64 `json:"itl_p50_ms"`
	Requests float64 `json:"requests_per_s"`
}

// figures computes every worker's figures over the last statsWindow.
func (c *console) figures() map[string]WorkerFigures {
	now := c.now()
	c.mu.Lock()
	type acc struct {
		n              int
		cached, prompt float64
		ttft, itl      []float64
	}
	by := map[string]*acc{}
	first := c.next - min(c.next, consoleDecisions)
	for i := c.next; i > first; i-- {
		e := &c.ring[(i-1)%consoleDecisions]
		if now.Sub(e.arrived) > statsWindow {
			break
		}
		a := by[e.d.GetWorker()]
		if a == nil {
			a = &acc{}
			by[e.d.GetWorker()] = a
		}
		a.n++
		a.cached += float64(e.d.GetCachedTokens())
		a.prompt += float64(e.d.GetPromptTokens())
		if t := e.d.GetTtft(); t > 0 {
			a.ttft = append(a.ttft, t*1e3)
		}
		if t := e.d.GetItl(); t > 0 {
			a.itl = append(a.itl, t*1e3)
		}
	}
	c.mu.Unlock()
	out := make(map[string]WorkerFigures, len(by))
	for w, a := range by {
		f := WorkerFigures{Samples: a.n, TTFTP50: median(a.ttft), ITLP50: median(a.itl), Requests: float64(a.n) / statsWindow.Seconds()}
		if a.prompt > 0 {
			f.HitRate = a.cached / a.prompt
		}
		out[w] = f
	}
	return out
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	if len(xs)%2 == 1 {
		return xs[len(xs)/2]
	}
	return (xs[len(xs)/2-1] + xs[len(xs)/2]) / 2
}

// PrefixView is one of the hottest shared prefixes: its hash (of its first blocks, hex),
// length in blocks, model, hits (decayed with a five-minute half-life) and the workers its
// requests went to.
type PrefixView struct {
	Prefix  string         `json:"prefix"`
	Blocks  int            `json:"blocks"`
	Model   string         `json:"model"`
	Hits    float64        `json:"hits"`
	Workers map[string]int `json:"workers"`
}

// hottest returns the n prefixes with the most hits now, more than one each.
func (c *console) hottest(n int) []PrefixView {
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]PrefixView, 0, min(n, len(c.prefixes)))
	for k, p := range c.prefixes {
		h := decayed(p.hits, p.at, now)
		if h < 1.5 {
			continue
		}
		out = append(out, PrefixView{Prefix: strconv.FormatUint(k.hash, 16), Blocks: p.blocks, Model: k.model, Hits: math.Round(h*10) / 10, Workers: copyCounts(p.workers)})
	}
	slices.SortFunc(out, func(a, b PrefixView) int { return cmp.Compare(b.Hits, a.Hits) })
	return out[:min(n, len(out))]
}

func copyCounts(m map[string]int) map[string]int {
	out := make(map[string]int, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// FleetView is the console's picture of the fleet at one instant: every worker as the
// operator API lists it with its last minute's sampled figures, the proxies, the policy,
// the index and the rollout (absent when none ran).
type FleetView struct {
	Time    time.Time         `json:"time"`
	Workers []json.RawMessage `json:"workers"`
	Proxies json.RawMessage   `json:"proxies"`
	Tenants json.RawMessage   `json:"tenants"`
	Policy  json.RawMessage   `json:"policy"`
	Index   json.RawMessage   `json:"index"`
	Rollout json.RawMessage   `json:"rollout,omitempty"`
	Leader  string            `json:"leader,omitempty"`
	// Decisions is the newest decision's id: a client asks /v1/decisions?since= for those
	// after the ones it has.
	Decisions uint64 `json:"decisions"`
}

var consoleJSON = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}

// fleet builds the FleetView.
func (s *Server) fleet(ctx context.Context) FleetView {
	o := operator{s}
	v := FleetView{Time: time.Now()}
	figs := s.console.figures()
	ws, _ := o.ListWorkers(ctx)
	for _, w := range ws {
		b, _ := consoleJSON.Marshal(w)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		m["figures"] = figs[w.GetSpec().GetId()]
		out, _ := json.Marshal(m)
		v.Workers = append(v.Workers, out)
	}
	ps, _ := o.ListProxies(ctx)
	reports := s.xds.NodeReports()
	pm := make([]json.RawMessage, 0, len(ps))
	for _, p := range ps {
		b, _ := consoleJSON.Marshal(p)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		if r, ok := reports[p.GetNodeId()]; ok {
			// How long ago its latest load report came, and the policy versions it routes with.
			m["report_age_s"] = math.Round(time.Since(r.At).Seconds()*10) / 10
			m["policy_versions"] = r.Versions
		}
		out, _ := json.Marshal(m)
		pm = append(pm, out)
	}
	v.Proxies, _ = json.Marshal(pm)
	ts, _ := o.ListTenants(ctx)
	tm := make([]json.RawMessage, 0, len(ts))
	for _, t := range ts {
		b, _ := consoleJSON.Marshal(t)
		tm = append(tm, b)
	}
	v.Tenants, _ = json.Marshal(tm)
	if p, err := o.GetPolicy(ctx); err == nil {
		v.Policy, _ = consoleJSON.Marshal(p)
	}
	if ix, err := o.GetIndex(ctx); err == nil {
		v.Index, _ = consoleJSON.Marshal(ix)
	}
	if r, err := o.GetRollout(ctx); err == nil {
		v.Rollout, _ = consoleJSON.Marshal(r)
	}
	if s.opts.Leader != nil {
		v.Leader = s.opts.Leader.Leader()
	}
	s.console.mu.Lock()
	v.Decisions = s.console.next
	s.console.mu.Unlock()
	return v
}

// consoleRoutes adds the console's read endpoints to mux, under the API's read rule:
//
//	GET /v1/fleet                      FleetView
//	GET /v1/decisions?since=ID&n=N     {"decisions": [DecisionView, newest first], "last": ID}
//	GET /v1/decisions/{id}             DecisionView
//	GET /v1/prefixes?n=N               {"prefixes": [PrefixView, hottest first]}
//	GET /v1/events                     Server-Sent Events: "fleet" (a FleetView) every
//	                                   second, and at once after new decisions
func (s *Server) consoleRoutes(mux *http.ServeMux, opts api.Options) {
	read := func(h http.HandlerFunc) http.Handler { return api.ReadOnly(h, opts) }
	mux.Handle("/v1/fleet", read(func(w http.ResponseWriter, r *http.Request) {
		writeConsoleJSON(w, s.fleet(r.Context()))
	}))
	mux.Handle("/v1/decisions", read(func(w http.ResponseWriter, r *http.Request) {
		since, _ := strconv.ParseUint(r.URL.Query().Get("since"), 10, 64)
		n := queryInt(r, "n", 50, consoleDecisions)
		ds, last := s.console.decisions(since, n)
		if ds == nil {
			ds = []DecisionView{}
		}
		writeConsoleJSON(w, map[string]any{"decisions": ds, "last": last})
	}))
	mux.Handle("/v1/decisions/", read(func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseUint(strings.TrimPrefix(r.URL.Path, "/v1/decisions/"), 10, 64)
		d, ok := s.console.decision(id)
		if err != nil || !ok {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			_, _ = w.Write([]byte(`{"error":{"message":"no such decision is kept (the console keeps the last 1024)","code":"not_found"}}` + "\n"))
			return
		}
		writeConsoleJSON(w, d)
	}))
	mux.Handle("/v1/prefixes", read(func(w http.ResponseWriter, r *http.Request) {
		writeConsoleJSON(w, map[string]any{"prefixes": s.console.hottest(queryInt(r, "n", 10, 100))})
	}))
	mux.Handle("/v1/events", read(s.serveEvents))
}

// serveEvents streams the fleet as Server-Sent Events until the client goes away.
func (s *Server) serveEvents(w http.ResponseWriter, r *http.Request) {
	fl, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	rc := http.NewResponseController(w)
	for {
		// Past the server's write timeout: each event has its own.
		_ = rc.SetWriteDeadline(time.Now().Add(30 * time.Second))
		b, _ := json.Marshal(s.fleet(r.Context()))
		if _, err := w.Write(append(append([]byte("event: fleet\ndata: "), b...), "\n\n"...)); err != nil {
			return
		}
		fl.Flush()
		changed := s.console.wait()
		select {
		case <-r.Context().Done():
			return
		case <-t.C:
		case <-changed:
			// New decisions: at most one extra event a quarter second.
			select {
			case <-r.Context().Done():
				return
			case <-time.After(250 * time.Millisecond):
			}
		}
	}
}

func writeConsoleJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(v)
}

func queryInt(r *http.Request, name string, def, most int) int {
	n, err := strconv.Atoi(r.URL.Query().Get(name))
	if err != nil || n <= 0 {
		return def
	}
	return min(n, most)
}
