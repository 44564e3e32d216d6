package sim

import "testing"

// TestLearnWriteOnce: an engine that learns write-once output, with no client hint, marks
// generated blocks ephemeral once it has seen that later requests do not resend them
// (distinct prompts each time), and does not where each request resends the last one's
// answer (a conversation that keeps its history); one request in writeOnceProbe stays a
// probe either way.
func TestLearnWriteOnce(t *testing.T) {
	for _, tc := range []struct {
		name      string
		resend    bool
		writeOnce bool
	}{{"answers never resent", false, true}, {"answers resent", true, false}} {
		t.Run(tc.name, func(t *testing.T) {
			e, _, c := newTestEngine(t, func(cfg *Config) {
				cfg.NumGPUBlocks, cfg.Eviction, cfg.LearnWriteOnce = 96, EvictWORM, true
			})
			history := prompt(32, 1)
			for i := range 60 {
				p := prompt(32, uint32(100+i))
				if tc.resend {
					p = history
				}
				r := submit(t, e, p, Params{MaxTokens: 48, IgnoreEOS: true})
				c.runUntilIdle(t, 500)
				out, _, _, _ := r.Output(nil, 0)
				if tc.resend {
					history = append(append([]uint32(nil), history...), out...)
					if len(history) > 1200 {
						history = prompt(32, uint32(1000+i)) // a new conversation
					}
				}
			}
			share, ok := e.kvm.writeOnce.share()
			t.Logf("resent share %.2f (enough observations: %v)", share, ok)
			if got := ok && share < writeOnceShare; got != tc.writeOnce {
				t.Fatalf("learned write-once %v (share %.2f, enough %v), want %v", got, share, ok, tc.writeOnce)
			}
			// A request that is not a probe: its generated blocks are marked as learned.
			r := submit(t, e, prompt(32, 7777), Params{MaxTokens: 48, IgnoreEOS: true})
			if r.seqNo%writeOnceProbe == 0 {
				r = submit(t, e, prompt(32, 7778), Params{MaxTokens: 48, IgnoreEOS: true})
			}
			c.runUntilIdle(t, 500)
			marked := 0
			for _, h := range r.hashes[2:] { // past the prompt's 2 blocks
				if b := e.kvm.meta[h]; b != nil && b.ephemeral {
					marked++
				}
			}
			if (marked > 0) != tc.writeOnce {
				t.Fatalf("%d generated blocks marked ephemeral, want some: %v", marked, tc.writeOnce)
			}
		})
	}
}
