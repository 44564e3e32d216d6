package kvevents

import (
	"encoding/binary"
	"math"
)

// Wire names of event fields, in the order vLLM declares them. Map-encoded events list the
// fields in this order with "type" first, as msgspec does.
const (
	keyType            = "type"
	keyBlockHashes     = "block_hashes"
	keyParent          = "parent_block_hash"
	keyTokenIDs        = "token_ids"
	keyBlockSize       = "block_size"
	keyLoraID          = "lora_id"
	keyMedium          = "medium"
	keyLoraName        = "lora_name"
	keyExtraKeys       = "extra_keys"
	keyGroupIdx        = "group_idx"
	keySpecKind        = "kv_cache_spec_kind"
	keySlidingWindow   = "kv_cache_spec_sliding_window"
	keyLocality        = "locality"
	keyOwnership       = "ownership"
	keySessionID       = "session_id"
	keyBatchTS         = "ts"
	keyBatchEvents     = "events"
	keyBatchDPRank     = "data_parallel_rank"
	tagBlockStored     = "BlockStored"
	tagBlockRemoved    = "BlockRemoved"
	tagAllBlocksClear  = "AllBlocksCleared"
	storedMinArrayLen  = 6 // tag + block_hashes, parent, token_ids, block_size, lora_id
	removedMinArrayLen = 2 // tag + block_hashes
)

// AppendBatch appends the msgpack encoding of b in format f to dst and returns the extended
// slice. The batch is the positional array [ts, [event, ...], data_parallel_rank] (the rank
// is left out when !b.HasDPRank); events are maps (FormatMap) or tagged arrays (FormatArray).
// Events whose Kind is not valid are left out. Optional fields at their nil value are left
// out the way msgspec's omit_defaults does, so a plain event's bytes match vLLM's.
//
// AppendBatch does not allocate when dst has room; reuse dst[:0] across calls. It is safe for
// concurrent use on distinct dst buffers and does not retain b or dst.
func AppendBatch(dst []byte, b *Batch, f Format) []byte {
	n := 2
	if b.HasDPRank {
		n = 3
	}
	dst = appendArrayHeader(dst, n)
	dst = appendFloat64(dst, b.TS)
	valid := 0
	for i := range b.Events {
		if b.Events[i].Kind.Valid() {
			valid++
		}
	}
	dst = appendArrayHeader(dst, valid)
	for i := range b.Events {
		e := &b.Events[i]
		if !e.Kind.Valid() {
			continue
		}
		if f == FormatArray {
			dst = appendEventArray(dst, e)
		} else {
			dst = appendEventMap(dst, e)
		}
	}
	if b.HasDPRank {
		dst = appendInt(dst, int64(b.DPRank))
	}
	return dst
}

func appendEventMap(dst []byte, e *Event) []byte {
	switch e.Kind {
	case BlockStored:
		n := 8
		if e.HasExtraKeys {
			n++
		}
		if e.HasGroupIdx {
			n++
		}
		if e.KVCacheSpecKind != "" {
			n++
		}
		if e.HasSlidingWindow {
			n++
		}
		n += countStrs(e.Locality, e.Ownership, e.SessionID)
		dst = appendMapHeader(dst, n)
		dst = appendStr(dst, keyType)
		dst = appendStr(dst, tagBlockStored)
		dst = appendStr(dst, keyBlockHashes)
		dst = appendHashes(dst, e.BlockHashes)
		dst = appendStr(dst, keyParent)
		dst = appendOptHash(dst, e.Parent, e.HasParent)
		dst = appendStr(dst, keyTokenIDs)
		dst = appendTokens(dst, e.TokenIDs, e.BigramTokens)
		dst = appendStr(dst, keyBlockSize)
		dst = appendInt(dst, int64(e.BlockSize))
		dst = appendStr(dst, keyLoraID)
		dst = appendOptInt(dst, e.LoraID, e.HasLoraID)
		dst = appendStr(dst, keyMedium)
		dst = appendOptStr(dst, e.Medium)
		dst = appendStr(dst, keyLoraName)
		dst = appendOptStr(dst, e.LoraName)
		if e.HasExtraKeys {
			dst = appendStr(dst, keyExtraKeys)
			dst = appendExtraKeys(dst, e.ExtraKeys)
		}
		if e.HasGroupIdx {
			dst = appendStr(dst, keyGroupIdx)
			dst = appendInt(dst, int64(e.GroupIdx))
		}
		if e.KVCacheSpecKind != "" {
			dst = appendStr(dst, keySpecKind)
			dst = appendStr(dst, e.KVCacheSpecKind)
		}
		if e.HasSlidingWindow {
			dst = appendStr(dst, keySlidingWindow)
			dst = appendInt(dst, int64(e.SlidingWindow))
		}
		dst = appendStrField(dst, keyLocality, e.Locality)
		dst = appendStrField(dst, keyOwnership, e.Ownership)
		dst = appendStrField(dst, keySessionID, e.SessionID)
	case BlockRemoved:
		n := 3
		if e.HasGroupIdx {
			n++
		}
		n += countStrs(e.Locality, e.Ownership)
		dst = appendMapHeader(dst, n)
		dst = appendStr(dst, keyType)
		dst = appendStr(dst, tagBlockRemoved)
		dst = appendStr(dst, keyBlockHashes)
		dst = appendHashes(dst, e.BlockHashes)
		dst = appendStr(dst, keyMedium)
		dst = appendOptStr(dst, e.Medium)
		if e.HasGroupIdx {
			dst = appendStr(dst, keyGroupIdx)
			dst = appendInt(dst, int64(e.GroupIdx))
		}
		dst = appendStrField(dst, keyLocality, e.Locality)
		dst = appendStrField(dst, keyOwnership, e.Ownership)
	case AllBlocksCleared:
		dst = appendMapHeader(dst, 1)
		dst = appendStr(dst, keyType)
		dst = appendStr(dst, tagAllBlocksClear)
	}
	return dst
}

