package workload

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/tokenizer"
)

// tokens counts the tokens of s with the test tokenizer.
func tokens(tb testing.TB, s string) int { return len(testTokenizer(tb).Encode(s)) }

// render encodes a chat request's messages with a chat template, as the proxy and the engines
// do, with a generation prompt and a fixed date.
func render(tb testing.TB, tmpl string, msgs []Message) []uint32 {
	tb.Helper()
	js, _ := json.Marshal(msgs)
	var tm []tokenizer.Message
	if err := json.Unmarshal(js, &tm); err != nil {
		tb.Fatal(err)
	}
	t, err := tokenizer.NewTemplate(tmpl)
	if err != nil {
		tb.Fatal(err)
	}
	s, err := t.Render(tm, tokenizer.RenderOptions{AddGenerationPrompt: true, Date: "2026-01-01"})
	if err != nil {
		tb.Fatalf("%s template rejects the request: %v", tmpl, err)
	}
	return testTokenizer(tb).Encode(s)
}

func TestPrefixGroups(t *testing.T) {
	tok := testTokenizer(t)
	for _, tc := range []struct {
		name                       string
		groups, prompt, user, reqs int
		rate                       float64
		zipf                       float64
	}{
		{"uniform", 8, 100, 12, 4000, 50, 0},
		{"skewed", 8, 33, 5, 4000, 50, 1.5},
		{"one group", 1, 64, 1, 50, 2, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spec := fmt.Sprintf("prefix-groups:groups=%d,prompt=%d,user=%d,requests=%d,rate=%g,osl=9,zipf=%g,hints=true",
				tc.groups, tc.prompt, tc.user, tc.reqs, tc.rate, tc.zipf)
			w, err := Parse(spec, 5, tok)
			if err != nil {
				t.Fatal(err)
			}
			if len(w.Open) != tc.reqs || len(w.Sessions) != 0 {
				t.Fatalf("%d requests, %d sessions", len(w.Open), len(w.Sessions))
			}
			count := map[string]int{}
			users := map[string]bool{}
			var last time.Duration
			for i, r := range w.Open {
				if r.At < last || !r.Chat || r.MaxTokens != 9 || r.OSL != 9 || !r.IgnoreEOS || r.Tag != "group" || len(r.Messages) != 2 {
					t.Fatalf("request %d: %+v", i, r)
				}
				last = r.At
				count[r.Messages[0].Content]++
				users[r.Messages[1].Content] = true
				if i < 50 {
					if n := tokens(t, r.Messages[0].Content); n != tc.prompt {
						t.Errorf("system prompt of %d tokens, want %d", n, tc.prompt)
					}
					if n := tokens(t, r.Messages[1].Content); n != tc.user {
						t.Errorf("user message of %d tokens, want %d", n, tc.user)
					}
				}
			}
			if len(count) != tc.groups {
				t.Errorf("%d distinct system prompts, want %d", len(count), tc.groups)
			}
			if tc.user > 2 && len(users) != tc.reqs {
				t.Errorf("%d distinct user messages in %d requests", len(users), tc.reqs)
			}
			// Distinct groups differ from their first tokens on.
			var firsts []uint32
			for p := range count {
				firsts = append(firsts, tok.Encode(p)[0])
			}
			slices.Sort(firsts)
			if len(slices.Compact(firsts)) != tc.groups {
				t.Errorf("system prompts share first tokens: %v", firsts)
			}
			// Poisson arrivals: the mean gap is 1/rate (within 10% over thousands of gaps).
			if tc.reqs >= 1000 {
				mean := last.Seconds() / float64(tc.reqs)
				if want := 1 / tc.rate; mean < 0.9*want || mean > 1.1*want {
					t.Errorf("mean gap %.4fs, want about %.4fs", mean, want)
				}
			}
			if tc.zipf > 0 {
				counts := slices.Collect(func(yield func(int) bool) {
					for _, c := range count {
						if !yield(c) {
							return
						}
					}
				})
				slices.Sort(counts)
				if top := counts[len(counts)-1]; top < tc.reqs/3 {
					t.Errorf("zipf=%g: most popular group has %d of %d requests", tc.zipf, top, tc.reqs)
				}
			}
		})
	}
}

