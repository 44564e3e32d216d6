package server_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"strings"
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

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
	"github.com/kvrelay/kvrelay/xds/server"
)

// serve runs srv on a loopback port until the test ends.
func serve(t *testing.T, srv *server.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return lis.Addr().String()
}

// dial connects with static HTTP/2 windows of the given size (no BDP growth).
func dial(t *testing.T, addr string, window int32) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(window), grpc.WithInitialConnWindowSize(window))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func workers(n, load uint32) []*xdsv1.Worker {
	ws := make([]*xdsv1.Worker, n)
	for i := range ws {
		ws[i] = xds.NewWorker(fmt.Sprintf("w%05d", i), fmt.Sprintf("http://10.0.%d.%d:8000", i/250, i%250), "Qwen/Qwen3-0.6B")
		ws[i].Slot, ws[i].BlockSize, ws[i].Engine = uint32(i), 16, "sim"
		ws[i].Load = &xdsv1.Load{Running: load}
	}
	return ws
}

// A proxy that subscribes and acknowledges without reading gets its next response queued
// behind the first, unsent (its window is full); after SendTimeout the stream is ended
// instead of holding that response for as long as the connection lives.
func TestNonReadingADSStreamIsCutOff(t *testing.T) {
	srv := server.New(server.Options{SendTimeout: 300 * time.Millisecond})
	if err := srv.SetWorkers(workers(3000, 0)); err != nil { // a response of about 300 KB
		t.Fatal(err)
	}
	conn := dial(t, serve(t, srv), 64<<10)
	st, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	req := &discovery.DeltaDiscoveryRequest{Node: &core.Node{Id: "mute"}, TypeUrl: xds.WorkerType, ResourceNamesSubscribe: []string{"*"}}
	if err := st.Send(req); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the first push", func() bool { return srv.Stats().Pushes == 1 })
	if err := st.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: xds.WorkerType, ResponseNonce: "1"}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the blind ACK", func() bool { return srv.Stats().ACKs == 1 })
	// Every worker drains (a change of loads alone would go as Loads, not subscribed here).
	ws := workers(3000, 0)
	for _, w := range ws {
		w.Draining = true
	}
	if err := srv.SetWorkers(ws); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the mute stream ended", func() bool {
		s := srv.Stats()
		return s.SlowStreams == 1 && s.Proxies["mute"] == 0
	})
}

// rawConn speaks HTTP/2 by hand, to open streams the way no gRPC client would.
type rawConn struct {
	c net.Conn
	r *bufio.Reader
}

func dialRaw(t *testing.T, addr string) *rawConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	r := &rawConn{c: c, r: bufio.NewReader(c)}
	r.write(t, append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), frame(0x4, 0, 0, nil)...)) // preface, empty SETTINGS
	return r
}

func frame(typ, flags byte, stream uint32, payload []byte) []byte {
	n := len(payload)
	b := append([]byte{byte(n >> 16), byte(n >> 8), byte(n)}, typ, flags)
	return append(binary.BigEndian.AppendUint32(b, stream), payload...)
}

// headers is a HEADERS frame (END_HEADERS) opening a gRPC call to path, its fields literal
// without indexing (HPACK 6.2.2), all shorter than 127 bytes.
func headers(stream uint32, path string) []byte {
	var hb []byte
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", path},
		{":authority", "xds"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		hb = append(append(append(hb, 0, byte(len(kv[0]))), kv[0]...), byte(len(kv[1])))
		hb = append(hb, kv[1]...)
	}
	return frame(0x1, 0x4, stream, hb)
}

func (r *rawConn) write(t *testing.T, b []byte) {
	t.Helper()
	if _, err := r.c.Write(b); err != nil {
		t.Fatal(err)
	}
}

// read returns the next frame.
func (r *rawConn) read() (typ, flags byte, stream uint32, payload []byte, err error) {
	var h [9]byte
	if _, err = io.ReadFull(r.r, h[:]); err != nil {
		return
	}
	payload = make([]byte, int(h[0])<<16|int(h[1])<<8|int(h[2]))
	_, err = io.ReadFull(r.r, payload)
	return h[3], h[4], binary.BigEndian.Uint32(h[5:]) &^ (1 << 31), payload, err
}