func appendEventArray(dst []byte, e *Event) []byte {
	switch e.Kind {
	case BlockStored:
		// Positions: 0 tag, 1 hashes, 2 parent, 3 tokens, 4 block_size, 5 lora_id, 6 medium,
		// 7 lora_name, 8 extra_keys, 9 group_idx, 10 spec kind, 11 sliding window. The
		// fields engines added after they moved to maps (locality, ownership, session_id)
		// have no position and are not written.
		n := storedMinArrayLen
		switch {
		case e.HasSlidingWindow:
			n = 12
		case e.KVCacheSpecKind != "":
			n = 11
		case e.HasGroupIdx:
			n = 10
		case e.HasExtraKeys:
			n = 9
		case e.LoraName != "":
			n = 8
		case e.Medium != "":
			n = 7
		}
		dst = appendArrayHeader(dst, n)
		dst = appendStr(dst, tagBlockStored)
		dst = appendHashes(dst, e.BlockHashes)
		dst = appendOptHash(dst, e.Parent, e.HasParent)
		dst = appendTokens(dst, e.TokenIDs, e.BigramTokens)
		dst = appendInt(dst, int64(e.BlockSize))
		dst = appendOptInt(dst, e.LoraID, e.HasLoraID)
		if n > 6 {
			dst = appendOptStr(dst, e.Medium)
		}
		if n > 7 {
			dst = appendOptStr(dst, e.LoraName)
		}
		if n > 8 {
			if e.HasExtraKeys {
				dst = appendExtraKeys(dst, e.ExtraKeys)
			} else {
				dst = appendNil(dst)
			}
		}
		if n > 9 {
			dst = appendOptInt(dst, e.GroupIdx, e.HasGroupIdx)
		}
		if n > 10 {
			dst = appendOptStr(dst, e.KVCacheSpecKind)
		}
		if n > 11 {
			dst = appendInt(dst, int64(e.SlidingWindow))
		}
	case BlockRemoved:
		// Positions: 0 tag, 1 hashes, 2 medium, 3 group_idx (locality and ownership: map
		// events only).
		n := removedMinArrayLen
		switch {
		case e.HasGroupIdx:
			n = 4
		case e.Medium != "":
			n = 3
		}
		dst = appendArrayHeader(dst, n)
		dst = appendStr(dst, tagBlockRemoved)
		dst = appendHashes(dst, e.BlockHashes)
		if n > 2 {
			dst = appendOptStr(dst, e.Medium)
		}
		if n > 3 {
			dst = appendInt(dst, int64(e.GroupIdx))
		}
	case AllBlocksCleared:
		dst = appendArrayHeader(dst, 1)
		dst = appendStr(dst, tagAllBlocksClear)
	}
	return dst
}

