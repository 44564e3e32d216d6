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

// tracePath returns the Mooncake conversation trace shared beside the repository, skipping
// the test where it is absent.
func tracePath(tb testing.TB) string {
	tb.Helper()
	p := filepath.Join("..", "..", "..", "..", "..", "shared", "traces", "mooncake-conversation.jsonl")
	if env := os.Getenv("KVRELAY_MOONCAKE_TRACE"); env != "" {
		p = env
	}
	if _, err := os.Stat(p); err != nil {
		tb.Skipf("Mooncake trace not found (%v); set KVRELAY_MOONCAKE_TRACE", err)
	}
	return p
}
