package nixl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

func TestTransferRoundTrip(t *testing.T) {
	const blockSize, slots = 64 << 10, 32
	for _, backend := range testBackends() {
		for _, op := range []Op{Read, Write} {
			for _, chunk := range []int{0, 4 << 10} { // default, and many small frames
				name := fmt.Sprintf("%s/%s/chunk=%d", backend, op, chunk)
				t.Run(name, func(t *testing.T) {
					cfg := Config{ChunkSize: chunk}
					if backend == BackendTCP {
						cfg.Backends = []BackendKind{BackendTCP}
					}
					ini := newAgent(t, "initiator", cfg)
					tgt := newAgent(t, "target", Config{})
					lr := hostRegion(t, ini, blockSize*slots)
					rr := hostRegion(t, tgt, blockSize*slots, WithRegionName("kv"))
					fillRandom(lr.Bytes(), 1)
					fillRandom(rr.Bytes(), 2)
					loadMD(t, ini, tgt)

					localIDs := []int{3, 4, 5, 9, 0, 31, 17}
					remoteIDs := []int{10, 11, 12, 2, 30, 0, 7}
					src, dst := lr, rr
					srcIDs, dstIDs := localIDs, remoteIDs
					if op == Read {
						src, dst, srcIDs, dstIDs = rr, lr, remoteIDs, localIDs
					}
					want := blocksSum(src, blockSize, srcIDs)
					untouched := slices.Clone(dst.Bytes()[blockSize*20 : blockSize*21])

					local, err := lr.Blocks(blockSize, localIDs)
					if err != nil {
						t.Fatal(err)
					}
					md, err := ini.RemoteMD("target")
					if err != nil {
						t.Fatal(err)
					}
					kv, ok := md.Region("kv")
					if !ok {
						t.Fatal("remote region kv missing")
					}
					remote, err := kv.Blocks(blockSize, remoteIDs)
					if err != nil {
						t.Fatal(err)
					}
					x, err := ini.CreateXfer(op, local, "target", remote)
					if err != nil {
						t.Fatal(err)
					}
					if s := x.State(); s != StatePending {
						t.Fatalf("state before Post = %v", s)
					}
					if err := x.Post(testCtx(t)); err != nil {
						t.Fatal(err)
					}
					if err := x.Wait(testCtx(t)); err != nil {
						t.Fatal(err)
					}
					if s := x.State(); s != StateDone {
						t.Fatalf("state after Wait = %v", s)
					}
					if got := x.Backend(); got != backend {
						t.Errorf("carried by %q, want %q", got, backend)
					}
					if got := blocksSum(dst, blockSize, dstIDs); got != want {
						t.Errorf("destination blocks differ from source blocks")
					}
					if !bytes.Equal(untouched, dst.Bytes()[blockSize*20:blockSize*21]) {
						t.Errorf("a block outside the transfer changed")
					}
					// A finished transfer can be posted again.
					fillRandom(src.Bytes(), 3)
					want = blocksSum(src, blockSize, srcIDs)
					if err := x.Post(testCtx(t)); err != nil {
						t.Fatal(err)
					}
					if err := x.Wait(testCtx(t)); err != nil {
						t.Fatal(err)
					}
					if got := blocksSum(dst, blockSize, dstIDs); got != want {
						t.Errorf("after repost: destination blocks differ from source blocks")
					}
				})
			}
		}
	}
}

