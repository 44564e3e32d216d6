package loadview

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// counters are one target's poll counters, written by its poller and read by Stats.
type counters struct {
	scrapes, scrapeFailures        atomic.Uint64
	probes, probeFailures          atomic.Uint64
	discoveries, discoveryFailures atomic.Uint64
	becameHealthy, becameUnhealthy atomic.Uint64
	remote                         atomic.Uint64
	lastScrapeNanos                atomic.Int64
}

func (c *counters) remoteTaken() { c.remote.Add(1) }

func (c *counters) scrapeDone(d time.Duration, ok bool) {
	c.scrapes.Add(1)
	if !ok {
		c.scrapeFailures.Add(1)
	}
	c.lastScrapeNanos.Store(int64(d))
}

func (c *counters) probeDone(ok bool) {
	c.probes.Add(1)
	if !ok {
		c.probeFailures.Add(1)
	}
}

func (c *counters) discoveryDone(ok bool) {
	c.discoveries.Add(1)
	if !ok {
		c.discoveryFailures.Add(1)
	}
}

func (c *counters) flipped(healthy bool) {
	if healthy {
		c.becameHealthy.Add(1)
	} else {
		c.becameUnhealthy.Add(1)
	}
}

// TargetStats are one target's poll counters. Counts only grow while the target stays in the
// view (a changed target keeps its counters; a removed one loses them), as Prometheus
// counters should.
type TargetStats struct {
	// Scrapes counts metrics scrapes; ScrapeFailures those that failed (unreachable,
	// non-200, unparseable, or without the engine's load metrics).
	Scrapes, ScrapeFailures uint64
	// Probes counts health probes (made only after a failed scrape); ProbeFailures those
	// that failed.
	Probes, ProbeFailures uint64
	// Discoveries counts /v1/models requests; DiscoveryFailures those that failed.
	Discoveries, DiscoveryFailures uint64
	// BecameHealthy and BecameUnhealthy count health transitions.
	BecameHealthy, BecameUnhealthy uint64
	// Remote counts the polls that took another replica's reading instead
	// (Options.Delegated).
	Remote uint64
	// LastScrape is how long the last scrape took.
	LastScrape time.Duration
	// Healthy is the target's current health.
	Healthy bool
}

// Stats returns every target's counters, keyed by ID. The map is the caller's.
func (v *View) Stats() map[string]TargetStats {
	v.mu.RLock()
	defer v.mu.RUnlock()
	out := make(map[string]TargetStats, len(v.stats))
	for id, c := range v.stats {
		out[id] = TargetStats{
			Scrapes:           c.scrapes.Load(),
			ScrapeFailures:    c.scrapeFailures.Load(),
			Probes:            c.probes.Load(),
			ProbeFailures:     c.probeFailures.Load(),
			Discoveries:       c.discoveries.Load(),
			DiscoveryFailures: c.discoveryFailures.Load(),
			BecameHealthy:     c.becameHealthy.Load(),
			BecameUnhealthy:   c.becameUnhealthy.Load(),
			Remote:            c.remote.Load(),
			LastScrape:        time.Duration(c.lastScrapeNanos.Load()),
			Healthy:           v.states[id].Healthy,
		}
	}
	return out
}

// The metrics a View exports as a prometheus.Collector, one series per worker.
var (
	descScrapes = prometheus.NewDesc("kvrelay_loadview_scrapes_total",
		"Metrics scrapes of a worker by the control plane's load view.", []string{"worker"}, nil)
	descScrapeFailures = prometheus.NewDesc("kvrelay_loadview_scrape_failures_total",
		"Metrics scrapes of a worker that failed.", []string{"worker"}, nil)
	descProbes = prometheus.NewDesc("kvrelay_loadview_health_probes_total",
		"Health probes of a worker (made after a failed scrape).", []string{"worker"}, nil)
	descProbeFailures = prometheus.NewDesc("kvrelay_loadview_health_probe_failures_total",
		"Health probes of a worker that failed.", []string{"worker"}, nil)
	descDiscoveryFailures = prometheus.NewDesc("kvrelay_loadview_model_discovery_failures_total",
		"Model discoveries (/v1/models) of a worker that failed.", []string{"worker"}, nil)
	descUnhealthy = prometheus.NewDesc("kvrelay_loadview_unhealthy_transitions_total",
		"Times a worker turned unhealthy.", []string{"worker"}, nil)
	descHealthy = prometheus.NewDesc("kvrelay_loadview_healthy",
		"1 when the worker is healthy, 0 when not.", []string{"worker"}, nil)
	descRemote = prometheus.NewDesc("kvrelay_loadview_remote_readings_total",
		"Polls of a worker that took another control plane replica's reading of it instead of scraping.", []string{"worker"}, nil)
	descScrapeSeconds = prometheus.NewDesc("kvrelay_loadview_last_scrape_seconds",
		"Duration of the last metrics scrape of a worker.", []string{"worker"}, nil)
)

// Describe implements prometheus.Collector.
func (v *View) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descScrapes, descScrapeFailures, descProbes, descProbeFailures,
		descDiscoveryFailures, descUnhealthy, descHealthy, descScrapeSeconds, descRemote} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (v *View) Collect(ch chan<- prometheus.Metric) {
	for id, s := range v.Stats() {
		healthy := 0.0
		if s.Healthy {
			healthy = 1
		}
		ch <- prometheus.MustNewConstMetric(descScrapes, prometheus.CounterValue, float64(s.Scrapes), id)
		ch <- prometheus.MustNewConstMetric(descScrapeFailures, prometheus.CounterValue, float64(s.ScrapeFailures), id)
		ch <- prometheus.MustNewConstMetric(descProbes, prometheus.CounterValue, float64(s.Probes), id)
		ch <- prometheus.MustNewConstMetric(descProbeFailures, prometheus.CounterValue, float64(s.ProbeFailures), id)
		ch <- prometheus.MustNewConstMetric(descDiscoveryFailures, prometheus.CounterValue, float64(s.DiscoveryFailures), id)
		ch <- prometheus.MustNewConstMetric(descUnhealthy, prometheus.CounterValue, float64(s.BecameUnhealthy), id)
		ch <- prometheus.MustNewConstMetric(descHealthy, prometheus.GaugeValue, healthy, id)
		ch <- prometheus.MustNewConstMetric(descScrapeSeconds, prometheus.GaugeValue, s.LastScrape.Seconds(), id)
		ch <- prometheus.MustNewConstMetric(descRemote, prometheus.CounterValue, float64(s.Remote), id)
	}
}

var _ prometheus.Collector = (*View)(nil)
