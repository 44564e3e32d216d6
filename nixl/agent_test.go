package nixl

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"
)

func TestConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero", Config{}, true},
		{"tcp only", tcpOnly(), true},
		{"no tcp", Config{Backends: []BackendKind{BackendSHM}}, false},
		{"unknown backend", Config{Backends: []BackendKind{BackendTCP, "ucx"}}, false},
		{"duplicate backend", Config{Backends: []BackendKind{BackendTCP, BackendTCP}}, false},
		{"tiny chunk", Config{ChunkSize: 100}, false},
		{"huge chunk", Config{ChunkSize: 1 << 30}, false},
		{"negative timeout", Config{Timeout: -1}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if (err == nil) != tt.ok {
				t.Fatalf("Validate = %v, want ok=%v", err, tt.ok)
			}
			if err != nil {
				if !errors.Is(err, ErrInvalidConfig) {
					t.Errorf("err %v does not wrap ErrInvalidConfig", err)
				}
				if _, err := NewAgent("x", tt.cfg); err == nil {
					t.Error("NewAgent accepted the config")
				}
			}
		})
	}
	if _, err := NewAgent("", Config{}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("nameless agent: %v", err)
	}
	if _, err := NewAgent("x", Config{ListenAddr: "256.0.0.1:1"}); err == nil {
		t.Error("bad listen address accepted")
	}
}

func TestRegistration(t *testing.T) {
	a := newAgent(t, "a", Config{})
	buf := make([]byte, 1<<16)
	r, err := a.RegisterMem(buf[:4096])
	if err != nil {
		t.Fatal(err)
	}
	if d := r.Desc(); d.Addr != sliceAddr(buf) || d.Len != 4096 || d.Mem != DRAM || d.Shared {
		t.Errorf("desc %+v", d)
	}
	if _, err := a.RegisterMem(buf[100:200]); !errors.Is(err, ErrOverlap) {
		t.Errorf("overlapping registration: %v", err)
	}
	r2, err := a.RegisterMem(buf[4096:8192])
	if err != nil {
		t.Fatalf("adjacent registration: %v", err)
	}
	if r2.ID() == r.ID() {
		t.Error("ids repeat")
	}
	if _, err := a.RegisterMem(nil); !errors.Is(err, ErrInvalidDesc) {
		t.Errorf("empty registration: %v", err)
	}
	if _, err := a.RegisterDeviceMem(0, 0x10000, 1<<20); !errors.Is(err, ErrDeviceMemoryUnavailable) {
		t.Errorf("device registration: %v", err)
	}

	m, err := AllocHostMem(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if !m.Shareable() && runtime.GOOS == "linux" {
		t.Error("host memory not shareable on Linux")
	}
	hr, err := a.RegisterHostMem(m, WithRegionName("kv"))
	if err != nil {
		t.Fatal(err)
	}
	if hr.Desc().Shared != m.Shareable() || hr.Desc().Name != "kv" {
		t.Errorf("host region desc %+v", hr.Desc())
	}
	if err := m.Free(); !errors.Is(err, ErrRegionInUse) {
		t.Errorf("freeing registered memory: %v", err)
	}
	if err := a.DeregisterMem(hr); err != nil {
		t.Fatal(err)
	}
	if err := a.DeregisterMem(hr); !errors.Is(err, ErrUnknownRegion) {
		t.Errorf("second deregistration: %v", err)
	}
	if err := m.Free(); err != nil {
		t.Errorf("freeing deregistered memory: %v", err)
	}
	if _, err := a.RegisterHostMem(m); err == nil {
		t.Error("registering freed memory succeeded")
	}
	if _, err := AllocHostMem(0); err == nil {
		t.Error("zero-size allocation succeeded")
	}
	if got := len(a.Regions()); got != 2 {
		t.Errorf("%d regions, want 2", got)
	}
}

// Block descriptors address fixed slots of a region.
func TestBlocks(t *testing.T) {
	r := RegionDesc{ID: 3, Addr: 0x1000, Len: 10 * 256, DevID: 2}
	l, err := r.Blocks(256, []int{0, 9, 4})
	if err != nil {
		t.Fatal(err)
	}
	want := []Desc{{Addr: 0x1000, Len: 256, DevID: 2}, {Addr: 0x1000 + 9*256, Len: 256, DevID: 2}, {Addr: 0x1000 + 4*256, Len: 256, DevID: 2}}
	for i := range want {
		if l.Descs[i] != want[i] {
			t.Errorf("desc %d = %v, want %v", i, l.Descs[i], want[i])
		}
	}
	if l.Len() != 768 {
		t.Errorf("Len = %d", l.Len())
	}
	for _, ids := range [][]int{{10}, {-1}} {
		if _, err := r.Blocks(256, ids); !errors.Is(err, ErrOutOfRange) {
			t.Errorf("Blocks(%v): %v", ids, err)
		}
	}
	if _, err := r.Blocks(0, []int{0}); !errors.Is(err, ErrInvalidDesc) {
		t.Errorf("block size 0: %v", err)
	}
	if d, err := r.Range(10, 20); err != nil || d.Addr != 0x100a || d.Len != 20 {
		t.Errorf("Range = %v, %v", d, err)
	}
	if _, err := r.Range(2550, 20); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("Range past end: %v", err)
	}
}

