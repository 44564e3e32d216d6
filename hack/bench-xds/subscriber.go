package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"

	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/internal/cputime"
	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/client"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// subscriber is a proxy's xDS side without its HTTP data plane: the same gRPC connection
// (xds/client.Dial), the same delta ADS client and index journal client, and the same
// prefix.Replica as journal sink, here wrapped in a timingSink that notes when each sampled
// block became visible in the replica. A stats handler on the connection counts the bytes
// every stream receives.
type subscriber struct {
	node  string
	conn  *grpc.ClientConn
	ads   *client.Client
	jc    *journal.Client
	sink  *timingSink
	bytes *byteCounter
	// jerr is the journal client's latest error (why its latest stream ended).
	jerr atomic.Pointer[string]
	// adsAtSync is the ADS bytes taken until the ADS client was first synced (its workers
	// and the policy applied): what a connect costs, before loads churn in.
	adsAtSync atomic.Uint64
}

// noteSync records the ADS bytes once the ADS client is first synced.
func (s *subscriber) noteSync(ctx context.Context) {
	select {
	case <-s.ads.Synced():
		s.adsAtSync.Store(s.bytes.adsIn.Load())
	case <-ctx.Done():
	}
}

// timingSink applies changes to a prefix.Replica exactly as the proxy does, then stamps the
// sampled Stored changes with the time Apply returned (the block is visible to Match from
// then on). Without a replica (r nil) it is a counting sink: it stamps and counts only. It
// is called from the journal client's goroutine only.
type timingSink struct {
	r    *prefix.Replica
	mask uint64
	// recs are the sampled arrivals not yet taken (take), under mu.
	mu      sync.Mutex
	recs    []pubRec
	stored  atomic.Uint64
	removed atomic.Uint64
	resets  atomic.Uint64
	// snapshotAt is when the latest snapshot was complete, resumedAt when the latest resume
	// on another replica was (unix nanoseconds).
	snapshotAt, resumedAt atomic.Int64
}

// take returns the arrivals recorded since the last take.
func (s *timingSink) take() []pubRec {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.recs
	s.recs = nil
	return out
}

func (s *timingSink) Reset() {
	s.resets.Add(1)
	if s.r != nil {
		s.r.Reset()
	}
}

func (s *timingSink) SnapshotDone() {
	if s.r != nil {
		s.r.SnapshotDone()
	}
	s.snapshotAt.Store(time.Now().UnixNano())
}

func (s *timingSink) Resumed() { s.resumedAt.Store(time.Now().UnixNano()) }

func (s *timingSink) Apply(cs []journal.Change) {
	if s.r != nil {
		s.r.Apply(cs)
	}
	now := time.Now().UnixNano()
	var st, rm uint64
	s.mu.Lock()
	for _, c := range cs {
		switch c.Op {
		case journal.Stored:
			st++
			if c.Seq&s.mask == 0 {
				s.recs = append(s.recs, pubRec{seq: c.Seq, at: now})
			}
		case journal.Removed:
			rm++
		}
	}
	s.mu.Unlock()
	s.stored.Add(st)
	s.removed.Add(rm)
}

// byteCounter is a grpc stats.Handler counting payload bytes by stream: WireLength of each
// received message (the gRPC message as sent, 5-byte length prefix included, before HTTP/2
// framing) and of each sent one.
type byteCounter struct {
	journalIn, adsIn, otherIn, out atomic.Uint64
	journalMsgs                    atomic.Uint64

	// conns are the connections opened, in order: when, to which address, and when they
	// ended (0: open); ads the ADS streams opened, in order: when, and when their first
	// response came (0: none yet).
	connMu sync.Mutex
	conns  []connAt
	ads    []adsAt
}

type adsAt struct{ start, firstIn int64 }

type adsKey struct{}

// adsUpAfter is when the first ADS stream opened after t took its first response (0: none
// has yet).
func (b *byteCounter) adsUpAfter(t int64) int64 {
	b.connMu.Lock()
	defer b.connMu.Unlock()
	for _, a := range b.ads {
		if a.start > t && a.firstIn != 0 {
			return a.firstIn
		}
	}
	return 0
}

type connAt struct {
	at, end int64
	addr    string
}

type connKey struct{}

// addrAt is the address of the last connection opened before t and still open at t (""
// when none was): a connection attempt that pick_first gave up on does not count.
func (b *byteCounter) addrAt(t int64) string {
	b.connMu.Lock()
	defer b.connMu.Unlock()
	addr := ""
	for _, c := range b.conns {
		if c.at < t && (c.end == 0 || c.end > t) {
			addr = c.addr
		}
	}
	return addr
}

type methodKey struct{}

