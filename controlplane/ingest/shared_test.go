package ingest

import (
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/sim/simtest"
	"github.com/kvrelay/kvrelay/internal/loopback"
	"github.com/kvrelay/kvrelay/xds/journal"
)

func freePort(t *testing.T) string {
	t.Helper()
	a, err := loopback.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// startConnectingSim runs a simulated worker on listen whose KV event publisher connects out
// to endpoint with the given topic.
func startConnectingSim(t *testing.T, listen, endpoint, topic string) *sim.Worker {
	t.Helper()
	return simtest.Worker(t, "gpt-oss-120b", func(cfg *sim.WorkerConfig) {
		cfg.Listen = listen
		cfg.Events = kvevents.PublisherConfig{Endpoint: endpoint, Connect: true, Topic: topic}
		cfg.Engine.NumGPUBlocks = 4096
	})
}

// TestSharedBoundEndpoint: four engines' publishers connect to one endpoint the control
// plane binds, each with its topic (two given, two derived as kv@<host:port>@<model>, one of
// them with the model unknown); a fifth publisher's topic nobody claims. Every engine's
// blocks land on its own worker only, the interleaved sequence numbers of different
// publishers are neither gaps nor restarts, and the stranger's messages are counted and
// dropped.
func TestSharedBoundEndpoint(t *testing.T) {
	const model = "gpt-oss-120b"
	bind := "tcp://" + freePort(t)
	idx := kvindex.New()
	m := NewManager(idx, journal.NewLog(1<<16), nil)
	defer m.Close()

	var eps []Endpoint
	var sims []*sim.Worker
	for i := range 4 {
		listen := freePort(t)
		url := "http://" + listen
		ep := Endpoint{WorkerID: "w" + string(rune('0'+i)), Address: bind, Bind: true}
		switch i {
		case 0, 1:
			ep.Topic, ep.TopicGiven = "engine-"+ep.WorkerID, true
		case 2:
			ep.Topic = DefaultTopic(url, model)
		case 3:
			ep.Topic = DefaultTopic(url, "") // model not known yet: any model
		}
		eps = append(eps, ep)
		topic := ep.Topic
		if i == 3 {
			topic = DefaultTopic(url, model)
		}
		if i >= 2 && !strings.HasPrefix(topic, "kv@127.0.0.1:") {
			t.Fatalf("derived topic %q", topic)
		}
		sims = append(sims, startConnectingSim(t, listen, bind, topic))
	}
	m.Sync(eps)
	stranger := startConnectingSim(t, freePort(t), bind, "kv@10.9.9.9:8000@"+model)

	// Each engine serves prompts of its own until their blocks show up in the index (what a
	// publisher sends before its connection is up is lost, so each try is a new prompt).
	prompts := make([][]uint64, len(sims))
	deadline := time.Now().Add(15 * time.Second)
	for i, w := range sims {
		for try := 0; ; try++ {
			toks := complete(t, w, words(100*i+try, 200))
			prompts[i] = blockhash.Seq(toks, 16, nil)
			overlap := make([]float64, 8)
			idx.Match(prompts[i], overlap, kvindex.DefaultWeights)
			if overlap[idx.Slot(eps[i].WorkerID)] > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no events of %s reached the index: %s", eps[i].WorkerID, m.Stats(eps[i].WorkerID))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	// The stranger's prompt is served and its events published, but nobody claims them.
	for try := 0; m.Unclaimed()[bind] == 0; try++ {
		complete(t, stranger, words(1000+try, 200))
		if time.Now().After(deadline) {
			t.Fatal("the stranger's messages were not counted as unclaimed")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Another round on every engine, interleaving the publishers' sequence numbers.
	for i, w := range sims {
		complete(t, w, words(2000+i, 100))
	}
	time.Sleep(300 * time.Millisecond)

	for i := range sims {
		overlap := make([]float64, 8)
		idx.Match(prompts[i], overlap, kvindex.DefaultWeights)
		for j, ep := range eps {
			got := overlap[idx.Slot(ep.WorkerID)]
			if want := float64(len(prompts[i])); j == i && got != want {
				t.Errorf("prompt of w%d: %s holds %v blocks, want %v", i, ep.WorkerID, got, want)
			} else if j != i && got != 0 {
				t.Errorf("prompt of w%d credited to %s (%v blocks)", i, ep.WorkerID, got)
			}
		}
	}
	for _, ep := range eps {
		st := m.Stats(ep.WorkerID)
		if st.Restarts.Load() != 0 || st.Gaps.Load() != 0 || st.Stale.Load() != 0 {
			t.Errorf("%s: %s, want no gaps or restarts", ep.WorkerID, st)
		}
		if st.Batches.Load() == 0 {
			t.Errorf("%s received nothing", ep.WorkerID)
		}
	}
	// A worker leaving stops nothing for the others: the endpoint stays bound.
	m.Sync(eps[1:])
	if b := idx.Blocks("w0")[kvindex.GPU]; b != 0 {
		t.Fatalf("w0 removed but %d of its blocks remain", b)
	}
	toks := complete(t, sims[1], words(3000, 100))
	hs := blockhash.Seq(toks, 16, nil)
	for {
		overlap := make([]float64, 8)
		idx.Match(hs, overlap, kvindex.DefaultWeights)
		if overlap[idx.Slot("w1")] == float64(len(hs)) {
			break
		}
		if time.Now().After(deadline.Add(5 * time.Second)) {
			t.Fatalf("after w0 left, w1's events stopped: %s", m.Stats("w1"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
