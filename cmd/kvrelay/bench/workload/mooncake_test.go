package workload

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
)

func TestScaledLength(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		in, block, trace, out int
	}{
		{"unscaled", 6758, 512, 512, 6758},
		{"exact multiple", 1024, 64, 512, 128},
		{"remainder rounds up", 1200, 16, 512, 2*16 + 6},
		{"tiny remainder keeps one token", 513, 16, 512, 17},
		{"remainder just below a block", 1023, 64, 512, 128},
		{"partial only", 100, 16, 512, 4},
		{"scaled up", 700, 1024, 512, 1024 + 376},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := ScaledLength(tc.in, tc.block, tc.trace); got != tc.out {
				t.Errorf("ScaledLength(%d, %d, %d) = %d, want %d", tc.in, tc.block, tc.trace, got, tc.out)
			}
		})
	}
}

// lcp returns the length of the common prefix of a and b.
func lcp(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// commonIDs returns the length of the common prefix of two hash_id lists.
func commonIDs(a, b []int64) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// checkSharing checks the sharing property for two records and their token ids: identical
// hash_ids and lengths give identical prompts; otherwise the prompts agree on exactly the full
// blocks of their common hash_ids and then differ within the idWords tokens that spell the
// next block's id (or one prompt ends).
func checkSharing(t *testing.T, ra, rb *TraceRecord, a, b []uint32, block int) {
	t.Helper()
	c := commonIDs(ra.HashIDs, rb.HashIDs)
	got := lcp(a, b)
	if slices.Equal(ra.HashIDs, rb.HashIDs) && ra.InputLength == rb.InputLength {
		if !slices.Equal(a, b) {
			t.Errorf("identical records %v give different prompts (common prefix %d of %d)", ra.HashIDs, got, len(a))
		}
		return
	}
	want := c * block
	if got < want || got >= want+idWords {
		t.Errorf("hash_ids %v and %v share %d ids: token prefix %d, want %d (+ < %d); lengths %d, %d",
			ra.HashIDs, rb.HashIDs, c, got, want, idWords, len(a), len(b))
	}
	// Block hashes at the engine's granularity agree on exactly c·block/16 blocks.
	ha, hb := blockhash.Seq(a, 16, nil), blockhash.Seq(b, 16, nil)
	common := 0
	for common < len(ha) && common < len(hb) && ha[common] == hb[common] {
		common++
	}
	if common != c*block/16 {
		t.Errorf("hash_ids %v and %v share %d ids: %d common 16-token blocks, want %d",
			ra.HashIDs, rb.HashIDs, c, common, c*block/16)
	}
}

func TestMooncakeMiniTrace(t *testing.T) {
	tok := testTokenizer(t)
	f, err := os.Open("testdata/mini-trace.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	recs, err := ReadTrace(f, 0, 512)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 6 {
		t.Fatalf("read %d records, want 6 (blank lines skipped)", len(recs))
	}
	for _, block := range []int{16, 64, 512} {
		t.Run(fmt.Sprintf("block=%d", block), func(t *testing.T) {
			w, err := Parse(fmt.Sprintf("mooncake:path=testdata/mini-trace.jsonl,block=%d", block), 7, tok)
			if err != nil {
				t.Fatal(err)
			}
			// Stable sort by timestamp: lines 1, 5, 2, 3, 4, 6.
			order := []int{0, 4, 1, 2, 3, 5}
			wantAt := []time.Duration{0, 3 * time.Millisecond, 5 * time.Millisecond, 5 * time.Millisecond, 12500 * time.Microsecond, 20 * time.Millisecond}
			ids := make([][]uint32, len(recs))
			for i, r := range w.Open {
				rec := &recs[order[i]]
				if r.At != wantAt[i] || r.MaxTokens != rec.OutputLength || !r.IgnoreEOS || r.Chat || r.Tag != "trace" || r.OSL != 0 {
					t.Errorf("request %d: %+v, want at %v, max_tokens %d", i, r, wantAt[i], rec.OutputLength)
				}
				ids[order[i]] = tok.Encode(r.Prompt)
				if want := ScaledLength(rec.InputLength, block, 512); len(ids[order[i]]) != want {
					t.Errorf("line %d: %d tokens, want %d", order[i]+1, len(ids[order[i]]), want)
				}
			}
			for _, tc := range []struct {
				name   string
				a, b   int // line indices
				common int // common hash_ids
			}{
				{"two full blocks then different partials", 0, 1, 2},
				{"one full block then full vs partial", 0, 2, 1},
				{"identical records", 0, 3, 3},
				{"aligned prompt is a prefix", 2, 4, 2},
				{"nothing shared", 0, 5, 0},
				{"partial-only vs full", 5, 4, 0},
			} {
				t.Run(tc.name, func(t *testing.T) {
					if c := commonIDs(recs[tc.a].HashIDs, recs[tc.b].HashIDs); c != tc.common {
						t.Fatalf("fixture: %d common ids, want %d", c, tc.common)
					}
					checkSharing(t, &recs[tc.a], &recs[tc.b], ids[tc.a], ids[tc.b], block)
				})
			}
			if !slices.Equal(ids[2], ids[4][:len(ids[2])]) {
				t.Error("a block-aligned prompt is not a prefix of the prompt that extends its hash_ids")
			}
		})
	}
}

// TestMooncakeRealTrace replays the first requests of the Mooncake conversation trace through
// the real gpt-oss tokenizer and checks that the text preserves the trace's prefix sharing
// exactly: every prompt has ScaledLength tokens; the engines' 16-token block hashes map one to
// one onto (hash_id, block within it), so two prompts share k 16-token blocks exactly when
// their hash_ids agree on k·16/block ids; and each request against the earlier one sharing
// most of its hash_ids agrees on exactly the common blocks' tokens, then differs.
func TestMooncakeRealTrace(t *testing.T) {
	path := tracePath(t)
	tok := testTokenizer(t)
	for _, tc := range []struct {
		name            string
		requests, block int
	}{
		{"2000 requests, 64-token blocks", 2000, 64},
		{"300 requests, 512-token blocks", 300, 512},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if testing.Short() && tc.block == 512 {
				t.Skip("short")
			}
			recs, err := readTraceFile(path, tc.requests, 512)
			if err != nil {
				t.Fatal(err)
			}
			w, err := Parse(fmt.Sprintf("mooncake:path=%s,requests=%d,block=%d", path, tc.requests, tc.block), 1, tok)
			if err != nil {
				t.Fatal(err)
			}
			if len(w.Open) != tc.requests {
				t.Fatalf("%d requests, want %d", len(w.Open), tc.requests)
			}
			// The trace is sorted by timestamp, so requests keep the trace order.
			type key struct {
				id  int64
				sub int
			}
			byKey := map[key]uint64{}
			byHash := map[uint64]key{}
			last := map[int64]int{} // hash_id → latest request holding it
			per := tc.block / 16
			shared := 0
			for i := range recs {
				rec, req := &recs[i], &w.Open[i]
				if req.MaxTokens != rec.OutputLength || req.At != time.Duration(rec.Timestamp)*time.Millisecond {
					t.Fatalf("request %d out of trace order: %+v vs %+v", i, req.At, rec)
				}
				ids := tok.Encode(req.Prompt)
				if want := ScaledLength(rec.InputLength, tc.block, 512); len(ids) != want {
					t.Fatalf("request %d: %d tokens, want %d", i, len(ids), want)
				}
				for j, h := range blockhash.Seq(ids, 16, nil) {
					k := key{rec.HashIDs[j/per], j % per}
					if old, ok := byKey[k]; ok && old != h {
						t.Fatalf("request %d: block %d of hash_id %d hashes differently than before", i, k.sub, k.id)
					}
					if old, ok := byHash[h]; ok && old != k {
						t.Fatalf("request %d: 16-token block (%d, %d) aliases (%d, %d)", i, k.id, k.sub, old.id, old.sub)
					}
					byKey[k], byHash[h] = h, k
				}
				// The earlier request sharing the most hash_ids: the latest holding the deepest
				// shared id (an id names its whole prefix).
				best := -1
				for j := len(rec.HashIDs) - 1; j >= 0 && best < 0; j-- {
					if r, ok := last[rec.HashIDs[j]]; ok {
						best = r
					}
				}
				if best >= 0 {
					shared++
					checkSharing(t, &recs[best], rec, tok.Encode(w.Open[best].Prompt), ids, tc.block)
				}
				for _, h := range rec.HashIDs {
					last[h] = i
				}
			}
			if shared < len(recs)/2 {
				t.Errorf("only %d of %d requests share a prefix with an earlier one", shared, len(recs))
			}
			t.Logf("%d requests, %d distinct 16-token blocks, %d with an earlier sharer", len(recs), len(byHash), shared)
		})
	}
}