func (b *byteCounter) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	if strings.Contains(info.FullMethodName, "AggregatedDiscoveryService") {
		b.connMu.Lock()
		b.ads = append(b.ads, adsAt{start: time.Now().UnixNano()})
		ctx = context.WithValue(ctx, adsKey{}, len(b.ads)-1)
		b.connMu.Unlock()
	}
	return context.WithValue(ctx, methodKey{}, info.FullMethodName)
}

func (b *byteCounter) HandleRPC(ctx context.Context, s stats.RPCStats) {
	switch p := s.(type) {
	case *stats.InPayload:
		m, _ := ctx.Value(methodKey{}).(string)
		switch {
		case strings.Contains(m, "IndexJournal"):
			b.journalIn.Add(uint64(p.WireLength))
			b.journalMsgs.Add(1)
		case strings.Contains(m, "AggregatedDiscoveryService"):
			b.adsIn.Add(uint64(p.WireLength))
			if i, ok := ctx.Value(adsKey{}).(int); ok {
				b.connMu.Lock()
				if b.ads[i].firstIn == 0 {
					b.ads[i].firstIn = time.Now().UnixNano()
				}
				b.connMu.Unlock()
			}
		default:
			b.otherIn.Add(uint64(p.WireLength))
		}
	case *stats.OutPayload:
		b.out.Add(uint64(p.WireLength))
	}
}

func (b *byteCounter) TagConn(ctx context.Context, info *stats.ConnTagInfo) context.Context {
	b.connMu.Lock()
	defer b.connMu.Unlock()
	b.conns = append(b.conns, connAt{at: time.Now().UnixNano(), addr: info.RemoteAddr.String()})
	return context.WithValue(ctx, connKey{}, len(b.conns)-1)
}

func (b *byteCounter) HandleConn(ctx context.Context, s stats.ConnStats) {
	if _, ok := s.(*stats.ConnEnd); !ok {
		return
	}
	if i, ok := ctx.Value(connKey{}).(int); ok {
		b.connMu.Lock()
		b.conns[i].end = time.Now().UnixNano()
		b.connMu.Unlock()
	}
}

func newSubscriber(addr, node string, mask uint64, opts ...grpc.DialOption) (*subscriber, error) {
	bc := &byteCounter{}
	conn, err := client.Dial(addr, append([]grpc.DialOption{grpc.WithStatsHandler(bc)}, opts...)...)
	if err != nil {
		return nil, err
	}
	ads, err := client.New(conn, client.Options{NodeID: node, OnUpdate: func([]*xdsv1.Worker, *xdsv1.RoutingPolicy, xds.PushedLoads) {}})
	if err != nil {
		conn.Close()
		return nil, err
	}
	s := &subscriber{
		node:  node,
		conn:  conn,
		ads:   ads,
		sink:  &timingSink{r: prefix.NewReplica(blockset.DefaultWeights), mask: mask},
		bytes: bc,
	}
	s.jc = journal.NewClient(conn, journal.ClientOptions{NodeID: node, OnError: s.noteJournalError})
	return s, nil
}

// noteJournalError keeps why the journal stream last ended.
func (s *subscriber) noteJournalError(err error) {
	msg := err.Error()
	s.jerr.Store(&msg)
}

