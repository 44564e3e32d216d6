package workload

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/golden")

// goldenCases are small workloads whose requests are pinned byte for byte.
var goldenCases = []struct {
	name, spec string
	seed       uint64
}{
	{"mooncake", "mooncake:path=testdata/mini-trace.jsonl,block=16,hints=true", 1},
	{"prefix-groups", "prefix-groups:groups=3,prompt=12,user=4,requests=6,rate=5,osl=8,zipf=1.2,hints=true", 1},
	{"multi-turn", "multi-turn:sessions=2,turns=3,system=10,systems=2,user=5,osl=6,think=1s", 1},
	{"agentic", "agentic:sessions=2,preamble=40,task=6,turns=2,rounds=2,tool=8,subagents=2,sub_task=5,sub_rounds=1,reasoning=4,osl=6", 1},
	{"fixed", "fixed:isl=20,osl=5,requests=4,rate=3,hints=true", 1},
	{"fixed-text", "fixed:isl=9,osl=3,requests=3,rate=50,chat=false", 2},
	{"prefix-groups-burst", "prefix-groups:groups=2,prompt=12,user=4,requests=6,rate=5,osl=8,burst=3,burst_period=1s", 1},
	{"multi-turn-rate", "multi-turn:sessions=2,turns=2,system=10,systems=2,user=5,osl=6,think=1s,rate=2,session_ids=false", 1},
	{"mixed", "mixed:users=2,user_rate=2,turns=2,system=10,user=5,osl=6,think=1s,rag=3,rag_rate=2,rag_system=8,docs=2,doc=20,question=5,rag_osl=6", 1},
	{"agentic-text", "agentic:sessions=1,preamble=400,task=6,turns=1,rounds=3,tool=8,subagents=1,sub_task=5,sub_rounds=1,reasoning=4,osl=6,toolcalls=false", 2},
}

// transcript renders the requests a test runner sent, one JSON line each.
func transcript(tb testing.TB, w *Workload, reqs []sent) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# %s\n", w.Spec)
	for _, r := range reqs {
		line, err := json.Marshal(struct {
			At     string          `json:"at"`
			Depth  int             `json:"depth,omitempty"`
			Tag    string          `json:"tag"`
			Spawn  int             `json:"spawn,omitempty"`
			Body   json.RawMessage `json:"body"`
			Answer string          `json:"answer"`
		}{r.At.String(), r.Depth, r.Tag, len(r.Spawn), r.Body("gpt-oss", true), r.Answer})
		if err != nil {
			tb.Fatal(err)
		}
		b.Write(line)
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// TestGolden pins each workload's requests for a seed: the same seed gives byte-identical
// requests on every run and Go release. Refresh with go test -run TestGolden -update.
func TestGolden(t *testing.T) {
	tok := testTokenizer(t)
	for _, tc := range goldenCases {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Parse(tc.spec, tc.seed, tok)
			if err != nil {
				t.Fatal(err)
			}
			got := transcript(t, w, drive(t, w, wordAnswers(t), true))
			path := filepath.Join("testdata", "golden", tc.name+".jsonl")
			if *update {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if !bytes.Equal(got, want) {
				gl, wl := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
				for i := range min(len(gl), len(wl)) {
					if gl[i] != wl[i] {
						t.Fatalf("%s differs at line %d:\n got: %.300s\nwant: %.300s", path, i+1, gl[i], wl[i])
					}
				}
				t.Fatalf("%s: %d lines, want %d", path, len(gl), len(wl))
			}
		})
	}
}

// TestDeterminism checks that two parses with one seed send identical requests, that another
// seed changes them, and that the canonical spec regenerates the workload.
func TestDeterminism(t *testing.T) {
	tok := testTokenizer(t)
	for _, tc := range goldenCases {
		t.Run(tc.name, func(t *testing.T) {
			a, err := Parse(tc.spec, tc.seed, tok)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := Parse(tc.spec, tc.seed, tok)
			c, err := Parse(a.Spec, tc.seed, tok)
			if err != nil {
				t.Fatalf("canonical spec %q: %v", a.Spec, err)
			}
			d, _ := Parse(tc.spec, tc.seed+1000, tok)
			ta := transcript(t, a, drive(t, a, wordAnswers(t), true))
			if tb := transcript(t, b, drive(t, b, wordAnswers(t), true)); !bytes.Equal(ta, tb) {
				t.Error("same seed, different requests")
			}
			if tc := transcript(t, c, drive(t, c, wordAnswers(t), true)); !bytes.Equal(ta, tc) {
				t.Error("the canonical spec gives different requests")
			}
			if c.Spec != a.Spec {
				t.Errorf("canonical spec %q reparses as %q", a.Spec, c.Spec)
			}
			if td := transcript(t, d, drive(t, d, wordAnswers(t), true)); bytes.Equal(ta, td) {
				t.Error("another seed gives the same requests")
			}
		})
	}
}
