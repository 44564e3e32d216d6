package kvevents

import (
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// sameBatch compares batches field by field, treating nil and empty slices alike and
// timestamps by their bits (NaN included); Skipped is not compared.
func sameBatch(a, b *Batch) bool {
	if math.Float64bits(a.TS) != math.Float64bits(b.TS) || a.HasDPRank != b.HasDPRank ||
		(a.HasDPRank && a.DPRank != b.DPRank) || len(a.Events) != len(b.Events) {
		return false
	}
	for i := range a.Events {
		x, y := a.Events[i], b.Events[i]
		for _, e := range []*Event{&x, &y} {
			if len(e.BlockHashes) == 0 {
				e.BlockHashes = nil
			}
			if len(e.TokenIDs) == 0 {
				e.TokenIDs = nil
			}
			if len(e.ExtraKeys) == 0 {
				e.ExtraKeys = nil
			}
		}
		if !reflect.DeepEqual(x, y) {
			return false
		}
	}
	return true
}

func FuzzDecodeBatch(f *testing.F) {
	for _, v := range append(loadVectors(f, "vectors"), loadVectors(f, "captures")...) {
		f.Add(v.data)
	}
	f.Add(AppendBatch(nil, typicalBatch(), FormatArray))
	f.Add([]byte{0xc1})
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := DecodeBatch(data)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		// What decodes must survive a round trip through either encoding.
		for _, format := range []Format{FormatMap, FormatArray} {
			enc := AppendBatch(nil, &b, format)
			again, err := DecodeBatch(enc)
			if err != nil {
				t.Fatalf("decoding our %s re-encoding %x of %x: %v", format, enc, data, err)
			}
			want := &b
			if format == FormatArray {
				want = withoutMapOnly(&b)
			}
			if !sameBatch(want, &again) {
				t.Fatalf("%s round trip of %x\n got %+v\nwant %+v", format, data, again, *want)
			}
			var generic any
			if err := msgpack.Unmarshal(enc, &generic); err != nil {
				t.Fatalf("vmihailenco/msgpack rejects our %s encoding %x: %v", format, enc, err)
			}
		}
	})
}

// fuzzSource builds a batch from fuzz bytes: every field the encoder can write, with values
// drawn from the input so that the fuzzer explores lengths, bytes hashes and big integers.
type fuzzSource struct{ b []byte }

func (s *fuzzSource) u64() uint64 {
	if len(s.b) >= 8 {
		v := binary.LittleEndian.Uint64(s.b)
		s.b = s.b[8:]
		return v
	}
	var v uint64
	for _, c := range s.b {
		v = v<<8 | uint64(c)
	}
	s.b = nil
	return v
}

func (s *fuzzSource) byte() byte {
	if len(s.b) == 0 {
		return 0
	}
	c := s.b[0]
	s.b = s.b[1:]
	return c
}

func (s *fuzzSource) str(max int) string {
	n := int(s.byte()) % (max + 1)
	n = min(n, len(s.b))
	out := string(s.b[:n])
	s.b = s.b[n:]
	return out
}

// text is str made valid UTF-8, as msgpack str values must be for other implementations.
func (s *fuzzSource) text(max int) string { return strings.ToValidUTF8(s.str(max), "\uFFFD") }

func (s *fuzzSource) num() int { return int(int64(s.u64()) >> (s.byte() % 64)) }

func (s *fuzzSource) hash() Hash {
	if s.byte()%4 == 0 {
		if b := s.str(40); b != "" {
			return Hash{B: b}
		}
	}
	return HashU64(s.u64())
}

func (s *fuzzSource) batch() *Batch {
	b := &Batch{TS: math.Float64frombits(s.u64())}
	if s.byte()%2 == 0 {
		b.DPRank, b.HasDPRank = s.num(), true
	}
	for n := int(s.byte() % 6); n > 0 && len(s.b) > 0; n-- {
		e := Event{Kind: Kind(s.byte()%3 + 1)}
		for k := int(s.byte() % 20); k > 0; k-- {
			e.BlockHashes = append(e.BlockHashes, s.hash())
		}
		if e.Kind == AllBlocksCleared {
			e.BlockHashes = nil
		} else {
			e.Medium = s.text(8)
			if s.byte()%2 == 0 {
				e.GroupIdx, e.HasGroupIdx = s.num(), true
			}
		}
		if e.Kind == BlockStored {
			flags := s.byte()
			e.Parent, e.HasParent = s.hash(), flags&1 != 0
			if !e.HasParent {
				e.Parent = Hash{}
			}
			for k := int(s.byte()); k > 0 && len(s.b) > 0; k-- {
				e.TokenIDs = append(e.TokenIDs, uint32(s.u64()))
			}
			e.BigramTokens = flags&2 != 0 && len(e.TokenIDs) >= 2
			e.BlockSize = s.num()
			if flags&4 != 0 {
				e.LoraID, e.HasLoraID = s.num(), true
			}
			e.LoraName = s.text(300)
			if flags&8 != 0 {
				e.HasExtraKeys = true
				for range e.BlockHashes {
					if s.byte()%2 == 0 {
						e.ExtraKeys = append(e.ExtraKeys, nil)
					} else {
						key := appendStr(appendArrayHeader(nil, 2), s.text(20))
						e.ExtraKeys = append(e.ExtraKeys, RawValue(appendUint(key, s.u64())))
					}
				}
			}
			e.KVCacheSpecKind = s.text(20)
			if flags&16 != 0 {
				e.SlidingWindow, e.HasSlidingWindow = s.num(), true
			}
		}
		b.Events = append(b.Events, e)
	}
	return b
}

func FuzzAppendBatch(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"))
	f.Add(AppendBatch(nil, typicalBatch(), FormatMap))
	f.Fuzz(func(t *testing.T, data []byte) {
		src := &fuzzSource{b: data}
		b := src.batch()
		for _, format := range []Format{FormatMap, FormatArray} {
			enc := AppendBatch(nil, b, format)
			got, err := DecodeBatch(enc)
			if err != nil {
				t.Fatalf("%s: decoding %x: %v", format, enc, err)
			}
			if !sameBatch(b, &got) {
				t.Fatalf("%s round trip\n got %+v\nwant %+v", format, got, *b)
			}
			var generic any
			if err := msgpack.Unmarshal(enc, &generic); err != nil {
				t.Fatalf("vmihailenco/msgpack rejects our %s encoding %x: %v", format, enc, err)
			}
		}
	})
}
