package server

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// MaxReportWorkers bounds the workers one load report may name.
const MaxReportWorkers = 1 << 16

// WorkerLoad is the load proxies report on one worker: requests in flight, the prompt
// tokens they still have to prefill and the KV blocks their decodes hold.
type WorkerLoad struct {
	Inflight      uint32
	PrefillTokens uint64
	DecodeBlocks  uint64
}

// Add sums two loads, saturating.
func (a WorkerLoad) Add(b WorkerLoad) WorkerLoad { return a.add(b) }

func (a WorkerLoad) add(b WorkerLoad) WorkerLoad {
	inflight := uint64(a.Inflight) + uint64(b.Inflight)
	return WorkerLoad{
		Inflight:      uint32(min(inflight, math.MaxUint32)),
		PrefillTokens: satAdd(a.PrefillTokens, b.PrefillTokens),
		DecodeBlocks:  satAdd(a.DecodeBlocks, b.DecodeBlocks),
	}
}

func satAdd(a, b uint64) uint64 {
	if s := a + b; s >= a {
		return s
	}
	return math.MaxUint64
}

// Merged returns the load every live proxy reports, summed per worker id. Workers no proxy
// reports are absent (no load). The map is the caller's.
func (s *Server) Merged() map[string]WorkerLoad { return s.load.merged() }

// MergedReports is Merged together with the report of each node it sums (node id and the
// report's seq, sorted by node id), taken at the same instant, for the Load.reports field of
// control planes without epochs. MergedEpochs replaces it.
func (s *Server) MergedReports() (map[string]WorkerLoad, []*xdsv1.ReportSeq) {
	return s.load.mergedReports()
}

// MergedEpochs is Merged as one numbered merge (Load.epoch): the sums, and for each worker
// the merge in which any proxy's share of it last changed (absent: no proxy has any). Each
// node whose report the merge includes is told so on its load stream, before this returns,
// so that it takes its own share out of the pushed sums: one small message per proxy and
// merge instead of every proxy's report on every worker (queued on each stream before this
// returns, so it usually arrives before the workers it is for), and a worker whose sums and
// shares stay put keeps its epoch and is not sent again.
func (s *Server) MergedEpochs() (map[string]WorkerLoad, map[string]uint64) {
	return s.load.mergedEpochs()
}

// Arms sums the live reports' arms by policy version: each arm's figures over the proxies
// that route with it (histograms with other bounds than the first proxy's are left out).
func (s *Server) Arms() map[uint64]Arm { return SumArms(s.load.nodeArms()) }

// NodeArms returns each live proxy's latest arms by node id: what a replica shares with
// the leader, which sums them with its own proxies' (SumArms). The slices are the caller's
// to read, not to modify.
func (s *Server) NodeArms() map[string][]Arm { return s.load.nodeArms() }

// NodeReport is what the latest load report of a proxy says of it: when it came and the
// routing policy versions the proxy routes with (its arms').
type NodeReport struct {
	At       time.Time
	Versions []uint64
}

// NodeReports returns each live proxy's latest report by node id. The map is the caller's.
func (s *Server) NodeReports() map[string]NodeReport {
	l := s.load
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]NodeReport, len(l.nodes))
	for id, r := range l.nodes {
		nr := NodeReport{At: r.at}
		for _, a := range r.arms {
			nr.Versions = append(nr.Versions, a.Version)
		}
		out[id] = nr
	}
	return out
}

func (l *loadStore) nodeArms() map[string][]Arm {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string][]Arm, len(l.nodes))
	for id, r := range l.nodes {
		if len(r.arms) > 0 {
			out[id] = r.arms
		}
	}
	return out
}

