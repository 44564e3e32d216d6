package sim

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are a worker's Prometheus metrics under vLLM's names and labels, so that scrapers
// written for vLLM (kvrelay's control plane among them) read a simulated worker unchanged.
// Every method is safe for concurrent use and a nil *Metrics records nothing.
type Metrics struct {
	reg *prometheus.Registry

	running, waiting, usage prometheus.Gauge
	queries, hits           prometheus.Counter
	promptTokens, genTokens prometheus.Counter
	preemptions             prometheus.Counter
	success                 *prometheus.CounterVec
	aborts                  prometheus.Counter
	ttft, itl, e2e          prometheus.Histogram
	queueTime, prefillTime  prometheus.Histogram
	reqPrompt, reqGen       prometheus.Histogram
	kv                      *kvMetrics // nil in role both

	// The block manager's tiers.
	tierTokens                    *prometheus.CounterVec
	externalQueries, externalHits prometheus.Counter
	offloads, evictions, diskErrs *prometheus.CounterVec
	diskReadBytes, diskWriteBytes prometheus.Counter
	pinnedBlocks                  prometheus.Gauge
	pinsRefused                   prometheus.Counter
	peerFetches                   *prometheus.CounterVec
	onboardSkips                  prometheus.Counter
	peerExports                   prometheus.Counter
	peerExportedBlocks            prometheus.Counter
}

// kvMetrics are the KV transfer metrics of a prefill or decode worker: vLLM's NixlConnector
// metrics under their vLLM names, and kvrelay_sim_kv_* for what vLLM does not export.
type kvMetrics struct {
	xferTime, xferBytes, xferDescs prometheus.Histogram
	failedXfers, failedNotifs      prometheus.Counter

	pulls, pulledBlocks, pulledBytes, modelledBytes prometheus.Counter
	pullSeconds, modelledSeconds                    prometheus.Histogram
	pullFailures                                    *prometheus.CounterVec
	checksumErrors                                  prometheus.Counter

	held, heldBlocksTotal    prometheus.Counter
	heldRequests, heldBlocks prometheus.Gauge
	freed                    *prometheus.CounterVec
	unknownNotifs, conflicts prometheus.Counter
}

// Bucket boundaries as vLLM defines them.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets  = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	e2eBuckets  = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
)

