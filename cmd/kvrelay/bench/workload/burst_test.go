package workload

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestBurstWarp(t *testing.T) {
	b := burst{factor: 3, period: 30 * time.Second}
	for _, tc := range []struct{ in, want time.Duration }{
		{0, 0},
		{3 * time.Second, time.Second},
		{29 * time.Second, 29 * time.Second / 3},
		{30 * time.Second, 30 * time.Second},
		{45 * time.Second, 35 * time.Second},
		{89 * time.Second, 60*time.Second + 29*time.Second/3},
	} {
		if got := b.at(tc.in); got != tc.want {
			t.Errorf("at(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
	if steady := (burst{factor: 1, period: 30 * time.Second}); steady.at(17*time.Second) != 17*time.Second {
		t.Error("burst=1 moved an arrival")
	}
}

// TestBurstArrivals: with burst=3 a stream's arrivals all fall in the first third of each
// period, each period holds the arrivals the steady stream has in it (the mean rate is kept),
// and the requests are the steady stream's, in the same order.
func TestBurstArrivals(t *testing.T) {
	tok := testTokenizer(t)
	const base = "prefix-groups:groups=4,prompt=20,user=4,requests=3000,rate=50,osl=4"
	steady, err := Parse(base, 7, tok)
	if err != nil {
		t.Fatal(err)
	}
	bursty, err := Parse(base+",burst=3,burst_period=10s", 7, tok)
	if err != nil {
		t.Fatal(err)
	}
	const period = 10 * time.Second
	perPeriod := map[time.Duration][2]int{}
	for i := range steady.Open {
		s, b := steady.Open[i], bursty.Open[i]
		if string(s.Body("m", true)) != string(b.Body("m", true)) {
			t.Fatalf("request %d differs beyond its time", i)
		}
		if b.At%period >= period/3+time.Microsecond {
			t.Fatalf("request %d arrives %v into its period, after the on third", i, b.At%period)
		}
		if s.At/period != b.At/period {
			t.Fatalf("request %d moved from period %d to %d", i, s.At/period, b.At/period)
		}
		c := perPeriod[b.At/period]
		c[0]++
		perPeriod[b.At/period] = c
	}
	// The on part runs at three times the mean rate: about 50 × 10 = 500 arrivals a period
	// within 3.3 s.
	full := 0
	for k, c := range perPeriod {
		if k < steady.Open[len(steady.Open)-1].At/period { // complete periods only
			full++
			if c[0] < 400 || c[0] > 600 {
				t.Errorf("period %d holds %d arrivals, want about 500", k, c[0])
			}
		}
	}
	if full < 4 {
		t.Fatalf("only %d complete periods", full)
	}
}

func TestBurstOnSessions(t *testing.T) {
	tok := testTokenizer(t)
	for _, spec := range []string{
		"agentic:sessions=300,rate=10,preamble=40,task=6,rounds=1,subagents=0,tool=8,burst=4,burst_period=8s",
		"multi-turn:sessions=300,rate=10,system=10,user=4,turns=1,osl=4,burst=4,burst_period=8s",
		"mixed:users=300,user_rate=10,rag=0,system=10,user=4,turns=1,burst=4,burst_period=8s",
	} {
		w, err := Parse(spec, 3, tok)
		if err != nil {
			t.Fatal(err)
		}
		var last time.Duration
		for i, s := range w.Sessions {
			r, ok := s.Next("")
			if !ok {
				t.Fatalf("%s: session %d sent nothing", spec, i)
			}
			if r.At < last || r.At%(8*time.Second) > 2*time.Second {
				t.Fatalf("%s: session %d starts at %v (after %v): not in order within the on quarter", spec, i, r.At, last)
			}
			last = r.At
		}
		// 300 sessions at a mean of 10/s: the last starts near 30 s.
		if last < 20*time.Second || last > 40*time.Second {
			t.Errorf("%s: last session starts at %v, want about 30s", spec, last)
		}
	}
}

func TestBurstErrors(t *testing.T) {
	tok := testTokenizer(t)
	for _, tc := range []struct{ spec, want string }{
		{"agentic:burst=3", "burst needs arrivals at a rate"},
		{"multi-turn:burst=2", "burst needs arrivals at a rate"},
		{"prefix-groups:burst=0.5", "burst="},
		{"prefix-groups:burst=3,burst_period=0s", "burst_period="},
		{"mixed:burst=many", "burst="},
	} {
		_, err := Parse(tc.spec, 1, tok)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one mentioning %q", tc.spec, err, tc.want)
		}
	}
}

// TestMultiTurnRate: with a rate, sessions send their first turn as they start, in order,
// later turns after a think time; session_ids=false keeps the id off the wire.
func TestMultiTurnRate(t *testing.T) {
	tok := testTokenizer(t)
	w, err := Parse("multi-turn:sessions=200,rate=20,system=10,systems=200,user=4,turns=2,osl=4,think=1s,session_ids=false", 4, tok)
	if err != nil {
		t.Fatal(err)
	}
	var last time.Duration
	systems := map[string]bool{}
	for i, s := range w.Sessions {
		r, _ := s.Next("")
		if r.At < last {
			t.Fatalf("session %d starts at %v, before %v", i, r.At, last)
		}
		last = r.At
		if !r.Anonymous || strings.Contains(string(r.Body("m", true)), "session_id") {
			t.Fatalf("session %d names itself", i)
		}
		systems[r.Messages[0].Content] = true
	}
	if last < 7*time.Second || last > 13*time.Second {
		t.Errorf("last of 200 sessions at 20/s starts at %v, want about 10s", last)
	}
	if len(systems) != 200 {
		t.Errorf("%d distinct system prompts, want one per session", len(systems))
	}
}

func TestMixed(t *testing.T) {
	tok := testTokenizer(t)
	for _, docs := range []int{0, 5} {
		t.Run(fmt.Sprintf("docs=%d", docs), func(t *testing.T) {
			spec := fmt.Sprintf("mixed:users=40,user_rate=8,turns=2,system=30,user=6,osl=5,think=1s,rag=300,rag_rate=10,rag_system=20,docs=%d,doc=200,question=7,rag_osl=9,zipf=1", docs)
			w, err := Parse(spec, 2, tok)
			if err != nil {
				t.Fatal(err)
			}
			if w.Name != "mixed" || len(w.Sessions) != 40 || len(w.Open) != 300 {
				t.Fatalf("%s: %d sessions, %d open requests", w.Name, len(w.Sessions), len(w.Open))
			}
			reqs := drive(t, w, wordAnswers(t), true)
			var chat, rag int
			chatSystems := map[string]bool{}
			instr := map[string]bool{}
			documents := map[string]int{}
			var last time.Duration
			for _, r := range reqs {
				switch r.Tag {
				case "rag":
					rag++
					if r.At < last {
						t.Fatalf("RAG arrivals out of order: %v after %v", r.At, last)
					}
					last = r.At
					if len(r.Messages) != 2 || r.MaxTokens != 9 || r.Session != "" {
						t.Fatalf("RAG request %+v", r.Request)
					}
					instr[r.Messages[0].Content] = true
					d, _, ok := strings.Cut(r.Messages[1].Content, "\n\nQuestion:")
					if !ok {
						t.Fatalf("RAG prompt without a question: %.80q", r.Messages[1].Content)
					}
					if n := tokens(t, d); n != 200 {
						t.Fatalf("document of %d tokens, want 200", n)
					}
					documents[d]++
				case "chat":
					chat++
					if r.MaxTokens != 5 || r.Session == "" || !r.Anonymous {
						t.Fatalf("chat request %+v", r.Request)
					}
					chatSystems[r.Messages[0].Content] = true
				default:
					t.Fatalf("tag %q", r.Tag)
				}
			}
			if chat != 80 || rag != 300 {
				t.Fatalf("%d chat turns, %d RAG requests, want 80 and 300", chat, rag)
			}
			if len(chatSystems) != 1 || len(instr) != 1 {
				t.Fatalf("%d chat system prompts, %d RAG instructions, want one each", len(chatSystems), len(instr))
			}
			for s := range chatSystems {
				if instr[s] {
					t.Fatal("the chat system prompt is the RAG instructions")
				}
			}
			switch docs {
			case 0:
				if len(documents) != 300 {
					t.Fatalf("%d distinct documents in 300 RAG requests, want all unique", len(documents))
				}
			default:
				if len(documents) != docs {
					t.Fatalf("%d distinct documents, want %d", len(documents), docs)
				}
				top := 0
				for _, n := range documents {
					top = max(top, n)
				}
				if top < 300/docs {
					t.Errorf("zipf=1: the most retrieved document has %d of 300", top)
				}
			}
			if last < 20*time.Second || last > 40*time.Second {
				t.Errorf("300 RAG requests at 10/s end at %v, want about 30s", last)
			}
		})
	}
}
