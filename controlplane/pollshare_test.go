package controlplane

import (
	"bytes"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/loadview"
	"github.com/kvrelay/kvrelay/engines"
)

// TestPollerOf: every replica computes the same poller for an engine from the same set of
// replicas, whatever their order; engines spread over the replicas; an engine keeps its
// poller when a replica that did not poll it leaves.
func TestPollerOf(t *testing.T) {
	rs := []string{"cp-0", "cp-1", "cp-2"}
	count := map[string]int{}
	for i := range 3000 {
		id := "w" + strconv.Itoa(i)
		p := pollerOf(rs, id)
		if q := pollerOf([]string{"cp-2", "cp-0", "cp-1"}, id); q != p {
			t.Fatalf("%s: %s or %s by the order of the replicas", id, p, q)
		}
		count[p]++
		var rest []string
		for _, r := range rs {
			if r != p {
				rest = append(rest, r)
			}
		}
		// Without one of the others, p still polls it.
		if q := pollerOf([]string{p, rest[0]}, id); q != p {
			t.Fatalf("%s: polled by %s of %v, by %s once %s left", id, p, rs, q, rest[1])
		}
	}
	for _, r := range rs {
		if count[r] < 900 || count[r] > 1100 {
			t.Errorf("engines per replica %v: uneven", count)
		}
	}
}

// TestPollShareRanks: a replica delegates nothing alone, delegates the engines another
// sharing replica ranks first for, and takes them back once that replica is silent for
// replicaLoadMaxAge or says it no longer shares.
func TestPollShareRanks(t *testing.T) {
	var p pollShare
	p.self = "cp-0"
	if p.delegated("w1") {
		t.Fatal("alone, a replica delegates")
	}
	now := time.Now()
	p.heardFrom("cp-1", true, true, now)
	var theirs []string
	for i := range 100 {
		id := "w" + strconv.Itoa(i)
		if p.delegated(id) {
			if pollerOf([]string{"cp-0", "cp-1"}, id) != "cp-1" {
				t.Fatalf("%s delegated but cp-0 ranks first", id)
			}
			theirs = append(theirs, id)
		}
	}
	if len(theirs) < 30 || len(theirs) > 70 {
		t.Fatalf("%d of 100 engines delegated to the other replica", len(theirs))
	}
	p.heardFrom("cp-2", true, false, now.Add(100*time.Millisecond)) // an older replica, not sharing
	if !p.delegated(theirs[0]) {
		t.Error("a replica that does not share polls took an engine")
	}
	// cp-1 does not answer one ask in time: it still polls its engines.
	p.heardFrom("cp-1", false, false, now.Add(replicaLoadMaxAge-time.Millisecond))
	if !p.delegated(theirs[0]) {
		t.Error("an engine was taken back from a replica that missed one answer")
	}
	p.heardFrom("cp-2", true, false, now.Add(replicaLoadMaxAge+time.Millisecond))
	if p.delegated(theirs[0]) {
		t.Error("an engine stays delegated to a replica silent past replicaLoadMaxAge")
	}
	p.heardFrom("cp-1", true, true, now.Add(2*replicaLoadMaxAge))
	p.heardFrom("cp-1", false, false, now.Add(2*replicaLoadMaxAge+time.Millisecond))
	if !p.delegated(theirs[0]) {
		t.Error("an engine was taken back from a replica that missed one answer")
	}
	p.heardFrom("cp-1", true, false, now.Add(2*replicaLoadMaxAge))
	if p.delegated(theirs[0]) {
		t.Error("an engine stays delegated to a replica that stopped sharing")
	}
	// A replica that leaves the peers is asked no more: the loop's own ranking ages it out.
	p.heardFrom("cp-1", true, true, now.Add(3*replicaLoadMaxAge))
	p.heardFrom("", false, false, now.Add(4*replicaLoadMaxAge-time.Millisecond))
	if !p.delegated(theirs[0]) {
		t.Error("an engine was taken back from a replica heard within replicaLoadMaxAge")
	}
	p.heardFrom("", false, false, now.Add(4*replicaLoadMaxAge+time.Millisecond))
	if p.delegated(theirs[0]) {
		t.Error("an engine stays delegated to a replica no longer asked")
	}
}

