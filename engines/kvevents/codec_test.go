package kvevents

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// canonical renders b in the JSON form that hack/kvevents-vectors/gen.py's normalize()
// produces from the same bytes, decoded into generic values for comparison.
func canonical(t testing.TB, b *Batch) any {
	t.Helper()
	hash := func(h Hash) string {
		if h.B != "" {
			return "b:" + hex.EncodeToString([]byte(h.B))
		}
		return "u:" + strconv.FormatUint(h.U, 10)
	}
	optStr := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	optInt := func(v int, ok bool) any {
		if !ok {
			return nil
		}
		return v
	}
	events := []any{}
	for _, e := range b.Events {
		hs := []string{}
		for _, h := range e.BlockHashes {
			hs = append(hs, hash(h))
		}
		switch e.Kind {
		case BlockStored:
			var parent any
			if e.HasParent {
				parent = hash(e.Parent)
			}
			var extra any
			if e.HasExtraKeys {
				ks := []any{}
				for _, k := range e.ExtraKeys {
					if k == nil {
						ks = append(ks, nil)
					} else {
						ks = append(ks, hex.EncodeToString(k))
					}
				}
				extra = ks
			}
			toks := e.TokenIDs
			if toks == nil {
				toks = []uint32{}
			}
			events = append(events, map[string]any{
				"type": "BlockStored", "block_hashes": hs, "parent": parent, "token_ids": toks,
				"bigram": e.BigramTokens, "block_size": e.BlockSize,
				"lora_id": optInt(e.LoraID, e.HasLoraID), "medium": optStr(e.Medium),
				"lora_name": optStr(e.LoraName), "extra_keys": extra,
				"group_idx":          optInt(e.GroupIdx, e.HasGroupIdx),
				"kv_cache_spec_kind": optStr(e.KVCacheSpecKind),
				"sliding_window":     optInt(e.SlidingWindow, e.HasSlidingWindow),
				"locality":           optStr(e.Locality), "ownership": optStr(e.Ownership),
				"session_id": optStr(e.SessionID),
			})
		case BlockRemoved:
			events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": hs,
				"medium": optStr(e.Medium), "group_idx": optInt(e.GroupIdx, e.HasGroupIdx),
				"locality": optStr(e.Locality), "ownership": optStr(e.Ownership)})
		case AllBlocksCleared:
			events = append(events, map[string]any{"type": "AllBlocksCleared"})
		default:
			t.Fatalf("event with invalid kind %d", e.Kind)
		}
	}
	out := map[string]any{"ts": b.TS, "dp_rank": optInt(b.DPRank, b.HasDPRank),
		"skipped": b.Skipped, "events": events}
	return generic(t, out)
}

// generic round-trips v through JSON so that values compare with reflect.DeepEqual.
func generic(t testing.TB, v any) any {
	t.Helper()
	raw, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("marshal: %v", err)
	}
	var out any
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("unmarshal: %v", err)
	}
	return out
}

type vector struct {
	name      string
	data      []byte
	canonical string // "map", "array" or ""
	source    string
	want      any
}

func loadVectors(t testing.TB, dir string) []vector {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", dir, "*.msgpack"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no vectors under testdata/%s: %v", dir, err)
	}
	var out []vector
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		raw, err := os.ReadFile(strings.TrimSuffix(f, ".msgpack") + ".json")
		if err != nil {
			t.Fatal(err)
		}
		var meta struct {
			Source    string  `json:"source"`
			Canonical *string `json:"canonical"`
			Batch     any     `json:"batch"`
		}
		if err := json.Unmarshal(raw, &meta); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		v := vector{name: strings.TrimSuffix(filepath.Base(f), ".msgpack"), data: data,
			source: meta.Source, want: meta.Batch}
		if meta.Canonical != nil {
			v.canonical = *meta.Canonical
		}
		out = append(out, v)
	}
	return out
}

