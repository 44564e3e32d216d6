package decide

import (
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/dataplane/oai"
)

// metrics are the routing core's Prometheus series, named kvrelay_proxy_* as the proxy's
// own (the core is the proxy's, and the endpoint picker's, deciding half). Label values
// come from bounded sets (configured models and workers, known routes, status codes) so
// series cannot grow with client input. Per-request updates go through children resolved
// once per label combination and cached, so the request path does not allocate.
type metrics struct {
	requests        *prometheus.CounterVec   // model, route, code
	ttft            *prometheus.HistogramVec // model
	itl             *prometheus.HistogramVec // model
	e2e             *prometheus.HistogramVec // model, route
	decision        *prometheus.HistogramVec // stage
	predicted       *prometheus.CounterVec   // worker: prompt blocks the index predicted cached
	reported        *prometheus.CounterVec   // worker: prompt blocks the engine reported cached
	promptBlocks    *prometheus.CounterVec   // worker: prompt blocks routed
	predictionErr   prometheus.Histogram     // |reported − predicted| blocks per request
	regretBlocks    *prometheus.HistogramVec // policy, policy_version: achievable − achieved blocks
	costGap         *prometheus.HistogramVec // policy, policy_version: chosen − cheapest cost
	armTTFT         *prometheus.HistogramVec // policy_version
	armRequests     *prometheus.CounterVec   // policy_version, outcome
	shadow          *prometheus.CounterVec   // result
	shadowOverlap   *prometheus.HistogramVec // arm
	queueDepth      prometheus.Gauge
	queued          *prometheus.CounterVec // outcome: dispatched, rejected, timeout, abandoned, slo_unmet
	ejections       *prometheus.CounterVec // worker
	affinity        *prometheus.CounterVec // outcome: pinned, fallback, unknown
	refused         *prometheus.CounterVec // field
	peerFetches     prometheus.Counter     // requests told to pull their prefix from a peer
	recomputes      prometheus.Counter     // requests told to compute what their worker caches below GPU memory
	pickFallbacks   prometheus.Counter     // picks a gateway served from a fallback endpoint
	inflight        *prometheus.GaugeVec   // worker
	routed          *prometheus.CounterVec // worker, mode
	remoteFallbacks prometheus.Counter
	tooLong         prometheus.Counter     // prompts refused past the model's context length
	disagg          *prometheus.CounterVec // path: local, remote, fallback
	ttftPredErr     *prometheus.HistogramVec
	ttftPredRel     *prometheus.HistogramVec
	ttftPredBias    *prometheus.CounterVec // worker, side: predictions under or over the actual

	mu     sync.Mutex // serialises additions to models
	models atomic.Pointer[map[string]*modelMetrics]
	stages [numStages]prometheus.Observer
}

// Decision stages, timed separately.
const (
	stageParse = iota
	stageTokenize
	stageHash
	stageMatch
	stageScore
	// stageIndex is an index query's round trip (a proxy that keeps no replica asks the
	// control plane about the prompt), from the query's start to its answer.
	stageIndex
	// stageTotal is the whole decision of a request, from its parsed body to its pick,
	// remote tokenization and the index query included.
	stageTotal
	numStages
)

var stageNames = [numStages]string{"parse", "tokenize", "hash", "match", "score", "index", "total"}

