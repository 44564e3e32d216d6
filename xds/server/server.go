package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/resource/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/delta/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// Defaults of Options.
const (
	DefaultReportInterval = 100 * time.Millisecond
	DefaultShutdownGrace  = 5 * time.Second
	minReportStaleAfter   = time.Second
	staleIntervals        = 30
)

// Options configure a Server. The zero value is usable.
type Options struct {
	// ReportInterval is how often proxies are asked to send their load reports (default
	// DefaultReportInterval).
	ReportInterval time.Duration
	// ReportStaleAfter drops a node's load report when it has sent none for this long, even
	// if its stream is still open (default 30 report intervals, at least one second).
	ReportStaleAfter time.Duration
	// ShutdownGrace is how long Serve waits, once its context is done, for open RPCs to
	// end before it closes their connections (default DefaultShutdownGrace).
	ShutdownGrace time.Duration
	// Hooks observe the ADS streams; nil hooks are skipped.
	Hooks Hooks
	// GRPCOptions are appended to the gRPC server's options (after kvrelay's keepalive
	// settings, so they may override them).
	GRPCOptions []grpc.ServerOption
	// MaxStreamsPerPeer bounds the streams (ADS, load reports, index journal) one peer
	// address may hold open at once (default DefaultMaxStreamsPerPeer); more are refused
	// with RESOURCE_EXHAUSTED. One connection may carry twice as many, refused or not
	// (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); its transport refuses streams past that.
	MaxStreamsPerPeer int
	// MaxConnsPerPeer bounds the connections one peer host may hold open at once (default
	// DefaultMaxConnsPerPeer); more are closed as soon as they are accepted.
	MaxConnsPerPeer int
	// MaxConnectionAge closes a proxy's connection this long after it opened (grpc-go adds
	// ±10 % jitter), after MaxConnectionAgeGrace for its streams to end; the proxy reconnects,
	// through the Service to any replica, so that connections spread again after a scale-up
	// or a failover instead of staying where they landed (defaults
	// DefaultMaxConnectionAge, DefaultMaxConnectionAgeGrace; negative: never).
	MaxConnectionAge, MaxConnectionAgeGrace time.Duration
	// MaxConns and MaxStreams bound the connections and streams every peer together may
	// hold open (defaults DefaultMaxConns, DefaultMaxStreams): the per-peer caps alone let
	// many addresses (a host's loopback range, a NAT's ports do not count) hold the server
	// without bound. More are refused as the per-peer caps refuse.
	MaxConns, MaxStreams int
	// SendTimeout ends an ADS stream whose proxy has not taken a response for this long
	// (its flow-control window full: it does not read), instead of holding the response for
	// as long as the connection lives (default DefaultSendTimeout).
	SendTimeout time.Duration
	// OnDecisions, when set, hears the sampled routing decisions each load report carries
	// (LoadReport.decisions: at most MaxReportDecisions, each checked by DecisionsOf), from
	// the report's stream goroutine.
	OnDecisions func(node string, ds []*xdsv1.DecisionSample)
}

// keepaliveTimeout is how long a pinged peer has to answer, and the TCP user timeout of
// its connection.
const keepaliveTimeout = 10 * time.Second

// DefaultSendTimeout is Options.SendTimeout's default, the same as the index journal's.
const DefaultSendTimeout = 30 * time.Second

// Flow-control windows of the xDS port: what a client may send the server before its
// handler reads it. They are static, which turns off grpc-go's dynamic windows: those grow
// with the bandwidth-delay product up to 16 MiB a stream, and an ADS stream whose handler is
// blocked sending to a proxy that does not read stops reading its requests, so a client
// could park that much in each of its streams (5 to 8 MiB at a 2 ms round trip). Proxies
// send acks, subscriptions and load reports: a 256 KiB window passes a report on a thousand
// workers in one round trip.
const (
	streamWindow = 256 << 10
	connWindow   = 1 << 20
)

// DefaultMaxStreamsPerPeer is Options.MaxStreamsPerPeer's default: a proxy opens three
// streams, and a host may run a few proxies.
const DefaultMaxStreamsPerPeer = 64

// DefaultMaxConnsPerPeer is Options.MaxConnsPerPeer's default: a proxy holds one
// connection, a host runs a few proxies and reconnecting ones overlap their old connection.
const DefaultMaxConnsPerPeer = 32

// DefaultMaxConnectionAge and DefaultMaxConnectionAgeGrace are Options.MaxConnectionAge's
// and MaxConnectionAgeGrace's defaults: a fleet rebalances within about half an hour, and a
// proxy's streams get a minute to finish what they carry.
const (
	DefaultMaxConnectionAge      = 30 * time.Minute
	DefaultMaxConnectionAgeGrace = time.Minute
)

