package proxy

import (
	"context"
	"fmt"
	"math"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/kvrelay/kvrelay/dataplane/decide"
	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/client"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// xdsState is what a proxy fed by a control plane keeps beside its routing state: the gRPC
// connection its three streams share (workers and policy over delta ADS, the index journal,
// load reports), the index replica, and the stable position of every worker id it has seen.
//
// Nothing here is on the request path: the streams update the routers' pools, the workers'
// reported load and the replica, which the event loops read without waiting on the control
// plane. When the control plane is away the last state stays in force.
type xdsState struct {
	conn     *grpc.ClientConn
	ads      *client.Client
	journal  *journal.Client
	reporter *client.Reporter
	replica  *prefix.Replica
	// remote, with Config.IndexQuery, answers from the control plane's index in the
	// replica's stead (asked through query); the replica then stays empty.
	remote *prefix.Remote
	query  xdsv1.IndexQueryClient
	// primary is the index the routers read, the replica or remote: told the pool's slots
	// and the policy's tier weights.
	primary interface {
		prefix.Index
		SetSlots([]int)
		SetWeights(blockset.Weights)
	}
	index  prefix.Index // primary overlaid with this proxy's recent decisions
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu            sync.Mutex     // one update at a time
	pos           map[string]int // worker id → route.Worker.Index, for the process's life
	policyVersion uint64
	updates       uint64
	// applied are the worker and policy resources of the last update, to tell an update
	// of loads alone (the same resources) from one that changes the pool; codecsFailed is
	// whether that update failed to load a model's tokenizer (the next is applied whole, to
	// try again).
	appliedWorkers []*xdsv1.Worker
	appliedPolicy  *xdsv1.RoutingPolicy
	codecsFailed   bool
	// pushed is each worker's last pushed load and when it arrived, which ageLoads fades
	// once it is older than the config's LoadStaleAfter; stale counts those that are.
	pushed map[string]pushedLoad
	// acked is the nanotime of the control plane's last answer on the load stream.
	acked atomic.Int64
	stale atomic.Int64

	// sent holds this proxy's last load reports, per worker, by seq: a pushed load's
	// fleet-wide sums include one report of this proxy, and the router takes exactly that
	// share out (it counts its current load itself). The load names its merge (Load.epoch)
	// and the load stream said which report each merge includes (included, a ring by
	// epoch); a control plane without epochs names the report in the load (Load.reports).
	nodeID   string
	sentMu   sync.Mutex
	sent     [sentReports]sentReport // ring by seq
	last     uint64                  // the latest report's seq
	included [sentReports]inclusion  // ring by epoch
	newest   inclusion               // the latest merge heard of
}

// inclusion is the control plane's word that merge epoch includes this proxy's report seq.
type inclusion struct{ epoch, seq uint64 }

// sentReports is how many recent reports the proxy remembers: 6.4 s at the 100 ms interval,
// far past the push lag. A pushed load naming an older one falls back to the latest (a
// control plane keeps an unchanged report under its first seq).
const sentReports = 64

type pushedLoad struct {
	w  *route.Worker
	r  *route.Reported
	at int64 // nanotime of its arrival
}

// ageLoads fades every pushed load older than LoadStaleAfter linearly to nothing over as long
// again, so that a worker the control plane last saw busy is not shunned forever once it has
// gone: the router then sees only this proxy's own requests there. A load is as young as
// the control plane's last answer on the load stream: while it answers, a worker it does
// not push again is one whose load has not moved past its band (or has not changed).
func (s *Server) ageLoads(now int64) {
	x := s.xds
	if x == nil {
		return
	}
	after := int64(s.cfg.LoadStaleAfter)
	x.mu.Lock()
	defer x.mu.Unlock()
	stale := 0
	heard := x.acked.Load()
	for _, p := range x.pushed {
		age := now - max(p.at, heard)
		if p.r == nil || age <= after {
			continue
		}
		stale++
		f := 1 - float64(age-after)/float64(after)
		if f <= 0 {
			p.w.FadeReported(nil)
			continue
		}
		scale := func(n int) int { return int(math.Round(float64(n) * f)) }
		p.w.FadeReported(&route.Reported{
			Running: scale(p.r.Running), Waiting: scale(p.r.Waiting), KVUsage: p.r.KVUsage * f,
			PrefillTokens: scale(p.r.PrefillTokens), DecodeBlocks: scale(p.r.DecodeBlocks),
		})
	}
	x.stale.Store(int64(stale))
}

type sentReport struct {
	seq   uint64
	loads map[string]ownSent
}

type ownSent struct{ prefill, decode int64 }

// setupXDS builds empty routers over the replica and starts following the control plane.
func (s *Server) setupXDS(ctx context.Context) error {
	nodeID := s.cfg.NodeID
	if nodeID == "" {
		host, _ := os.Hostname()
		nodeID = host + "-" + strconv.Itoa(os.Getpid())
	}
	// With a control plane, the core's own index only remembers recent decisions
	// (Config.RecentTTL, decideConfig), overlaid on the replica.
	x := &xdsState{replica: prefix.NewReplica(blockset.DefaultWeights), pos: map[string]int{}, pushed: map[string]pushedLoad{}, nodeID: nodeID}
	pool := route.NewPoolIndexed(nil)
	x.primary = x.replica
	if s.cfg.IndexQuery {
		// No replica: the control plane's index answers each prompt, asked before routing.
		x.remote = prefix.NewRemote(func(ctx context.Context, req *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, error) {
			return x.query.Match(ctx, req)
		}, nodeID, s.cfg.IndexQueryTimeout, blockset.DefaultWeights)
		x.primary = x.remote
	}
	x.index = prefix.NewOverlay(x.primary, s.core.Index())
	// Policy version 0 until the control plane's policy arrives.
	if err := s.core.Build(pool, x.index, s.cfg.routeConfig(), "0"); err != nil {
		return err
	}
	s.setModels(pool)

	creds, err := s.cfg.XDSAuth.DialOptions(s.cfg.XDS, s.log)
	if err != nil {
		return err
	}
	conn, err := client.Dial(s.cfg.XDS, creds...)
	if err != nil {
		return err
	}
	x.conn = conn
	x.query = xdsv1.NewIndexQueryClient(conn)
	var serves func(*xdsv1.Worker) bool
	if len(s.cfg.ServeModels) > 0 {
		serves = s.serves // the loads of the served workers' shards only
	}
	x.ads, err = client.New(conn, client.Options{
		NodeID:         nodeID,
		Serves:         serves,
		Models:         s.cfg.ServeModels, // the control plane sends their workers only
		OnUpdate:       s.applyXDS,
		ValidateWorker: s.checkWorker,
		ValidatePolicy: s.checkPolicy,
		ValidateKeys:   s.keys.CheckRemote,
		OnKeys:         s.applyKeys,
	})
	if err != nil {
		conn.Close()
		return err
	}
	x.journal = journal.NewClient(conn, journal.ClientOptions{
		NodeID:  nodeID,
		Models:  s.cfg.ServeModels,
		OnError: func(err error) { s.log.Debug("index journal stream ended", "err", err) },
	})
	x.reporter, err = client.NewReporter(conn, client.ReporterOptions{NodeID: nodeID, Snapshot: s.ownLoad, Arms: s.core.ArmReports, Decisions: s.core.ReportDecisions, Fits: s.latencyFits, Included: x.noteIncluded, Acked: x.noteAcked, Interval: 100 * time.Millisecond,
		Tenants: s.tenantDemand, Grants: s.applyGrants})
	if err != nil {
		conn.Close()
		return err
	}
	s.xds = x
	s.metrics.reg.MustRegister(newXDSCollector(s))
	runCtx, cancel := context.WithCancel(context.Background())
	x.cancel = cancel
	x.wg.Add(1)
	go func() { defer x.wg.Done(); _ = x.ads.Run(runCtx) }()
	if x.remote != nil {
		s.core.SetIndexQuery(x.remote)
	} else {
		x.wg.Add(1)
		go func() { defer x.wg.Done(); _ = x.journal.Run(runCtx, x.replica) }()
	}
	if !s.cfg.DisableLoadReports {
		x.wg.Add(1)
		go func() { defer x.wg.Done(); _ = x.reporter.Run(runCtx) }()
	}

	if s.cfg.XDSSyncTimeout > 0 {
		t := time.NewTimer(s.cfg.XDSSyncTimeout)
		defer t.Stop()
		select {
		case <-x.ads.Synced():
			s.log.Info("control plane synced", "xds", s.cfg.XDS, "node", nodeID, "workers", len(s.core.Pool().Workers))
		case <-t.C:
			s.log.Warn("no answer from the control plane yet; serving 503 until workers arrive", "xds", s.cfg.XDS, "node", nodeID)
		case <-ctx.Done():
			s.stopXDS()
			return ctx.Err()
		}
	}
	return nil
}

// stopXDS stops following the control plane.
func (s *Server) stopXDS() {
	if x := s.xds; x != nil && x.cancel != nil {
		x.cancel()
		x.wg.Wait()
		x.conn.Close()
		x.cancel = nil
	}
}

// checkWorker is the proxy's own check of a pushed worker, on top of xds.ValidateWorker.
func (s *Server) checkWorker(w *xdsv1.Worker) error {
	if !s.serves(w) {
		return nil // dropped by servedWorkers: another model's settings are not this proxy's concern
	}
	u, err := url.Parse(w.GetUrl())
	if err != nil || u.Scheme != "http" || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return fmt.Errorf("worker %s: url %q is not http://host:port", w.GetId(), w.GetUrl())
	}
	if bs := int(w.GetBlockSize()); bs != 0 && bs != s.cfg.BlockSize {
		return fmt.Errorf("worker %s: block size %d differs from the proxy's %d (its prompt hashes would never match; run the proxy with --block-size %d)", w.GetId(), bs, s.cfg.BlockSize, bs)
	}
	return nil
}

