package ingest

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/internal/cputime"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// pipelineBatches are engine steps in vLLM's map encoding: each stores four chained
// 4-block prefixes (16 blocks, with their tokens) and removes the 16 blocks stored
// `live` steps earlier, so that cycling through them holds the index at a steady
// live·16 blocks.
func pipelineBatches(n, live int) (payloads [][]byte, blocks int) {
	hash := func(step, i int) kvevents.Hash { return kvevents.HashU64(uint64(step)<<8 | uint64(i) | 1<<40) }
	for s := range n {
		b := &kvevents.Batch{TS: float64(s), HasDPRank: true}
		for e := range 4 {
			toks := make([]uint32, 64)
			for j := range toks {
				toks[j] = uint32(s*256 + e*64 + j)
			}
			ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: 16, TokenIDs: toks, Medium: "GPU"}
			for i := range 4 {
				ev.BlockHashes = append(ev.BlockHashes, hash(s, e*4+i))
			}
			b.Events = append(b.Events, ev)
		}
		old := (s - live + n) % n
		rm := kvevents.Event{Kind: kvevents.BlockRemoved, Medium: "GPU"}
		for i := range 16 {
			rm.BlockHashes = append(rm.BlockHashes, hash(old, i))
		}
		b.Events = append(b.Events, rm)
		payloads = append(payloads, kvevents.AppendBatch(nil, b, kvevents.FormatMap))
	}
	return payloads, 32
}

// BenchmarkPipeline is the control plane's ingest of KV events: block events (stores and
// removals) per second through decoding, the index and the journal, and per second of CPU
// the process spent (blocks/cpu-s: on a machine whose cores the benchmark does not fill,
// the figure that scales with cores).
//   - decoded: the payloads decoded and applied on one goroutine, as a subscriber does
//     with each message it receives;
//   - zmq: published by a real publisher over loopback TCP and received by the manager's
//     own subscriber, the publisher's encoding and sending counted in the CPU time.
func BenchmarkPipeline(b *testing.B) {
	payloads, per := pipelineBatches(4096, 2048)
	b.Run("decoded", func(b *testing.B) {
		m := NewManager(kvindex.New(), journal.NewLog(1<<16), nil)
		defer m.Close()
		f := &follower{m: m, s: &subscription{ep: Endpoint{WorkerID: "w"}, stats: &Stats{}}}
		var dst kvevents.Batch
		cpu0 := cputime.Self()
		b.ReportAllocs()
		seq := uint64(0)
		for b.Loop() {
			if err := kvevents.DecodeBatchInto(&dst, payloads[seq%uint64(len(payloads))]); err != nil {
				b.Fatal(err)
			}
			f.emit(seq, &dst)
			seq++
		}
		blocks := float64(b.N * per)
		b.ReportMetric(blocks/b.Elapsed().Seconds(), "blocks/s")
		b.ReportMetric(blocks/(cputime.Self()-cpu0).Seconds(), "blocks/cpu-s")
	})
	b.Run("zmq", func(b *testing.B) {
		// The publisher runs in another process (this test binary, TestPipelinePublisher),
		// so that the CPU time counted is the control plane's alone.
		cmd := exec.Command(os.Args[0], "-test.run=^TestPipelinePublisher$", "-test.count=1")
		cmd.Env = append(os.Environ(), pipelineEnv+"="+strconv.Itoa(b.N))
		cmd.Stderr = os.Stderr
		stdin, _ := cmd.StdinPipe()
		stdout, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
		lines := bufio.NewScanner(stdout)
		if !lines.Scan() {
			b.Fatal("the publisher printed no endpoint")
		}
		m := NewManager(kvindex.New(), journal.NewLog(1<<16), nil)
		defer m.Close()
		m.Sync([]Endpoint{{WorkerID: "w", Address: lines.Text()}})
		deadline := time.Now().Add(10 * time.Second)
		for m.Stats("w") == nil || m.Stats("w").Batches.Load() == 0 {
			if time.Now().After(deadline) {
				b.Fatal("no kv events arrived")
			}
			time.Sleep(10 * time.Millisecond)
		}
		st := m.Stats("w")
		// The probes stop before the publisher reads "go"; let the last of them land.
		_, _ = io.WriteString(stdin, "go\n")
		for lines.Scan() && lines.Text() != "started" {
		}
		b.ResetTimer()
		cpu0 := cputime.Self()
		start := st.Batches.Load()
		_, _ = io.WriteString(stdin, "run\n")
		deadline = time.Now().Add(time.Minute)
		for st.Batches.Load()-start < uint64(b.N) {
			if st.Gaps.Load() > 0 || time.Now().After(deadline) {
				b.Fatalf("events lost: %s, %d of %d", st, st.Batches.Load()-start, b.N)
			}
			time.Sleep(time.Millisecond)
		}
		b.StopTimer()
		blocks := float64(b.N * per)
		b.ReportMetric(blocks/b.Elapsed().Seconds(), "blocks/s")
		b.ReportMetric(blocks/(cputime.Self()-cpu0).Seconds(), "blocks/cpu-s")
	})
}

// pipelineEnv tells TestPipelinePublisher how many batches to publish.
const pipelineEnv = "KVRELAY_PIPELINE_PUBLISH"

// TestPipelinePublisher is BenchmarkPipeline's publisher process: it binds a publisher,
// prints its endpoint, sends probes until told "go" on its input, prints "started" once the
// last probe has landed, and on "run" publishes the batches as fast as its queue takes them,
// without a loss.
func TestPipelinePublisher(t *testing.T) {
	n, err := strconv.Atoi(os.Getenv(pipelineEnv))
	if err != nil {
		t.Skip("BenchmarkPipeline's publisher process")
	}
	payloads, _ := pipelineBatches(4096, 2048)
	batches := make([]kvevents.Batch, len(payloads))
	for i, p := range payloads {
		if batches[i], err = kvevents.DecodeBatch(p); err != nil {
			t.Fatal(err)
		}
	}
	// One batch kept for replay, not an engine's 10,000: an engine publishes from another
	// machine, and here the ring's 13 MB would share the receiver's caches.
	pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", QueueSize: 1 << 14, HWM: 1 << 20, BufferSteps: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	fmt.Println(pub.Endpoint())
	in := bufio.NewScanner(os.Stdin)
	goCh := make(chan struct{})
	go func() {
		in.Scan()
		close(goCh)
	}()
	probe := batches[len(batches)-1]
probing:
	for {
		select {
		case <-goCh:
			break probing
		case <-time.After(10 * time.Millisecond):
			_ = pub.Publish(&probe)
		}
	}
	time.Sleep(50 * time.Millisecond)
	fmt.Println("started")
	in.Scan() // "run": the benchmark has counted what arrived so far
	for i := 0; i < n; {
		if pub.Publish(&batches[i%len(batches)]) != nil {
			time.Sleep(50 * time.Microsecond)
			continue
		}
		i++
	}
	in.Scan() // until the benchmark ends
}