func TestMooncakeDeterminism(t *testing.T) {
	tok := testTokenizer(t)
	spec := "mooncake:path=testdata/mini-trace.jsonl,block=32"
	a, err := Parse(spec, 3, tok)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Parse(spec, 3, tok)
	c, _ := Parse(spec, 4, tok)
	for i := range a.Open {
		if !bytes.Equal(a.Open[i].Body("m", true), b.Open[i].Body("m", true)) {
			t.Errorf("request %d differs between two parses with one seed", i)
		}
		if a.Open[i].Prompt == c.Open[i].Prompt {
			t.Errorf("request %d is the same under seeds 3 and 4", i)
		}
	}
}

func TestReadTraceErrors(t *testing.T) {
	for _, tc := range []struct{ name, line, want string }{
		{"not json", "{", "line 1"},
		{"too few ids", `{"timestamp":0,"input_length":1025,"output_length":1,"hash_ids":[1,2]}`, "2 hash_ids for input_length 1025"},
		{"too many ids", `{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[1,2]}`, "2 hash_ids"},
		{"no output", `{"timestamp":0,"input_length":10,"output_length":0,"hash_ids":[1]}`, "output_length"},
		{"no input", `{"timestamp":0,"input_length":0,"output_length":1,"hash_ids":[]}`, "input_length"},
		{"negative id", `{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[-1]}`, "negative"},
		{"negative time", `{"timestamp":-1,"input_length":10,"output_length":1,"hash_ids":[1]}`, "timestamp"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadTrace(strings.NewReader(tc.line+"\n"), 0, 512)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one mentioning %q", err, tc.want)
			}
		})
	}
	recs, err := ReadTrace(strings.NewReader(`{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[1]}`), 0, 512)
	if err != nil || len(recs) != 1 {
		t.Errorf("last line without newline: %v, %d records", err, len(recs))
	}
	if _, err := ReadTrace(strings.NewReader(`{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[-1]}`), 0, 512); !errors.Is(err, ErrSpec) {
		t.Errorf("error %v is not ErrSpec", err)
	}
}

