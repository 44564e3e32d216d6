package kvevents

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
)

// Errors wrapped into every decoding failure; each also wraps ErrMalformed. They are static so
// that the decoder's error paths do not allocate.
var (
	errTruncated    = fmt.Errorf("%w: truncated", ErrMalformed)
	errTrailing     = fmt.Errorf("%w: trailing bytes after batch", ErrMalformed)
	errType         = fmt.Errorf("%w: unexpected msgpack type", ErrMalformed)
	errRange        = fmt.Errorf("%w: integer out of range", ErrMalformed)
	errLength       = fmt.Errorf("%w: length exceeds input", ErrMalformed)
	errDepth        = fmt.Errorf("%w: nesting too deep", ErrMalformed)
	errShortBatch   = fmt.Errorf("%w: batch needs ts and events", ErrMalformed)
	errNoTag        = fmt.Errorf("%w: event without type tag", ErrMalformed)
	errBigram       = fmt.Errorf("%w: bigram token pairs do not chain", ErrMalformed)
	errMapKey       = fmt.Errorf("%w: map key is not a string", ErrMalformed)
	errInvalidFloat = fmt.Errorf("%w: timestamp is not a number", ErrMalformed)
)

// maxDepth bounds the nesting of values the decoder skips or captures (unknown fields,
// extra_keys entries), so hostile input cannot exhaust the stack.
const maxDepth = 32

// DecodeBatch decodes one KV event batch in either encoding: events as maps (current vLLM) or
// as tagged arrays (older vLLM, SGLang, simulators), the batch as a positional array with
// optional trailing fields or as a map. Unknown fields and extra array elements are ignored;
// events with an unknown type tag are counted in Batch.Skipped and left out. Anything else
// that is not a well-formed batch yields an error wrapping ErrMalformed. DecodeBatch never
// panics and the result does not alias data.
func DecodeBatch(data []byte) (Batch, error) {
	var b Batch
	err := DecodeBatchInto(&b, data)
	return b, err
}

// DecodeBatchInto is DecodeBatch decoding into dst, reusing the capacity of dst.Events and of
// each event's slices so that a long-lived Batch decodes steady-state traffic with few
// allocations (bytes-form hashes, unusual strings and extra_keys entries still allocate). On
// error dst holds a partial result and must not be used. dst must not be shared with another
// goroutine during the call.
func DecodeBatchInto(dst *Batch, data []byte) error {
	r := reader{b: data}
	events := dst.Events[:0]
	*dst = Batch{Events: events}
	if r.off >= len(r.b) {
		return errTruncated
	}
	var err error
	switch c := r.b[r.off]; {
	case isArray(c):
		err = r.batchArray(dst)
	case isMap(c):
		err = r.batchMap(dst)
	default:
		err = errType
	}
	if err != nil {
		return fmt.Errorf("decoding kv event batch: %w", err)
	}
	if r.off != len(r.b) {
		return fmt.Errorf("decoding kv event batch: %w", errTrailing)
	}
	return nil
}

func (r *reader) batchArray(dst *Batch) error {
	n, err := r.arrayLen()
	if err != nil {
		return err
	}
	if n < 2 {
		return errShortBatch
	}
	if dst.TS, err = r.float(); err != nil {
		return err
	}
	if err = r.events(dst); err != nil {
		return err
	}
	if n >= 3 {
		if dst.DPRank, dst.HasDPRank, err = r.optInt(); err != nil {
			return err
		}
	}
	for i := 3; i < n; i++ {
		if err = r.skip(0); err != nil {
			return err
		}
	}
	return nil
}

func (r *reader) batchMap(dst *Batch) error {
	n, err := r.mapLen()
	if err != nil {
		return err
	}
	var haveTS, haveEvents bool
	for range n {
		key, err := r.str()
		if err != nil {
			if err == errType {
				return errMapKey
			}
			return err
		}
		switch string(key) {
		case keyBatchTS:
			dst.TS, err = r.float()
			haveTS = true
		case keyBatchEvents:
			dst.Events = dst.Events[:0]
			dst.Skipped = 0
			err = r.events(dst)
			haveEvents = true
		case keyBatchDPRank:
			dst.DPRank, dst.HasDPRank, err = r.optInt()
		default:
			err = r.skip(0)
		}
		if err != nil {
			return err
		}
	}
	if !haveTS || !haveEvents {
		return errShortBatch
	}
	return nil
}

