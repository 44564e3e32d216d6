package client_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/client"
	"github.com/kvrelay/kvrelay/xds/server"
)

const waitTimeout = 10 * time.Second

// controlPlane is a Server serving on a loopback listener until stopped.
type controlPlane struct {
	srv    *server.Server
	addr   string
	cancel context.CancelFunc
	done   chan error
}

// startControlPlane serves srv on addr ("127.0.0.1:0" for any port); Cleanup stops it.
func startControlPlane(t testing.TB, addr string, srv *server.Server) *controlPlane {
	t.Helper()
	var lis net.Listener
	var err error
	for range 50 { // a restarted control plane may find its port still held for a moment
		if lis, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("listening on %s: %v", addr, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cp := &controlPlane{srv: srv, addr: lis.Addr().String(), cancel: cancel, done: make(chan error, 1)}
	go func() { cp.done <- srv.Serve(ctx, lis) }()
	t.Cleanup(func() { cp.stop(t) })
	return cp
}

func (cp *controlPlane) stop(t testing.TB) {
	t.Helper()
	if cp.cancel == nil {
		return
	}
	cp.cancel()
	cp.cancel = nil
	if err := <-cp.done; err != nil {
		t.Errorf("Serve: %v", err)
	}
}

// recorder collects a Client's OnUpdate calls.
type recorder struct {
	mu      sync.Mutex
	calls   int
	workers []*xdsv1.Worker
	policy  *xdsv1.RoutingPolicy
	loads   xds.PushedLoads
}

func (r *recorder) onUpdate(ws []*xdsv1.Worker, p *xdsv1.RoutingPolicy, l xds.PushedLoads) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	r.workers, r.policy, r.loads = ws, p, l
}

func (r *recorder) state() ([]*xdsv1.Worker, *xdsv1.RoutingPolicy, xds.PushedLoads) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.workers, r.policy, r.loads
}

type proxy struct {
	c      *client.Client
	rec    *recorder
	conn   *grpc.ClientConn
	cancel context.CancelFunc
	done   chan error
}