// SumArms sums the arms of several proxies by policy version (Arms).
func SumArms(nodes map[string][]Arm) map[uint64]Arm {
	out := map[uint64]Arm{}
	for _, arms := range nodes {
		for _, a := range arms {
			sum := out[a.Version]
			sum.Version = a.Version
			sum.Requests = satAdd(sum.Requests, a.Requests)
			sum.Errors = satAdd(sum.Errors, a.Errors)
			sum.CachedBlocks = satAdd(sum.CachedBlocks, a.CachedBlocks)
			sum.PromptBlocks = satAdd(sum.PromptBlocks, a.PromptBlocks)
			sum.Shadow = sum.Shadow.add(a.Shadow)
			sum.Rejections = satAdd(sum.Rejections, a.Rejections)
			sum.ServerErrors = satAdd(sum.ServerErrors, a.ServerErrors)
			sum.Decisions = satAdd(sum.Decisions, a.Decisions)
			sum.RegretBlocks = satAdd(sum.RegretBlocks, a.RegretBlocks)
			sum.ITLBounds, sum.ITLCounts = addHistogram(sum.ITLBounds, sum.ITLCounts, a.ITLBounds, a.ITLCounts)
			sum.HitBounds, sum.HitCounts = addHistogram(sum.HitBounds, sum.HitCounts, a.HitBounds, a.HitCounts)
			sum.TTFTBounds, sum.TTFTCounts = addHistogram(sum.TTFTBounds, sum.TTFTCounts, a.TTFTBounds, a.TTFTCounts)
			sum.RouterErrors, sum.ClientErrors = satAdd(sum.RouterErrors, a.RouterErrors), satAdd(sum.ClientErrors, a.ClientErrors)
			sum.ClientGone = satAdd(sum.ClientGone, a.ClientGone)
			if slices.Equal(sum.TTFTBounds, a.TTFTBounds) && (len(a.ITLBounds) == 0 || slices.Equal(sum.ITLBounds, a.ITLBounds)) {
				sum.Groups = addGroups(sum.Groups, a.Groups)
			}
			out[a.Version] = sum
		}
	}
	return out
}

// NodeLoad returns the latest live report of one node, or nil. The map is the caller's.
func (s *Server) NodeLoad(nodeID string) map[string]WorkerLoad { return s.load.node(nodeID) }

// LoadChanged is signalled (a buffered channel of one, so signals coalesce) after the
// merged load may have changed: a report that differs from its node's previous one, a
// node's report dropped when its stream ends or goes stale. The control plane's one
// consumer reads Merged after each signal and pushes the result in Worker resources.
func (s *Server) LoadChanged() <-chan struct{} { return s.load.changed }

// loadStore keeps each node's latest load report.
type loadStore struct {
	staleAfter time.Duration
	now        func() time.Time
	changed    chan struct{}

	mu    sync.Mutex
	nodes map[string]*nodeReport
	// epoch numbers the merges of MergedEpochs; shares holds, per worker, a hash of the
	// proxies' shares the last merge summed and the merge it last changed in; acks the load
	// streams' mailboxes for the inclusions they send (by stream id).
	epoch  uint64
	seed   maphash.Seed
	shares map[string]workerShares
	acks   map[uint64]chan inclusion
	// known is the published workers' ids: reports on others are dropped (counted in
	// unknown), so that a report cannot grow the store past the fleet.
	known   atomic.Pointer[map[string]struct{}]
	unknown atomic.Uint64

	// fitMu guards the pooled fits and when they were pooled (PooledFits).
	fitMu    sync.Mutex
	pooled   map[FitKey]*xdsv1.LatencyFit
	pooledAt time.Time
}

// workerShares is what MergedEpochs remembers of a worker: the hash of the (node, share)
// pairs it summed, and the merge in which that last changed.
type workerShares struct{ hash, epoch uint64 }

// inclusion is one merge's word to one node: its report seq is in merge epoch.
type inclusion struct{ epoch, seq uint64 }

type nodeReport struct {
	stream uint64 // the stream that sent it: only that stream's end drops it
	seq    uint64 // the report's own number (LoadReport.seq)
	at     time.Time
	loads  map[string]WorkerLoad
	arms   []Arm
	// fits are the latest latency fits the node sent (reports carry them every few
	// seconds; those between keep the last).
	fits []*xdsv1.LatencyFit
	// tenants is the latest tenant demand the node sent (every second or so; the reports
	// between keep the last).
	tenants map[string]TenantDemand
}