// applyXDS installs the control plane's state: the pool of workers (keeping the Worker, and
// so the load and connections, of each that did not change), their health and reported
// load (loads.LoadOf), the replica's slots, the codecs of new models and the routing
// policy. Called by the ADS client, one call at a time.
func (s *Server) applyXDS(workers []*xdsv1.Worker, policy *xdsv1.RoutingPolicy, loads xds.PushedLoads) {
	x := s.xds
	x.mu.Lock()
	defer x.mu.Unlock()
	x.updates++
	workers = s.servedWorkers(workers)

	if !x.codecsFailed && policy == x.appliedPolicy && slices.Equal(workers, x.appliedWorkers) && x.applyLoads(workers, loads) {
		return
	}
	x.appliedWorkers, x.appliedPolicy = workers, policy
	workers = lastOfEachID(workers)
	states := append([]*decide.WorkerState(nil), s.core.WorkerStates()...)
	present := make([]*route.Worker, 0, len(workers))
	var slots []int
	for _, res := range workers {
		id := res.GetId()
		pos, ok := x.pos[id]
		if !ok {
			pos = len(x.pos)
			x.pos[id] = pos
		}
		for len(states) <= pos {
			states = append(states, nil)
		}
		host := upstreamHost(res.GetUrl())
		cand := &route.Worker{
			ID: id, Index: pos, URL: "http://" + host, Addr: host, Model: res.GetModel(), LoRAs: slices.Clone(res.GetLoraAdapters()),
			MaxModelLen: int(min(res.GetMaxModelLen(), 1<<30)),
			Role:        route.Role(res.GetRole()), BlockSize: s.cfg.BlockSize, Capacity: int(res.GetCapacityBlocks()),
			Engine: latency.Engine{MaxNumSeqs: int(min(res.GetMaxNumSeqs(), 1<<30)), MaxBatchedTokens: int(min(res.GetMaxNumBatchedTokens(), 1<<30))},
			Pins:   engines.Kind(res.GetEngine()).Pins(),
		}
		if t := res.GetKvTiers(); t != nil && t.GetKvBytesPerToken() <= 1<<30 && bandwidthOK(t.GetHostBandwidth()) && bandwidthOK(t.GetDiskBandwidth()) && bandwidthOK(t.GetSharedBandwidth()) && bandwidthOK(t.GetPeerBandwidth()) {
			cand.Engine.KVBytesPerToken = float64(t.GetKvBytesPerToken())
			cand.Engine.HostBandwidth, cand.Engine.DiskBandwidth = t.GetHostBandwidth(), t.GetDiskBandwidth()
			cand.Engine.SharedBandwidth = t.GetSharedBandwidth()
			cand.Engine.PeerBandwidth = t.GetPeerBandwidth()
		}
		if p := res.GetKvTiers().GetP2PPort(); p <= 65535 {
			cand.P2PPort = int(p)
		}
		// A worker whose identity is unchanged keeps its Worker: its load and connections.
		st := states[pos]
		switch {
		case st == nil:
			st = s.core.NewWorkerState(cand)
			s.metrics.forUpstream(id)
			states[pos] = st
		case !sameIdentity(st.W, cand):
			st = st.With(cand)
			states[pos] = st
		}
		w := st.W
		w.SetDraining(res.GetDraining() || !res.GetHealthy())
		load := loads.LoadOf(res)
		rep := reportedLoad(x.ownSent(id, load), load)
		w.SetReported(rep)
		x.pushed[id] = pushedLoad{w: w, r: rep, at: nanotime()}
		present = append(present, w)
		for len(slots) <= pos {
			slots = append(slots, -1)
		}
		slots[pos] = int(res.GetSlot())
	}
	if len(x.pushed) > len(present) {
		keep := make(map[string]bool, len(present))
		for _, w := range present {
			keep[w.ID] = true
		}
		for id := range x.pushed {
			if !keep[id] {
				delete(x.pushed, id)
			}
		}
	}
	pool := route.NewPoolIndexed(present)
	for len(slots) < pool.Size() {
		slots = append(slots, -1)
	}
	// States first: a loop that sees the new pool must find every worker's state.
	s.core.SetWorkers(states)
	x.primary.SetSlots(slots)
	err := s.core.BuildCodecs(pool)
	if err != nil {
		s.log.Error("loading the tokenizer of a pushed model; its prompts route by load", "err", err)
	}
	x.codecsFailed = err != nil
	s.setModels(pool)
	s.core.SetPool(pool)
	shareFits(workers, present)
	if policy != nil {
		s.core.ApplyCandidate(pool, x.index, s.candidateOf(policy))
	}

	if policy != nil && policy.GetVersion() != x.policyVersion {
		cfg := policyConfig(s.cfg.routeConfig(), policy)
		mode, threshold := s.cfg.Disagg, s.cfg.DisaggThreshold
		if m := policy.GetDisagg(); m != "" {
			mode = m
		}
		if policy.DisaggThreshold != nil {
			threshold = int(max(min(policy.GetDisaggThreshold(), math.MaxInt32), math.MinInt32))
		}
		if err := s.core.SetPolicy(cfg, policy.GetVersion(), mode, threshold); err != nil {
			// xds.ValidatePolicy passed it, so this is a policy this proxy does not know.
			s.log.Error("pushed routing policy not applied", "version", policy.GetVersion(), "err", err)
		} else {
			x.policyVersion = policy.GetVersion()
			if tw := policy.GetTierWeights(); len(tw) > 0 {
				w := blockset.DefaultWeights
				copy(w[:], tw)
				x.primary.SetWeights(w)
			}
			s.log.Info("routing policy applied", "version", x.policyVersion, "policy", cfg.Policy)
			// The pushed policy wins over the proxy's own flags; say so where they differ.
			own := s.cfg.routeConfig()
			if own.Policy != cfg.Policy {
				s.log.Warn("the control plane's routing policy replaces this proxy's --policy", "flag", own.Policy, "pushed", cfg.Policy)
			}
			if own.Busy != cfg.Busy {
				s.log.Warn("the control plane's busy thresholds replace this proxy's own",
					"flag_prefill_tokens", own.Busy.MaxPrefillTokens, "pushed_prefill_tokens", cfg.Busy.MaxPrefillTokens,
					"flag_decode_blocks", own.Busy.MaxDecodeBlocks, "pushed_decode_blocks", cfg.Busy.MaxDecodeBlocks,
					"flag_kv_fraction", own.Busy.MaxKVFraction, "pushed_kv_fraction", cfg.Busy.MaxKVFraction)
			}
		}
	}
}

