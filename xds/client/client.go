package client

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	rpcstatus "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// Defaults of Options and ReporterOptions.
const (
	DefaultBackoffBase = 100 * time.Millisecond
	DefaultBackoffMax  = 5 * time.Second
)

// Options configure a Client.
type Options struct {
	// NodeID names this proxy to the control plane (required).
	NodeID string
	// Cluster is the proxy's group, sent in the xDS node (optional).
	Cluster string
	// OnUpdate receives the full current state after each response that changed it (and,
	// with Serves, after the load shards followed changed):
	// workers sorted by id, the routing policy (nil until the control plane sets one), and
	// the loads the control plane pushed (loads.LoadOf gives a worker's). It is called from
	// Run's goroutine, one call at a time, before the response is acknowledged, so it should
	// only swap the proxy's routing snapshot. The slice and the resources are the callee's
	// to keep but must not be modified.
	OnUpdate func(workers []*xdsv1.Worker, policy *xdsv1.RoutingPolicy, loads xds.PushedLoads)
	// ValidateWorker and ValidatePolicy add this proxy's own checks to xds.ValidateWorker
	// and xds.ValidatePolicy (a model it cannot serve, a block size it cannot hash). A
	// resource either refuses is NACKed and its previous version kept. Called from Run's
	// goroutine.
	ValidateWorker func(*xdsv1.Worker) error
	ValidatePolicy func(*xdsv1.RoutingPolicy) error
	// OnKeys receives the API keys given through the control plane's operator API (as keys
	// file lines; "" when none) each time they change, and ValidateKeys checks them first (a
	// refusal NACKs them and keeps the previous ones). Both are called from Run's goroutine,
	// before the response is acknowledged. Unlike workers and the policy, keys are not
	// waited for by Synced: a control plane may serve none.
	OnKeys       func(keys string)
	ValidateKeys func(keys string) error
	// BackoffBase and BackoffMax bound the jittered exponential wait before reopening a
	// broken stream (defaults DefaultBackoffBase and DefaultBackoffMax).
	BackoffBase, BackoffMax time.Duration
	// Serves, when set, says which workers the proxy routes to: the client then subscribes
	// to the loads of their shards only (by name), instead of every shard, and follows
	// their shards as workers come, go or move. The control plane gives each model's
	// workers shards of their own (by base model: a proxy that serves an adapter takes the
	// shards of the workers that carry it, with their other workers), so that a proxy that
	// routes some models takes the loads of those models' workers.
	Serves func(*xdsv1.Worker) bool
	// Models, when set, names the models the proxy routes (node metadata
	// xds.NodeModelsKey): the control plane then sends the workers that serve one of them,
	// as their base model or an adapter, and those whose model is not known, instead of
	// every worker. A control plane that does not scope sends them all, so Serves (or the
	// proxy) still picks among what comes.
	Models []string
}

// Stats is a snapshot of a Client's counters.
type Stats struct {
	// Connected is true while a stream has delivered at least one response and not broken.
	Connected bool
	// Streams counts the streams opened; Responses, Resources and Removals what arrived.
	Streams, Responses, Resources, Removals uint64
	// ACKs and NACKs count the acknowledgements and refusals sent.
	ACKs, NACKs uint64
	// LastNACK is the detail of the latest NACK; LastError why the latest stream ended.
	LastNACK, LastError string
}

// Client is a proxy's delta ADS client: it subscribes to every kvrelay resource type,
// validates and applies what the control plane pushes, ACKs or NACKs each response, and
// reconnects with backoff, resubscribing with the versions it holds so that a restarted
// control plane resends only what changed. While disconnected it keeps its last state.
//
// Lifecycle: New (no goroutines, no I/O) → Run, once, on a goroutine the caller owns; Run
// returns when its context is done. State, Stats and Synced are safe from any goroutine.
type Client struct {
	conn grpc.ClientConnInterface
	opts Options
	node *core.Node

	running atomic.Bool
	st      *state // owned by Run's goroutine

	snap       atomic.Pointer[snapshot]
	synced     chan struct{}
	syncedOnce sync.Once
	seenTypes  map[string]bool // owned by Run's goroutine

	// loadSubs are the Loads shards subscribed to on the current stream, with Serves.
	loadSubs map[string]bool // owned by Run's goroutine

	connected                               atomic.Bool
	streams, responses, resources, removals atomic.Uint64
	acks, nacks                             atomic.Uint64
	lastMu                                  sync.Mutex
	lastNACK, lastErr                       string
}