// Arm is what the proxies saw of the requests one routing policy version routed,
// cumulative (ArmReport): a rollout compares the stable and candidate arms.
type Arm struct {
	Version          uint64
	Requests, Errors uint64
	// TTFTCounts[i] counts first tokens within TTFTBounds[i] seconds; the last entry, one
	// past the bounds, those above.
	TTFTBounds                 []float64
	TTFTCounts                 []uint64
	CachedBlocks, PromptBlocks uint64
	// Shadow is the candidate's shadow sums (ArmReport.shadow_*).
	Shadow Shadow
	// Rejections are its 429 and 503 answers, ServerErrors those of 500 and above.
	Rejections, ServerErrors uint64
	// ITLCounts[i] counts gaps between content chunks within ITLBounds[i] seconds (none
	// from a proxy that reports no gaps).
	ITLBounds []float64
	ITLCounts []uint64
	// Decisions are the requests its policy placed, RegretBlocks their summed regret.
	Decisions, RegretBlocks uint64
	// HitCounts[i] counts requests whose cached share of the prompt was within HitBounds[i].
	HitBounds []float64
	HitCounts []uint64
	// RouterErrors are the answers the routing is answerable for (5xx, broken streams),
	// ClientErrors the 4xx other than 429, ClientGone the requests whose client left first.
	RouterErrors, ClientErrors, ClientGone uint64
	// Groups are the figures by conversation group (ArmReport.groups), sorted by group.
	Groups []ArmGroup
}

// ArmGroup is one conversation group's figures in an arm; its histograms have the arm's
// bounds (or none).
type ArmGroup struct {
	Group                                            uint32
	Requests, RouterErrors, ClientErrors, ClientGone uint64
	CachedBlocks, PromptBlocks                       uint64
	TTFTCounts, ITLCounts                            []uint64
}

// MaxArmGroups bounds the conversation groups of an arm (their numbers too).
const MaxArmGroups = 256

// groupsOf validates an arm's groups: numbered below MaxArmGroups, each once, histograms
// as long as the arm's (or empty); the others are dropped. The result is sorted by group.
func groupsOf(a *xdsv1.ArmReport, ttftLen, itlLen int) []ArmGroup {
	var out []ArmGroup
	seen := map[uint32]bool{}
	for _, g := range a.GetGroups() {
		tc, ic := g.GetTtftCounts(), g.GetItlCounts()
		if g.GetGroup() >= MaxArmGroups || seen[g.GetGroup()] || (len(tc) != 0 && len(tc) != ttftLen) || (len(ic) != 0 && len(ic) != itlLen) {
			continue
		}
		seen[g.GetGroup()] = true
		out = append(out, ArmGroup{Group: g.GetGroup(), Requests: g.GetRequests(), RouterErrors: g.GetRouterErrors(), ClientErrors: g.GetClientErrors(),
			ClientGone: g.GetClientGone(), CachedBlocks: g.GetCachedBlocks(), PromptBlocks: g.GetPromptBlocks(),
			TTFTCounts: slices.Clone(tc), ITLCounts: slices.Clone(ic)})
	}
	slices.SortFunc(out, func(x, y ArmGroup) int { return cmp.Compare(x.Group, y.Group) })
	return out
}

// addGroups adds the groups b to the sum a (both sorted by group), histograms of other
// lengths than the sum's left out (addHistogram, on the arm's bounds).
func addGroups(a, b []ArmGroup) []ArmGroup {
	for _, g := range b {
		i, found := slices.BinarySearchFunc(a, g.Group, func(x ArmGroup, n uint32) int { return cmp.Compare(x.Group, n) })
		if !found {
			g.TTFTCounts, g.ITLCounts = slices.Clone(g.TTFTCounts), slices.Clone(g.ITLCounts)
			a = slices.Insert(a, i, g)
			continue
		}
		s := &a[i]
		s.Requests, s.RouterErrors = satAdd(s.Requests, g.Requests), satAdd(s.RouterErrors, g.RouterErrors)
		s.ClientErrors, s.ClientGone = satAdd(s.ClientErrors, g.ClientErrors), satAdd(s.ClientGone, g.ClientGone)
		s.CachedBlocks, s.PromptBlocks = satAdd(s.CachedBlocks, g.CachedBlocks), satAdd(s.PromptBlocks, g.PromptBlocks)
		_, s.TTFTCounts = addHistogram(nil, s.TTFTCounts, nil, g.TTFTCounts) // the arm's bounds
		_, s.ITLCounts = addHistogram(nil, s.ITLCounts, nil, g.ITLCounts)
	}
	return a
}

