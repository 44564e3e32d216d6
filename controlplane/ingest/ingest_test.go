package ingest

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/xds/journal"
)

func stored(first uint32, n int, parent uint64, hasParent bool, tag uint64) (kvevents.Event, []uint32) {
	toks := make([]uint32, 16*n)
	for i := range toks {
		toks[i] = first + uint32(i)
	}
	ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: 16, TokenIDs: toks}
	for i := range n {
		ev.BlockHashes = append(ev.BlockHashes, kvevents.HashU64(tag<<20|uint64(i)))
	}
	if hasParent {
		ev.Parent, ev.HasParent = kvevents.HashU64(parent), true
	}
	return ev, toks
}

func TestFollowerSequenceHandling(t *testing.T) {
	idx := kvindex.New()
	log := journal.NewLog(1024)
	m := NewManager(idx, log, nil)
	defer m.Close()
	f := &follower{m: m, s: &subscription{ep: Endpoint{WorkerID: "w"}, stats: &Stats{}}}
	ev1, toks1 := stored(100, 3, 0, false, 1)
	f.emit(0, &kvevents.Batch{Events: []kvevents.Event{ev1}})
	ev2, _ := stored(900, 2, 0, false, 2)
	f.emit(1, &kvevents.Batch{Events: []kvevents.Event{ev2}})
	if idx.Blocks("w")[kvindex.GPU] != 5 || log.Next() != 5 {
		t.Fatalf("blocks %v journal %d", idx.Blocks("w"), log.Next())
	}
	overlap := make([]float64, 1)
	if idx.Match(blockhash.Seq(toks1, 16, nil), overlap, kvindex.DefaultWeights); overlap[0] != 3 {
		t.Fatalf("overlap %v", overlap)
	}
	// Batches 2-4 are lost and there is no replay endpoint: the worker's blocks go, the
	// batch that revealed the gap applies.
	ev3, _ := stored(5000, 1, 0, false, 3)
	f.emit(5, &kvevents.Batch{Events: []kvevents.Event{ev3}})
	if f.s.stats.Gaps.Load() != 1 || f.s.stats.Stale.Load() != 1 || idx.Blocks("w")[kvindex.GPU] != 1 {
		t.Fatalf("after a gap: %s, blocks %v", f.s.stats, idx.Blocks("w"))
	}
	// The sequence goes back: the engine restarted.
	ev4, _ := stored(7000, 2, 0, false, 4)
	f.emit(0, &kvevents.Batch{Events: []kvevents.Event{ev4}})
	if f.s.stats.Restarts.Load() != 1 || idx.Blocks("w")[kvindex.GPU] != 2 {
		t.Fatalf("after a restart: %s, blocks %v", f.s.stats, idx.Blocks("w"))
	}
	// The journal replays into exactly the index's state.
	if n := checkJournalReplays(t, log, idx); n != idx.Len() {
		t.Fatalf("the index holds %d entries for %d blocks of one worker", n, idx.Len())
	}
}

// startSim runs a simulated worker publishing KV events (and replaying them).
func startSim(t *testing.T) *sim.Worker {
	t.Helper()
	codec, err := sim.NewCodec("gpt-oss-120b", "", "")
	if err != nil {
		t.Fatal(err)
	}
	cfg := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec,
		Events: kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}}
	cfg.Engine.NumGPUBlocks = 4096
	cfg.Engine.Timing.Speedup = 50
	w, err := sim.NewWorker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; w.Close() })
	return w
}

func complete(t *testing.T, w *sim.Worker, prompt string) []uint32 {
	t.Helper()
	body := fmt.Sprintf(`{"prompt":%q,"max_tokens":2}`, prompt)
	resp, err := http.Post(w.URL()+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	resp, err = http.Post(w.URL()+"/tokenize", "application/json", strings.NewReader(fmt.Sprintf(`{"prompt":%q}`, prompt)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct{ Tokens []uint32 }
	if err := jsonDecode(resp, &out); err != nil {
		t.Fatal(err)
	}
	return out.Tokens
}

func words(seed, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "word%d_%d ", seed, i)
	}
	return b.String()
}

// TestLiveWorkerWithLateStartReplay: the control plane starts after the engine has served a
// prompt; the replay buffer brings that prompt's blocks into the index, and new prompts
// follow live.
func TestLiveWorkerWithLateStartReplay(t *testing.T) {
	w := startSim(t)
	early := complete(t, w, words(1, 300))
	idx := kvindex.New()
	log := journal.NewLog(1 << 16)
	m := NewManager(idx, log, nil)
	defer m.Close()
	m.Sync([]Endpoint{{WorkerID: "w0", Address: w.EventsEndpoint(), Replay: w.ReplayEndpoint()}})
	overlap := make([]float64, 1)
	// New events only flow once the subscription is up; keep sending until one lands.
	deadline := time.Now().Add(10 * time.Second)
	var late []uint32
	for {
		late = complete(t, w, words(2, 200))
		idx.Match(blockhash.Seq(late, 16, nil), overlap, kvindex.DefaultWeights)
		if overlap[0] > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no live events reached the index: %s", m.Stats("w0"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if want := float64(len(late) / 16); overlap[0] != want {
		t.Fatalf("live prompt overlap %v, want %v", overlap[0], want)
	}
	idx.Match(blockhash.Seq(early, 16, nil), overlap, kvindex.DefaultWeights)
	if want := float64(len(early) / 16); overlap[0] != want {
		t.Fatalf("the prompt served before the control plane started: overlap %v, want %v (%s)", overlap[0], want, m.Stats("w0"))
	}
	if m.Stats("w0").Replays.Load() == 0 {
		t.Fatal("the late start should have replayed")
	}
	// Removing the worker drops its blocks and journals a clear.
	m.RemoveWorker("w0")
	if idx.Len() != 0 {
		t.Fatalf("%d blocks left after the worker was removed", idx.Len())
	}
}

func jsonDecode(resp *http.Response, v any) error { return json.NewDecoder(resp.Body).Decode(v) }