// DefaultMaxConns and DefaultMaxStreams are Options.MaxConns' and MaxStreams' defaults: two
// thousand proxies, each with its connection and three streams, twice over while they
// reconnect.
const (
	DefaultMaxConns   = 4096
	DefaultMaxStreams = 12288
)

func (o Options) withDefaults() Options {
	if o.ReportInterval <= 0 {
		o.ReportInterval = DefaultReportInterval
	}
	if o.ReportStaleAfter <= 0 {
		o.ReportStaleAfter = max(staleIntervals*o.ReportInterval, minReportStaleAfter)
	}
	if o.ShutdownGrace <= 0 {
		o.ShutdownGrace = DefaultShutdownGrace
	}
	if o.MaxStreamsPerPeer <= 0 {
		o.MaxStreamsPerPeer = DefaultMaxStreamsPerPeer
	}
	if o.MaxConnsPerPeer <= 0 {
		o.MaxConnsPerPeer = DefaultMaxConnsPerPeer
	}
	if o.MaxConns <= 0 {
		o.MaxConns = DefaultMaxConns
	}
	if o.MaxConnectionAge == 0 {
		o.MaxConnectionAge = DefaultMaxConnectionAge
	}
	if o.MaxConnectionAgeGrace == 0 {
		o.MaxConnectionAgeGrace = DefaultMaxConnectionAgeGrace
	}
	if o.MaxStreams <= 0 {
		o.MaxStreams = DefaultMaxStreams
	}
	if o.SendTimeout <= 0 {
		o.SendTimeout = DefaultSendTimeout
	}
	return o
}

// Hooks observe the ADS streams, for metrics and logs. Each is called synchronously from
// the goroutine of the stream concerned (so calls for different proxies are concurrent)
// and must return quickly: a slow hook delays that proxy's pushes.
type Hooks struct {
	// OnConnect is called when an ADS stream has identified its node (first request).
	OnConnect func(nodeID string)
	// OnDisconnect is called when an identified ADS stream ends.
	OnDisconnect func(nodeID string)
	// OnPush is called before a response is sent: how many resources it sets and removes.
	OnPush func(nodeID, typeURL string, resources, removed int)
	// OnACK is called when a proxy acknowledges a response.
	OnACK func(nodeID, typeURL string)
	// OnNACK is called when a proxy refuses (part of) a response, with its reason.
	OnNACK func(nodeID, typeURL, reason string)
}

// NACK is a proxy's latest refusal.
type NACK struct {
	TypeURL string
	Reason  string
	At      time.Time
}

// Stats is a snapshot of the server's counters; its maps are the caller's.
type Stats struct {
	// Proxies counts the open ADS streams of each node id.
	Proxies map[string]int
	// Pushes counts responses sent; PushedResources and PushedRemovals the resources they
	// set and removed.
	Pushes, PushedResources, PushedRemovals uint64
	// ACKs and NACKs count proxies' acknowledgements and refusals.
	ACKs, NACKs uint64
	// LastNACK holds each connected node's latest NACK.
	LastNACK map[string]NACK
	// LoadReporters is the number of nodes whose load report is live.
	LoadReporters int
	// UnknownWorkerLoads counts load report entries dropped for naming a worker that is not
	// published (a proxy cannot report load on a worker it was not given).
	UnknownWorkerLoads uint64
	// RefusedStreams counts streams refused for their peer's MaxStreamsPerPeer.
	RefusedStreams uint64
	// RefusedConns counts connections closed for their peer's MaxConnsPerPeer.
	RefusedConns uint64
	// SlowStreams counts ADS streams ended because their proxy took nothing for
	// SendTimeout.
	SlowStreams uint64
	// WorkerScopes is the number of worker caches held for proxies that name the models they
	// route (scoped.go); UnscopedWatches counts their watches sent to the full cache because
	// every scope's cache was in use.
	WorkerScopes    int
	UnscopedWatches uint64
}