// A plain []byte region is not shareable, so even same-host agents move it over TCP.
func TestHeapRegionFallsBackToTCP(t *testing.T) {
	ini := newAgent(t, "ini", Config{})
	tgt := newAgent(t, "tgt", Config{})
	lr := heapRegion(t, ini, 1<<20)
	rr := heapRegion(t, tgt, 1<<20)
	fillRandom(rr.Bytes(), 7)
	loadMD(t, ini, tgt)
	x, err := ini.CreateXfer(Read, DescList{Descs: []Desc{lr.Desc().Whole()}}, "tgt", DescList{Descs: []Desc{rr.Desc().Whole()}})
	if err != nil {
		t.Fatal(err)
	}
	x.Post(testCtx(t))
	if err := x.Wait(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if x.Backend() != BackendTCP {
		t.Errorf("backend %q, want tcp", x.Backend())
	}
	if !bytes.Equal(lr.Bytes(), rr.Bytes()) {
		t.Error("data differs")
	}
}

func TestNotifications(t *testing.T) {
	for _, backend := range testBackends() {
		t.Run(string(backend), func(t *testing.T) {
			cfg := Config{}
			if backend == BackendTCP {
				cfg = tcpOnly()
			}
			dec := newAgent(t, "decode", cfg)
			pre := newAgent(t, "prefill", Config{})
			lr := hostRegion(t, dec, 4<<10)
			rr := hostRegion(t, pre, 4<<10)
			loadMD(t, dec, pre)
			ctx := testCtx(t)
			local := DescList{Descs: []Desc{lr.Desc().Whole()}}
			remote := DescList{Descs: []Desc{rr.Desc().Whole()}}

			if err := dec.Transfer(ctx, Read, local, "prefill", remote, WithNotif([]byte("read-done"))); err != nil {
				t.Fatal(err)
			}
			if err := dec.Transfer(ctx, Write, local, "prefill", remote, WithNotif([]byte("write-done"))); err != nil {
				t.Fatal(err)
			}
			if err := dec.GenNotif(ctx, "prefill", []byte("hello")); err != nil {
				t.Fatal(err)
			}
			// A transfer without notification delivers nothing.
			if err := dec.Transfer(ctx, Read, local, "prefill", remote); err != nil {
				t.Fatal(err)
			}
			var got []string
			for len(got) < 3 {
				n, err := pre.WaitNotifs(ctx)
				if err != nil {
					t.Fatalf("waiting for notifications (have %q): %v", got, err)
				}
				for from, msgs := range n {
					if from != "decode" {
						t.Errorf("notification from %q", from)
					}
					for _, m := range msgs {
						got = append(got, string(m))
					}
				}
			}
			if want := []string{"read-done", "write-done", "hello"}; !slices.Equal(got, want) {
				t.Errorf("notifications %q, want %q", got, want)
			}
			time.Sleep(20 * time.Millisecond)
			if n := pre.GetNotifs(); n != nil {
				t.Errorf("unexpected notifications %q", n)
			}
			// The target can notify back over the connection the initiator opened.
			if err := pre.GenNotif(ctx, "decode", []byte("back")); err != nil {
				t.Fatal(err)
			}
			n, err := dec.WaitNotifs(ctx)
			if err != nil || len(n["prefill"]) != 1 || string(n["prefill"][0]) != "back" {
				t.Errorf("notifications at initiator = %q, %v", n, err)
			}
		})
	}
}

// The decode side of disaggregated serving: it knows only the prefill worker's host:port
// and block ids, reads the blocks into its own slots and tells prefill to free them.
func TestConnectAndReadBlocks(t *testing.T) {
	const blockSize, slots = 16 << 10, 64
	pre := newAgent(t, "prefill-0", Config{})
	kv := hostRegion(t, pre, blockSize*slots, WithRegionName("kv"))
	fillRandom(kv.Bytes(), 11)
	for _, backend := range testBackends() {
		t.Run(string(backend), func(t *testing.T) {
			cfg := Config{}
			if backend == BackendTCP {
				cfg = tcpOnly()
			}
			dec := newAgent(t, "decode-"+string(backend), cfg)
			mine := hostRegion(t, dec, blockSize*slots)
			ctx := testCtx(t)
			peer, err := dec.Connect(ctx, pre.Addr())
			if err != nil {
				t.Fatal(err)
			}
			if peer != "prefill-0" {
				t.Fatalf("Connect returned %q", peer)
			}
			if again, err := dec.Connect(ctx, pre.Addr()); err != nil || again != peer {
				t.Fatalf("second Connect = %q, %v", again, err)
			}
			md, _ := dec.RemoteMD(peer)
			remoteKV, ok := md.Region("kv")
			if !ok {
				t.Fatal("no kv region in fetched metadata")
			}
			remoteIDs, localIDs := []int{5, 6, 7, 40}, []int{0, 1, 2, 3}
			remote, err := remoteKV.Blocks(blockSize, remoteIDs)
			if err != nil {
				t.Fatal(err)
			}
			local, err := mine.Blocks(blockSize, localIDs)
			if err != nil {
				t.Fatal(err)
			}
			if err := dec.Transfer(ctx, Read, local, peer, remote, WithNotif([]byte("free 5,6,7,40"))); err != nil {
				t.Fatal(err)
			}
			if blocksSum(mine, blockSize, localIDs) != blocksSum(kv, blockSize, remoteIDs) {
				t.Error("blocks differ")
			}
			n, err := pre.WaitNotifs(ctx)
			if err != nil || string(n[dec.Name()][0]) != "free 5,6,7,40" {
				t.Errorf("prefill notifications = %q, %v", n, err)
			}
		})
	}
}

func TestConcurrentTransfers(t *testing.T) {
	const blockSize, slots, workers, rounds = 8 << 10, 128, 8, 20
	for _, backend := range testBackends() {
		t.Run(string(backend), func(t *testing.T) {
			cfg := Config{ChunkSize: 16 << 10}
			if backend == BackendTCP {
				cfg.Backends = []BackendKind{BackendTCP}
			}
			ini := newAgent(t, "ini", cfg)
			tgt := newAgent(t, "tgt", cfg)
			lr := hostRegion(t, ini, blockSize*slots)
			rr := hostRegion(t, tgt, blockSize*slots)
			fillRandom(lr.Bytes(), 21)
			fillRandom(rr.Bytes(), 22)
			loadMD(t, ini, tgt)
			loadMD(t, tgt, ini) // both directions at once on one connection
			ctx := testCtx(t)
			var wg sync.WaitGroup
			errs := make(chan error, workers)
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					// Each worker owns blocks w, w+workers, ... on both sides.
					var ids []int
					for id := w; id < slots; id += workers {
						ids = append(ids, id)
					}
					self, peer, mine, theirs := ini, "tgt", lr, rr
					if w%2 == 1 { // odd workers run on the target, towards the initiator
						self, peer, mine, theirs = tgt, "ini", rr, lr
					}
					md, _ := self.RemoteMD(peer)
					remoteDesc := md.Regions[0]
					for i := range rounds {
						op := Read
						if i%2 == 0 {
							op = Write
						}
						local, _ := mine.Blocks(blockSize, ids)
						remote, _ := remoteDesc.Blocks(blockSize, ids)
						if err := self.Transfer(ctx, op, local, peer, remote); err != nil {
							errs <- err
							return
						}
						if blocksSum(mine, blockSize, ids) != blocksSum(theirs, blockSize, ids) {
							errs <- fmt.Errorf("worker %d round %d (%s): blocks differ", w, i, op)
							return
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}

func TestBadDescriptorsRejected(t *testing.T) {
	const n = 64 << 10
	ini := newAgent(t, "ini", tcpOnly())
	tgt := newAgent(t, "tgt", Config{})
	lr := hostRegion(t, ini, n)
	rr := hostRegion(t, tgt, n)
	fillRandom(lr.Bytes(), 31)
	before := slices.Clone(rr.Bytes())
	loadMD(t, ini, tgt)
	l, r := lr.Desc(), rr.Desc()
	whole := func(d RegionDesc) DescList { return DescList{Descs: []Desc{d.Whole()}} }
	one := func(d Desc) DescList { return DescList{Descs: []Desc{d}} }

	tests := []struct {
		name   string
		peer   string
		local  DescList
		remote DescList
		want   error
		side   Side
		index  int
	}{
		{name: "unknown agent", peer: "nobody", local: whole(l), remote: whole(r), want: ErrUnknownAgent, index: -1},
		{name: "empty lists", peer: "tgt", want: ErrInvalidDesc, index: -1},
		{name: "count mismatch", peer: "tgt", local: whole(l), remote: DescList{Descs: []Desc{r.Whole(), r.Whole()}}, want: ErrLengthMismatch, index: -1},
		{name: "length mismatch", peer: "tgt", local: one(Desc{Addr: l.Addr, Len: 100}), remote: one(Desc{Addr: r.Addr, Len: 200}), want: ErrLengthMismatch, side: RemoteSide},
		{name: "zero length", peer: "tgt", local: one(Desc{Addr: l.Addr}), remote: one(Desc{Addr: r.Addr}), want: ErrInvalidDesc, side: LocalSide},
		{name: "local unregistered", peer: "tgt", local: one(Desc{Addr: l.Addr + n, Len: 16}), remote: one(Desc{Addr: r.Addr, Len: 16}), want: ErrUnknownRegion, side: LocalSide},
		{name: "local past end", peer: "tgt", local: one(Desc{Addr: l.Addr + n - 8, Len: 16}), remote: one(Desc{Addr: r.Addr, Len: 16}), want: ErrOutOfRange, side: LocalSide},
		{name: "local wrong device", peer: "tgt", local: one(Desc{Addr: l.Addr, Len: 16, DevID: 1}), remote: one(Desc{Addr: r.Addr, Len: 16}), want: ErrUnknownRegion, side: LocalSide},
		{name: "remote unregistered", peer: "tgt", local: one(Desc{Addr: l.Addr, Len: 16}), remote: one(Desc{Addr: r.Addr - 4096, Len: 16}), want: ErrUnknownRegion, side: RemoteSide},
		{name: "remote past end", peer: "tgt", local: one(Desc{Addr: l.Addr, Len: 16}), remote: one(Desc{Addr: r.Addr + n - 1, Len: 16}), want: ErrOutOfRange, side: RemoteSide},
		{name: "second pair bad", peer: "tgt", local: DescList{Descs: []Desc{{Addr: l.Addr, Len: 16}, {Addr: l.Addr + 16, Len: 16}}}, remote: DescList{Descs: []Desc{{Addr: r.Addr, Len: 16}, {Addr: r.Addr + n, Len: 16}}}, want: ErrUnknownRegion, side: RemoteSide, index: 1},
		{name: "local VRAM", peer: "tgt", local: DescList{Mem: VRAM, Descs: []Desc{{Addr: 4096, Len: 16}}}, remote: one(Desc{Addr: r.Addr, Len: 16}), want: ErrDeviceMemoryUnavailable, index: -1},
		{name: "remote VRAM", peer: "tgt", local: one(Desc{Addr: l.Addr, Len: 16}), remote: DescList{Mem: VRAM, Descs: []Desc{{Addr: r.Addr, Len: 16}}}, want: ErrUnknownRegion, side: RemoteSide},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, op := range []Op{Read, Write} {
				_, err := ini.CreateXfer(op, tt.local, tt.peer, tt.remote, WithNotif([]byte("x")))
				if !errors.Is(err, tt.want) {
					t.Fatalf("%s: err = %v, want %v", op, err, tt.want)
				}
				var de *DescError
				if tt.index >= 0 {
					if !errors.As(err, &de) || de.Side != tt.side || de.Index != tt.index {
						t.Errorf("%s: err = %#v, want a DescError for %s descriptor %d", op, err, tt.side, tt.index)
					}
				}
				err = ini.Transfer(testCtx(t), op, tt.local, tt.peer, tt.remote)
				if !errors.Is(err, tt.want) {
					t.Errorf("%s: Transfer err = %v, want %v", op, err, tt.want)
				}
			}
		})
	}
	if !bytes.Equal(before, rr.Bytes()) {
		t.Error("target memory changed")
	}
	if n := tgt.GetNotifs(); n != nil {
		t.Errorf("target got notifications %q", n)
	}
}

// Metadata that claims more than the peer registered passes local validation; the peer
// itself must refuse, before writing anything.
func TestPeerRejectsStaleDescriptors(t *testing.T) {
	const n = 64 << 10
	ini := newAgent(t, "ini", tcpOnly())
	tgt := newAgent(t, "tgt", Config{})
	lr := hostRegion(t, ini, 4*n)
	rr := hostRegion(t, tgt, n)
	gone := heapRegion(t, tgt, n)
	fillRandom(lr.Bytes(), 41)
	before := slices.Clone(rr.Bytes())

	md := tgt.LocalMD()
	for i := range md.Regions {
		if md.Regions[i].ID == rr.ID() {
			md.Regions[i].Len = 4 * n // lie about the size
		}
	}
	b, _ := md.MarshalBinary()
	if _, err := ini.LoadRemoteMD(b); err != nil {
		t.Fatal(err)
	}
	if err := tgt.DeregisterMem(gone); err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	tests := []struct {
		name   string
		remote Desc
		want   error
	}{
		{"out of range", Desc{Addr: rr.Desc().Addr + n/2, Len: n}, ErrOutOfRange},
		{"deregistered", gone.Desc().Whole(), ErrUnknownRegion},
	}
	for _, tt := range tests {
		for _, op := range []Op{Write, Read} {
			t.Run(tt.name+"/"+op.String(), func(t *testing.T) {
				local := DescList{Descs: []Desc{{Addr: lr.Desc().Addr, Len: tt.remote.Len}}}
				err := ini.Transfer(ctx, op, local, "tgt", DescList{Descs: []Desc{tt.remote}}, WithNotif([]byte("no")))
				var re *RemoteError
				if !errors.Is(err, tt.want) || !errors.Is(err, ErrRemote) || !errors.As(err, &re) {
					t.Fatalf("err = %v, want a RemoteError matching %v", err, tt.want)
				}
			})
		}
	}
	if !bytes.Equal(before, rr.Bytes()) {
		t.Error("target memory changed")
	}
	if n := tgt.GetNotifs(); n != nil {
		t.Errorf("target got notifications %q", n)
	}
	// The connection survives rejections.
	ok := DescList{Descs: []Desc{{Addr: rr.Desc().Addr, Len: n}}}
	if err := ini.Transfer(ctx, Write, DescList{Descs: []Desc{{Addr: lr.Desc().Addr, Len: n}}}, "tgt", ok); err != nil {
		t.Fatalf("valid transfer after rejections: %v", err)
	}
	if !bytes.Equal(lr.Bytes()[:n], rr.Bytes()) {
		t.Error("valid transfer did not land")
	}
}

func TestPeerClosedMidTransfer(t *testing.T) {
	const total = 64 << 20
	for _, op := range []Op{Read, Write} {
		t.Run(op.String(), func(t *testing.T) {
			started := make(chan struct{})
			release := make(chan struct{})
			var once sync.Once
			hookOp := frRData
			if op == Write {
				hookOp = frWData
			}
			testHookData = func(t frameType, off uint64) {
				if t == hookOp && off > 0 {
					once.Do(func() { close(started) })
					<-release
				}
			}
			t.Cleanup(func() { testHookData = nil })
			ini := newAgent(t, "ini", Config{Backends: []BackendKind{BackendTCP}, ChunkSize: 64 << 10})
			tgt, err := NewAgent("tgt", Config{ChunkSize: 64 << 10})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { tgt.Close() })
			lr := heapRegion(t, ini, total)
			rr := heapRegion(t, tgt, total)
			loadMD(t, ini, tgt)
			x, err := ini.CreateXfer(op, DescList{Descs: []Desc{lr.Desc().Whole()}}, "tgt", DescList{Descs: []Desc{rr.Desc().Whole()}})
			if err != nil {
				t.Fatal(err)
			}
			if err := x.Post(context.Background()); err != nil {
				t.Fatal(err)
			}
			<-started // the first chunk went through, the rest is held up at the target
			closed := make(chan error, 1)
			go func() { closed <- tgt.Close() }()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err = x.Wait(ctx)
			close(release)
			if errors.Is(err, context.DeadlineExceeded) && x.State() == StateInProgress {
				t.Fatal("transfer hangs after the peer closed")
			}
			if !errors.Is(err, ErrPeerGone) {
				t.Fatalf("err = %v, want ErrPeerGone", err)
			}
			if s := x.State(); s != StateError {
				t.Errorf("state %v after the peer closed, want Error", s)
			}
			if err := <-closed; err != nil {
				t.Errorf("closing target: %v", err)
			}
			// The initiator stays usable: a new transfer to the closed peer fails fast.
			err = ini.Transfer(testCtx(t), op, DescList{Descs: []Desc{lr.Desc().Whole()}}, "tgt", DescList{Descs: []Desc{rr.Desc().Whole()}})
			if !errors.Is(err, ErrPeerGone) {
				t.Errorf("transfer to a closed peer: %v, want ErrPeerGone", err)
			}
		})
	}
}

func TestTimeoutAndCancel(t *testing.T) {
	hold := make(chan struct{})
	testHookData = func(frameType, uint64) { <-hold }
	t.Cleanup(func() { testHookData = nil })
	ini := newAgent(t, "ini", tcpOnly())
	tgt := newAgent(t, "tgt", Config{})
	t.Cleanup(func() { close(hold) }) // runs before the agents close
	lr := heapRegion(t, ini, 1<<20)
	rr := heapRegion(t, tgt, 1<<20)
	loadMD(t, ini, tgt)
	local := DescList{Descs: []Desc{lr.Desc().Whole()}}
	remote := DescList{Descs: []Desc{rr.Desc().Whole()}}

	start := time.Now()
	err := ini.Transfer(context.Background(), Read, local, "tgt", remote, WithTimeout(150*time.Millisecond))
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("timeout took %v", d)
	}

	x, err := ini.CreateXfer(Read, local, "tgt", remote)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	x.Post(ctx)
	if err := x.Post(ctx); !errors.Is(err, ErrBusy) {
		t.Errorf("second Post = %v, want ErrBusy", err)
	}
	if s := x.State(); s != StateInProgress {
		t.Errorf("state %v, want InProgress", s)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	if err := x.Wait(wctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Wait with short context = %v", err)
	}
	wcancel()
	cancel()
	if err := x.Wait(testCtx(t)); !errors.Is(err, context.Canceled) {
		t.Errorf("after cancel: %v, want context.Canceled", err)
	}
	if s := x.State(); s != StateError {
		t.Errorf("state %v, want Error", s)
	}
	x.Release()
	if err := x.Post(context.Background()); !errors.Is(err, ErrReleased) {
		t.Errorf("Post after Release = %v", err)
	}
}

// A peer that completes the handshake and then never answers: transfers time out, and
// the agent never waits on it beyond the timeout.
func TestSilentPeerTimesOut(t *testing.T) {
	ln := silentPeer(t, "silent")
	ini := newAgent(t, "ini", Config{Backends: []BackendKind{BackendTCP}, Timeout: 200 * time.Millisecond})
	lr := heapRegion(t, ini, 4096)
	md := &Metadata{
		Name:     "silent",
		Backends: []BackendInfo{{Kind: BackendTCP, Info: []byte(ln)}},
		Regions:  []RegionDesc{{ID: 1, Addr: 1 << 20, Len: 4096}},
	}
	b, _ := md.MarshalBinary()
	if _, err := ini.LoadRemoteMD(b); err != nil {
		t.Fatal(err)
	}
	for _, op := range []Op{Read, Write} {
		start := time.Now()
		err := ini.Transfer(context.Background(), op, DescList{Descs: []Desc{lr.Desc().Whole()}}, "silent", DescList{Descs: []Desc{{Addr: 1 << 20, Len: 4096}}})
		if !errors.Is(err, ErrTimeout) {
			t.Errorf("%s: err = %v, want ErrTimeout", op, err)
		}
		if d := time.Since(start); d > 3*time.Second {
			t.Errorf("%s took %v", op, d)
		}
	}
	if err := ini.InvalidateRemoteMD("silent"); err != nil {
		t.Fatal(err)
	}
	if _, err := ini.Connect(testCtxTimeout(t, 300*time.Millisecond), ln); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Connect to a silent peer: %v, want a deadline error", err)
	}
}

func testCtxTimeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// A same-host peer whose shared-memory socket cannot be reached (another network
// namespace), or a peer on another host, is served over TCP instead.
func TestSHMFallsBackToTCP(t *testing.T) {
	if !slices.Contains(testBackends(), BackendSHM) {
		t.Skip("no shared memory backend on this platform")
	}
	tests := []struct {
		name       string
		host, sock func(host, sock string) (string, string)
	}{
		{"unreachable socket", nil, func(h, s string) (string, string) { return h, s + "-gone" }},
		{"other host", func(h, s string) (string, string) { return "boot:elsewhere", s }, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ini := newAgent(t, "ini", Config{})
			tgt := newAgent(t, "tgt", Config{})
			lr := hostRegion(t, ini, 1<<20)
			rr := hostRegion(t, tgt, 1<<20)
			fillRandom(rr.Bytes(), 51)
			md := tgt.LocalMD()
			for i, b := range md.Backends {
				if b.Kind == BackendSHM {
					h, s, _ := parseSHMInfo(b.Info)
					if tt.host != nil {
						h, s = tt.host(h, s)
					} else {
						h, s = tt.sock(h, s)
					}
					md.Backends[i].Info = encodeSHMInfo(h, s)
				}
			}
			raw, _ := md.MarshalBinary()
			if _, err := ini.LoadRemoteMD(raw); err != nil {
				t.Fatal(err)
			}
			for range 2 { // the second time the peer is already known to be unreachable
				x, err := ini.CreateXfer(Read, DescList{Descs: []Desc{lr.Desc().Whole()}}, "tgt", DescList{Descs: []Desc{rr.Desc().Whole()}})
				if err != nil {
					t.Fatal(err)
				}
				x.Post(testCtx(t))
				if err := x.Wait(testCtx(t)); err != nil {
					t.Fatal(err)
				}
				if x.Backend() != BackendTCP {
					t.Errorf("carried by %q, want tcp", x.Backend())
				}
				if !bytes.Equal(lr.Bytes(), rr.Bytes()) {
					t.Error("data differs")
				}
			}
		})
	}
}
