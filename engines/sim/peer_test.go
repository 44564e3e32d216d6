package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// peerBody is a chat request that fetches its prefix from holder (http://host:port), with
// vLLM's remote_kv_source.
func peerBody(prompt, holder string) string {
	u, err := url.Parse(holder)
	if err != nil {
		panic(err)
	}
	return `{"messages":[{"role":"user","content":` + strconv.Quote(prompt) + `}],"max_tokens":4,` +
		`"kv_transfer_params":{"remote_kv_source":{"kv_request_id":"pull-1","remote_host":` + strconv.Quote(u.Hostname()) +
		`,"remote_port":` + u.Port() + `}}}`
}

func chatUsage(t *testing.T, w *Worker, body string) usage {
	t.Helper()
	code, b := post(t, w.URL()+"/v1/chat/completions", body)
	if code != 200 {
		t.Fatalf("%d %s", code, b)
	}
	var r pdResponse
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "kv_transfer_params") {
		t.Fatalf("a peer fetch's answer names kv_transfer_params: %s", b)
	}
	return r.Usage
}

// TestPeerFetchPullsTheHoldersPrefix: a worker told to fetch from the worker that caches the
// prompt pulls that prefix over nixl (checked), stores it and computes only the rest; the
// holder frees what it held once read; the fetched blocks are the fetcher's cache after.
func TestPeerFetchPullsTheHoldersPrefix(t *testing.T) {
	mut := func(c *WorkerConfig) { c.Engine.PeerFetch = true; c.Engine.NumGPUBlocks = 1024 }
	holder, fetcher := startWorker(t, mut), startWorker(t, mut)
	prompt := "peer " + longText(640) // ~40 blocks
	first := chatUsage(t, holder, `{"messages":[{"role":"user","content":`+strconv.Quote(prompt)+`}],"max_tokens":2}`)
	got := chatUsage(t, fetcher, peerBody(prompt, holder.URL()))
	if got.PromptTokens != first.PromptTokens || got.PromptTokensDetails.CachedTokens < first.PromptTokens-16 {
		t.Fatalf("fetched request cached %d of %d tokens, want all but the last block's", got.PromptTokensDetails.CachedTokens, got.PromptTokens)
	}
	if n := metric(t, fetcher, "kvrelay_sim_kv_peer_fetches_total", `result="pulled"`); n != 1 {
		t.Fatalf("%v fetches pulled, want 1", n)
	}
	if n := metric(t, holder, "kvrelay_sim_kv_peer_exports_total", ""); n != 1 {
		t.Fatalf("holder exported %v prefixes, want 1", n)
	}
	eventually(t, "the holder to free the exported blocks", func() bool {
		reqs, _ := holder.Engine().HeldKV()
		return reqs == 0
	})
	// The fetcher caches the prompt now: a plain request hits.
	again := chatUsage(t, fetcher, `{"messages":[{"role":"user","content":`+strconv.Quote(prompt)+`}],"max_tokens":2}`)
	if again.PromptTokensDetails.CachedTokens < first.PromptTokens-16 {
		t.Fatalf("after the fetch the fetcher caches %d tokens", again.PromptTokensDetails.CachedTokens)
	}
}