// applyLoads takes an update whose workers and policy are those applied last, so only
// their loads moved: each worker's reported load is replaced, the pool left as it is. It
// reports false, changing nothing, when a worker is not in the pool (the caller then applies
// the update whole). x.mu is held.
func (x *xdsState) applyLoads(workers []*xdsv1.Worker, loads xds.PushedLoads) bool {
	for _, res := range workers {
		if _, ok := x.pushed[res.GetId()]; !ok {
			return false
		}
	}
	now := nanotime()
	for _, res := range workers {
		id := res.GetId()
		p := x.pushed[id]
		load := loads.LoadOf(res)
		rep := reportedLoad(x.ownSent(id, load), load)
		p.w.SetReported(rep)
		x.pushed[id] = pushedLoad{w: p.w, r: rep, at: now}
	}
	return true
}

// servedWorkers keeps the workers that serve one of the models the proxy routes
// (Config.ServeModels; all of them when it names none), and those that name no model.
func (s *Server) servedWorkers(ws []*xdsv1.Worker) []*xdsv1.Worker {
	if len(s.cfg.ServeModels) == 0 {
		return ws
	}
	out := make([]*xdsv1.Worker, 0, len(ws))
	for _, w := range ws {
		if s.serves(w) {
			out = append(out, w)
		}
	}
	return out
}

