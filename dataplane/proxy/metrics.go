package proxy

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvrelay/kvrelay/dataplane/tenant"
)

// metrics are the proxy's own Prometheus metrics, all named kvrelay_proxy_*: what carrying
// requests costs and meets (engine failures, retries, migrations, cut-off streams, prefill
// legs, off-loop steps). The routing core registers its own series (requests, TTFT,
// decisions, the queue, workers' load) on the same registry. Label values come from bounded
// sets (configured workers, known outcomes) so series cannot grow with client input.
type metrics struct {
	reg *prometheus.Registry

	upstreamErrs    *prometheus.CounterVec // worker, kind
	retries         prometheus.Counter
	poisoned        prometheus.Counter
	migrations      *prometheus.CounterVec // outcome: continued, completed, failed
	aborted         *prometheus.CounterVec // reason: client_gone, slow_client, upstream_died
	draining        prometheus.Gauge
	offLoop         prometheus.Counter // prompts tokenized off the event loop
	prefillSeconds  prometheus.Histogram
	prefillInflight prometheus.Gauge
	prefillFailures prometheus.Counter
	speculative     *prometheus.CounterVec // outcome: sent, failed, skipped
	// tenantRequests counts the requests each tenant had admitted, tenantRefused those
	// refused, by tenant (empty: no valid key) and reason (invalid_api_key or the budget).
	tenantRequests *prometheus.CounterVec
	tenantRefused  *prometheus.CounterVec
	// tenantPrompt, tenantOutput and tenantCached count each tenant's tokens as its answers'
	// usage reports them; tenantQueue is the wait of its requests in the admission queue,
	// tenantTTFT the time to first token of its streamed answers.
	tenantPrompt, tenantOutput, tenantCached *prometheus.CounterVec
	tenantQueue, tenantTTFT                  *prometheus.HistogramVec
	// tenants are the series of each tenant label given so far, by tenant name (at most
	// maxTenantLabels; the rest share otherTenants, labelled "other"), guarded by mu.
	tenants      map[string]*tenantMetrics
	otherTenants *tenantMetrics

	mu        sync.Mutex // guards upstreams, tenants and otherTenants
	upstreams map[string]*upstreamMetrics
}

func newMetrics() *metrics {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	latency := []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}
	m := &metrics{
		reg: reg,
		tenantRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_tenant_requests_total", Help: "Requests admitted, by tenant (--api-keys-file; at most 100 tenants by name, the rest as other).",
		}, []string{"tenant"}),
		tenantRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_tenant_refused_total", Help: "Requests refused, by tenant (empty: no valid API key) and reason (invalid_api_key, or the budget spent: requests, prompt_tokens, output_tokens).",
		}, []string{"tenant", "reason"}),
		tenantPrompt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_tenant_prompt_tokens_total", Help: "Prompt tokens of answered requests, by tenant, as the answers' usage reports them (answers without usage count none).",
		}, []string{"tenant"}),
		tenantOutput: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_tenant_output_tokens_total", Help: "Generated tokens of answered requests, by tenant, as the answers' usage reports them (answers without usage count none).",
		}, []string{"tenant"}),
		tenantCached: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_tenant_cached_tokens_total", Help: "Prompt tokens the engines found cached, by tenant, where the answers report them (usage.prompt_tokens_details.cached_tokens).",
		}, []string{"tenant"}),
		tenantQueue: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_tenant_queue_seconds", Help: "Time requests waited in the admission queue before their dispatch to a worker, by tenant (0 for a request that found a worker at once; those that left the queue unserved are not counted).", Buckets: latency,
		}, []string{"tenant"}),
		tenantTTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_tenant_ttft_seconds", Help: "Time to first token of streamed answers, by tenant: from the request's dispatch to the worker that answers it to its first content token, as kvrelay_proxy_time_to_first_token_seconds measures it (the wait before dispatch is in kvrelay_proxy_tenant_queue_seconds).", Buckets: latency,
		}, []string{"tenant"}),
		tenants: map[string]*tenantMetrics{},
		upstreamErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_upstream_errors_total", Help: "Failures talking to engines, by worker and kind.",
		}, []string{"worker", "kind"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_retries_total", Help: "Requests sent again to another worker after a failure before their first byte.",
		}),
		poisoned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_poisoned_requests_total", Help: "Requests that got a 5xx from two workers: the client got the second, and neither worker was blamed for it.",
		}),
		migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_migrations_total", Help: "Streams whose engine failed after the first token, by outcome: continued on another worker; completed (only the end was missing); failed (could not migrate: the client got an error event).",
		}, []string{"outcome"}),
		aborted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_aborted_requests_total", Help: "Requests cut short, by reason.",
		}, []string{"reason"}),
		draining: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvrelay_proxy_draining", Help: "1 while the proxy drains before stopping.",
		}),
		offLoop: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_off_loop_steps_total", Help: "Steps of large requests (parsing the body, tokenizing the prompt) run on a goroutine of their own instead of the event loop, which serves other connections meanwhile.",
		}),
		prefillSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvrelay_proxy_prefill_leg_seconds", Help: "Duration of prefill legs (request to a prefill worker until its kv_transfer_params).", Buckets: latency,
		}),
		prefillInflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvrelay_proxy_prefill_legs_inflight", Help: "Prefill legs in flight: the prefill pool's queue as this proxy sees it.",
		}),
		prefillFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrelay_proxy_prefill_leg_failures_total", Help: "Prefill legs that failed or timed out (the decode worker prefilled instead).",
		}),
		speculative: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_proxy_speculative_prefills_total", Help: "Speculative prefills (agent hint speculative_prefill) of finished turns, by outcome: sent, failed, skipped (no answer to warm).",
		}, []string{"outcome"}),
		upstreams: map[string]*upstreamMetrics{},
	}
	reg.MustRegister(m.tenantRequests, m.tenantRefused, m.tenantPrompt, m.tenantOutput, m.tenantCached, m.tenantQueue, m.tenantTTFT)
	reg.MustRegister(m.upstreamErrs, m.retries, m.poisoned, m.migrations, m.aborted, m.draining, m.offLoop,
		m.prefillSeconds, m.prefillInflight, m.prefillFailures, m.speculative)
	for _, o := range []string{"continued", "completed", "failed"} {
		m.migrations.WithLabelValues(o)
	}
	return m
}

