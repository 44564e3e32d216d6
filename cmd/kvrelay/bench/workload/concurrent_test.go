package workload

import (
	"bytes"
	"hash/fnv"
	"slices"
	"sync"
	"testing"
)

// contentAnswers answers with MaxTokens words seeded by the request body, so that a request
// gets the same answer whatever order requests are sent in.
func contentAnswers(tb testing.TB) answerer {
	v, err := vocabFor(testTokenizer(tb))
	if err != nil {
		tb.Fatal(err)
	}
	return func(req *Request, _ int) string {
		h := fnv.New64a()
		h.Write(req.Body("m", false))
		return v.text(newRNG(h.Sum64()), req.MaxTokens)
	}
}

// TestConcurrentRunner runs every session on its own goroutine, spawned subagents on theirs
// (the spawner waiting for them), as the bench runner does, and checks under the race
// detector that each session sends exactly what a sequential run sends.
func TestConcurrentRunner(t *testing.T) {
	tok := testTokenizer(t)
	for _, spec := range []string{
		"multi-turn:sessions=8,turns=3,system=20,user=5,osl=6",
		"agentic:sessions=6,preamble=80,task=10,turns=2,rounds=3,tool=20,subagents=3,sub_task=8,sub_rounds=2,reasoning=5,osl=7",
	} {
		t.Run(spec, func(t *testing.T) {
			answer := contentAnswers(t)
			seqW, err := Parse(spec, 21, tok)
			if err != nil {
				t.Fatal(err)
			}
			want := map[string][][]byte{}
			for _, r := range drive(t, seqW, answer, true) {
				want[r.Session] = append(want[r.Session], r.Body("m", false))
			}

			w, _ := Parse(spec, 21, tok)
			var mu sync.Mutex
			got := map[string][][]byte{}
			var run func(s Session, first string)
			run = func(s Session, first string) {
				prev := first
				for {
					req, ok := s.Next(prev)
					if !ok {
						return
					}
					mu.Lock()
					got[req.Session] = append(got[req.Session], req.Body("m", false))
					mu.Unlock()
					prev = answer(&req, 0)
					var wg sync.WaitGroup
					for _, sub := range req.Spawn {
						wg.Go(func() { run(sub, prev) })
					}
					wg.Wait()
				}
			}
			var wg sync.WaitGroup
			for _, s := range w.Sessions {
				wg.Go(func() { run(s, "") })
			}
			wg.Wait()

			if len(got) != len(want) {
				t.Fatalf("%d sessions sent requests, want %d", len(got), len(want))
			}
			for id, reqs := range want {
				if !slices.EqualFunc(reqs, got[id], bytes.Equal) {
					t.Errorf("session %s sends differently when run concurrently", id)
				}
			}
		})
	}
}