type snapshot struct {
	workers []*xdsv1.Worker
	policy  *xdsv1.RoutingPolicy
	loads   xds.PushedLoads
}

// New builds a Client that will speak on conn (see Dial); it starts nothing.
func New(conn grpc.ClientConnInterface, opts Options) (*Client, error) {
	if conn == nil {
		return nil, errors.New("creating xds client: nil connection")
	}
	if opts.NodeID == "" {
		return nil, errors.New("creating xds client: empty node id")
	}
	if opts.BackoffBase <= 0 {
		opts.BackoffBase = DefaultBackoffBase
	}
	if opts.BackoffMax < opts.BackoffBase {
		opts.BackoffMax = max(DefaultBackoffMax, opts.BackoffBase)
	}
	c := &Client{
		conn:      conn,
		opts:      opts,
		node:      &core.Node{Id: opts.NodeID, Cluster: opts.Cluster, UserAgentName: "kvrelay"},
		st:        newState(opts.ValidateWorker, opts.ValidatePolicy),
		synced:    make(chan struct{}),
		seenTypes: make(map[string]bool),
	}
	if opts.ValidateKeys != nil {
		c.st.validateKeys = func(k *xdsv1.TenantKeys) error { return opts.ValidateKeys(k.GetKeys()) }
	}
	if err := xds.CheckNodeModels(opts.Models); err != nil {
		return nil, fmt.Errorf("creating xds client: %w", err)
	}
	xds.SetNodeModels(c.node, opts.Models)
	c.snap.Store(&snapshot{})
	return c, nil
}

// State returns the current workers (sorted by id) and routing policy (nil when none);
// they must not be modified. Safe from any goroutine; while the control plane is away it
// is the last state received.
func (c *Client) State() ([]*xdsv1.Worker, *xdsv1.RoutingPolicy) {
	s := c.snap.Load()
	return s.workers, s.policy
}

// Loads returns the loads the control plane pushed, as of State. Safe from any goroutine.
func (c *Client) Loads() xds.PushedLoads { return c.snap.Load().loads }

// Synced is closed once a first response of workers and of the policy has been applied (in
// part, when it NACKed some of it). Loads and API keys are not waited for: a control plane
// with no workers serves no loads, and one may serve no keys; a worker whose load has not
// come yet is routed on the proxy's own count of it.
func (c *Client) Synced() <-chan struct{} { return c.synced }

// Stats returns a snapshot of the client's counters.
func (c *Client) Stats() Stats {
	c.lastMu.Lock()
	nack, lastErr := c.lastNACK, c.lastErr
	c.lastMu.Unlock()
	return Stats{
		Connected: c.connected.Load(),
		Streams:   c.streams.Load(),
		Responses: c.responses.Load(),
		Resources: c.resources.Load(),
		Removals:  c.removals.Load(),
		ACKs:      c.acks.Load(),
		NACKs:     c.nacks.Load(),
		LastNACK:  nack,
		LastError: lastErr,
	}
}

// Run keeps a delta ADS stream open until ctx is done, reopening it after a jittered
// exponential backoff whenever it breaks (reset once a stream delivers a response). It
// calls OnUpdate and the validators on its own goroutine. It returns nil when ctx is done,
// and an error only if it is already running.
func (c *Client) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("running xds client: already running")
	}
	defer c.running.Store(false)
	bo := newBackoff(c.opts.BackoffBase, c.opts.BackoffMax)
	for {
		healthy, err := c.stream(ctx)
		if ctx.Err() != nil {
			return nil
		}
		c.lastMu.Lock()
		c.lastErr = err.Error()
		c.lastMu.Unlock()
		if healthy {
			bo.reset()
		}
		if !sleep(ctx, bo.next()) {
			return nil
		}
	}
}

// stream runs one ADS stream until it breaks; healthy reports whether it delivered a
// response. It never returns a nil error.
func (c *Client) stream(ctx context.Context) (healthy bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ads := discovery.NewAggregatedDiscoveryServiceClient(c.conn)
	st, err := ads.DeltaAggregatedResources(sctx, grpc.WaitForReady(true))
	if err != nil {
		return false, fmt.Errorf("opening delta ADS stream: %w", err)
	}
	c.streams.Add(1)
	defer c.connected.Store(false)
	c.loadSubs = nil
	for _, typ := range xds.TypeURLs() {
		if typ == xds.LoadsType && c.opts.Serves != nil {
			continue // by name, once the served workers' shards are known (below)
		}
		req := &discovery.DeltaDiscoveryRequest{
			Node:                    c.node,
			TypeUrl:                 typ,
			ResourceNamesSubscribe:  []string{"*"},
			InitialResourceVersions: c.st.versions(typ),
		}
		if err := st.Send(req); err != nil {
			return false, fmt.Errorf("subscribing to %s: %w", typ, err)
		}
	}
	if err := c.followLoads(st); err != nil {
		return false, err
	}
	for {
		resp, err := st.Recv()
		if err != nil {
			return healthy, fmt.Errorf("receiving delta ADS response: %w", err)
		}
		healthy = true
		c.connected.Store(true)
		if err := st.Send(c.handle(resp)); err != nil {
			return healthy, fmt.Errorf("acknowledging %s: %w", resp.GetTypeUrl(), err)
		}
		if resp.GetTypeUrl() == xds.WorkerType {
			if err := c.followLoads(st); err != nil {
				return healthy, err
			}
		}
	}
}

