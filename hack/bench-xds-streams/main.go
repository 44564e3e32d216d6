// Command bench-xds-streams measures what xDS streams that never read cost the control
// plane. A child process of this binary serves ADS and the index journal the way the
// control plane does (xds/server with xds/journal registered on it) over an index of
// -blocks entries that changes -churn times a second, with -workers workers whose load is
// republished every 100 ms. This process then opens -journal journal streams and -ads ADS
// streams from the source addresses 127.0.0.2 to 127.0.0.<1+sources> (so that the
// per-peer stream cap does not stop them), none of which reads, holds them for -hold,
// closes them, and prints the child's heap and RSS before, at peak and -after the close,
// with how long an honest proxy took to sync its journal replica meanwhile.
//
//	go run ./hack/bench-xds-streams                  # raw HTTP/2 clients that never read the socket
//	go run ./hack/bench-xds-streams -client grpc     # grpc-go clients granting 1 GiB windows, never calling Recv
package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
	xdsserver "github.com/kvrelay/kvrelay/xds/server"
)

type flags struct {
	role             string
	blocks, workers  int
	churn            int
	journal, ads     int
	sources          int
	client           string
	hold, after      time.Duration
	sample           time.Duration
	streamsPerConn   int
	honestSyncBudget time.Duration
	heapProfile      string
	zombies          int
	idleConns        int
	verbose          bool
}

func main() {
	var f flags
	flag.StringVar(&f.role, "role", "attack", "attack (this process) | serve (the child)")
	flag.IntVar(&f.blocks, "blocks", 200000, "index entries")
	flag.IntVar(&f.workers, "workers", 64, "published workers (index slots)")
	flag.IntVar(&f.churn, "churn", 5000, "index changes a second")
	flag.IntVar(&f.journal, "journal", 500, "journal streams that never read")
	flag.IntVar(&f.ads, "ads", 500, "ADS streams that never read")
	flag.IntVar(&f.sources, "sources", 19, "source addresses, 127.0.0.2 on")
	flag.StringVar(&f.client, "client", "raw", "raw: HTTP/2 by hand, granting 2 GiB windows and never reading the socket; grpc: grpc-go with 1 GiB windows, never calling Recv")
	flag.IntVar(&f.streamsPerConn, "streams-per-conn", 1, "raw: streams on one connection")
	flag.DurationVar(&f.hold, "hold", 45*time.Second, "how long the streams stay open")
	flag.DurationVar(&f.after, "after", 30*time.Second, "how long after closing them the last sample is taken")
	flag.DurationVar(&f.sample, "sample", 250*time.Millisecond, "sampling period")
	flag.DurationVar(&f.honestSyncBudget, "honest-timeout", 120*time.Second, "how long the honest proxy may take to sync")
	flag.StringVar(&f.heapProfile, "heap-profile", "", "write the child's heap profile, a third into -hold, to this file")
	flag.IntVar(&f.zombies, "zombies", 0, "raw: streams more opened on one more connection that never reads (past the per-peer cap: refused, but the refusals cannot be written)")
	flag.IntVar(&f.idleConns, "idle-conns", 0, "raw: connections more, from one address, that open no stream and never read")
	flag.BoolVar(&f.verbose, "v", false, "print a sample every 5 s while the streams are held")
	flag.Parse()
	var err error
	switch f.role {
	case "serve":
		err = serve(f)
	case "attack":
		err = attack(f)
	default:
		err = fmt.Errorf("unknown role %q", f.role)
	}
	if err != nil {
		log.Fatal(err)
	}
}

// index is the child's journal.Snapshotter: a set and a log changed together.
type index struct {
	mu   sync.Mutex
	set  blockset.Set
	log  *journal.Log
	seqs []uint64 // ring of stored blocks, oldest first from at
	at   int
}

func (x *index) Each(fn func(uint64, int, blockset.Tier)) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.set.Each(fn)
}

// replace removes n of the oldest blocks and stores n new ones.
func (x *index) replace(n, slots int) {
	cs := make([]journal.Change, 0, 2*n)
	x.mu.Lock()
	for range n {
		old := x.seqs[x.at]
		slot := int(old % uint64(slots))
		x.set.Remove(old, slot, blockset.GPU)
		cs = append(cs, journal.Change{Seq: old, Slot: uint32(slot), Op: journal.Removed})
		seq := rand.Uint64()
		slot = int(seq % uint64(slots))
		x.set.Add(seq, slot, blockset.GPU)
		cs = append(cs, journal.Change{Seq: seq, Slot: uint32(slot), Op: journal.Stored})
		x.seqs[x.at] = seq
		x.at = (x.at + 1) % len(x.seqs)
	}
	x.mu.Unlock()
	x.log.Append(cs...)
}

