package tokenizer

import (
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