// One connection may carry twice MaxStreamsPerPeer streams (SETTINGS_MAX_CONCURRENT_STREAMS);
// its transport refuses more with REFUSED_STREAM and never starts their handlers. Without
// the limit a client that opens streams and reads nothing had each refused by limitStreams
// and held until the refusal was written: 300,000 streams took 1 GB.
func TestStreamsPerConnectionAreBounded(t *testing.T) {
	const perPeer, opened = 4, 200
	srv := server.New(server.Options{MaxStreamsPerPeer: perPeer})
	c := dialRaw(t, serve(t, srv))
	var burst []byte
	for i := range opened {
		burst = append(burst, headers(uint32(2*i+1), "/kvrelay.xds.v1.LoadReporting/Report")...)
	}
	c.write(t, burst)
	c.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var maxStreams uint32
	answered, refused := map[uint32]bool{}, map[uint32]bool{}
	for len(answered)+len(refused) < opened-perPeer { // perPeer streams stay open
		typ, flags, stream, p, err := c.read()
		if err != nil {
			t.Fatalf("after %d answered and %d refused: %v", len(answered), len(refused), err)
		}
		switch {
		case typ == 0x4 && flags&1 == 0: // SETTINGS
			for i := 0; i+6 <= len(p); i += 6 {
				if binary.BigEndian.Uint16(p[i:]) == 0x3 {
					maxStreams = binary.BigEndian.Uint32(p[i+2:])
				}
			}
			c.write(t, frame(0x4, 1, 0, nil))
		case typ == 0x1 && flags&1 != 0: // trailers only: refused by limitStreams
			answered[stream] = true
		case typ == 0x3 && binary.BigEndian.Uint32(p) == 0x7: // RST_STREAM REFUSED_STREAM
			refused[stream] = true
		}
	}
	if maxStreams != 2*perPeer {
		t.Fatalf("SETTINGS_MAX_CONCURRENT_STREAMS %d, want %d", maxStreams, 2*perPeer)
	}
	if len(refused) == 0 || srv.Stats().RefusedStreams >= opened-perPeer {
		t.Fatalf("%d streams refused by the transport, %d by limitStreams: the transport should refuse most", len(refused), srv.Stats().RefusedStreams)
	}
}

// slowConn delays each read, so that a round trip on loopback takes milliseconds, as across
// a network: grpc-go's dynamic windows then grow with the bandwidth-delay product.
type slowConn struct{ net.Conn }

func (c slowConn) Read(b []byte) (int, error) {
	time.Sleep(2 * time.Millisecond)
	return c.Conn.Read(b)
}

// The server's receive windows are static: a client can park no more than a stream's window
// (256 KiB) in a stream whose handler has stopped reading (an ADS stream blocked sending to
// it), where grpc-go's dynamic windows, grown while the handler read, let it park megabytes
// (up to 16 MiB a stream). Whether they grow on a connection depends on its first round
// trips, so the test tries a few.
func TestReceiveWindowIsStatic(t *testing.T) {
	srv := server.New(server.Options{})
	const readFirst = 32 << 20
	var read atomic.Int64 // by the latest stream
	srv.GRPC().RegisterService(&grpc.ServiceDesc{
		ServiceName: "test.Park",
		Streams: []grpc.StreamDesc{{StreamName: "Park", ClientStreams: true, Handler: func(_ any, st grpc.ServerStream) error {
			for read.Load() < readFirst {
				m := &xdsv1.JournalAck{}
				if err := st.RecvMsg(m); err != nil {
					return err
				}
				read.Add(int64(proto.Size(m)))
			}
			<-st.Context().Done()
			return nil
		}}},
	}, nil)
	addr := serve(t, srv)
	msg := &xdsv1.JournalAck{NodeId: strings.Repeat("x", 32<<10)}
	size := int64(proto.Size(msg))
	for try := range 4 {
		read.Store(0)
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
				c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
				return slowConn{c}, err
			}))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		st, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true}, "/test.Park/Park")
		if err != nil {
			t.Fatal(err)
		}
		var sent atomic.Int64
		go func() {
			for st.SendMsg(msg) == nil {
				sent.Add(size)
			}
		}()
		// Until the sends stall: half a second without progress once the handler stopped.
		last, since := int64(-1), time.Now()
		for read.Load() < readFirst || time.Since(since) < 500*time.Millisecond {
			time.Sleep(20 * time.Millisecond)
			if n := sent.Load(); n != last {
				last, since = n, time.Now()
			}
		}
		parked := sent.Load() - read.Load()
		cancel()
		conn.Close()
		// The window, plus what the client's own transport queues (64 KiB and a message).
		if parked > 1<<20 {
			t.Fatalf("try %d: the client parked %d KiB in a stream the server stopped reading, want at most 1024", try, parked>>10)
		}
	}
}