func appendHashes(dst []byte, hs []Hash) []byte {
	dst = appendArrayHeader(dst, len(hs))
	for _, h := range hs {
		dst = appendHash(dst, h)
	}
	return dst
}

func appendHash(dst []byte, h Hash) []byte {
	if h.B != "" {
		return appendBin(dst, h.B)
	}
	return appendUint(dst, h.U)
}

func appendOptHash(dst []byte, h Hash, ok bool) []byte {
	if !ok {
		return appendNil(dst)
	}
	return appendHash(dst, h)
}

func appendTokens(dst []byte, toks []uint32, bigram bool) []byte {
	if bigram && len(toks) >= 2 {
		dst = appendArrayHeader(dst, len(toks)-1)
		for i := 1; i < len(toks); i++ {
			dst = append(dst, 0x92)
			dst = appendUint(dst, uint64(toks[i-1]))
			dst = appendUint(dst, uint64(toks[i]))
		}
		return dst
	}
	dst = appendArrayHeader(dst, len(toks))
	for _, t := range toks {
		dst = appendUint(dst, uint64(t))
	}
	return dst
}

func appendExtraKeys(dst []byte, keys []RawValue) []byte {
	dst = appendArrayHeader(dst, len(keys))
	for _, k := range keys {
		if k == nil {
			dst = appendNil(dst)
		} else {
			dst = append(dst, k...)
		}
	}
	return dst
}

func appendOptInt(dst []byte, v int, ok bool) []byte {
	if !ok {
		return appendNil(dst)
	}
	return appendInt(dst, int64(v))
}

func appendOptStr(dst []byte, s string) []byte {
	if s == "" {
		return appendNil(dst)
	}
	return appendStr(dst, s)
}

// The msgpack primitives below pick the shortest form for each value, as msgspec and
// Python's msgpack do: non-negative integers as (fix)uint, negative ones as (fix)int, floats as
// float64, strings as fixstr/str8/16/32 and bytes as bin8/16/32.

func appendNil(dst []byte) []byte { return append(dst, 0xc0) }

func appendUint(dst []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(dst, byte(v))
	case v <= math.MaxUint8:
		return append(dst, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xcd), uint16(v))
	case v <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(dst, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xcf), v)
}

func appendInt(dst []byte, v int64) []byte {
	if v >= 0 {
		return appendUint(dst, uint64(v))
	}
	switch {
	case v >= -32:
		return append(dst, byte(v))
	case v >= math.MinInt8:
		return append(dst, 0xd0, byte(v))
	case v >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(dst, 0xd1), uint16(v))
	case v >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(dst, 0xd2), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(dst, 0xd3), uint64(v))
}

func appendFloat64(dst []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(dst, 0xcb), math.Float64bits(f))
}

func appendStr(dst []byte, s string) []byte {
	n := len(s)
	switch {
	case n <= 31:
		dst = append(dst, 0xa0|byte(n))
	case n <= math.MaxUint8:
		dst = append(dst, 0xd9, byte(n))
	case n <= math.MaxUint16:
		dst = binary.BigEndian.AppendUint16(append(dst, 0xda), uint16(n))
	default:
		dst = binary.BigEndian.AppendUint32(append(dst, 0xdb), uint32(n))
	}
	return append(dst, s...)
}

func appendBin(dst []byte, s string) []byte {
	n := len(s)
	switch {
	case n <= math.MaxUint8:
		dst = append(dst, 0xc4, byte(n))
	case n <= math.MaxUint16:
		dst = binary.BigEndian.AppendUint16(append(dst, 0xc5), uint16(n))
	default:
		dst = binary.BigEndian.AppendUint32(append(dst, 0xc6), uint32(n))
	}
	return append(dst, s...)
}

func appendArrayHeader(dst []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(dst, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(dst, 0xdd), uint32(n))
}

func appendMapHeader(dst []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(dst, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(dst, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(dst, 0xdf), uint32(n))
}

// countStrs counts the non-empty strings: the optional string fields a map event carries
// (omitted when nil, as msgspec's omit_defaults does).
func countStrs(ss ...string) int {
	n := 0
	for _, s := range ss {
		if s != "" {
			n++
		}
	}
	return n
}

// appendStrField appends key and s to a map event when s is not empty.
func appendStrField(dst []byte, key, s string) []byte {
	if s == "" {
		return dst
	}
	return appendStr(appendStr(dst, key), s)
}