// serves reports whether the proxy routes to w: it names no model, or serves one the proxy
// routes (Config.ServeModels, every model when empty), as its base model or an adapter.
func (s *Server) serves(w *xdsv1.Worker) bool {
	return len(s.cfg.ServeModels) == 0 || xds.ServesAny(w, s.cfg.ServeModels)
}

// candidateOf is the rollout candidate a pushed policy carries (nil: none).
func (s *Server) candidateOf(p *xdsv1.RoutingPolicy) *decide.Candidate {
	c := p.GetCandidate()
	if c == nil {
		return nil
	}
	return &decide.Candidate{Version: c.GetVersion(), Config: policyConfig(s.cfg.routeConfig(), c), Share: p.GetCandidateShare(), Shadow: p.GetShadow()}
}

// policyConfig is base with the routing settings of a pushed policy.
func policyConfig(base route.Config, p *xdsv1.RoutingPolicy) route.Config {
	cfg := base
	cfg.Policy = p.GetPolicy()
	cfg.OverlapWeight = p.GetOverlapWeight()
	cfg.QueueWeight = p.GetQueueWeight()
	cfg.Temperature = p.GetTemperature()
	if p.ComputeWeight != nil {
		cfg.ComputeWeight = p.GetComputeWeight()
	}
	if p.BackgroundWeight != nil {
		cfg.BackgroundWeight = p.GetBackgroundWeight()
	}
	cfg.CacheThreshold = p.GetCacheThreshold()
	cfg.Profile = xds.ProfileOf(p.GetProfile())
	cfg.Busy = route.BusyFilter{
		MaxPrefillTokens: int64(p.GetBusyPrefillTokens()),
		MaxDecodeBlocks:  int64(p.GetBusyDecodeBlocks()),
		MaxKVFraction:    p.GetBusyKvFraction(),
		// The policy carries no requests threshold: the proxy's own (busy_requests) stays.
		MaxRequests: base.Busy.MaxRequests,
	}
	if ttl := p.GetSessionTtlMs(); ttl > 0 {
		cfg.SessionTTL = time.Duration(ttl) * time.Millisecond
	}
	return cfg
}

