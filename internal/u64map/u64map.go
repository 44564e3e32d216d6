// Package u64map is a hash map from uint64 to uint64 laid out for memory latency: one flat
// array of key and value pairs, probed linearly, so that a lookup usually reads one cache
// line (a Go map reads its group's control word and the slot, and its directory and table
// first). Deletion shifts the entries that follow back into the hole, so the table keeps no
// tombstones however long keys come and go. The KV index's block maps use it: a block event
// costs a few lookups in tables larger than the caches, and each lookup's cache misses are
// what the ingest and the match pay.
//
// Keys can come from outside (an engine's block hashes arrive over the wire), so each table
// hashes them with a random multiplier of its own, drawn when it is first allocated: keys
// chosen to share a slot (which would make every operation walk them all) cannot be chosen
// without it, and keys that share one in one table share none in another.
//
// A Map is not safe for concurrent use. The zero Map is empty and ready.
package u64map

import (
	"iter"
	"math/bits"
	"math/rand/v2"
)

type entry struct{ k, v uint64 }

// Map maps uint64 keys to uint64 values.
type Map struct {
	tab   []entry // len a power of two, or 0
	shift uint8   // 64 - log2(len(tab))
	seed  uint64  // odd, drawn with the first table, kept across resizes
	n     int     // entries in tab
	// The key 0 marks an empty slot, so its value is kept aside.
	zero    uint64
	hasZero bool
}

const minSize = 16

// New returns a map with room for n entries before it grows.
func New(n int) *Map {
	m := &Map{}
	if n > 0 {
		m.resize(sizeFor(n))
	}
	return m
}

// sizeFor is the table size that holds n entries at most three quarters full.
func sizeFor(n int) int {
	size := minSize
	for size*3/4 < n {
		size *= 2
	}
	return size
}

// Len returns the number of entries.
func (m *Map) Len() int {
	if m.hasZero {
		return m.n + 1
	}
	return m.n
}

// home is k's first slot: the top bits of k times the table's seed, a random odd number
// (multiply-shift hashing: two given keys share a home with probability at most 2 in the
// table's size whatever keys were chosen, as long as the seed is unknown; one multiply on the
// path of every lookup).
func (m *Map) home(k uint64) int { return int((k * m.seed) >> m.shift) }

// Get returns k's value and whether k is present.
func (m *Map) Get(k uint64) (uint64, bool) {
	if k == 0 {
		return m.zero, m.hasZero
	}
	if m.n == 0 {
		return 0, false
	}
	mask := len(m.tab) - 1
	for i := m.home(k); ; i = (i + 1) & mask {
		e := &m.tab[i]
		if e.k == k {
			return e.v, true
		}
		if e.k == 0 {
			return 0, false
		}
	}
}

// Put sets k's value to v and reports whether k was new.
func (m *Map) Put(k, v uint64) bool {
	if k == 0 {
		added := !m.hasZero
		m.zero, m.hasZero = v, true
		return added
	}
	if (m.n+1)*4 > len(m.tab)*3 {
		m.resize(max(2*len(m.tab), minSize))
	}
	mask := len(m.tab) - 1
	for i := m.home(k); ; i = (i + 1) & mask {
		e := &m.tab[i]
		if e.k == k {
			e.v = v
			return false
		}
		if e.k == 0 {
			e.k, e.v = k, v
			m.n++
			return true
		}
	}
}

// Delete removes k and returns its value and whether it was present.
func (m *Map) Delete(k uint64) (uint64, bool) {
	if k == 0 {
		v, ok := m.zero, m.hasZero
		m.zero, m.hasZero = 0, false
		return v, ok
	}
	if m.n == 0 {
		return 0, false
	}
	mask := len(m.tab) - 1
	i := m.home(k)
	for ; m.tab[i].k != k; i = (i + 1) & mask {
		if m.tab[i].k == 0 {
			return 0, false
		}
	}
	v := m.tab[i].v
	// Shift back every entry of the run after the hole whose home does not lie cyclically
	// within (hole, its own position]: its probe from home would otherwise stop at the hole.
	for j := (i + 1) & mask; m.tab[j].k != 0; j = (j + 1) & mask {
		h := m.home(m.tab[j].k)
		if (j-h)&mask >= (j-i)&mask {
			m.tab[i] = m.tab[j]
			i = j
		}
	}
	m.tab[i] = entry{}
	m.n--
	return v, true
}

// All yields every entry, in no order. The map must not change while it is ranged over.
func (m *Map) All() iter.Seq2[uint64, uint64] {
	return func(yield func(k, v uint64) bool) {
		if m.hasZero && !yield(0, m.zero) {
			return
		}
		for _, e := range m.tab {
			if e.k != 0 && !yield(e.k, e.v) {
				return
			}
		}
	}
}

func (m *Map) resize(size int) {
	old := m.tab
	if m.seed == 0 {
		m.seed = rand.Uint64() | 1
	}
	m.tab = make([]entry, size)
	m.shift = uint8(64 - bits.TrailingZeros(uint(size)))
	m.n = 0
	mask := size - 1
	for _, e := range old {
		if e.k == 0 {
			continue
		}
		i := m.home(e.k)
		for m.tab[i].k != 0 {
			i = (i + 1) & mask
		}
		m.tab[i] = e
		m.n++
	}
}
