package controlplane

import (
	"math"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/controlplane/rollout"
)

// collector exposes the control plane's state as Prometheus metrics, read at scrape time.
type collector struct {
	s *Server

	indexBlocks, workerBlocks                    *prometheus.Desc
	indexEvents                                  *prometheus.Desc
	ingestEvents, ingestGaps, ingestReplays      *prometheus.Desc
	ingestRestarts, ingestStale, ingestUnclaimed *prometheus.Desc
	journalNext, journalSent, journalSnapshots   *prometheus.Desc
	proxies, pushes, pushedResources, acks       *prometheus.Desc
	nacks, loadReporters, workers, policyVersion *prometheus.Desc
	unknownLoads, refusedStreams, refusedConns   *prometheus.Desc
	armRequests, armTTFTP90, armHitRate          *prometheus.Desc
	journalDropped, xdsDropped                   *prometheus.Desc
	rolloutState, rolloutStep, rolloutShare      *prometheus.Desc
	stepRequests, stepTTFTP90, stepHitRate       *prometheus.Desc
	stepErrorRate, stepITLP90, stepRouterErrors  *prometheus.Desc
	leading, leaderTerms                         *prometheus.Desc
}

func newCollector(s *Server) *collector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("kvrelay_controlplane_"+name, help, labels, nil)
	}
	return &collector{
		s:                s,
		leading:          d("leader", "1 while this replica leads the control plane (makes changes: the operator API's writes, rollout steps, the planner's scaling), 0 while it follows."),
		leaderTerms:      d("leader_terms_total", "Times this replica started leading."),
		indexBlocks:      d("index_blocks", "Distinct KV blocks in the global index."),
		workerBlocks:     d("index_worker_blocks", "KV blocks the index holds for a worker, by tier.", "worker", "tier"),
		indexEvents:      d("index_block_events_total", "Block events applied to the index, by kind.", "kind"),
		ingestEvents:     d("ingest_events_total", "KV events received from a worker.", "worker"),
		ingestGaps:       d("ingest_gaps_total", "Sequence gaps in a worker's KV events.", "worker"),
		ingestReplays:    d("ingest_replays_total", "Replays asked of a worker after a gap.", "worker"),
		ingestRestarts:   d("ingest_restarts_total", "Engine restarts seen in a worker's KV events (its blocks dropped).", "worker"),
		ingestStale:      d("ingest_stale_total", "Gaps without replay that left a worker's index stale.", "worker"),
		ingestUnclaimed:  d("ingest_unclaimed_total", "KV event messages on a bound endpoint whose topic no worker claims (dropped).", "endpoint"),
		journalNext:      d("journal_offset", "Offset of the next index journal change."),
		journalSent:      d("journal_changes_sent_total", "Index changes sent to proxies."),
		journalSnapshots: d("journal_snapshots_total", "Index snapshots sent to proxies."),
		proxies:          d("proxies", "Proxies connected over ADS."),
		pushes:           d("xds_pushes_total", "ADS responses pushed to proxies."),
		pushedResources:  d("xds_pushed_resources_total", "Resources set by ADS pushes."),
		acks:             d("xds_acks_total", "ADS responses acknowledged by proxies."),
		nacks:            d("xds_nacks_total", "ADS responses refused by proxies."),
		loadReporters:    d("load_reporters", "Proxies whose in-flight load report is live."),
		unknownLoads:     d("load_report_unknown_workers_total", "Load report entries dropped for naming a worker that is not published."),
		armRequests:      d("policy_requests_total", "Chat and text completions the proxies answered, by the routing policy version that routed them and outcome (ok: 2xx; router_error: 5xx, 429, broken streams; client_error: other 4xx; client_gone: the client left first), summed over the proxies reporting now.", "policy_version", "outcome"),
		armTTFTP90:       d("policy_ttft_p90_seconds", "TTFT p90 of the requests each routing policy version routed, over the proxies reporting now (a rollout's stable and candidate arms).", "policy_version"),
		armHitRate:       d("policy_prefix_hit_rate", "Share of prompt blocks engines reported cached, of the requests each routing policy version routed.", "policy_version"),
		refusedConns:     d("xds_refused_connections_total", "xDS connections closed at once for a peer host already holding 32."),
		refusedStreams:   d("xds_refused_streams_total", "xDS streams refused, by reason (no_token, bad_token, wrong_node: a node id the credential was not issued for, bad_cert, revoked: an open stream whose token was withdrawn, too_many: the peer's stream limit or the server's).", "reason"),
		journalDropped:   d("journal_dropped_streams_total", "Index journal streams ended by the control plane, by reason (send_timeout: the proxy took nothing for 30 s, ack_timeout: it left a batch unacknowledged for 30 s); the proxy reconnects and resumes or resnapshots.", "reason"),
		xdsDropped:       d("xds_dropped_streams_total", "ADS streams ended by the control plane, by reason (send_timeout: the proxy took no response for 30 s).", "reason"),
		workers:          d("workers", "Workers in the registry, by health.", "state"),
		policyVersion:    d("policy_version", "Version of the routing policy pushed to proxies."),
		rolloutState:     d("rollout_state", "1 for the state the latest policy rollout is in, 0 for the others (shadow, canary, paused, promoted, rolled_back, aborted).", "state"),
		rolloutStep:      d("rollout_step", "Step the latest policy rollout is at (index into its steps, -1 in shadow)."),
		rolloutShare:     d("rollout_candidate_share", "Share of the requests the latest rollout's candidate routes now."),
		stepRequests:     d("rollout_step_requests", "Requests each arm (stable, candidate) answered in the running rollout step so far.", "arm"),
		stepTTFTP90:      d("rollout_step_ttft_p90_seconds", "TTFT p90 of each arm in the running rollout step so far.", "arm"),
		stepHitRate:      d("rollout_step_prefix_hit_rate", "Prefix hit rate of each arm in the running rollout step so far.", "arm"),
		stepITLP90:       d("rollout_step_itl_p90_seconds", "Inter-token latency p90 of each arm in the running rollout step so far.", "arm"),
		stepErrorRate:    d("rollout_step_error_rate", "Share of non-2xx answers of each arm in the running rollout step so far.", "arm"),
		stepRouterErrors: d("rollout_step_router_error_rate", "Share of each arm's answers in the running rollout step so far that the routing is answerable for (5xx, 429, broken streams).", "arm"),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	g := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	k := func(d *prometheus.Desc, v uint64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), l...)
	}
	g(c.indexBlocks, float64(s.index.Len()))
	lead := 0.0
	if s.opts.Leader.Leading() {
		lead = 1
	}
	g(c.leading, lead)
	k(c.leaderTerms, uint64(s.opts.Leader.Terms()))
	is := s.index.Stats()
	k(c.indexEvents, is.Stored, "stored")
	k(c.indexEvents, is.Removed, "removed")
	k(c.indexEvents, is.Cleared, "cleared")
	k(c.indexEvents, is.Orphans, "orphan")
	k(c.indexEvents, is.Unknown, "unknown")
	k(c.indexEvents, is.BadExtraKeys, "bad_extra_keys")
	k(c.indexEvents, is.UnknownMedium, "unknown_medium")
	k(c.indexEvents, is.Copies, "copy")
	k(c.indexEvents, is.Placeholders, "placeholder")
	k(c.indexEvents, is.PlaceholdersResolved, "placeholder_resolved")
	k(c.indexEvents, is.SharedExpired, "shared_expired")
	states := s.view.Snapshot()
	healthy, unhealthy, draining := 0, 0, 0
	for _, w := range s.reg.Workers() {
		b := s.index.Blocks(w.ID)
		for t, name := range []string{"gpu", "cpu", "disk", "shared"} {
			g(c.workerBlocks, float64(b[t]), w.ID, name)
		}
		if st := s.ingest.Stats(w.ID); st != nil {
			k(c.ingestEvents, st.Events.Load(), w.ID)
			k(c.ingestGaps, st.Gaps.Load(), w.ID)
			k(c.ingestReplays, st.Replays.Load(), w.ID)
			k(c.ingestRestarts, st.Restarts.Load(), w.ID)
			k(c.ingestStale, st.Stale.Load(), w.ID)
		}
		switch {
		case w.Draining:
			draining++
		case states[w.ID].Healthy:
			healthy++
		default:
			unhealthy++
		}
	}
	for ep, n := range s.ingest.Unclaimed() {
		k(c.ingestUnclaimed, n, ep)
	}
	g(c.workers, float64(healthy), "healthy")
	g(c.workers, float64(unhealthy), "unhealthy")
	g(c.workers, float64(draining), "draining")
	g(c.journalNext, float64(s.journal.Next()))
	js := s.jserver.Stats()
	k(c.journalSent, js.Changes)
	k(c.journalSnapshots, js.Snapshots)
	k(c.journalDropped, js.SlowStreams, "send_timeout")
	k(c.journalDropped, js.UnackedStreams, "ack_timeout")
	xs := s.xds.Stats()
	g(c.proxies, float64(len(xs.Proxies)))
	k(c.pushes, xs.Pushes)
	k(c.pushedResources, xs.PushedResources)
	k(c.acks, xs.ACKs)
	k(c.nacks, xs.NACKs)
	g(c.loadReporters, float64(xs.LoadReporters))
	k(c.unknownLoads, xs.UnknownWorkerLoads)
	k(c.refusedStreams, xs.RefusedStreams, "too_many")
	k(c.refusedConns, xs.RefusedConns)
	for v, a := range s.xds.Arms() {
		ver := strconv.FormatUint(v, 10)
		bad := a.RouterErrors + a.ClientErrors + a.ClientGone
		k(c.armRequests, a.Requests-min(bad, a.Requests), ver, "ok")
		k(c.armRequests, a.RouterErrors, ver, "router_error")
		k(c.armRequests, a.ClientErrors, ver, "client_error")
		k(c.armRequests, a.ClientGone, ver, "client_gone")
		if q := (rollout.Histogram{Bounds: a.TTFTBounds, Counts: a.TTFTCounts}).Quantile(0.9); !math.IsNaN(q) {
			g(c.armTTFTP90, q, ver)
		}
		if a.PromptBlocks > 0 {
			g(c.armHitRate, float64(a.CachedBlocks)/float64(a.PromptBlocks), ver)
		}
	}
	k(c.xdsDropped, xs.SlowStreams, "send_timeout")
	for reason, n := range s.xdsAuth.Refused() {
		k(c.refusedStreams, n, reason)
	}
	g(c.policyVersion, float64(s.reg.Policy().Version))
	if rec, cur, err := s.rollouts.latest(); err == nil {
		for _, st := range []string{rollout.StateShadow, rollout.StateCanary, rollout.StatePaused, rollout.StatePromoted, rollout.StateRolledBack, rollout.StateAborted} {
			g(c.rolloutState, b2f(rec.R.State == st), st)
		}
		share, _ := rec.R.Share()
		g(c.rolloutStep, float64(rec.R.Step))
		g(c.rolloutShare, share)
		if !rec.R.Done() {
			g(c.stepRequests, float64(cur.StableRequests), "stable")
			g(c.stepRequests, float64(cur.CandidateRequests), "candidate")
			g(c.stepTTFTP90, cur.StableTTFTP90, "stable")
			g(c.stepTTFTP90, cur.CandidateTTFTP90, "candidate")
			g(c.stepHitRate, cur.StableHitRate, "stable")
			g(c.stepHitRate, cur.CandidateHitRate, "candidate")
			g(c.stepITLP90, cur.StableITLP90, "stable")
			g(c.stepITLP90, cur.CandidateITLP90, "candidate")
			g(c.stepErrorRate, cur.StableErrorRate, "stable")
			g(c.stepErrorRate, cur.CandidateErrorRate, "candidate")
			g(c.stepRouterErrors, cur.StableRouterErrorRate, "stable")
			g(c.stepRouterErrors, cur.CandidateRouterErrorRate, "candidate")
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