// checkPolicy refuses (NACKs) a pushed policy, or its candidate, that this proxy cannot
// build: a profile naming a plugin its registry lacks, or a parameter one does not take.
func (s *Server) checkPolicy(p *xdsv1.RoutingPolicy) error {
	if err := policyConfig(s.cfg.routeConfig(), p).Validate(); err != nil {
		return err
	}
	if c := p.GetCandidate(); c != nil {
		if err := policyConfig(s.cfg.routeConfig(), c).Validate(); err != nil {
			return fmt.Errorf("candidate: %w", err)
		}
	}
	return nil
}

// lastOfEachID is workers with only the last resource of each id (xDS names a resource by
// its id, so a push holds one; a malformed one holding two must not give one slot two
// workers).
func lastOfEachID(workers []*xdsv1.Worker) []*xdsv1.Worker {
	last := make(map[string]int, len(workers))
	for i, w := range workers {
		last[w.GetId()] = i
	}
	if len(last) == len(workers) {
		return workers
	}
	out := make([]*xdsv1.Worker, 0, len(last))
	for i, w := range workers {
		if last[w.GetId()] == i {
			out = append(out, w)
		}
	}
	return out
}

// sameIdentity reports whether two workers are the same engine to route to.
func sameIdentity(a, b *route.Worker) bool {
	return a.ID == b.ID && a.URL == b.URL && a.Model == b.Model && a.Role == b.Role && a.BlockSize == b.BlockSize && a.Capacity == b.Capacity && a.P2PPort == b.P2PPort &&
		a.Engine == b.Engine && slices.Equal(a.LoRAs, b.LoRAs) && a.MaxModelLen == b.MaxModelLen
}