// preEncoded is an Encoded message whose encoding differs from its fields, to tell which
// one went on the wire.
type preEncoded struct {
	*xdsv1.JournalAck
	raw []byte
}

func (p *preEncoded) EncodedProto() []byte { return p.raw }

// A message that carries its encoding goes out as those bytes, not marshaled again: the
// journal sends one encoding of a snapshot to every proxy, where marshaling per stream held
// a copy each (500 proxies resyncing at once: 1.4 GB).
func TestEncodedMessagesAreSentAsIs(t *testing.T) {
	srv := server.New(server.Options{})
	raw, err := proto.Marshal(&xdsv1.JournalAck{NodeId: "encoded"})
	if err != nil {
		t.Fatal(err)
	}
	srv.GRPC().RegisterService(&grpc.ServiceDesc{
		ServiceName: "test.Encoded",
		Streams: []grpc.StreamDesc{{StreamName: "Get", ServerStreams: true, Handler: func(_ any, st grpc.ServerStream) error {
			return st.SendMsg(&preEncoded{JournalAck: &xdsv1.JournalAck{NodeId: "marshaled"}, raw: raw})
		}}},
	}, nil)
	conn := dial(t, serve(t, srv), 64<<10)
	st, err := conn.NewStream(context.Background(), &grpc.StreamDesc{ServerStreams: true}, "/test.Encoded/Get")
	if err != nil {
		t.Fatal(err)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	got := &xdsv1.JournalAck{}
	if err := st.RecvMsg(got); err != nil {
		t.Fatal(err)
	}
	if got.NodeId != "encoded" {
		t.Fatalf("received %q, want the message's own encoding", got.NodeId)
	}
}

// blocks is a journal.Snapshotter over a fixed set.
type blocks struct{ set blockset.Set }

func (b *blocks) Each(fn func(uint64, int, blockset.Tier)) { b.set.Each(fn) }

// countSink counts a replica's entries.
type countSink struct{ n atomic.Int64 }

func (c *countSink) Reset()                    { c.n.Store(0) }
func (c *countSink) Apply(cs []journal.Change) { c.n.Add(int64(len(cs))) }

// Proxies resyncing together over the xDS port share one encoded snapshot and each gets all
// of it.
func TestJournalSnapshotIsSharedOnXDSPort(t *testing.T) {
	const entries, proxies = 30000, 8
	src := &blocks{}
	for i := range entries {
		src.set.Add(uint64(i+1), i%5, blockset.GPU)
	}
	jsrv := journal.NewServer(journal.NewLog(1024), src, journal.ServerOptions{SnapshotBatch: 1000})
	srv := server.New(server.Options{})
	xdsv1.RegisterIndexJournalServer(srv.GRPC(), jsrv)
	addr := serve(t, srv)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var clients []*journal.Client
	var sinks []*countSink
	for i := range proxies {
		c := journal.NewClient(dial(t, addr, 1<<20), journal.ClientOptions{NodeID: fmt.Sprintf("p%d", i)})
		s := &countSink{}
		clients, sinks = append(clients, c), append(sinks, s)
		go c.Run(ctx, s)
	}
	for i, c := range clients {
		waitUntil(t, "a proxy's sync", c.Synced)
		if n := sinks[i].n.Load(); n != entries {
			t.Fatalf("proxy %d holds %d entries, want %d", i, n, entries)
		}
	}
	if st := jsrv.Stats(); st.Snapshots != proxies || st.SnapshotsBuilt >= proxies {
		t.Fatalf("%d snapshots sent from %d copies of the index", st.Snapshots, st.SnapshotsBuilt)
	}
}

// TestConnectionsPerPeerAreBounded: past MaxConnsPerPeer a host's connections are closed as
// soon as they are accepted, counted, and its place comes back when one of its own closes;
// the connections it holds keep working.
func TestConnectionsPerPeerAreBounded(t *testing.T) {
	srv := server.New(server.Options{MaxConnsPerPeer: 3, ShutdownGrace: 50 * time.Millisecond})
	addr := serve(t, srv)
	var held []net.Conn
	for range 3 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		held = append(held, c)
	}
	closedByServer := func(c net.Conn) bool {
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		var b [64]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				var ne net.Error
				return !(errors.As(err, &ne) && ne.Timeout())
			}
		}
	}
	extra, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	if !closedByServer(extra) {
		t.Fatal("a fourth connection from the host was kept")
	}
	waitUntil(t, "the refusal to be counted", func() bool { return srv.Stats().RefusedConns == 1 })
	if closedByServer(held[0]) {
		t.Fatal("a connection within the limit was closed")
	}
	held[1].Close()
	// Its place comes back: a new connection is served (a gRPC client gets an answer).
	waitUntil(t, "a place to come back", func() bool {
		conn := dial(t, addr, 1<<16)
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		st, err := xdsv1.NewLoadReportingClient(conn).Report(ctx)
		if err != nil {
			return false
		}
		_ = st.Send(&xdsv1.LoadReport{NodeId: "p", Seq: 1})
		_, err = st.Recv()
		conn.Close()
		return err == nil
	})
}