// subscribers runs n subscribers until stop.
type subscribers struct {
	subs   []*subscriber
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func startSubscribers(xds, nodeBase string, n int, mask uint64) (*subscribers, error) {
	ctx, cancel := context.WithCancel(context.Background())
	ss := &subscribers{cancel: cancel}
	for i := range n {
		s, err := newSubscriber(xds, nodeBase+"-"+strconv.Itoa(i), mask)
		if err != nil {
			ss.stop()
			return nil, err
		}
		ss.subs = append(ss.subs, s)
		ss.wg.Add(2)
		go func() { defer ss.wg.Done(); _ = s.ads.Run(ctx) }()
		go func() { defer ss.wg.Done(); _ = s.jc.Run(ctx, s.sink) }()
	}
	return ss, nil
}

// waitSynced waits for every subscriber's ADS and journal to be synced.
func (ss *subscribers) waitSynced(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, s := range ss.subs {
		select {
		case <-s.ads.Synced():
		case <-time.After(time.Until(deadline)):
			return fmt.Errorf("subscriber %s: no ADS state after %v", s.node, timeout)
		}
		for !s.jc.Synced() {
			if time.Now().After(deadline) {
				return fmt.Errorf("subscriber %s: index journal not synced after %v", s.node, timeout)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return nil
}

func (ss *subscribers) stop() {
	ss.cancel()
	ss.wg.Wait()
	for _, s := range ss.subs {
		s.conn.Close()
	}
}

// subStats is what one subscriber saw during the measured window.
type subStats struct {
	Node                    string
	JournalBytes, ADSBytes  uint64
	OtherBytes, SentBytes   uint64
	JournalMsgs             uint64
	Stored, Removed, Resets uint64
	Applied, Batches, Nacks uint64
	Streams, ADSResponses   uint64
	ReplicaBlocks           int
	ADSAtSync               uint64 // not a window's: since the start
	arrivals                []pubRec
}

func (s *subscriber) snapshot() subStats {
	js := s.jc.Stats()
	as := s.ads.Stats()
	return subStats{
		Node:         s.node,
		JournalBytes: s.bytes.journalIn.Load(), ADSBytes: s.bytes.adsIn.Load(),
		OtherBytes: s.bytes.otherIn.Load(), SentBytes: s.bytes.out.Load(),
		JournalMsgs: s.bytes.journalMsgs.Load(),
		Stored:      s.sink.stored.Load(), Removed: s.sink.removed.Load(), Resets: s.sink.resets.Load(),
		Applied: js.Applied, Batches: js.Batches, Nacks: js.Nacks, Streams: js.Streams,
		ADSResponses: as.Responses, ADSAtSync: s.adsAtSync.Load(),
		ReplicaBlocks: s.replicaLen(),
	}
}

func (s *subscriber) replicaLen() int {
	if s.sink.r == nil {
		return 0
	}
	return s.sink.r.Len()
}

func (a subStats) minus(b subStats) subStats {
	a.JournalBytes -= b.JournalBytes
	a.ADSBytes -= b.ADSBytes
	a.OtherBytes -= b.OtherBytes
	a.SentBytes -= b.SentBytes
	a.JournalMsgs -= b.JournalMsgs
	a.Stored -= b.Stored
	a.Removed -= b.Removed
	a.Applied -= b.Applied
	a.Batches -= b.Batches
	a.ADSResponses -= b.ADSResponses
	return a
}

// childResult is what the subscriber process reports.
type childResult struct {
	Subs []subStats
	// CPU is the process's user+system CPU between ready and stop; Wall the time between.
	CPUSeconds, WallSeconds float64
	// HeapAlloc is the live heap after a GC at stop (all replicas together).
	HeapAlloc uint64
	Error     string
}

// cpuSeconds is the process's CPU time so far, in seconds.
func cpuSeconds() float64 { return cputime.Self().Seconds() }

// runSubscribeChild is the child process: P subscribers to -xds; "ready" on stdout once
// synced; on stdin EOF, the window's stats as JSON on stdout and the arrival records in -out.
func runSubscribeChild(f flags) error {
	mask := uint64(1)<<uint(f.sample) - 1
	ss, err := startSubscribers(f.xds, f.nodeBase, f.proxies, mask)
	if err != nil {
		return err
	}
	if err := ss.waitSynced(30 * time.Second); err != nil {
		return err
	}
	before := make([]subStats, len(ss.subs))
	for i, s := range ss.subs {
		before[i] = s.snapshot()
	}
	cpu0, t0 := cpuSeconds(), time.Now()
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	cpu1, t1 := cpuSeconds(), time.Now()
	res := childResult{CPUSeconds: cpu1 - cpu0, WallSeconds: t1.Sub(t0).Seconds()}
	for i, s := range ss.subs {
		res.Subs = append(res.Subs, s.snapshot().minus(before[i]))
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	res.HeapAlloc = ms.HeapAlloc
	ss.cancel()
	ss.wg.Wait()
	if err := writeArrivals(f.outFile, ss); err != nil {
		res.Error = err.Error()
	}
	b, _ := json.Marshal(res)
	fmt.Println(string(b))
	return nil
}

func writeArrivals(path string, ss *subscribers) error {
	fh, err := os.Create(path)
	if err != nil {
		return err
	}
	fh.Close()
	for i, s := range ss.subs {
		p := path
		if i > 0 {
			p = path + "." + strconv.Itoa(i)
		}
		if err := writeRecs(p, s.sink.take()); err != nil {
			return err
		}
	}
	return nil
}

// readArrivals reads n record files written by writeArrivals (n == 1: writeRecs).
func readArrivals(path string, n int) ([][]pubRec, error) {
	out := make([][]pubRec, n)
	for i := range n {
		p := path
		if i > 0 {
			p = path + "." + strconv.Itoa(i)
		}
		recs, err := readRecs(p)
		if err != nil {
			return nil, err
		}
		out[i] = recs
	}
	return out, nil
}

func readRecs(path string) ([]pubRec, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	r := bufio.NewReaderSize(fh, 1<<20)
	var b [16]byte
	if _, err := io.ReadFull(r, b[:8]); err != nil {
		return nil, err
	}
	k := binary.LittleEndian.Uint64(b[:8])
	if k > 1<<32 {
		return nil, errors.New("record file is corrupt")
	}
	out := make([]pubRec, k)
	for j := range out {
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return nil, err
		}
		out[j] = pubRec{seq: binary.LittleEndian.Uint64(b[:8]), at: int64(binary.LittleEndian.Uint64(b[8:]))}
	}
	return out, nil
}
