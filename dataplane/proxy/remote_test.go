package proxy

import (
	"context"
	"slices"
	"testing"

	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestRemoteTokenizeMatchesLocal: the ids an engine's /tokenize returns for a chat request
// are exactly those the in-process codec computes.
func TestRemoteTokenizeMatchesLocal(t *testing.T) {
	codec, err := sim.NewCodec("gpt-oss-120b", "", "")
	if err != nil {
		t.Fatal(err)
	}
	w, err := sim.NewWorker(sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	go w.Run(ctx)
	defer w.Close()

	s := decisionServer(t, 1)
	cc := &clientConn{srv: s, lp: newLoop(s, nil), kind: oai.ChatCompletions}
	cc.body = []byte(`{"model":"gpt-oss-120b","messages":[{"role":"system","content":"Be brief. Answer in French."},{"role":"user","content":"Quelle heure est-il ? 🕰️"},{"role":"assistant","content":"Il est midi."},{"role":"user","content":"Merci"}]}`)
	decide(t, cc)
	local := slices.Clone(cc.toks)

	body, err := tokenizeBody(&cc.oreq, cc.kind)
	if err != nil {
		t.Fatal(err)
	}
	remote, err := s.remote.fetch(ctx, &route.Worker{ID: "w", URL: w.URL()}, body)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(local, remote) {
		t.Fatalf("in-process %d ids, remote %d ids", len(local), len(remote))
	}
}