// TestArmsAreSummedAcrossProxies: each proxy's arm figures are summed by policy version;
// malformed arms (no version, unordered bounds, counts not one past the bounds) are dropped.
func TestArmsAreSummedAcrossProxies(t *testing.T) {
	srv := server.New(server.Options{ShutdownGrace: 50 * time.Millisecond})
	if err := srv.SetWorkers(workers(1, 0)); err != nil {
		t.Fatal(err)
	}
	addr := serve(t, srv)
	conn := dial(t, addr, 1<<16)
	arm := func(v uint64, n uint64) *xdsv1.ArmReport {
		return &xdsv1.ArmReport{PolicyVersion: v, Requests: n, Errors: 1, TtftBounds: []float64{0.1, 1}, TtftCounts: []uint64{n - 1, 1, 0}, CachedBlocks: 9 * n, PromptBlocks: 10 * n,
			ShadowPicks: n, ShadowDisagreements: 1, ShadowCandidateOverlapBlocks: 3 * n,
			Rejections: 1, ServerErrors: 1, ItlBounds: []float64{0.01}, ItlCounts: []uint64{n, 1}, Decisions: n, RegretBlocks: 2,
			RouterErrors: 1, ClientErrors: 2, ClientGone: 3,
			Groups: []*xdsv1.ArmGroup{
				{Group: 5, Requests: n - 1, RouterErrors: 1, TtftCounts: []uint64{n - 2, 1, 0}, ItlCounts: []uint64{n, 1}},
				{Group: uint32(n), Requests: 1, ClientGone: 1, TtftCounts: []uint64{1, 0, 0}},
				{Group: 5, Requests: 99},                           // again: dropped
				{Group: 300, Requests: 99},                         // past MaxArmGroups: dropped
				{Group: 6, Requests: 99, TtftCounts: []uint64{99}}, // histogram of another length: dropped
			}}
	}
	for i, node := range []string{"a", "b"} {
		st, err := xdsv1.NewLoadReportingClient(conn).Report(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		rep := &xdsv1.LoadReport{NodeId: node, Seq: 1, Arms: []*xdsv1.ArmReport{
			arm(7, uint64(10*(i+1))), arm(8, 5),
			{PolicyVersion: 0, Requests: 99, TtftCounts: []uint64{1}},
			{PolicyVersion: 9, Requests: 99, TtftBounds: []float64{1, 0.5}, TtftCounts: []uint64{1, 1, 1}},
			{PolicyVersion: 9, Requests: 99, TtftBounds: []float64{1}, TtftCounts: []uint64{1}},
		}}
		if err := st.Send(rep); err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.CloseSend() })
	}
	waitUntil(t, "both reports", func() bool { return srv.Arms()[7].Requests == 30 })
	arms := srv.Arms()
	a7, a8 := arms[7], arms[8]
	if a7.Errors != 2 || a7.PromptBlocks != 300 || a7.TTFTCounts[0] != 28 || a8.Requests != 10 || len(arms) != 2 ||
		a7.Shadow.Picks != 30 || a7.Shadow.Disagreements != 2 || a7.Shadow.CandOverlapBlocks != 90 ||
		a7.Rejections != 2 || a7.ServerErrors != 2 || a7.ITLCounts[0] != 30 || a7.ITLCounts[1] != 2 || a7.Decisions != 30 || a7.RegretBlocks != 4 ||
		a7.RouterErrors != 2 || a7.ClientErrors != 4 || a7.ClientGone != 6 {
		t.Fatalf("arms %+v", arms)
	}
	// Conversation groups summed by number across the proxies: group 5 from both, groups
	// 10 and 20 (one conversation each) from one each.
	want := []server.ArmGroup{
		{Group: 5, Requests: 28, RouterErrors: 2, TTFTCounts: []uint64{26, 2, 0}, ITLCounts: []uint64{30, 2}},
		{Group: 10, Requests: 1, ClientGone: 1, TTFTCounts: []uint64{1, 0, 0}},
		{Group: 20, Requests: 1, ClientGone: 1, TTFTCounts: []uint64{1, 0, 0}},
	}
	if !reflect.DeepEqual(a7.Groups, want) {
		t.Fatalf("arm 7's groups %+v, want %+v", a7.Groups, want)
	}
}