// ownSent is this proxy's share of a pushed load on worker id: what it reported for id in
// the report reports names for its node, nothing when reports does not name it (the sums
// include none of its requests), its latest report when that one is no longer remembered.
func (x *xdsState) ownSent(id string, l *xdsv1.Load) ownSent {
	x.sentMu.Lock()
	defer x.sentMu.Unlock()
	var seq uint64
	if e := l.GetEpoch(); e != 0 {
		switch in := x.included[e%sentReports]; {
		case in.epoch == e:
			seq = in.seq
		case x.newest.epoch > e:
			// No proxy's share of the worker changed since its merge, so this proxy's
			// share in the latest merge is the one its sums hold.
			seq = x.newest.seq
		default:
			// Its merge's word has not come yet: the latest report is the likeliest.
			seq = x.last
		}
	} else {
		reports := l.GetReports()
		i, ok := slices.BinarySearchFunc(reports, x.nodeID, func(r *xdsv1.ReportSeq, node string) int {
			return strings.Compare(r.GetNodeId(), node)
		})
		if !ok {
			return ownSent{}
		}
		seq = reports[i].GetSeq()
	}
	r := &x.sent[seq%sentReports]
	if r.seq != seq || seq == 0 {
		r = &x.sent[x.last%sentReports]
	}
	return r.loads[id]
}

// noteAcked records that the control plane answered on the load stream.
func (x *xdsState) noteAcked() { x.acked.Store(nanotime()) }

// noteIncluded records the load stream's word that merge epoch includes report seq; (0, 0)
// forgets every merge heard of (a new stream, perhaps to another replica).
func (x *xdsState) noteIncluded(epoch, seq uint64) {
	x.sentMu.Lock()
	defer x.sentMu.Unlock()
	if epoch == 0 {
		x.included, x.newest = [sentReports]inclusion{}, inclusion{}
		return
	}
	in := inclusion{epoch, seq}
	x.included[epoch%sentReports] = in
	if epoch > x.newest.epoch {
		x.newest = in
	}
}

// reportedLoad turns a pushed load into the router's Reported, taking out of the fleet-wide
// in-flight sums own, this proxy's share in the report the sums include (not the requests it
// has started or finished since: the router adds its current own load back).
func reportedLoad(own ownSent, l *xdsv1.Load) *route.Reported {
	if l == nil {
		return nil
	}
	return &route.Reported{
		Running:       int(l.GetRunning()),
		Waiting:       int(l.GetWaiting()),
		KVUsage:       l.GetKvUsage(),
		PrefillTokens: int(max(0, int64(l.GetPrefillTokens())-own.prefill)),
		DecodeBlocks:  int(max(0, int64(l.GetDecodeBlocks())-own.decode)),
	}
}

// ownLoad is the load report numbered seq: this proxy's requests in flight per worker.
func (s *Server) ownLoad(seq uint64) []*xdsv1.WorkerLoad {
	pool := s.core.Pool()
	out := make([]*xdsv1.WorkerLoad, 0, len(pool.Workers))
	x := s.xds
	x.sentMu.Lock()
	defer x.sentMu.Unlock()
	r := &x.sent[seq%sentReports]
	if r.loads == nil {
		r.loads = make(map[string]ownSent, len(pool.Workers))
	}
	r.seq, x.last = seq, seq
	clear(r.loads)
	for _, w := range pool.Workers {
		inflight, prefill, decode := w.Own()
		prefill, decode = max(prefill, 0), max(decode, 0)
		if inflight == 0 && prefill == 0 && decode == 0 {
			continue
		}
		r.loads[w.ID] = ownSent{prefill: prefill, decode: decode}
		out = append(out, &xdsv1.WorkerLoad{WorkerId: w.ID, Inflight: uint32(inflight), PrefillTokens: uint64(prefill), DecodeBlocks: uint64(decode)})
	}
	return out
}

// XDSStats says how the proxy follows its control plane; ok is false without one.
type XDSStats struct {
	ADS     client.Stats
	Journal journal.ClientStats
	Reports uint64
	// Blocks is the number of distinct blocks in the index replica.
	Blocks int
	// IndexQueries, IndexQueryFailures and IndexUnasked count the control plane index's
	// queries (Config.IndexQuery), those that failed, and matches of a prompt with no
	// answer; IndexQueryBytes the bytes of the queries and of their answers.
	IndexQueries, IndexQueryFailures, IndexUnasked, IndexQueryBytes uint64
	PolicyVersion                                                   uint64
	// CandidateVersion is a rollout's candidate policy routing beside it (0: none), with its
	// share of the requests, or in shadow.
	CandidateVersion uint64
	CandidateShare   float64
	Shadow           bool
}