// Shadow is what a candidate in shadow decided beside the stable policy: its decisions,
// those that picked another worker, and the sums over them of each pick's cached prompt
// blocks and of its worker's load.
type Shadow struct {
	Picks, Disagreements                   uint64
	StableOverlapBlocks, CandOverlapBlocks uint64
	StableLoad, CandLoad                   uint64
}

func (s Shadow) add(o Shadow) Shadow {
	return Shadow{satAdd(s.Picks, o.Picks), satAdd(s.Disagreements, o.Disagreements),
		satAdd(s.StableOverlapBlocks, o.StableOverlapBlocks), satAdd(s.CandOverlapBlocks, o.CandOverlapBlocks),
		satAdd(s.StableLoad, o.StableLoad), satAdd(s.CandLoad, o.CandLoad)}
}

// MaxReportDecisions bounds the decision samples taken of one report, and
// maxSampleCandidates the candidates of one sample.
const (
	MaxReportDecisions  = 64
	maxSampleCandidates = 64
	maxSampleString     = 256
)

// DecisionsOf returns the decision samples of a report that are whole: at most
// MaxReportDecisions, each with a worker, names no longer than 256 bytes, finite figures,
// and at most 64 candidates (the rest dropped); the others are left out.
func DecisionsOf(r *xdsv1.LoadReport) []*xdsv1.DecisionSample {
	var out []*xdsv1.DecisionSample
	for _, d := range r.GetDecisions() {
		if len(out) == MaxReportDecisions {
			break
		}
		ok := d.GetWorker() != "" && len(d.GetWorker()) <= maxSampleString && len(d.GetModel()) <= maxSampleString && len(d.GetMode()) <= maxSampleString &&
			finite(d.GetOverlapBlocks(), d.GetAchievableBlocks(), d.GetTtft(), d.GetItl())
		if !ok {
			continue
		}
		cs := d.GetCandidates()
		if len(cs) > maxSampleCandidates {
			d.Candidates = cs[:maxSampleCandidates]
		}
		d.Candidates = slices.DeleteFunc(d.Candidates, func(c *xdsv1.CandidateSample) bool {
			return c.GetWorker() == "" || len(c.GetWorker()) > maxSampleString || !finite(c.GetCachedBlocks(), c.GetTtft(), c.GetQueue(), c.GetPrefill())
		})
		out = append(out, d)
	}
	return out
}

func finite(vs ...float64) bool {
	for _, v := range vs {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return false
		}
	}
	return true
}

// maxArms bounds the arms kept of one report (a proxy routes with two at most).
const maxArms = 4

