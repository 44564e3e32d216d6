package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
)

// idsFixture is testdata/ids/<name>.json, written by hack/tokenizer-fixtures.
type idsFixture struct {
	Tokenizer string `json:"tokenizer"`
	Source    string `json:"source"`
	Cases     []struct {
		Name string   `json:"name"`
		IDs  []uint32 `json:"ids"`
	} `json:"cases"`
}

type corpusCase struct {
	Name string `json:"name"`
	Text string `json:"text"`
}

func readJSON(t testing.TB, rel string, v any) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", rel))
	if err != nil {
		t.Fatalf("reading fixture: %v", err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("decoding fixture %s: %v", rel, err)
	}
}

func loadCorpus(t testing.TB) []corpusCase {
	var c []corpusCase
	readJSON(t, "corpus.json", &c)
	return c
}

// Model files the golden tests load, relative to testdata/.
const (
	qwen3TokenizerFile  = "models/qwen3/tokenizer.json.gz"
	llama3TokenizerFile = "models/llama3/tokenizer.json.gz"
)

// loadedFiles shares tokenizers loaded from testdata between tests: parsing a 10 MB
// tokenizer.json is the slowest step of the suite under the race detector.
var loadedFiles sync.Map // spec -> Tokenizer

func mustTokenizer(t testing.TB, spec string) Tokenizer {
	t.Helper()
	if spec != O200kBase && spec != O200kHarmony && spec != Cl100kBase {
		spec = filepath.Join("testdata", spec)
	}
	if tok, ok := loadedFiles.Load(spec); ok {
		return tok.(Tokenizer)
	}
	tok, err := New(spec)
	if err != nil {
		t.Fatalf("New(%q): %v", spec, err)
	}
	loadedFiles.Store(spec, tok)
	return tok
}

func TestGoldenIDs(t *testing.T) {
	corpus := loadCorpus(t)
	tests := []struct {
		name    string
		spec    string
		fixture string
	}{
		{name: "o200k_base vs js-tiktoken", spec: O200kBase, fixture: "ids/o200k_base.json"},
		{name: "cl100k_base vs js-tiktoken", spec: Cl100kBase, fixture: "ids/cl100k_base.json"},
		{name: "o200k_harmony vs gpt-oss tokenizer.json", spec: O200kHarmony, fixture: "ids/gpt-oss.json"},
		{name: "qwen3 tokenizer.json", spec: qwen3TokenizerFile, fixture: "ids/qwen3.json"},
		{name: "llama3 tokenizer.json", spec: llama3TokenizerFile, fixture: "ids/llama3.json"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tok := mustTokenizer(t, tt.spec)
			var fx idsFixture
			readJSON(t, tt.fixture, &fx)
			if len(fx.Cases) != len(corpus) {
				t.Fatalf("fixture has %d cases, corpus %d", len(fx.Cases), len(corpus))
			}
			for i, c := range fx.Cases {
				text := corpus[i].Text
				got := tok.Encode(text)
				if !slices.Equal(got, c.IDs) && !(len(got) == 0 && len(c.IDs) == 0) {
					t.Errorf("%s: Encode(%.60q)\n got  %v\n want %v", c.Name, text, got, c.IDs)
					continue
				}
				if n := tok.Count(text); n != len(c.IDs) {
					t.Errorf("%s: Count = %d, want %d", c.Name, n, len(c.IDs))
				}
			}
		})
	}
}
