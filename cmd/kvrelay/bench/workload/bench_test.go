package workload

import (
	"fmt"
	"testing"
)

// BenchmarkParseMooncake generates the first N requests of the Mooncake conversation trace,
// what `kvrelay bench` does at start.
func BenchmarkParseMooncake(b *testing.B) {
	path := tracePath(b)
	tok := testTokenizer(b)
	for _, n := range []int{200, 2000} {
		for _, block := range []int{64, 512} {
			b.Run(fmt.Sprintf("requests=%d/block=%d", n, block), func(b *testing.B) {
				spec := fmt.Sprintf("mooncake:path=%s,requests=%d,block=%d", path, n, block)
				b.ReportAllocs()
				for b.Loop() {
					if _, err := Parse(spec, 1, tok); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkParse generates the built-in synthetic workloads with their defaults.
func BenchmarkParse(b *testing.B) {
	tok := testTokenizer(b)
	for _, spec := range []string{"prefix-groups", "multi-turn", "agentic"} {
		b.Run(spec, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(spec, 1, tok); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkAgentSession drives one default agent session and its subagents with answers of
// the requested length: the cost the runner pays per call, mostly stripping reasoning.
func BenchmarkAgentSession(b *testing.B) {
	tok := testTokenizer(b)
	w, err := Parse("agentic:sessions=1", 1, tok)
	if err != nil {
		b.Fatal(err)
	}
	answer := wordAnswers(b)
	b.ReportAllocs()
	calls := 0
	for b.Loop() {
		w, _ = Parse("agentic:sessions=1", 1, tok)
		calls = len(drive(b, w, answer, true))
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*calls), "ns/call")
}