// Server is the control plane's xDS server: kvrelay's resources over delta ADS (one
// go-control-plane LinearCache per type URL behind a MuxCache) and the LoadReporting
// service, on one gRPC server that other services (IndexJournal) may join through GRPC.
//
// Lifecycle: New (no goroutines, no I/O) → register other services on GRPC() → set the
// initial resources → Serve, once. SetWorkers, UpdateWorkers, SetPolicy, Merged, Stats and
// the other methods are safe from any goroutine, before, during and after Serve.
type Server struct {
	opts Options

	// ctx is done when Serve begins to stop; ADS and load streams end with it.
	ctx    context.Context
	cancel context.CancelFunc
	served atomic.Bool

	grpc    *grpc.Server
	workers *scopedWorkers // scoped.go
	loads   *cache.LinearCache
	policy  *cache.LinearCache
	keys    *cache.LinearCache
	load    *loadStore
	tenants tenantShares

	// pubMu serialises publications and guards published and publishedPolicy: the
	// resources last handed to the caches (never modified once published).
	pubMu sync.Mutex
	// loadBytes is the size of the Loads the last publication changed, framed: what it
	// sends a proxy that follows every shard.
	loadBytes atomic.Int64
	// peerStreams counts each peer host's open streams (limitStreams).
	peerMu          sync.Mutex
	peerStreams     map[string]int
	totalStreams    int // every peer's, under peerMu
	refusedStreams  atomic.Uint64
	refusedConns    atomic.Uint64
	published       map[string]*xdsv1.Worker
	publishedPolicy *xdsv1.RoutingPolicy
	publishedKeys   string
	// statics are the Worker resources as the worker cache holds them: published's, without
	// their load and with their load index; indexID is the worker at each load index (""
	// where free). The loads themselves travel in the loads cache, a Loads resource a shard
	// (xds.LoadsShard indexes). Each shard's indexes go to the workers of one model
	// (shardModel), so that a proxy that routes some models subscribes to their shards
	// only; freeByModel are the free indexes of each model's shards, shardUsed each shard's
	// indexes given, and freeShards the shards a change set emptied: a model that needs
	// one takes it before the index space grows, so models that come and go (a fine-tune
	// per rollout) do not use it up.
	statics     map[string]*xdsv1.Worker
	indexID     []string
	shardModel  []string
	shardUsed   []int
	freeShards  []uint32
	freeByModel map[string][]uint32

	// streamMu guards the ADS stream bookkeeping below.
	streamMu sync.Mutex
	nodes    map[int64]string // ADS stream id → node id, once identified
	proxies  map[string]int   // node id → open ADS streams
	lastNACK map[string]NACK

	pushes, pushedResources, pushedRemovals atomic.Uint64
	acks, nacks                             atomic.Uint64
	slowStreams                             atomic.Uint64
}

// New builds a Server; it starts nothing.
func New(opts Options) *Server {
	opts = opts.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		opts:        opts,
		ctx:         ctx,
		cancel:      cancel,
		workers:     newScopedWorkers(),
		loads:       cache.NewLinearCache(xds.LoadsType),
		policy:      cache.NewLinearCache(xds.PolicyType),
		keys:        cache.NewLinearCache(xds.KeysType),
		published:   make(map[string]*xdsv1.Worker),
		statics:     make(map[string]*xdsv1.Worker),
		freeByModel: make(map[string][]uint32),
		nodes:       make(map[int64]string),
		proxies:     make(map[string]int),
		lastNACK:    make(map[string]NACK),
		peerStreams: make(map[string]int),
	}
	s.load = newLoadStore(opts.ReportStaleAfter, time.Now)
	mux := &cache.MuxCache{
		Classify:      func(r *cache.Request) string { return r.GetTypeUrl() },
		ClassifyDelta: func(r *cache.DeltaRequest) string { return r.GetTypeUrl() },
		Caches: map[string]cache.Cache{
			xds.WorkerType: s.workers,
			xds.LoadsType:  s.loads,
			xds.PolicyType: s.policy,
			xds.KeysType:   s.keys,
		},
	}
	gopts := append([]grpc.ServerOption{
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             5 * time.Second,
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time:                  30 * time.Second,
			Timeout:               keepaliveTimeout,
			MaxConnectionAge:      ageOrInfinity(opts.MaxConnectionAge),
			MaxConnectionAgeGrace: ageOrInfinity(opts.MaxConnectionAgeGrace),
		}),
		grpc.ChainStreamInterceptor(s.limitStreams),
		// Without a limit, one connection that does not read could open streams without end,
		// each refused by limitStreams but held until its refusal is written: 300,000 of them
		// took 1 GB. With one, the transport refuses the excess, and stops reading a
		// connection whose refusals pile up. It is twice the per-peer cap, so that a client
		// opening one stream too many is told RESOURCE_EXHAUSTED by limitStreams rather than
		// left waiting by its own transport.
		grpc.MaxConcurrentStreams(uint32(2 * opts.MaxStreamsPerPeer)),
		grpc.InitialWindowSize(streamWindow),
		grpc.InitialConnWindowSize(connWindow),
		grpc.ForceServerCodecV2(newCodec()), // protobuf, Encoded messages sent as they are
	}, opts.GRPCOptions...)
	s.grpc = grpc.NewServer(gopts...)
	discovery.RegisterAggregatedDiscoveryServiceServer(s.grpc, &ads{
		delta:   delta.NewServer(ctx, mux, callbacks{s}),
		timeout: opts.SendTimeout,
		slow:    &s.slowStreams,
	})
	xdsv1.RegisterLoadReportingServer(s.grpc, &loadService{s: s})
	return s
}

