package decide

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/zeebo/xxh3"

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

	s := decisionCore(t, 1)
	cc := newChat(s)
	decideBody(t, cc, []byte(`{"model":"gpt-oss-120b","messages":[{"role":"system","content":"Be brief. Answer in French."},{"role":"user","content":"Quelle heure est-il ? 🕰️"},{"role":"assistant","content":"Il est midi."},{"role":"user","content":"Merci"}]}`))
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

func startTokenizer(t *testing.T) *sim.Worker {
	t.Helper()
	codec, err := sim.NewCodec("gpt-oss-120b", "", "")
	if err != nil {
		t.Fatal(err)
	}
	w, err := sim.NewWorker(sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: codec})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := w.Start(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = w.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; w.Close() })
	return w
}

// TestRemoteTokenizeToolCalls: an agent's conversation with tool calls and tool results
// tokenizes remotely exactly as in process: the /tokenize body carries them.
func TestRemoteTokenizeToolCalls(t *testing.T) {
	w := startTokenizer(t)
	s := decisionCore(t, 1)
	cc := newChat(s)
	body := []byte(`{"model":"gpt-oss-120b","reasoning_effort":"high","tools":[{"type":"function","function":{"name":"read_file","parameters":{"type":"object","properties":{"path":{"type":"string"}}}}}],` +
		`"messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"Fix the bug."},` +
		`{"role":"assistant","content":"Reading it.","tool_calls":[{"id":"call_1","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"main.go\"}"}}]},` +
		`{"role":"tool","tool_call_id":"call_1","content":"package main"}]}`)
	decideBody(t, cc, body)
	local := slices.Clone(cc.toks)
	tb, err := tokenizeBody(&cc.oreq, cc.kind)
	if err != nil {
		t.Fatal(err)
	}
	remote, err := s.remote.fetch(context.Background(), &route.Worker{ID: "w", URL: w.URL()}, tb)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(local, remote) {
		t.Fatalf("in-process %d ids, remote %d ids", len(local), len(remote))
	}
}

// TestRemoteTokenizeConversationPrefix: once a turn of a conversation was tokenized, the
// next turn is routed at once on those tokens (a true prefix of its own, less the generation
// prompt), with the new messages' length estimated, while its own tokens are fetched in the
// background for the turn after.
func TestRemoteTokenizeConversationPrefix(t *testing.T) {
	w := startTokenizer(t)
	cfg := testConfig()
	cfg.Tokenizer = TokenizerRemote
	worker := testWorkers(1)[0]
	worker.URL, worker.Addr = w.URL(), strings.TrimPrefix(w.URL(), "http://")
	s := newTestCore(t, cfg, testRouteConfig(""), []*route.Worker{worker})
	system := strings.Repeat("You review code carefully and explain every change. ", 60)
	turn1 := `{"model":"gpt-oss-120b","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"Review main.go"}]}`
	turn2 := `{"model":"gpt-oss-120b","messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"Review main.go"},` +
		`{"role":"assistant","content":"It looks fine."},{"role":"user","content":"And util.go?"}]}`

	fetchInto := func(body string) (*Request, []uint32) {
		cc := newChat(s)
		if err := cc.Parse([]byte(body)); err != nil {
			t.Fatal(err)
		}
		b, err := tokenizeBody(&cc.oreq, cc.kind)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := s.remote.fetch(context.Background(), s.kv.Pool().Workers[0], b)
		if err != nil {
			t.Fatal(err)
		}
		keys := conversationKeys(nil, &cc.oreq)
		s.remote.store(xxh3.Hash128(b), keys[len(keys)-1], ids)
		return cc, ids
	}
	fetchInto(turn1)
	_, full2 := fetchInto(turn2)
	s.remote.cache, s.remote.order, s.remote.tokens = map[xxh3.Uint128][]uint32{}, nil, 0
	fetchInto(turn1) // only the first turn is known again

	cc := newChat(s)
	if err := cc.Parse([]byte(turn2)); err != nil {
		t.Fatal(err)
	}
	if err := cc.Prepare(); err != nil {
		t.Fatalf("the second turn should route at once on the first turn's tokens: %v", err)
	}
	if s.remote.prefixHits.Load() != 1 || len(cc.toks) == 0 || !slices.Equal(cc.toks, full2[:len(cc.toks)]) {
		t.Fatalf("prefix hits %d: %d prefix ids are not the start of the turn's own %d", s.remote.prefixHits.Load(), len(cc.toks), len(full2))
	}
	if cc.rreq.PromptTokens <= len(cc.toks) || len(cc.rreq.Hashes) != len(cc.toks)/16 {
		t.Fatalf("prompt %d tokens over %d prefix ids, %d blocks", cc.rreq.PromptTokens, len(cc.toks), len(cc.rreq.Hashes))
	}
	// The turn's own tokens arrive in the background.
	b, _ := tokenizeBody(&cc.oreq, cc.kind)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if ids, ok := s.remote.get(xxh3.Hash128(b)); ok {
			if !slices.Equal(ids, full2) {
				t.Fatal("the background fetch stored other ids")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the turn's own tokens were not fetched in the background")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