func TestMultiTurn(t *testing.T) {
	tok := testTokenizer(t)
	w, err := Parse("multi-turn:sessions=6,turns=4,system=50,systems=2,user=7,osl=11,think=1s", 9, tok)
	if err != nil {
		t.Fatal(err)
	}
	reqs := drive(t, w, wordAnswers(t), true)
	if len(reqs) != 6*4 {
		t.Fatalf("%d requests, want 24", len(reqs))
	}
	bySession := map[string][]sent{}
	systems := map[string]bool{}
	var think time.Duration
	for _, r := range reqs {
		bySession[r.Session] = append(bySession[r.Session], r)
		systems[r.Messages[0].Content] = true
		think += r.At
	}
	if len(bySession) != 6 || len(systems) != 2 {
		t.Errorf("%d sessions over %d system prompts, want 6 over 2", len(bySession), len(systems))
	}
	for id, turns := range bySession {
		for k, r := range turns {
			if !r.Chat || r.MaxTokens != 11 || !r.IgnoreEOS || r.Tag != "chat" || r.OSL != 0 || r.HasPriority {
				t.Errorf("%s turn %d: %+v", id, k, r.Request)
			}
			if want := 2 + 2*k; len(r.Messages) != want {
				t.Fatalf("%s turn %d: %d messages, want %d", id, k, len(r.Messages), want)
			}
			if tokens(t, r.Messages[0].Content) != 50 || tokens(t, r.Messages[len(r.Messages)-1].Content) != 7 {
				t.Errorf("%s turn %d: system or user message of the wrong length", id, k)
			}
			if k == 0 {
				continue
			}
			prev := turns[k-1]
			if !slices.EqualFunc(prev.Messages, r.Messages[:len(prev.Messages)], messageEqual) {
				t.Errorf("%s turn %d does not extend turn %d's messages", id, k, k-1)
			}
			if a := r.Messages[len(prev.Messages)]; a.Role != "assistant" || a.Content != prev.Answer {
				t.Errorf("%s turn %d: previous answer not appended: %+v", id, k, a)
			}
			// The rendered prompt of a turn extends the last one's, answer included: the
			// history is reusable.
			if k == 1 && id == "chat-0" {
				p, q := render(t, "harmony", prev.Messages), render(t, "harmony", r.Messages)
				if lcp(p, q) != len(p) {
					t.Errorf("turn %d's prompt does not start with turn %d's", k, k-1)
				}
			}
		}
	}
	if mean := think.Seconds() / float64(len(reqs)); mean < 0.5 || mean > 1.6 {
		t.Errorf("mean think time %.2fs, want about 1s", mean)
	}
}

