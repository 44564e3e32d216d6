package cputime

import "testing"

func TestSelfGrowsWithWork(t *testing.T) {
	before := Self()
	x := 0
	for i := range 50_000_000 {
		x ^= i * i
	}
	if after := Self(); after <= before || x == 1 {
		t.Fatalf("CPU time %v after work, %v before", after, before)
	}
}
