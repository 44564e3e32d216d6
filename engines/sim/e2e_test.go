package sim_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/sim/simtest"
)

// run starts a worker with the real gpt-oss codec on loopback for the test's lifetime.
func run(t *testing.T, mut func(*sim.WorkerConfig)) *sim.Worker {
	t.Helper()
	return simtest.Worker(t, "gpt-oss-120b", func(cfg *sim.WorkerConfig) {
		cfg.Engine.NumGPUBlocks = 4096
		cfg.Engine.Timing.Speedup = 20
		if mut != nil {
			mut(cfg)
		}
	})
}

func longSystemPrompt(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString("alpha")
		b.WriteString(string(rune('a' + i%26)))
		b.WriteString(" beta")
		b.WriteString(string(rune('a' + i%13)))
		b.WriteString(". ")
	}
	return b.String()
}

func TestOpenAISDK(t *testing.T) {
	w := run(t, nil)
	client := openai.NewClient(option.WithBaseURL(w.URL()+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx := context.Background()
	params := openai.ChatCompletionNewParams{
		Model: "gpt-oss-120b",
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage(longSystemPrompt(200)),
			openai.UserMessage("What is the capital of France?"),
		},
		MaxTokens: openai.Int(12),
	}

	t.Run("chat", func(t *testing.T) {
		first, err := client.Chat.Completions.New(ctx, params)
		if err != nil {
			t.Fatal(err)
		}
		second, err := client.Chat.Completions.New(ctx, params)
		if err != nil {
			t.Fatal(err)
		}
		if first.Choices[0].FinishReason != "length" || first.Usage.CompletionTokens != 12 || first.Choices[0].Message.Content == "" {
			t.Fatalf("first answer %+v", first)
		}
		pt := second.Usage.PromptTokens
		if got, want := second.Usage.PromptTokensDetails.CachedTokens, pt/16*16; got != want {
			t.Fatalf("second identical prompt: cached_tokens %d of %d, want %d", got, pt, want)
		}
		if pt < 1000 {
			t.Fatalf("the harmony-rendered prompt has only %d tokens", pt)
		}
	})

	t.Run("chat stream", func(t *testing.T) {
		p := params
		p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		stream := client.Chat.Completions.NewStreaming(ctx, p)
		var acc openai.ChatCompletionAccumulator
		chunks := 0
		for stream.Next() {
			acc.AddChunk(stream.Current())
			chunks++
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if acc.Usage.CompletionTokens != 12 || acc.Usage.PromptTokensDetails.CachedTokens == 0 {
			t.Fatalf("stream usage %+v", acc.Usage)
		}
		if chunks < 12 || len(strings.Fields(acc.Choices[0].Message.Content)) != 12 {
			t.Fatalf("%d chunks, content %q", chunks, acc.Choices[0].Message.Content)
		}
	})

	t.Run("completion", func(t *testing.T) {
		resp, err := client.Completions.New(ctx, openai.CompletionNewParams{
			Model:     "gpt-oss-120b",
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
			MaxTokens: openai.Int(5),
		})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Usage.PromptTokens != 4 || resp.Usage.CompletionTokens != 5 || resp.Choices[0].Text == "" {
			t.Fatalf("completion %+v", resp)
		}
	})

	t.Run("completion stream", func(t *testing.T) {
		stream := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{
			Model:     "gpt-oss-120b",
			Prompt:    openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: []int64{200006, 1428, 200008}},
			MaxTokens: openai.Int(6),
		})
		var text strings.Builder
		for stream.Next() {
			for _, c := range stream.Current().Choices {
				text.WriteString(c.Text)
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if n := len(strings.Fields(text.String())); n != 6 {
			t.Fatalf("streamed %q (%d words)", text.String(), n)
		}
	})

	t.Run("unknown model", func(t *testing.T) {
		p := params
		p.Model = "no-such-model"
		_, err := client.Chat.Completions.New(ctx, p)
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || !strings.Contains(apiErr.Message, "does not exist") {
			t.Fatalf("err = %v", err)
		}
	})
}

// The output text re-tokenizes to exactly the ids the engine generated, so a client that
// appends the answer to its next turn finds the answer's blocks cached too.
func TestOutputRetokenizes(t *testing.T) {
	w := run(t, nil)
	client := openai.NewClient(option.WithBaseURL(w.URL()+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	prompt := longSystemPrompt(40)
	first, err := client.Completions.New(context.Background(), openai.CompletionNewParams{
		Model: "gpt-oss-120b", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompt)},
		MaxTokens: openai.Int(64),
	})
	if err != nil {
		t.Fatal(err)
	}
	next := prompt + first.Choices[0].Text + " and more"
	second, err := client.Completions.New(context.Background(), openai.CompletionNewParams{
		Model: "gpt-oss-120b", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(next)},
		MaxTokens: openai.Int(1),
	})
	if err != nil {
		t.Fatal(err)
	}
	// Everything computed in the first request (prompt plus all output but the last token)
	// is cached, in whole blocks.
	computed := first.Usage.PromptTokens + first.Usage.CompletionTokens - 1
	if got, want := second.Usage.PromptTokensDetails.CachedTokens, computed/16*16; got != want {
		t.Fatalf("follow-up turn cached %d tokens, want %d", got, want)
	}
}

// subscribe follows w's KV events until the test ends, once the subscription has reached
// the publisher.
func subscribe(t *testing.T, w *sim.Worker) (*collector, *kvevents.Subscriber) {
	t.Helper()
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: w.EventsEndpoint()})
	if err != nil {
		t.Fatal(err)
	}
	col := &collector{}
	go sub.Run(t.Context(), col.emit)
	select {
	case <-sub.Ready():
	case <-time.After(5 * time.Second):
		t.Fatal("subscriber did not connect")
	}
	time.Sleep(200 * time.Millisecond) // let the subscription reach the publisher
	return col, sub
}

