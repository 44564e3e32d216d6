package workload

import "testing"

// TestFixed checks the prefill-heavy synthetic load: every prompt exactly isl tokens, unique
// from its first block on (no prefix cache hits past the chat template), exact output length,
// Poisson arrivals at the rate.
func TestFixed(t *testing.T) {
	tok := testTokenizer(t)
	const isl, osl, n, rate = 3000, 150, 400, 4.0
	for _, chat := range []bool{true, false} {
		spec := "fixed:isl=3000,osl=150,requests=400,rate=4,chat=false"
		if chat {
			spec = "fixed:isl=3000,osl=150,requests=400,rate=4"
		}
		w, err := Parse(spec, 7, tok)
		if err != nil {
			t.Fatal(err)
		}
		if len(w.Open) != n || len(w.Sessions) != 0 || w.Name != "fixed" {
			t.Fatalf("%s: %d requests, %d sessions", w.Name, len(w.Open), len(w.Sessions))
		}
		firstBlocks := map[string]bool{}
		for i, r := range w.Open {
			if r.Chat != chat || r.MaxTokens != osl || !r.IgnoreEOS || r.Tag != "fixed" || r.OSL != 0 {
				t.Fatalf("request %d: %+v", i, r)
			}
			if i > 0 && r.At < w.Open[i-1].At {
				t.Fatalf("request %d sent before request %d", i, i-1)
			}
			text := r.Prompt
			if chat {
				if len(r.Messages) != 1 || r.Messages[0].Role != "user" || r.Prompt != "" {
					t.Fatalf("request %d messages %+v", i, r.Messages)
				}
				text = r.Messages[0].Content
			}
			ids := tok.Encode(text)
			if i < 40 && len(ids) != isl {
				t.Fatalf("request %d: %d prompt tokens, want %d", i, len(ids), isl)
			}
			firstBlocks[tok.Decode(ids[:16])] = true
		}
		if len(firstBlocks) != n {
			t.Errorf("chat=%v: %d distinct first blocks in %d prompts", chat, len(firstBlocks), n)
		}
		mean := w.Open[n-1].At.Seconds() / n
		if want := 1 / rate; mean < 0.85*want || mean > 1.15*want {
			t.Errorf("mean gap %.3fs, want about %.3fs", mean, want)
		}
	}
	// The chat template adds the same few tokens to every prompt.
	w, err := Parse("fixed:isl=100,requests=3", 1, tok)
	if err != nil {
		t.Fatal(err)
	}
	var overhead []int
	for _, tmpl := range []string{"harmony", "chatml"} {
		for _, r := range w.Open {
			overhead = append(overhead, len(render(t, tmpl, r.Messages))-100)
		}
	}
	t.Logf("chat template overhead (harmony ×3, chatml ×3): %v tokens", overhead)
	if overhead[0] != overhead[1] || overhead[0] != overhead[2] || overhead[0] <= 0 || overhead[0] > 128 {
		t.Errorf("harmony overhead %v", overhead[:3])
	}
}
