// Package vllmtest starts vLLM-compatible engines for tests: kvrelay's simulated engine
// (engines/sim) on loopback, with a tiny word-per-token codec so that it starts in
// milliseconds.
package vllmtest

import (
	"hash/fnv"
	"strings"
	"sync"
	"testing"

	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/sim/simtest"
)

// WordCodec is a sim.Codec in which every space-separated word (with its leading space) is one
// token and chat messages render as "role: content" lines. Safe for concurrent use.
type WordCodec struct {
	mu    sync.Mutex
	words map[uint32]string
}

// EncodePrompt splits text before each space.
func (c *WordCodec) EncodePrompt(text string) []uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.words == nil {
		c.words = map[uint32]string{}
	}
	var ids []uint32
	for i := 0; i < len(text); {
		j := i + 1
		for j < len(text) && text[j] != ' ' {
			j++
		}
		h := fnv.New32a()
		h.Write([]byte(text[i:j]))
		id := h.Sum32() % 1_000_000
		c.words[id] = text[i:j]
		ids = append(ids, id)
		i = j
	}
	return ids
}

// Decode joins the words of ids.
func (c *WordCodec) Decode(ids []uint32) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(c.words[id])
	}
	return b.String()
}

// EncodeChat renders messages as "role: content" lines.
func (c *WordCodec) EncodeChat(msgs []sim.ChatMessage, opts sim.ChatOptions) ([]uint32, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.Role + ": " + m.Content + " \n")
	}
	if opts.AddGenerationPrompt {
		b.WriteString("assistant:")
	}
	return c.EncodePrompt(b.String()), nil
}

// Config returns the worker configuration StartSim uses before mut: model "sim-model", block
// size 16, 2048 GPU blocks, 50x speedup, HTTP on 127.0.0.1:0, no KV events.
func Config() sim.WorkerConfig {
	cfg := sim.WorkerConfig{Engine: sim.DefaultConfig(), Listen: "127.0.0.1:0", Codec: &WordCodec{}}
	cfg.Engine.Model = "sim-model"
	cfg.Engine.NumGPUBlocks = 2048
	cfg.Engine.Timing.Speedup = 50
	return cfg
}

// StartSim runs a simulated worker on loopback until the test ends. mut, if not nil, edits
// the configuration first.
func StartSim(t testing.TB, mut func(*sim.WorkerConfig)) *sim.Worker {
	t.Helper()
	cfg := Config()
	if mut != nil {
		mut(&cfg)
	}
	return simtest.Start(t, cfg)
}