// startProxy runs a Client for nodeID against addr; Cleanup stops it.
func startProxy(t testing.TB, addr, nodeID string, opts client.Options, dial ...grpc.DialOption) *proxy {
	t.Helper()
	conn, err := client.Dial(addr, dial...)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	opts.NodeID = nodeID
	opts.OnUpdate = rec.onUpdate
	if opts.BackoffBase == 0 {
		opts.BackoffBase, opts.BackoffMax = 20*time.Millisecond, 200*time.Millisecond
	}
	c, err := client.New(conn, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &proxy{c: c, rec: rec, conn: conn, cancel: cancel, done: make(chan error, 1)}
	go func() { p.done <- c.Run(ctx) }()
	t.Cleanup(func() {
		p.cancel()
		if err := <-p.done; err != nil {
			t.Errorf("Run: %v", err)
		}
		conn.Close()
	})
	return p
}

// dialServing starts a control plane serving ws and dials it; Cleanup closes both.
func dialServing(t testing.TB, opts server.Options, ws []*xdsv1.Worker) (*controlPlane, *grpc.ClientConn) {
	t.Helper()
	srv := server.New(opts)
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	conn, err := client.Dial(cp.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return cp, conn
}

func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func worker(id string, port int) *xdsv1.Worker {
	w := xds.NewWorker(id, fmt.Sprintf("http://127.0.0.1:%d", port), "Qwen/Qwen3-0.6B")
	w.BlockSize = 16
	w.Engine = "sim"
	w.Load = &xdsv1.Load{}
	return w
}

func workers(n int) []*xdsv1.Worker {
	ws := make([]*xdsv1.Worker, n)
	for i := range ws {
		ws[i] = worker(fmt.Sprintf("w%04d", i), 8000+i)
		ws[i].Slot = uint32(i)
	}
	return ws
}

// sameWorkers reports whether got, with each worker's load from loads, is want, in order:
// the workers come without their loads (those travel as Loads) and with load indexes,
// distinct, that want does not name.
func sameWorkers(got []*xdsv1.Worker, loads xds.PushedLoads, want []*xdsv1.Worker) bool {
	if len(got) != len(want) {
		return false
	}
	indexes := map[uint32]bool{}
	for i := range got {
		if got[i].GetLoad() != nil || indexes[got[i].GetLoadIndex()] {
			return false
		}
		indexes[got[i].GetLoadIndex()] = true
		g := proto.Clone(got[i]).(*xdsv1.Worker)
		g.Load, g.LoadIndex = loads.LoadOf(got[i]), 0
		if !proto.Equal(g, want[i]) {
			return false
		}
	}
	return true
}

func hasState(p *proxy, want []*xdsv1.Worker, policy *xdsv1.RoutingPolicy) func() bool {
	return func() bool {
		ws, pol := p.c.State()
		rws, rpol, rl := p.rec.state()
		return sameWorkers(ws, p.c.Loads(), want) && proto.Equal(pol, policy) && sameWorkers(rws, rl, want) && proto.Equal(rpol, policy)
	}
}

func clone(ws []*xdsv1.Worker) []*xdsv1.Worker {
	out := make([]*xdsv1.Worker, len(ws))
	for i, w := range ws {
		out[i] = proto.Clone(w).(*xdsv1.Worker)
	}
	return out
}

func TestWorkersReachClientExactly(t *testing.T) {
	srv := server.New(server.Options{})
	ws := workers(3)
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	policy := xds.DefaultPolicy()
	if err := srv.SetPolicy(policy); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	p := startProxy(t, cp.addr, "proxy-a", client.Options{})

	select {
	case <-p.c.Synced():
	case <-time.After(waitTimeout):
		t.Fatal("client never synced")
	}
	waitUntil(t, "initial state", hasState(p, ws, policy))
	// The client applies a response (the state above) before it counts the ACK it sends.
	waitUntil(t, "client to count its ACKs", func() bool { return p.c.Stats().ACKs+p.c.Stats().NACKs >= 4 })
	st := p.c.Stats()
	if st.Responses != 4 || st.Resources != 5 || st.ACKs != 4 || st.NACKs != 0 || !st.Connected {
		t.Fatalf("after sync: %+v, want 4 responses (3 workers, their loads' shard, 1 policy, no API keys), 4 ACKs", st)
	}
	waitUntil(t, "server to count the ACKs", func() bool { return srv.Stats().ACKs == 4 })
	if got := srv.Stats().Proxies; got["proxy-a"] != 1 || len(got) != 1 {
		t.Fatalf("server sees proxies %v", got)
	}

	// One worker's load changes: one response carrying one resource, the shard of loads.
	ws = clone(ws)
	ws[1].Load = &xdsv1.Load{Running: 4, Inflight: 2, KvUsage: 0.25}
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "changed worker", hasState(p, ws, policy))
	if d := p.c.Stats(); d.Responses != st.Responses+1 || d.Resources != st.Resources+1 || d.Removals != 0 {
		t.Fatalf("after one change: %+v, was %+v: want one more response with one resource", d, st)
	}

	// One added and one removed in one call: one response of workers, one of loads.
	st = p.c.Stats()
	ws = append(clone(ws[:2]), worker("w0009", 9009))
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "added and removed worker", hasState(p, ws, policy))
	waitUntil(t, "the loads' response", func() bool { return p.c.Stats().Responses >= st.Responses+2 })
	if d := p.c.Stats(); d.Responses != st.Responses+2 || d.Resources != st.Resources+2 || d.Removals != 1 {
		t.Fatalf("after add+remove: %+v, was %+v: want two responses, two resources (the worker, the shard), one removal", d, st)
	}

	// The same set again sends nothing: the policy change behind it is the only response.
	st = p.c.Stats()
	if err := srv.SetWorkers(clone(ws)); err != nil {
		t.Fatal(err)
	}
	policy = proto.Clone(policy).(*xdsv1.RoutingPolicy)
	policy.Version++
	policy.Temperature = 0.5
	if err := srv.SetPolicy(policy); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "new policy", hasState(p, ws, policy))
	if d := p.c.Stats(); d.Responses != st.Responses+1 || d.Resources != st.Resources+1 {
		t.Fatalf("after unchanged workers and a policy change: %+v, was %+v", d, st)
	}

	// Removing the policy reaches the client as a removal.
	if err := srv.SetPolicy(nil); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "policy removed", hasState(p, ws, nil))
	if got := srv.Stats(); got.NACKs != 0 || got.Pushes < 6 {
		t.Fatalf("server stats %+v", got)
	}
}

func TestNACKKeepsPreviousVersion(t *testing.T) {
	srv := server.New(server.Options{})
	good := worker("w1", 8001)
	if err := srv.SetWorkers([]*xdsv1.Worker{good}); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	// This proxy cannot talk to engine "exotic": the control plane's validation lets it
	// through, the proxy's refuses it. (A worker whose model changes moves to a load shard
	// of its new model: the engine keeps its load index.)
	p := startProxy(t, cp.addr, "proxy-a", client.Options{
		ValidateWorker: func(w *xdsv1.Worker) error {
			if w.GetEngine() == "exotic" {
				return errors.New("engine exotic not served here")
			}
			return nil
		},
	})
	waitUntil(t, "initial state", hasState(p, []*xdsv1.Worker{good}, nil))

	bad := proto.Clone(good).(*xdsv1.Worker)
	bad.Engine = "exotic"
	fresh := worker("w2", 8002)
	if err := srv.SetWorkers([]*xdsv1.Worker{bad, fresh}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "server to see the NACK", func() bool { return srv.Stats().NACKs == 1 })
	nack := srv.Stats().LastNACK["proxy-a"]
	if nack.TypeURL != xds.WorkerType || !strings.Contains(nack.Reason, `"w1"`) || !strings.Contains(nack.Reason, "not served here") {
		t.Fatalf("server's NACK record %+v", nack)
	}
	// The refused worker keeps its previous version; the valid one in the same response applies.
	waitUntil(t, "partial apply", hasState(p, []*xdsv1.Worker{good, fresh}, nil))
	if st := p.c.Stats(); st.NACKs != 1 || !strings.Contains(st.LastNACK, "exotic") {
		t.Fatalf("client stats %+v", st)
	}

	// A fixed version is applied and ACKed.
	fixed := proto.Clone(good).(*xdsv1.Worker)
	fixed.Model = "Qwen/Qwen3-8B"
	acks := srv.Stats().ACKs
	if err := srv.SetWorkers([]*xdsv1.Worker{fixed, fresh}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "fixed worker", hasState(p, []*xdsv1.Worker{fixed, fresh}, nil))
	waitUntil(t, "ACK of the fix", func() bool { return srv.Stats().ACKs > acks })
	if st := srv.Stats(); st.NACKs != 1 {
		t.Fatalf("server stats %+v", st)
	}
}

