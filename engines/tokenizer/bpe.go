package tokenizer

import (
	"math"
	"sync/atomic"
)

// vocab holds the byte strings of a byte-level BPE vocabulary. It is immutable after
// construction and safe for concurrent use.
type vocab struct {
	// arena holds every token's bytes back to back; token id's bytes are
	// arena[offs[id]:offs[id+1]]. Ids without a token have an empty span.
	arena string
	offs  []uint32
	// ids maps token bytes to their id (for tiktoken vocabularies the id is also the rank).
	// Its keys are substrings of arena.
	ids map[string]uint32
	// byteIDs is the id of each single byte.
	byteIDs [256]uint32
	// pair2 is the id of every two-byte token (noRank where none), indexed by the two bytes:
	// the first round of BPE looks up only byte pairs, and a dense table beats the map there.
	pair2 []uint32
}

// newVocab builds a vocabulary from tokens indexed by id ("" for holes).
func newVocab(tokens []string) *vocab {
	size := 0
	for _, t := range tokens {
		size += len(t)
	}
	buf := make([]byte, 0, size)
	offs := make([]uint32, len(tokens)+1)
	for i, t := range tokens {
		offs[i] = uint32(len(buf))
		buf = append(buf, t...)
	}
	offs[len(tokens)] = uint32(len(buf))
	v := &vocab{arena: string(buf), offs: offs, ids: make(map[string]uint32, len(tokens))}
	for i := range tokens {
		if t := v.token(uint32(i)); t != "" {
			if _, dup := v.ids[t]; !dup {
				v.ids[t] = uint32(i)
			}
		}
	}
	v.pair2 = make([]uint32, 1<<16)
	for i := range v.pair2 {
		v.pair2[i] = noRank
	}
	for s, id := range v.ids {
		if len(s) == 2 {
			v.pair2[int(s[0])<<8|int(s[1])] = id
		}
	}
	for b := range 256 {
		v.byteIDs[b] = math.MaxUint32
		if id, ok := v.ids[string([]byte{byte(b)})]; ok {
			v.byteIDs[b] = id
		}
	}
	return v
}

// token returns the bytes of id, or "" when id has none.
func (v *vocab) token(id uint32) string {
	if int(id)+1 >= len(v.offs) {
		return ""
	}
	return v.arena[v.offs[id]:v.offs[id+1]]
}

// size is one past the largest id.
func (v *vocab) size() int { return len(v.offs) - 1 }

// complete reports whether every byte has a token, as byte-level BPE needs.
func (v *vocab) complete() bool {
	for _, id := range v.byteIDs {
		if id == math.MaxUint32 {
			return false
		}
	}
	return true
}

// noRank marks a pair that cannot merge.
const noRank = math.MaxUint32

// smallPiece is the piece length, in bytes, below which BPE runs on stack arrays with linear
// scans; longer pieces use a heap.
const smallPiece = 64

// part is one symbol of a piece being merged: it starts at start and, for the rank-based
// algorithm, rank is the rank of merging it with its successor; for the merge-table algorithm
// id is its token and rank the merge rank with its successor.
type part struct {
	start uint32
	rank  uint32
	id    uint32
}

// rankBPE encodes one piece the way tiktoken does: repeatedly merge the adjacent pair whose
// concatenation has the lowest rank (leftmost first). Ranks are token ids.
func (v *vocab) rankBPE(dst []uint32, piece string) []uint32 {
	if len(piece) == 1 {
		return append(dst, v.byteIDs[piece[0]])
	}
	if len(piece) >= smallPiece {
		return v.rankBPEHeap(dst, piece)
	}
	var buf [smallPiece + 1]part
	parts := buf[:len(piece)+1]
	for i := range parts {
		parts[i] = part{start: uint32(i), rank: noRank}
	}
	rank := func(i int) uint32 {
		if i+2 < len(parts) {
			s, e := parts[i].start, parts[i+2].start
			if e-s == 2 {
				return v.pair2[int(piece[s])<<8|int(piece[s+1])]
			}
			if r, ok := v.ids[piece[s:e]]; ok {
				return r
			}
		}
		return noRank
	}
	for i := 0; i+2 < len(parts); i++ {
		parts[i].rank = rank(i)
	}
	for len(parts) > 2 {
		minRank, minIdx := uint32(noRank), -1
		for i := 0; i+1 < len(parts); i++ {
			if parts[i].rank < minRank {
				minRank, minIdx = parts[i].rank, i
			}
		}
		if minIdx < 0 {
			break
		}
		// Merge parts[minIdx] and parts[minIdx+1]: drop the boundary at minIdx+1.
		copy(parts[minIdx+1:], parts[minIdx+2:])
		parts = parts[:len(parts)-1]
		parts[minIdx].rank = rank(minIdx)
		if minIdx > 0 {
			parts[minIdx-1].rank = rank(minIdx - 1)
		}
	}
	for i := 0; i+1 < len(parts); i++ {
		dst = append(dst, v.ids[piece[parts[i].start:parts[i+1].start]])
	}
	return dst
}