// TestVectors decodes the vectors python3-msgpack wrote (hack/kvevents-vectors/gen.py) and
// the public captures, compares them with python's own reading, and checks that AppendBatch
// reproduces python's bytes exactly where the vector uses kvrelay's layout.
func TestVectors(t *testing.T) {
	vs := append(loadVectors(t, "vectors"), loadVectors(t, "captures")...)
	for _, v := range vs {
		t.Run(v.name, func(t *testing.T) {
			b, err := DecodeBatch(v.data)
			if err != nil {
				t.Fatalf("DecodeBatch: %v", err)
			}
			if got := canonical(t, &b); !reflect.DeepEqual(got, v.want) {
				t.Fatalf("decoded\n got %v\nwant %v", got, v.want)
			}
			if v.canonical != "" {
				f, err := ParseFormat(v.canonical)
				if err != nil {
					t.Fatal(err)
				}
				if got := AppendBatch(nil, &b, f); !bytes.Equal(got, v.data) {
					t.Fatalf("AppendBatch(%s)\n got %x\nwant %x", f, got, v.data)
				}
			}
			for _, f := range []Format{FormatMap, FormatArray} {
				enc := AppendBatch(nil, &b, f)
				again, err := DecodeBatch(enc)
				if err != nil {
					t.Fatalf("decoding own %s encoding: %v", f, err)
				}
				again.Skipped = b.Skipped
				want := v.want
				if f == FormatArray {
					want = canonical(t, withoutMapOnly(&b))
				}
				if got := canonical(t, &again); !reflect.DeepEqual(got, want) {
					t.Fatalf("%s round trip\n got %v\nwant %v", f, got, want)
				}
				var generic any
				if err := msgpack.Unmarshal(enc, &generic); err != nil {
					t.Fatalf("vmihailenco/msgpack rejects our %s encoding: %v", f, err)
				}
			}
		})
	}
}

// TestCaptures pins the facts of the public captures (testdata/captures/README.md).
func TestCaptures(t *testing.T) {
	tests := []struct {
		name  string
		file  string
		check func(t *testing.T, b Batch)
	}{
		{
			name: "vLLM 0.26 map events (kthena#1535)",
			file: "vllm_0.26_map_kthena_1535.msgpack",
			check: func(t *testing.T, b Batch) {
				e := b.Events[0]
				want := Event{Kind: BlockStored, BlockHashes: []Hash{HashU64(15760518052499183552)},
					TokenIDs: []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645,
						198, 151644, 77091, 198, 151667},
					BlockSize: 16, Medium: "GPU", ExtraKeys: []RawValue{nil}, HasExtraKeys: true,
					GroupIdx: 0, HasGroupIdx: true, KVCacheSpecKind: "full_attention"}
				if !reflect.DeepEqual(e, want) {
					t.Fatalf("event\n got %+v\nwant %+v", e, want)
				}
				if b.TS != 1789095808.8378847 || !b.HasDPRank || b.DPRank != 0 {
					t.Fatalf("batch header %v %v %v", b.TS, b.HasDPRank, b.DPRank)
				}
			},
		},
		{
			name: "vLLM array events (raw frame)",
			file: "vllm_array_dynamo_kvbm.msgpack",
			check: func(t *testing.T, b Batch) {
				e := b.Events[0]
				if e.Kind != BlockStored || len(e.BlockHashes) != 1 ||
					e.BlockHashes[0] != HashU64(17536983392627827276) ||
					!e.HasParent || e.Parent != HashU64(15722805041033817089) ||
					len(e.TokenIDs) != 16 || e.BlockSize != 16 || e.Medium != "GPU" ||
					e.HasLoraID || e.HasGroupIdx || e.HasExtraKeys {
					t.Fatalf("event %+v", e)
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join("testdata", "captures", tc.file))
			if err != nil {
				t.Fatal(err)
			}
			b, err := DecodeBatch(data)
			if err != nil {
				t.Fatal(err)
			}
			if len(b.Events) != 1 {
				t.Fatalf("%d events", len(b.Events))
			}
			tc.check(t, b)
		})
	}
}