// TestDefaultTrace checks that the mooncake workload's default path names the trace the
// repository ships, from the repository's root, and that it is the whole conversation trace.
func TestDefaultTrace(t *testing.T) {
	tok := testTokenizer(t)
	root, err := filepath.Abs(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("repository root %s: %v", root, err)
	}
	t.Chdir(root)
	w, err := Parse("mooncake:requests=20", 1, tok)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Open) != 20 || !strings.Contains(w.Spec, "path="+DefaultTrace) {
		t.Errorf("%d requests, spec %q", len(w.Open), w.Spec)
	}
	recs, err := readTraceFile(DefaultTrace, 0, 512)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 12031 { // hack/traces/README.md
		t.Errorf("%d records, want 12031", len(recs))
	}
}

// TestTraceFileErrors checks that a trace that cannot be read says what to do: a missing
// file names the flag, a missing default also says where it is looked for.
func TestTraceFileErrors(t *testing.T) {
	tok := testTokenizer(t)
	dir := t.TempDir()
	line := `{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[1]}` + "\n"
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte(line + line))
	zw.Close()
	for name, data := range map[string][]byte{
		"plain.jsonl":     []byte(line + line),
		"zipped.jsonl.gz": gz.Bytes(),
		"cut.jsonl.gz":    gz.Bytes()[:gz.Len()-6],
		"notgz.jsonl.gz":  []byte(line),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Chdir(dir)
	cases := []struct {
		name, spec string
		requests   int      // when the spec parses
		want       []string // in the error otherwise
		notExist   bool
	}{
		{name: "plain", spec: "mooncake:path=plain.jsonl", requests: 2},
		{name: "gzipped", spec: "mooncake:path=zipped.jsonl.gz", requests: 2},
		{name: "bare gzipped path", spec: "zipped.jsonl.gz", requests: 2},
		{name: "missing file", spec: "mooncake:path=nothere.jsonl", want: []string{"nothere.jsonl", "--workload mooncake:path=FILE"}, notExist: true},
		{name: "missing default", spec: "mooncake", want: []string{DefaultTrace, "repository's root", "--workload mooncake:path=FILE"}, notExist: true},
		{name: "truncated gzip", spec: "mooncake:path=cut.jsonl.gz", want: []string{"cut.jsonl.gz", "unexpected EOF"}},
		{name: "not gzip", spec: "mooncake:path=notgz.jsonl.gz", want: []string{"notgz.jsonl.gz", "gzip"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Parse(tc.spec, 1, tok)
			if tc.want == nil {
				if err != nil || len(w.Open) != tc.requests {
					t.Fatalf("Parse: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("no error")
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q does not mention %q", err, s)
				}
			}
			if got := errors.Is(err, fs.ErrNotExist); got != tc.notExist {
				t.Errorf("errors.Is(%v, fs.ErrNotExist) = %v", err, got)
			}
		})
	}
}