// TestPeerFetchFallsBack: whatever goes wrong with the holder — it caches nothing, it does not
// answer, it dies between answering and the read — the request computes its prompt and
// answers as if it had not been told to fetch.
func TestPeerFetchFallsBack(t *testing.T) {
	mut := func(c *WorkerConfig) { c.Engine.PeerFetch = true; c.Engine.NumGPUBlocks = 1024 }
	fetcher := startWorker(t, mut)
	prompt := "fallback " + longText(320)
	sent := 0 // prompt tokens

	t.Run("holder caches nothing", func(t *testing.T) {
		empty := startWorker(t, mut)
		u := chatUsage(t, fetcher, peerBody(prompt+" a", empty.URL()))
		if sent += u.PromptTokens; u.PromptTokensDetails.CachedTokens != 0 {
			t.Fatalf("cached %d", u.PromptTokensDetails.CachedTokens)
		}
		if n := metric(t, fetcher, "kvrelay_sim_kv_peer_fetches_total", `result="none"`); n != 1 {
			t.Fatalf("%v fetches found nothing, want 1", n)
		}
	})
	t.Run("holder does not answer", func(t *testing.T) {
		dead := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(500) }))
		defer dead.Close()
		sent += chatUsage(t, fetcher, peerBody("b "+prompt, dead.URL)).PromptTokens // nothing of it cached here
		if n := metric(t, fetcher, "kvrelay_sim_kv_peer_fetches_total", `result="export_failed"`); n != 1 {
			t.Fatalf("%v failed exports, want 1", n)
		}
	})
	t.Run("holder dies before the read", func(t *testing.T) {
		holder := startWorker(t, mut)
		p := "c " + prompt
		chatUsage(t, holder, `{"messages":[{"role":"user","content":`+strconv.Quote(p)+`}],"max_tokens":2}`)
		// A front that relays the export, then stops the holder before answering: the
		// fetcher gets valid parameters for blocks nobody can read any more.
		var once sync.Once
		front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			resp, err := http.Post(holder.URL()+r.URL.Path, "application/json", r.Body)
			if err != nil {
				w.WriteHeader(502)
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			once.Do(func() { _ = holder.Close() })
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(b)
		}))
		defer front.Close()
		u := chatUsage(t, fetcher, peerBody(p, front.URL))
		if sent += u.PromptTokens; u.CompletionTokens != 4 {
			t.Fatalf("answer %+v", u)
		}
		if n := metric(t, fetcher, "kvrelay_sim_kv_peer_fetches_total", `result="fallback"`); n != 1 {
			t.Fatalf("%v fallbacks, want 1", n)
		}
	})
	// Each request falling back is counted once, as the plain request it became.
	if st := fetcher.Engine().TierStats(); st.PromptTokens != int64(sent) || st.PeerTokens != 0 {
		t.Fatalf("fetcher's totals %+v, %d prompt tokens sent", st, sent)
	}
}

// TestExportRefusesBadBodies: the export endpoint answers a clear 400 to what it cannot read.
func TestExportRefusesBadBodies(t *testing.T) {
	w := startWorker(t, func(c *WorkerConfig) { c.Engine.PeerFetch = true; c.Engine.NumGPUBlocks = 64 })
	for _, body := range []string{`{`, `{"block_hashes":"x"}`, `{"block_hashes":[` + strings.Repeat("1,", 64) + `1]}`} {
		if code, b := post(t, w.URL()+"/kvrelay/kv/export", body); code != 400 || !strings.Contains(string(b), `"error"`) {
			t.Errorf("%.40s: %d %s", body, code, b)
		}
	}
	if code, b := post(t, w.URL()+"/kvrelay/kv/export", `{"block_hashes":[1,2,3]}`); code != 200 || string(b) != `{"kv_transfer_params":null}` {
		t.Fatalf("export of uncached blocks: %d %s", code, b)
	}
}

// TestPeerFetchFromABusyHoldersLowerTiers: a holder whose GPU blocks a long stream holds
// gives the prompt it keeps in its host and disk tiers through staging slots.
func TestPeerFetchFromABusyHoldersLowerTiers(t *testing.T) {
	holder := startWorker(t, func(c *WorkerConfig) {
		c.Engine.PeerFetch, c.Engine.NumGPUBlocks, c.Engine.CPUOffloadBlocks = true, 64, 8
		c.Engine.DiskOffloadDir, c.Engine.DiskOffloadBlocks, c.Engine.DiskAdmitMinHits = t.TempDir(), 256, 0
		c.Engine.Timing.Speedup = 1
	})
	fetcher := startWorker(t, func(c *WorkerConfig) { c.Engine.PeerFetch, c.Engine.NumGPUBlocks = true, 1024 })
	prompt := "host " + longText(480) // ~30 blocks
	chatUsage(t, holder, `{"messages":[{"role":"user","content":`+strconv.Quote(prompt)+`}],"max_tokens":2}`)
	// Another prompt of 57 blocks pushes it out of the holder's 64 GPU blocks and 8 host
	// blocks (write-through kept it on disk).
	chatUsage(t, holder, `{"messages":[{"role":"user","content":`+strconv.Quote("other "+longText(900))+`}],"max_tokens":2}`)
	if n := metric(t, holder, "kvrelay_sim_kv_gpu_evictions_total", ""); n < 20 {
		t.Fatalf("the holder evicted %v blocks: most of the prompt is still on its GPU", n)
	}
	// A long stream holds about 40 of the holder's GPU blocks, more than the 30 the prompt
	// would need there.
	longStream(t, holder)
	got := chatUsage(t, fetcher, peerBody(prompt, holder.URL()))
	if got.PromptTokensDetails.CachedTokens < got.PromptTokens-32 {
		t.Fatalf("fetched %d of %d tokens from the holder's host and disk tiers", got.PromptTokensDetails.CachedTokens, got.PromptTokens)
	}
	if n := metric(t, fetcher, "kvrelay_sim_kv_peer_fetches_total", `result="pulled"`); n != 1 {
		t.Fatalf("%v fetches pulled", n)
	}
	if n := metric(t, holder, "kvrelay_sim_kv_disk_read_bytes_total", ""); n <= 0 {
		t.Fatal("the holder read nothing from disk")
	}
}