type collector struct {
	mu      sync.Mutex
	seqs    []uint64
	batches []kvevents.Batch
}

func (c *collector) emit(seq uint64, b *kvevents.Batch) {
	c.mu.Lock()
	defer c.mu.Unlock()
	cp := *b
	cp.Events = slices.Clone(b.Events)
	for i := range cp.Events {
		cp.Events[i].BlockHashes = slices.Clone(cp.Events[i].BlockHashes)
		cp.Events[i].TokenIDs = slices.Clone(cp.Events[i].TokenIDs)
	}
	c.seqs = append(c.seqs, seq)
	c.batches = append(c.batches, cp)
}

func (c *collector) snapshot() ([]uint64, []kvevents.Batch) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.seqs), slices.Clone(c.batches)
}

func tokenize(t *testing.T, url, prompt string) []uint32 {
	t.Helper()
	body, _ := json.Marshal(map[string]string{"prompt": prompt})
	resp, err := http.Post(url+"/tokenize", "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct{ Tokens []uint32 }
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatalf("tokenize: %s", b)
	}
	return out.Tokens
}

func TestKVEventsOverZMQ(t *testing.T) {
	for _, tc := range []struct {
		name    string
		format  kvevents.Format
		asBytes bool
	}{
		{"map encoding, integer hashes", kvevents.FormatMap, false},
		{"array encoding, bytes hashes", kvevents.FormatArray, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := run(t, func(c *sim.WorkerConfig) {
				c.Engine.NumGPUBlocks = 40 // room for one 600-token prompt, not two
				c.Engine.EngineHashBytes = tc.asBytes
				c.Events = kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Format: tc.format}
			})
			col, sub := subscribe(t, w)
			ctx := t.Context()

			client := openai.NewClient(option.WithBaseURL(w.URL()+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
			promptA, promptB := longSystemPrompt(100), "Different: "+longSystemPrompt(100)[3:]
			for _, p := range []string{promptA, promptB} {
				if _, err := client.Completions.New(ctx, openai.CompletionNewParams{
					Model: "gpt-oss-120b", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(p)},
					MaxTokens: openai.Int(2),
				}); err != nil {
					t.Fatal(err)
				}
			}
			idsA := tokenize(t, w.URL(), promptA)
			wantA := blockhash.Seq(idsA, 16, nil)

			var seqs []uint64
			var batches []kvevents.Batch
			deadline := time.Now().Add(5 * time.Second)
			for {
				seqs, batches = col.snapshot()
				removed := 0
				for _, b := range batches {
					for _, ev := range b.Events {
						if ev.Kind == kvevents.BlockRemoved {
							removed++
						}
					}
				}
				if removed > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("no BlockRemoved after a prompt that does not fit beside the first (%d batches)", len(batches))
				}
				time.Sleep(20 * time.Millisecond)
			}
			for i := 1; i < len(seqs); i++ {
				if seqs[i] != seqs[i-1]+1 {
					t.Fatalf("seq not contiguous: %v", seqs)
				}
			}
			// The first stored chain is prompt A's: recomputing kvrelay's hash chain from the
			// events' token ids gives exactly the chain of A's tokens, and the engine's own
			// hashes are opaque (not that chain) and in the configured form.
			var tokens []uint32
			var engineHashes []kvevents.Hash
			for _, b := range batches {
				for _, ev := range b.Events {
					if ev.Kind != kvevents.BlockStored || len(tokens) >= len(wantA)*16 {
						continue
					}
					if ev.BlockSize != 16 || len(ev.TokenIDs) != 16*len(ev.BlockHashes) {
						t.Fatalf("stored event: block size %d, %d tokens for %d hashes", ev.BlockSize, len(ev.TokenIDs), len(ev.BlockHashes))
					}
					tokens = append(tokens, ev.TokenIDs...)
					engineHashes = append(engineHashes, ev.BlockHashes...)
				}
			}
			got := blockhash.Seq(tokens, 16, nil)
			if !slices.Equal(got[:len(wantA)], wantA) {
				t.Fatal("hash chain recomputed from BlockStored token_ids differs from the prompt's")
			}
			for i, h := range engineHashes[:len(wantA)] {
				if h.IsBytes() != tc.asBytes || (!tc.asBytes && h.U == wantA[i]) {
					t.Fatalf("engine hash %v is not an opaque %v hash", h, map[bool]string{true: "bytes", false: "integer"}[tc.asBytes])
				}
			}

			// Replay from the second batch returns every later batch, in order. The last
			// steps' batches are published after their responses: wait until none arrive.
			for n, still := len(seqs), 0; still < 10; time.Sleep(20 * time.Millisecond) {
				if seqs, batches = col.snapshot(); len(seqs) != n {
					n, still = len(seqs), 0
				} else {
					still++
				}
			}
			rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
			defer rcancel()
			replayed, err := kvevents.Replay(rctx, w.ReplayEndpoint(), seqs[0]+1)
			if err != nil {
				t.Fatal(err)
			}
			if len(replayed) != len(seqs)-1 {
				t.Fatalf("replay from %d returned %d batches, want %d", seqs[0]+1, len(replayed), len(seqs)-1)
			}
			for i, r := range replayed {
				if r.Seq != seqs[i+1] || len(r.Batch.Events) != len(batches[i+1].Events) {
					t.Fatalf("replayed batch %d: seq %d, %d events", i, r.Seq, len(r.Batch.Events))
				}
			}
			if st := sub.Stats(); st.Malformed != 0 || st.Gaps != 0 {
				t.Fatalf("subscriber stats %v", st)
			}
		})
	}
}

