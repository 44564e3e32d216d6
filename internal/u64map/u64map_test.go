package u64map

import (
	"encoding/binary"
	"math/rand/v2"
	"testing"
)

// check compares m with the Go map want, entry by entry both ways.
func check(t *testing.T, m *Map, want map[uint64]uint64) {
	t.Helper()
	if m.Len() != len(want) {
		t.Fatalf("Len %d, want %d", m.Len(), len(want))
	}
	for k, v := range want {
		if got, ok := m.Get(k); !ok || got != v {
			t.Fatalf("Get(%d) = %d, %v; want %d", k, got, ok, v)
		}
	}
	n := 0
	for k, v := range m.All() {
		n++
		if w, ok := want[k]; !ok || w != v {
			t.Fatalf("All gave %d=%d, want %d (present %v)", k, v, w, ok)
		}
	}
	if n != len(want) {
		t.Fatalf("All gave %d entries, want %d", n, len(want))
	}
}

// apply runs one operation on both maps and compares what they answer.
func apply(t *testing.T, m *Map, want map[uint64]uint64, op byte, k, v uint64) {
	t.Helper()
	switch op % 4 {
	case 0, 1:
		_, ok := want[k]
		if added := m.Put(k, v); added == ok {
			t.Fatalf("Put(%d, %d) = %v; want %v", k, v, added, !ok)
		}
		if got, _ := m.Get(k); got != v {
			t.Fatalf("Get(%d) = %d after Put(%d, %d)", k, got, k, v)
		}
		want[k] = v
	case 2:
		old, ok := want[k]
		got, gotOK := m.Delete(k)
		if gotOK != ok || got != old {
			t.Fatalf("Delete(%d) = %d, %v; want %d, %v", k, got, gotOK, old, ok)
		}
		delete(want, k)
	case 3:
		w, ok := want[k]
		if got, gotOK := m.Get(k); gotOK != ok || got != w {
			t.Fatalf("Get(%d) = %d, %v; want %d, %v", k, got, gotOK, w, ok)
		}
	}
}

// TestAgainstGoMap churns keys from small ranges (long probe runs that wrap the table, the
// key 0, deletions in the middle of runs) and large ones, comparing with a Go map throughout.
func TestAgainstGoMap(t *testing.T) {
	for _, keys := range []uint64{8, 100, 5000, 1 << 40} {
		r := rand.New(rand.NewPCG(keys, 1))
		m, want := &Map{}, map[uint64]uint64{}
		for i := range 200000 {
			apply(t, m, want, byte(r.IntN(4)), r.Uint64N(keys), r.Uint64())
			if i%10000 == 0 {
				check(t, m, want)
			}
		}
		check(t, m, want)
		for k := range want {
			m.Delete(k)
		}
		check(t, m, map[uint64]uint64{})
	}
}

// TestCollidingKeys puts keys that share their home slot, then deletes them in every order
// of the run's start, middle and end.
func TestCollidingKeys(t *testing.T) {
	m := New(8)
	size := uint64(len(m.tab))
	var same []uint64
	for k := uint64(1); len(same) < 6; k++ {
		if m.home(k) == int(size-1) { // the last slot: the run wraps around
			same = append(same, k)
		}
	}
	for _, order := range [][]int{{0, 1, 2, 3, 4, 5}, {5, 4, 3, 2, 1, 0}, {2, 0, 4, 1, 5, 3}} {
		want := map[uint64]uint64{}
		for i, k := range same {
			m.Put(k, uint64(i))
			want[k] = uint64(i)
		}
		for _, i := range order {
			if _, ok := m.Delete(same[i]); !ok {
				t.Fatalf("Delete(%d): not found", same[i])
			}
			delete(want, same[i])
			check(t, m, want)
		}
	}
}

func TestAllStops(t *testing.T) {
	m := New(0)
	for k := range uint64(10) {
		m.Put(k, k)
	}
	n := 0
	for range m.All() {
		if n++; n == 3 {
			break
		}
	}
	if n != 3 {
		t.Fatalf("ranging over All went on after a break: %d entries", n)
	}
}

// FuzzAgainstGoMap reads operations (op, key, value) from the input and compares with a Go
// map; keys come from a small range so that runs collide and wrap.
func FuzzAgainstGoMap(f *testing.F) {
	f.Add([]byte("\x00\x01\x00\x00\x00\x00\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00\x02\x01\x00\x00\x00\x00\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, in []byte) {
		m, want := &Map{}, map[uint64]uint64{}
		for len(in) >= 17 {
			op, k, v := in[0], binary.LittleEndian.Uint64(in[1:9])%64, binary.LittleEndian.Uint64(in[9:17])
			in = in[17:]
			apply(t, m, want, op, k, v)
		}
		check(t, m, want)
	})
}