// armsOf validates a report's arms: at most maxArms, versioned, with increasing finite
// bounds and one count more than bounds (at most 64); the others are dropped.
func armsOf(r *xdsv1.LoadReport) []Arm {
	var out []Arm
	for _, a := range r.GetArms() {
		b, c := a.GetTtftBounds(), a.GetTtftCounts()
		ib, ic := a.GetItlBounds(), a.GetItlCounts()
		hb, hc := a.GetHitBounds(), a.GetHitCounts()
		ok := a.GetPolicyVersion() != 0 && len(out) < maxArms && buckets(b, c) && (len(ib)+len(ic) == 0 || buckets(ib, ic)) &&
			(len(hb)+len(hc) == 0 || buckets(hb, hc))
		if !ok {
			continue
		}
		out = append(out, Arm{Version: a.GetPolicyVersion(), Requests: a.GetRequests(), Errors: a.GetErrors(),
			TTFTBounds: slices.Clone(b), TTFTCounts: slices.Clone(c), CachedBlocks: a.GetCachedBlocks(), PromptBlocks: a.GetPromptBlocks(),
			Shadow: Shadow{a.GetShadowPicks(), a.GetShadowDisagreements(), a.GetShadowStableOverlapBlocks(),
				a.GetShadowCandidateOverlapBlocks(), a.GetShadowStableLoad(), a.GetShadowCandidateLoad()},
			Rejections: a.GetRejections(), ServerErrors: a.GetServerErrors(), ITLBounds: slices.Clone(ib), ITLCounts: slices.Clone(ic),
			Decisions: a.GetDecisions(), RegretBlocks: a.GetRegretBlocks(), HitBounds: slices.Clone(hb), HitCounts: slices.Clone(hc),
			RouterErrors: a.GetRouterErrors(), ClientErrors: a.GetClientErrors(), ClientGone: a.GetClientGone(),
			Groups: groupsOf(a, len(c), len(ic))})
	}
	return out
}

// addHistogram adds the histogram (b, c) to the sum (sb, sc): the first one with counts
// taken as it is (copied), later ones with the same bounds added, others left out.
func addHistogram(sb []float64, sc []uint64, b []float64, c []uint64) ([]float64, []uint64) {
	switch {
	case sc == nil && len(c) > 0:
		return b, slices.Clone(c)
	case sc != nil && slices.Equal(sb, b) && len(sc) == len(c):
		for i, n := range c {
			sc[i] = satAdd(sc[i], n)
		}
	}
	return sb, sc
}

// buckets reports whether bounds (at most 64, finite, increasing) and counts (one more)
// make a histogram.
func buckets(bounds []float64, counts []uint64) bool {
	ok := len(bounds) <= 64 && len(counts) == len(bounds)+1
	for i := 0; ok && i < len(bounds); i++ {
		ok = !math.IsNaN(bounds[i]) && !math.IsInf(bounds[i], 0) && (i == 0 || bounds[i] > bounds[i-1])
	}
	return ok
}

func newLoadStore(staleAfter time.Duration, now func() time.Time) *loadStore {
	return &loadStore{
		staleAfter: staleAfter,
		now:        now,
		changed:    make(chan struct{}, 1),
		nodes:      make(map[string]*nodeReport),
		// Epochs start from the clock, so that a proxy that moves to another replica does
		// not take that replica's merges for the ones it knew.
		epoch:  uint64(max(now().UnixMicro(), 0)),
		seed:   maphash.MakeSeed(),
		shares: make(map[string]workerShares),
		acks:   make(map[uint64]chan inclusion),
	}
}

// subscribe gives stream a mailbox for the merges that include its node's report.
func (l *loadStore) subscribe(stream uint64) <-chan inclusion {
	ch := make(chan inclusion, 1)
	l.mu.Lock()
	l.acks[stream] = ch
	l.mu.Unlock()
	return ch
}

func (l *loadStore) unsubscribe(stream uint64) {
	l.mu.Lock()
	delete(l.acks, stream)
	l.mu.Unlock()
}