// The OpenAI SDK drives both legs of a disaggregated request, with the real gpt-oss codec:
// kv_transfer_params rides as an extra request field, comes back as an extra top-level
// response field on the prefill leg and as null on the decode leg, and a failed pull is an
// *openai.Error with the status.
func TestDisaggOpenAISDK(t *testing.T) {
	pre := run(t, func(c *sim.WorkerConfig) { c.Engine.Role = sim.RolePrefill })
	dec := run(t, func(c *sim.WorkerConfig) { c.Engine.Role = sim.RoleDecode })
	ctx := context.Background()
	client := func(w *sim.Worker) *openai.Client {
		c := openai.NewClient(option.WithBaseURL(w.URL()+"/v1"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
		return &c
	}
	params := openai.ChatCompletionNewParams{
		Model: "gpt-oss-120b",
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage(longSystemPrompt(100)),
			openai.UserMessage("Summarise the system prompt."),
		},
		MaxTokens: openai.Int(1),
	}
	first, err := client(pre).Chat.Completions.New(ctx, params, option.WithJSONSet("kv_transfer_params", map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
	}))
	if err != nil {
		t.Fatal(err)
	}
	field, ok := first.JSON.ExtraFields["kv_transfer_params"]
	if !ok || field.Raw() == "" || field.Raw() == "null" { // extra fields are raw, never "Valid"
		t.Fatalf("prefill response has no kv_transfer_params: %s", first.RawJSON())
	}
	var kv map[string]any
	if err := json.Unmarshal([]byte(field.Raw()), &kv); err != nil || kv["remote_engine_id"] != pre.EngineID() || kv["remote_request_id"] != first.ID {
		t.Fatalf("kv_transfer_params %s (%v)", field.Raw(), err)
	}
	if first.Usage.CompletionTokens != 1 || first.Choices[0].FinishReason != "length" {
		t.Fatalf("prefill leg %+v", first.Usage)
	}

	p := params
	p.MaxTokens = openai.Int(10)
	p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := client(dec).Chat.Completions.NewStreaming(ctx, p, option.WithJSONSet("kv_transfer_params", json.RawMessage(field.Raw())))
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if acc.Usage.CompletionTokens != 10 || acc.Usage.PromptTokens != first.Usage.PromptTokens || acc.Usage.PromptTokensDetails.CachedTokens != first.Usage.PromptTokens-1 {
		t.Fatalf("decode leg usage %+v (prompt %d)", acc.Usage, first.Usage.PromptTokens)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if n, _ := pre.Engine().HeldKV(); n == 0 {
			break
		} else if time.Now().After(deadline) {
			t.Fatal("prefill worker still holds the blocks")
		}
	}

	// Non-streaming decode leg: kv_transfer_params is null. The prefill worker is asked
	// again (its blocks were freed), then the decode worker reads them.
	again, err := client(pre).Chat.Completions.New(ctx, params, option.WithJSONSet("kv_transfer_params", map[string]any{"do_remote_decode": true}))
	if err != nil {
		t.Fatal(err)
	}
	raw := again.JSON.ExtraFields["kv_transfer_params"].Raw()
	second, err := client(dec).Chat.Completions.New(ctx, p, option.WithJSONSet("kv_transfer_params", json.RawMessage(raw)))
	if err != nil {
		t.Fatal(err)
	}
	if f := second.JSON.ExtraFields["kv_transfer_params"]; f.Raw() != "null" || second.Choices[0].Message.Content == "" {
		t.Fatalf("decode leg: %s", second.RawJSON())
	}

	// Params of a prefill worker that is gone: a clean 503 the SDK reports. (A worker the
	// decode worker had already mapped over shared memory may still be read; see
	// TestDisaggPullFailures.)
	gone := run(t, func(c *sim.WorkerConfig) { c.Engine.Role = sim.RolePrefill })
	third, err := client(gone).Chat.Completions.New(ctx, params, option.WithJSONSet("kv_transfer_params", map[string]any{"do_remote_decode": true}))
	if err != nil {
		t.Fatal(err)
	}
	gone.Close()
	raw = third.JSON.ExtraFields["kv_transfer_params"].Raw()
	_, err = client(dec).Chat.Completions.New(ctx, p, option.WithJSONSet("kv_transfer_params", json.RawMessage(raw)))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 503 {
		t.Fatalf("pull from a stopped prefill worker: %v", err)
	}
}