func newMetrics(reg prometheus.Registerer) *metrics {
	latency := []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_requests_total", Help: "Requests answered, by model, route and HTTP status code.",
		}, []string{"model", "route", "code"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_time_to_first_token_seconds", Help: "Time from a request's last byte to its first content token, as clients see it.", Buckets: latency,
		}, []string{"model"}),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_inter_token_latency_seconds", Help: "Gaps between consecutive content chunks of streamed responses.",
			Buckets: []float64{0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5},
		}, []string{"model"}),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_request_duration_seconds", Help: "Time from a request's last byte to its response's last byte.", Buckets: latency,
		}, []string{"model", "route"}),
		decision: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_decision_seconds", Help: "Time spent deciding where a request goes, by stage.",
			Buckets: []float64{1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1},
		}, []string{"stage"}),
		predicted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_prefix_predicted_blocks_total", Help: "Prompt blocks the prefix index predicted the chosen worker had cached.",
		}, []string{"worker"}),
		reported: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_prefix_reported_blocks_total", Help: "Prompt blocks the engine reported cached (usage.prompt_tokens_details.cached_tokens).",
		}, []string{"worker"}),
		promptBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_prompt_blocks_total", Help: "Full prompt blocks of routed requests that reported usage.",
		}, []string{"worker"}),
		predictionErr: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_prefix_prediction_error_blocks", Help: "Absolute difference between predicted and reported cached prompt blocks, per request.",
			Buckets: []float64{0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024},
		}),
		regretBlocks: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_routing_regret_blocks", Help: "Routing regret per decision: the most cached prompt blocks any worker that could take the request had, less those of the worker chosen, by policy and policy version (0 for policies that do not match prompts).",
			Buckets: []float64{0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096},
		}, []string{"policy", "policy_version"}),
		costGap: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_routing_cost_gap", Help: "Per decision by cost: the chosen worker's cost less the cheapest candidate's, in the policy's units (latency: seconds of predicted TTFT; kv: blocks), by policy and policy version.",
			Buckets: append([]float64{0}, prometheus.ExponentialBuckets(0.001, 4, 11)...),
		}, []string{"policy", "policy_version"}),
		armTTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_policy_ttft_seconds", Help: "Time to first token of chat and text completions by the routing policy version that routed them (a rollout's stable and candidate arms).",
			Buckets: armTTFTBounds[:],
		}, []string{"policy_version"}),
		armRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_policy_requests_total", Help: "Answered chat and text completions by the routing policy version that routed them and outcome (ok: 2xx; router_error: 5xx, 429, streams that broke after their head; client_error: other 4xx; client_gone: the client left before its answer ended).",
		}, []string{"policy_version", "outcome"}),
		shadow: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_shadow_decisions_total", Help: "Requests a rollout's candidate policy decided in shadow beside the stable one, by result: agree (same worker), disagree, no_pick.",
		}, []string{"result"}),
		shadowOverlap: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_shadow_overlap_blocks", Help: "In shadow, the cached prompt blocks of the worker each arm picked (the stable pick is the one served).",
			Buckets: []float64{0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096},
		}, []string{"arm"}),
		queueDepth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvrelay_proxy_queue_depth", Help: "Requests waiting in the admission queue for a worker under its busy thresholds.",
		}),
		queued: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_queue_requests_total", Help: "Requests that met the admission queue, by outcome.",
		}, []string{"outcome"}),
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_worker_ejections_total", Help: "Times a worker was taken out of rotation after consecutive failures.",
		}, []string{"worker"}),
		affinity: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_response_affinity_total", Help: "Responses API requests naming a stored response (previous_response_id, GET/DELETE /v1/responses/{id}), by outcome: pinned to the worker that holds it; fallback, that worker gone or unhealthy; unknown, a response this proxy did not see.",
		}, []string{"outcome"}),
		pickFallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_pick_fallbacks_total",
			Help: "Picks of the endpoint picker that the gateway served from another endpoint than the picked one (a fallback down the list); their load moved there.",
		}),
		peerFetches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_peer_fetches_total", Help: "Requests sent to a worker told to pull their prompt's prefix from the peer that caches it (peer fetch) instead of computing it.",
		}),
		recomputes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_recomputes_total", Help: "Requests sent to a worker told to compute the prompt blocks it caches below GPU memory rather than load them back (kv_transfer_params max_load_tokens 0), predicted sooner.",
		}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_refused_fields_total", Help: "Requests refused (400) for carrying a field only kvrelay may set, by field.",
		}, []string{"field"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvrelay_proxy_inflight_requests", Help: "Requests this proxy has in flight, by worker.",
		}, []string{"worker"}),
		routed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_routed_requests_total", Help: "Routing decisions, by worker and by the rule that decided (cost, spread, session, or a policy's picker).",
		}, []string{"worker", "mode"}),
		remoteFallbacks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_remote_tokenize_failures_total", Help: "Prompts an engine's /tokenize could not tokenize, routed on an estimate instead.",
		}),
		tooLong: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_context_length_exceeded_total", Help: "Prompts refused (400) for holding more tokens than any worker of their model takes, found before tokenizing them whole.",
		}),
		disagg: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_disagg_requests_total", Help: "Requests of disaggregated pools, by path: remote (prefill worker, KV pulled by the decode worker), local (prefilled on the decode worker: short uncached part or prefill pool busy), fallback (the prefill leg or a decode worker failed).",
		}, []string{"path"}),
		ttftPredErr: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_ttft_prediction_error_seconds", Help: "Absolute error of the latency policy's predicted time to first token (from dispatch), per streamed request.",
			Buckets: []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
		}, []string{"worker"}),
		ttftPredRel: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_ttft_prediction_relative_error", Help: "Absolute error of the predicted time to first token over the actual one, per streamed request.",
			Buckets: []float64{0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10},
		}, []string{"worker"}),
		ttftPredBias: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_ttft_predictions_total", Help: "Streamed requests with a TTFT prediction, by whether it was under or over the actual TTFT.",
		}, []string{"worker", "side"}),
	}
	reg.MustRegister(m.requests, m.ttft, m.itl, m.e2e, m.decision, m.predicted, m.reported, m.promptBlocks, m.predictionErr,
		m.regretBlocks, m.costGap, m.armTTFT, m.armRequests, m.shadow, m.shadowOverlap, m.queueDepth, m.queued, m.ejections,
		m.affinity, m.refused, m.peerFetches, m.recomputes, m.pickFallbacks, m.inflight, m.routed, m.remoteFallbacks, m.tooLong, m.disagg,
		m.ttftPredErr, m.ttftPredRel, m.ttftPredBias)
	m.models.Store(&map[string]*modelMetrics{})
	m.refused.WithLabelValues("kv_transfer_params")
	for _, o := range []string{"pinned", "fallback", "unknown"} {
		m.affinity.WithLabelValues(o)
	}
	for i, n := range stageNames {
		m.stages[i] = m.decision.WithLabelValues(n)
	}
	return m
}

