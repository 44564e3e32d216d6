package decide

import (
	"context"
	"strings"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/prefix"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// TestPickTellsTheWorkerToRecompute: when the chosen worker caches the prompt's first blocks
// in GPU memory and the rest on a disk too slow to load them back from, the body it gets
// says so in vLLM's terms (kv_transfer_params max_load_tokens 0), and the proxy counts it:
// routing on the replica alone, and on the replica overlaid with the proxy's own recent
// decisions, as a proxy fed by a control plane does.
func TestPickTellsTheWorkerToRecompute(t *testing.T) {
	for _, overlay := range []bool{false, true} {
		t.Run(map[bool]string{false: "replica", true: "overlay"}[overlay], func(t *testing.T) {
			testPickTellsTheWorkerToRecompute(t, overlay)
		})
	}
}

func testPickTellsTheWorkerToRecompute(t *testing.T, overlay bool) {
	ws := testWorkers(3)
	ws[0].Engine.KVBytesPerToken, ws[0].Engine.DiskBandwidth = 73728, 0.2e9
	c := newTestCore(t, testConfig(), testRouteConfig("latency"), ws)
	rep := prefix.NewReplica(blockset.DefaultWeights)
	rep.SetSlots([]int{0, 1, 2})
	var match prefix.Index = rep
	if overlay {
		match = prefix.NewOverlay(rep, c.Index())
	}
	if err := c.Build(c.Pool(), match, testRouteConfig("latency"), "local"); err != nil {
		t.Fatal(err)
	}
	body := []byte(`{"model":"gpt-oss-120b","messages":[{"role":"user","content":"` + strings.Repeat("the context of a long task ", 1200) + `"}],"max_tokens":4}`)
	hashes := prepared(t, c, body, "").rreq.Hashes
	if len(hashes) < 100 {
		t.Fatalf("%d blocks", len(hashes))
	}
	var cs []journal.Change
	for i, h := range hashes {
		tier := blockset.GPU
		if i >= len(hashes)/5 {
			tier = blockset.Disk
		}
		cs = append(cs, journal.Change{Seq: h, Slot: 0, Tier: tier, Op: journal.Stored})
	}
	rep.Apply(cs)
	p, err := c.Pick(context.Background(), &PickRequest{Path: "/v1/chat/completions", Body: body})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Finish()
	if p.WorkerID() != "w0" || !p.r.dec.Recompute {
		t.Fatalf("picked %s, recompute %v: want w0 computing what its disk holds", p.WorkerID(), p.r.dec.Recompute)
	}
	if !strings.Contains(string(p.Body()), `"kv_transfer_params":{"max_load_tokens":0}`) {
		t.Fatalf("forwarded body %.200s… lacks max_load_tokens 0", p.Body())
	}
}
