package kvindex

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
)

// TestTierViewFollowsSimulatedEngine drives a simulated engine with GPU, host and disk tiers
// (WORM eviction, pins, write-through) through a random agentic-shaped workload on a virtual
// clock, feeding every step's KV events to the index as the control plane would, and checks
// after every step that the index holds exactly the engine's blocks in each tier.
func TestTierViewFollowsSimulatedEngine(t *testing.T) {
	for _, tc := range []struct {
		name         string
		offload      sim.Offload
		evict        sim.Eviction
		placeholders bool
	}{
		{"write-through, lru", sim.OffloadOnStore, sim.EvictLRU, false},
		{"on eviction, worm", sim.OffloadOnEvict, sim.EvictWORM, false},
		{"write-through, lru, placeholders", sim.OffloadOnStore, sim.EvictLRU, true},
		{"on eviction, worm, placeholders", sim.OffloadOnEvict, sim.EvictWORM, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := sim.DefaultConfig()
			cfg.NumGPUBlocks, cfg.MaxNumSeqs, cfg.MaxNumBatchedTokens = 96, 4, 512
			cfg.CPUOffloadBlocks = 128
			cfg.DiskOffloadDir, cfg.DiskOffloadBlocks, cfg.DiskAdmitMinHits = t.TempDir(), 256, 1
			cfg.OffloadOn, cfg.Eviction = tc.offload, tc.evict
			x := New()
			var step int
			sink := sim.NewEventSink(liveCopies(t, x, &step), cfg.BlockSize, false, tc.placeholders)
			e, err := sim.NewEngine(cfg, []uint32{7, 8, 9}, sink, nil)
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(5, 6))
			now := time.Unix(1000, 0)
			var reqs []*sim.Request
			var prompts [][]uint32
			for step = 0; step < 3000; step++ {
				if rng.IntN(4) == 0 && len(reqs) < 400 {
					// A session prefix (one of 6) and a tail, or an earlier prompt grown by
					// a turn (conversations come back); sometimes pinned.
					var toks []uint32
					if len(prompts) > 0 && rng.IntN(2) == 0 {
						prev := prompts[rng.IntN(len(prompts))]
						toks = append(append([]uint32(nil), prev...), randomTokens(rng, 1+rng.IntN(40))...)
						if len(toks) > 400 {
							toks = toks[:400]
						}
					} else {
						fam := uint32(rng.IntN(6))
						for i := range 64 {
							toks = append(toks, fam*1_000_003+uint32(i))
						}
						toks = append(toks, randomTokens(rng, 16*rng.IntN(6)+rng.IntN(16))...)
					}
					prompts = append(prompts, toks)
					p := sim.Params{MaxTokens: 1 + rng.IntN(40), IgnoreEOS: true, EphemeralOutput: rng.IntN(2) == 0}
					if rng.IntN(5) == 0 {
						p.PinTTL = time.Duration(1+rng.IntN(20)) * time.Second
					}
					r, err := e.NewRequest("r", toks, blockhash.Keys{}, p)
					if err != nil {
						t.Fatal(err)
					}
					e.Submit(r)
					reqs = append(reqs, r)
				}
				end, busy := e.StepAt(now)
				if busy {
					now = end
				} else {
					now = now.Add(50 * time.Millisecond)
				}
				checkTierView(t, x, e, step, tc.placeholders)
				if t.Failed() {
					return
				}
			}
			b := x.Blocks("w")
			t.Logf("index after the run: %d GPU, %d host, %d disk blocks; stats %+v", b[GPU], b[Host], b[Disk], x.Stats())
			if b[Host] == 0 || b[Disk] == 0 {
				t.Fatalf("the workload never reached host (%d) or disk (%d): the test checks nothing below GPU", b[Host], b[Disk])
			}
			if st := x.Stats(); tc.placeholders != (st.Placeholders > 0) || st.Placeholders < st.PlaceholdersResolved {
				t.Fatalf("placeholders %v: stats %+v", tc.placeholders, st)
			}
		})
	}
}

// liveCopies applies each batch to x after checking that the engine announces blocks as
// vLLM does: the simulated engine keeps one copy of a block per tier, so it must not store a
// block a tier holds before announcing that copy's removal (an index counting copies would
// keep it forever).
func liveCopies(t *testing.T, x *Index, step *int) func(b *kvevents.Batch) error {
	live := map[[2]string]bool{}
	return func(b *kvevents.Batch) error {
		for _, ev := range b.Events {
			for _, h := range ev.BlockHashes {
				k := [2]string{ev.Medium, h.String()}
				switch ev.Kind {
				case kvevents.BlockStored:
					if live[k] {
						t.Errorf("step %d: block %s stored in %s again before its removal", *step, h, ev.Medium)
					}
					live[k] = true
				case kvevents.BlockRemoved:
					delete(live, k)
				}
			}
		}
		x.Apply("w", b, nil)
		return nil
	}
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(rng.IntN(50000))
	}
	return t
}

// checkTierView checks that the index holds exactly the engine's blocks in each tier; with
// placeholders (lower tiers announced by hash alone), that it holds no block the engine does
// not, and every block the engine holds on its GPU.
func checkTierView(t *testing.T, x *Index, e *sim.Engine, step int, placeholders bool) {
	t.Helper()
	tiers := map[string]Tier{sim.MediumGPU: GPU, sim.MediumCPU: Host, sim.MediumDISK: Disk}
	want := map[[2]uint64]bool{}
	e.EachBlock(func(seq uint64, medium string) { want[[2]uint64{seq, uint64(tiers[medium])}] = true })
	got := map[[2]uint64]bool{}
	x.Each(func(seq uint64, slot int, tier Tier) { got[[2]uint64{seq, uint64(tier)}] = true })
	for k := range want {
		if !got[k] && !(placeholders && Tier(k[1]) != GPU) {
			t.Errorf("step %d: the engine holds %x in tier %d, the index does not", step, k[0], k[1])
			return
		}
	}
	for k := range got {
		if !want[k] {
			t.Errorf("step %d: the index holds %x in tier %d, the engine does not", step, k[0], k[1])
			return
		}
	}
}
