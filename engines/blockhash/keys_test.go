package blockhash_test

import (
	"bytes"
	"slices"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// decoded is a vLLM extra_keys entry as the index sees it: msgpack, decoded.
func decoded(t *testing.T, v any) any {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	out, err := kvevents.RawValue(b).Decode()
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestKeysAreVLLMs: a request's keys render, block by block, as the canonical form of the
// tuple vLLM publishes for that block: (adapter, multimodal identifiers, salt on block 0).
func TestKeysAreVLLMs(t *testing.T) {
	k := blockhash.Keys{LoRA: "sql-lora", MM: [][]byte{[]byte("img-1")}, Salt: []byte("tenant-a")}
	for _, c := range []struct {
		block int
		vllm  any
	}{
		{0, []any{"sql-lora", "img-1", "tenant-a"}},
		{0, []any{"sql-lora", "img-1", []any{"cache_salt", "tenant-a"}}}, // later vLLM tags the salt
		{1, []any{"sql-lora", "img-1"}},
		{7, []any{"sql-lora", "img-1"}},
	} {
		got := blockhash.AppendKey(nil, decoded(t, c.vllm))
		if want := k.Block(nil, c.block); !bytes.Equal(got, want) {
			t.Errorf("block %d: vLLM's %v renders %q, the request's keys %q", c.block, c.vllm, got, want)
		}
	}
	five := string(blockhash.AppendKey(nil, int64(5)))
	for _, v := range []any{int8(5), int16(5), int32(5), 5, uint8(5), uint16(5), uint32(5), uint(5), uint64(5)} {
		if got := string(blockhash.AppendKey(nil, v)); got != five {
			t.Errorf("%T 5 renders %q, int64 5 %q", v, got, five)
		}
	}
	if got := blockhash.AppendKey(nil, decoded(t, nil)); len(got) != 0 {
		t.Errorf("None renders %q", got)
	}
	var plain blockhash.Keys
	if !plain.Empty() || len(plain.Block(nil, 0)) != 0 {
		t.Error("empty keys render something")
	}
	// Keys differ from their absence and from other values. (Like vLLM's, the tuple does
	// not say which kind each element is: adapter "a" with salt "b" renders as multimodal
	// inputs "a", "b" do, and would hit the same engine cache.)
	seen := map[string]string{}
	for name, k := range map[string]blockhash.Keys{
		"plain": {}, "lora a": {LoRA: "a"}, "lora b": {LoRA: "b"}, "lora ab": {LoRA: "ab"}, "lora a salt b": {LoRA: "a", Salt: []byte("b")},
		"salt a, b": {Salt: []byte("a,b")}, "mm a, b, c": {MM: [][]byte{[]byte("a"), []byte("b"), []byte("c")}},
	} {
		r := string(k.Block(nil, 0))
		if other, dup := seen[r]; dup {
			t.Errorf("%s and %s render alike: %q", name, other, r)
		}
		seen[r] = name
	}
}

// TestSaltKeysTheChain: the salt keys block 0 only, yet every block of a salted prompt
// differs from the plain prompt's; an adapter keys every block.
func TestSaltKeysTheChain(t *testing.T) {
	toks := make([]uint32, 64)
	for i := range toks {
		toks[i] = uint32(i)
	}
	var h blockhash.Hasher
	plain := h.AppendSeq(nil, toks, 16, nil)
	same := h.AppendSeqKeys(nil, 0, false, toks, 16, &blockhash.Keys{}, 0)
	if !slices.Equal(plain, same) {
		t.Fatal("empty keys change the chain")
	}
	for _, k := range []blockhash.Keys{{Salt: []byte("s")}, {LoRA: "a"}} {
		got := h.AppendSeqKeys(nil, 0, false, toks, 16, &k, 0)
		for i := range got {
			if got[i] == plain[i] {
				t.Errorf("keys %+v: block %d aliases the plain one", k, i)
			}
		}
		// Continuing a chain block by block gives the same hashes.
		var cont []uint64
		for b := 0; b < 4; b++ {
			parent, has := uint64(0), b > 0
			if has {
				parent = cont[b-1]
			}
			cont = h.AppendSeqKeys(cont, parent, has, toks[b*16:(b+1)*16], 16, &k, b)
		}
		if !slices.Equal(cont, got) {
			t.Errorf("keys %+v: block-by-block chain %x, whole %x", k, cont, got)
		}
	}
	// The salt enters at block 0: a salted chain continued past block 0 without the salt
	// equals one continued with it.
	salted := h.AppendSeqKeys(nil, 0, false, toks, 16, &blockhash.Keys{Salt: []byte("s")}, 0)
	tail := h.AppendSeqKeys(nil, salted[0], true, toks[16:], 16, &blockhash.Keys{}, 1)
	if !slices.Equal(tail, salted[1:]) {
		t.Error("the salt keys blocks past the first")
	}
}

// FuzzAppendKey: any extra_keys entry an engine sends renders without panicking, and the
// same entry renders the same way twice.
func FuzzAppendKey(f *testing.F) {
	for _, v := range []any{nil, []any{"a", "b"}, []any{"a", []any{"cache_salt", "s"}}, []any{int64(1), 2.5, true, nil, []byte{1}, map[string]any{"k": "v"}}} {
		b, _ := msgpack.Marshal(v)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		v, err := kvevents.RawValue(raw).Decode()
		if err != nil {
			return
		}
		a := blockhash.AppendKey(nil, v)
		if b := blockhash.AppendKey(nil, v); !bytes.Equal(a, b) {
			t.Fatalf("%v renders %q then %q", v, a, b)
		}
	})
}
