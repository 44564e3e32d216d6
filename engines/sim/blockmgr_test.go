package sim

import (
	"os"
	"slices"
	"testing"
	"time"
)

// tierOf returns the media a hash was last stored in and not removed from since, per the
// recorded events: the tier view an index following them has.
func tierView(rec *recorder) map[string]map[uint64]bool {
	view := map[string]map[uint64]bool{MediumGPU: {}, MediumCPU: {}, MediumDISK: {}}
	for _, ev := range rec.events {
		m := mediumOf(ev.Medium)
		switch ev.Kind {
		case BlocksStored:
			for _, h := range ev.Hashes {
				view[m][h] = true
			}
		case BlocksRemoved:
			for _, h := range ev.Hashes {
				delete(view[m], h)
			}
		case AllBlocksCleared:
			for _, v := range view {
				clear(v)
			}
		}
	}
	return view
}

// engineView is what the engine's tiers really hold.
func engineView(e *Engine) map[string]map[uint64]bool {
	view := map[string]map[uint64]bool{MediumGPU: {}, MediumCPU: {}, MediumDISK: {}}
	e.kvm.pool.Each(func(h uint64) { view[MediumGPU][h] = true })
	for _, t := range []*lowerTier{e.kvm.host, e.kvm.disk} {
		if t == nil {
			continue
		}
		for h := range t.entries {
			view[t.medium][h] = true
		}
	}
	return view
}

func checkViews(t *testing.T, e *Engine, rec *recorder) {
	t.Helper()
	ev, en := tierView(rec), engineView(e)
	for _, m := range []string{MediumGPU, MediumCPU, MediumDISK} {
		for h := range en[m] {
			if !ev[m][h] {
				t.Errorf("%s holds %x but its events do not say so", m, h)
			}
		}
		for h := range ev[m] {
			if !en[m][h] {
				t.Errorf("events say %s holds %x but it does not", m, h)
			}
		}
	}
}

// eventIndex is the position of the first event of kind in medium naming h, -1 if none.
func eventIndex(rec *recorder, kind CacheEventKind, medium string, h uint64) int {
	for i, ev := range rec.events {
		if ev.Kind == kind && mediumOf(ev.Medium) == medium && slices.Contains(ev.Hashes, h) {
			return i
		}
	}
	return -1
}