// ageOrInfinity is d for grpc's keepalive, a negative d (never) as grpc's infinity.
func ageOrInfinity(d time.Duration) time.Duration {
	if d < 0 {
		return time.Duration(math.MaxInt64)
	}
	return d
}

// GRPC returns the gRPC server, for the control plane to register more services (the
// IndexJournal) before calling Serve. Streams of those services should end when Done is
// closed, or Serve waits ShutdownGrace for them.
func (s *Server) GRPC() *grpc.Server { return s.grpc }

// Done is closed when Serve begins to stop.
func (s *Server) Done() <-chan struct{} { return s.ctx.Done() }

// Serve serves on lis until ctx is done or the listener fails, then stops: it ends the ADS
// and load streams, lets other RPCs finish for up to ShutdownGrace, and closes the rest.
// It may be called once; it closes lis. It returns nil after a stop asked through ctx.
func (s *Server) Serve(ctx context.Context, lis net.Listener) error {
	if !s.served.CompareAndSwap(false, true) {
		return errors.New("serving xds: Serve called twice")
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // reaps stale load reports until the server stops
		defer wg.Done()
		s.load.reapLoop(s.ctx)
	}()
	errc := make(chan error, 1)
	lis = newPeerListener(lis, s.opts.MaxConnsPerPeer, s.opts.MaxConns, keepaliveTimeout, &s.refusedConns)
	go func() { errc <- s.grpc.Serve(lis) }() // ends with Stop or GracefulStop below

	var err error
	select {
	case err = <-errc:
		s.cancel()
		s.grpc.Stop()
	case <-ctx.Done():
		s.cancel()
		stopped := make(chan struct{})
		go func() { // ends when every RPC has, at the latest after Stop below
			s.grpc.GracefulStop()
			close(stopped)
		}()
		t := time.NewTimer(s.opts.ShutdownGrace)
		select {
		case <-stopped:
		case <-t.C:
			s.grpc.Stop()
			<-stopped
		}
		t.Stop()
		err = <-errc
	}
	wg.Wait()
	if err != nil {
		return fmt.Errorf("serving xds on %s: %w", lis.Addr(), err)
	}
	return nil
}

// SetWorkers publishes ws as the whole set of workers: workers that differ (proto.Equal)
// from what was published are pushed, workers no longer in ws are removed, and unchanged
// workers cost nothing; a worker whose load alone changed is pushed as its shard of loads
// (publishLocked), and the change set goes to each cache in one call. It refuses the whole
// set, publishing nothing, when a worker fails xds.ValidateWorker or an id repeats. ws is
// not retained: the server publishes copies.
func (s *Server) SetWorkers(ws []*xdsv1.Worker) error {
	if err := checkWorkers(ws); err != nil {
		return fmt.Errorf("setting workers: %w", err)
	}
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	keep := make(map[string]struct{}, len(ws))
	for _, w := range ws {
		keep[w.GetId()] = struct{}{}
	}
	var remove []string
	for id := range s.published {
		if _, ok := keep[id]; !ok {
			remove = append(remove, id)
		}
	}
	if err := s.publishLocked(ws, remove); err != nil {
		return fmt.Errorf("setting workers: %w", err)
	}
	return nil
}

// UpdateWorkers publishes a change set: upsert adds or replaces workers (those equal to
// what was published cost nothing), remove drops workers by id (unknown ids are ignored).
// It refuses the whole change, publishing nothing, when a worker fails xds.ValidateWorker,
// an id repeats, or an id is both upserted and removed. upsert is not retained.
func (s *Server) UpdateWorkers(upsert []*xdsv1.Worker, remove []string) error {
	if err := checkWorkers(upsert); err != nil {
		return fmt.Errorf("updating workers: %w", err)
	}
	for _, id := range remove {
		if slices.ContainsFunc(upsert, func(w *xdsv1.Worker) bool { return w.GetId() == id }) {
			return fmt.Errorf("updating workers: worker %q both upserted and removed", id)
		}
	}
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	if err := s.publishLocked(upsert, remove); err != nil {
		return fmt.Errorf("updating workers: %w", err)
	}
	return nil
}

func checkWorkers(ws []*xdsv1.Worker) error {
	var errs []error
	seen := make(map[string]struct{}, len(ws))
	for _, w := range ws {
		if err := xds.ValidateWorker(w); err != nil {
			errs = append(errs, err)
			continue
		}
		if _, dup := seen[w.GetId()]; dup {
			errs = append(errs, fmt.Errorf("worker %q given twice", w.GetId()))
		}
		seen[w.GetId()] = struct{}{}
	}
	return errors.Join(errs...)
}

