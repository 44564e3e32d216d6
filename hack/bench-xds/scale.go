package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/internal/loopback"
	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/client"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// runScale is the scale mode: W synthetic engines (a child process), R control-plane
// replicas (a child process each) that all ingest every engine's events and serve xDS, and
// P proxies' xDS sides (a child process) as counting sinks, each following the replica
// i mod R first and the others after it (a Service's pods, pick_first), each reporting its
// in-flight load for -report-workers workers every interval the control plane asks for. A
// steady load measures freshness, bytes and CPU; a second load kills replica 0 a third of
// the way in and measures how long its proxies take to converge on the others.
func runScale(f flags, res *results) error {
	batch, sample := synthParams(f)
	mask := uint64(1)<<uint(sample) - 1
	dir, err := os.MkdirTemp("", "bench-scale-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	eng, err := startEngines(f, dir)
	if err != nil {
		return err
	}
	defer eng.close()
	specsFile := filepath.Join(dir, "workers.json")
	b, _ := json.Marshal(eng.specs)
	if err := os.WriteFile(specsFile, b, 0o600); err != nil {
		return err
	}
	var reps []*child
	defer func() {
		for _, r := range reps {
			r.kill()
		}
	}()
	var addrs, apis []string
	for range f.replicas {
		a, err := loopback.FreeAddr()
		if err != nil {
			return err
		}
		apis = append(apis, a)
	}
	for i := range f.replicas {
		args := []string{"-mode", "replica", "-specs", specsFile, "-api", apis[i], "-load-push-budget", strconv.Itoa(f.loadBudget),
			"-scrape", f.scrape.String(), "-linger", f.linger.String(), "-out", filepath.Join(dir, "ages-"+strconv.Itoa(i))}
		switch f.share {
		case "none":
		case "polls", "all":
			args = append(args, "-share", f.share, "-peers", strings.Join(slices.Delete(slices.Clone(apis), i, i+1), ","))
		default:
			return fmt.Errorf("-share %q: none, polls or all", f.share)
		}
		if f.verbose {
			args = append(args, "-v") // the replica's control plane logs, on this process's stderr
		}
		r, err := startChildMode(fmt.Sprintf("replica %d", i), append(childProfile(f, "replica"+strconv.Itoa(i)), args...)...)
		if err != nil {
			return err
		}
		reps = append(reps, r)
		addrs = append(addrs, r.ready)
	}
	sinks, err := startChildMode("proxies", append(childProfile(f, "proxies"),
		"-mode", "sinks", "-xds", strings.Join(addrs, ","), "-proxies", strconv.Itoa(f.proxies),
		"-workers", strconv.Itoa(f.workers), "-report-workers", strconv.Itoa(f.reportWorkers), "-sample", strconv.Itoa(sample), "-models", strconv.Itoa(f.models), "-all-workers="+strconv.FormatBool(f.allWorkers),
		"-out", filepath.Join(dir, "arrivals"))...)
	if err != nil {
		return err
	}
	defer sinks.kill()
	res.add("setup", "mode", "scale", "rate", f.rate, "workers", f.workers, "proxies", f.proxies, "replicas", f.replicas, "models", f.models, "all_workers", f.allWorkers, "load_push_budget", f.loadBudget,
		"share", f.share, "batch", batch, "sampled", fmt.Sprintf("1/%d", mask+1), "duration", f.duration, "scrape", f.scrape,
		"report_workers_per_proxy", f.reportWorkers, "processes", fmt.Sprintf("engines|%d replicas|proxies", f.replicas))

	// Steady load.
	for _, r := range reps {
		if _, err := r.ask("report"); err != nil { // zero the replicas' counters
			return err
		}
	}
	// A proxy's connect: its ADS bytes until its workers and the policy were applied (loads
	// that moved meanwhile may have come too), and its journal until all were synced,
	// before the engines publish.
	l, err := sinks.ask("report")
	if err != nil {
		return err
	}
	var cs sinkStats
	if err := json.Unmarshal([]byte(l), &cs); err != nil {
		return fmt.Errorf("the proxies said %q", l)
	}
	var adsConnect, adsConnectMax, journalConnect uint64
	for _, s := range cs.Subs {
		adsConnect += s.ADSAtSync
		adsConnectMax = max(adsConnectMax, s.ADSAtSync)
		journalConnect += s.JournalBytes
	}
	res.add("connect_bytes_per_proxy", "ads", adsConnect/uint64(max(len(cs.Subs), 1)), "ads_max", adsConnectMax,
		"journal", journalConnect/uint64(max(len(cs.Subs), 1)))
	er, err := eng.run(f)
	if err != nil {
		return err
	}
	time.Sleep(time.Second) // let the last batches drain
	var repStats []replicaStats
	var ages []ageRec
	for i, r := range reps {
		l, err := r.ask("report")
		if err != nil {
			return err
		}
		var st replicaStats
		if err := json.Unmarshal([]byte(l), &st); err != nil {
			return fmt.Errorf("replica %d said %q", i, l)
		}
		repStats = append(repStats, st)
		a, err := readAges(filepath.Join(dir, "ages-"+strconv.Itoa(i)))
		if err != nil {
			return err
		}
		ages = append(ages, a...)
	}
	l, err = sinks.ask("report")
	if err != nil {
		return err
	}
	var ss sinkStats
	if err := json.Unmarshal([]byte(l), &ss); err != nil {
		return fmt.Errorf("the proxies said %q", l)
	}
	secs := er.LoadSeconds
	res.add("published", "blockstored", er.Stored, "blockstored_per_s", float64(er.Stored)/secs, "blockremoved", er.Removed,
		"messages", er.Messages, "dropped_by_publisher", er.Failed, "engines_cpu_cores", er.CPUSeconds/secs)
	for i, st := range repStats {
		res.add("replica", "replica", i, "cpu_cores", st.CPUSeconds/st.WallSeconds,
			"cpu_us_per_block_event", st.CPUSeconds*1e6/float64(max(er.Stored+er.Removed, 1)),
			"heap_after_gc", st.HeapAlloc, "rss", st.RSS, "index_blocks", st.IndexBlocks, "journal_streams", st.Streams,
			"events_ingested", st.Events, "gaps", st.Gaps, "stale", st.Stale,
			"scrapes_per_s", float64(st.Scrapes)/st.WallSeconds, "readings_taken_per_s", float64(st.Remote)/st.WallSeconds)
	}
	ds := make([]time.Duration, len(ages))
	for i, a := range ages {
		ds[i] = time.Duration(a.age)
	}
	p50, p99, mx := percentiles(ds)
	res.add("freshness", "what", "arrival at replica->send on each proxy stream (oldest change of each batch)", "rate", f.rate,
		"p50", p50, "p99", p99, "max", mx, "batches", len(ds), "target_p99", "50ms@100k/s")
	pubAt := make(map[uint64]int64, len(er.recs))
	for _, r := range er.recs {
		pubAt[r.seq] = r.at
	}
	arr, err := readArrivals(filepath.Join(dir, "arrivals"), f.proxies)
	if err != nil {
		return err
	}
	var all []time.Duration
	var lost int
	for _, recs := range arr {
		seen := map[uint64]bool{}
		for _, r := range recs {
			if at, ok := pubAt[r.seq]; ok && !seen[r.seq] {
				seen[r.seq] = true
				all = append(all, time.Duration(r.at-at))
			}
		}
		lost += len(pubAt) - len(seen)
	}
	p50, p99, mx = percentiles(all)
	// A scoped proxy (-models) is not sent other models' blocks: their samples count here too.
	lostKey := "lost"
	if f.models > 1 {
		lostKey = "lost_or_out_of_scope"
	}
	res.add("freshness_end_to_end", "what", "engine publish->proxy journal client", "p50", p50, "p99", p99, "max", mx,
		"samples", len(all), lostKey, lost)
	n := float64(max(len(ss.Subs), 1))
	var jb, ab, ob, sent uint64
	for _, s := range ss.Subs {
		jb += s.JournalBytes
		ab += s.ADSBytes
		ob += s.OtherBytes
		sent += s.SentBytes
	}
	// The journal moves while the engines publish; ADS (load pushes) and the reports all the time.
	w := ss.WallSeconds
	res.add("bytes_per_proxy", "journal_per_s", float64(jb)/n/secs, "ads_per_s", float64(ab)/n/w, "load_acks_per_s", float64(ob)/n/w,
		"reports_sent_per_s", float64(sent)/n/w, "journal_per_block_event", float64(jb)/n/float64(max(er.Stored+er.Removed, 1)),
		"window_s", w)
	blocks := 0
	for _, st := range repStats {
		blocks = max(blocks, st.IndexBlocks)
	}
	bpb, _ := replicaBytesPerBlock(max(blocks, 1), f.workers)
	res.add("proxy_memory", "how", "a prefix.Replica of the index's blocks over W slots, live heap after GC", "blocks", blocks,
		"bytes_per_block", bpb, "replica_bytes", bpb*float64(blocks), "sinks_cpu_cores_per_proxy", ss.CPUSeconds/ss.WallSeconds/n)

	if f.replicas < 2 {
		return nil
	}
	// Failover: replica 0 is killed a third of the way into a second load.
	type runOut struct {
		er  engineResult
		err error
	}
	done := make(chan runOut, 1)
	go func() { er, err := eng.run(f); done <- runOut{er, err} }()
	time.Sleep(f.duration / 3)
	killedAt := time.Now()
	reps[0].kill()
	l, err = sinks.ask("converge " + strconv.FormatInt(killedAt.UnixNano(), 10))
	if err != nil {
		return err
	}
	var cv convergence
	if err := json.Unmarshal([]byte(l), &cv); err != nil {
		return fmt.Errorf("the proxies said %q", l)
	}
	out := <-done
	if out.err != nil {
		return out.err
	}
	durs := func(ns []int64) []time.Duration {
		out := make([]time.Duration, len(ns))
		for i, d := range ns {
			out[i] = time.Duration(d)
		}
		return out
	}
	p50, p99, mx = percentiles(durs(cv.Moved))
	a50, _, amx := percentiles(durs(cv.ADS))
	j50, _, jmx := percentiles(durs(cv.Journal))
	slices.Sort(cv.JournalBytes)
	var b50, bmx uint64
	if n := len(cv.JournalBytes); n > 0 {
		b50, bmx = cv.JournalBytes[n/2], cv.JournalBytes[n-1]
	}
	res.add("failover", "killed", "replica 0 (SIGKILL) under load", "proxies_moved", len(cv.Moved), "not_converged", cv.NotConverged,
		"converged_p50", p50, "converged_p99", p99, "converged_all", mx, "target_all", "5s",
		"ads_p50", a50, "ads_all", amx, "journal_p50", j50, "journal_all", jmx,
		"resumed", cv.Resumed, "snapshotted", cv.Snapshotted, "journal_bytes_p50", b50, "journal_bytes_max", bmx,
		"what", "kill->journal current on another replica (resumed from the proxy's marks, or a snapshot complete) and ADS stream up; bytes: journal payload each moved proxy took from the kill until then")
	for _, d := range cv.Stuck {
		res.add("failover_stuck", "proxy", d)
	}
	return nil
}

// childProfile passes -cpuprofile on to a child as FILE.name, so that each process of the
// scale mode leaves its own profile (a replica that is killed leaves none).
func childProfile(f flags, name string) []string {
	if f.cpuProfile == "" {
		return nil
	}
	return []string{"-cpuprofile", f.cpuProfile + "." + name, "-cpuprofile-for", f.profileFor.String()}
}

// replicaStats is what a replica child reports for the window since its last report.
type replicaStats struct {
	CPUSeconds, WallSeconds float64
	HeapAlloc, RSS          uint64
	IndexBlocks             int
	Streams                 int
	Events, Gaps, Stale     uint64
	// Scrapes of the engines' metrics, and readings taken from another replica instead.
	Scrapes, Remote uint64
}

// sinkStats is what the proxies' child reports for the window since its last report.
type sinkStats struct {
	Subs                    []subStats
	CPUSeconds, WallSeconds float64
}

// convergence is the proxies' child's answer to "converge": for each proxy that followed
// the killed replica, nanoseconds from the kill until it was synced on another (Moved), and
// until each of its two streams was (ADS: a new stream connected; Journal: resumed or a
// snapshot completed).
type convergence struct {
	Moved, ADS, Journal []int64
	NotConverged        int
	// Resumed and Snapshotted count the moved proxies whose journal went on from their
	// marks or took a snapshot; JournalBytes is the journal payload each took from the kill
	// until its journal was current.
	Resumed, Snapshotted int
	JournalBytes         []uint64
	// Stuck describes, for each proxy not converged, what its streams were doing.
	Stuck []string
}

// ageRec is one journal batch sent: when, and how old its oldest change was.
type ageRec struct{ at, age int64 }

func readAges(path string) ([]ageRec, error) {
	recs, err := readRecs(path)
	if err != nil {
		return nil, err
	}
	out := make([]ageRec, len(recs))
	for i, r := range recs {
		out[i] = ageRec{at: r.at, age: int64(r.seq)}
	}
	return out, nil
}

// child is a child process of this binary speaking lines on stdin and stdout: the first
// line it prints is its ready message; each question gets one line back.
type child struct {
	name  string
	cmd   *exec.Cmd
	in    *bufio.Writer
	inF   interface{ Close() error }
	out   *bufio.Reader
	ready string
}

func startChildMode(name string, args ...string) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	c := &child{name: name, cmd: exec.Command(exe, args...)}
	c.cmd.Stderr = os.Stderr
	stdin, err := c.cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := c.cmd.Start(); err != nil {
		return nil, err
	}
	c.in, c.inF, c.out = bufio.NewWriter(stdin), stdin, bufio.NewReaderSize(stdout, 1<<20)
	l, err := c.out.ReadString('\n')
	if err != nil {
		c.kill()
		return nil, fmt.Errorf("%s did not start: %w", name, err)
	}
	c.ready = strings.TrimSpace(l)
	return c, nil
}

