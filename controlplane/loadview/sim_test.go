package loadview

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestFollowsSimulatedWorkers watches two simulated engines: one is given more requests than
// it may run at once, the other stays idle, and the view must follow the busy one's running
// and waiting counts and its growing KV usage, and see it drain when the requests end.
func TestFollowsSimulatedWorkers(t *testing.T) {
	busy := startSim(t, "127.0.0.1:0", func(c *sim.WorkerConfig) {
		c.Engine.MaxNumSeqs = 2
		c.Engine.NumGPUBlocks = 16384
		c.Engine.Timing.Speedup = 20
	})
	idle := startSim(t, "127.0.0.1:0", nil)
	opts := testOptions()
	v := newView(t, opts)
	v.Sync([]Target{busy.target("busy"), idle.target("idle")})

	eventually(t, 5*time.Second, "both workers healthy with their model and cache geometry", func() bool {
		for _, id := range []string{"busy", "idle"} {
			s, ok := v.Get(id)
			if !ok || !s.Healthy || s.Model.ID != "sim-model" || s.BlockSize != 16 || s.CapacityBlocks == 0 {
				return false
			}
		}
		return true
	})
	if s, _ := v.Get("busy"); s.CapacityBlocks != 16384 || s.Load.Running != 0 || s.Load.KVUsage != 0 {
		t.Fatalf("busy worker before load: %+v", s)
	}
	drain(v.Changed())

	eng := busy.w.Engine()
	var reqs []*sim.Request
	for i := range 5 {
		prompt := make([]uint32, 64)
		for j := range prompt {
			prompt[j] = uint32(1000*i + j + 1)
		}
		r, err := eng.NewRequest(fmt.Sprintf("r%d", i), prompt, blockhash.Keys{}, sim.Params{MaxTokens: 100_000, IgnoreEOS: true})
		if err != nil {
			t.Fatal(err)
		}
		eng.Submit(r)
		reqs = append(reqs, r)
	}
	submitted := time.Now()
	select {
	case <-v.Changed():
	case <-time.After(5 * time.Second):
		t.Fatal("no change signalled after the busy worker took requests")
	}
	eventually(t, 5*time.Second, "engine schedules 2 and queues 3", func() bool {
		l := eng.Load()
		return l.Running == 2 && l.Waiting == 3
	})
	eventually(t, 5*time.Second, "view shows 2 running and 3 waiting", func() bool {
		s, _ := v.Get("busy")
		return s.Load.Running == 2 && s.Load.Waiting == 3
	})
	t.Logf("view showed 2 running, 3 waiting %v after the requests were submitted (interval %v)",
		time.Since(submitted).Round(time.Millisecond), opts.Interval)

	// KV usage grows as the two running requests decode; the view must keep up with it.
	first, _ := v.Get("busy")
	eventually(t, 10*time.Second, "view's KV usage grows by 2 points", func() bool {
		s, _ := v.Get("busy")
		return s.Load.KVUsage >= first.Load.KVUsage+0.02
	})
	got, _ := v.Get("busy")
	if truth := eng.Load().KVUsage; math.Abs(truth-got.Load.KVUsage) > 0.05 {
		t.Errorf("view's KV usage %.4f, engine's %.4f", got.Load.KVUsage, truth)
	}
	if !got.ObservedAt.After(first.ObservedAt) {
		t.Errorf("ObservedAt did not advance: %v then %v", first.ObservedAt, got.ObservedAt)
	}
	if s, _ := v.Get("idle"); s.Load.Running != 0 || s.Load.Waiting != 0 || s.Load.KVUsage != 0 {
		t.Errorf("idle worker shows load: %+v", s.Load)
	}

	for _, r := range reqs {
		eng.Abort(r)
	}
	eventually(t, 5*time.Second, "engine idle after aborts", func() bool {
		l := eng.Load()
		return l.Running == 0 && l.Waiting == 0
	})
	truth := eng.Load()
	eventually(t, 5*time.Second, "view idle after aborts", func() bool {
		s, _ := v.Get("busy")
		return s.Load.Running == 0 && s.Load.Waiting == 0 && s.Load.KVUsage == truth.KVUsage
	})

	st := v.Stats()
	for _, id := range []string{"busy", "idle"} {
		if s := st[id]; s.Scrapes == 0 || s.ScrapeFailures != 0 || s.Probes != 0 || !s.Healthy || s.Discoveries != 1 {
			t.Errorf("stats of %s: %+v", id, s)
		}
	}
}

