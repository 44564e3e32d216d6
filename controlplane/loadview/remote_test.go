package loadview

import (
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines"
)

// countingEngine is a fake vLLM engine and the count of its scrapes.
func countingEngine(t *testing.T) (*fakeEngine, *atomic.Int32) {
	var scrapes atomic.Int32
	f := newFakeEngine(t, func(w http.ResponseWriter) {
		scrapes.Add(1)
		_, _ = w.Write([]byte(vllmBody))
	})
	return f, &scrapes
}

// TestDelegatedTakesRemoteReadings: a worker another replica polls is not scraped while that
// replica's readings come, takes them (load, health, model) as soon as they come, shares none
// of them on (Polled), and is scraped again once they stop for RemoteMaxAge.
func TestDelegatedTakesRemoteReadings(t *testing.T) {
	f, scrapes := countingEngine(t)
	var delegate atomic.Bool
	opts := testOptions()
	opts.Delegated = func(id string) bool { return id == "w0" && delegate.Load() }
	opts.RemoteMaxAge = 200 * time.Millisecond
	v := newView(t, opts)
	v.Sync([]Target{{ID: "w0", URL: f.URL, Engine: engines.KindVLLM}})
	eventually(t, 2*time.Second, "the first scrape", func() bool { s, _ := v.Get("w0"); return s.Healthy && s.Model.ID == "m" })
	got, last := v.Polled(0)
	if len(got) != 1 || got[0].ID != "w0" || got[0].From != "" || got[0].Seq == 0 || got[0].Seq > last {
		t.Fatalf("Polled = %+v, %d: want w0 polled here, numbered", got, last)
	}
	if again, _ := v.Polled(last); len(again) != 0 {
		t.Fatalf("Polled after %d = %+v, want nothing newer", last, again)
	}

	delegate.Store(true)
	stop := make(chan struct{})
	done := make(chan struct{})
	remoteLoad := engines.Load{Running: 7, Waiting: 2, KVUsage: 0.5}
	var seq uint64
	go func() {
		defer close(done)
		for {
			now := time.Now()
			seq++
			v.PutRemote([]State{{ID: "w0", From: "cp-1", Seq: seq, Healthy: true, Load: remoteLoad, CheckedAt: now, ObservedAt: now},
				{ID: "unknown", From: "cp-1", Seq: seq, Healthy: true, CheckedAt: now}})
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	eventually(t, 2*time.Second, "the remote reading taken", func() bool { s, _ := v.Get("w0"); return s.From == "cp-1" })
	s, _ := v.Get("w0")
	if s.Load.Running != 7 || s.Load.Waiting != 2 || !s.Healthy || s.Model.ID != "m" || s.CapacityBlocks != 512 {
		t.Errorf("taken state %+v: want the remote load, healthy, and the model and capacity known here kept", s)
	}
	before := scrapes.Load()
	time.Sleep(300 * time.Millisecond) // 15 intervals
	if n := scrapes.Load() - before; n > 1 {
		t.Errorf("%d scrapes while another replica's readings came, want none (one in flight at most)", n)
	}
	if got, _ := v.Polled(0); len(got) != 0 {
		t.Errorf("Polled = %+v: another replica's readings are not shared on", got)
	}
	if st := v.Stats()["w0"]; st.Remote == 0 {
		t.Errorf("stats %+v count no remote reading", st)
	}
	if _, ok := v.Get("unknown"); ok {
		t.Error("a reading of a worker the view does not watch became a state")
	}

	// A remote reading that says unhealthy is taken too.
	close(stop)
	<-done
	// The poller takes a reading after PutRemote returns: wait for the last one sent.
	eventually(t, 2*time.Second, "the last remote reading taken", func() bool { s, _ := v.Get("w0"); return s.From == "cp-1" && s.Seq == seq })
	taken := v.Stats()["w0"].Remote
	now := time.Now()
	// The same reading again (its number) is not taken again.
	v.PutRemote([]State{{ID: "w0", From: "cp-1", Seq: seq, Healthy: true, Load: remoteLoad, CheckedAt: now}})
	time.Sleep(50 * time.Millisecond)
	if n := v.Stats()["w0"].Remote; n != taken {
		t.Errorf("a reading sent again was taken again (%d readings taken, %d before)", n, taken)
	}
	v.PutRemote([]State{{ID: "w0", From: "cp-1", Seq: seq + 1, Healthy: false, ConsecutiveFailures: 3, LastError: "refused", CheckedAt: now}})
	eventually(t, time.Second, "the remote unhealthy reading taken", func() bool { s, _ := v.Get("w0"); return !s.Healthy })
	// An older reading does not replace a newer one.
	v.PutRemote([]State{{ID: "w0", From: "cp-2", Healthy: true, CheckedAt: now.Add(-50 * time.Millisecond)}})
	time.Sleep(50 * time.Millisecond)
	if s, _ := v.Get("w0"); s.Healthy || s.From != "cp-1" {
		t.Errorf("an older reading replaced a newer one: %+v", s)
	}

	// The readings stop: the view polls the worker itself again.
	eventually(t, 2*time.Second, "polling again once the readings stopped", func() bool {
		s, _ := v.Get("w0")
		return s.From == "" && s.Healthy && s.Load.Running == 3
	})
}

// TestRemoteReadingsDoNotAddPolls: readings of a worker this view polls itself (another
// replica that polls it too, while the two disagree on who should) do not make it poll more
// often; a replica that restarted, numbering its readings from 1 again, is heard.
func TestRemoteReadingsDoNotAddPolls(t *testing.T) {
	f, scrapes := countingEngine(t)
	var delegate atomic.Bool
	opts := testOptions() // polls every 20 ms
	opts.Delegated = func(string) bool { return delegate.Load() }
	v := newView(t, opts)
	v.Sync([]Target{{ID: "w0", URL: f.URL, Engine: engines.KindVLLM}})
	eventually(t, 2*time.Second, "the first scrape", func() bool { s, _ := v.Get("w0"); return s.Healthy })
	before := scrapes.Load()
	start := time.Now()
	for seq := uint64(1); time.Since(start) < 300*time.Millisecond; seq++ {
		v.PutRemote([]State{{ID: "w0", From: "cp-1", Seq: seq, Healthy: true, CheckedAt: time.Now()}})
		time.Sleep(2 * time.Millisecond)
	}
	if n := scrapes.Load() - before; n > 20 {
		t.Errorf("%d scrapes in 300 ms at a 20 ms interval while another replica's readings came", n)
	}
	// The other replica restarts: its numbers start again, its readings are newer.
	delegate.Store(true)
	v.PutRemote([]State{{ID: "w0", From: "cp-1", Seq: 1, Healthy: true, Load: engines.Load{Running: 42}, CheckedAt: time.Now()}})
	eventually(t, time.Second, "the restarted replica's reading taken", func() bool { s, _ := v.Get("w0"); return s.Load.Running == 42 })
}