// TestLoRAAndSaltKeysInEvents: a completion naming a LoRA adapter with a cache salt is
// answered under the adapter's name, its blocks are published with lora_name and, per
// block, vLLM's extra_keys tuple (adapter, and the salt on the first block); hashing the
// events' tokens with those keys by blockhash's rule gives the chain the proxy computes
// for the request; a plain completion's blocks carry no keys. /v1/models lists the adapter
// under the base model.
func TestLoRAAndSaltKeysInEvents(t *testing.T) {
	w := run(t, func(c *sim.WorkerConfig) {
		c.Engine.LoRAModules = []string{"sql-lora"}
		c.Events = kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0"}
	})
	col, _ := subscribe(t, w)

	resp, err := http.Get(w.URL() + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&models)
	resp.Body.Close()
	if len(models.Data) != 2 || models.Data[1].ID != "sql-lora" || models.Data[1].Parent == nil || *models.Data[1].Parent != "gpt-oss-120b" {
		t.Fatalf("/v1/models: %+v", models.Data)
	}

	prompt := longSystemPrompt(40)
	complete := func(model, salt string) string {
		body, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": 1, "cache_salt": salt})
		resp, err := http.Post(w.URL()+"/v1/completions", "application/json", strings.NewReader(string(body)))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out struct {
			Model string `json:"model"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&out)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: status %d", model, resp.StatusCode)
		}
		return out.Model
	}
	if got := complete("sql-lora", "tenant-a"); got != "sql-lora" {
		t.Errorf("an adapter's completion names model %q", got)
	}
	ids := tokenize(t, w.URL(), prompt)
	keys := blockhash.Keys{LoRA: "sql-lora", Salt: []byte("tenant-a")}
	var h blockhash.Hasher
	want := h.AppendSeqKeys(nil, 0, false, ids, 16, &keys, 0)

	var got []uint64
	deadline := time.Now().Add(5 * time.Second)
	for len(got) < len(want) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d keyed blocks published", len(got), len(want))
		}
		time.Sleep(20 * time.Millisecond)
		got = got[:0]
		_, batches := col.snapshot()
		block := 0
		var parent uint64
		for _, b := range batches {
			for _, ev := range b.Events {
				if ev.Kind != kvevents.BlockStored {
					continue
				}
				if ev.LoraName != "sql-lora" || !ev.HasExtraKeys || len(ev.ExtraKeys) != len(ev.BlockHashes) {
					t.Fatalf("stored event: lora_name %q, extra_keys %v for %d blocks", ev.LoraName, ev.ExtraKeys, len(ev.BlockHashes))
				}
				for i := range ev.BlockHashes {
					v, err := ev.ExtraKeys[i].Decode()
					if err != nil {
						t.Fatal(err)
					}
					tuple, _ := v.([]any)
					wantLen := 1
					if block == 0 {
						wantLen = 2
					}
					if len(tuple) != wantLen || tuple[0] != "sql-lora" || (block == 0 && tuple[1] != "tenant-a") {
						t.Fatalf("block %d extra_keys %v", block, v)
					}
					local := h.Local(ev.TokenIDs[i*16:(i+1)*16], blockhash.AppendKey(nil, v))
					seq := local
					if block > 0 {
						seq = blockhash.Chain(parent, local)
					}
					got = append(got, seq)
					parent = seq
					block++
				}
			}
		}
	}
	if !slices.Equal(got[:len(want)], want) {
		t.Fatal("the chain rebuilt from the events' keys differs from the request's")
	}

	complete("gpt-oss-120b", "")
	time.Sleep(300 * time.Millisecond)
	_, batches := col.snapshot()
	plain := 0
	for _, b := range batches {
		for _, ev := range b.Events {
			if ev.Kind == kvevents.BlockStored && ev.LoraName == "" {
				plain++
				for _, k := range ev.ExtraKeys {
					if k != nil {
						t.Fatalf("a plain block carries extra keys %v", k)
					}
				}
			}
		}
	}
	if plain == 0 {
		t.Fatal("the plain completion stored no blocks (or they carry the adapter)")
	}
}
