package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/controlplane"
	"github.com/kvrelay/kvrelay/controlplane/registry"
	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// runIngest is the freshness and pushcost modes: W synthetic engines publishing KV events
// at the given rate, a control plane subscribed to them, and P subscribers following its
// index journal (and ADS) like proxies.
func runIngest(f flags, res *results) error {
	batch, sample := synthParams(f)
	mask := uint64(1)<<uint(sample) - 1
	lg := logger(f)

	dataDir, err := os.MkdirTemp("", "bench-xds-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dataDir)
	eng, err := startEngines(f, dataDir)
	if err != nil {
		return err
	}
	defer eng.close()
	cp, err := controlplane.New(controlplane.Options{
		XDSListen: "127.0.0.1:0", DataDir: dataDir, Workers: eng.specs, Adapters: adapters(),
		ScrapeInterval: 100 * time.Millisecond, JournalLinger: f.linger, Logger: lg,
	})
	if err != nil {
		return err
	}
	if err := cp.Start(context.Background()); err != nil {
		return err
	}
	defer cp.Close()
	jlog, jsrv := cp.Journal()
	tap := startTap(jlog, mask)
	defer tap.stop()

	// The subscribers: a child process (so that its CPU is the proxies' alone), or here.
	var child *childProc
	var local *subscribers
	var localBefore []subStats
	where := "separate-processes(engines|control-plane|proxies)"
	if f.inProcess {
		where = "one-process"
		local, err = startSubscribers(cp.XDSAddr(), "bench", f.proxies, mask)
		if err != nil {
			return err
		}
		defer local.stop()
		if err := local.waitSynced(30 * time.Second); err != nil {
			return err
		}
		for _, s := range local.subs {
			localBefore = append(localBefore, s.snapshot())
		}
	} else {
		child, err = startChild(cp.XDSAddr(), f.proxies, sample, dataDir)
		if err != nil {
			return err
		}
		defer child.kill()
	}

	runtime.GC()
	cpu0, t0 := cpuSeconds(), time.Now()
	er, err := eng.run(f)
	if err != nil {
		return err
	}
	loadEnd := time.Now()
	stored, removed, messages, failed, pubBytes := er.Stored, er.Removed, er.Messages, er.Failed, er.Bytes
	drained := waitDrained(cp, jsrv, jlog, eng.specs, messages, 60*time.Second)
	drainDur := time.Since(loadEnd)
	cpuParent := cpuSeconds() - cpu0
	window := time.Since(t0)
	tapRecs := tap.stop()

	var subs []subStats
	var childRes childResult
	if child != nil {
		childRes, subs, err = child.finish(f.proxies)
		if err != nil {
			return err
		}
	} else {
		local.cancel()
		local.wg.Wait()
		for i, s := range local.subs {
			st := s.snapshot().minus(localBefore[i])
			st.arrivals = s.sink.take()
			subs = append(subs, st)
		}
	}

	// Publish times of the sampled blocks.
	pubAt := make(map[uint64]int64, len(er.recs))
	for _, r := range er.recs {
		pubAt[r.seq] = r.at
	}
	secs := er.LoadSeconds
	res.add("setup", "mode", f.mode, "rate", f.rate, "workers", f.workers, "proxies", f.proxies,
		"batch", batch, "sampled", fmt.Sprintf("1/%d", mask+1), "processes", where,
		"duration", time.Duration(secs*float64(time.Second)), "max_blocks", f.maxBlocks, "drained", drained)
	res.add("published", "blockstored", stored, "blockstored_per_s", float64(stored)/secs,
		"blockremoved", removed, "messages", messages, "dropped_by_publisher", failed,
		"cp_index_blocks", cp.Index().Len(), "engines_cpu_cores", er.CPUSeconds/secs)
	var gaps, stale uint64
	for _, w := range eng.specs {
		if st := cp.Ingest().Stats(w.ID); st != nil {
			gaps += st.Gaps.Load()
			stale += st.Stale.Load()
		}
	}
	ist := cp.Index().Stats()
	what := "control_plane"
	if f.inProcess {
		what = "everything"
	}
	res.add("ingest", "gaps", gaps, "stale", stale, "orphans", ist.Orphans, "unknown_removals", ist.Unknown,
		"drain_after_load", drainDur, "cpu_of", what, "cpu_cores", cpuParent/window.Seconds(),
		"cpu_us_per_block_event", cpuParent*1e6/float64(max(stored+removed, 1)))

	// Publish → control plane journal (ZMQ, decode, index), from the tap.
	var cpLat []time.Duration
	for _, r := range tapRecs {
		if at, ok := pubAt[r.seq]; ok {
			cpLat = append(cpLat, time.Duration(r.at-at))
		}
	}
	p50, p99, mx := percentiles(cpLat)
	res.add("freshness_cp", "what", "publish->cp_journal", "p50", p50, "p99", p99, "max", mx, "samples", len(cpLat), "lost", len(pubAt)-len(cpLat))

	// Publish → proxy replica.
	var all []time.Duration
	type timed struct {
		pub int64
		d   time.Duration
	}
	var series []timed
	var lostAll, delivered uint64
	for _, s := range subs {
		seen := make(map[uint64]bool, len(s.arrivals))
		var ds []time.Duration
		for _, r := range s.arrivals {
			if at, ok := pubAt[r.seq]; ok && !seen[r.seq] {
				seen[r.seq] = true
				ds = append(ds, time.Duration(r.at-at))
				if f.timeline {
					series = append(series, timed{at, time.Duration(r.at - at)})
				}
			}
		}
		lost := len(pubAt) - len(ds)
		lostAll += uint64(lost)
		delivered += s.Stored
		all = append(all, ds...)
		if f.mode == "freshness" {
			p50, p99, mx := percentiles(ds)
			res.add("freshness_proxy", "node", s.Node, "p50", p50, "p99", p99, "max", mx, "samples", len(ds), "lost", lost,
				"delivered_per_s", float64(s.Stored)/secs, "resets", s.Resets, "nacks", s.Nacks)
		}
	}
	if f.timeline {
		buckets := map[int][]time.Duration{}
		var start int64 = 1<<63 - 1
		for _, t := range series {
			start = min(start, t.pub)
		}
		for _, t := range series {
			s := int((t.pub - start) / int64(time.Second))
			buckets[s] = append(buckets[s], t.d)
		}
		for s := 0; s < len(buckets); s++ {
			p50, p99, mx := percentiles(buckets[s])
			res.add("freshness_timeline", "second", s, "p50", p50, "p99", p99, "max", mx, "samples", len(buckets[s]))
		}
	}
	p50, p99, mx = percentiles(all)
	res.add("freshness", "what", "publish->replica", "rate", f.rate, "proxies", f.proxies, "p50", p50, "p99", p99, "max", mx,
		"samples", len(all), "lost", lostAll, "delivered_per_s_per_proxy", float64(delivered)/float64(max(len(subs), 1))/secs,
		"target_p99", "50ms@100k/s")

	if child != nil {
		n := float64(max(len(subs), 1))
		var applied uint64
		for _, s := range subs {
			applied += s.Applied
		}
		res.add("proxy_cpu", "how", "getrusage(process running only the subscribers)", "cpu_s", childRes.CPUSeconds,
			"window_s", childRes.WallSeconds, "load_s", secs, "cores_per_proxy", childRes.CPUSeconds/childRes.WallSeconds/n,
			"us_per_change", childRes.CPUSeconds*1e6/float64(max(applied, 1)), "changes_per_proxy", float64(applied)/n)
		var blocks int
		for _, s := range subs {
			blocks += s.ReplicaBlocks
		}
		res.add("proxy_heap", "heap_after_gc", childRes.HeapAlloc, "replica_blocks_all_proxies", blocks,
			"bytes_per_block", float64(childRes.HeapAlloc)/float64(max(blocks, 1)))
	}
	if f.mode != "pushcost" {
		return nil
	}
	blockEvents := stored + removed
	res.add("engine_bytes", "msgpack_bytes", pubBytes, "bytes_per_s", float64(pubBytes)/secs,
		"bytes_per_block_event", float64(pubBytes)/float64(max(blockEvents, 1)), "block_events", blockEvents)
	var sumJ, sumA uint64
	for _, s := range subs {
		b := s.JournalBytes + s.ADSBytes + s.OtherBytes
		sumJ += s.JournalBytes
		sumA += s.ADSBytes
		res.add("pushcost_proxy", "node", s.Node, "journal_bytes_per_s", float64(s.JournalBytes)/secs,
			"ads_bytes_per_s", float64(s.ADSBytes)/secs, "bytes_per_block_event", float64(b)/float64(max(blockEvents, 1)),
			"ratio_to_engine_bytes", float64(b)/float64(max(pubBytes, 1)), "journal_msgs_per_s", float64(s.JournalMsgs)/secs,
			"acks_sent_bytes_per_s", float64(s.SentBytes)/secs)
	}
	n := float64(max(len(subs), 1))
	res.add("pushcost", "bytes_per_proxy_per_s", float64(sumJ+sumA)/n/secs, "journal_share", float64(sumJ)/float64(max(sumJ+sumA, 1)),
		"bytes_per_block_event", float64(sumJ+sumA)/n/float64(max(blockEvents, 1)),
		"ratio_to_engine_bytes", float64(sumJ+sumA)/n/float64(max(pubBytes, 1)), "target_ratio", 2)
	bpb, blocks := replicaBytesPerBlock(1<<20, 64)
	res.add("replica_memory", "blocks", blocks, "slots", 64, "bytes_per_block", bpb, "target", 100)
	return nil
}

// waitDrained waits until the control plane has ingested every published event and every
// journal subscriber has acknowledged the whole journal.
func waitDrained(cp *controlplane.Server, jsrv *journal.Server, jlog *journal.Log, specs []registry.Worker, want uint64, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		var got uint64
		for _, w := range specs {
			if st := cp.Ingest().Stats(w.ID); st != nil {
				got += st.Batches.Load()
			}
		}
		if got >= want {
			next := jlog.Next()
			done := true
			for _, n := range jsrv.Stats().Nodes {
				if n.Connected && n.Acked < next {
					done = false
				}
			}
			if done {
				return true
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// tap follows the control plane's journal log in this process and stamps each sampled
// Stored change when it appears: the control plane's side of freshness.
type tap struct {
	cancel context.CancelFunc
	done   chan struct{}
	recs   []pubRec
	once   sync.Once
}

func startTap(l *journal.Log, mask uint64) *tap {
	ctx, cancel := context.WithCancel(context.Background())
	t := &tap{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(t.done)
		next := l.Next()
		var buf []journal.Change
		for {
			select {
			case <-ctx.Done():
				return
			case <-l.Wait(next):
			}
			now := time.Now().UnixNano()
			var ok bool
			buf, next, ok = l.Read(buf[:0], next, 1<<16)
			if !ok {
				next = l.Next()
				continue
			}
			for _, c := range buf {
				if c.Op == journal.Stored && c.Seq&mask == 0 {
					t.recs = append(t.recs, pubRec{seq: c.Seq, at: now})
				}
			}
		}
	}()
	return t
}

func (t *tap) stop() []pubRec {
	t.once.Do(func() { t.cancel(); <-t.done })
	return t.recs
}

// childProc is the subscriber process.
type childProc struct {
	cmd   *exec.Cmd
	stdin interface{ Close() error }
	out   *bufio.Reader
	file  string
}

func startChild(xds string, proxies, sample int, dir string) (*childProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	file := filepath.Join(dir, "arrivals.bin")
	cmd := exec.Command(exe, "-mode", "subscribe", "-xds", xds, "-proxies", strconv.Itoa(proxies),
		"-sample", strconv.Itoa(sample), "-out", file)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &childProc{cmd: cmd, stdin: stdin, out: bufio.NewReaderSize(stdout, 1<<20), file: file}
	ready := make(chan error, 1)
	go func() {
		l, err := c.out.ReadString('\n')
		if err == nil && l != "ready\n" {
			err = fmt.Errorf("subscriber process said %q", l)
		}
		ready <- err
	}()
	select {
	case err := <-ready:
		if err != nil {
			c.kill()
			return nil, err
		}
	case <-time.After(60 * time.Second):
		c.kill()
		return nil, errors.New("the subscriber process did not sync within 60s")
	}
	return c, nil
}

func (c *childProc) finish(n int) (childResult, []subStats, error) {
	var res childResult
	c.stdin.Close()
	l, err := c.out.ReadString('\n')
	if err != nil {
		return res, nil, fmt.Errorf("reading the subscriber process's result: %w", err)
	}
	if err := json.Unmarshal([]byte(l), &res); err != nil {
		return res, nil, err
	}
	_ = c.cmd.Wait()
	if res.Error != "" {
		return res, nil, errors.New(res.Error)
	}
	arr, err := readArrivals(c.file, n)
	if err != nil {
		return res, nil, err
	}
	subs := res.Subs
	for i := range subs {
		if i < len(arr) {
			subs[i].arrivals = arr[i]
		}
	}
	return res, subs, nil
}

func (c *childProc) kill() {
	if c.cmd.ProcessState == nil && c.cmd.Process != nil {
		_ = c.cmd.Process.Kill()
		_ = c.cmd.Wait()
	}
}

// replicaBytesPerBlock fills a prefix.Replica through its journal Apply with blocks random
// blocks spread over slots worker slots (one holder each) and returns the live heap it
// added per block, measured after GC.
func replicaBytesPerBlock(blocks, slots int) (float64, int) {
	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	r := prefix.NewReplica(blockset.DefaultWeights)
	rng := rand.New(rand.NewPCG(1, 2))
	cs := make([]journal.Change, 0, 8192)
	for i := range blocks {
		cs = append(cs, journal.Change{Seq: rng.Uint64(), Slot: uint32(i % slots), Tier: blockset.GPU, Op: journal.Stored})
		if len(cs) == cap(cs) {
			r.Apply(cs)
			cs = cs[:0]
		}
	}
	r.Apply(cs)
	cs = nil
	runtime.GC()
	runtime.ReadMemStats(&m1)
	n := r.Len()
	runtime.KeepAlive(r)
	return float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc)) / float64(n), n
}