// TestPeerFetchAsksOnlyForWhatItLacks: a fetcher that caches the first half of a prompt asks
// the holder for the blocks after it alone, so the holder holds (and the transfer carries)
// only those.
func TestPeerFetchAsksOnlyForWhatItLacks(t *testing.T) {
	mut := func(c *WorkerConfig) { c.Engine.PeerFetch = true; c.Engine.NumGPUBlocks = 1024 }
	holder, fetcher := startWorker(t, mut), startWorker(t, mut)
	half := "lacks " + longText(320)
	prompt := half + " " + longText(320)
	chatUsage(t, holder, `{"messages":[{"role":"user","content":`+strconv.Quote(prompt)+`}],"max_tokens":2}`)
	mine := chatUsage(t, fetcher, `{"messages":[{"role":"user","content":`+strconv.Quote(half)+`}],"max_tokens":2}`)
	got := chatUsage(t, fetcher, peerBody(prompt, holder.URL()))
	if got.PromptTokensDetails.CachedTokens < got.PromptTokens-16 {
		t.Fatalf("fetched request cached %d of %d tokens", got.PromptTokensDetails.CachedTokens, got.PromptTokens)
	}
	exported := metric(t, holder, "kvrelay_sim_kv_peer_exported_blocks_total", "")
	whole := float64((got.PromptTokens - 1) / 16)
	own := float64(mine.PromptTokens / 16)
	if exported <= 0 || exported > whole-own+2 {
		t.Fatalf("holder exported %v blocks; the prompt has %v whole blocks and the fetcher cached about %v", exported, whole, own)
	}
	// Counted once, by where each cached token came from: the fetcher's GPU, then the peer.
	st := fetcher.Engine().TierStats()
	gpu := st.CachedByTier[0] - int64(mine.PromptTokensDetails.CachedTokens)
	if st.PromptTokens != int64(mine.PromptTokens+got.PromptTokens) || gpu <= 0 || gpu+st.PeerTokens != int64(got.PromptTokensDetails.CachedTokens) || st.CachedTokens != st.CachedByTier[0] {
		t.Fatalf("fetcher's totals %+v: the fetch found %d tokens on the GPU, pulled %d, answered %d cached",
			st, gpu, st.PeerTokens, got.PromptTokensDetails.CachedTokens)
	}
}

