package workload

import "github.com/kvrelay/kvrelay/engines/blockhash"

// Ideal accumulates the prefix cache hit rate of a request stream under an unbounded cache
// that every engine shares: the upper bound a router can reach, to set beside the measured
// Σ cached_tokens / Σ prompt tokens.
//
// Requests are added in the order they were sent. Only full blocks of BlockSize tokens count,
// as engines cache nothing smaller. Block i of a prompt is a hit when an earlier request left
// the same chain prefix (blocks 0..i, the engines' sequence hash) in the cache, so hits always
// form a prefix of the prompt. The last block of a prompt whose length is an exact multiple of
// BlockSize is never a hit: engines recompute at least one token to produce logits. A request
// leaves in the cache the full blocks of its prompt followed by its answer, less the answer's
// last token (generated but never fed back, so it has no KV).
//
// The bound ignores time (a block counts as cached as soon as the request holding it was
// added, even if it was still being prefilled) and capacity. An Ideal is not safe for
// concurrent use.
type Ideal struct {
	blockSize int
	seen      map[uint64]struct{}
	h         blockhash.Hasher
	hashes    []uint64
	scratch   []uint32

	// HitTokens and PromptTokens sum hit blocks' tokens and prompt lengths over the requests
	// added; HitBlocks and Blocks count hit and full prompt blocks.
	HitTokens, PromptTokens int64
	HitBlocks, Blocks       int64
}

// NewIdeal returns an empty Ideal for blocks of blockSize (> 0) tokens; vLLM's default is 16.
func NewIdeal(blockSize int) *Ideal {
	return &Ideal{blockSize: max(blockSize, 1), seen: make(map[uint64]struct{})}
}

// Add counts one request: prompt as sent (token ids after the chat template) and the answer's
// token ids (nil when unknown). It returns how many of the prompt's tokens were hits.
func (x *Ideal) Add(prompt, answer []uint32) int {
	bs := x.blockSize
	x.hashes = x.h.AppendSeq(x.hashes[:0], prompt, bs, nil)
	usable := len(x.hashes)
	if len(prompt)%bs == 0 && usable > 0 {
		usable-- // the engine recomputes the last block of a block-aligned prompt
	}
	hit := 0
	for hit < usable {
		if _, ok := x.seen[x.hashes[hit]]; !ok {
			break
		}
		hit++
	}
	x.HitBlocks += int64(hit)
	x.Blocks += int64(len(x.hashes))
	x.HitTokens += int64(hit * bs)
	x.PromptTokens += int64(len(prompt))
	for _, h := range x.hashes {
		x.seen[h] = struct{}{}
	}
	if len(answer) > 1 {
		x.scratch = append(append(x.scratch[:0], prompt...), answer[:len(answer)-1]...)
		x.hashes = x.h.AppendSeq(x.hashes[:0], x.scratch, bs, nil)
		for _, h := range x.hashes {
			x.seen[h] = struct{}{}
		}
	}
	return hit * bs
}

// HitRate returns HitTokens / PromptTokens (0 before any request): comparable to the measured
// Σ cached_tokens / Σ prompt tokens.
func (x *Ideal) HitRate() float64 {
	if x.PromptTokens == 0 {
		return 0
	}
	return float64(x.HitTokens) / float64(x.PromptTokens)
}

// BlockHitRate returns HitBlocks / Blocks (0 before any full block): the share of full prompt
// blocks served from cache.
func (x *Ideal) BlockHitRate() float64 {
	if x.Blocks == 0 {
		return 0
	}
	return float64(x.HitBlocks) / float64(x.Blocks)
}

// IdealHitRate returns the Ideal hit rate (hit tokens / prompt tokens) of prompts added in
// order without answers.
func IdealHitRate(prompts [][]uint32, blockSize int) float64 {
	x := NewIdeal(blockSize)
	for _, p := range prompts {
		x.Add(p, nil)
	}
	return x.HitRate()
}