// NewMetrics registers a worker's metrics, labelled with the model name, in a registry of its
// own (so several workers can share a process).
func NewMetrics(cfg Config) *Metrics {
	reg := prometheus.NewRegistry()
	labels := prometheus.Labels{"model_name": cfg.Model, "engine": "0"}
	f := factory{reg: reg, labels: labels}
	m := &Metrics{
		reg:          reg,
		running:      f.gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
		waiting:      f.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
		usage:        f.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
		queries:      f.counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."),
		hits:         f.counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
		promptTokens: f.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed."),
		genTokens:    f.counter("vllm:generation_tokens_total", "Number of generation tokens processed."),
		preemptions:  f.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine."),
		aborts:       f.counter("vllm:request_abort_total", "Number of requests aborted before they finished."),
		ttft:         f.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets),
		itl:          f.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itlBuckets),
		e2e:          f.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e2eBuckets),
		queueTime:    f.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", e2eBuckets),
		prefillTime:  f.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", e2eBuckets),
		reqPrompt:    f.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokenBuckets(cfg.MaxModelLen)),
		reqGen:       f.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", tokenBuckets(cfg.MaxModelLen)),
	}
	m.externalQueries = f.counter("vllm:external_prefix_cache_queries_total", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.")
	m.externalHits = f.counter("vllm:external_prefix_cache_hits_total", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.")
	m.diskReadBytes = f.counter("kvrelay_sim_kv_disk_read_bytes_total", "Bytes read back from the disk tier's block files.")
	m.diskWriteBytes = f.counter("kvrelay_sim_kv_disk_written_bytes_total", "Bytes written to the disk tier's block files.")
	m.pinnedBlocks = f.gauge("kvrelay_sim_kv_pinned_blocks", "Blocks pinned now (nvext.cache_control), in any tier.")
	m.pinsRefused = f.counter("kvrelay_sim_kv_pins_refused_total", "Pins refused because --max-pinned-fraction of the GPU tier was pinned.")
	m.tierTokens = f.counterVec("kvrelay_sim_cached_tokens_by_tier_total", "Prompt tokens found cached, by the tier that held them (GPU, CPU, DISK).", "tier")
	m.offloads = f.counterVec("kvrelay_sim_kv_offloaded_blocks_total", "Blocks copied down to a tier (CPU, DISK).", "tier")
	m.evictions = f.counterVec("kvrelay_sim_kv_gpu_evictions_total", "Cached blocks the GPU tier evicted, by class (ephemeral, once, reused, pinned).", "class")
	m.diskErrs = f.counterVec("kvrelay_sim_kv_disk_errors_total", "Disk tier failures, by kind (write: the block stays off disk; read, checksum: a miss, the file removed).", "kind")
	m.onboardSkips = f.counter("kvrelay_sim_kv_onboard_skipped_blocks_total", "Blocks found in host memory or on disk but computed instead of brought back: their request came up without free GPU blocks for all of them.")
	m.peerFetches = f.counterVec("kvrelay_sim_kv_peer_fetches_total", "Requests told to fetch their prefix from a peer, by outcome (pulled, partial: room for only the prompt's leading blocks, pulled, the rest computed, fallback: the pull failed and the prompt was computed, export_failed: the holder did not answer, none: it held nothing of the prompt, no_room: no free block for a fetch beside the prompt's next chunk when it came up, so it was computed).", "result")
	m.peerExports = f.counter("kvrelay_sim_kv_peer_exports_total", "Prefixes held for a peer to fetch.")
	m.peerExportedBlocks = f.counter("kvrelay_sim_kv_peer_exported_blocks_total", "Blocks held for peers to fetch.")
	for _, t := range []string{MediumGPU, MediumCPU, MediumDISK} {
		m.tierTokens.WithLabelValues(t)
	}
	m.success = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm:request_success_total", Help: "Count of successfully processed requests.", ConstLabels: labels,
	}, []string{"finished_reason"})
	reg.MustRegister(m.success)
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "vllm:cache_config_info", Help: "Information of the LLMEngine CacheConfig",
		ConstLabels: prometheus.Labels{
			"block_size":            strconv.Itoa(cfg.BlockSize),
			"num_gpu_blocks":        strconv.Itoa(cfg.NumGPUBlocks),
			"enable_prefix_caching": strconv.FormatBool(cfg.EnablePrefixCaching),
			"cache_dtype":           "auto",
			"engine":                "0",
		},
	})
	info.Set(1)
	reg.MustRegister(info)
	if cfg.Role == RolePrefill || cfg.Role == RoleDecode {
		m.kv = newKVMetrics(f, cfg)
	}
	return m
}

// Bucket boundaries of vLLM's NixlConnector histograms.
var (
	nixlTimeBuckets  = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	nixlBytesBuckets = []float64{1 << 11, 1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21, 1 << 23, 1 << 25, 1 << 27, 1 << 29, 1 << 31, 1 << 33}
	nixlDescBuckets  = []float64{10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000}
	pullBuckets      = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}
)

