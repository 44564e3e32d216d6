package decide

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// disaggCore is a routing core over a disaggregated pool: w0 and w1 prefill, w2 and w3
// decode.
func disaggCore(t *testing.T) *Core {
	t.Helper()
	ws := testWorkers(4)
	ws[0].Role, ws[1].Role, ws[2].Role, ws[3].Role = route.RolePrefill, route.RolePrefill, route.RoleDecode, route.RoleDecode
	return newTestCore(t, testConfig(), testRouteConfig("kv"), ws)
}

// disaggRequest is a prepared chat request of body on c; legs says its carrier sends the
// prefill leg itself.
func disaggRequest(t *testing.T, c *Core, body []byte, legs bool) *Request {
	t.Helper()
	r := &Request{}
	r.Init(c, new(route.Request), legs)
	r.Start(oai.ChatCompletions, nanotime(), false)
	if err := r.Parse(body); err != nil {
		t.Fatal(err)
	}
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := r.Prepare(); err != nil {
		t.Fatal(err)
	}
	return r
}

func paths(c *Core) (local, remote, fallback float64) {
	m := c.m.disagg
	return testutil.ToFloat64(m.WithLabelValues(pathLocal)), testutil.ToFloat64(m.WithLabelValues(pathRemote)), testutil.ToFloat64(m.WithLabelValues(pathFallback))
}

// TestDecideDisaggregated: both carriers' disaggregated requests take one decision. A long
// prompt gets a decode worker by load and a prefill worker; a pick's (no legs) is remote at
// once and holds the prefill worker until its first token, a proxy's (legs) goes remote
// once its leg succeeded, to a decode worker that then holds the whole prompt, and falls
// back to prefilling on the decode worker when the leg failed. A short prompt prefills on the
// decode worker.
func TestDecideDisaggregated(t *testing.T) {
	long := chat8k("a long prompt")
	t.Run("pick", func(t *testing.T) {
		c := disaggCore(t)
		r := disaggRequest(t, c, long, false)
		if err := r.Decide(nanotime(), false); err != nil {
			t.Fatal(err)
		}
		p := r.PrefillWorker()
		if p == nil || p.Role != route.RolePrefill || r.Decision().Worker.Role != route.RoleDecode || !r.Disaggregated() {
			t.Fatalf("prefill %v, decode %v", p, r.Decision().Worker)
		}
		if _, remote, _ := paths(c); remote != 1 {
			t.Fatalf("remote %v, want 1 at the decision", remote)
		}
		if p.Load() != 1 {
			t.Fatalf("the prefill worker holds %d requests, want the leg's 1", p.Load())
		}
		r.Dispatch(nanotime(), true)
		r.Answer(nanotime())
		r.Feed([]byte(`data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}`+"\n\n"), nanotime())
		if p.Load() != 0 {
			t.Fatalf("the prefill worker still holds %d after the first token", p.Load())
		}
		r.Settle(200, nanotime())
	})
	t.Run("proxy", func(t *testing.T) {
		c := disaggCore(t)
		r := disaggRequest(t, c, long, true)
		if err := r.Decide(nanotime(), false); err != nil {
			t.Fatal(err)
		}
		p := r.PrefillWorker()
		if p == nil {
			t.Fatal("no prefill leg for a long prompt")
		}
		if _, remote, _ := paths(c); remote != 0 {
			t.Fatalf("remote %v before the leg ran", remote)
		}
		r.HoldPrefill(nanotime())
		if p.Load() != 1 {
			t.Fatalf("the prefill worker holds %d during the leg", p.Load())
		}
		r.PrefillDone(true)
		if p.Load() != 0 {
			t.Fatalf("the prefill worker holds %d after the leg", p.Load())
		}
		if err := r.Decide(nanotime(), false); err != nil {
			t.Fatal(err)
		}
		if r.PrefillWorker() != nil || r.Decision().Worker.Role != route.RoleDecode || r.Decision().Overlap != float64(len(r.BlockHashes())) {
			t.Fatalf("after the leg: prefill %v, decode %v with overlap %v of %d", r.PrefillWorker(), r.Decision().Worker, r.Decision().Overlap, len(r.BlockHashes()))
		}
		if _, remote, _ := paths(c); remote != 1 {
			t.Fatalf("remote %v after the decode leg's decision, want 1", remote)
		}

		failed := disaggRequest(t, c, long, true)
		if err := failed.Decide(nanotime(), false); err != nil || failed.PrefillWorker() == nil {
			t.Fatalf("%v, prefill %v", err, failed.PrefillWorker())
		}
		failed.HoldPrefill(nanotime())
		failed.PrefillDone(false)
		if err := failed.Decide(nanotime(), false); err != nil || failed.PrefillWorker() != nil {
			t.Fatalf("after a failed leg: %v, prefill %v", err, failed.PrefillWorker())
		}
		if _, remote, fallback := paths(c); remote != 1 || fallback != 1 {
			t.Fatalf("remote %v, fallback %v; want 1 and 1", remote, fallback)
		}
	})
	t.Run("short", func(t *testing.T) {
		c := disaggCore(t)
		r := disaggRequest(t, c, []byte(`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"hi"}]}`), false)
		if err := r.Decide(nanotime(), false); err != nil {
			t.Fatal(err)
		}
		if r.PrefillWorker() != nil || r.Decision().Worker.Role != route.RoleDecode {
			t.Fatalf("a short prompt: prefill %v, decode %v", r.PrefillWorker(), r.Decision().Worker)
		}
		if local, _, _ := paths(c); local != 1 {
			t.Fatalf("local %v, want 1", local)
		}
	})
}

