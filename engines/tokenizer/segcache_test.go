package tokenizer

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
)

func TestSegmentCacheMatchesTokenizer(t *testing.T) {
	base, err := New(O200kHarmony)
	if err != nil {
		t.Fatal(err)
	}
	c := NewSegmentCache(base, 1<<16, 16)
	system := strings.Repeat("You are a careful assistant who answers briefly. ", 40)
	texts := []string{
		"<|start|>system<|message|>" + system + "<|end|><|start|>user<|message|>hello there<|end|><|start|>assistant",
		"<|start|>system<|message|>" + system + "<|end|><|start|>user<|message|>a different question, longer than sixteen bytes<|end|><|start|>assistant",
		"plain text with no special token at all, long enough to be cached",
		"",
		"<|start|><|end|>",
	}
	for round := range 3 {
		for _, s := range texts {
			if got, want := c.Encode(s), base.Encode(s); !slices.Equal(got, want) {
				t.Fatalf("round %d: %q: cached ids differ", round, s[:min(len(s), 40)])
			}
		}
	}
}

func TestSegmentCacheEvictsWithinBound(t *testing.T) {
	base, _ := New(O200kBase)
	c := NewSegmentCache(base, 16*64, 1).(*SegmentCache)
	for i := range 2000 {
		s := strings.Repeat("word ", 10) + strings.Repeat("x", i%50) + string(rune('a'+i%26))
		if !slices.Equal(c.Encode(s), base.Encode(s)) {
			t.Fatal("ids differ")
		}
	}
	total := 0
	for i := range c.shards {
		total += c.shards[i].tokens
		if c.shards[i].tokens > c.shards[i].maxTokens {
			t.Fatalf("shard %d holds %d tokens over its %d", i, c.shards[i].tokens, c.shards[i].maxTokens)
		}
		if len(c.shards[i].m) > len(c.shards[i].ents) {
			t.Fatal("map and entries disagree")
		}
	}
	if total == 0 {
		t.Fatal("nothing cached")
	}
}

func TestSegmentCacheConcurrent(t *testing.T) {
	base, _ := New(O200kBase)
	c := NewSegmentCache(base, 1<<12, 8)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 300 {
				s := strings.Repeat("segment ", 5+(i+g)%20)
				if !slices.Equal(c.Encode(s), base.Encode(s)) {
					t.Error("ids differ")
					return
				}
			}
		}()
	}
	wg.Wait()
}

func TestSegmentCacheHitDoesNotAllocate(t *testing.T) {
	base, _ := New(O200kHarmony)
	c := NewSegmentCache(base, 1<<16, 16)
	text := "<|start|>system<|message|>" + strings.Repeat("cached system prompt ", 200) + "<|end|>"
	dst := c.AppendEncode(nil, text)
	if a := testing.AllocsPerRun(100, func() { dst = c.AppendEncode(dst[:0], text) }); a != 0 {
		t.Fatalf("a cache hit allocates %.1f times", a)
	}
}

func BenchmarkSegmentCacheHit8k(b *testing.B) {
	base, _ := New(O200kHarmony)
	c := NewSegmentCache(base, 1<<20, 64)
	text := "<|start|>system<|message|>" + benchText(8192, base) + "<|end|><|start|>user<|message|>hi<|end|><|start|>assistant"
	dst := c.AppendEncode(nil, text)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		dst = c.AppendEncode(dst[:0], text)
	}
}

// benchText is English-like text of about n tokens (each word with its space is one).
func benchText(n int, _ Tokenizer) string {
	var sb strings.Builder
	words := strings.Fields("the quick brown fox jumps over the lazy dog while a careful engineer measures every cache hit and miss")
	for i := range n {
		sb.WriteString(words[i%len(words)])
		sb.WriteByte(' ')
	}
	return sb.String()
}

// chatMLConversation renders a ChatML conversation of n turns as plain text, the way a
// tokenizer without ChatML's special tokens sees it: one segment.
func chatMLConversation(n int) string {
	var sb strings.Builder
	sb.WriteString("<|im_start|>system\n")
	for i := range 60 {
		fmt.Fprintf(&sb, "Rule %d: answer from the workspace notes, cite paths like /src/main.go, and keep it short.\n", i)
	}
	sb.WriteString("<|im_end|>\n")
	for t := range n {
		fmt.Fprintf(&sb, "<|im_start|>user\nStep %d: read the file and report.\n<|im_end|>\n", t)
		fmt.Fprintf(&sb, "<|im_start|>assistant\n<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"/src/f%d.go\"}}\n</tool_call><|im_end|>\n", t)
		sb.WriteString("<|im_start|>tool\n")
		for l := range 12 {
			fmt.Fprintf(&sb, "  %d\tfunc f%d_%d() {  return  \u00a0nil }\n/* slash-led line */\n\n", l, t, l)
		}
		sb.WriteString("<|im_end|>\n")
	}
	sb.WriteString("<|im_start|>assistant\n")
	return sb.String()
}

func TestSegmentCacheChunksMatchTokenizer(t *testing.T) {
	for _, name := range []string{O200kBase, Cl100kBase} {
		base, err := New(name)
		if err != nil {
			t.Fatal(err)
		}
		c := NewSegmentCache(base, 1<<20, 64)
		if !c.(*SegmentCache).chunk {
			t.Fatalf("%s: segments are not chunked", name)
		}
		for turns := range 8 {
			s := chatMLConversation(turns)
			for round := range 2 {
				if got, want := c.Encode(s), base.Encode(s); !slices.Equal(got, want) {
					t.Fatalf("%s, %d turns, round %d: cached ids differ", name, turns, round)
				}
			}
		}
	}
}

// A conversation that grows by a turn is encoded again only from the chunk the new turn
// extends: the chunks of the unchanged prefix are hits.
func TestSegmentCacheGrowingConversationHitsPrefix(t *testing.T) {
	base, _ := New(O200kBase)
	c := NewSegmentCache(base, 1<<20, 64).(*SegmentCache)
	entries := func() int {
		n := 0
		for i := range c.shards {
			n += len(c.shards[i].m)
		}
		return n
	}
	prev := chatMLConversation(6)
	c.Encode(prev)
	before := entries()
	next := chatMLConversation(7)
	if !slices.Equal(c.Encode(next), base.Encode(next)) {
		t.Fatal("ids differ")
	}
	added := entries() - before
	newBytes := len(next) - len(prev)
	if limit := newBytes/chunkBytes + 3; added > limit {
		t.Fatalf("the new turn (%d bytes) added %d chunks, want at most %d: the prefix missed", newBytes, added, limit)
	}
	if before < len(prev)/(2*chunkBytes) {
		t.Fatalf("a %d-byte segment became only %d entries", len(prev), before)
	}
}

// BenchmarkSegmentCacheGrowingChatML: the next turn of a long ChatML conversation that the
// tokenizer sees as one segment (o200k_base has no ChatML tokens).
func BenchmarkSegmentCacheGrowingChatML(b *testing.B) {
	base, _ := New(O200kBase)
	convs := make([]string, 40)
	for i := range convs {
		convs[i] = chatMLConversation(i + 8)
	}
	for _, cached := range []bool{false, true} {
		b.Run(fmt.Sprintf("cache=%v", cached), func(b *testing.B) {
			tok := base
			if cached {
				tok = NewSegmentCache(base, 1<<22, 64)
			}
			var dst []uint32
			i := 0
			b.ReportAllocs()
			for b.Loop() {
				dst = tok.AppendEncode(dst[:0], convs[i%len(convs)])
				i++
			}
		})
	}
}