func newKVMetrics(f factory, cfg Config) *kvMetrics {
	k := &kvMetrics{
		xferTime:        f.histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", nixlTimeBuckets),
		xferBytes:       f.histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.", nixlBytesBuckets),
		xferDescs:       f.histogram("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL KV Cache transfers.", nixlDescBuckets),
		failedXfers:     f.counter("vllm:nixl_num_failed_transfers_total", "Number of failed NIXL KV Cache transfers."),
		failedNotifs:    f.counter("vllm:nixl_num_failed_notifications_total", "Number of failed NIXL KV Cache notifications."),
		pulls:           f.counter("kvrelay_sim_kv_pulls_total", "Requests whose prompt KV was pulled from a prefill worker."),
		pulledBlocks:    f.counter("kvrelay_sim_kv_pulled_blocks_total", "KV blocks pulled from prefill workers and verified."),
		pulledBytes:     f.counter("kvrelay_sim_kv_pulled_bytes_total", "Bytes really moved by pulls (the modelled size times --kv-bytes-scale)."),
		modelledBytes:   f.counter("kvrelay_sim_kv_modelled_bytes_total", "Bytes the pulled blocks have in the modelled model (--kv-bytes-per-token)."),
		pullSeconds:     f.histogram("kvrelay_sim_kv_pull_seconds", "Time a request waited for its prompt KV: connect, transfer, checks and the modelled transfer time.", pullBuckets),
		modelledSeconds: f.histogram("kvrelay_sim_kv_pull_modelled_seconds", "Modelled transfer time of a pull (bytes / --kv-transfer-bandwidth / --speedup-ratio).", pullBuckets),
		checksumErrors:  f.counter("kvrelay_sim_kv_checksum_errors_total", "Pulls whose blocks did not hold the prompt's KV."),
		held:            f.counter("kvrelay_sim_kv_held_requests_total", "Finished requests whose blocks were kept for a remote decode."),
		heldBlocksTotal: f.counter("kvrelay_sim_kv_held_blocks_total", "Blocks kept for remote decodes."),
		heldRequests:    f.gauge("kvrelay_sim_kv_held_requests", "Requests whose blocks are kept for a remote decode now."),
		heldBlocks:      f.gauge("kvrelay_sim_kv_held_blocks", "Blocks kept for remote decodes now."),
		unknownNotifs:   f.counter("kvrelay_sim_kv_unknown_notifications_total", "Notifications naming no held request (late, after the timeout, or malformed)."),
		conflicts:       f.counter("kvrelay_sim_kv_slot_conflicts_total", "Requests answered without kv_transfer_params because a capped region's slot was taken."),
	}
	k.pullFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrelay_sim_kv_pull_failures_total", Help: "Pulls that failed, by reason (peer, timeout, checksum, layout, resolve, rejected, slots, aborted, transfer).", ConstLabels: f.labels,
	}, []string{"reason"})
	k.freed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrelay_sim_kv_freed_requests_total", Help: "Held requests whose blocks were freed, by what freed them (notification, timeout).", ConstLabels: f.labels,
	}, []string{"by"})
	f.reg.MustRegister(k.pullFailures, k.freed)
	for _, by := range []string{"notification", "timeout"} {
		k.freed.WithLabelValues(by)
	}
	role := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvrelay_sim_kv_connector_info", Help: "KV connector of a disaggregated worker.",
		ConstLabels: prometheus.Labels{
			"model_name": cfg.Model, "engine": "0", "role": string(cfg.Role),
			"slot_bytes": strconv.Itoa(cfg.SlotBytes()), "slots": strconv.Itoa(cfg.RegionSlots()),
			"kv_bytes_per_token": strconv.Itoa(cfg.KVBytesPerToken),
		},
	})
	role.Set(1)
	f.reg.MustRegister(role)
	return k
}

// Registry is what /metrics serves.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

type factory struct {
	reg    *prometheus.Registry
	labels prometheus.Labels
}

func (f factory) gauge(name, help string) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: f.labels})
	f.reg.MustRegister(g)
	return g
}

func (f factory) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: f.labels})
	f.reg.MustRegister(c)
	return c
}

func (f factory) histogram(name, help string, buckets []float64) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: f.labels, Buckets: buckets})
	f.reg.MustRegister(h)
	return h
}

// tokenBuckets are vLLM's 1-2-5 series up to the model length.
func tokenBuckets(maxLen int) []float64 {
	var b []float64
	for exp := 1.0; ; exp *= 10 {
		for _, m := range []float64{1, 2, 5} {
			v := m * exp
			if v > float64(maxLen) {
				return b
			}
			b = append(b, v)
		}
	}
}

func (m *Metrics) load(running, waiting int, usage float64) {
	if m == nil {
		return
	}
	m.running.Set(float64(running))
	m.waiting.Set(float64(waiting))
	m.usage.Set(usage)
}

func (m *Metrics) admitted(prompt, cached int) {
	if m == nil {
		return
	}
	m.queries.Add(float64(prompt))
	m.hits.Add(float64(cached))
	m.promptTokens.Add(float64(prompt))
}

func (m *Metrics) step(generated int) {
	if m == nil || generated == 0 {
		return
	}
	m.genTokens.Add(float64(generated))
}

func (m *Metrics) firstToken(d time.Duration) {
	if m != nil {
		m.ttft.Observe(d.Seconds())
	}
}

// queueAndPrefill records a request's time waiting to be scheduled and, from then, to its
// first token (vLLM's request_queue_time_seconds and request_prefill_time_seconds).
func (m *Metrics) queueAndPrefill(queue, prefill time.Duration) {
	if m != nil {
		m.queueTime.Observe(queue.Seconds())
		m.prefillTime.Observe(prefill.Seconds())
	}
}

func (m *Metrics) interToken(d time.Duration) {
	if m != nil {
		m.itl.Observe(d.Seconds())
	}
}

func (m *Metrics) preempted() {
	if m != nil {
		m.preemptions.Inc()
	}
}

func (m *Metrics) aborted() {
	if m != nil {
		m.aborts.Inc()
	}
}

