package workload

import (
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

var (
	tokOnce sync.Once
	tokVal  tokenizer.Tokenizer
	tokErr  error
)

// testTokenizer returns the real gpt-oss tokenizer, loaded once per test binary.
func testTokenizer(tb testing.TB) tokenizer.Tokenizer {
	tb.Helper()
	tokOnce.Do(func() { tokVal, tokErr = tokenizer.New(DefaultTokenizer) })
	if tokErr != nil {
		tb.Fatal(tokErr)
	}
	return tokVal
}

// repoRoot is the repository's root, four levels above this package.
var repoRoot = filepath.Join("..", "..", "..", "..")

// tracePath returns the Mooncake conversation trace the repository ships (DefaultTrace), or
// $KVRELAY_MOONCAKE_TRACE.
func tracePath(tb testing.TB) string {
	tb.Helper()
	p := filepath.Join(repoRoot, DefaultTrace)
	if env := os.Getenv("KVRELAY_MOONCAKE_TRACE"); env != "" {
		p = env
	}
	if _, err := os.Stat(p); err != nil {
		tb.Fatalf("Mooncake trace: %v", err)
	}
	return p
}

// sent is a request as a test runner sent it, with the answer it got.
type sent struct {
	Request
	Answer string
	Depth  int // 0 for a top-level session's request, 1 for a spawned session's
}

// answerer returns the answer to the n-th request sent: words of exactly MaxTokens tokens.
type answerer func(req *Request, n int) string

// wordAnswers answers with MaxTokens fresh words, deterministic in the request's position.
func wordAnswers(tb testing.TB) answerer {
	v, err := vocabFor(testTokenizer(tb))
	if err != nil {
		tb.Fatal(err)
	}
	return func(req *Request, n int) string { return v.text(newRNG(99, uint64(n)), req.MaxTokens) }
}

// drive runs a workload the way a runner would, but sequentially: open requests first, then
// each session to its end; a request's spawned sessions run, each to its end, right after it is
// answered, before its own session continues. With runSpawns false, spawned sessions are
// ignored (a runner that does not know Spawn).
func drive(tb testing.TB, w *Workload, answer answerer, runSpawns bool) []sent {
	tb.Helper()
	var out []sent
	for i := range w.Open {
		out = append(out, sent{Request: w.Open[i], Answer: answer(&w.Open[i], len(out))})
	}
	var run func(s Session, first string, depth int)
	run = func(s Session, first string, depth int) {
		prev := first
		for turn := 0; ; turn++ {
			if turn > 10000 {
				tb.Fatal("session does not end")
			}
			req, ok := s.Next(prev)
			if !ok {
				return
			}
			prev = answer(&req, len(out))
			out = append(out, sent{Request: req, Answer: prev, Depth: depth})
			if runSpawns {
				for _, sub := range req.Spawn {
					run(sub, prev, depth+1)
				}
			}
		}
	}
	for _, s := range w.Sessions {
		run(s, "", 0)
	}
	return out
}