func (l *loadStore) mergedEpochs() (map[string]WorkerLoad, map[string]uint64) {
	cutoff := l.now().Add(-l.staleAfter)
	out := make(map[string]WorkerLoad)
	hashes := make(map[string]uint64)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.epoch++
	var h maphash.Hash
	h.SetSeed(l.seed)
	var buf [20]byte
	for node, r := range l.nodes {
		if r.at.Before(cutoff) {
			continue
		}
		for id, wl := range r.loads {
			out[id] = out[id].add(wl)
			h.Reset()
			h.WriteString(node)
			binary.LittleEndian.PutUint32(buf[0:], wl.Inflight)
			binary.LittleEndian.PutUint64(buf[4:], wl.PrefillTokens)
			binary.LittleEndian.PutUint64(buf[12:], wl.DecodeBlocks)
			h.Write(buf[:])
			hashes[id] += h.Sum64() // a sum: independent of the nodes' order
		}
		if ch := l.acks[r.stream]; ch != nil {
			// Only the latest merge matters: replace one the stream has not sent yet.
			select {
			case <-ch:
			default:
			}
			ch <- inclusion{l.epoch, r.seq}
		}
	}
	epochs := make(map[string]uint64, len(hashes))
	for id, hv := range hashes {
		ws, ok := l.shares[id]
		if !ok || ws.hash != hv {
			ws = workerShares{hv, l.epoch}
			l.shares[id] = ws
		}
		epochs[id] = ws.epoch
	}
	for id := range l.shares {
		if _, ok := hashes[id]; !ok {
			delete(l.shares, id) // no shares left: nothing to take out
		}
	}
	return out, epochs
}

func (l *loadStore) signal() {
	select {
	case l.changed <- struct{}{}:
	default:
	}
}

// put records node's report from stream.
func (l *loadStore) put(node string, stream uint64, r *xdsv1.LoadReport) {
	l.putWith(node, stream, r, tenantsOf(r))
}

// putWith is put with the report's tenants already taken (tenantsOf).
func (l *loadStore) putWith(node string, stream uint64, r *xdsv1.LoadReport, tenants map[string]TenantDemand) {
	known := l.known.Load()
	loads := make(map[string]WorkerLoad, min(len(r.GetWorkers()), 1024))
	for _, w := range r.GetWorkers() {
		id := w.GetWorkerId()
		if id == "" {
			continue
		}
		if known == nil {
			l.unknown.Add(1)
			continue
		}
		if _, ok := (*known)[id]; !ok {
			l.unknown.Add(1)
			continue
		}
		wl := WorkerLoad{Inflight: w.GetInflight(), PrefillTokens: w.GetPrefillTokens(), DecodeBlocks: w.GetDecodeBlocks()}
		if wl == (WorkerLoad{}) {
			continue
		}
		loads[id] = loads[id].add(wl)
	}
	now := l.now()
	l.mu.Lock()
	prev := l.nodes[node]
	same := prev != nil && now.Sub(prev.at) < l.staleAfter && maps.Equal(prev.loads, loads)
	fits := fitsOf(r)
	if fits == nil && prev != nil && prev.stream == stream {
		fits = prev.fits
	}
	if tenants == nil && prev != nil && prev.stream == stream {
		tenants = prev.tenants
	}
	l.nodes[node] = &nodeReport{stream: stream, seq: r.GetSeq(), at: now, loads: loads, arms: armsOf(r), fits: fits, tenants: tenants}
	l.mu.Unlock()
	if !same {
		l.signal()
	}
}

// drop forgets node's report if stream sent it.
func (l *loadStore) drop(node string, stream uint64) {
	l.mu.Lock()
	r, ok := l.nodes[node]
	if ok && r.stream == stream {
		delete(l.nodes, node)
	}
	l.mu.Unlock()
	if ok && r.stream == stream {
		l.signal()
	}
}

// reap forgets reports older than staleAfter.
func (l *loadStore) reap() {
	cutoff := l.now().Add(-l.staleAfter)
	dropped := false
	l.mu.Lock()
	for node, r := range l.nodes {
		if r.at.Before(cutoff) {
			delete(l.nodes, node)
			dropped = true
		}
	}
	l.mu.Unlock()
	if dropped {
		l.signal()
	}
}

// reapLoop reaps stale reports until ctx is done; Serve runs it.
func (l *loadStore) reapLoop(ctx context.Context) {
	t := time.NewTicker(max(l.staleAfter/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			l.reap()
		}
	}
}

func (l *loadStore) merged() map[string]WorkerLoad {
	out, _ := l.mergedReports()
	return out
}