func mp(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestDecodeMalformed(t *testing.T) {
	stored := func(fields ...any) any { return append([]any{"BlockStored"}, fields...) }
	good := []any{1.0, []any{stored([]any{1}, nil, []any{1, 2}, 2, nil, "GPU")}, 0}
	deep := any("x")
	for range 100 {
		deep = []any{deep}
	}
	tests := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"reserved byte", []byte{0xc1}},
		{"top-level int", mp(t, 7)},
		{"top-level string", mp(t, "BlockStored")},
		{"batch without events", mp(t, []any{1.0})},
		{"events not a list", mp(t, []any{1.0, "x"})},
		{"ts not a number", mp(t, []any{"now", []any{}})},
		{"event is a number", mp(t, []any{1.0, []any{5}})},
		{"empty event array", mp(t, []any{1.0, []any{[]any{}}})},
		{"tag not a string", mp(t, []any{1.0, []any{[]any{1, []any{}}}})},
		{"map event without type", mp(t, []any{1.0, []any{map[string]any{"block_hashes": []any{1}}}})},
		{"map event with int key", mp(t, []any{1.0, []any{map[int]any{1: "BlockStored"}}})},
		{"block_hashes a string", mp(t, []any{1.0, []any{stored("abc", nil, []any{}, 0, nil)}})},
		{"hash a float", mp(t, []any{1.0, []any{stored([]any{1.5}, nil, []any{}, 0, nil)}})},
		{"parent a bool", mp(t, []any{1.0, []any{stored([]any{1}, true, []any{}, 0, nil)}})},
		{"negative token", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{-1}, 1, nil)}})},
		{"token above 2^32", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{uint64(1) << 32}, 1, nil)}})},
		{"block_size a string", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{}, "16", nil)}})},
		{"block_size above int64", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{}, uint64(math.MaxUint64), nil)}})},
		{"medium an int", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{}, 1, nil, 5)}})},
		{"bigram pairs that do not chain", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{[]any{1, 2}, []any{3, 4}}, 1, nil)}})},
		{"bigram triple", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{[]any{1, 2, 3}}, 1, nil)}})},
		{"mixed flat and bigram", mp(t, []any{1.0, []any{stored([]any{1}, nil, []any{1, []any{1, 2}}, 1, nil)}})},
		{"known map event with bad field", mp(t, []any{1.0, []any{map[string]any{"type": "BlockRemoved", "block_hashes": 3}}})},
		{"unknown field nested too deep", mp(t, []any{1.0, []any{}, 0, deep})},
		{"trailing bytes", append(mp(t, good), 0x00)},
		{"array length beyond input", []byte{0xdd, 0xff, 0xff, 0xff, 0xff, 0xcb}},
		{"map length beyond input", []byte{0xdf, 0x7f, 0xff, 0xff, 0xff}},
		{"batch map without ts", mp(t, map[string]any{"events": []any{}})},
		{"ext type as ts", []byte{0x92, 0xd4, 0x01, 0x01, 0x90}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeBatch(tc.data)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("DecodeBatch(%x) = %v, want ErrMalformed", tc.data, err)
			}
		})
	}
	t.Run("every truncation of every vector", func(t *testing.T) {
		for _, v := range loadVectors(t, "vectors") {
			for i := range len(v.data) {
				if _, err := DecodeBatch(v.data[:i]); !errors.Is(err, ErrMalformed) {
					t.Fatalf("%s[:%d]: %v, want ErrMalformed", v.name, i, err)
				}
			}
		}
	})
}

func TestDecodeLenient(t *testing.T) {
	tests := []struct {
		name  string
		data  []byte
		check func(t *testing.T, b Batch)
	}{
		{
			name: "signed hash keeps its bit pattern",
			data: mp(t, []any{1.0, []any{[]any{"BlockRemoved", []any{int64(-2)}}}}),
			check: func(t *testing.T, b Batch) {
				if got := b.Events[0].BlockHashes[0]; got != HashU64(math.MaxUint64-1) {
					t.Fatalf("hash %v", got)
				}
			},
		},
		{
			name: "signed and unsigned spellings of one hash are equal",
			data: mp(t, []any{1.0, []any{[]any{"BlockRemoved", []any{int64(-1), uint64(math.MaxUint64)}}}}),
			check: func(t *testing.T, b Batch) {
				hs := b.Events[0].BlockHashes
				if hs[0] != hs[1] {
					t.Fatalf("%v != %v", hs[0], hs[1])
				}
			},
		},
		{
			name: "unknown event type is skipped and counted",
			data: mp(t, []any{1.0, []any{[]any{"TransferInitiated", 1}, []any{"AllBlocksCleared"}}}),
			check: func(t *testing.T, b Batch) {
				if b.Skipped != 1 || len(b.Events) != 1 || b.Events[0].Kind != AllBlocksCleared {
					t.Fatalf("%+v", b)
				}
			},
		},
		{
			name: "mistyped extension field is dropped",
			data: mp(t, []any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []any{1},
				"token_ids": []any{}, "group_idx": "zero", "extra_keys": "x", "kv_cache_spec_kind": 3}}}),
			check: func(t *testing.T, b Batch) {
				e := b.Events[0]
				if e.HasGroupIdx || e.HasExtraKeys || e.KVCacheSpecKind != "" {
					t.Fatalf("%+v", e)
				}
			},
		},
		{
			name: "removed event drops stored-only fields",
			data: mp(t, []any{1.0, []any{map[string]any{"type": "BlockRemoved", "block_hashes": []any{1},
				"token_ids": []any{1, 2}, "block_size": 2}}}),
			check: func(t *testing.T, b Batch) {
				if e := b.Events[0]; len(e.TokenIDs) != 0 || e.BlockSize != 0 {
					t.Fatalf("%+v", e)
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := DecodeBatch(tc.data)
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, b)
		})
	}
}