// TestOffloadOnEvictAndOnboard: blocks the GPU evicts go to host, stored there before they
// are removed from the GPU; a later request finds them on host, pays the onboarding time
// and counts them as cached.
func TestOffloadOnEvictAndOnboard(t *testing.T) {
	e, rec, c := newTestEngine(t, func(cfg *Config) {
		cfg.NumGPUBlocks = 10
		cfg.CPUOffloadBlocks = 32
		cfg.OffloadOn = OffloadOnEvict
	})
	a := prompt(64, 1)
	submit(t, e, a, Params{MaxTokens: 8, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	for seed := uint32(2); seed < 5; seed++ {
		submit(t, e, prompt(64, seed), Params{MaxTokens: 8, IgnoreEOS: true})
		c.runUntilIdle(t, 100)
	}
	aHashes := e.mustHashes(t, a)
	for _, h := range aHashes[:4] {
		if e.kvm.onGPU(h) {
			t.Fatalf("block %x of the first prompt still on the GPU: the test does not evict", h)
		}
		stored, removed := eventIndex(rec, BlocksStored, MediumCPU, h), eventIndex(rec, BlocksRemoved, MediumGPU, h)
		if stored < 0 || removed < 0 || stored > removed {
			t.Fatalf("block %x: CPU store at event %d, GPU removal at %d: want the store first", h, stored, removed)
		}
	}
	checkViews(t, e, rec)
	r := submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.e.drain(c.now)
	c.e.planAt = c.now
	c.e.plan()
	onboard := c.e.batch.Onboard
	// 3 blocks: the last of the 4 full ones holds the last prompt token, always computed.
	want := time.Duration(float64(3*16*e.cfg.KVBytesPerToken) / e.cfg.HostBandwidth * float64(time.Second))
	if onboard != want {
		t.Fatalf("onboarding 3 host blocks priced %v, want %v", onboard, want)
	}
	c.now = c.now.Add(c.e.stepTime())
	c.e.apply(c.now)
	c.runUntilIdle(t, 100)
	if _, _, _, cached := result(r); cached != 48 {
		t.Fatalf("cached %d tokens, want 48 (3 blocks from host)", cached)
	}
	if st := e.TierStats(); st.CachedByTier != [3]int64{0, 48, 0} || st.OffloadedCPU == 0 {
		t.Fatalf("tier stats %+v: want 48 tokens found on host, blocks offloaded", st)
	}
	checkViews(t, e, rec)
}

// TestWriteThroughAndDiskAdmission: offloading on store copies every block to host as the
// GPU stores it; host evicts to disk only blocks reused at least DiskAdmitMinHits times, as
// files whose bytes read back; a one-shot block leaves host for nowhere.
func TestWriteThroughAndDiskAdmission(t *testing.T) {
	dir := t.TempDir()
	e, rec, c := newTestEngine(t, func(cfg *Config) {
		cfg.NumGPUBlocks = 10
		cfg.CPUOffloadBlocks = 8
		cfg.DiskOffloadDir, cfg.DiskOffloadBlocks = dir, 64
		cfg.DiskAdmitMinHits = 2
	})
	hot := prompt(64, 1)
	for range 3 { // stored, then hit twice
		submit(t, e, hot, Params{MaxTokens: 1, IgnoreEOS: true})
		c.runUntilIdle(t, 100)
	}
	hotHashes := e.mustHashes(t, hot)
	if i, j := eventIndex(rec, BlocksStored, MediumGPU, hotHashes[0]), eventIndex(rec, BlocksStored, MediumCPU, hotHashes[0]); i < 0 || j < i {
		t.Fatalf("write-through: GPU store at event %d, CPU store at %d", i, j)
	}
	var cold [][]uint64
	for seed := uint32(2); seed < 8; seed++ {
		p := prompt(64, seed)
		submit(t, e, p, Params{MaxTokens: 1, IgnoreEOS: true})
		c.runUntilIdle(t, 100)
		cold = append(cold, e.mustHashes(t, p))
	}
	// Hot blocks were reused twice: on disk, with their files. The first cold prompt's
	// blocks were seen once: off host and never on disk.
	for _, h := range hotHashes[:3] {
		if !e.kvm.disk.has(h) {
			t.Fatalf("hot block %x not on disk", h)
		}
		if _, err := os.Stat(e.kvm.disk.path(h)); err != nil {
			t.Fatalf("hot block's file: %v", err)
		}
	}
	for _, h := range cold[0] {
		if e.kvm.host.has(h) || e.kvm.disk.has(h) || eventIndex(rec, BlocksStored, MediumDISK, h) >= 0 {
			t.Fatalf("one-shot block %x kept below the GPU", h)
		}
	}
	checkViews(t, e, rec)
	// The hot prompt comes back from disk (its GPU and host copies are gone).
	for _, h := range hotHashes[:3] {
		if e.kvm.onGPU(h) || e.kvm.host.has(h) {
			t.Fatalf("hot block %x still above disk: the test does not push it down", h)
		}
	}
	r := submit(t, e, hot, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	if _, _, _, cached := result(r); cached < 48 {
		t.Fatalf("hot prompt from disk cached %d tokens, want at least 48", cached)
	}
	checkViews(t, e, rec)
}

// smallDiskEngine has 10 GPU blocks, 4 on host and 64 on disk, every block admitted to disk.
func smallDiskEngine(t *testing.T) (*Engine, *recorder, *vclock) {
	t.Helper()
	dir := t.TempDir()
	return newTestEngine(t, func(cfg *Config) {
		cfg.NumGPUBlocks = 10
		cfg.CPUOffloadBlocks = 4
		cfg.DiskOffloadDir, cfg.DiskOffloadBlocks = dir, 64
		cfg.DiskAdmitMinHits = 0
	})
}

// pushDown runs four other 64-token prompts, which push what came before below the GPU and
// host tiers of a smallDiskEngine.
func pushDown(t *testing.T, e *Engine, c *vclock) {
	t.Helper()
	for seed := uint32(2); seed < 6; seed++ {
		submit(t, e, prompt(64, seed), Params{MaxTokens: 1, IgnoreEOS: true})
		c.runUntilIdle(t, 100)
	}
}

// corruptBlockFile flips a byte of the disk tier's file of block h and returns its path.
func corruptBlockFile(t *testing.T, e *Engine, h uint64) string {
	t.Helper()
	f := e.kvm.disk.path(h)
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	b[3] ^= 0xff
	if err := os.WriteFile(f, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestCorruptDiskBlockIsAMiss: a block file whose bytes are wrong is a miss — counted, its
// file removed, its removal published — and the request computes from there.
func TestCorruptDiskBlockIsAMiss(t *testing.T) {
	e, rec, c := smallDiskEngine(t)
	a := prompt(64, 1)
	submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	pushDown(t, e, c)
	h := e.mustHashes(t, a)
	if !e.kvm.disk.has(h[1]) || e.kvm.host.has(h[1]) {
		t.Fatal("block 1 of the first prompt is not on disk alone: the test does not push it down")
	}
	f := corruptBlockFile(t, e, h[1])
	r := submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	if _, _, _, cached := result(r); cached != 16 {
		t.Fatalf("cached %d tokens, want 16: block 0 from disk, block 1 corrupt and computed from there", cached)
	}
	if _, err := os.Stat(f); !os.IsNotExist(err) {
		t.Fatalf("corrupt block file still there: %v", err)
	}
	if eventIndex(rec, BlocksRemoved, MediumDISK, h[1]) < 0 {
		t.Fatal("the corrupt block's removal from disk was not published")
	}
	checkViews(t, e, rec)
}

// TestFullDiskKeepsBlockOff: a write that fails (ENOSPC, from /dev/full) leaves the block off
// disk and is counted; nothing is announced.
func TestFullDiskKeepsBlockOff(t *testing.T) {
	if _, err := os.Stat("/dev/full"); err != nil {
		t.Skip("no /dev/full to make a full disk with")
	}
	e, rec, c := smallDiskEngine(t)
	a := prompt(64, 1)
	h := e.mustHashes(t, a)
	for _, x := range h {
		if err := os.Symlink("/dev/full", e.kvm.disk.path(x)); err != nil {
			t.Fatal(err)
		}
	}
	submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	pushDown(t, e, c)
	for _, x := range h[:4] {
		if e.kvm.disk.has(x) || eventIndex(rec, BlocksStored, MediumDISK, x) >= 0 {
			t.Fatalf("block %x announced on a full disk", x)
		}
	}
	checkViews(t, e, rec)
}

// TestWORMEvictsEphemeralFirst: under EvictWORM the generated blocks of a chat answer go
// before an older prompt's blocks; under LRU the older prompt goes first.
func TestWORMEvictsEphemeralFirst(t *testing.T) {
	for _, tc := range []struct {
		eviction    Eviction
		oldSurvives bool
	}{{EvictLRU, false}, {EvictWORM, true}} {
		t.Run(string(tc.eviction), func(t *testing.T) {
			e, _, c := newTestEngine(t, func(cfg *Config) { cfg.NumGPUBlocks = 12; cfg.Eviction = tc.eviction })
			old := prompt(64, 1) // 4 blocks
			submit(t, e, old, Params{MaxTokens: 1, IgnoreEOS: true})
			c.runUntilIdle(t, 100)
			// 32 prompt tokens and 64 generated: 2 prompt blocks, 4 of output.
			submit(t, e, prompt(32, 2), Params{MaxTokens: 65, IgnoreEOS: true, EphemeralOutput: true})
			c.runUntilIdle(t, 200)
			// A new request needing 4 blocks: 12 − 4 − 6 = 2 never-used blocks, then evictions.
			submit(t, e, prompt(48, 3), Params{MaxTokens: 8, IgnoreEOS: true})
			c.runUntilIdle(t, 100)
			kept := 0
			for _, h := range e.mustHashes(t, old) {
				if e.kvm.onGPU(h) {
					kept++
				}
			}
			if got := kept == 4; got != tc.oldSurvives {
				t.Fatalf("%s: %d of the old prompt's 4 blocks kept", tc.eviction, kept)
			}
		})
	}
}

// TestPinsLastRenewedAndCapped: a pinned prefix outlives pressure that evicts everything
// else, a hit renews its pin, it goes once the pin lapses, and pins beyond the cap are
// refused.
func TestPinsLastRenewedAndCapped(t *testing.T) {
	e, _, c := newTestEngine(t, func(cfg *Config) {
		cfg.NumGPUBlocks = 16
		cfg.Eviction = EvictWORM
		cfg.MaxPinnedFraction = 0.25 // 4 blocks
	})
	pinned := prompt(64, 1)
	submit(t, e, pinned, Params{MaxTokens: 1, IgnoreEOS: true, PinTTL: time.Minute})
	c.runUntilIdle(t, 100)
	ph := e.mustHashes(t, pinned)
	if e.kvm.pinned != 4 {
		t.Fatalf("%d blocks pinned, want 4", e.kvm.pinned)
	}
	// A second pinned prompt finds the cap reached.
	submit(t, e, prompt(64, 9), Params{MaxTokens: 1, IgnoreEOS: true, PinTTL: time.Minute})
	c.runUntilIdle(t, 100)
	if e.kvm.pinned != 4 {
		t.Fatalf("%d blocks pinned past a cap of 4", e.kvm.pinned)
	}
	pressure := func(seed uint32) {
		for s := seed; s < seed+4; s++ {
			submit(t, e, prompt(160, s), Params{MaxTokens: 1, IgnoreEOS: true})
			c.runUntilIdle(t, 100)
		}
	}
	// The hits renew the 3 blocks a 64-token prompt reuses (its last block holds the last
	// token, always computed).
	cachedCount := func() (n int) {
		for _, h := range ph[:3] {
			if e.kvm.onGPU(h) {
				n++
			}
		}
		return n
	}
	pressure(100)
	if n := cachedCount(); n != 3 {
		t.Fatalf("pinned prefix lost %d blocks to pressure", 3-n)
	}
	// 50 s later a hit renews the pin for another minute.
	c.now = c.now.Add(50 * time.Second)
	submit(t, e, pinned, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	c.now = c.now.Add(50 * time.Second) // 100 s after the pin, 50 s after the hit
	pressure(200)
	if n := cachedCount(); n != 3 {
		t.Fatalf("renewed pin lost %d blocks", 3-n)
	}
	c.now = c.now.Add(2 * time.Minute)
	pressure(300)
	if n := cachedCount(); n != 0 {
		t.Fatalf("%d blocks survived after their pin lapsed", n)
	}
	if e.kvm.pinned != 0 {
		t.Fatalf("%d pins counted after all lapsed", e.kvm.pinned)
	}
}

// TestOnboardWhatFits: a prompt whose blocks wait in host memory comes up while a running
// request holds most of the GPU. Bringing all of them back does not fit; the engine brings
// back the longest prefix that fits beside the prompt's next chunk and computes the rest,
// instead of waiting for the running request to end.
func TestOnboardWhatFits(t *testing.T) {
	e, rec, c := newTestEngine(t, func(cfg *Config) {
		cfg.NumGPUBlocks = 16
		cfg.CPUOffloadBlocks = 64
		cfg.MaxNumBatchedTokens = 32 // chunks of 2 blocks
	})
	a := prompt(128, 1) // 8 blocks; 7 can hit (the last holds the last token)
	submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	for seed := uint32(2); seed < 5; seed++ { // push a out of the GPU; it stays on host
		submit(t, e, prompt(128, seed), Params{MaxTokens: 1, IgnoreEOS: true})
		c.runUntilIdle(t, 100)
	}
	for _, h := range e.mustHashes(t, a)[:7] {
		if e.kvm.onGPU(h) {
			t.Fatalf("block %x of a still on the GPU: the test does not evict", h)
		}
	}
	long := submit(t, e, prompt(128, 9), Params{MaxTokens: 40, IgnoreEOS: true}) // 8 blocks, growing to 11
	for range 8 {
		c.step()
	}
	if _, done, _, _ := result(long); done {
		t.Fatal("the long request finished before a came up")
	}
	r := submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.step()
	if r.state == stateWaiting {
		t.Fatalf("a waits for all 7 of its host blocks to fit: %d free", e.kvm.numFree())
	}
	c.runUntilIdle(t, 200)
	_, done, _, cached := result(r)
	if !done || cached <= 0 || cached >= 112 {
		t.Fatalf("a done %v with %d tokens cached: want some of its 112 brought back, not all", done, cached)
	}
	if st := e.TierStats(); st.OnboardSkipped != int64((112-cached)/16) {
		t.Fatalf("%d blocks counted as skipped, want %d", st.OnboardSkipped, (112-cached)/16)
	}
	checkViews(t, e, rec)
}

// mediumOf is an engine cache event's medium, "" read as GPU.
func mediumOf(m string) string {
	if m == "" {
		return MediumGPU
	}
	return m
}