func TestHooksSeeNACK(t *testing.T) {
	type event struct{ kind, node, typ, reason string }
	events := make(chan event, 64)
	srv := server.New(server.Options{Hooks: server.Hooks{
		OnConnect:    func(node string) { events <- event{kind: "connect", node: node} },
		OnDisconnect: func(node string) { events <- event{kind: "disconnect", node: node} },
		OnNACK:       func(node, typ, reason string) { events <- event{"nack", node, typ, reason} },
	}})
	policy := xds.DefaultPolicy()
	if err := srv.SetPolicy(policy); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	p := startProxy(t, cp.addr, "proxy-h", client.Options{
		ValidatePolicy: func(p *xdsv1.RoutingPolicy) error {
			if p.GetPolicy() != xds.DefaultPolicy().GetPolicy() {
				return fmt.Errorf("policy %q unknown to this proxy", p.GetPolicy())
			}
			return nil
		},
	})
	next := func() event {
		select {
		case e := <-events:
			return e
		case <-time.After(waitTimeout):
			t.Fatal("no hook event")
			return event{}
		}
	}
	if e := next(); e.kind != "connect" || e.node != "proxy-h" {
		t.Fatalf("first event %+v", e)
	}
	waitUntil(t, "policy", hasState(p, nil, policy))
	other := proto.Clone(policy).(*xdsv1.RoutingPolicy)
	other.Policy = "shiny"
	if err := srv.SetPolicy(other); err != nil {
		t.Fatal(err)
	}
	if e := next(); e.kind != "nack" || e.node != "proxy-h" || e.typ != xds.PolicyType || !strings.Contains(e.reason, "shiny") {
		t.Fatalf("event %+v, want the NACK", e)
	}
	if _, pol := p.c.State(); !proto.Equal(pol, policy) {
		t.Fatalf("policy %v, want the previous one kept", pol)
	}
	p.cancel()
	if e := next(); e.kind != "disconnect" || e.node != "proxy-h" {
		t.Fatalf("event %+v, want the disconnect", e)
	}
}

func TestRestartResync(t *testing.T) {
	ws := workers(3)
	for i, w := range ws {
		w.Load = &xdsv1.Load{Running: uint32(10 + i)}
	}
	policy := xds.DefaultPolicy()
	srvA := server.New(server.Options{})
	if err := srvA.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	if err := srvA.SetPolicy(policy); err != nil {
		t.Fatal(err)
	}
	a := startControlPlane(t, "127.0.0.1:0", srvA)
	p := startProxy(t, a.addr, "proxy-a", client.Options{})
	waitUntil(t, "initial state", hasState(p, ws, policy))

	a.stop(t)
	waitUntil(t, "client to notice", func() bool { return !p.c.Stats().Connected })
	// Static stability: the last state stays while the control plane is away.
	time.Sleep(100 * time.Millisecond)
	if got, pol := p.c.State(); !sameWorkers(got, p.c.Loads(), ws) || !proto.Equal(pol, policy) {
		t.Fatalf("state while the control plane is down: %v %v", got, pol)
	}
	before := p.c.Stats()

	// The new control plane knows w0000 unchanged, w0001 changed, w0002 gone and w0003 new.
	ws2 := clone(ws[:2])
	ws2[1].Healthy = false
	ws2 = append(ws2, worker("w0003", 9003))
	srvB := server.New(server.Options{})
	if err := srvB.SetWorkers(ws2); err != nil {
		t.Fatal(err)
	}
	if err := srvB.SetPolicy(policy); err != nil {
		t.Fatal(err)
	}
	startControlPlane(t, a.addr, srvB)
	waitUntil(t, "resync", hasState(p, ws2, policy))
	waitUntil(t, "reconnected", func() bool { return p.c.Stats().Connected })
	after := p.c.Stats()
	// initial_resource_versions spare what the proxy already holds: only the changed and
	// the new worker travel, with their shard of loads (w0003 took w0002's index, which the
	// proxy read as no load of w0003's until the shard came), and the removed one is named.
	if got := after.Resources - before.Resources; got != 3 {
		t.Errorf("resync sent %d resources, want 3 (w0001 changed, w0003 new, their loads' shard)", got)
	}
	if got := after.Removals - before.Removals; got != 1 {
		t.Errorf("resync sent %d removals, want 1 (w0002)", got)
	}
	if after.Streams < 2 {
		t.Errorf("streams %d, want a reconnect", after.Streams)
	}
}