// TestPolledWire: a state crosses the wire with its ages; readings that cannot be true are
// refused.
func TestPolledWire(t *testing.T) {
	now := time.Now()
	st := loadview.State{ID: "w0", Healthy: true, Load: engines.Load{Running: 3, Waiting: 1, KVUsage: 0.5},
		Model: engines.Model{ID: "m", IDs: []string{"m"}, MaxModelLen: 8192}, BlockSize: 16, CapacityBlocks: 512,
		CheckedAt: now.Add(-30 * time.Millisecond), ObservedAt: now.Add(-40 * time.Millisecond)}
	b, err := json.Marshal(toWire(st, now))
	if err != nil {
		t.Fatal(err)
	}
	var w polledWire
	if err := json.Unmarshal(b, &w); err != nil {
		t.Fatal(err)
	}
	later := now.Add(time.Second) // the answer arrives a second later by this host's clock
	got, ok := fromWire(w, "cp-1", later)
	if !ok || got.From != "cp-1" || got.Load != st.Load || got.Model.ID != "m" || got.CapacityBlocks != 512 ||
		later.Sub(got.CheckedAt) != 30*time.Millisecond || later.Sub(got.ObservedAt) != 40*time.Millisecond {
		t.Fatalf("across the wire %+v, ok %v; want %+v from cp-1 with its ages", got, ok, st)
	}
	never := toWire(loadview.State{ID: "w1", CheckedAt: now}, now)
	if got, ok := fromWire(never, "cp-1", now); !ok || !got.ObservedAt.IsZero() {
		t.Errorf("a never scraped engine: %+v, %v", got, ok)
	}
	for _, bad := range []func(*polledWire){
		func(w *polledWire) { w.ID = "" },
		func(w *polledWire) { w.CheckedAgo = -1 },
		func(w *polledWire) { w.Load.KVUsage = 2 },
		func(w *polledWire) { w.Load.Running = -1 },
		func(w *polledWire) { w.Failures = -3 },
	} {
		w := toWire(st, now)
		bad(&w)
		if _, ok := fromWire(w, "cp-1", now); ok {
			t.Errorf("%+v taken", w)
		}
	}
}

// BenchmarkPollShare: what sharing one engine's poll costs, per engine: the polling replica
// encodes it into its answer ("encode"), another decodes it and takes it as a reading
// ("decode"). Set beside loadview's BenchmarkScrape (one scrape of a simulated engine).
func BenchmarkPollShare(b *testing.B) {
	const engines = 1000
	now := time.Now()
	rl := replicaLoad{Replica: "cp-0", Workers: map[string][3]uint64{}, PollShare: true}
	for i := range engines {
		st := loadview.State{ID: "worker-" + strconv.Itoa(i), Healthy: true, Load: engineLoad(i),
			Model: engineModel, BlockSize: 16, CapacityBlocks: 30000, CheckedAt: now, ObservedAt: now}
		rl.Polls = append(rl.Polls, toWire(st, now))
	}
	raw, _ := json.Marshal(rl)
	b.Run("encode", func(b *testing.B) {
		var buf bytes.Buffer
		for b.Loop() {
			buf.Reset()
			if err := json.NewEncoder(&buf).Encode(rl); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/engines, "ns/engine")
		b.ReportMetric(float64(buf.Len())/engines, "bytes/engine")
	})
	b.Run("decode", func(b *testing.B) {
		for b.Loop() {
			var got replicaLoad
			if err := json.NewDecoder(bytes.NewReader(raw)).Decode(&got); err != nil {
				b.Fatal(err)
			}
			for _, w := range got.Polls {
				if _, ok := fromWire(w, got.Replica, now); !ok {
					b.Fatal(w)
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/engines, "ns/engine")
	})
}

var engineModel = engines.Model{ID: "Qwen/Qwen3-8B", IDs: []string{"Qwen/Qwen3-8B"}, MaxModelLen: 40960}

func engineLoad(i int) engines.Load {
	return engines.Load{Running: i % 64, Waiting: i % 7, KVUsage: float64(i%100) / 100, BlockSize: 16, CapacityBlocks: 30000,
		Found: engines.FieldRunning | engines.FieldWaiting | engines.FieldKVUsage}
}

// FuzzReplicaAnswer: whatever another replica answers at /v1/replica/load, decoding it never
// panics, and every poll taken from it names a worker, carries counts and a KV usage that can
// be true, and was checked no later than its arrival.
func FuzzReplicaAnswer(f *testing.F) {
	now := time.Now()
	st := loadview.State{ID: "w0", Healthy: true, Load: engineLoad(3), Model: engineModel, CheckedAt: now, ObservedAt: now}
	good, _ := json.Marshal(replicaLoad{Replica: "cp-1", Workers: map[string][3]uint64{"w0": {1, 2, 3}}, PollShare: true,
		Polls: []polledWire{toWire(st, now)}, Seq: 7})
	for _, s := range []string{string(good), `{}`, `{"replica":"cp-1","polls":[{"id":"w","checked_ago_us":-5,"observed_ago_us":-1}]}`,
		`{"replica":"cp-1","polls":[{"id":"w","load":{"kv_usage":1.5}}]}`, `{"polls":[{"id":"w"}]}`, `[]`, `null`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var rl replicaLoad
		if json.Unmarshal(b, &rl) != nil {
			return
		}
		at := time.Now()
		for _, w := range rl.Polls {
			got, ok := fromWire(w, "cp-1", at)
			if !ok {
				continue
			}
			if got.ID == "" || got.From != "cp-1" || got.Load.Running < 0 || got.Load.Waiting < 0 || got.ConsecutiveFailures < 0 ||
				!(got.Load.KVUsage >= 0 && got.Load.KVUsage <= 1) || got.BlockSize < 0 || got.CapacityBlocks < 0 || got.CheckedAt.After(at) {
				t.Fatalf("taken %+v from %+v", got, w)
			}
		}
	})
}