// upstreamMetrics are one worker's failure series, resolved once.
type upstreamMetrics struct {
	connectErr, resetErr, statusErr, timeoutErr prometheus.Counter
}

// forUpstream returns worker id's failure series, resolving them the first time (when the
// worker joins, so that they read 0 from then on). Failures are rare: a lock is cheap here.
func (m *metrics) forUpstream(id string) *upstreamMetrics {
	m.mu.Lock()
	defer m.mu.Unlock()
	um, ok := m.upstreams[id]
	if !ok {
		um = &upstreamMetrics{
			connectErr: m.upstreamErrs.WithLabelValues(id, "connect"),
			resetErr:   m.upstreamErrs.WithLabelValues(id, "reset"),
			statusErr:  m.upstreamErrs.WithLabelValues(id, "status_5xx"),
			timeoutErr: m.upstreamErrs.WithLabelValues(id, "timeout"),
		}
		m.upstreams[id] = um
	}
	return um
}

// Registerer is the registry behind the proxy's /metrics: callers register extra collectors
// on it (the eBPF probes' metrics, for one) to have them served beside the proxy's own. Safe
// for concurrent use; collectors registered after Start appear from the next scrape on.
func (s *Server) Registerer() prometheus.Registerer { return s.metrics.reg }

// maxTenantLabels bounds the tenant label's values: a keys file of many tenants does not grow
// the metrics without bound.
const maxTenantLabels = 100

// tenantMetrics are one tenant label's series, resolved once: a request of a tenant reaches
// them through the pointer its connection keeps (clientConn.tm), without a lookup by label.
type tenantMetrics struct {
	label                            string
	requests, prompt, output, cached prometheus.Counter
	queue, ttft                      prometheus.Observer
}

// forTenant returns t's series: its name's, or "other"'s past maxTenantLabels names,
// resolving them the first time (so that they read 0 from then on). Once per request, at
// its admission (or refusal).
func (s *Server) forTenant(t *tenant.Tenant) *tenantMetrics {
	m := s.metrics
	m.mu.Lock()
	defer m.mu.Unlock()
	if tm, ok := m.tenants[t.Name]; ok {
		return tm
	}
	if len(m.tenants) < maxTenantLabels {
		tm := m.newTenantMetrics(t.Name)
		m.tenants[t.Name] = tm
		return tm
	}
	if m.otherTenants == nil {
		m.otherTenants = m.newTenantMetrics("other")
	}
	return m.otherTenants
}

// newTenantMetrics resolves the series of tenant label label. The caller holds m.mu.
func (m *metrics) newTenantMetrics(label string) *tenantMetrics {
	return &tenantMetrics{
		label:    label,
		requests: m.tenantRequests.WithLabelValues(label),
		prompt:   m.tenantPrompt.WithLabelValues(label),
		output:   m.tenantOutput.WithLabelValues(label),
		cached:   m.tenantCached.WithLabelValues(label),
		queue:    m.tenantQueue.WithLabelValues(label),
		ttft:     m.tenantTTFT.WithLabelValues(label),
	}
}
