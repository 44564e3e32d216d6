package planner

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the planner's Prometheus metrics, all named kvrelay_planner_*.
type metrics struct {
	replicas, floor, needed *prometheus.GaugeVec
	decisions               *prometheus.CounterVec
	actions                 *prometheus.CounterVec
	actuationErrors         *prometheus.CounterVec
	inputs                  *prometheus.GaugeVec
	dryRun                  prometheus.Gauge
	all                     []prometheus.Collector
}

func newMetrics(p *Planner) *metrics {
	m := &metrics{
		replicas: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrelay_planner_replicas",
			Help: "Replicas of each pool as the planner last set or read them."}, []string{"pool"}),
		floor: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrelay_planner_floor_replicas",
			Help: "Replicas throughput mode needs: load mode never scales a pool below this."}, []string{"pool"}),
		needed: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrelay_planner_needed_replicas",
			Help: "Fractional replicas throughput mode computed at its last interval."}, []string{"pool"}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_planner_decisions_total",
			Help: "Planner decisions by pool, mode (throughput, load, retry) and direction (up, down, hold)."}, []string{"pool", "mode", "direction"}),
		actions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_planner_scaling_actions_total",
			Help: "Changes of a pool's size the actuator applied."}, []string{"pool"}),
		actuationErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrelay_planner_actuation_errors_total",
			Help: "Failed actuator calls (each attempt), by pool."}, []string{"pool"}),
		inputs: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrelay_planner_input",
			Help: "The planner's last throughput-mode inputs: request_rate, predicted_rate (req/s), isl, osl, predicted_isl, predicted_osl (tokens), observed_ttft_ms, observed_itl_ms, prefill_correction, decode_correction, replica_prefill_tps, replica_decode_tps."}, []string{"input"}),
		dryRun: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrelay_planner_dry_run",
			Help: "1 when the planner only decides and does not actuate."}),
	}
	if p.cfg.DryRun {
		m.dryRun.Set(1)
	}
	m.all = []prometheus.Collector{m.replicas, m.floor, m.needed, m.decisions, m.actions, m.actuationErrors, m.inputs, m.dryRun}
	for pool := range p.cfg.Pools {
		m.actuationErrors.WithLabelValues(string(pool))
		m.actions.WithLabelValues(string(pool))
	}
	return m
}

// observe updates the metrics after a decision.
func (m *metrics) observe(d Decision) {
	dir := "hold"
	switch {
	case d.To > d.From:
		dir = "up"
	case d.To < d.From:
		dir = "down"
	}
	m.decisions.WithLabelValues(string(d.Pool), d.Mode, dir).Inc()
	if d.Applied {
		m.actions.WithLabelValues(string(d.Pool)).Inc()
	}
	if d.Mode == ModeThroughput {
		m.needed.WithLabelValues(string(d.Pool)).Set(d.Inputs.Needed)
		in := d.Inputs
		for k, v := range map[string]float64{
			"request_rate": in.RequestRate, "predicted_rate": in.PredictedRate, "isl": in.ISL, "osl": in.OSL,
			"predicted_isl": in.PredictedISL, "predicted_osl": in.PredictedOSL,
			"observed_ttft_ms": in.ObservedTTFTMs, "observed_itl_ms": in.ObservedITLMs,
			"prefill_correction": in.PrefillCorrection, "decode_correction": in.DecodeCorrection,
			"replica_prefill_tps": in.ReplicaPrefillTPS, "replica_decode_tps": in.ReplicaDecodeTPS,
		} {
			m.inputs.WithLabelValues(k).Set(v)
		}
	}
}

// Collector returns the planner's metrics for a Prometheus registry.
func (p *Planner) Collector() prometheus.Collector { return (*collector)(p) }

type collector Planner

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, x := range c.m.all {
		x.Describe(ch)
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	p := (*Planner)(c)
	p.mu.Lock()
	for pool, v := range p.snap {
		p.m.replicas.WithLabelValues(string(pool)).Set(float64(v[0]))
		p.m.floor.WithLabelValues(string(pool)).Set(float64(v[1]))
	}
	p.mu.Unlock()
	for _, x := range c.m.all {
		x.Collect(ch)
	}
}

var _ prometheus.Collector = (*collector)(nil)