func TestTwoClientsSameState(t *testing.T) {
	srv := server.New(server.Options{})
	ws := workers(20)
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	p1 := startProxy(t, cp.addr, "proxy-1", client.Options{})
	p2 := startProxy(t, cp.addr, "proxy-2", client.Options{})
	for round := range 5 {
		ws = clone(ws)
		ws[round].Draining = true
		ws = append(ws[:len(ws)-1], worker(fmt.Sprintf("x%d", round), 9100+round))
		if err := srv.SetWorkers(ws); err != nil {
			t.Fatal(err)
		}
		want := srv.Workers()
		waitUntil(t, "proxy-1", hasState(p1, want, nil))
		waitUntil(t, "proxy-2", hasState(p2, want, nil))
	}
	waitUntil(t, "both counted", func() bool {
		px := srv.Stats().Proxies
		return px["proxy-1"] == 1 && px["proxy-2"] == 1
	})
}

// reporter runs a Reporter whose snapshot returns *loads.
type reporter struct {
	mu     sync.Mutex
	loads  []*xdsv1.WorkerLoad
	seq    uint64 // of the last snapshot
	cancel context.CancelFunc
	done   chan error
	r      *client.Reporter

	stopOnce sync.Once
	stopErr  error
}

func (r *reporter) set(l ...*xdsv1.WorkerLoad) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.loads = l
}

func (r *reporter) snapshot(seq uint64) []*xdsv1.WorkerLoad {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq = seq
	return r.loads
}

func (r *reporter) lastSeq() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.seq
}

// stop ends the reporter's Run and returns its result; safe to call again (the cleanup does).
func (r *reporter) stop() error {
	r.stopOnce.Do(func() {
		r.cancel()
		r.stopErr = <-r.done
	})
	return r.stopErr
}

func startReporter(t *testing.T, addr, node string) *reporter {
	t.Helper()
	conn, err := client.Dial(addr)
	if err != nil {
		t.Fatal(err)
	}
	rep := &reporter{done: make(chan error, 1)}
	r, err := client.NewReporter(conn, client.ReporterOptions{NodeID: node, Snapshot: rep.snapshot})
	if err != nil {
		t.Fatal(err)
	}
	rep.r = r
	ctx, cancel := context.WithCancel(context.Background())
	rep.cancel = cancel
	go func() { rep.done <- r.Run(ctx) }()
	t.Cleanup(func() {
		_ = rep.stop()
		conn.Close()
	})
	return rep
}

func TestLoadReportsMerge(t *testing.T) {
	srv := server.New(server.Options{ReportInterval: 10 * time.Millisecond})
	if err := srv.SetWorkers([]*xdsv1.Worker{worker("w1", 8001), worker("w2", 8002)}); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	r1 := startReporter(t, cp.addr, "proxy-1")
	r2 := startReporter(t, cp.addr, "proxy-2")
	r1.set(&xdsv1.WorkerLoad{WorkerId: "w1", Inflight: 2, PrefillTokens: 1000, DecodeBlocks: 10},
		&xdsv1.WorkerLoad{WorkerId: "w2", Inflight: 1, PrefillTokens: 10, DecodeBlocks: 1})
	r2.set(&xdsv1.WorkerLoad{WorkerId: "w1", Inflight: 3, PrefillTokens: 500, DecodeBlocks: 5})

	want := map[string]server.WorkerLoad{
		"w1": {Inflight: 5, PrefillTokens: 1500, DecodeBlocks: 15},
		"w2": {Inflight: 1, PrefillTokens: 10, DecodeBlocks: 1},
	}
	waitUntil(t, "merged load", func() bool { return equalLoads(srv.Merged(), want) })
	waitUntil(t, "the server's interval", func() bool { return r1.r.Interval() == 10*time.Millisecond })
	// The merge names the report of each node it includes: node ids sorted, seqs the
	// reporters numbered (from 1, increasing).
	_, seqs := srv.MergedReports()
	if len(seqs) != 2 || seqs[0].GetNodeId() != "proxy-1" || seqs[1].GetNodeId() != "proxy-2" ||
		seqs[0].GetSeq() == 0 || seqs[0].GetSeq() > r1.lastSeq() || seqs[1].GetSeq() > r2.lastSeq() {
		t.Fatalf("merged reports %v (reporters at %d, %d)", seqs, r1.lastSeq(), r2.lastSeq())
	}
	if n := srv.Stats().LoadReporters; n != 2 {
		t.Fatalf("%d reporters, want 2", n)
	}
	// Drain the change signal, then a disconnect must raise it and drop proxy-2's load.
	select {
	case <-srv.LoadChanged():
	default:
	}
	if err := r2.stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-srv.LoadChanged():
	case <-time.After(waitTimeout):
		t.Fatal("no load change signal after a reporter left")
	}
	want = map[string]server.WorkerLoad{
		"w1": {Inflight: 2, PrefillTokens: 1000, DecodeBlocks: 10},
		"w2": {Inflight: 1, PrefillTokens: 10, DecodeBlocks: 1},
	}
	waitUntil(t, "proxy-2's load dropped", func() bool { return equalLoads(srv.Merged(), want) })
	if got := srv.NodeLoad("proxy-2"); got != nil {
		t.Fatalf("proxy-2 still has load %v", got)
	}
	// Load going back to zero reaches the merge too.
	r1.set()
	waitUntil(t, "no load", func() bool { return len(srv.Merged()) == 0 })
}

