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