func messageEqual(a, b Message) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// TestAgentic runs agent sessions through a sequential runner and checks the shape of what an
// agent harness sends.
func TestAgentic(t *testing.T) {
	tok := testTokenizer(t)
	for _, tc := range []struct {
		name      string
		spec      string
		toolCalls bool
	}{
		{"defaults", "agentic", true},
		{"small", "agentic:sessions=3,preamble=300,task=20,turns=3,rounds=4,tool=50,subagents=3,sub_task=15,sub_rounds=2,reasoning=16,osl=24,priority=5,sub_priority=2", true},
		{"plain-text tool calls", "agentic:sessions=2,preamble=300,task=20,turns=2,rounds=3,tool=50,subagents=1,sub_task=15,sub_rounds=2,reasoning=16,osl=24,toolcalls=false", false},
		{"no subagents, no reasoning", "agentic:sessions=2,preamble=100,rounds=2,subagents=0,reasoning=0,tool=30", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Parse(tc.spec, 11, tok)
			if err != nil {
				t.Fatal(err)
			}
			p, _ := parseParams("agentic", agenticParams, strings.TrimPrefix(w.Spec, "agentic:"), true)
			sessions, turns, rounds := p.int("sessions", 0, 1e9), p.int("turns", 0, 1e9), p.int("rounds", 0, 1e9)
			subagents, subRounds := p.int("subagents", 0, 1e9), p.int("sub_rounds", 0, 1e9)
			reasoning, osl, preamble := p.int("reasoning", 0, 1e9), p.int("osl", 0, 1e9), p.int("preamble", 0, 1e9)
			prio, subPrio := p.int("priority", -1e9, 1e9), p.int("sub_priority", -1e9, 1e9)

			reqs := drive(t, w, wordAnswers(t), true)
			if want := sessions * (turns*(rounds+1) + subagents*(subRounds+1)); len(reqs) != want {
				t.Fatalf("%d requests, want %d", len(reqs), want)
			}
			preambles := map[string]bool{}
			last := map[string]sent{}
			tags := map[string]int{}
			for i, r := range reqs {
				tags[r.Tag]++
				preambles[r.Messages[0].Content] = true
				if r.MaxTokens != reasoning+osl || r.OSL != reasoning+osl || !r.IgnoreEOS || !r.HasPriority || !r.Chat {
					t.Fatalf("request %d: %+v", i, r.Request)
				}
				switch r.Tag {
				case "interactive", "tool":
					if r.Priority != prio || r.Depth != 0 || strings.Contains(r.Session, "/") {
						t.Errorf("request %d (%s, %s): priority %d, want %d", i, r.Tag, r.Session, r.Priority, prio)
					}
				case "subagent", "fork":
					if r.Priority != subPrio || r.Depth != 1 || !strings.Contains(r.Session, "/sub-") {
						t.Errorf("request %d (subagent %s): priority %d, want %d", i, r.Session, r.Priority, subPrio)
					}
				default:
					t.Errorf("request %d: tag %q", i, r.Tag)
				}
				if r.Tag == "tool" && tc.toolCalls {
					if m := r.Messages[len(r.Messages)-1]; m.Role != "tool" || m.ToolCallID == "" || tokens(t, m.Content) < 10 {
						t.Errorf("request %d: last message %+v, want a tool result", i, m)
					}
				}
				// Within a session, each call extends the previous call's messages, and what
				// was appended of the previous answer is its final text only: the answer less
				// its first `reasoning` tokens.
				if prev, ok := last[r.Session]; ok {
					n := len(prev.Messages)
					if !slices.EqualFunc(prev.Messages, r.Messages[:n], messageEqual) {
						t.Fatalf("request %d does not extend the previous call of %s", i, r.Session)
					}
					a := r.Messages[n]
					wantFinal := cutTokens(tok, prev.Answer, reasoning)
					if a.Role != "assistant" || !strings.HasPrefix(a.Content, wantFinal) {
						t.Errorf("request %d: appended %+v, want the final text %q", i, a, wantFinal)
					}
					if tc.toolCalls && tokens(t, a.Content) != osl {
						t.Errorf("request %d: appended %d tokens of the answer, want %d", i, tokens(t, a.Content), osl)
					}
				}
				// A subagent starts from the spawning request's messages.
				if len(r.Spawn) > 0 {
					if len(r.Spawn) != subagents || r.Tag == "subagent" || r.Tag == "fork" {
						t.Errorf("request %d spawns %d sessions", i, len(r.Spawn))
					}
					for k := range r.Spawn {
						sub := firstOf(reqs, fmt.Sprintf("%s/sub-%d", r.Session, k))
						if sub == nil || !slices.EqualFunc(r.Messages, sub.Messages[:len(r.Messages)], messageEqual) {
							t.Errorf("subagent %d of request %d does not fork from its context", k, i)
						}
					}
				}
				last[r.Session] = r
			}
			if len(preambles) != 1 {
				t.Errorf("%d distinct preambles, want 1 shared", len(preambles))
			}
			for pre := range preambles {
				if n := tokens(t, pre); n != preamble {
					t.Errorf("preamble of %d tokens, want %d", n, preamble)
				}
				if preamble >= 1000 && !strings.Contains(pre, `"name": "read_file"`) {
					t.Error("preamble lacks the tools list")
				}
			}
			if tags["interactive"] != sessions*turns || tags["fork"] != sessions*subagents || tags["subagent"] != sessions*subagents*subRounds {
				t.Errorf("tags %v", tags)
			}
			// Subagent reports come back to the parent as the results of its task calls.
			if subagents > 0 {
				for _, r := range reqs {
					if (r.Tag != "subagent" && r.Tag != "fork") || !strings.HasSuffix(r.Session, "/sub-0") {
						continue
					}
					if _, ok := last[r.Session]; !ok {
						continue
					}
					final := cutTokens(tok, last[r.Session].Answer, reasoning)
					found := false
					for _, q := range reqs {
						if q.Session == strings.TrimSuffix(r.Session, "/sub-0") {
							for _, m := range q.Messages {
								found = found || strings.Contains(m.Content, final)
							}
						}
					}
					if !found {
						t.Errorf("%s's report never reaches its parent", r.Session)
					}
					break
				}
			}
			// Every request renders with the gpt-oss and Qwen3 templates, and within a session
			// each rendered prompt extends the previous one (harmony), so the history is reused.
			prevIDs := map[string][]uint32{}
			for i, r := range reqs {
				if tc.name == "defaults" && i%7 != 0 {
					continue
				}
				ids := render(t, "harmony", r.Messages)
				render(t, "chatml", r.Messages)
				if p, ok := prevIDs[r.Session]; ok && tc.name != "defaults" {
					if lcp(p, ids) != len(p) {
						t.Errorf("request %d's prompt does not extend %s's previous prompt", i, r.Session)
					}
				}
				prevIDs[r.Session] = ids
			}
		})
	}
}