// publishLocked hands the changed workers among upsert and the known ids among remove to
// the caches: each worker's resource without its load to the worker cache, when more than
// its load changed, and the loads of the shards where any changed to the loads cache, each
// cache in one call. s.pubMu is held.
func (s *Server) publishLocked(upsert []*xdsv1.Worker, remove []string) error {
	added := 0
	for _, w := range upsert {
		if _, ok := s.statics[w.GetId()]; !ok {
			added++
		}
	}
	// The shards this change set opens, checked before anything changes: each new worker,
	// or one whose model changed, takes a free index of its model's shards or opens one.
	need := map[string]int{}
	for _, w := range upsert {
		if _, ok := s.keptIndex(w.GetId(), w.GetModel()); !ok {
			need[w.GetModel()]++
		}
	}
	opened := 0
	for m, n := range need {
		if n -= len(s.freeByModel[m]); n > 0 {
			opened += (n + xds.LoadsShard - 1) / xds.LoadsShard
		}
	}
	if grown := max(opened-len(s.freeShards), 0); len(s.indexID)+grown*xds.LoadsShard > xds.MaxLoadIndex {
		return fmt.Errorf("%d workers published and %d more need a load index: the indexes would pass %d", len(s.statics), len(need), xds.MaxLoadIndex)
	}
	changed := make(map[string]types.Resource)
	var moved []string     // workers whose load changed
	var reindexed []uint32 // load indexes left by workers whose model changed
	for _, w := range upsert {
		id := w.GetId()
		old, ok := s.published[id]
		if ok && proto.Equal(old, w) {
			continue
		}
		full := proto.Clone(w).(*xdsv1.Worker)
		static := proto.Clone(w).(*xdsv1.Worker)
		static.Load = nil
		idx := s.indexFor(id, w.GetModel()) // the check above keeps it within MaxLoadIndex
		static.LoadIndex = idx
		prev, had := s.statics[id]
		if had && prev.GetLoadIndex() != idx {
			// Its model changed: it moves to a shard of its new model, its old index freed
			// with the removals below.
			reindexed = append(reindexed, prev.GetLoadIndex())
		}
		if !had || !proto.Equal(prev, static) {
			changed[id] = static
			s.statics[id] = static
		}
		if !ok || !proto.Equal(old.GetLoad(), full.GetLoad()) || had && prev.GetLoadIndex() != idx {
			moved = append(moved, id)
		}
		s.published[id] = full
	}
	var gone []string
	shards := map[uint32]bool{}
	for _, id := range moved {
		shards[s.statics[id].GetLoadIndex()/xds.LoadsShard] = true
	}
	for _, i := range reindexed {
		s.freeIndexAt(i)
		shards[i/xds.LoadsShard] = true
	}
	for _, id := range remove {
		if _, ok := s.published[id]; !ok {
			continue
		}
		gone = append(gone, id)
		// Freed only now: a worker added in this same change set does not take the index of
		// one that goes, whose loads the proxies still hold.
		i := s.statics[id].GetLoadIndex()
		delete(s.published, id)
		delete(s.statics, id)
		s.freeIndexAt(i)
		shards[i/xds.LoadsShard] = true
	}
	for shard := range shards {
		if s.shardUsed[shard] == 0 {
			s.reclaimShard(shard)
		}
	}
	if len(changed) == 0 && len(gone) == 0 && len(shards) == 0 {
		s.loadBytes.Store(0)
		return nil
	}
	if added > 0 || len(gone) > 0 { // the set of ids changed: not on loads alone
		known := make(map[string]struct{}, len(s.published))
		for id := range s.published {
			known[id] = struct{}{}
		}
		s.load.known.Store(&known)
	}
	loads := make(map[string]types.Resource, len(shards))
	var empty []string
	size := 0
	for shard := range shards {
		l, err := s.packShard(shard)
		if err != nil {
			return err
		}
		if l == nil {
			empty = append(empty, xds.LoadsName(shard))
			continue
		}
		loads[xds.LoadsName(shard)] = l
		size += proto.Size(l) + deltaFraming + len(xds.LoadsName(shard))
	}
	s.loadBytes.Store(int64(size))
	// The caches hold the new state even when notifying a watch fails, so both are given
	// theirs whatever the other's says. Workers first: a proxy told of a new worker before
	// its load routes on its own count of it meanwhile.
	var errs []error
	if len(changed) > 0 || len(gone) > 0 {
		if err := s.workers.update(changed, gone); err != nil {
			errs = append(errs, fmt.Errorf("publishing %d changed and %d removed workers: %w", len(changed), len(gone), err))
		}
	}
	if len(loads) > 0 || len(empty) > 0 {
		if err := s.loads.UpdateResources(loads, empty); err != nil {
			errs = append(errs, fmt.Errorf("publishing the loads of %d shards: %w", len(loads)+len(empty), err))
		}
	}
	return errors.Join(errs...)
}