// heapNode is a symbol of a long piece in a doubly linked list.
type heapNode struct {
	prev, next int32
	rank       uint32 // rank (or merge rank) of merging this symbol with the next one
	id         uint32 // token of this symbol (merge-table algorithm only)
	gen        uint32 // bumped when rank changes, to discard stale heap entries
}

type heapItem struct {
	rank uint32
	pos  int32
	gen  uint32
}

func heapLess(a, b heapItem) bool {
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos)
}

func heapPush(h []heapItem, it heapItem) []heapItem {
	h = append(h, it)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !heapLess(h[i], h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	return h
}

func heapPop(h []heapItem) (heapItem, []heapItem) {
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h = h[:n]
	i := 0
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && heapLess(h[l], h[m]) {
			m = l
		}
		if r < n && heapLess(h[r], h[m]) {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	return top, h
}

// rankBPEHeap is rankBPE in O(n log n) for long pieces (long runs of letters, digits-free
// symbols or spaces), where the quadratic scan would be slow.
func (v *vocab) rankBPEHeap(dst []uint32, piece string) []uint32 {
	n := len(piece)
	nodes := make([]heapNode, n)
	for i := range nodes {
		nodes[i] = heapNode{prev: int32(i - 1), next: int32(i + 1), rank: noRank}
	}
	end := func(i int32) int {
		if nx := nodes[i].next; int(nx) < n {
			return int(nodes[nx].next)
		}
		return -1
	}
	rank := func(i int32) uint32 {
		e := end(i)
		if e < 0 {
			return noRank
		}
		if e > n {
			e = n
		}
		if r, ok := v.ids[piece[i:e]]; ok {
			return r
		}
		return noRank
	}
	h := make([]heapItem, 0, n)
	for i := range int32(n) {
		nodes[i].rank = rank(i)
		if nodes[i].rank != noRank {
			h = heapPush(h, heapItem{rank: nodes[i].rank, pos: i})
		}
	}
	for len(h) > 0 {
		var it heapItem
		it, h = heapPop(h)
		nd := &nodes[it.pos]
		if nd.gen != it.gen || nd.rank != it.rank || nd.prev == -2 {
			continue // stale
		}
		// Merge it.pos with its successor.
		succ := nd.next
		nd.next = nodes[succ].next
		if int(nd.next) < n {
			nodes[nd.next].prev = it.pos
		}
		nodes[succ].prev = -2 // removed
		nd.rank = rank(it.pos)
		nd.gen++
		if nd.rank != noRank {
			h = heapPush(h, heapItem{rank: nd.rank, pos: it.pos, gen: nd.gen})
		}
		if p := nd.prev; p >= 0 {
			pn := &nodes[p]
			pn.rank = rank(p)
			pn.gen++
			if pn.rank != noRank {
				h = heapPush(h, heapItem{rank: pn.rank, pos: p, gen: pn.gen})
			}
		}
	}
	for i := int32(0); int(i) < n; i = nodes[i].next {
		e := int(nodes[i].next)
		dst = append(dst, v.ids[piece[i:e]])
	}
	return dst
}

// mergeTable is a HuggingFace BPE model's merges: pair (left id, right id) to
// (rank << 32 | merged id). It is immutable after construction.
type mergeTable map[uint64]uint64

func pairKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

// mergeBPE encodes one piece the way the HuggingFace BPE model does: start from one symbol per
// byte and repeatedly apply the listed merge of lowest rank (leftmost first).
func (v *vocab) mergeBPE(dst []uint32, piece string, merges mergeTable) []uint32 {
	if len(piece) == 1 {
		return append(dst, v.byteIDs[piece[0]])
	}
	if len(piece) >= smallPiece {
		return v.mergeBPEHeap(dst, piece, merges)
	}
	var buf [smallPiece]part
	parts := buf[:len(piece)]
	for i := range parts {
		parts[i] = part{id: v.byteIDs[piece[i]], rank: noRank}
	}
	var mergedID [smallPiece]uint32
	look := func(i int) {
		parts[i].rank = noRank
		if i+1 < len(parts) {
			if m, ok := merges[pairKey(parts[i].id, parts[i+1].id)]; ok {
				parts[i].rank = uint32(m >> 32)
				mergedID[i] = uint32(m)
			}
		}
	}
	for i := range parts {
		look(i)
	}
	for len(parts) > 1 {
		minRank, minIdx := uint32(noRank), -1
		for i := 0; i+1 < len(parts); i++ {
			if parts[i].rank < minRank {
				minRank, minIdx = parts[i].rank, i
			}
		}
		if minIdx < 0 {
			break
		}
		parts[minIdx].id = mergedID[minIdx]
		copy(parts[minIdx+1:], parts[minIdx+2:])
		copy(mergedID[minIdx+1:len(parts)], mergedID[minIdx+2:len(parts)])
		parts = parts[:len(parts)-1]
		look(minIdx)
		if minIdx > 0 {
			look(minIdx - 1)
		}
	}
	for _, p := range parts {
		dst = append(dst, p.id)
	}
	return dst
}

// mergeBPEHeap is mergeBPE in O(n log n) for long pieces.
func (v *vocab) mergeBPEHeap(dst []uint32, piece string, merges mergeTable) []uint32 {
	n := len(piece)
	nodes := make([]heapNode, n)
	merged := make([]uint32, n)
	for i := range nodes {
		nodes[i] = heapNode{prev: int32(i - 1), next: int32(i + 1), rank: noRank, id: v.byteIDs[piece[i]]}
	}
	look := func(i int32) {
		nd := &nodes[i]
		nd.rank = noRank
		if int(nd.next) < n {
			if m, ok := merges[pairKey(nd.id, nodes[nd.next].id)]; ok {
				nd.rank = uint32(m >> 32)
				merged[i] = uint32(m)
			}
		}
	}
	h := make([]heapItem, 0, n)
	for i := range int32(n) {
		look(i)
		if nodes[i].rank != noRank {
			h = heapPush(h, heapItem{rank: nodes[i].rank, pos: i})
		}
	}
	for len(h) > 0 {
		var it heapItem
		it, h = heapPop(h)
		nd := &nodes[it.pos]
		if nd.gen != it.gen || nd.rank != it.rank || nd.prev == -2 {
			continue
		}
		succ := nd.next
		nd.id = merged[it.pos]
		nd.next = nodes[succ].next
		if int(nd.next) < n {
			nodes[nd.next].prev = it.pos
		}
		nodes[succ].prev = -2
		look(it.pos)
		nd.gen++
		if nd.rank != noRank {
			h = heapPush(h, heapItem{rank: nd.rank, pos: it.pos, gen: nd.gen})
		}
		if p := nd.prev; p >= 0 {
			look(p)
			nodes[p].gen++
			if nodes[p].rank != noRank {
				h = heapPush(h, heapItem{rank: nodes[p].rank, pos: p, gen: nodes[p].gen})
			}
		}
	}
	for i := int32(0); int(i) < n; i = nodes[i].next {
		dst = append(dst, nodes[i].id)
	}
	return dst
}

// selfMemo remembers, per token id, whether the merge table turns the token's own bytes into
// that single token, so that a piece found whole in the vocabulary can skip the merges. Each id
// has two bits: 0 unknown, 1 yes, 2 no. Safe for concurrent use.
type selfMemo struct {
	words []atomic.Uint32
}

func newSelfMemo(n int) *selfMemo {
	return &selfMemo{words: make([]atomic.Uint32, (n+15)/16)}
}

func (m *selfMemo) get(id uint32) uint32 {
	return m.words[id/16].Load() >> (2 * (id % 16)) & 3
}

func (m *selfMemo) set(id uint32, v uint32) {
	w := &m.words[id/16]
	for {
		old := w.Load()
		nw := old | v<<(2*(id%16))
		if old == nw || w.CompareAndSwap(old, nw) {
			return
		}
	}
}