// mem is what the child reports.
type mem struct {
	HeapAllocMB, HeapInuseMB, SysMB float64
	RSSMB, HWMMB                    float64
	Goroutines                      int
	Journal                         journal.Stats
	XDS                             xdsserver.Stats
}

func readMem(jsrv *journal.Server, xsrv *xdsserver.Server) mem {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	m := mem{
		HeapAllocMB: mb(ms.HeapAlloc), HeapInuseMB: mb(ms.HeapInuse), SysMB: mb(ms.Sys),
		Goroutines: runtime.NumGoroutine(), Journal: jsrv.Stats(), XDS: xsrv.Stats(),
	}
	m.Journal.Nodes = nil
	m.XDS.Proxies, m.XDS.LastNACK = nil, nil
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for line := range strings.SplitSeq(string(b), "\n") {
			k, v, ok := strings.Cut(line, ":")
			if !ok || (k != "VmRSS" && k != "VmHWM") {
				continue
			}
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			if k == "VmRSS" {
				m.RSSMB = kb / 1024
			} else {
				m.HWMMB = kb / 1024
			}
		}
	}
	return m
}

func mb(b uint64) float64 { return float64(b) / (1 << 20) }

// serve is the child: the control plane's xDS port, and a /mem endpoint for the parent.
func serve(f flags) error {
	x := &index{log: journal.NewLog(0), seqs: make([]uint64, f.blocks)}
	for i := range x.seqs {
		seq := rand.Uint64()
		x.seqs[i] = seq
		x.set.Add(seq, int(seq%uint64(f.workers)), blockset.GPU)
	}
	jsrv := journal.NewServer(x.log, x, journal.ServerOptions{})
	xsrv := xdsserver.New(xdsserver.Options{ShutdownGrace: 100 * time.Millisecond})
	xdsv1.RegisterIndexJournalServer(xsrv.GRPC(), jsrv)
	ws := make([]*xdsv1.Worker, f.workers)
	for i := range ws {
		ws[i] = xds.NewWorker(fmt.Sprintf("w%04d", i), fmt.Sprintf("http://127.0.0.1:%d", 9000+i), "Qwen/Qwen3-0.6B")
		ws[i].Slot, ws[i].BlockSize, ws[i].Engine, ws[i].Load = uint32(i), 16, "sim", &xdsv1.Load{}
	}
	if err := xsrv.SetWorkers(ws); err != nil {
		return err
	}
	if err := xsrv.SetPolicy(xds.DefaultPolicy()); err != nil {
		return err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		if err := xsrv.Serve(ctx, lis); err != nil {
			log.Print(err)
		}
	}()
	go func() { // churn: the index changes, and workers' load is republished
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for i := 0; ; i++ {
			<-t.C
			x.replace(max(f.churn/200, 1), f.workers)
			if i%10 == 0 {
				up := make([]*xdsv1.Worker, len(ws))
				for j, w := range ws {
					w = proto.Clone(w).(*xdsv1.Worker)
					w.Load = &xdsv1.Load{Running: uint32(rand.N(32)), Waiting: uint32(rand.N(8))}
					up[j] = w
				}
				if err := xsrv.UpdateWorkers(up, nil); err != nil {
					log.Print(err)
				}
			}
		}
	}()
	mux := http.NewServeMux()
	mux.HandleFunc("/mem", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("gc") != "" {
			runtime.GC()
		}
		json.NewEncoder(w).Encode(readMem(jsrv, xsrv))
	})
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	go http.Serve(hl, mux)
	fmt.Printf("xds=%s mem=%s\n", lis.Addr(), hl.Addr())
	io.Copy(io.Discard, os.Stdin) // the parent closes stdin to stop the child
	return nil
}