// XDSStats returns the proxy's control-plane counters.
func (s *Server) XDSStats() (XDSStats, bool) {
	x := s.xds
	if x == nil {
		return XDSStats{}, false
	}
	x.mu.Lock()
	v := x.policyVersion
	x.mu.Unlock()
	st := XDSStats{ADS: x.ads.Stats(), Journal: x.journal.Stats(), Reports: x.reporter.Sent(), Blocks: x.replica.Len(), PolicyVersion: v}
	if x.remote != nil {
		rs := x.remote.Stats()
		st.IndexQueries, st.IndexQueryFailures, st.IndexUnasked = rs.Queries.Load(), rs.Failed.Load(), rs.Unasked.Load()
		st.IndexQueryBytes = rs.RequestBytes.Load() + rs.ResponseBytes.Load()
	}
	if c, ok := s.core.CandidateStatus(); ok {
		st.CandidateVersion, st.CandidateShare, st.Shadow = c.Version, c.Share, c.Shadow
	}
	return st, true
}

// Remote returns the index the proxy asks the control plane with Config.IndexQuery (nil
// otherwise).
func (s *Server) Remote() *prefix.Remote {
	if s.xds == nil {
		return nil
	}
	return s.xds.remote
}

// Replica returns the proxy's index replica (nil without a control plane).
func (s *Server) Replica() *prefix.Replica {
	if s.xds == nil {
		return nil
	}
	return s.xds.replica
}

// xdsCollector exposes how the proxy follows its control plane.
type xdsCollector struct {
	s                                          *Server
	connected, blocks, policy, workers, stale  *prometheus.Desc
	applied, responses, nacks, streams, report *prometheus.Desc
	snapshots, resumes, marks                  *prometheus.Desc
	queries, queryFailures, unasked, qbytes    *prometheus.Desc
}

func newXDSCollector(s *Server) *xdsCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("kvrelay_proxy_xds_"+name, help, nil, nil)
	}
	return &xdsCollector{
		s:             s,
		connected:     d("connected", "1 while the ADS stream to the control plane is up."),
		blocks:        d("replica_blocks", "Distinct KV blocks in the proxy's index replica."),
		policy:        d("policy_version", "Version of the routing policy in force."),
		workers:       d("workers", "Workers the control plane pushed."),
		stale:         d("load_stale", "Workers whose pushed load is older than load_stale_after and fading to this proxy's own view."),
		applied:       d("journal_changes_total", "Index journal changes applied to the replica."),
		responses:     d("responses_total", "ADS responses received."),
		nacks:         d("nacks_total", "ADS responses and journal batches refused."),
		streams:       d("streams_total", "ADS and journal streams opened (reconnections)."),
		report:        d("load_reports_total", "In-flight load reports sent to the control plane."),
		snapshots:     d("journal_snapshots_total", "Index snapshots the replica was rebuilt from."),
		resumes:       d("journal_resumes_total", "Journal streams that went on without a snapshot on another control plane replica (from the workers' marks)."),
		marks:         d("journal_marks", "Workers whose journal position the replica holds: those a move to another control plane replica resumes rather than fills again."),
		queries:       d("index_queries_total", "Prompts asked of the control plane's index (index_query: no replica)."),
		queryFailures: d("index_query_failures_total", "Index queries that failed or timed out: their prompts routed as uncached."),
		unasked:       d("index_unasked_total", "Index matches of a prompt the control plane's index had not answered (failed, expired or never asked): routed as uncached."),
		qbytes:        d("index_query_bytes_total", "Bytes of the index queries and their answers, encoded."),
	}
}

func (c *xdsCollector) Describe(ch chan<- *prometheus.Desc) { prometheus.DescribeByCollect(c, ch) }