// dialFrom is dial from the loopback address src (127.0.0.0/8 holds many), as another
// host would.
func dialFrom(t *testing.T, addr, src string) *grpc.ClientConn {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) { return d.DialContext(ctx, "tcp", a) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestGlobalStreamAndConnectionCaps: many addresses, each under its own caps, together get
// no more than MaxStreams streams and MaxConns connections.
func TestGlobalStreamAndConnectionCaps(t *testing.T) {
	srv := server.New(server.Options{MaxStreamsPerPeer: 100, MaxStreams: 2, MaxConnsPerPeer: 100, MaxConns: 3, ShutdownGrace: 50 * time.Millisecond})
	addr := serve(t, srv)
	report := func(conn *grpc.ClientConn) error {
		st, err := xdsv1.NewLoadReportingClient(conn).Report(context.Background())
		if err != nil {
			return err
		}
		// A stream the server has already ended fails Send with io.EOF; Recv says why.
		_ = st.Send(&xdsv1.LoadReport{NodeId: "p", Seq: 1})
		_, err = st.Recv()
		return err
	}
	// Two streams from two hosts are served and held; a third host's is refused.
	for i, src := range []string{"127.0.0.2", "127.0.0.3"} {
		if err := report(dialFrom(t, addr, src)); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
	}
	if err := report(dialFrom(t, addr, "127.0.0.4")); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a third host's stream past MaxStreams 2: %v, want RESOURCE_EXHAUSTED", err)
	}
	// Three connections are open now; a fourth host's connection is closed at once.
	c, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.5")}}).Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	var b [64]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("a fourth host's connection past MaxConns 3 was kept")
			}
			break
		}
	}
	waitUntil(t, "the refusal to be counted", func() bool { return srv.Stats().RefusedConns >= 1 })
}

// TestConnectionsAgeOut: a proxy's connection is closed MaxConnectionAge after it opened
// (after MaxConnectionAgeGrace for its streams), so that it reconnects, wherever the Service
// sends it; its next stream is served on a new connection.
func TestConnectionsAgeOut(t *testing.T) {
	srv := server.New(server.Options{MaxConnectionAge: 300 * time.Millisecond, MaxConnectionAgeGrace: 200 * time.Millisecond, ShutdownGrace: 50 * time.Millisecond})
	conn := dial(t, serve(t, srv), 1<<16)
	st, err := xdsv1.NewLoadReportingClient(conn).Report(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&xdsv1.LoadReport{NodeId: "p", Seq: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for {
		if _, err := st.Recv(); err != nil {
			break // the stream ended with its connection
		}
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("the aged connection's stream ended after %v", took)
	}
	waitUntil(t, "a stream on a new connection", func() bool {
		st, err := xdsv1.NewLoadReportingClient(conn).Report(context.Background())
		if err != nil {
			return false
		}
		if st.Send(&xdsv1.LoadReport{NodeId: "p", Seq: 2}) != nil {
			return false
		}
		_, err = st.Recv()
		return err == nil
	})
}