func attack(f flags) error {
	child := exec.Command(os.Args[0], "-role", "serve", "-blocks", strconv.Itoa(f.blocks),
		"-workers", strconv.Itoa(f.workers), "-churn", strconv.Itoa(f.churn))
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		return err
	}
	out, err := child.StdoutPipe()
	if err != nil {
		return err
	}
	if err := child.Start(); err != nil {
		return err
	}
	defer func() { stdin.Close(); child.Wait() }()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return fmt.Errorf("reading the child's addresses: %w", err)
	}
	var xdsAddr, memAddr string
	if _, err := fmt.Sscanf(line, "xds=%s mem=%s", &xdsAddr, &memAddr); err != nil {
		return fmt.Errorf("parsing %q: %w", line, err)
	}
	get := func(gc bool) (mem, error) {
		u := "http://" + memAddr + "/mem"
		if gc {
			u += "?gc=1"
		}
		resp, err := http.Get(u)
		if err != nil {
			return mem{}, err
		}
		defer resp.Body.Close()
		var m mem
		return m, json.NewDecoder(resp.Body).Decode(&m)
	}
	print := func(phase string, m mem) {
		fmt.Printf("%-9s rss_mb=%.0f hwm_mb=%.0f heap_inuse_mb=%.0f heap_alloc_mb=%.0f sys_mb=%.0f goroutines=%d\n          journal=%+v\n          xds=%+v\n",
			phase, m.RSSMB, m.HWMMB, m.HeapInuseMB, m.HeapAllocMB, m.SysMB, m.Goroutines, m.Journal, m.XDS)
	}
	fmt.Printf("config blocks=%d workers=%d churn=%d/s journal=%d ads=%d sources=%d client=%s hold=%v after=%v\n",
		f.blocks, f.workers, f.churn, f.journal, f.ads, f.sources, f.client, f.hold, f.after)

	// An honest proxy first, so that the baseline includes one synced stream.
	honest := startHonest(xdsAddr, "honest-0")
	if d, ok := honest.wait(f.honestSyncBudget); !ok {
		return errors.New("the honest proxy did not sync before the attack")
	} else {
		fmt.Printf("honest    sync_before_ms=%d\n", d.Milliseconds())
	}
	time.Sleep(3 * time.Second)
	before, err := get(true)
	if err != nil {
		return err
	}
	print("before", before)

	var closers []func()
	var opened atomic.Int64
	src := func(i int) net.IP { return net.IPv4(127, 0, 0, byte(2+i%f.sources)) }
	switch f.client {
	case "raw":
		closers, err = openRaw(f, xdsAddr, src, &opened)
	case "grpc":
		closers, err = openGRPC(f, xdsAddr, src, &opened)
	default:
		err = fmt.Errorf("unknown client %q", f.client)
	}
	if err != nil {
		return err
	}
	fmt.Printf("opened    streams=%d conns=%d\n", opened.Load(), len(closers))
	if f.heapProfile != "" {
		go func() {
			time.Sleep(f.hold / 3)
			if err := fetch("http://"+memAddr+"/debug/pprof/heap", f.heapProfile); err != nil {
				log.Print(err)
			}
		}()
	}

	// A second honest proxy connects while the streams are open.
	time.Sleep(time.Second)
	late := startHonest(xdsAddr, "honest-1")
	lateSynced := make(chan time.Duration, 1)
	go func() {
		d, ok := late.wait(f.hold)
		if ok {
			lateSynced <- d
		}
	}()
	peak := before
	deadline := time.Now().Add(f.hold)
	synced := false
	for time.Now().Before(deadline) {
		time.Sleep(f.sample)
		m, err := get(false)
		if err != nil {
			return err
		}
		if m.RSSMB > peak.RSSMB {
			peak.RSSMB, peak.HWMMB = m.RSSMB, m.HWMMB
		}
		if m.HeapInuseMB > peak.HeapInuseMB {
			peak.HeapInuseMB, peak.HeapAllocMB, peak.SysMB = m.HeapInuseMB, m.HeapAllocMB, m.SysMB
		}
		peak.Goroutines = max(peak.Goroutines, m.Goroutines)
		if f.verbose && int(time.Until(deadline)/f.sample)%int(5*time.Second/f.sample) == 0 {
			print(fmt.Sprintf("t+%.0fs", (f.hold-time.Until(deadline)).Seconds()), m)
		}
		peak.Journal, peak.XDS = m.Journal, m.XDS
		select {
		case d := <-lateSynced:
			synced = true
			fmt.Printf("honest    sync_during_ms=%d\n", d.Milliseconds())
		default:
		}
	}
	if !synced {
		fmt.Printf("honest    sync_during_ms=none_within_%v\n", time.Since(late.start).Round(time.Second))
	}
	held, err := get(false)
	if err != nil {
		return err
	}
	print("peak", peak)
	print("held-end", held)
	for _, c := range closers {
		c()
	}
	time.Sleep(f.after)
	after, err := get(false)
	if err != nil {
		return err
	}
	print("after", after)
	afterGC, err := get(true)
	if err != nil {
		return err
	}
	print("after-gc", afterGC)
	st := honest.client.Stats()
	fmt.Printf("honest    streams=%d synced=%v batches=%d\n", st.Streams, st.Synced, st.Batches)
	honest.stop()
	late.stop()
	return nil
}

