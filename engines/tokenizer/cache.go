package tokenizer

import (
	"encoding/binary"
	"hash/maphash"
	"sync/atomic"
)

// Piece cache sizes: pieces of up to cacheMaxPiece bytes that encode to at most cacheMaxIDs
// tokens are remembered in one of cacheSlots slots.
const (
	cacheSlots    = 1 << 12
	cacheMaxPiece = 24
	cacheMaxIDs   = 12
)

// pieceCache is a direct-mapped cache of BPE results for short pieces that are not single
// tokens, so that common words that split ("tokenizer" → "token", "izer") skip the merge loop.
// It never allocates: each slot is a seqlock over atomic words (a writer makes the sequence odd,
// stores, then makes it even again; a reader retries nothing and simply misses if the sequence
// moved), which keeps it safe for concurrent use and clean under the race detector.
type pieceCache struct {
	seed  maphash.Seed
	slots []cacheSlot
}

type cacheSlot struct {
	meta  atomic.Uint64 // seq << 16 | piece length << 8 | id count
	piece [cacheMaxPiece / 8]atomic.Uint64
	ids   [cacheMaxIDs / 2]atomic.Uint64
}

func newPieceCache() *pieceCache {
	return &pieceCache{seed: maphash.MakeSeed(), slots: make([]cacheSlot, cacheSlots)}
}

func (c *pieceCache) slot(piece string) *cacheSlot {
	return &c.slots[maphash.String(c.seed, piece)&(cacheSlots-1)]
}

// get appends the cached ids of piece to dst; ok is false on a miss.
func (c *pieceCache) get(dst []uint32, piece string) ([]uint32, bool) {
	s := c.slot(piece)
	m := s.meta.Load()
	if m&(1<<16) != 0 || int(m>>8&0xff) != len(piece) {
		return dst, false
	}
	var buf [cacheMaxPiece]byte
	for i := range s.piece {
		binary.LittleEndian.PutUint64(buf[8*i:], s.piece[i].Load())
	}
	n := int(m & 0xff)
	var ids [cacheMaxIDs]uint32
	for i := 0; 2*i < n; i++ {
		w := s.ids[i].Load()
		ids[2*i], ids[2*i+1] = uint32(w), uint32(w>>32)
	}
	if s.meta.Load() != m || string(buf[:len(piece)]) != piece {
		return dst, false
	}
	return append(dst, ids[:n]...), true
}

// put remembers ids as the encoding of piece, unless another writer holds the slot.
func (c *pieceCache) put(piece string, ids []uint32) {
	if len(piece) > cacheMaxPiece || len(ids) > cacheMaxIDs || len(ids) == 0 {
		return
	}
	s := c.slot(piece)
	m := s.meta.Load()
	if m&(1<<16) != 0 || !s.meta.CompareAndSwap(m, m|1<<16) {
		return
	}
	var buf [cacheMaxPiece]byte
	copy(buf[:], piece)
	for i := range s.piece {
		s.piece[i].Store(binary.LittleEndian.Uint64(buf[8*i:]))
	}
	var idb [cacheMaxIDs]uint32
	copy(idb[:], ids)
	for i := range s.ids {
		s.ids[i].Store(uint64(idb[2*i]) | uint64(idb[2*i+1])<<32)
	}
	seq := m>>16 + 2 // stays even
	s.meta.Store(seq<<16 | uint64(len(piece))<<8 | uint64(len(ids)))
}