// indexFor returns the worker's load index: its own while its model stays, else a free
// index of its model's shards (the last freed), of a shard a change set emptied, or of a
// new shard at the end. The caller has checked that a new shard stays within MaxLoadIndex.
func (s *Server) indexFor(id, model string) uint32 {
	if i, ok := s.keptIndex(id, model); ok {
		return i
	}
	free := s.freeByModel[model]
	if len(free) == 0 {
		// A shard for the model, its indexes all the model's.
		var shard uint32
		if n := len(s.freeShards); n > 0 {
			shard, s.freeShards = s.freeShards[n-1], s.freeShards[:n-1]
			s.shardModel[shard] = model
		} else {
			shard = uint32(len(s.shardModel))
			s.indexID = append(s.indexID, make([]string, xds.LoadsShard)...)
			s.shardModel = append(s.shardModel, model)
			s.shardUsed = append(s.shardUsed, 0)
		}
		base := shard * xds.LoadsShard
		for k := xds.LoadsShard - 1; k >= 0; k-- {
			free = append(free, base+uint32(k))
		}
	}
	i := free[len(free)-1]
	s.freeByModel[model] = free[:len(free)-1]
	s.indexID[i] = id
	s.shardUsed[i/xds.LoadsShard]++
	return i
}

// keptIndex returns the load index a published worker keeps: its own, while its shard is of
// model; ok is false for a new worker or one whose model changed (it needs another).
func (s *Server) keptIndex(id, model string) (uint32, bool) {
	st, ok := s.statics[id]
	if !ok || s.shardModel[st.GetLoadIndex()/xds.LoadsShard] != model {
		return 0, false
	}
	return st.GetLoadIndex(), true
}

// freeIndexAt frees load index i, for the model of its shard. Freed only once a change set
// is published: a worker added in the same set does not take the index of one that goes,
// whose loads the proxies still hold.
func (s *Server) freeIndexAt(i uint32) {
	s.indexID[i] = ""
	sh := i / xds.LoadsShard
	s.shardUsed[sh]--
	m := s.shardModel[sh]
	s.freeByModel[m] = append(s.freeByModel[m], i)
}

// reclaimShard takes an emptied shard from its model into freeShards, once its change set
// has freed its last index (its Loads resource goes with that change set): the next model
// that needs a shard takes it. A proxy that still holds the shard's old loads reads none of
// them for the new model's workers (each entry carries its worker's id check).
func (s *Server) reclaimShard(shard uint32) {
	m := s.shardModel[shard]
	lo, hi := shard*xds.LoadsShard, (shard+1)*xds.LoadsShard
	free := s.freeByModel[m][:0]
	for _, i := range s.freeByModel[m] {
		if i < lo || i >= hi {
			free = append(free, i)
		}
	}
	if len(free) == 0 {
		delete(s.freeByModel, m)
	} else {
		s.freeByModel[m] = free
	}
	s.shardModel[shard] = ""
	s.freeShards = append(s.freeShards, shard)
}

// packShard encodes the published loads of a shard's workers; nil when none is left in it.
// s.pubMu is held.
func (s *Server) packShard(shard uint32) (*xdsv1.Loads, error) {
	var ls []xds.IndexedLoad
	lo := int(shard) * xds.LoadsShard
	for i := lo; i < min(lo+xds.LoadsShard, len(s.indexID)); i++ {
		if id := s.indexID[i]; id != "" {
			if l := s.published[id].GetLoad(); l != nil { // none: none pushed, as a Worker without one
				ls = append(ls, xds.IndexedLoad{Index: uint32(i), ID: id, Load: l})
			}
		}
	}
	if len(ls) == 0 {
		return nil, nil
	}
	return xds.PackLoads(shard, ls)
}

// SetPolicy publishes the routing policy (pushed only if it differs from the current one);
// nil removes it, and proxies fall back to their own configuration. It refuses a policy
// that fails xds.ValidatePolicy. p is not retained.
func (s *Server) SetPolicy(p *xdsv1.RoutingPolicy) error {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	if p == nil {
		if s.publishedPolicy == nil {
			return nil
		}
		s.publishedPolicy = nil
		if err := s.policy.DeleteResource(xds.PolicyName); err != nil {
			return fmt.Errorf("removing routing policy: %w", err)
		}
		return nil
	}
	if err := xds.ValidatePolicy(p); err != nil {
		return fmt.Errorf("setting routing policy: %w", err)
	}
	if s.publishedPolicy != nil && proto.Equal(s.publishedPolicy, p) {
		return nil
	}
	s.publishedPolicy = proto.Clone(p).(*xdsv1.RoutingPolicy)
	if err := s.policy.UpdateResource(xds.PolicyName, s.publishedPolicy); err != nil {
		return fmt.Errorf("setting routing policy: %w", err)
	}
	return nil
}