func (m *Metrics) finished(r *Request, reason FinishReason, now time.Time) {
	if m == nil {
		return
	}
	m.e2e.Observe(now.Sub(r.arrival).Seconds())
	m.reqPrompt.Observe(float64(r.promptLen))
	m.reqGen.Observe(float64(len(r.tokens) - r.promptLen))
	m.success.WithLabelValues(string(reason)).Inc()
}

func (m *Metrics) nixlTransfer(d time.Duration, bytes, descs int) {
	if m == nil || m.kv == nil {
		return
	}
	m.kv.xferTime.Observe(d.Seconds())
	m.kv.xferBytes.Observe(float64(bytes))
	m.kv.xferDescs.Observe(float64(descs))
}

func (m *Metrics) nixlFailed() {
	if m != nil && m.kv != nil {
		m.kv.failedXfers.Inc()
	}
}

func (m *Metrics) kvNotifFailed() {
	if m != nil && m.kv != nil {
		m.kv.failedNotifs.Inc()
	}
}

func (m *Metrics) kvPulled(blocks, bytes, modelledBytes int, modelled, waited time.Duration) {
	if m == nil || m.kv == nil {
		return
	}
	m.kv.pulls.Inc()
	m.kv.pulledBlocks.Add(float64(blocks))
	m.kv.pulledBytes.Add(float64(bytes))
	m.kv.modelledBytes.Add(float64(modelledBytes))
	m.kv.modelledSeconds.Observe(modelled.Seconds())
	m.kv.pullSeconds.Observe(waited.Seconds())
}

func (m *Metrics) kvPullFailed(reason string) {
	if m != nil && m.kv != nil {
		m.kv.pullFailures.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) kvChecksumError() {
	if m != nil && m.kv != nil {
		m.kv.checksumErrors.Inc()
	}
}

// kvHeld records a request whose blocks are kept (blocks > 0) or freed (blocks < 0, by says
// what freed them).
func (m *Metrics) kvHeld(blocks int, by string) {
	if m == nil || m.kv == nil {
		return
	}
	if blocks > 0 {
		m.kv.held.Inc()
		m.kv.heldBlocksTotal.Add(float64(blocks))
		m.kv.heldRequests.Inc()
	} else {
		m.kv.heldRequests.Dec()
		m.kv.freed.WithLabelValues(by).Inc()
	}
	m.kv.heldBlocks.Add(float64(blocks))
}

func (m *Metrics) kvUnknownNotif() {
	if m != nil && m.kv != nil {
		m.kv.unknownNotifs.Inc()
	}
}

func (m *Metrics) kvConflict() {
	if m != nil && m.kv != nil {
		m.kv.conflicts.Inc()
	}
}

func (f factory) counterVec(name, help, label string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: f.labels}, []string{label})
	f.reg.MustRegister(c)
	return c
}

func (m *Metrics) tierHit(medium string, tokens int) {
	if m == nil {
		return
	}
	m.tierTokens.WithLabelValues(medium).Add(float64(tokens))
	if medium != MediumGPU {
		m.externalHits.Add(float64(tokens))
	}
}

// externalQuery counts the prompt tokens a request asked the tiers below the GPU for.
func (m *Metrics) externalQuery(tokens int) {
	if m != nil {
		m.externalQueries.Add(float64(tokens))
	}
}

func (m *Metrics) offloaded(medium string) {
	if m != nil {
		m.offloads.WithLabelValues(medium).Inc()
	}
}

func (m *Metrics) evicted(class string) {
	if m != nil {
		m.evictions.WithLabelValues(class).Inc()
	}
}

func (m *Metrics) diskRead(n int) {
	if m != nil {
		m.diskReadBytes.Add(float64(n))
	}
}

func (m *Metrics) diskWritten(n int) {
	if m != nil {
		m.diskWriteBytes.Add(float64(n))
	}
}

func (m *Metrics) diskError(kind string) {
	if m != nil {
		m.diskErrs.WithLabelValues(kind).Inc()
	}
}

func (m *Metrics) pinRefused() {
	if m != nil {
		m.pinsRefused.Inc()
	}
}

func (m *Metrics) pins(n int) {
	if m != nil {
		m.pinnedBlocks.Set(float64(n))
	}
}

func (m *Metrics) onboardSkipped(blocks int) {
	if m != nil {
		m.onboardSkips.Add(float64(blocks))
	}
}

func (m *Metrics) peerFetch(result string) {
	if m != nil {
		m.peerFetches.WithLabelValues(result).Inc()
	}
}

func (m *Metrics) peerExported(blocks int) {
	if m != nil {
		m.peerExports.Inc()
		m.peerExportedBlocks.Add(float64(blocks))
	}
}