// modelMetrics are one model's series, resolved once; the request path reaches them through
// a copy-on-write map, without locks.
type modelMetrics struct {
	ttft, itl prometheus.Observer
	e2e       [numRoutes]prometheus.Observer
	ok        [numRoutes]prometheus.Counter // status 200
	codes     [numRoutes]sync.Map           // other HTTP statuses → prometheus.Counter
}

// numRoutes bounds oai.Kind values (1..4); index 0 is for requests that never got a kind.
const numRoutes = 5

func (m *metrics) forModel(model string) *modelMetrics {
	if mm, ok := (*m.models.Load())[model]; ok {
		return mm
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	old := *m.models.Load()
	if mm, ok := old[model]; ok {
		return mm
	}
	mm := &modelMetrics{ttft: m.ttft.WithLabelValues(model), itl: m.itl.WithLabelValues(model)}
	for k := 1; k < numRoutes; k++ {
		mm.e2e[k] = m.e2e.WithLabelValues(model, oai.Kind(k).String())
		mm.ok[k] = m.requests.WithLabelValues(model, oai.Kind(k).String(), "200")
	}
	next := make(map[string]*modelMetrics, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[model] = mm
	m.models.Store(&next)
	return mm
}

// request counts one answered request.
func (m *metrics) request(model string, kind oai.Kind, code int) {
	m.requestOf(m.forModel(model), model, kind, code)
}

// requestOf counts one answered request of model, whose series are mm.
func (m *metrics) requestOf(mm *modelMetrics, model string, kind oai.Kind, code int) {
	k := int(kind)
	if k <= 0 || k >= numRoutes {
		return
	}
	if code == 200 {
		mm.ok[k].Inc()
		return
	}
	if c, ok := mm.codes[k].Load(code); ok {
		c.(prometheus.Counter).Inc()
		return
	}
	c := m.requests.WithLabelValues(model, kind.String(), strconv.Itoa(code))
	mm.codes[k].Store(code, c)
	c.Inc()
}

// workerMetrics are one worker's routing series, resolved once.
type workerMetrics struct {
	predicted, reported, promptBlocks prometheus.Counter
	ejections                         prometheus.Counter
	inflight                          prometheus.Gauge
	cost, spread, session, picked     prometheus.Counter
	slo                               prometheus.Counter
	predErr, predRel                  prometheus.Observer
	predUnder, predOver               prometheus.Counter
}

func (m *metrics) forWorker(id string) *workerMetrics {
	return &workerMetrics{
		predicted:    m.predicted.WithLabelValues(id),
		reported:     m.reported.WithLabelValues(id),
		promptBlocks: m.promptBlocks.WithLabelValues(id),
		ejections:    m.ejections.WithLabelValues(id),
		inflight:     m.inflight.WithLabelValues(id),
		cost:         m.routed.WithLabelValues(id, "cost"),
		spread:       m.routed.WithLabelValues(id, "spread"),
		session:      m.routed.WithLabelValues(id, "session"),
		picked:       m.routed.WithLabelValues(id, "pick"),
		slo:          m.routed.WithLabelValues(id, "slo"),
		predErr:      m.ttftPredErr.WithLabelValues(id),
		predRel:      m.ttftPredRel.WithLabelValues(id),
		predUnder:    m.ttftPredBias.WithLabelValues(id, "under"),
		predOver:     m.ttftPredBias.WithLabelValues(id, "over"),
	}
}

// prediction records how far a request's predicted TTFT was from what it took.
func (wm *workerMetrics) prediction(predicted, actual float64) {
	d := actual - predicted
	if d > 0 {
		wm.predUnder.Inc()
	} else {
		wm.predOver.Inc()
		d = -d
	}
	wm.predErr.Observe(d)
	if actual > 0 {
		wm.predRel.Observe(d / actual)
	}
}

func (wm *workerMetrics) routedBy(mode string) prometheus.Counter {
	switch mode {
	case "cost":
		return wm.cost
	case "spread":
		return wm.spread
	case "session":
		return wm.session
	case "slo":
		return wm.slo
	}
	return wm.picked
}