// SetKeys publishes the API keys given through the operator API, as keys file lines (pushed
// only if they differ from the current ones); "" removes them.
func (s *Server) SetKeys(keys string) error {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	if keys == s.publishedKeys {
		return nil
	}
	if len(keys) > xds.MaxKeysLen {
		return fmt.Errorf("publishing API keys: %d bytes, at most %d", len(keys), xds.MaxKeysLen)
	}
	s.publishedKeys = keys
	if keys == "" {
		if err := s.keys.DeleteResource(xds.KeysName); err != nil {
			return fmt.Errorf("removing API keys: %w", err)
		}
		return nil
	}
	if err := s.keys.UpdateResource(xds.KeysName, &xdsv1.TenantKeys{Keys: keys}); err != nil {
		return fmt.Errorf("publishing API keys: %w", err)
	}
	return nil
}

// deltaFraming is what a resource costs in a delta ADS response beside its value and name:
// its version (the LinearCache's, 64 hex digits), the Any's type URL and the fields' tags
// and lengths.
const deltaFraming = 64 + len(xds.LoadsType) + 8

// LoadBytes is the size of the Loads resources the last publication changed, with their
// delta framing (0 when it changed none): what it sent a proxy that follows every shard.
func (s *Server) LoadBytes() int { return int(s.loadBytes.Load()) }

// Workers returns the published workers sorted by id, each with its load as given (the
// cache holds them without it, their loads in the Loads shards). They must not be modified.
func (s *Server) Workers() []*xdsv1.Worker {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	ws := slices.Collect(maps.Values(s.published))
	slices.SortFunc(ws, func(a, b *xdsv1.Worker) int { return cmp.Compare(a.GetId(), b.GetId()) })
	return ws
}

// Policy returns the published routing policy, or nil. It must not be modified.
func (s *Server) Policy() *xdsv1.RoutingPolicy {
	s.pubMu.Lock()
	defer s.pubMu.Unlock()
	return s.publishedPolicy
}

// Stats returns a snapshot of the server's counters.
func (s *Server) Stats() Stats {
	s.streamMu.Lock()
	st := Stats{
		Proxies:  maps.Clone(s.proxies),
		LastNACK: maps.Clone(s.lastNACK),
	}
	s.streamMu.Unlock()
	st.Pushes = s.pushes.Load()
	st.PushedResources = s.pushedResources.Load()
	st.PushedRemovals = s.pushedRemovals.Load()
	st.ACKs = s.acks.Load()
	st.NACKs = s.nacks.Load()
	st.LoadReporters = s.load.reporters()
	st.UnknownWorkerLoads = s.load.unknown.Load()
	st.RefusedStreams = s.refusedStreams.Load()
	st.RefusedConns = s.refusedConns.Load()
	st.SlowStreams = s.slowStreams.Load()
	st.WorkerScopes, st.UnscopedWatches = s.workers.stats()
	return st
}

// ads serves the delta ADS stream through go-control-plane's delta server. State of the
// world is refused: it cannot tell a proxy that a worker was removed.
type ads struct {
	discovery.UnimplementedAggregatedDiscoveryServiceServer
	delta   delta.Server
	timeout time.Duration
	slow    *atomic.Uint64
}

type deltaStream = grpc.BidiStreamingServer[discovery.DeltaDiscoveryRequest, discovery.DeltaDiscoveryResponse]

func (a *ads) DeltaAggregatedResources(st deltaStream) error {
	return a.delta.DeltaStreamHandler(timedStream{st, a}, resource.AnyType)
}

// timedStream gives up a Send that waits SendTimeout: the delta server then returns, which
// ends the stream and releases the Send. go-control-plane sends a proxy one response per
// type and the next only after its ACK, so a stream that does not read holds no more than
// that; this bounds for how long.
type timedStream struct {
	deltaStream
	a *ads
}

func (t timedStream) Send(resp *discovery.DeltaDiscoveryResponse) error {
	done := make(chan error, 1)
	go func() { done <- t.deltaStream.Send(resp) }()
	timer := time.NewTimer(t.a.timeout)
	defer timer.Stop()
	select {
	case err := <-done:
		return err
	case <-timer.C:
		t.a.slow.Add(1)
		return status.Errorf(codes.ResourceExhausted, "delta ADS: the proxy took nothing for %v", t.a.timeout)
	}
}