func (r *reader) events(dst *Batch) error {
	n, err := r.arrayLen()
	if err != nil {
		return err
	}
	// An Event is two hundred bytes; bound what a short hostile header can make us reserve.
	dst.Events = slices.Grow(dst.Events, min(n, 256))
	for i := range n {
		evs := dst.Events
		if len(evs) < cap(evs) {
			evs = evs[:len(evs)+1]
		} else {
			evs = append(evs, Event{})
		}
		e := &evs[len(evs)-1]
		*e = Event{BlockHashes: e.BlockHashes[:0], TokenIDs: e.TokenIDs[:0], ExtraKeys: e.ExtraKeys[:0]}
		known, err := r.event(e)
		if err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		if known {
			dst.Events = evs
		} else {
			dst.Events = evs[:len(evs)-1]
			dst.Skipped++
		}
	}
	return nil
}

// event decodes one event into e and reports whether its tag is known. Unknown-tag events are
// consumed whole.
func (r *reader) event(e *Event) (bool, error) {
	if r.off >= len(r.b) {
		return false, errTruncated
	}
	var err error
	if c := r.b[r.off]; isArray(c) {
		err = r.eventArray(e)
	} else if isMap(c) {
		err = r.eventMap(e)
	} else {
		return false, errType
	}
	if err != nil {
		return false, err
	}
	if !e.Kind.Valid() {
		return false, nil
	}
	// Keep only the fields that belong to the kind, so that what decodes re-encodes to the
	// same event.
	switch e.Kind {
	case BlockRemoved:
		*e = Event{Kind: BlockRemoved, BlockHashes: e.BlockHashes, Medium: e.Medium,
			GroupIdx: e.GroupIdx, HasGroupIdx: e.HasGroupIdx, Locality: e.Locality, Ownership: e.Ownership,
			TokenIDs: e.TokenIDs[:0], ExtraKeys: e.ExtraKeys[:0]}
	case AllBlocksCleared:
		*e = Event{Kind: AllBlocksCleared, BlockHashes: e.BlockHashes[:0],
			TokenIDs: e.TokenIDs[:0], ExtraKeys: e.ExtraKeys[:0]}
	}
	return true, nil
}

func kindOf(tag []byte) Kind {
	switch string(tag) {
	case tagBlockStored:
		return BlockStored
	case tagBlockRemoved:
		return BlockRemoved
	case tagAllBlocksClear:
		return AllBlocksCleared
	}
	return 0
}