// TestStoppedWorkerTurnsUnhealthyAndBack stops a worker, which must turn unhealthy after
// FailAfter failed polls and not before, then starts another engine on the same port, serving
// another model, which must turn healthy and be rediscovered.
func TestStoppedWorkerTurnsUnhealthyAndBack(t *testing.T) {
	w := startSim(t, "127.0.0.1:0", nil)
	addr := w.addr
	opts := testOptions()
	v := newView(t, opts)
	v.Sync([]Target{w.target("w1")})
	eventually(t, 5*time.Second, "worker healthy with its model", func() bool {
		s, _ := v.Get("w1")
		return s.Healthy && s.Model.ID == "sim-model"
	})
	before := v.Stats()["w1"]
	drain(v.Changed())

	w.stop(t)
	eventually(t, 5*time.Second, "worker unhealthy after it stopped", func() bool {
		s, _ := v.Get("w1")
		if !s.Healthy && s.ConsecutiveFailures < opts.FailAfter {
			t.Fatalf("unhealthy after %d failures, want %d", s.ConsecutiveFailures, opts.FailAfter)
		}
		if s.Healthy && s.ConsecutiveFailures >= opts.FailAfter {
			t.Fatalf("still healthy after %d failures", s.ConsecutiveFailures)
		}
		return !s.Healthy
	})
	s, _ := v.Get("w1")
	if s.LastError == "" || !strings.Contains(s.LastError, "probing health") {
		t.Errorf("LastError %q, want the scrape's and the probe's errors", s.LastError)
	}
	if s.Model.ID != "sim-model" || s.BlockSize != 16 {
		t.Errorf("an unhealthy worker keeps what was known: %+v", s)
	}
	st := v.Stats()["w1"]
	if got := st.ProbeFailures - before.ProbeFailures; got < uint64(opts.FailAfter) {
		t.Errorf("%d probe failures, want at least %d", got, opts.FailAfter)
	}
	if st.BecameUnhealthy != 1 || st.Healthy {
		t.Errorf("stats: %+v", st)
	}
	select {
	case <-v.Changed():
	default:
		t.Error("health flip not signalled")
	}

	startSim(t, addr, func(c *sim.WorkerConfig) {
		c.Engine.Model = "other-model"
		c.Engine.BlockSize = 32
	})
	eventually(t, 5*time.Second, "restarted worker healthy with its new model and block size", func() bool {
		s, _ := v.Get("w1")
		return s.Healthy && s.Model.ID == "other-model" && s.BlockSize == 32
	})
	if s, _ := v.Get("w1"); s.ConsecutiveFailures != 0 || s.LastError != "" {
		t.Errorf("after recovery: %+v", s)
	}
	if st := v.Stats()["w1"]; st.BecameHealthy != 2 || st.BecameUnhealthy != 1 || st.Discoveries != 2 {
		t.Errorf("stats after recovery: %+v", st)
	}
}

// TestDiscoversModelAndCacheGeometry reads a simulated worker's model, context length, block
// size and capacity.
func TestDiscoversModelAndCacheGeometry(t *testing.T) {
	w := startSim(t, "127.0.0.1:0", func(c *sim.WorkerConfig) {
		c.Engine.Model = "disc-model"
		c.Engine.BlockSize = 32
		c.Engine.NumGPUBlocks = 1000
		c.Engine.MaxModelLen = 4096
	})
	v := newView(t, testOptions())
	v.Sync([]Target{w.target("w")})
	eventually(t, 5*time.Second, "model and geometry discovered", func() bool {
		s, _ := v.Get("w")
		return s.Model.ID != "" && s.BlockSize != 0
	})
	s, _ := v.Get("w")
	want := engines.Model{ID: "disc-model", IDs: []string{"disc-model"}, MaxModelLen: 4096}
	if s.Model.ID != want.ID || s.Model.MaxModelLen != want.MaxModelLen || len(s.Model.IDs) != 1 || s.Model.IDs[0] != want.ID {
		t.Errorf("model %+v, want %+v", s.Model, want)
	}
	if s.BlockSize != 32 || s.CapacityBlocks != 1000 || s.Load.CapacityTokens != 32000 {
		t.Errorf("geometry: block size %d, capacity %d blocks, load %+v", s.BlockSize, s.CapacityBlocks, s.Load)
	}
	// The snapshot is a copy.
	snap := v.Snapshot()
	snap["w"].Model.IDs[0] = "scribbled"
	if s, _ := v.Get("w"); s.Model.IDs[0] != "disc-model" {
		t.Error("Snapshot shares the model's IDs with the view")
	}
}