func firstOf(reqs []sent, session string) *sent {
	for i := range reqs {
		if reqs[i].Session == session {
			return &reqs[i]
		}
	}
	return nil
}

// TestAgenticIgnoredSpawn checks that a runner that does not start spawned sessions still gets
// a well-formed parent conversation: stand-in reports fill the task results.
func TestAgenticIgnoredSpawn(t *testing.T) {
	w, err := Parse("agentic:sessions=1,preamble=50,rounds=2,subagents=2,reasoning=4,osl=8,tool=20", 1, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	reqs := drive(t, w, wordAnswers(t), false)
	if len(reqs) != 2*3 {
		t.Fatalf("%d requests, want 6", len(reqs))
	}
	results := 0
	for _, m := range reqs[len(reqs)-1].Messages {
		if m.Role == "tool" && m.Name == "task" {
			results++
			if tokens(t, m.Content) != 8 {
				t.Errorf("stand-in report of %d tokens, want osl=8", tokens(t, m.Content))
			}
		}
	}
	if results != 2 {
		t.Errorf("%d task results, want 2", results)
	}
	for _, r := range reqs {
		render(t, "harmony", r.Messages)
	}
}

// TestAgenticSessionRate checks rate=R: sessions start as a Poisson process at R per second,
// each sending its first request as it starts, in session order; without a rate every
// session starts at 0 and waits a think time.
func TestAgenticSessionRate(t *testing.T) {
	const n, rate = 400, 20.0
	spec := fmt.Sprintf("agentic:sessions=%d,rate=%g,preamble=40,task=6,rounds=1,subagents=0,tool=8", n, rate)
	w, err := Parse(spec, 3, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	var last time.Duration
	for i, s := range w.Sessions {
		r, ok := s.Next("")
		if !ok {
			t.Fatalf("session %d sent nothing", i)
		}
		if r.At <= last {
			t.Fatalf("session %d starts at %v, not after session %d's %v", i, r.At, i-1, last)
		}
		last = r.At
	}
	// n exponential gaps of mean 1/rate: the last start is n/rate = 20 s, standard deviation
	// sqrt(n)/rate = 1 s.
	if want := time.Duration(float64(n) / rate * float64(time.Second)); last < want-4*time.Second || last > want+4*time.Second {
		t.Errorf("last session starts at %v, want about %v", last, want)
	}

	w, err = Parse("agentic:sessions=50,preamble=40,task=6,rounds=1,subagents=0,tool=8", 3, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	sorted := true
	for i, s := range w.Sessions {
		r, _ := s.Next("")
		if i > 0 && r.At < last {
			sorted = false
		}
		last = r.At
	}
	if sorted {
		t.Error("without a rate the first requests' think times came out in session order")
	}
}

// session_ids=false sends the same calls in the same sessions, without naming the session.
func TestAgenticAnonymousSessions(t *testing.T) {
	const spec = "agentic:sessions=3,preamble=40,task=6,rounds=2,subagents=1,tool=8,reasoning=4,osl=6"
	named, err := Parse(spec, 5, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	anon, err := Parse(spec+",session_ids=false", 5, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	a, b := drive(t, named, wordAnswers(t), true), drive(t, anon, wordAnswers(t), true)
	if len(a) != len(b) || len(a) == 0 {
		t.Fatalf("%d requests named, %d anonymous", len(a), len(b))
	}
	for i := range a {
		if a[i].Session == "" || a[i].Session != b[i].Session || a[i].Anonymous || !b[i].Anonymous {
			t.Fatalf("request %d: session %q anonymous %v, then %q anonymous %v", i, a[i].Session, a[i].Anonymous, b[i].Session, b[i].Anonymous)
		}
		body := string(b[i].Body("m", true))
		if strings.Contains(body, "session_id") {
			t.Fatalf("request %d names its session: %s", i, body)
		}
		want := strings.Replace(string(a[i].Body("m", true)), fmt.Sprintf(`"session_id":%q,`, a[i].Session), "", 1)
		if body != want {
			t.Fatalf("request %d differs beyond its session id:\n%s\n%s", i, want, body)
		}
	}
}

// TestAgenticPreamblesPinsAndEphemeralOutput: preambles=2 alternates two distinct system
// messages across sessions; pin sends nvext.cache_control with its ttl; calls that generate
// reasoning say their output is ephemeral, unless ephemeral=false.
func TestAgenticPreamblesPinsAndEphemeralOutput(t *testing.T) {
	const spec = "agentic:sessions=4,preamble=400,task=6,rounds=1,subagents=0,tool=8,reasoning=4,osl=6,preambles=2,pin=5m"
	w, err := Parse(spec, 5, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	reqs := drive(t, w, wordAnswers(t), true)
	system := map[string]string{}
	for i, r := range reqs {
		system[r.Session] = r.Messages[0].Content
		body := string(r.Body("m", true))
		if !strings.Contains(body, `"cache_control":{"type":"ephemeral","ttl":"5m0s"}`) || !strings.Contains(body, `"ephemeral_output":true`) {
			t.Fatalf("request %d lacks its pin or ephemeral output: %s", i, body)
		}
	}
	if system["agent-0"] == system["agent-1"] || system["agent-0"] != system["agent-2"] || system["agent-1"] != system["agent-3"] {
		t.Fatal("sessions do not alternate between two distinct preambles")
	}
	w, err = Parse(strings.Replace(spec, ",preambles=2,pin=5m", ",ephemeral=false", 1), 5, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range drive(t, w, wordAnswers(t), true) {
		if body := string(r.Body("m", true)); strings.Contains(body, "cache_control") || strings.Contains(body, "ephemeral_output") {
			t.Fatalf("request %d pins or marks its output without being asked: %s", i, body)
		}
	}
}

// TestAgenticClientErrors: client_errors sends that share of the calls with max_tokens -1 (a
// request servers refuse), the sessions going on as before.
func TestAgenticClientErrors(t *testing.T) {
	const spec = "agentic:sessions=8,preamble=40,task=6,rounds=3,subagents=1,tool=8,reasoning=4,osl=6"
	clean, err := Parse(spec, 5, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	faulty, err := Parse(spec+",client_errors=0.3", 5, testTokenizer(t))
	if err != nil {
		t.Fatal(err)
	}
	a, b := drive(t, clean, wordAnswers(t), true), drive(t, faulty, wordAnswers(t), true)
	if len(a) != len(b) || len(a) < 40 {
		t.Fatalf("%d clean requests, %d with client errors", len(a), len(b))
	}
	bad := 0
	for i := range b {
		body := string(b[i].Body("m", true))
		if a[i].Invalid || strings.Contains(string(a[i].Body("m", true)), `"max_tokens":-1`) {
			t.Fatalf("request %d of the clean workload is invalid", i)
		}
		if b[i].Invalid {
			bad++
			if !strings.Contains(body, `"max_tokens":-1`) {
				t.Fatalf("invalid request %d: %s", i, body)
			}
		} else if body != string(a[i].Body("m", true)) {
			t.Fatalf("request %d differs beyond its validity", i)
		}
	}
	if share := float64(bad) / float64(len(b)); share < 0.15 || share > 0.45 {
		t.Fatalf("%d of %d requests invalid at client_errors=0.3", bad, len(b))
	}
}