// Deregistration waits for transfers using the region; later transfers fail.
func TestDeregisterDuringUse(t *testing.T) {
	hold := make(chan struct{})
	entered := make(chan struct{}, 16)
	testHookData = func(frameType, uint64) {
		entered <- struct{}{}
		<-hold
	}
	t.Cleanup(func() { testHookData = nil })
	ini := newAgent(t, "ini", tcpOnly())
	tgt := newAgent(t, "tgt", Config{})
	lr := heapRegion(t, ini, 4096)
	rr := heapRegion(t, tgt, 4096)
	loadMD(t, ini, tgt)
	x, err := ini.CreateXfer(Read, DescList{Descs: []Desc{lr.Desc().Whole()}}, "tgt", DescList{Descs: []Desc{rr.Desc().Whole()}})
	if err != nil {
		t.Fatal(err)
	}
	x.Post(context.Background())
	<-entered // the target is serving the READ from rr
	dereg := make(chan error)
	go func() { dereg <- tgt.DeregisterMem(rr) }()
	select {
	case err := <-dereg:
		t.Fatalf("DeregisterMem returned (%v) while the region was being read", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(hold)
	if err := <-dereg; err != nil {
		t.Fatal(err)
	}
	if err := x.Wait(testCtx(t)); err != nil {
		t.Fatalf("transfer begun before deregistration: %v", err)
	}
	err = x.Post(context.Background())
	if err == nil {
		err = x.Wait(testCtx(t))
	}
	if !errors.Is(err, ErrUnknownRegion) {
		t.Errorf("transfer after deregistration: %v", err)
	}
	if err := ini.DeregisterMem(lr); err != nil {
		t.Fatal(err)
	}
	if err := x.Post(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := x.Wait(testCtx(t)); !errors.Is(err, ErrUnknownRegion) {
		t.Errorf("transfer from a deregistered local region: %v", err)
	}
}

func TestClose(t *testing.T) {
	a, err := NewAgent("a", Config{})
	if err != nil {
		t.Fatal(err)
	}
	b := newAgent(t, "b", Config{})
	m, _ := AllocHostMem(4096)
	r, err := a.RegisterHostMem(m)
	if err != nil {
		t.Fatal(err)
	}
	rb := heapRegion(t, b, 4096)
	if _, err := a.Connect(testCtx(t), b.Addr()); err != nil {
		t.Fatal(err)
	}
	x, err := a.CreateXfer(Write, DescList{Descs: []Desc{r.Desc().Whole()}}, "b", DescList{Descs: []Desc{rb.Desc().Whole()}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := x.Post(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Post after Close: %v", err)
	}
	if _, err := a.CreateXfer(Write, DescList{Descs: []Desc{r.Desc().Whole()}}, "b", DescList{Descs: []Desc{rb.Desc().Whole()}}); !errors.Is(err, ErrClosed) {
		t.Errorf("CreateXfer after Close: %v", err)
	}
	if _, err := a.RegisterMem(make([]byte, 8)); !errors.Is(err, ErrClosed) {
		t.Errorf("RegisterMem after Close: %v", err)
	}
	if err := m.Free(); err != nil {
		t.Errorf("Free after Close: %v", err)
	}
	if err := a.GenNotif(context.Background(), "b", []byte("x")); !errors.Is(err, ErrClosed) {
		t.Errorf("GenNotif after Close: %v", err)
	}
}

// Two agents must not share a name: the handshake refuses it.
func TestNameConflict(t *testing.T) {
	a := newAgent(t, "same", Config{})
	b := newAgent(t, "same", Config{})
	if _, err := a.Connect(testCtx(t), b.Addr()); !errors.Is(err, ErrNameConflict) {
		t.Errorf("Connect to a namesake: %v", err)
	}
}

// A peer that restarts at the same address is a new instance: transfers prepared against
// the old metadata are refused before any byte moves, and Connect fetches the new one.
func TestPeerRestart(t *testing.T) {
	old, err := NewAgent("prefill", tcpOnly())
	if err != nil {
		t.Fatal(err)
	}
	addr := old.Addr()
	oldKV, _ := old.RegisterMem(make([]byte, 8192), WithRegionName("kv"))
	dec := newAgent(t, "decode", tcpOnly())
	mine := heapRegion(t, dec, 4096)
	ctx := testCtx(t)
	if _, err := dec.Connect(ctx, addr); err != nil {
		t.Fatal(err)
	}
	local := DescList{Descs: []Desc{mine.Desc().Whole()}}
	remote := DescList{Descs: []Desc{{Addr: oldKV.Desc().Addr, Len: 4096}}}
	if err := dec.Transfer(ctx, Read, local, "prefill", remote); err != nil {
		t.Fatal(err)
	}
	old.Close()

	restarted := newAgent(t, "prefill", Config{ListenAddr: addr, Backends: []BackendKind{BackendTCP}})
	newKV := heapRegion(t, restarted, 4096, WithRegionName("kv"))
	// The first attempt may still find the old connection before its reader saw the close.
	err = dec.Transfer(ctx, Read, local, "prefill", remote)
	if errors.Is(err, ErrPeerGone) {
		err = dec.Transfer(ctx, Read, local, "prefill", remote)
	}
	if !errors.Is(err, ErrStaleMetadata) {
		t.Fatalf("transfer against the old metadata: %v, want ErrStaleMetadata", err)
	}
	if _, err := dec.Connect(ctx, addr); err != nil {
		t.Fatal(err)
	}
	md, _ := dec.RemoteMD("prefill")
	if kv, ok := md.Region("kv"); !ok || kv != newKV.Desc() {
		t.Fatalf("after Connect: kv region %+v, want %+v", kv, newKV.Desc())
	}
	fillRandom(newKV.Bytes(), 5)
	if err := dec.Transfer(ctx, Read, local, "prefill", DescList{Descs: []Desc{newKV.Desc().Whole()}}); err != nil {
		t.Fatal(err)
	}
	if string(mine.Bytes()) != string(newKV.Bytes()) {
		t.Error("data differs")
	}
}
