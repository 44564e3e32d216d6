package sim

import (
	"testing"
)

// TestAdmitKeepsLaterGPUHits: a prompt whose cached prefix is [GPU, host, GPU] — its second
// block evicted from the GPU while the third stayed, which two requests sharing a prefix
// leave behind — is admitted with its third block at the head of the free queue once the
// first is taken. Bringing the host block back must not evict the GPU hit after it: the
// request reuses all three blocks, two from the GPU and one from host, and the third stays
// on the GPU (no tier read for a block that is not there, no block lost, no wrong count).
func TestAdmitKeepsLaterGPUHits(t *testing.T) {
	for _, tc := range []struct {
		name    string
		offload Offload
		disk    bool
	}{
		{"host tier, offload on eviction", OffloadOnEvict, false},
		{"host and disk tiers, offload on eviction", OffloadOnEvict, true},
		{"host tier, write-through", OffloadOnStore, false},
		{"host and disk tiers, write-through", OffloadOnStore, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, rec, c := newTestEngine(t, func(cfg *Config) {
				cfg.NumGPUBlocks = 8
				cfg.CPUOffloadBlocks = 32
				cfg.OffloadOn = tc.offload
				if tc.disk {
					cfg.DiskOffloadDir, cfg.DiskOffloadBlocks = t.TempDir(), 32
				}
			})
			p := prompt(64, 1)
			h := e.mustHashes(t, p)
			// One step admits both and both finish in it. The first computes blocks 0 and 1
			// first and caches them (the second's copies stay anonymous); the second caches
			// block 2. The first frees its blocks before the second: the free queue is
			// [2 never used, the first's partial block, 1, 0, 2, the second's copies].
			submit(t, e, p[:33], Params{MaxTokens: 1, IgnoreEOS: true})
			submit(t, e, p[:48], Params{MaxTokens: 1, IgnoreEOS: true})
			c.step()
			// A 4-block prompt evicts the 2 never-used blocks, the partial one and block 1,
			// then frees its own behind the rest: [0, 2, ...].
			submit(t, e, prompt(64, 2), Params{MaxTokens: 1, IgnoreEOS: true})
			c.runUntilIdle(t, 10)
			if !e.kvm.onGPU(h[0]) || e.kvm.onGPU(h[1]) || !e.kvm.host.has(h[1]) || !e.kvm.onGPU(h[2]) {
				t.Fatalf("prefix not [GPU, host, GPU]: on GPU %v %v %v, block 1 on host %v: the test does not set up its case",
					e.kvm.onGPU(h[0]), e.kvm.onGPU(h[1]), e.kvm.onGPU(h[2]), e.kvm.host.has(h[1]))
			}
			r := submit(t, e, p, Params{MaxTokens: 1, IgnoreEOS: true})
			c.runUntilIdle(t, 10)
			if _, done, _, cached := result(r); !done || cached != 48 {
				t.Fatalf("done %v, %d tokens cached: want the 3 blocks of the prefix (48)", done, cached)
			}
			if st := e.TierStats(); st.CachedByTier != [3]int64{32, 16, 0} || st.DiskReadBytes != 0 {
				t.Fatalf("cached by tier %v, %d disk bytes read: want 32 tokens from the GPU, 16 from host, no disk read",
					st.CachedByTier, st.DiskReadBytes)
			}
			for i, x := range h[:3] {
				if !e.kvm.onGPU(x) {
					t.Errorf("block %d of the prefix left the GPU", i)
				}
			}
			checkViews(t, e, rec)
		})
	}
}