// followLoads, with Options.Serves, brings the stream's Loads subscription to the shards of
// the served workers: the first request names them with the versions held (never empty,
// which would subscribe to every shard), later ones add and remove names. Shards no longer
// followed leave the state, and the proxy is given the loads without them.
func (c *Client) followLoads(st discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient) error {
	if c.opts.Serves == nil {
		return nil
	}
	want := map[string]bool{}
	for _, w := range c.st.workers {
		if c.opts.Serves(w.value) {
			want[xds.LoadsName(w.value.GetLoadIndex()/xds.LoadsShard)] = true
		}
	}
	var add, drop []string
	for n := range want {
		if !c.loadSubs[n] {
			add = append(add, n)
		}
	}
	for n := range c.loadSubs {
		if !want[n] {
			drop = append(drop, n)
		}
	}
	if len(add) == 0 && len(drop) == 0 {
		return nil
	}
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: xds.LoadsType, ResourceNamesSubscribe: add, ResourceNamesUnsubscribe: drop}
	if c.loadSubs == nil {
		if len(add) == 0 {
			return nil
		}
		req.Node = c.node
		held := c.st.versions(xds.LoadsType)
		req.InitialResourceVersions = map[string]string{}
		for _, n := range add {
			if v, ok := held[n]; ok {
				req.InitialResourceVersions[n] = v
			}
		}
	}
	if err := st.Send(req); err != nil {
		return fmt.Errorf("subscribing to %d and leaving %d load shards: %w", len(add), len(drop), err)
	}
	c.loadSubs = want
	if c.st.dropLoads(want) {
		c.publish()
	}
	return nil
}

// publish gives the state's current workers, policy and loads to State, Loads and OnUpdate.
func (c *Client) publish() {
	ws, p, l := c.st.snapshot()
	c.snap.Store(&snapshot{workers: ws, policy: p, loads: l})
	if c.opts.OnUpdate != nil {
		c.opts.OnUpdate(ws, p, l)
	}
}

// handle applies one response and returns its ACK or NACK.
func (c *Client) handle(resp *discovery.DeltaDiscoveryResponse) *discovery.DeltaDiscoveryRequest {
	c.responses.Add(1)
	c.resources.Add(uint64(len(resp.GetResources())))
	c.removals.Add(uint64(len(resp.GetRemovedResources())))
	changed, err := c.st.apply(resp)
	if c.opts.Serves != nil && resp.GetTypeUrl() == xds.LoadsType && c.st.dropLoads(c.loadSubs) {
		// A shard left by the subscription, sent before the control plane heard so.
		changed = true
	}
	if changed && resp.GetTypeUrl() == xds.KeysType {
		if c.opts.OnKeys != nil {
			c.opts.OnKeys(c.st.keysText())
		}
		changed = false // workers and policy stand
	}
	if changed {
		c.publish()
	}
	if typ := resp.GetTypeUrl(); (typ == xds.WorkerType || typ == xds.PolicyType) && !c.seenTypes[typ] {
		c.seenTypes[resp.GetTypeUrl()] = true
		if len(c.seenTypes) == 2 { // workers and policy; keys are optional
			c.syncedOnce.Do(func() { close(c.synced) })
		}
	}
	ack := &discovery.DeltaDiscoveryRequest{TypeUrl: resp.GetTypeUrl(), ResponseNonce: resp.GetNonce()}
	if err != nil {
		ack.ErrorDetail = &rpcstatus.Status{Code: int32(codes.InvalidArgument), Message: err.Error()}
		c.nacks.Add(1)
		c.lastMu.Lock()
		c.lastNACK = err.Error()
		c.lastMu.Unlock()
	} else {
		c.acks.Add(1)
	}
	return ack
}

// sleep waits d or until ctx is done, and reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
