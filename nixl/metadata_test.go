package nixl

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"slices"
	"testing"
)

func sampleMD() *Metadata {
	return &Metadata{
		Name:     "prefill-0",
		Instance: 0x1234_5678_9abc,
		Backends: []BackendInfo{
			{Kind: BackendSHM, Info: encodeSHMInfo("boot:abc", "kvrelay-nixl/1/ff")},
			{Kind: BackendTCP, Info: []byte("10.0.0.7:5600")},
		},
		Regions: []RegionDesc{
			{ID: 1, Name: "kv", Mem: DRAM, Addr: 0x7f0000000000, Len: 1 << 30, Shared: true},
			{ID: 2, Mem: DRAM, Addr: 0x1000, Len: 4096},
			{ID: 7, Name: "gpu0", Mem: VRAM, DevID: 3, Addr: 0x1000, Len: 1 << 20},
		},
	}
}

func TestMetadataRoundTrip(t *testing.T) {
	for _, md := range []*Metadata{sampleMD(), {Name: "bare"}} {
		b, err := md.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeMetadata(b)
		if err != nil {
			t.Fatal(err)
		}
		if len(md.Regions) == 0 {
			md.Regions = []RegionDesc{}
		}
		if len(md.Backends) == 0 {
			md.Backends = []BackendInfo{}
		}
		if !reflect.DeepEqual(got, md) {
			t.Errorf("round trip:\n got %+v\nwant %+v", got, md)
		}
	}
}

// An agent's metadata lists its backends and regions, survives encoding, and a peer
// fetching it over TCP sees the same.
func TestAgentMetadata(t *testing.T) {
	a := newAgent(t, "prefill", Config{})
	kv := hostRegion(t, a, 1<<20, WithRegionName("kv"))
	scratch := heapRegion(t, a, 4096)
	md := a.LocalMD()
	if md.Name != "prefill" {
		t.Errorf("name %q", md.Name)
	}
	if addr, ok := md.Backend(BackendTCP); !ok || string(addr) != a.Addr() {
		t.Errorf("tcp info %q, want %q", addr, a.Addr())
	}
	if info, ok := md.Backend(BackendSHM); !ok {
		if slices.Contains(testBackends(), BackendSHM) {
			t.Error("no shm backend")
		}
	} else if host, sock, ok := parseSHMInfo(info); !ok || host == "" || sock == "" {
		t.Errorf("shm info %q", info)
	}
	want := []RegionDesc{kv.Desc(), scratch.Desc()}
	if !reflect.DeepEqual(md.Regions, want) {
		t.Errorf("regions %+v, want %+v", md.Regions, want)
	}
	if !kv.Desc().Shared || scratch.Desc().Shared {
		t.Errorf("shared flags: kv %v, scratch %v", kv.Desc().Shared, scratch.Desc().Shared)
	}

	b := newAgent(t, "decode", Config{})
	name, err := b.Connect(testCtx(t), a.Addr())
	if err != nil || name != "prefill" {
		t.Fatalf("Connect = %q, %v", name, err)
	}
	fetched, err := b.RemoteMD("prefill")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(fetched, md) {
		t.Errorf("fetched %+v\nwant %+v", fetched, md)
	}
	if r, ok := fetched.Region("kv"); !ok || r != kv.Desc() {
		t.Errorf("Region(kv) = %+v, %v", r, ok)
	}

	// Own metadata cannot be loaded as a peer's.
	own, _ := a.GetLocalMD()
	if _, err := a.LoadRemoteMD(own); !errors.Is(err, ErrNameConflict) {
		t.Errorf("loading own metadata: %v", err)
	}
	// Invalidation forgets the peer; Connect fetches it again.
	if err := b.InvalidateRemoteMD("prefill"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RemoteMD("prefill"); !errors.Is(err, ErrUnknownAgent) {
		t.Errorf("after invalidation: %v", err)
	}
	if err := b.InvalidateRemoteMD("prefill"); !errors.Is(err, ErrUnknownAgent) {
		t.Errorf("second invalidation: %v", err)
	}
	if _, err := b.Connect(testCtx(t), a.Addr()); err != nil {
		t.Fatal(err)
	}
	if err := b.RemoveRemoteAgent("prefill"); err != nil {
		t.Fatal(err)
	}
}

func TestMetadataRejectsMalformed(t *testing.T) {
	good, _ := sampleMD().MarshalBinary()
	mutate := func(f func(m *Metadata)) []byte {
		m := sampleMD()
		f(m)
		b, err := m.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	tests := []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"bad magic", append([]byte("XXMD"), good[4:]...)},
		{"bad version", append(append([]byte("NXMD"), 9), good[5:]...)},
		{"truncated", good[:len(good)-1]},
		{"trailing", append(bytes.Clone(good), 0)},
		{"zero-length region", mutate(func(m *Metadata) { m.Regions[0].Len = 0 })},
		{"overflowing region", mutate(func(m *Metadata) { m.Regions[0].Addr = ^uint64(0) - 10 })},
		{"bad memory type", mutate(func(m *Metadata) { m.Regions[0].Mem = 9 })},
		{"duplicate id", mutate(func(m *Metadata) { m.Regions[1].ID = m.Regions[0].ID })},
		{"overlapping", mutate(func(m *Metadata) { m.Regions[1].Addr = m.Regions[0].Addr + 8 })},
		{"huge region count", func() []byte {
			b := append([]byte("NXMD"), mdVersion)
			b = appendStr16(b, "x")
			b = append(b, 0)
			return binary.LittleEndian.AppendUint32(b, 1<<31)
		}()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := DecodeMetadata(tt.data); !errors.Is(err, ErrBadMetadata) {
				t.Errorf("err = %v, want ErrBadMetadata", err)
			}
		})
	}
	if _, err := (&Metadata{}).MarshalBinary(); !errors.Is(err, ErrBadMetadata) {
		t.Errorf("encoding nameless metadata: %v", err)
	}
}

func FuzzDecodeMetadata(f *testing.F) {
	good, _ := sampleMD().MarshalBinary()
	bare, _ := (&Metadata{Name: "a"}).MarshalBinary()
	f.Add(good)
	f.Add(bare)
	f.Add(good[:20])
	f.Add([]byte("NXMD\x01"))
	self := newAgent(f, "fuzz-self", Config{})
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := DecodeMetadata(data)
		if err != nil {
			if !errors.Is(err, ErrBadMetadata) {
				t.Fatalf("error %v does not wrap ErrBadMetadata", err)
			}
			return
		}
		// Whatever decodes re-encodes to the same bytes.
		b, err := m.MarshalBinary()
		if err != nil {
			t.Fatalf("re-encoding decoded metadata: %v", err)
		}
		if !bytes.Equal(b, data) {
			t.Fatalf("re-encoding differs:\n got %x\nwant %x", b, data)
		}
		// And loads into an agent as a peer (unless it names the agent itself).
		if m.Name != "fuzz-self" {
			if _, err := self.LoadRemoteMD(data); err != nil {
				t.Fatalf("loading decodable metadata: %v", err)
			}
		}
	})
}