// honestProxy follows the journal like a proxy.
type honestProxy struct {
	client *journal.Client
	start  time.Time
	stop   func()
}

type countSink struct{ n atomic.Int64 }

func (s *countSink) Reset()                    { s.n.Store(0) }
func (s *countSink) Apply(cs []journal.Change) { s.n.Add(int64(len(cs))) }

func startHonest(addr, node string) *honestProxy {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	c := journal.NewClient(conn, journal.ClientOptions{NodeID: node})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { c.Run(ctx, &countSink{}); close(done) }()
	return &honestProxy{client: c, start: time.Now(), stop: func() { cancel(); <-done; conn.Close() }}
}

func (h *honestProxy) wait(budget time.Duration) (time.Duration, bool) {
	for time.Since(h.start) < budget {
		if h.client.Synced() {
			return time.Since(h.start), true
		}
		time.Sleep(10 * time.Millisecond)
	}
	return 0, false
}

const (
	journalPath = "/kvrelay.xds.v1.IndexJournal/Stream"
	adsPath     = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
)

func hello(i int) *xdsv1.JournalAck {
	return &xdsv1.JournalAck{NodeId: fmt.Sprintf("mute-j%d", i)}
}

func subscribe(i int, typ string) *discovery.DeltaDiscoveryRequest {
	return &discovery.DeltaDiscoveryRequest{Node: &core.Node{Id: fmt.Sprintf("mute-a%d", i)}, TypeUrl: typ, ResourceNamesSubscribe: []string{"*"}}
}

// openGRPC opens the streams with grpc-go, one connection per source address, granting
// 1 GiB windows so that the server's sends never wait on flow control; it never calls Recv.
func openGRPC(f flags, addr string, src func(int) net.IP, opened *atomic.Int64) ([]func(), error) {
	conns := make([]*grpc.ClientConn, f.sources)
	for i := range conns {
		ip := src(i)
		var err error
		conns[i], err = grpc.NewClient(addr,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithInitialWindowSize(1<<30), grpc.WithInitialConnWindowSize(1<<30),
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}}
				return d.DialContext(ctx, "tcp", a)
			}))
		if err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	for i := range f.journal {
		st, err := xdsv1.NewIndexJournalClient(conns[i%len(conns)]).Stream(ctx)
		if err != nil {
			cancel()
			return nil, fmt.Errorf("journal stream %d: %w", i, err)
		}
		if err := st.Send(hello(i)); err != nil {
			cancel()
			return nil, fmt.Errorf("journal stream %d: %w", i, err)
		}
		opened.Add(1)
	}
	for i := range f.ads {
		st, err := discovery.NewAggregatedDiscoveryServiceClient(conns[(f.journal+i)%len(conns)]).DeltaAggregatedResources(ctx)
		if err != nil {
			cancel()
			return nil, fmt.Errorf("ADS stream %d: %w", i, err)
		}
		for _, typ := range xds.TypeURLs() {
			if err := st.Send(subscribe(i, typ)); err != nil {
				cancel()
				return nil, fmt.Errorf("ADS stream %d: %w", i, err)
			}
		}
		opened.Add(1)
	}
	closers := []func(){cancel}
	for _, c := range conns {
		closers = append(closers, func() { c.Close() })
	}
	return closers, nil
}

