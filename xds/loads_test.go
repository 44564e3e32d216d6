package xds

import (
	"errors"
	"math"
	"strconv"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// TestLoadsRoundTrip: a shard's loads come back from PackLoads and UnpackLoads at their
// indexes, equal but for KV usage (to 1/65536) and the reading's time (to the
// millisecond); a zero epoch and an unknown reading time stay zero; indexes the shard does
// not hold come back nil.
func TestLoadsRoundTrip(t *testing.T) {
	const shard = 3
	base := uint32(shard * LoadsShard)
	in := []IndexedLoad{
		{base, "w-a", &xdsv1.Load{Running: 40, Waiting: 2, KvUsage: 0.123456, Inflight: 7, PrefillTokens: 9000, DecodeBlocks: 1200, ObservedUnixNano: 1_700_000_000_123_456_789, Epoch: 1 << 50}},
		{base + 1, "w-b", nil},
		{base + 9, "w-c", &xdsv1.Load{KvUsage: 1, Epoch: 1<<50 - 3, ObservedUnixNano: 1_700_000_000_023_456_789}},
		{base + LoadsShard - 1, "w-d", &xdsv1.Load{Running: math.MaxUint32, Inflight: math.MaxUint32, PrefillTokens: math.MaxUint64, DecodeBlocks: math.MaxUint64}},
	}
	l, err := PackLoads(shard, in)
	if err != nil {
		t.Fatal(err)
	}
	a, err := anypb.New(l)
	if err != nil {
		t.Fatal(err)
	}
	gotShard, sh, err := DecodeLoads(LoadsName(shard), a)
	got := sh.Loads
	if err != nil || gotShard != shard || len(got) != LoadsShard || len(sh.Checks) != LoadsShard {
		t.Fatalf("DecodeLoads: shard %d, %d loads, %d checks, %v", gotShard, len(got), len(sh.Checks), err)
	}
	for i, id := range map[int]string{0: "w-a", 1: "w-b", 9: "w-c", LoadsShard - 1: "w-d"} {
		if sh.Checks[i] != IDCheck(id) {
			t.Errorf("index %d: check %x, want %s's %x", i, sh.Checks[i], id, IDCheck(id))
		}
	}
	want := map[int]*xdsv1.Load{
		0:              {Running: 40, Waiting: 2, KvUsage: math.Round(0.123456*65536) / 65536, Inflight: 7, PrefillTokens: 9000, DecodeBlocks: 1200, ObservedUnixNano: 1_700_000_000_123_456_789, Epoch: 1 << 50},
		1:              {},
		9:              {KvUsage: 1, Epoch: 1<<50 - 3, ObservedUnixNano: 1_700_000_000_023_456_789},
		LoadsShard - 1: {Running: math.MaxUint32, Inflight: math.MaxUint32, PrefillTokens: math.MaxUint64, DecodeBlocks: math.MaxUint64},
	}
	for i, g := range got {
		w, ok := want[i]
		switch {
		case !ok && g != nil:
			t.Errorf("index %d: %v, want none", i, g)
		case ok && !proto.Equal(g, w):
			t.Errorf("index %d: %v, want %v", i, g, w)
		}
	}
	// A reading 100.5 ms before the newest is kept to the millisecond.
	l, err = PackLoads(0, []IndexedLoad{{0, "a", &xdsv1.Load{ObservedUnixNano: 1_000_000_000}}, {1, "b", &xdsv1.Load{ObservedUnixNano: 1_000_000_000 - 100_500_000}}})
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnpackLoads(0, l)
	if err != nil {
		t.Fatal(err)
	}
	if o := back.Loads[1].GetObservedUnixNano(); o != 1_000_000_000-100_000_000 {
		t.Errorf("reading 100.5 ms back: %d, want %d", o, 1_000_000_000-100_000_000)
	}
	// A busy shard is about 17 bytes a worker.
	full := make([]IndexedLoad, LoadsShard)
	for i := range full {
		full[i] = IndexedLoad{uint32(i), "vllm-decode-" + strconv.Itoa(i), &xdsv1.Load{Running: 40 + uint32(i%5), Waiting: uint32(i % 3), KvUsage: 0.5 + float64(i)/1000, Inflight: 30, PrefillTokens: 9000 + uint64(i), DecodeBlocks: 1200,
			ObservedUnixNano: 1_700_000_000_000_000_000 - int64(i%10)*10_000_000, Epoch: 77 - uint64(i%2)}}
	}
	l, err = PackLoads(0, full)
	if err != nil {
		t.Fatal(err)
	}
	if n := proto.Size(l); n > 24*LoadsShard {
		t.Errorf("a full shard of busy workers takes %d bytes, more than 24 a worker", n)
	}
	t.Logf("a full shard of busy workers: %d bytes", proto.Size(l))
}

// TestPackLoadsRefuses: indexes out of order, repeated or outside the shard.
func TestPackLoadsRefuses(t *testing.T) {
	for _, ls := range [][]IndexedLoad{
		{{5, "a", nil}, {5, "b", nil}},
		{{6, "a", nil}, {5, "b", nil}},
		{{LoadsShard, "a", nil}},
	} {
		if _, err := PackLoads(0, ls); err == nil {
			t.Errorf("PackLoads(0, %v) packed", ls)
		}
	}
	if _, err := PackLoads(1, []IndexedLoad{{LoadsShard - 1, "a", nil}}); err == nil {
		t.Error("PackLoads(1) packed index LoadsShard-1, in shard 0")
	}
	if _, err := PackLoads(MaxLoadIndex/LoadsShard, nil); err == nil {
		t.Error("PackLoads packed a shard past the last")
	}
}

// TestUnpackLoadsRefuses: every way a Loads resource can be malformed is refused with
// ErrInvalid.
func TestUnpackLoadsRefuses(t *testing.T) {
	one := func(f func(l *xdsv1.Loads)) *xdsv1.Loads {
		l := &xdsv1.Loads{IndexDelta: []uint32{0}, Running: []uint32{1}, Waiting: []uint32{0}, KvUsage: []uint32{0}, Inflight: []uint32{0},
			PrefillTokens: []uint64{0}, DecodeBlocks: []uint64{0}, EpochBack: []uint64{0}, ObservedBackMs: []uint64{0}, IdCheck: []uint32{7}}
		f(l)
		return l
	}
	if _, err := UnpackLoads(0, one(func(*xdsv1.Loads) {})); err != nil {
		t.Fatalf("the well-formed one: %v", err)
	}
	for name, l := range map[string]*xdsv1.Loads{
		"short column":           one(func(l *xdsv1.Loads) { l.Waiting = nil }),
		"no id checks":           one(func(l *xdsv1.Loads) { l.IdCheck = nil }),
		"long column":            one(func(l *xdsv1.Loads) { l.EpochBack = []uint64{0, 0} }),
		"index past the shard":   one(func(l *xdsv1.Loads) { l.IndexDelta = []uint32{LoadsShard} }),
		"kv usage above 1":       one(func(l *xdsv1.Loads) { l.KvUsage = []uint32{kvUnit + 1} }),
		"epoch below zero":       one(func(l *xdsv1.Loads) { l.EpochBase, l.EpochBack = 3, []uint64{5} }),
		"epoch zero not by back": one(func(l *xdsv1.Loads) { l.EpochBase, l.EpochBack = 3, []uint64{4} }),
		"reading before 1970":    one(func(l *xdsv1.Loads) { l.ObservedBaseUnixNano, l.ObservedBackMs = 5_000_000, []uint64{7} }),
		"negative base":          one(func(l *xdsv1.Loads) { l.ObservedBaseUnixNano = -1 }),
		"huge back": one(func(l *xdsv1.Loads) {
			l.ObservedBaseUnixNano, l.ObservedBackMs = math.MaxInt64, []uint64{math.MaxUint64}
		}),
		"repeated index": func() *xdsv1.Loads {
			l := one(func(*xdsv1.Loads) {})
			for _, c := range []*[]uint32{&l.Running, &l.Waiting, &l.KvUsage, &l.Inflight, &l.IdCheck} {
				*c = append(*c, 0)
			}
			for _, c := range []*[]uint64{&l.PrefillTokens, &l.DecodeBlocks, &l.EpochBack, &l.ObservedBackMs} {
				*c = append(*c, 0)
			}
			l.IndexDelta = []uint32{4, 0}
			return l
		}(),
	} {
		if _, err := UnpackLoads(0, l); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	last := strconv.Itoa(MaxLoadIndex/LoadsShard - 1)
	for _, name := range []string{"loads/", "loads/x", "loads/01", "loads/-1", "load/1", "loads/" + strconv.Itoa(MaxLoadIndex/LoadsShard)} {
		if _, err := ParseLoadsName(name); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseLoadsName(%q): %v, want ErrInvalid", name, err)
		}
	}
	if n, err := ParseLoadsName("loads/" + last); strconv.Itoa(int(n)) != last || err != nil {
		t.Errorf("ParseLoadsName(loads/%s) = %d, %v", last, n, err)
	}
}

// TestIDCheck: FNV-1a's 32-bit test vectors, so that proxies and control planes of any
// build agree.
func TestIDCheck(t *testing.T) {
	for id, want := range map[string]uint32{"": 0x811c9dc5, "a": 0xe40c292c, "foobar": 0xbf9cf968} {
		if got := IDCheck(id); got != want {
			t.Errorf("IDCheck(%q) = %#x, want %#x", id, got, want)
		}
	}
}

// TestPushedLoads: a worker's own Load wins; else its entry in the shards if the entry is
// of its id; else nil (another worker's entry at its index, none, a short shard).
func TestPushedLoads(t *testing.T) {
	sh := Shard{Loads: make([]*xdsv1.Load, LoadsShard), Checks: make([]uint32, LoadsShard)}
	sh.Loads[5], sh.Checks[5] = &xdsv1.Load{Running: 9}, IDCheck("w5")
	p := NewPushedLoads(map[uint32]Shard{2: sh, 3: {Loads: []*xdsv1.Load{{Running: 1}}, Checks: []uint32{IDCheck("w3")}}})
	if l := p.LoadOf(&xdsv1.Worker{Id: "w5", LoadIndex: 2*LoadsShard + 5}); l.GetRunning() != 9 {
		t.Errorf("by index: %v", l)
	}
	if l := p.LoadOf(&xdsv1.Worker{Id: "w6", LoadIndex: 2*LoadsShard + 5}); l != nil {
		t.Errorf("another worker's entry at its index: %v, want nil", l)
	}
	if l := p.LoadOf(&xdsv1.Worker{Id: "w5", LoadIndex: 2*LoadsShard + 5, Load: &xdsv1.Load{Running: 1}}); l.GetRunning() != 1 {
		t.Errorf("own load: %v", l)
	}
	for _, i := range []uint32{2*LoadsShard + 6, 5, 3*LoadsShard + 7, MaxLoadIndex - 1} {
		if l := p.LoadOf(&xdsv1.Worker{Id: "w3", LoadIndex: i}); l != nil {
			t.Errorf("index %d: %v, want nil", i, l)
		}
	}
	if l := (PushedLoads{}).LoadOf(&xdsv1.Worker{}); l != nil {
		t.Errorf("no loads: %v", l)
	}
}

// FuzzDecodeLoads: whatever bytes come as a Loads resource, DecodeLoads returns an error or
// a shard of LoadsShard loads, each with a KV usage in [0, 1] and a reading time not
// negative, and packing them again gives the same loads back.
func FuzzDecodeLoads(f *testing.F) {
	seed, err := PackLoads(1, []IndexedLoad{
		{LoadsShard, "w0", &xdsv1.Load{Running: 3, KvUsage: 0.25, Epoch: 9, ObservedUnixNano: 5_000_000_000}},
		{LoadsShard + 7, "w1", &xdsv1.Load{Waiting: 1, Epoch: 8, ObservedUnixNano: 4_000_000_000}},
	})
	if err != nil {
		f.Fatal(err)
	}
	b, err := proto.Marshal(seed)
	if err != nil {
		f.Fatal(err)
	}
	f.Add("loads/1", b)
	f.Add("loads/0", []byte{0x0a, 0x01, 0x80})
	f.Fuzz(func(t *testing.T, name string, data []byte) {
		shard, sh, err := DecodeLoads(name, &anypb.Any{TypeUrl: LoadsType, Value: data})
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error not ErrInvalid: %v", err)
			}
			return
		}
		if len(sh.Loads) != LoadsShard || len(sh.Checks) != LoadsShard {
			t.Fatalf("%d loads, %d checks", len(sh.Loads), len(sh.Checks))
		}
		var in []IndexedLoad
		for i, l := range sh.Loads {
			if l == nil {
				continue
			}
			if u := l.GetKvUsage(); !(u >= 0 && u <= 1) || l.GetObservedUnixNano() < 0 {
				t.Fatalf("index %d: %v", i, l)
			}
			in = append(in, IndexedLoad{shard*LoadsShard + uint32(i), "", l})
		}
		again, err := PackLoads(shard, in)
		if err != nil {
			t.Fatalf("packing what was unpacked: %v", err)
		}
		back, err := UnpackLoads(shard, again)
		if err != nil {
			t.Fatalf("unpacking what was packed again: %v", err)
		}
		for i := range sh.Loads {
			if !proto.Equal(sh.Loads[i], back.Loads[i]) {
				t.Fatalf("index %d: %v, then %v", i, sh.Loads[i], back.Loads[i])
			}
		}
	})
}