func (l *loadStore) mergedReports() (map[string]WorkerLoad, []*xdsv1.ReportSeq) {
	cutoff := l.now().Add(-l.staleAfter)
	out := make(map[string]WorkerLoad)
	l.mu.Lock()
	seqs := make([]*xdsv1.ReportSeq, 0, len(l.nodes))
	for node, r := range l.nodes {
		if r.at.Before(cutoff) {
			continue
		}
		seqs = append(seqs, &xdsv1.ReportSeq{NodeId: node, Seq: r.seq})
		for id, wl := range r.loads {
			out[id] = out[id].add(wl)
		}
	}
	l.mu.Unlock()
	slices.SortFunc(seqs, func(a, b *xdsv1.ReportSeq) int { return strings.Compare(a.GetNodeId(), b.GetNodeId()) })
	return out, seqs
}

func (l *loadStore) node(node string) map[string]WorkerLoad {
	cutoff := l.now().Add(-l.staleAfter)
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.nodes[node]
	if r == nil || r.at.Before(cutoff) {
		return nil
	}
	return maps.Clone(r.loads)
}

func (l *loadStore) reporters() int {
	cutoff := l.now().Add(-l.staleAfter)
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.nodes {
		if !r.at.Before(cutoff) {
			n++
		}
	}
	return n
}

// loadService serves LoadReporting: one stream per proxy, a report every interval, each
// answered with the interval wanted.
type loadService struct {
	xdsv1.UnimplementedLoadReportingServer
	s       *Server
	streams atomic.Uint64
}

// Report runs on gRPC's goroutine for the stream. Its node is named by the first report
// and may not change; its report is dropped when the stream ends.
func (ls *loadService) Report(st grpc.BidiStreamingServer[xdsv1.LoadReport, xdsv1.LoadReportAck]) error {
	s := ls.s
	id := ls.streams.Add(1)
	node := ""
	defer func() {
		if node != "" {
			s.load.drop(node, id)
		}
	}()

	reports := make(chan *xdsv1.LoadReport)
	recvErr := make(chan error, 1)
	go func() { // ends when Recv fails, at the latest when Report returns and gRPC cancels the stream
		for {
			r, err := st.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case reports <- r:
			case <-st.Context().Done():
				return
			}
		}
	}()

	interval := uint32(min(s.opts.ReportInterval.Milliseconds(), math.MaxUint32))
	if interval == 0 {
		interval = 1
	}
	ack := &xdsv1.LoadReportAck{IntervalMs: interval}
	included := s.load.subscribe(id)
	defer s.load.unsubscribe(id)
	for {
		select {
		case <-s.ctx.Done():
			return status.Error(codes.Unavailable, "control plane stopping")
		case in := <-included:
			if err := st.Send(&xdsv1.LoadReportAck{IntervalMs: interval, Epoch: in.epoch, IncludedSeq: in.seq}); err != nil {
				return fmt.Errorf("telling the proxy its report's merge: %w", err)
			}
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("receiving load report: %w", err)
		case r := <-reports:
			switch {
			case r.GetNodeId() == "":
				return status.Error(codes.InvalidArgument, "load report without a node id")
			case node != "" && r.GetNodeId() != node:
				return status.Errorf(codes.InvalidArgument, "load report from node %q on the stream of %q", r.GetNodeId(), node)
			case len(r.GetWorkers()) > MaxReportWorkers:
				return status.Errorf(codes.InvalidArgument, "load report names %d workers, at most %d", len(r.GetWorkers()), MaxReportWorkers)
			}
			node = r.GetNodeId()
			ts := tenantsOf(r)
			s.load.putWith(node, id, r, ts)
			if f := s.opts.OnDecisions; f != nil && len(r.GetDecisions()) > 0 {
				if ds := DecisionsOf(r); len(ds) > 0 {
					f(node, ds)
				}
			}
			a := ack
			if ts != nil {
				a = &xdsv1.LoadReportAck{IntervalMs: interval, Tenants: s.grants(node, ts)}
			}
			if err := st.Send(a); err != nil {
				return fmt.Errorf("acknowledging load report: %w", err)
			}
		}
	}
}

var _ xdsv1.LoadReportingServer = (*loadService)(nil)