// TestDecideRefusesAPassedTTFTTarget: a request whose TTFT target has passed by the time it
// is decided is refused with 429, a disaggregated one before its prefill leg too.
func TestDecideRefusesAPassedTTFTTarget(t *testing.T) {
	for name, c := range map[string]*Core{"aggregated": decisionCore(t, 2), "disaggregated": disaggCore(t)} {
		t.Run(name, func(t *testing.T) {
			r := &Request{}
			r.Init(c, new(route.Request), true)
			r.Start(oai.ChatCompletions, nanotime()-int64(2e9), false) // complete 2 s ago
			r.SetHints(nil, nil, nil, []byte("500"), nil)
			if err := r.Parse(chat8k("late")); err != nil {
				t.Fatal(err)
			}
			if err := r.Prepare(); err != nil {
				t.Fatal(err)
			}
			var rf *Refusal
			if err := r.Decide(nanotime(), false); !errors.As(err, &rf) || rf.Status != 429 || rf.Code != "slo_unmet" || rf.RetryAfter < 1 {
				t.Fatalf("a request 2 s past its 500 ms TTFT target: %v", err)
			}
			if r.PrefillWorker() != nil {
				t.Fatal("a refused request was given a prefill leg")
			}
		})
	}
}

// TestPeerFetchParams: the pull instruction is vLLM's remote_kv_source, with the peer's host
// and numeric port and a fresh request id each time.
func TestPeerFetchParams(t *testing.T) {
	type source struct {
		KVRequestID string `json:"kv_request_id"`
		RemoteHost  string `json:"remote_host"`
		RemotePort  int    `json:"remote_port"`
	}
	seen := map[string]bool{}
	for addr, want := range map[string]source{
		"10.0.0.7:8000": {RemoteHost: "10.0.0.7", RemotePort: 8000},
		"[::1]:9":       {RemoteHost: "::1", RemotePort: 9},
		"gpu-3:31000":   {RemoteHost: "gpu-3", RemotePort: 31000},
	} {
		var got struct {
			Source source `json:"remote_kv_source"`
		}
		b := PeerFetchParams(addr)
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%s: %s: %v", addr, b, err)
		}
		if got.Source.RemoteHost != want.RemoteHost || got.Source.RemotePort != want.RemotePort || got.Source.KVRequestID == "" || seen[got.Source.KVRequestID] {
			t.Fatalf("%s: %s", addr, b)
		}
		seen[got.Source.KVRequestID] = true
	}
}

// TestDecideDisaggregatedPrefillSource: in a prefill pool whose workers can pull a prefix
// from a peer, a long prompt whose prefix the only prefill worker caching it cannot take now
// (its one slot busy) goes to the other prefill worker, told to pull that prefix from it
// rather than compute it (PrefillSource); with the holder free, it prefills there and pulls
// nothing; and a prefill leg that ended leaves no source behind.
func TestDecideDisaggregatedPrefillSource(t *testing.T) {
	ws := testWorkers(4)
	ws[0].Role, ws[1].Role, ws[2].Role, ws[3].Role = route.RolePrefill, route.RolePrefill, route.RoleDecode, route.RoleDecode
	for _, w := range ws[:2] {
		w.Engine.MaxNumSeqs, w.Engine.KVBytesPerToken, w.Engine.PeerBandwidth = 1, 73728, 50e9
	}
	c := newTestCore(t, testConfig(), testRouteConfig(route.PolicyLatency), ws)
	first := disaggRequest(t, c, chat8k("the first call"), true)
	if err := first.Decide(nanotime(), false); err != nil {
		t.Fatal(err)
	}
	holder := first.PrefillWorker()
	if holder == nil || first.PrefillSource() != nil {
		t.Fatalf("first call: prefill %v, source %v", holder, first.PrefillSource())
	}
	// The first call's leg runs: its worker caches the prompt, and is full until it ends.
	first.HoldPrefill(nanotime())
	c.Index().Record(holder.Index, first.BlockHashes(), 0)

	fork := disaggRequest(t, c, chat8k("a subagent forked from it"), true)
	if err := fork.Decide(nanotime(), false); err != nil {
		t.Fatal(err)
	}
	if p, src := fork.PrefillWorker(), fork.PrefillSource(); p == nil || p == holder || src != holder {
		t.Fatalf("with the holder full: prefill %v, source %v; want the other prefill worker pulling from %s", p, src, holder.ID)
	}
	fork.PrefillDone(true)
	if fork.PrefillSource() != nil {
		t.Fatal("a finished leg kept its source")
	}

	first.PrefillDone(true)
	again := disaggRequest(t, c, chat8k("another call"), true)
	if err := again.Decide(nanotime(), false); err != nil {
		t.Fatal(err)
	}
	if p, src := again.PrefillWorker(), again.PrefillSource(); p != holder || src != nil {
		t.Fatalf("with the holder free: prefill %v, source %v; want %s computing nothing it caches", p, src, holder.ID)
	}
}