func TestAppendBatchSkipsInvalidKinds(t *testing.T) {
	b := Batch{TS: 1, Events: []Event{{Kind: 0}, {Kind: AllBlocksCleared}, {Kind: 9}}}
	for _, f := range []Format{FormatMap, FormatArray} {
		got, err := DecodeBatch(AppendBatch(nil, &b, f))
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Events) != 1 || got.Events[0].Kind != AllBlocksCleared {
			t.Fatalf("%s: %+v", f, got)
		}
	}
}

// typicalBatch is one engine step: four prompts stored two 16-token blocks each (the later
// ones chained to the earlier), and one eviction of three blocks.
func typicalBatch() *Batch {
	b := &Batch{TS: 1789095808.8378847, DPRank: 0, HasDPRank: true}
	parent := Hash{}
	for i := range 4 {
		toks := make([]uint32, 32)
		for j := range toks {
			toks[j] = uint32(151000 + 97*i + j)
		}
		h1 := HashU64(15760518052499183552 + uint64(2*i))
		h2 := HashU64(15760518052499183552 + uint64(2*i+1))
		b.Events = append(b.Events, Event{Kind: BlockStored, BlockHashes: []Hash{h1, h2},
			Parent: parent, HasParent: i > 0, TokenIDs: toks, BlockSize: 16, Medium: "GPU",
			ExtraKeys: []RawValue{nil, nil}, HasExtraKeys: true, HasGroupIdx: true,
			KVCacheSpecKind: "full_attention"})
		parent = h2
	}
	b.Events = append(b.Events, Event{Kind: BlockRemoved, Medium: "GPU", HasGroupIdx: true,
		BlockHashes: []Hash{HashU64(1 << 63), HashU64(42), HashU64(math.MaxUint64)}})
	return b
}

func TestAppendBatchDoesNotAllocate(t *testing.T) {
	b := typicalBatch()
	for _, f := range []Format{FormatMap, FormatArray} {
		buf := AppendBatch(nil, b, f)
		if n := testing.AllocsPerRun(100, func() { buf = AppendBatch(buf[:0], b, f) }); n != 0 {
			t.Errorf("AppendBatch(%s) allocates %v times per call", f, n)
		}
	}
}

func TestDecodeBatchIntoReusesMemory(t *testing.T) {
	b := typicalBatch()
	for _, f := range []Format{FormatMap, FormatArray} {
		data := AppendBatch(nil, b, f)
		var dst Batch
		if err := DecodeBatchInto(&dst, data); err != nil {
			t.Fatal(err)
		}
		n := testing.AllocsPerRun(100, func() {
			if err := DecodeBatchInto(&dst, data); err != nil {
				t.Fatal(err)
			}
		})
		if n != 0 {
			t.Errorf("DecodeBatchInto(%s) allocates %v times per call in steady state", f, n)
		}
		if !reflect.DeepEqual(canonical(t, &dst), canonical(t, b)) {
			t.Fatalf("%s: reused decode differs", f)
		}
	}
}

func TestHashString(t *testing.T) {
	tests := []struct {
		name string
		h    Hash
		want string
	}{
		{"integer", HashU64(15760518052499183552), "15760518052499183552"},
		{"bytes", HashBytes([]byte{0xde, 0xad}), "0xdead"},
		{"empty bytes is zero", HashBytes(nil), "0"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.h.String(); got != tc.want {
				t.Fatalf("got %q want %q", got, tc.want)
			}
		})
	}
}

