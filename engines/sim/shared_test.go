package sim

import (
	"strconv"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// TestSharedDiskTier: two workers mounting one directory as their disk tier (shared storage):
// a prompt one of them computed and wrote there is loaded by the other, which never saw it;
// the writer announces it as vLLM's fs tier on shared storage.
func TestSharedDiskTier(t *testing.T) {
	dir := t.TempDir()
	mount := func(c *WorkerConfig) {
		c.Engine.NumGPUBlocks, c.Engine.CPUOffloadBlocks = 256, 64
		c.Engine.DiskOffloadDir, c.Engine.DiskOffloadBlocks, c.Engine.DiskAdmitMinHits = dir, 512, 0
		c.Engine.DiskShared = true
	}
	a, b := startWorker(t, mount), startWorker(t, mount)
	prompt := "shared " + longText(480)
	body := `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":2}`
	first := chatUsage(t, a, body)
	if first.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("a's first call found %d tokens cached", first.PromptTokensDetails.CachedTokens)
	}
	chatUsage(t, a, body) // a hit: the blocks earn their place on disk (write-through)
	if st := a.Engine().TierStats(); st.OffloadedDisk < 20 {
		t.Fatalf("a wrote %d blocks to the shared directory", st.OffloadedDisk)
	}
	got := chatUsage(t, b, body)
	if got.PromptTokensDetails.CachedTokens < got.PromptTokens-32 {
		t.Fatalf("b loaded %d of %d tokens from the shared directory", got.PromptTokensDetails.CachedTokens, got.PromptTokens)
	}
	if st := b.Engine().TierStats(); st.CachedByTier[tierDisk] == 0 || st.OffloadedDisk != 0 {
		t.Fatalf("b's totals %+v: want its hits from the shared tier, and nothing written (a wrote it all)", st)
	}
}

// TestSharedTierEvents: the shared tier's stores and removals are published as vLLM's fs
// tier on shared storage: STORAGE, locality REMOTE, ownership fs; placeholders keep them.
func TestSharedTierEvents(t *testing.T) {
	for _, placeholders := range []bool{false, true} {
		var got []kvevents.Event
		sink := NewEventSink(func(b *kvevents.Batch) error {
			got = append(got, b.Events...)
			return nil
		}, 16, false, placeholders)
		toks := make([]uint32, 16)
		sink.CacheEvents(time.Unix(1, 0), []CacheEvent{
			{Kind: BlocksStored, Medium: MediumShared, Hashes: []uint64{7}, Tokens: toks},
			{Kind: BlocksRemoved, Medium: MediumShared, Hashes: []uint64{7}},
			{Kind: BlocksStored, Medium: MediumDISK, Hashes: []uint64{8}, Tokens: toks},
		})
		if len(got) != 3 {
			t.Fatalf("%d events", len(got))
		}
		for i, ev := range got[:2] {
			if ev.Medium != "STORAGE" || ev.Locality != "REMOTE" || ev.Ownership != SharedOwner {
				t.Fatalf("placeholders %v: event %d %+v", placeholders, i, ev)
			}
		}
		if ev := got[2]; ev.Medium != "STORAGE" || ev.Locality != "LOCAL" || ev.Ownership != "" {
			t.Fatalf("local disk event %+v", ev)
		}
		if placeholders && (got[0].BlockSize != 0 || len(got[0].TokenIDs) != 0) {
			t.Fatalf("a placeholder with tokens: %+v", got[0])
		}
	}
}