// BenchmarkChurn is the KV index's pattern: a table of live blocks far larger than the
// caches, each step storing a new block (a lookup, then an insert) and removing an old
// one (a lookup, then a delete), against Go's map.
func BenchmarkChurn(b *testing.B) {
	const live = 1 << 18
	key := func(i int) uint64 { return uint64(i)*0x9e3779b97f4a7c15 ^ 0x5bd1e995 }
	b.Run("u64map", func(b *testing.B) {
		m := New(live)
		for i := range live {
			m.Put(key(i), uint64(i))
		}
		i := live
		for b.Loop() {
			if _, ok := m.Get(key(i)); !ok {
				m.Put(key(i), uint64(i))
			}
			if _, ok := m.Get(key(i - live)); ok {
				m.Delete(key(i - live))
			}
			i++
		}
	})
	b.Run("gomap", func(b *testing.B) {
		m := make(map[uint64]uint64, live)
		for i := range live {
			m[key(i)] = uint64(i)
		}
		i := live
		for b.Loop() {
			if _, ok := m[key(i)]; !ok {
				m[key(i)] = uint64(i)
			}
			if _, ok := m[key(i-live)]; ok {
				delete(m, key(i-live))
			}
			i++
		}
	})
}

// longestRun is the longest stretch of occupied slots in m's table.
func longestRun(m *Map) int {
	best, run := 0, 0
	for _, e := range append(m.tab, m.tab...) { // twice: a run may wrap around
		if e.k == 0 {
			run = 0
			continue
		}
		run++
		best = max(best, min(run, len(m.tab)))
	}
	return best
}

// TestChosenKeys: keys chosen to share a home slot, under the unseeded multiplicative hash a
// table would otherwise use, and then keys chosen to share one in a particular table, spread
// in another table as in any: no table walks them all.
func TestChosenKeys(t *testing.T) {
	const n = 20000
	const inv = 0xf1de83e19937733d // the inverse of 0x9e3779b97f4a7c15 mod 2^64
	m := New(0)
	for j := range uint64(n) {
		m.Put(j*inv, j) // j·C⁻¹·C = j: all in slot 0 of an unseeded table
	}
	if r := longestRun(m); r > 200 {
		t.Fatalf("keys chosen against the unseeded hash make a run of %d slots", r)
	}
	// Keys that share their home in a table of m's size: found by trying.
	var same []uint64
	for k := uint64(1); len(same) < 500; k++ {
		if m.home(k) == 0 {
			same = append(same, k)
		}
	}
	other := New(n)
	for _, k := range same {
		other.Put(k, k)
	}
	if r := longestRun(other); r > 50 {
		t.Fatalf("keys sharing a home slot in one table make a run of %d slots in another", r)
	}
	// Keys a few flipped bits apart around a few bases, the flips chosen so that some choice
	// of their signs moves a key by a multiple of the golden ratio that is nearly 0 mod 2^64:
	// under that fixed multiplier with a seed only xored into the key, each such key lands
	// next to its base's slot for a good share of seeds (the flips' signs follow the seed's
	// bits); under a random multiplier no more often than chance.
	const golden = 0x9e3779b97f4a7c15
	near := func(d uint64) bool { x := d * golden; return x < 1<<50 || -x < 1<<50 }
	var flips []uint64
	for i := 0; i < 64 && len(flips) < 600; i++ {
		for j := i + 1; j < 64 && len(flips) < 600; j++ {
			for k := j + 1; k < 64 && len(flips) < 600; k++ {
				for l := k + 1; l < 64 && len(flips) < 600; l++ {
					for signs := range 16 {
						d := uint64(0)
						for b, p := range []int{i, j, k, l} {
							if signs&(1<<b) != 0 {
								d -= 1 << p
							} else {
								d += 1 << p
							}
						}
						if near(d) {
							flips = append(flips, 1<<i|1<<j|1<<k|1<<l)
							break
						}
					}
				}
			}
		}
	}
	r := rand.New(rand.NewPCG(7, 7))
	flood := New(0)
	for range 40 {
		base := r.Uint64()
		for _, f := range flips {
			flood.Put(base^f, 1)
		}
	}
	if r := longestRun(flood); r > 400 {
		t.Fatalf("keys a few bits apart make a run of %d slots", r)
	}
}