// longStream starts a streamed request on w that holds about 40 blocks of 16 tokens for 200
// output tokens, returns once its first chunk came, and returns what ends it (also called at
// the test's end).
func longStream(t *testing.T, w *Worker) context.CancelFunc {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	req, _ := http.NewRequestWithContext(ctx, "POST", w.URL()+"/v1/chat/completions",
		strings.NewReader(`{"messages":[{"role":"user","content":`+strconv.Quote("busy "+longText(640))+`}],"max_tokens":200,"ignore_eos":true,"stream":true}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); resp.Body.Close() })
	if resp.StatusCode != 200 {
		t.Fatalf("the long stream: %d", resp.StatusCode)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	return cancel
}

// fetchWhileBusy sends a fetch of prompt from holder to a fetcher of 64 blocks (with mut) while
// a long stream holds about 40 of them, ends the stream once cond holds, and returns the
// fetch's answer.
func fetchWhileBusy(t *testing.T, mut func(*Config), prompt string, cond func(fetcher *Worker) bool) (*Worker, usage) {
	t.Helper()
	holder := startWorker(t, func(c *WorkerConfig) { c.Engine.PeerFetch = true; c.Engine.NumGPUBlocks = 1024 })
	fetcher := startWorker(t, func(c *WorkerConfig) {
		c.Engine.PeerFetch = true
		c.Engine.NumGPUBlocks = 64
		c.Engine.Timing.Speedup = 1
		if mut != nil {
			mut(&c.Engine)
		}
	})
	chatUsage(t, holder, `{"messages":[{"role":"user","content":`+strconv.Quote(prompt)+`}],"max_tokens":2}`)
	cancel := longStream(t, fetcher)
	type answer struct {
		status int
		body   []byte
		err    error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Post(fetcher.URL()+"/v1/chat/completions", "application/json", strings.NewReader(peerBody(prompt, holder.URL())))
		if err != nil {
			done <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		done <- answer{resp.StatusCode, b, err}
	}()
	eventually(t, "the fetch to come up", func() bool { return cond(fetcher) })
	cancel() // the stream ends and frees its blocks
	a := <-done
	var r pdResponse
	if a.err != nil || a.status != 200 || json.Unmarshal(a.body, &r) != nil {
		t.Fatalf("the fetch request: %d %s %v", a.status, a.body, a.err)
	}
	if r.Usage.CompletionTokens != 4 {
		t.Fatalf("answer %+v: want 4 tokens", r.Usage)
	}
	return fetcher, r.Usage
}

// TestPeerFetchWaitsForRoomAsComputingWould: a fetch that comes up with room for neither its
// blocks nor its prompt's first chunk waits, as a plain request would, and pulls them all
// once the stream holding the blocks ends.
func TestPeerFetchWaitsForRoomAsComputingWould(t *testing.T) {
	prompt := "room " + longText(480) // ~30 blocks, one chunk
	fetcher, u := fetchWhileBusy(t, nil, prompt, func(f *Worker) bool {
		return metric(t, f, "vllm:num_requests_waiting", "") == 1
	})
	if want := min(u.PromptTokens/16*16, u.PromptTokens-1); u.PromptTokensDetails.CachedTokens != want {
		t.Fatalf("answer %+v: want all %d tokens of full blocks (but the last token) pulled", u, want)
	}
	if st := fetcher.Engine().TierStats(); st.PeerFetches != [numPeerOutcomes]int64{PeerPulled: 1} || st.PeerTokens != int64(u.PromptTokensDetails.CachedTokens) {
		t.Fatalf("peer fetch outcomes %v, %d tokens pulled", st.PeerFetches, st.PeerTokens)
	}
}

// TestPeerFetchPullsWhatFits: a fetch with room for part of its prompt beside the next
// chunk pulls the leading blocks that fit and computes the rest.
func TestPeerFetchPullsWhatFits(t *testing.T) {
	prompt := "room " + longText(480) // ~30 blocks, in chunks of 4
	fetcher, u := fetchWhileBusy(t, func(c *Config) { c.MaxNumBatchedTokens = 64 }, prompt, func(f *Worker) bool {
		return metric(t, f, "kvrelay_sim_kv_peer_fetches_total", `result="partial"`) == 1
	})
	st := fetcher.Engine().TierStats()
	if c := u.PromptTokensDetails.CachedTokens; c <= 0 || c >= u.PromptTokens-16 || c%16 != 0 || st.PeerTokens != int64(c) {
		t.Fatalf("answer %+v, %d tokens pulled: want a part of the prompt pulled, in whole blocks", u, st.PeerTokens)
	}
	if st.PeerFetches != [numPeerOutcomes]int64{PeerPartial: 1} {
		t.Fatalf("peer fetch outcomes %v", st.PeerFetches)
	}
}

// TestFetchFitting: how much of a prompt a fetch takes by the blocks free: all it lacks, the
// most that leave room for the next chunk, none (the fetch is dropped and the prompt
// computed), or not even the chunk (the request waits).
func TestFetchFitting(t *testing.T) {
	e, _, _ := newTestEngine(t, func(cfg *Config) {
		cfg.NumGPUBlocks = 64
		cfg.MaxNumBatchedTokens = 64 // chunks of 4 blocks
	})
	r, err := e.NewRequest("f", prompt(480, 7), blockhash.Keys{}, Params{MaxTokens: 1}) // 30 blocks, 29 fetchable
	if err != nil {
		t.Fatal(err)
	}
	hog := &Request{} // holds the blocks that are not free
	for _, tc := range []struct{ free, want int }{{64, 29}, {30, 29}, {29, 25}, {10, 6}, {3, -1}, {4, 0}} {
		e.kvm.free(hog)
		e.kvm.allocateSlots(hog, e.kvm.numFree()-tc.free)
		if got := e.fetchFitting(r, 0, 29, 64); got != tc.want {
			t.Errorf("%d blocks free: fetch %d, want %d", tc.free, got, tc.want)
		}
	}
	// With none beyond the chunk (the last case), the fetch is dropped and the request
	// admitted as a plain one.
	r.peerHolder = "http://127.0.0.1:1"
	e.waiting.push(r)
	if !e.admitPull(r, 64) || r.peerHolder != "" || e.waiting.peek() != r || e.TierStats().PeerFetches[PeerNoRoom] != 1 {
		t.Fatalf("no room for a fetch: admitted %v, holder %q", r.admitted, r.peerHolder)
	}
}

// TestExportStagesLowerTierBlocks: a holder gives a peer the blocks its host and disk tiers
// hold through staging slots of its KV region, taking none of its GPU blocks, frees the slots
// when the lease ends, and stops where the staging slots run out and at a disk block that
// fails its checksum (a miss, announced).
func TestExportStagesLowerTierBlocks(t *testing.T) {
	dir := t.TempDir()
	e, rec, c := newTestEngine(t, func(cfg *Config) {
		cfg.NumGPUBlocks, cfg.CPUOffloadBlocks = 10, 4
		cfg.DiskOffloadDir, cfg.DiskOffloadBlocks, cfg.DiskAdmitMinHits = dir, 64, 0
		cfg.PeerFetch = true
	})
	kv := newKVConnector(e.cfg, newEngineID(), "", "", nil)
	if err := kv.start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = kv.close() })
	e.kv = kv
	a := prompt(64, 1)
	submit(t, e, a, Params{MaxTokens: 1, IgnoreEOS: true})
	c.runUntilIdle(t, 100)
	pushDown(t, e, c)
	h := e.mustHashes(t, a)[:3]
	for _, x := range h {
		if e.kvm.onGPU(x) || !e.kvm.disk.has(x) {
			t.Fatal("the prompt is not below the GPU, on disk: the test does not push it down")
		}
	}
	export := func() exported {
		j := &exportJob{hashes: h, reply: make(chan exported, 1)}
		e.export(j, c.now)
		return <-j.reply
	}
	free, staging := e.kvm.numFree(), len(e.kvm.staging)
	x := export()
	if len(x.blocks) != 3 || e.kvm.numFree() != free || len(e.kvm.staging) != staging-3 {
		t.Fatalf("exported blocks %v, %d GPU blocks free (was %d): want 3 staged, no GPU block taken", x.blocks, e.kvm.numFree(), free)
	}
	if !kv.publish(x.blocks, x.keys) {
		t.Fatal("publishing the staged blocks failed")
	}
	buf := kv.mem.Bytes()
	for i, b := range x.blocks {
		s := kv.slot(b)
		if s < kv.gpuSlots || !checkSlot(buf[s*kv.slotBytes:(s+1)*kv.slotBytes], x.keys[i]) {
			t.Fatalf("block %d: slot %d does not hold its content", i, s)
		}
	}
	e.unhold(e.held[x.lease], "read")
	if len(e.kvm.staging) != staging || e.kvm.numFree() != free {
		t.Fatalf("after the read: %d staging slots free, want %d; %d GPU blocks free, want %d", len(e.kvm.staging), staging, e.kvm.numFree(), free)
	}
	// With one staging slot free, the export ends after the block it staged.
	spare := e.kvm.staging[1:]
	e.kvm.staging = e.kvm.staging[:1]
	if x := export(); len(x.blocks) != 1 {
		t.Fatalf("exported %d blocks through one free staging slot, want 1", len(x.blocks))
	} else {
		e.unhold(e.held[x.lease], "read")
	}
	e.kvm.staging = append(e.kvm.staging, spare...)
	corruptBlockFile(t, e, h[1])
	if x := export(); len(x.blocks) != 1 {
		t.Fatalf("exported %d blocks past a corrupt one, want 1", len(x.blocks))
	}
	if eventIndex(rec, BlocksRemoved, MediumDISK, h[1]) < 0 {
		t.Fatal("the corrupt block's removal from disk was not published")
	}
}