func (a *ads) StreamAggregatedResources(grpc.BidiStreamingServer[discovery.DiscoveryRequest, discovery.DiscoveryResponse]) error {
	return status.Error(codes.Unimplemented, "kvrelay serves delta ADS only: state of the world cannot signal removed resources")
}

// callbacks turns go-control-plane's delta callbacks (called on each stream's goroutine)
// into the server's bookkeeping and Hooks.
type callbacks struct{ s *Server }

func (c callbacks) OnDeltaStreamOpen(context.Context, int64, string) error { return nil }

func (c callbacks) OnDeltaStreamClosed(id int64, _ *core.Node) {
	s := c.s
	s.streamMu.Lock()
	node, ok := s.nodes[id]
	if ok {
		delete(s.nodes, id)
		if s.proxies[node]--; s.proxies[node] <= 0 {
			delete(s.proxies, node)
			delete(s.lastNACK, node)
		}
	}
	s.streamMu.Unlock()
	if ok && s.opts.Hooks.OnDisconnect != nil {
		s.opts.Hooks.OnDisconnect(node)
	}
}

// OnStreamDeltaRequest identifies the stream's node from its first request (which must
// name one) and counts ACKs and NACKs: a request answering a nonce is an ACK, or a NACK
// when it carries an error detail.
func (c callbacks) OnStreamDeltaRequest(id int64, req *discovery.DeltaDiscoveryRequest) error {
	s := c.s
	s.streamMu.Lock()
	node, known := s.nodes[id]
	if !known {
		node = req.GetNode().GetId()
		if node == "" {
			s.streamMu.Unlock()
			return status.Error(codes.InvalidArgument, "first delta ADS request without a node id")
		}
		s.nodes[id] = node
		s.proxies[node]++
	}
	var nack *NACK
	if req.GetResponseNonce() != "" && req.GetErrorDetail() != nil {
		nack = &NACK{TypeURL: req.GetTypeUrl(), Reason: req.GetErrorDetail().GetMessage(), At: time.Now()}
		s.lastNACK[node] = *nack
	}
	s.streamMu.Unlock()

	h := s.opts.Hooks
	if !known && h.OnConnect != nil {
		h.OnConnect(node)
	}
	switch {
	case req.GetResponseNonce() == "":
	case nack != nil:
		s.nacks.Add(1)
		if h.OnNACK != nil {
			h.OnNACK(node, nack.TypeURL, nack.Reason)
		}
	default:
		s.acks.Add(1)
		if h.OnACK != nil {
			h.OnACK(node, req.GetTypeUrl())
		}
	}
	return nil
}

func (c callbacks) OnStreamDeltaResponse(id int64, _ *discovery.DeltaDiscoveryRequest, resp *discovery.DeltaDiscoveryResponse) {
	s := c.s
	n, r := len(resp.GetResources()), len(resp.GetRemovedResources())
	s.pushes.Add(1)
	s.pushedResources.Add(uint64(n))
	s.pushedRemovals.Add(uint64(r))
	if s.opts.Hooks.OnPush == nil {
		return
	}
	s.streamMu.Lock()
	node := s.nodes[id]
	s.streamMu.Unlock()
	s.opts.Hooks.OnPush(node, resp.GetTypeUrl(), n, r)
}

var (
	_ delta.Callbacks                            = callbacks{}
	_ discovery.AggregatedDiscoveryServiceServer = (*ads)(nil)
)

// limitStreams refuses a stream past its peer's MaxStreamsPerPeer: clients that open streams
// and never read them cannot hold the server's memory without bound.
func (s *Server) limitStreams(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	host := "unknown"
	if p, ok := peer.FromContext(ss.Context()); ok && p.Addr != nil {
		host = p.Addr.String()
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
	}
	s.peerMu.Lock()
	if s.peerStreams[host] >= s.opts.MaxStreamsPerPeer {
		s.peerMu.Unlock()
		s.refusedStreams.Add(1)
		return status.Errorf(codes.ResourceExhausted, "%s holds %d streams open, the most this control plane allows one peer", host, s.opts.MaxStreamsPerPeer)
	}
	if s.totalStreams >= s.opts.MaxStreams {
		s.peerMu.Unlock()
		s.refusedStreams.Add(1)
		return status.Errorf(codes.ResourceExhausted, "%d streams are open, the most this control plane allows", s.opts.MaxStreams)
	}
	s.peerStreams[host]++
	s.totalStreams++
	s.peerMu.Unlock()
	defer func() {
		s.peerMu.Lock()
		if s.peerStreams[host]--; s.peerStreams[host] <= 0 {
			delete(s.peerStreams, host)
		}
		s.totalStreams--
		s.peerMu.Unlock()
	}()
	return handler(srv, ss)
}