func (r *reader) eventArray(e *Event) error {
	n, err := r.arrayLen()
	if err != nil {
		return err
	}
	if n == 0 {
		return errNoTag
	}
	tag, err := r.str()
	if err != nil {
		return err
	}
	e.Kind = kindOf(tag)
	var fields []string
	switch e.Kind {
	case BlockStored:
		fields = storedFields[:]
	case BlockRemoved:
		fields = removedFields[:]
	}
	for i := 1; i < n; i++ {
		if i-1 < len(fields) {
			err = r.field(e, fields[i-1])
		} else {
			err = r.skip(0)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// Positional layouts of tagged-array events, after the tag.
var (
	storedFields = [...]string{keyBlockHashes, keyParent, keyTokenIDs, keyBlockSize, keyLoraID,
		keyMedium, keyLoraName, keyExtraKeys, keyGroupIdx, keySpecKind, keySlidingWindow}
	removedFields = [...]string{keyBlockHashes, keyMedium, keyGroupIdx}
)

func (r *reader) eventMap(e *Event) error {
	n, err := r.mapLen()
	if err != nil {
		return err
	}
	tagged := false
	var fieldErr error
	for range n {
		key, err := r.str()
		if err != nil {
			if err == errType {
				return errMapKey
			}
			return err
		}
		if string(key) == keyType {
			tag, err := r.str()
			if err != nil {
				return err
			}
			e.Kind = kindOf(tag)
			tagged = true
			continue
		}
		// The tag may come after the fields, and an unknown event type may give a known
		// field name another type: remember the first bad field, skip it, and decide once
		// the tag is known.
		save := r.off
		if err := r.field(e, string(key)); err != nil {
			if fieldErr == nil {
				fieldErr = err
			}
			r.off = save
			if err := r.skip(0); err != nil {
				return err
			}
		}
	}
	if !tagged {
		return errNoTag
	}
	if e.Kind.Valid() {
		return fieldErr
	}
	return nil
}

// field decodes the value of the named event field into e. The fields every engine has sent
// since the first release are checked strictly; later extensions (lora_name, extra_keys,
// group_idx, kv_cache_spec_*) are dropped when their type is unexpected, because engines have
// put other things at those array positions (SGLang once sent a metadata map at position 7).
// Unknown names are skipped.
func (r *reader) field(e *Event, name string) error {
	var err error
	switch name {
	case keyBlockHashes:
		e.BlockHashes, err = r.hashes(e.BlockHashes[:0])
	case keyParent:
		if r.nextNil() {
			e.HasParent = false
		} else {
			e.Parent, err = r.hash()
			e.HasParent = err == nil
		}
	case keyTokenIDs:
		e.TokenIDs, e.BigramTokens, err = r.tokens(e.TokenIDs[:0])
	case keyBlockSize:
		var v int64
		v, err = r.int()
		e.BlockSize = int(v)
	case keyLoraID:
		e.LoraID, e.HasLoraID, err = r.optInt()
	case keyMedium:
		var s []byte
		s, err = r.optStr()
		e.Medium = intern(s)
	case keyLoraName:
		if s, ok := r.tryOptStr(); ok {
			e.LoraName = intern(s)
			return nil
		}
		return r.skip(0)
	case keyExtraKeys:
		if r.nextNil() {
			e.HasExtraKeys = false
			return nil
		}
		if r.off < len(r.b) && isArray(r.b[r.off]) {
			e.ExtraKeys, err = r.rawList(e.ExtraKeys[:0])
			e.HasExtraKeys = err == nil
			return err
		}
		return r.skip(0)
	case keyGroupIdx:
		if v, ok, good := r.tryOptInt(); good {
			e.GroupIdx, e.HasGroupIdx = v, ok
			return nil
		}
		return r.skip(0)
	case keySpecKind:
		if s, ok := r.tryOptStr(); ok {
			e.KVCacheSpecKind = intern(s)
			return nil
		}
		return r.skip(0)
	case keySlidingWindow:
		if v, ok, good := r.tryOptInt(); good {
			e.SlidingWindow, e.HasSlidingWindow = v, ok
			return nil
		}
		return r.skip(0)
	case keyLocality, keyOwnership, keySessionID:
		s, ok := r.tryOptStr()
		if !ok {
			return r.skip(0)
		}
		switch name {
		case keyLocality:
			e.Locality = intern(s)
		case keyOwnership:
			e.Ownership = intern(s)
		default:
			e.SessionID = string(s)
		}
		return nil
	default:
		err = r.skip(0)
	}
	return err
}

// intern returns s as a string, without allocating for the values engines send on every
// event.
func intern(s []byte) string {
	switch string(s) {
	case "":
		return ""
	case "GPU":
		return "GPU"
	case "CPU":
		return "CPU"
	case "DISK":
		return "DISK"
	case "STORAGE":
		return "STORAGE"
	case "CPU_PINNED":
		return "CPU_PINNED"
	case "LOCAL":
		return "LOCAL"
	case "REMOTE":
		return "REMOTE"
	case "cpu":
		return "cpu"
	case "gpu":
		return "gpu"
	case "full_attention":
		return "full_attention"
	case "sliding_window":
		return "sliding_window"
	case "mamba":
		return "mamba"
	}
	return string(s)
}

func (r *reader) hashes(dst []Hash) ([]Hash, error) {
	n, err := r.arrayLen()
	if err != nil {
		return dst, err
	}
	dst = slices.Grow(dst, n)
	for range n {
		h, err := r.hash()
		if err != nil {
			return dst, err
		}
		dst = append(dst, h)
	}
	return dst, nil
}

func (r *reader) hash() (Hash, error) {
	if r.off >= len(r.b) {
		return Hash{}, errTruncated
	}
	c := r.b[r.off]
	if isStr(c) || isBin(c) {
		s, err := r.strOrBin()
		if err != nil {
			return Hash{}, err
		}
		return Hash{B: string(s)}, nil
	}
	v, err := r.intBits()
	return Hash{U: v}, err
}

func (r *reader) tokens(dst []uint32) ([]uint32, bool, error) {
	n, err := r.arrayLen()
	if err != nil {
		return dst, false, err
	}
	if n == 0 {
		return dst, false, nil
	}
	dst = slices.Grow(dst, n+1)
	if r.off < len(r.b) && isArray(r.b[r.off]) {
		// SGLang EAGLE bigram pairs [[t0,t1],[t1,t2],...].
		for i := range n {
			m, err := r.arrayLen()
			if err != nil {
				return dst, true, err
			}
			if m != 2 {
				return dst, true, errBigram
			}
			a, err := r.token()
			if err != nil {
				return dst, true, err
			}
			b, err := r.token()
			if err != nil {
				return dst, true, err
			}
			if i == 0 {
				dst = append(dst, a)
			} else if dst[len(dst)-1] != a {
				return dst, true, errBigram
			}
			dst = append(dst, b)
		}
		return dst, true, nil
	}
	for range n {
		// The encodings token ids take (a fixint, uint8, uint16, uint32) read in place; any
		// other through token, which checks it.
		if b := r.b[r.off:]; len(b) >= 5 {
			switch c := b[0]; {
			case c <= 0x7f:
				dst, r.off = append(dst, uint32(c)), r.off+1
				continue
			case c == 0xcc:
				dst, r.off = append(dst, uint32(b[1])), r.off+2
				continue
			case c == 0xcd:
				dst, r.off = append(dst, uint32(binary.BigEndian.Uint16(b[1:3]))), r.off+3
				continue
			case c == 0xce:
				dst, r.off = append(dst, binary.BigEndian.Uint32(b[1:5])), r.off+5
				continue
			}
		}
		t, err := r.token()
		if err != nil {
			return dst, false, err
		}
		dst = append(dst, t)
	}
	return dst, false, nil
}

func (r *reader) token() (uint32, error) {
	v, err := r.int()
	if err != nil {
		return 0, err
	}
	if v < 0 || v > math.MaxUint32 {
		return 0, errRange
	}
	return uint32(v), nil
}

// rawList captures each element of an array as its own msgpack bytes; a nil element becomes a
// nil RawValue.
func (r *reader) rawList(dst []RawValue) ([]RawValue, error) {
	n, err := r.arrayLen()
	if err != nil {
		return dst, err
	}
	dst = slices.Grow(dst, n)
	for range n {
		start := r.off
		if err := r.skip(1); err != nil {
			return dst, err
		}
		if r.off-start == 1 && r.b[start] == 0xc0 {
			dst = append(dst, nil)
			continue
		}
		dst = append(dst, RawValue(append([]byte(nil), r.b[start:r.off]...)))
	}
	return dst, nil
}

// reader walks msgpack bytes. Every method checks bounds and returns one of the static errors
// above instead of panicking.
type reader struct {
	b   []byte
	off int
}

func isArray(c byte) bool { return c&0xf0 == 0x90 || c == 0xdc || c == 0xdd }
func isMap(c byte) bool   { return c&0xf0 == 0x80 || c == 0xde || c == 0xdf }
func isStr(c byte) bool   { return c&0xe0 == 0xa0 || c == 0xd9 || c == 0xda || c == 0xdb }
func isBin(c byte) bool   { return c == 0xc4 || c == 0xc5 || c == 0xc6 }

func (r *reader) nextNil() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// need returns the next n bytes and advances past them.
func (r *reader) need(n int) ([]byte, error) {
	if n < 0 || n > len(r.b)-r.off {
		return nil, errTruncated
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p, nil
}

func (r *reader) byte1() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	c := r.b[r.off]
	r.off++
	return c, nil
}

// length reads a big-endian length of size bytes.
func (r *reader) length(size int) (int, error) {
	p, err := r.need(size)
	if err != nil {
		return 0, err
	}
	switch size {
	case 1:
		return int(p[0]), nil
	case 2:
		return int(binary.BigEndian.Uint16(p)), nil
	}
	return int(binary.BigEndian.Uint32(p)), nil
}

func (r *reader) arrayLen() (int, error) {
	c, err := r.byte1()
	if err != nil {
		return 0, err
	}
	var n int
	switch {
	case c&0xf0 == 0x90:
		n = int(c & 0x0f)
	case c == 0xdc:
		n, err = r.length(2)
	case c == 0xdd:
		n, err = r.length(4)
	default:
		r.off--
		return 0, errType
	}
	if err != nil {
		return 0, err
	}
	if n > len(r.b)-r.off { // every element takes at least one byte
		return 0, errLength
	}
	return n, nil
}

func (r *reader) mapLen() (int, error) {
	c, err := r.byte1()
	if err != nil {
		return 0, err
	}
	var n int
	switch {
	case c&0xf0 == 0x80:
		n = int(c & 0x0f)
	case c == 0xde:
		n, err = r.length(2)
	case c == 0xdf:
		n, err = r.length(4)
	default:
		r.off--
		return 0, errType
	}
	if err != nil {
		return 0, err
	}
	if n > (len(r.b)-r.off)/2 {
		return 0, errLength
	}
	return n, nil
}

// str reads a msgpack str and returns its bytes (aliasing the input).
func (r *reader) str() ([]byte, error) {
	if r.off >= len(r.b) {
		return nil, errTruncated
	}
	if !isStr(r.b[r.off]) {
		return nil, errType
	}
	return r.strOrBin()
}

// strOrBin reads a msgpack str or bin and returns its bytes (aliasing the input).
func (r *reader) strOrBin() ([]byte, error) {
	c, err := r.byte1()
	if err != nil {
		return nil, err
	}
	var n int
	switch {
	case c&0xe0 == 0xa0:
		n = int(c & 0x1f)
	case c == 0xd9 || c == 0xc4:
		n, err = r.length(1)
	case c == 0xda || c == 0xc5:
		n, err = r.length(2)
	case c == 0xdb || c == 0xc6:
		n, err = r.length(4)
	default:
		r.off--
		return nil, errType
	}
	if err != nil {
		return nil, err
	}
	return r.need(n)
}

func (r *reader) optStr() ([]byte, error) {
	if r.nextNil() {
		return nil, nil
	}
	return r.str()
}

// tryOptStr reads a str or nil; on any other type it consumes nothing and reports false.
func (r *reader) tryOptStr() ([]byte, bool) {
	save := r.off
	s, err := r.optStr()
	if err != nil {
		r.off = save
		return nil, false
	}
	return s, true
}

// intBits reads any msgpack integer and returns its 64-bit two's-complement pattern, so that
// signed and unsigned encodings of the same hash agree.
func (r *reader) intBits() (uint64, error) {
	c, err := r.byte1()
	if err != nil {
		return 0, err
	}
	switch {
	case c <= 0x7f:
		return uint64(c), nil
	case c >= 0xe0:
		return uint64(int64(int8(c))), nil
	}
	var size int
	signed := false
	switch c {
	case 0xcc:
		size = 1
	case 0xcd:
		size = 2
	case 0xce:
		size = 4
	case 0xcf:
		size = 8
	case 0xd0:
		size, signed = 1, true
	case 0xd1:
		size, signed = 2, true
	case 0xd2:
		size, signed = 4, true
	case 0xd3:
		size, signed = 8, true
	default:
		r.off--
		return 0, errType
	}
	p, err := r.need(size)
	if err != nil {
		return 0, err
	}
	switch size {
	case 1:
		if signed {
			return uint64(int64(int8(p[0]))), nil
		}
		return uint64(p[0]), nil
	case 2:
		v := binary.BigEndian.Uint16(p)
		if signed {
			return uint64(int64(int16(v))), nil
		}
		return uint64(v), nil
	case 4:
		v := binary.BigEndian.Uint32(p)
		if signed {
			return uint64(int64(int32(v))), nil
		}
		return uint64(v), nil
	}
	return binary.BigEndian.Uint64(p), nil
}

// int reads a msgpack integer that must fit an int64.
func (r *reader) int() (int64, error) {
	if r.off < len(r.b) && r.b[r.off] == 0xcf {
		v, err := r.intBits()
		if err != nil {
			return 0, err
		}
		if v > math.MaxInt64 {
			return 0, errRange
		}
		return int64(v), nil
	}
	v, err := r.intBits()
	return int64(v), err
}

func (r *reader) optInt() (int, bool, error) {
	if r.nextNil() {
		return 0, false, nil
	}
	v, err := r.int()
	if err != nil {
		return 0, false, err
	}
	if v < math.MinInt || v > math.MaxInt {
		return 0, false, errRange
	}
	return int(v), true, nil
}

// tryOptInt reads an int or nil; on any other type it consumes nothing and reports good=false.
func (r *reader) tryOptInt() (v int, ok, good bool) {
	save := r.off
	v, ok, err := r.optInt()
	if err != nil {
		r.off = save
		return 0, false, false
	}
	return v, ok, true
}

// float reads a float32, float64 or integer as a float64.
func (r *reader) float() (float64, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	switch r.b[r.off] {
	case 0xca:
		r.off++
		p, err := r.need(4)
		if err != nil {
			return 0, err
		}
		return float64(math.Float32frombits(binary.BigEndian.Uint32(p))), nil
	case 0xcb:
		r.off++
		p, err := r.need(8)
		if err != nil {
			return 0, err
		}
		return math.Float64frombits(binary.BigEndian.Uint64(p)), nil
	}
	v, err := r.int()
	if err != nil {
		if err == errType {
			return 0, errInvalidFloat
		}
		return 0, err
	}
	return float64(v), nil
}

// skip consumes one value of any type, validating its structure.
func (r *reader) skip(depth int) error {
	if depth > maxDepth {
		return errDepth
	}
	c, err := r.byte1()
	if err != nil {
		return err
	}
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return nil
	case c&0xe0 == 0xa0:
		_, err = r.need(int(c & 0x1f))
		return err
	case c&0xf0 == 0x90, c == 0xdc, c == 0xdd:
		r.off--
		n, err := r.arrayLen()
		if err != nil {
			return err
		}
		for range n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case c&0xf0 == 0x80, c == 0xde, c == 0xdf:
		r.off--
		n, err := r.mapLen()
		if err != nil {
			return err
		}
		for range 2 * n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	}
	var n int
	switch c {
	case 0xcc, 0xd0:
		n = 1
	case 0xcd, 0xd1:
		n = 2
	case 0xce, 0xd2, 0xca:
		n = 4
	case 0xcf, 0xd3, 0xcb:
		n = 8
	case 0xd4: // fixext 1..16: type byte + data
		n = 2
	case 0xd5:
		n = 3
	case 0xd6:
		n = 5
	case 0xd7:
		n = 9
	case 0xd8:
		n = 17
	case 0xc4, 0xd9:
		n, err = r.length(1)
	case 0xc5, 0xda:
		n, err = r.length(2)
	case 0xc6, 0xdb:
		n, err = r.length(4)
	case 0xc7: // ext 8/16/32: length, then type byte + data
		n, err = r.length(1)
		n++
	case 0xc8:
		n, err = r.length(2)
		n++
	case 0xc9:
		n, err = r.length(4)
		n++
	default: // 0xc1 is never used
		return errType
	}
	if err != nil {
		return err
	}
	_, err = r.need(n)
	return err
}