// openRaw opens the streams over HTTP/2 written by hand: the client's SETTINGS grant the
// largest stream window and a WINDOW_UPDATE the largest connection window, each stream
// sends its first message(s), and nothing is ever read from the socket.
func openRaw(f flags, addr string, src func(int) net.IP, opened *atomic.Int64) ([]func(), error) {
	var closers []func()
	var c *rawConn
	n := 0
	open := func(path string, msgs ...proto.Message) error {
		if c == nil || c.streams >= f.streamsPerConn {
			var err error
			if c, err = dialRaw(addr, src(n)); err != nil {
				return err
			}
			cc := c.c
			closers = append(closers, func() { cc.Close() })
		}
		n++
		if err := c.open(path, msgs...); err != nil {
			return err
		}
		opened.Add(1)
		return nil
	}
	for i := range f.journal {
		if err := open(journalPath, hello(i)); err != nil {
			return closers, fmt.Errorf("journal stream %d: %w", i, err)
		}
	}
	for i := range f.ads {
		if err := open(adsPath, subscribe(i, xds.WorkerType), subscribe(i, xds.LoadsType), subscribe(i, xds.PolicyType)); err != nil {
			return closers, fmt.Errorf("ADS stream %d: %w", i, err)
		}
	}
	for i := range f.idleConns {
		z, err := dialRaw(addr, net.IPv4(127, 0, 0, byte(3+f.sources)))
		if err != nil {
			fmt.Printf("idle      opened=%d (%v)\n", i, err)
			break
		}
		closers = append(closers, func() { z.c.Close() })
	}
	if f.zombies > 0 {
		z, err := dialRaw(addr, net.IPv4(127, 0, 0, byte(2+f.sources)))
		if err != nil {
			return closers, err
		}
		closers = append(closers, func() { z.c.Close() })
		for i := range f.zombies {
			z.c.SetWriteDeadline(time.Now().Add(2 * time.Second))
			if err := z.open(journalPath, hello(i)); err != nil {
				fmt.Printf("zombies   opened=%d (%v)\n", i, err)
				break
			}
			opened.Add(1)
		}
	}
	return closers, nil
}

type rawConn struct {
	c       net.Conn
	addr    string
	next    uint32
	streams int
}

const (
	frameData         = 0x0
	frameHeaders      = 0x1
	frameSettings     = 0x4
	frameWindowUpdate = 0x8
	flagEndHeaders    = 0x4
	settingWindow     = 0x4
	maxWindow         = 1<<31 - 1
)

func dialRaw(addr string, ip net.IP) (*rawConn, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("dialing from %s: %w", ip, err)
	}
	var b []byte
	b = append(b, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"...)
	b = appendFrame(b, frameSettings, 0, 0, binary.BigEndian.AppendUint32([]byte{0, settingWindow}, maxWindow))
	b = appendFrame(b, frameWindowUpdate, 0, 0, binary.BigEndian.AppendUint32(nil, maxWindow-65535))
	if _, err := c.Write(b); err != nil {
		c.Close()
		return nil, err
	}
	return &rawConn{c: c, addr: addr, next: 1}, nil
}

func appendFrame(b []byte, typ, flags byte, stream uint32, payload []byte) []byte {
	n := len(payload)
	b = append(b, byte(n>>16), byte(n>>8), byte(n), typ, flags)
	b = binary.BigEndian.AppendUint32(b, stream)
	return append(b, payload...)
}

// appendHPACKInt appends an HPACK integer with a 7-bit prefix (no Huffman flag).
func appendHPACKInt(b []byte, v int) []byte {
	if v < 127 {
		return append(b, byte(v))
	}
	b = append(b, 127)
	for v -= 127; v >= 128; v >>= 7 {
		b = append(b, byte(v%128+128))
	}
	return append(b, byte(v))
}

func (r *rawConn) open(path string, msgs ...proto.Message) error {
	id := r.next
	r.next += 2
	r.streams++
	var hb []byte
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", path}, {":authority", r.addr},
		{"content-type", "application/grpc"}, {"te", "trailers"}} {
		hb = append(hb, 0) // literal without indexing, new name
		hb = append(appendHPACKInt(hb, len(kv[0])), kv[0]...)
		hb = append(appendHPACKInt(hb, len(kv[1])), kv[1]...)
	}
	b := appendFrame(nil, frameHeaders, flagEndHeaders, id, hb)
	for _, m := range msgs {
		p, err := proto.Marshal(m)
		if err != nil {
			return err
		}
		g := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(p)))
		b = appendFrame(b, frameData, 0, id, append(g, p...))
	}
	_, err := r.c.Write(b)
	return err
}

func fetch(url, file string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	out, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, resp.Body); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