func (c *child) ask(q string) (string, error) {
	c.in.WriteString(q + "\n")
	if err := c.in.Flush(); err != nil {
		return "", fmt.Errorf("%s: %w", c.name, err)
	}
	l, err := c.out.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("%s: no answer to %q: %w", c.name, q, err)
	}
	return strings.TrimSpace(l), nil
}

// close ends the child's stdin and waits up to 5 s for it to exit, then kills it.
func (c *child) close() {
	if c.cmd.Process == nil || c.cmd.ProcessState != nil {
		return
	}
	c.inF.Close()
	done := make(chan struct{})
	go func() { _ = c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = c.cmd.Process.Kill()
		<-done
	}
}

func (c *child) kill() {
	if c.cmd.Process != nil && c.cmd.ProcessState == nil {
		_ = c.cmd.Process.Kill()
		_ = c.cmd.Wait()
	}
}

// runReplicaChild is a control-plane replica: a controlplane.Server on the workers of
// -specs, serving xDS on a loopback port it prints once started. On each "report" it writes
// the journal batches sent since the last report to -out (send time, age) and prints its
// counters for that window as JSON.
func runReplicaChild(f flags) error {
	b, err := os.ReadFile(f.specsFile)
	if err != nil {
		return err
	}
	var specs []registry.Worker
	if err := json.Unmarshal(b, &specs); err != nil {
		return err
	}
	dataDir, err := os.MkdirTemp("", "bench-scale-replica-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dataDir)
	var mu sync.Mutex
	recs := make([]pubRec, 0, 1<<20)
	var peers []string
	if f.peers != "" {
		peers = strings.Split(f.peers, ",")
	}
	cp, err := controlplane.New(controlplane.Options{
		XDSListen: "127.0.0.1:0", DataDir: dataDir, Workers: specs, Adapters: adapters(),
		APIListen: f.api, APIToken: "bench-xds", ReplicaPeers: peers, NoReplicaLoadShare: f.share == "polls",
		ScrapeInterval: f.scrape, JournalLinger: f.linger, LoadPushBudget: f.loadBudget, Logger: logger(f),
		JournalSent: func(age time.Duration) {
			now := time.Now().UnixNano()
			mu.Lock()
			recs = append(recs, pubRec{seq: uint64(age), at: now})
			mu.Unlock()
		},
	})
	if err != nil {
		return err
	}
	if err := cp.Start(context.Background()); err != nil {
		return err
	}
	defer cp.Close()
	fmt.Println(cp.XDSAddr())
	in := bufio.NewScanner(os.Stdin)
	cpu0, t0 := cpuSeconds(), time.Now()
	var ev0, gaps0, stale0, scr0, rem0 uint64
	for in.Scan() {
		if in.Text() != "report" {
			continue
		}
		mu.Lock()
		got := recs
		recs = make([]pubRec, 0, max(cap(got), 1<<20))
		mu.Unlock()
		if err := writeRecs(f.outFile, got); err != nil {
			return err
		}
		var ev, gaps, stale, scr, rem uint64
		for _, st := range cp.View().Stats() {
			scr += st.Scrapes
			rem += st.Remote
		}
		for _, w := range specs {
			if st := cp.Ingest().Stats(w.ID); st != nil {
				ev += st.Events.Load()
				gaps += st.Gaps.Load()
				stale += st.Stale.Load()
			}
		}
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		_, jsrv := cp.Journal()
		cpu1, t1 := cpuSeconds(), time.Now()
		st := replicaStats{CPUSeconds: cpu1 - cpu0, WallSeconds: t1.Sub(t0).Seconds(), HeapAlloc: ms.HeapAlloc, RSS: rss(),
			IndexBlocks: cp.Index().Len(), Streams: connected(jsrv), Events: ev - ev0, Gaps: gaps - gaps0, Stale: stale - stale0,
			Scrapes: scr - scr0, Remote: rem - rem0}
		cpu0, t0, ev0, gaps0, stale0, scr0, rem0 = cpu1, t1, ev, gaps, stale, scr, rem
		b, _ := json.Marshal(st)
		fmt.Println(string(b))
	}
	return nil
}

// connected counts the proxies with a journal stream open.
func connected(s *journal.Server) int {
	n := 0
	for _, st := range s.Stats().Nodes {
		if st.Connected {
			n++
		}
	}
	return n
}

// rss is the process's resident set in bytes (Linux).
func rss() uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			kb, _ := strconv.ParseUint(strings.Fields(l)[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// runSinksChild is the proxies: P counting-sink subscribers, proxy i dialling the replicas
// of -xds in the order i, i+1, … (mod R) with pick_first, each with a load reporter. It
// prints "ready" once all are synced; on "report" it writes the arrivals since the last
// report to -out and prints the window's counters; on "converge T" it waits for every proxy
// that followed replica 0 to be synced again on another and prints how long after T each
// took.
func runSinksChild(f flags) error {
	addrs := strings.Split(f.xds, ",")
	mask := uint64(1)<<uint(f.sample) - 1
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	var subs []*subscriber
	for i := range f.proxies {
		r := manual.NewBuilderWithScheme("replicas" + strconv.Itoa(i))
		var as []resolver.Address
		for k := range addrs {
			as = append(as, resolver.Address{Addr: addrs[(i+k)%len(addrs)]})
		}
		r.InitialState(resolver.State{Addresses: as})
		node := "proxy-" + strconv.Itoa(i)
		s, err := newSubscriber(r.Scheme()+":///replicas", node, mask, grpc.WithResolvers(r),
			grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"pick_first":{}}]}`),
			grpc.WithContextDialer(proxyDialer(i)))
		if err != nil {
			return err
		}
		s.sink.r = nil // a counting sink
		if f.models > 1 {
			// The proxy routes one model, as kvrelay proxy --serve-models does: its journal
			// stream is scoped to the model's workers, and its ADS client is sent their
			// workers and takes their loads.
			m := modelOf(f, i)
			named := []string{m}
			if f.allWorkers {
				named = nil
			}
			s.jc = journal.NewClient(s.conn, journal.ClientOptions{NodeID: node, Models: []string{m}, OnError: s.noteJournalError})
			if s.ads, err = client.New(s.conn, client.Options{NodeID: node, OnUpdate: func([]*xdsv1.Worker, *xdsv1.RoutingPolicy, xds.PushedLoads) {},
				Serves: func(w *xdsv1.Worker) bool { return w.GetModel() == m }, Models: named}); err != nil {
				return err
			}
		}
		subs = append(subs, s)
		loads := newLoadSource(i, f.workers, f.reportWorkers)
		rep, err := client.NewReporter(s.conn, client.ReporterOptions{NodeID: node, Snapshot: loads.next, Interval: 100 * time.Millisecond})
		if err != nil {
			return err
		}
		wg.Add(3)
		go func() { defer wg.Done(); _ = s.ads.Run(ctx) }()
		go s.noteSync(ctx)
		go func() { defer wg.Done(); _ = s.jc.Run(ctx, s.sink) }()
		go func() { defer wg.Done(); _ = rep.Run(ctx) }()
	}
	ss := &subscribers{subs: subs, cancel: cancel}
	if err := ss.waitSynced(180 * time.Second); err != nil {
		return err
	}
	fmt.Println("ready")
	before := make([]subStats, len(subs))
	cpu0, t0 := cpuSeconds(), time.Now()
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		q := strings.Fields(in.Text())
		if len(q) == 0 {
			continue
		}
		switch q[0] {
		case "report":
			cpu1, t1 := cpuSeconds(), time.Now()
			st := sinkStats{CPUSeconds: cpu1 - cpu0, WallSeconds: t1.Sub(t0).Seconds()}
			for i, s := range subs {
				now := s.snapshot()
				st.Subs = append(st.Subs, now.minus(before[i]))
				before[i] = now
			}
			if err := writeArrivals(f.outFile, ss); err != nil {
				return err
			}
			cpu0, t0 = cpu1, t1
			b, _ := json.Marshal(st)
			fmt.Println(string(b))
		case "converge":
			t, _ := strconv.ParseInt(q[1], 10, 64)
			b, _ := json.Marshal(converge(subs, addrs[0], t, 30*time.Second))
			fmt.Println(string(b))
		}
	}
	cancel()
	wg.Wait()
	return nil
}

// proxyDialer dials from a loopback address of proxy i's own (127.0.1.0/24 and on), as proxies
// on their own pods would: the replicas bound the connections one host holds
// (xds/server.DefaultMaxConnsPerPeer), and 100 proxies from 127.0.0.1 would pass it.
func proxyDialer(i int) func(context.Context, string) (net.Conn, error) {
	src := &net.TCPAddr{IP: net.IPv4(127, 0, byte(1+i/250), byte(1+i%250))}
	return func(ctx context.Context, addr string) (net.Conn, error) {
		d := net.Dialer{LocalAddr: src}
		return d.DialContext(ctx, "tcp", addr)
	}
}

// converge polls every millisecond until each proxy that followed replica 0 (at killed:
// its last connection opened before killedAt went there; mostly proxy i with i mod R == 0,
// but pick_first moves on to the next replica when the first is too busy to take it) has
// opened a new ADS stream that is connected and has its journal current on another replica
// (resumed from its marks, or a snapshot completed) after killedAt, or timeout.
func converge(subs []*subscriber, killed string, killedAt int64, timeout time.Duration) convergence {
	type st struct {
		i             int
		ads0          uint64
		adsAt, jourAt int64
		bytes0        uint64
	}
	var wait []*st
	for i, s := range subs {
		if s.bytes.addrAt(killedAt) == killed {
			wait = append(wait, &st{i: i, ads0: s.ads.Stats().Streams, bytes0: s.bytes.journalIn.Load()})
		}
	}
	var out convergence
	deadline := time.Now().Add(timeout)
	for len(wait) > 0 && time.Now().Before(deadline) {
		rest := wait[:0]
		for _, w := range wait {
			s := subs[w.i]
			// By the streams' own times: a proxy may have moved before this child read
			// the kill.
			if w.adsAt == 0 {
				w.adsAt = s.bytes.adsUpAfter(killedAt)
			}
			if w.jourAt == 0 && s.jc.Synced() {
				switch snap, res := s.sink.snapshotAt.Load(), s.sink.resumedAt.Load(); {
				case snap > killedAt:
					w.jourAt = snap
					out.Snapshotted++
				case res > killedAt:
					w.jourAt = res
					out.Resumed++
				}
				if w.jourAt != 0 {
					out.JournalBytes = append(out.JournalBytes, s.bytes.journalIn.Load()-w.bytes0)
				}
			}
			if w.adsAt != 0 && w.jourAt != 0 {
				out.Moved = append(out.Moved, max(w.adsAt, w.jourAt)-killedAt)
				out.ADS = append(out.ADS, w.adsAt-killedAt)
				out.Journal = append(out.Journal, w.jourAt-killedAt)
				continue
			}
			rest = append(rest, w)
		}
		wait = rest
		time.Sleep(time.Millisecond)
	}
	out.NotConverged = len(wait)
	for _, w := range wait {
		s := subs[w.i]
		as, js := s.ads.Stats(), s.jc.Stats()
		jerr := ""
		if e := s.jerr.Load(); e != nil {
			jerr = *e
		}
		out.Stuck = append(out.Stuck, fmt.Sprintf("%s: ads up=%v streams %d→%d last error %q; journal synced=%v streams %d snapshot or resume after the kill=%v last error %q",
			s.node, w.adsAt != 0, w.ads0, as.Streams, as.LastError, js.Synced, js.Streams, w.jourAt != 0, jerr))
	}
	for _, d := range [][]int64{out.Moved, out.ADS, out.Journal} {
		slices.Sort(d)
	}
	return out
}

// loadSource is one proxy's in-flight load: k workers of w (its own random subset), each
// with a few requests in flight, a tenth of them changing every report.
type loadSource struct {
	rng   *rand.Rand
	loads []*xdsv1.WorkerLoad
}

func newLoadSource(proxy, w, k int) *loadSource {
	l := &loadSource{rng: rand.New(rand.NewPCG(uint64(proxy)+1, 0x10ad))}
	for _, j := range l.rng.Perm(w)[:min(k, w)] {
		l.loads = append(l.loads, &xdsv1.WorkerLoad{WorkerId: "w" + strconv.Itoa(j), Inflight: uint32(1 + l.rng.IntN(4)),
			PrefillTokens: uint64(l.rng.IntN(8192)), DecodeBlocks: uint64(l.rng.IntN(512))})
	}
	return l
}

func (l *loadSource) next(uint64) []*xdsv1.WorkerLoad {
	out := make([]*xdsv1.WorkerLoad, len(l.loads))
	for i, x := range l.loads {
		if l.rng.IntN(10) == 0 {
			x = &xdsv1.WorkerLoad{WorkerId: x.WorkerId, Inflight: uint32(1 + l.rng.IntN(4)),
				PrefillTokens: uint64(l.rng.IntN(8192)), DecodeBlocks: uint64(l.rng.IntN(512))}
			l.loads[i] = x
		}
		out[i] = x
	}
	return out
}
