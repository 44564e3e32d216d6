package workload

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestParseSpecs(t *testing.T) {
	tok := testTokenizer(t)
	for _, tc := range []struct {
		name, spec     string
		wantName       string
		wantOpen       int
		wantSessions   int
		wantSpecSubstr string
	}{
		{"prefix groups defaults", "prefix-groups", "prefix-groups", 400, 0, "prefix-groups:groups=16,prompt=2048,user=64,requests=400,rate=20,osl=64"},
		{"prefix groups with params", "prefix-groups:groups=4,requests=10", "prefix-groups", 10, 0, "groups=4,"},
		{"a repeated key takes the last value", "prefix-groups:requests=5,requests=7", "prefix-groups", 7, 0, "requests=7"},
		{"spaces around pairs", "prefix-groups: requests = 3 , osl=2", "prefix-groups", 3, 0, "osl=2"},
		{"multi-turn defaults", "multi-turn", "multi-turn", 0, 32, "turns=8,system=1024"},
		{"multi-turn plain seconds", "multi-turn:sessions=3,think=0.5", "multi-turn", 0, 3, "think=0.5"},
		{"agentic defaults", "agentic", "agentic", 0, 8, "preamble=6000"},
		{"mooncake by name", "mooncake:path=testdata/mini-trace.jsonl,requests=4", "mooncake", 4, 0, "requests=4,block=512"},
		{"mooncake by bare path", "testdata/mini-trace.jsonl", "mooncake", 6, 0, "mooncake:path=testdata/mini-trace.jsonl,"},
		{"fixed defaults", "fixed", "fixed", 200, 0, "fixed:isl=3000,osl=150,requests=200,rate=2,chat=true,hints=false"},
		{"empty parameter list", "multi-turn:", "multi-turn", 0, 32, "sessions=32"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Parse(tc.spec, 1, tok)
			if err != nil {
				t.Fatal(err)
			}
			if w.Name != tc.wantName || len(w.Open) != tc.wantOpen || len(w.Sessions) != tc.wantSessions {
				t.Errorf("got %s with %d open requests and %d sessions, want %s, %d, %d",
					w.Name, len(w.Open), len(w.Sessions), tc.wantName, tc.wantOpen, tc.wantSessions)
			}
			if !strings.Contains(w.Spec, tc.wantSpecSubstr) {
				t.Errorf("spec %q lacks %q", w.Spec, tc.wantSpecSubstr)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	tok := testTokenizer(t)
	for _, tc := range []struct{ name, spec, want string }{
		{"unknown workload", "zipfian", "not a built-in"},
		{"unknown parameter", "prefix-groups:group=3", `unknown parameter "group"`},
		{"not key=value", "prefix-groups:groups", "not key=value"},
		{"empty key", "prefix-groups:=3", "not key=value"},
		{"not an integer", "prefix-groups:groups=many", "groups="},
		{"zero groups", "prefix-groups:groups=0", "groups="},
		{"negative rate", "prefix-groups:rate=-1", "rate="},
		{"bad bool", "prefix-groups:hints=maybe", "hints="},
		{"zero isl", "fixed:isl=0", "isl="},
		{"bad chat", "fixed:chat=yes", "chat="},
		{"bad duration", "multi-turn:think=soon", "think="},
		{"negative duration", "multi-turn:think=-2s", "think="},
		{"block not a multiple of 16", "mooncake:path=testdata/mini-trace.jsonl,block=100", "multiple of 16"},
		{"block below 16", "mooncake:path=testdata/mini-trace.jsonl,block=8", "block="},
		{"missing trace", "mooncake:path=testdata/none.jsonl", "opening trace"},
		{"subagents without rounds", "agentic:rounds=0,subagents=1", "subagents need rounds"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(tc.spec, 1, tok)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tc.want)
			}
			if !strings.Contains(tc.name, "missing") && !errors.Is(err, ErrSpec) {
				t.Errorf("error %v is not ErrSpec", err)
			}
		})
	}
}

func TestParseDefaultTokenizer(t *testing.T) {
	testTokenizer(t) // the built-in is shared: this only checks that nil selects it
	w, err := Parse("prefix-groups:requests=2,prompt=8,user=3", 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(testTokenizer(t).Encode(w.Open[0].Messages[1].Content)); n != 3 {
		t.Errorf("user message has %d tokens of %s, want 3", n, DefaultTokenizer)
	}
}

func TestDurationParam(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want time.Duration
	}{
		{"2s", 2 * time.Second}, {"150ms", 150 * time.Millisecond}, {"1.5", 1500 * time.Millisecond}, {"0", 0},
	} {
		p, _ := parseParams("x", []param{{"d", "0", ""}}, "d="+tc.v, true)
		if got := p.duration("d"); got != tc.want || p.err != nil {
			t.Errorf("duration %q = %v (%v), want %v", tc.v, got, p.err, tc.want)
		}
	}
}