func TestRawValueDecode(t *testing.T) {
	v := RawValue(mp(t, []any{"mm-hash", 3}))
	got, err := v.Decode()
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(generic(t, got), generic(t, []any{"mm-hash", 3})) {
		t.Fatalf("got %#v", got)
	}
	if got, err := RawValue(nil).Decode(); got != nil || err != nil {
		t.Fatalf("nil RawValue decodes to %v, %v", got, err)
	}
	if _, err := (RawValue{0xc1}).Decode(); !errors.Is(err, ErrMalformed) {
		t.Fatalf("bad RawValue: %v", err)
	}
}

func TestKindStrings(t *testing.T) {
	tests := []struct {
		name string
		k    Kind
		want string
	}{
		{"stored", BlockStored, "BlockStored"},
		{"removed", BlockRemoved, "BlockRemoved"},
		{"cleared", AllBlocksCleared, "AllBlocksCleared"},
		{"invalid", 0, "Kind(0)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.k.String(); got != tc.want {
				t.Fatalf("got %q want %q", got, tc.want)
			}
		})
	}
	if _, err := ParseFormat("json"); err == nil {
		t.Fatal("ParseFormat accepted json")
	}
}

// withoutMapOnly returns a copy of b without the fields only map events carry (locality,
// ownership, session id): what a FormatArray round trip keeps.
func withoutMapOnly(b *Batch) *Batch {
	c := *b
	c.Events = append([]Event(nil), b.Events...)
	for i := range c.Events {
		c.Events[i].Locality, c.Events[i].Ownership, c.Events[i].SessionID = "", "", ""
	}
	return &c
}

// TestTokenEncodings reads token ids in every integer encoding msgpack allows, at the end of
// the input as well as inside it (where the reader takes the common ones in place), and
// refuses the ones no token id can have.
func TestTokenEncodings(t *testing.T) {
	ids := []uint32{0, 5, 127, 128, 255, 256, 65535, 65536, 151645, math.MaxUint32}
	var tail []byte // every id in each encoding that can hold it, then a fixint last
	var want []uint32
	for _, id := range ids {
		forms := [][]byte{}
		if id <= 0x7f {
			forms = append(forms, []byte{byte(id)})
		}
		if id <= math.MaxUint8 {
			forms = append(forms, []byte{0xcc, byte(id)}, []byte{0xd1, 0, byte(id)})
		}
		if id <= math.MaxUint16 {
			forms = append(forms, binary.BigEndian.AppendUint16([]byte{0xcd}, uint16(id)))
		}
		if id <= math.MaxInt32 {
			forms = append(forms, binary.BigEndian.AppendUint32([]byte{0xd2}, id))
		}
		forms = append(forms, binary.BigEndian.AppendUint32([]byte{0xce}, id),
			binary.BigEndian.AppendUint64([]byte{0xcf}, uint64(id)), binary.BigEndian.AppendUint64([]byte{0xd3}, uint64(id)))
		for _, f := range forms {
			tail = append(tail, f...)
			want = append(want, id)
		}
	}
	tail = append(tail, 0x07)
	want = append(want, 7)
	in := binary.BigEndian.AppendUint16([]byte{0xdc}, uint16(len(want)))
	in = append(in, tail...)
	r := &reader{b: in}
	got, _, err := r.tokens(nil)
	if err != nil || !slices.Equal(got, want) || r.off != len(in) {
		t.Fatalf("tokens = %v, %v (read %d of %d); want %v", got, err, r.off, len(in), want)
	}
	for _, bad := range [][]byte{
		{0x91, 0xff},                         // -1
		{0x91, 0xd0, 0x80},                   // int8 -128
		{0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0}, // 2^32
		{0x92, 0xce, 0, 0, 1},                // cut short
		{0x92, 0x01, 0xa1, 'x', 0, 0, 0},     // a string
		{0x91, 0xcd, 0x01},                   // cut short at the end
	} {
		if got, _, err := (&reader{b: bad}).tokens(nil); err == nil {
			t.Errorf("tokens(%x) = %v, want an error", bad, got)
		}
	}
}