func (c *xdsCollector) Collect(ch chan<- prometheus.Metric) {
	st, ok := c.s.XDSStats()
	if !ok {
		return
	}
	g := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
	k := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	conn := 0.0
	if st.ADS.Connected {
		conn = 1
	}
	g(c.connected, conn)
	g(c.blocks, float64(st.Blocks))
	g(c.policy, float64(st.PolicyVersion))
	g(c.workers, float64(len(c.s.core.Pool().Workers)))
	g(c.stale, float64(c.s.xds.stale.Load()))
	k(c.applied, st.Journal.Applied)
	k(c.responses, st.ADS.Responses)
	k(c.nacks, st.ADS.NACKs+st.Journal.Nacks)
	k(c.streams, st.ADS.Streams+st.Journal.Streams)
	k(c.report, st.Reports)
	k(c.snapshots, st.Journal.Snapshots)
	k(c.resumes, st.Journal.Resumes)
	g(c.marks, float64(st.Journal.Marks))
	if c.s.xds.remote != nil {
		k(c.queries, st.IndexQueries)
		k(c.queryFailures, st.IndexQueryFailures)
		k(c.unasked, st.IndexUnasked)
		k(c.qbytes, st.IndexQueryBytes)
	}
}

// bandwidthOK reports whether an advertised bandwidth is usable: finite and not negative.
func bandwidthOK(v float64) bool { return v >= 0 && !math.IsInf(v, 0) }

// latencyFits is what this proxy's latency models learned of its workers, one fit per model
// and role with each worker's own figures: sent to the control plane every few seconds
// (LoadReport.fits), which pools every proxy's and pushes the pool back (Worker.fit).
func (s *Server) latencyFits() []*xdsv1.LatencyFit {
	byModel := map[*latency.Model]*xdsv1.LatencyFit{}
	var out []*xdsv1.LatencyFit
	for _, w := range s.Workers() {
		m := w.Latency().Model()
		f := byModel[m]
		if f == nil {
			mf := m.Fit()
			if mf.TTFTObs == 0 && mf.DecodeObs == 0 {
				continue // nothing learned of this model yet
			}
			f = &xdsv1.LatencyFit{Model: w.Model, Role: xdsv1.Role(w.Role), Theta: slices.Clone(mf.Theta[:latency.NumFeat]),
				DecodeStep: slices.Clone(mf.DecodeStep[:]), DecodeKv: slices.Clone(mf.DecodeKV[:]),
				TtftObservations: uint64(mf.TTFTObs), DecodeObservations: uint64(mf.DecodeObs)}
			byModel[m] = f
			out = append(out, f)
		}
		wf := w.Latency().Fit()
		f.Workers = append(f.Workers, &xdsv1.WorkerFit{WorkerId: w.ID, Speed: wf.Speed, Occupancy: wf.Occupancy, MaxNumSeqs: uint32(max(wf.MaxNumSeqs, 0)),
			SigmaQueued: wf.SigmaQueued, SigmaFresh: wf.SigmaFresh, Observations: uint64(max(wf.Obs, 0)), DecodeSpeed: wf.DecodeSpeed})
	}
	return out
}

// shareFits hands the fleet's pooled latency fits (Worker.fit) to the workers' models: each
// model once, and each worker its own figures. Fits whose tables are not this build's
// lengths are ignored.
func shareFits(workers []*xdsv1.Worker, present []*route.Worker) {
	shared := map[*latency.Model]bool{}
	for i, res := range workers {
		f := res.GetFit()
		if f == nil || i >= len(present) {
			continue
		}
		w := present[i]
		if m := w.Latency().Model(); !shared[m] && len(f.GetTheta()) == latency.NumFeat &&
			len(f.GetDecodeStep()) == latency.NumDecode && len(f.GetDecodeKv()) == latency.NumKV {
			shared[m] = true
			var lf latency.Fit
			copy(lf.Theta[:], f.GetTheta())
			copy(lf.DecodeStep[:], f.GetDecodeStep())
			copy(lf.DecodeKV[:], f.GetDecodeKv())
			lf.TTFTObs, lf.DecodeObs = int64(min(f.GetTtftObservations(), 1<<62)), int64(min(f.GetDecodeObservations(), 1<<62))
			m.Share(lf)
		}
		for _, wf := range f.GetWorkers() {
			if wf.GetWorkerId() == w.ID {
				w.Latency().Share(latency.WorkerFit{Speed: wf.GetSpeed(), Occupancy: wf.GetOccupancy(), MaxNumSeqs: int(min(wf.GetMaxNumSeqs(), 1<<20)),
					SigmaQueued: wf.GetSigmaQueued(), SigmaFresh: wf.GetSigmaFresh(), Obs: int64(min(wf.GetObservations(), 1<<62)), DecodeSpeed: wf.GetDecodeSpeed()})
			}
		}
	}
}