func equalLoads(a, b map[string]server.WorkerLoad) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestClientNeedsNodeID(t *testing.T) {
	conn, err := client.Dial("127.0.0.1:1")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := client.New(conn, client.Options{}); err == nil {
		t.Error("New accepted an empty node id")
	}
	if _, err := client.NewReporter(conn, client.ReporterOptions{NodeID: "n"}); err == nil {
		t.Error("NewReporter accepted no snapshot function")
	}
}

// TestRunEndsWithContext checks a client that never reaches a control plane still stops.
func TestRunEndsWithContext(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close() // nothing listens there
	conn, err := client.Dial(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c, err := client.New(conn, client.Options{NodeID: "n"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := c.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Run took %v to stop", d)
	}
}

// A load report naming workers the control plane never published adds nothing to the
// store (65,536 of them added 94 MB); entries for published workers still merge.
func TestLoadReportsIgnoreUnknownWorkers(t *testing.T) {
	srv := server.New(server.Options{ReportInterval: 10 * time.Millisecond})
	if err := srv.SetWorkers([]*xdsv1.Worker{worker("w1", 8001)}); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	r := startReporter(t, cp.addr, "proxy-x")
	loads := []*xdsv1.WorkerLoad{{WorkerId: "w1", Inflight: 1, PrefillTokens: 5, DecodeBlocks: 1}}
	for i := range 20000 {
		loads = append(loads, &xdsv1.WorkerLoad{WorkerId: fmt.Sprintf("ghost-%d", i), Inflight: 1})
	}
	r.set(loads...)
	want := map[string]server.WorkerLoad{"w1": {Inflight: 1, PrefillTokens: 5, DecodeBlocks: 1}}
	waitUntil(t, "merged load", func() bool { return equalLoads(srv.Merged(), want) })
	if n := srv.Stats().UnknownWorkerLoads; n < 20000 {
		t.Fatalf("%d unknown worker entries counted, want at least 20000", n)
	}
	if got := srv.NodeLoad("proxy-x"); len(got) != 1 {
		t.Fatalf("the node's stored load has %d workers, want 1", len(got))
	}
}

// One peer may hold MaxStreamsPerPeer streams open; the next is refused with
// RESOURCE_EXHAUSTED until one closes.
func TestStreamsPerPeerAreBounded(t *testing.T) {
	srv := server.New(server.Options{MaxStreamsPerPeer: 3})
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	conn, err := grpc.NewClient(cp.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	open := func(ctx context.Context) error {
		st, err := xdsv1.NewLoadReportingClient(conn).Report(ctx)
		if err != nil {
			return err
		}
		// A refused stream may end before the Send (io.EOF): its status comes from Recv.
		_ = st.Send(&xdsv1.LoadReport{NodeId: "n", Seq: 1})
		_, err = st.Recv()
		return err
	}
	var cancels []context.CancelFunc
	for i := range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		cancels = append(cancels, cancel)
		if err := open(ctx); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
	}
	if err := open(context.Background()); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fourth stream: %v, want RESOURCE_EXHAUSTED", err)
	}
	cancels[0]()
	waitUntil(t, "a stream slot", func() bool {
		ctx, cancel := context.WithCancel(context.Background())
		err := open(ctx)
		if err != nil {
			cancel()
			return false
		}
		cancels = append(cancels, cancel)
		return true
	})
	for _, c := range cancels {
		c()
	}
	if srv.Stats().RefusedStreams == 0 {
		t.Fatal("refusals not counted")
	}
}

// The API keys the control plane publishes reach the proxy's OnKeys; keys its ValidateKeys
// refuses are NACKed and the previous ones kept; removing them gives "".
func TestKeysReachClient(t *testing.T) {
	srv := server.New(server.Options{})
	if err := srv.SetWorkers(workers(1)); err != nil {
		t.Fatal(err)
	}
	if err := srv.SetKeys("sha256:aa tenant=a\n"); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	var mu sync.Mutex
	var got []string
	p := startProxy(t, cp.addr, "proxy-a", client.Options{
		OnKeys: func(k string) { mu.Lock(); got = append(got, k); mu.Unlock() },
		ValidateKeys: func(k string) error {
			if strings.Contains(k, "bad") {
				return errors.New("line 1: bad key")
			}
			return nil
		},
	})
	last := func() string {
		mu.Lock()
		defer mu.Unlock()
		if len(got) == 0 {
			return "(none)"
		}
		return got[len(got)-1]
	}
	waitUntil(t, "the first keys", func() bool { return last() == "sha256:aa tenant=a\n" })
	if err := srv.SetKeys("sha256:bad tenant=a\n"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the bad keys NACKed", func() bool { return p.c.Stats().NACKs == 1 })
	if !strings.Contains(p.c.Stats().LastNACK, "bad key") || last() != "sha256:aa tenant=a\n" {
		t.Fatalf("after bad keys: NACK %q, keys %q", p.c.Stats().LastNACK, last())
	}
	if err := srv.SetKeys(""); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the keys removed", func() bool { return last() == "" })
}

// A reporter's Acked hears each answer on the load stream while the control plane runs
// (what keeps a proxy's pushed loads current) and nothing once it has stopped.
func TestReporterHearsAnswers(t *testing.T) {
	cp, conn := dialServing(t, server.Options{ReportInterval: 10 * time.Millisecond}, []*xdsv1.Worker{worker("w1", 8001)})
	var acks atomic.Int64
	r, err := client.NewReporter(conn, client.ReporterOptions{NodeID: "proxy-1", Acked: func() { acks.Add(1) },
		Snapshot: func(uint64) []*xdsv1.WorkerLoad { return []*xdsv1.WorkerLoad{{WorkerId: "w1", Inflight: 1}} }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitUntil(t, "answers on the load stream", func() bool { return acks.Load() >= 5 })
	cp.stop(t)
	time.Sleep(100 * time.Millisecond) // answers in flight when it stopped
	n := acks.Load()
	time.Sleep(300 * time.Millisecond)
	if got := acks.Load(); got != n {
		t.Fatalf("%d answers heard after the control plane stopped", got-n)
	}
}

// TestLoadsTravelByShard: the workers' loads reach the proxy in shards of xds.LoadsShard
// apart from the workers. A load that moves resends its shard and no worker; a worker that
// changes otherwise resends itself and no shard; removing every worker of a shard removes
// the shard; an index freed is not given to a worker added in the same change.
func TestLoadsTravelByShard(t *testing.T) {
	srv := server.New(server.Options{})
	n := 2*xds.LoadsShard + 10 // three shards
	ws := workers(n)
	for i, w := range ws {
		w.Load = &xdsv1.Load{Running: uint32(i), KvUsage: 0.5, Epoch: 9, ObservedUnixNano: 1_700_000_000_000_000_000}
	}
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	p := startProxy(t, cp.addr, "proxy-a", client.Options{})
	waitUntil(t, "initial state", hasState(p, ws, nil))
	// Four responses: workers, loads, and the policy and API keys, both empty.
	waitUntil(t, "every response", func() bool { return p.c.Stats().ACKs+p.c.Stats().NACKs >= 4 })
	if st := p.c.Stats(); st.Resources != uint64(n+3) || st.Responses != 4 {
		t.Fatalf("initial sync: %d resources in %d responses, want %d workers and 3 shards in 4", st.Resources, st.Responses, n)
	}
	// settled checks that nothing more than want responses came since st, once whatever
	// was on its way has had time to arrive.
	settled := func(what string, st client.Stats, want uint64) {
		t.Helper()
		time.Sleep(100 * time.Millisecond)
		if d := p.c.Stats(); d.Responses != st.Responses+want || d.Resources != st.Resources+want {
			t.Fatalf("%s: %+v, was %+v: want %d more responses of one resource each", what, d, st, want)
		}
	}

	// A load in the last shard moves: that shard alone.
	st := p.c.Stats()
	ws = clone(ws)
	ws[n-1].Load.Running = 1000
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "moved load", hasState(p, ws, nil))
	settled("after one load moved (its shard alone)", st, 1)

	// A worker drains, its load unchanged: that worker alone.
	st = p.c.Stats()
	ws = clone(ws)
	ws[3].Draining = true
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "draining worker", hasState(p, ws, nil))
	settled("after one worker drained (it alone)", st, 1)

	// The last shard's workers go, one comes in their place: it takes a new index, not one
	// of theirs (the proxy may hold their loads a little longer than their workers).
	st = p.c.Stats()
	indexes := map[string]uint32{}
	got, _ := p.c.State()
	for _, w := range got {
		indexes[w.GetId()] = w.GetLoadIndex()
	}
	ws = append(clone(ws[:2*xds.LoadsShard]), worker("z-new", 9999))
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the last shard's workers gone", hasState(p, ws, nil))
	got, _ = p.c.State()
	for _, w := range got {
		if w.GetId() == "z-new" {
			if w.GetLoadIndex() < uint32(n) {
				t.Errorf("the new worker took index %d, freed in the same change", w.GetLoadIndex())
			}
		} else if w.GetLoadIndex() != indexes[w.GetId()] {
			t.Errorf("%s moved from index %d to %d", w.GetId(), indexes[w.GetId()], w.GetLoadIndex())
		}
	}
	if d := p.c.Stats(); d.Removals != st.Removals+10 {
		t.Errorf("removals %d, want the 10 workers", d.Removals-st.Removals)
	}

	// The new one goes too: its shard is empty and removed.
	st = p.c.Stats()
	ws = ws[:2*xds.LoadsShard]
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the last shard removed", func() bool { return p.c.Stats().Removals >= st.Removals+2 })
	waitUntil(t, "the last worker gone", hasState(p, ws, nil))
	if d := p.c.Stats(); d.Removals != st.Removals+2 {
		t.Errorf("removals %d, want 2: the worker and its shard", d.Removals-st.Removals)
	}
}

// TestServedLoadsOnly: a proxy that routes one model (Options.Serves) subscribes to the load
// shards of that model's workers only: the control plane gives each model shards of its
// own, the proxy holds every worker but the loads of its model's alone, and when a worker
// moves into its model (a shard opens) or out of it (the shard empties) the subscription
// follows. Shards that models leave are given to others, so models that come and go do not
// grow the load indexes.
func TestServedLoadsOnly(t *testing.T) {
	srv := server.New(server.Options{})
	var ws []*xdsv1.Worker
	for i := range 104 { // 64 of the served model (two full shards), 40 of the other
		w := worker(fmt.Sprintf("w%03d", i), 9000+i)
		if i < 64 {
			w.Model = "other"
		}
		w.Load = &xdsv1.Load{Running: uint32(i + 1)}
		ws = append(ws, w)
	}
	publish := func() {
		t.Helper()
		if err := srv.SetWorkers(ws); err != nil {
			t.Fatal(err)
		}
	}
	publish()
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	serves := func(w *xdsv1.Worker) bool { return w.GetModel() == "other" }
	p := startProxy(t, cp.addr, "proxy-scoped", client.Options{Serves: serves})
	all := startProxy(t, cp.addr, "proxy-all", client.Options{})
	// loadsOf: how many workers the proxy has a pushed load for, of the served model and
	// of the other.
	loadsOf := func(p *proxy) (served, others int) {
		got, _ := p.c.State()
		l := p.c.Loads()
		for _, w := range got {
			if l.LoadOf(w) == nil {
				continue
			}
			if serves(w) {
				served++
			} else {
				others++
			}
		}
		return served, others
	}
	loadOf := func(p *proxy, id string) *xdsv1.Load {
		got, _ := p.c.State()
		for _, w := range got {
			if w.GetId() == id {
				return p.c.Loads().LoadOf(w)
			}
		}
		return nil
	}
	waitUntil(t, "the served workers' loads", func() bool {
		got, _ := p.c.State()
		s, o := loadsOf(p)
		return len(got) == 104 && s == 64 && o == 0
	})
	waitUntil(t, "every load at the unscoped proxy", func() bool { s, o := loadsOf(all); return s == 64 && o == 40 })
	if n, m := p.c.Stats().Resources, all.c.Stats().Resources; n >= m {
		t.Fatalf("the scoped proxy took %d resources, the unscoped %d", n, m)
	}

	// w100 moves into the served model: its shards are full, a third opens, and the proxy
	// subscribes to it.
	moved := proto.Clone(ws[100]).(*xdsv1.Worker)
	moved.Model = "other"
	ws[100] = moved
	publish()
	waitUntil(t, "the moved worker's load", func() bool { return loadOf(p, "w100").GetRunning() == 101 })
	if s, o := loadsOf(p); s != 65 || o != 0 {
		t.Fatalf("after the move in: %d served and %d other loads", s, o)
	}
	// And back out: its shard empties (and goes to the pool of free shards), the proxy
	// forgets it, and a change of w100's load, now in another model's shard, does not
	// reach the proxy.
	back := proto.Clone(moved).(*xdsv1.Worker)
	back.Model = ws[101].GetModel()
	ws[100] = back
	publish()
	waitUntil(t, "the shard left", func() bool { s, o := loadsOf(p); return s == 64 && o == 0 && loadOf(p, "w100") == nil })
	before := p.c.Stats().Resources
	busy := proto.Clone(back).(*xdsv1.Worker)
	busy.Load = &xdsv1.Load{Running: 7}
	ws[100] = busy
	publish()
	waitUntil(t, "the unscoped proxy's update", func() bool { return loadOf(all, "w100").GetRunning() == 7 })
	if n := p.c.Stats().Resources; n != before {
		t.Fatalf("the scoped proxy took %d resources for another model's load", n-before)
	}

	// Models that come and go: the served model's 64 workers move to a new model five
	// times; the shards they leave go to the next, and the indexes stay within what two
	// models' workers need at once.
	for round := range 5 {
		for i := range 64 {
			w := proto.Clone(ws[i]).(*xdsv1.Worker)
			w.Model = fmt.Sprintf("ft-%d", round)
			ws[i] = w
		}
		publish()
	}
	waitUntil(t, "the last round", func() bool {
		got, _ := all.c.State()
		return len(got) == 104 && got[0].GetModel() == "ft-4"
	})
	got, _ := all.c.State()
	for _, w := range got {
		if w.GetLoadIndex() >= 8*xds.LoadsShard {
			t.Fatalf("%s has load index %d after the models came and went: shards are not given again", w.GetId(), w.GetLoadIndex())
		}
	}
}

// A proxy that names the models it routes (Options.Models) is sent their workers only,
// those that carry one as an adapter, and those whose model is not known; it follows
// workers into and out of its scope, removals, and a control plane's restart, while an
// unscoped proxy beside it takes every worker.
func TestServedWorkersOnly(t *testing.T) {
	var ws []*xdsv1.Worker
	for i := range 50 {
		w := worker(fmt.Sprintf("w%03d", i), 9000+i)
		w.Slot = uint32(i)
		switch {
		case i < 20:
			w.Model = "a"
		case i < 40:
			w.Model = "b"
		case i < 45:
			w.Model = "" // not known: in every scope
		default:
			w.Model = "base"
			w.LoraAdapters = []string{"a-lora"}
		}
		ws = append(ws, w)
	}
	srv := server.New(server.Options{})
	var history [][]*xdsv1.Worker // what srv published, in order
	publish := func(srv *server.Server) {
		t.Helper()
		if err := srv.SetWorkers(ws); err != nil {
			t.Fatal(err)
		}
		history = append(history, clone(ws))
	}
	publish(srv)
	cp := startControlPlane(t, "127.0.0.1:0", srv)
	scoped := func(models ...string) *proxy {
		return startProxy(t, cp.addr, "proxy-"+strings.Join(models, "+"), client.Options{Models: models})
	}
	a, lora, ab := scoped("a"), scoped("a-lora"), scoped("b", "a")
	a2 := scoped("a") // shares a's scope
	all := startProxy(t, cp.addr, "proxy-all", client.Options{})
	// want is what a proxy of models should hold now.
	want := func(models ...string) []string {
		var ids []string
		for _, w := range ws {
			in := w.GetModel() == "" || slices.Contains(models, w.GetModel())
			for _, ad := range w.GetLoraAdapters() {
				in = in || slices.Contains(models, ad)
			}
			if in {
				ids = append(ids, w.GetId())
			}
		}
		return ids
	}
	holds := func(p *proxy) []string {
		got, _ := p.c.State()
		ids := make([]string, len(got))
		for i, w := range got {
			ids[i] = w.GetId()
		}
		return ids
	}
	check := func(what string) {
		t.Helper()
		for _, c := range []struct {
			p      *proxy
			models []string
		}{{a, []string{"a"}}, {a2, []string{"a"}}, {lora, []string{"a-lora"}}, {ab, []string{"a", "b"}}, {all, []string{"a", "b", "base"}}} {
			waitUntil(t, what+": the workers of "+strings.Join(c.models, ","), func() bool { return slices.Equal(holds(c.p), want(c.models...)) })
		}
	}
	check("first")
	if n := len(holds(a)); n != 25 {
		t.Fatalf("a proxy of model a holds %d workers, want 25", n)
	}
	if st := srv.Stats(); st.WorkerScopes != 3 || st.UnscopedWatches != 0 {
		t.Fatalf("scopes %d (want 3: a, a-lora, a+b), unscoped watches %d", st.WorkerScopes, st.UnscopedWatches)
	}

	// w030 moves from b to a, w005 from a to b, w047 drops its adapter, w010 goes, w050
	// comes (of model a).
	in, out, plain := proto.Clone(ws[30]).(*xdsv1.Worker), proto.Clone(ws[5]).(*xdsv1.Worker), proto.Clone(ws[47]).(*xdsv1.Worker)
	in.Model, out.Model, plain.LoraAdapters = "a", "b", nil
	ws[30], ws[5], ws[47] = in, out, plain
	ws = slices.Delete(ws, 10, 11)
	added := worker("w050", 9050)
	added.Model, added.Slot = "a", 50
	ws = append(ws, added)
	publish(srv)
	check("after the moves")

	// A control plane's restart: each proxy resumes with the versions it holds, within its
	// scope, and is sent what changed meanwhile (w001 now unhealthy) and nothing of the
	// workers it does not route. The new control plane publishes the same history, so that
	// it gives the same load indexes (and the same Loads shards).
	before := a.c.Stats()
	cp.stop(t)
	waitUntil(t, "the proxy to notice", func() bool { return !a.c.Stats().Connected })
	srv2 := server.New(server.Options{})
	for _, h := range history {
		if err := srv2.SetWorkers(h); err != nil {
			t.Fatal(err)
		}
	}
	ws[1] = proto.Clone(ws[1]).(*xdsv1.Worker)
	ws[1].Healthy = false
	publish(srv2)
	startControlPlane(t, cp.addr, srv2)
	check("after the restart")
	waitUntil(t, "w001 unhealthy at the proxy", func() bool {
		got, _ := a.c.State()
		return len(got) > 1 && got[1].GetId() == "w001" && !got[1].GetHealthy()
	})
	waitUntil(t, "reconnected", func() bool { return a.c.Stats().Connected })
	after := a.c.Stats()
	// w001 alone: every other worker of the scope, and every Loads shard, is as the proxy
	// holds it.
	if got := after.Resources - before.Resources; got != 1 || after.Removals != before.Removals {
		t.Errorf("the resume sent %d resources and %d removals, want w001 alone", got, after.Removals-before.Removals)
	}
}

// A node whose models are not a list of names is refused on its ADS stream with a clear
// error, not served the fleet.
func TestMalformedNodeModelsRefused(t *testing.T) {
	_, conn := dialServing(t, server.Options{}, workers(2))
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	node := &core.Node{Id: "p", Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
		xds.NodeModelsKey: structpb.NewNumberValue(3),
	}}}
	if err := st.Send(&discovery.DeltaDiscoveryRequest{Node: node, TypeUrl: xds.WorkerType, ResourceNamesSubscribe: []string{"*"}}); err != nil {
		t.Fatal(err)
	}
	_, err = st.Recv()
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), xds.NodeModelsKey) {
		t.Fatalf("got %v, want InvalidArgument naming %s", err, xds.NodeModelsKey)
	}
	if _, err := client.New(conn, client.Options{NodeID: "p", Models: []string{"a b"}}); err == nil {
		t.Fatal("client.New took a model with a space")
	}
}
