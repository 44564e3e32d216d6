package controlplane

import (
	"context"
	"net"
	"strconv"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/internal/cputime"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// TestIndexQueryAnswers: the query answers, for the slots asked about only, each run's length
// and its blocks below GPU memory; it refuses oversized queries, and answers Unavailable
// until ingestion has caught up.
func TestIndexQueryAnswers(t *testing.T) {
	x := kvindex.New()
	toks := make([]uint32, 16*6)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	store := func(id, medium string, tag uint64, n int) {
		ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: 16, Medium: medium, TokenIDs: toks[:16*n]}
		for i := range n {
			ev.BlockHashes = append(ev.BlockHashes, kvevents.HashU64(tag<<32|uint64(i)))
		}
		x.Apply(id, &kvevents.Batch{Events: []kvevents.Event{ev}}, nil)
	}
	store("a", "GPU", 1, 6) // slot 0: 6 blocks in GPU memory
	store("b", "GPU", 2, 2) // slot 1: 2 in GPU memory, then 3 in host memory
	store("b", "CPU", 3, 5)
	store("c", "GPU", 4, 4) // slot 2: 4, not asked about
	hashes := blockhash.Seq(toks, 16, nil)
	ready := make(chan struct{})
	q := newIndexQuery(x, ready)
	ask := func(req *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, codes.Code) {
		resp, err := q.Match(context.Background(), req)
		return resp, status.Code(err)
	}
	if _, code := ask(&xdsv1.IndexMatchRequest{Hashes: hashes, Slots: []byte{3}}); code != codes.Unavailable {
		t.Fatalf("before catching up: %v, want Unavailable", code)
	}
	close(ready)
	resp, code := ask(&xdsv1.IndexMatchRequest{Hashes: hashes, Slots: []byte{0b011}})
	if code != codes.OK {
		t.Fatal(code)
	}
	want := &xdsv1.IndexMatchResponse{Slot: []uint32{0, 1}, Run: []uint32{6, 5}, Host: []uint32{0, 3}, Disk: []uint32{0, 0}, Shared: []uint32{0, 0}}
	if resp.String() != want.String() {
		t.Fatalf("answer %v, want %v", resp, want)
	}
	if resp, _ := ask(&xdsv1.IndexMatchRequest{Hashes: hashes}); len(resp.Slot) != 0 {
		t.Fatalf("no slot asked about, answered %v", resp)
	}
	// Every slot the bitmap can name: the three the index has answer, the rest hold nothing.
	all := make([]byte, 2048)
	for i := range all {
		all[i] = 0xff
	}
	if resp, code := ask(&xdsv1.IndexMatchRequest{Hashes: hashes, Slots: all}); code != codes.OK || len(resp.Slot) != 3 || cap(q.scratch.Get().(*queryScratch).overlap) > 16 {
		t.Fatalf("asked about every slot: %v %v", code, resp)
	}
	if _, code := ask(&xdsv1.IndexMatchRequest{Hashes: make([]uint64, MaxQueryBlocks+1), Slots: []byte{1}}); code != codes.InvalidArgument {
		t.Fatalf("too long a prompt: %v", code)
	}
	if _, code := ask(&xdsv1.IndexMatchRequest{Hashes: hashes, Slots: make([]byte, 1<<20)}); code != codes.InvalidArgument {
		t.Fatalf("too large a bitmap: %v", code)
	}
}

// FuzzIndexQuery: any encoded query is answered or refused without a panic, and an answer
// names only slots asked about, in order, each run no longer than the prompt.
func FuzzIndexQuery(f *testing.F) {
	x := kvindex.New()
	toks := make([]uint32, 16*4)
	ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: 16, TokenIDs: toks}
	for i := range 4 {
		ev.BlockHashes = append(ev.BlockHashes, kvevents.HashU64(uint64(i+1)))
	}
	for _, id := range []string{"a", "b", "c"} {
		x.Apply(id, &kvevents.Batch{Events: []kvevents.Event{ev}}, nil)
	}
	ready := make(chan struct{})
	close(ready)
	q := newIndexQuery(x, ready)
	seed, _ := proto.Marshal(&xdsv1.IndexMatchRequest{NodeId: "p", Hashes: blockhash.Seq(toks, 16, nil), Slots: []byte{5}})
	f.Add(seed)
	f.Fuzz(func(t *testing.T, b []byte) {
		var req xdsv1.IndexMatchRequest
		if proto.Unmarshal(b, &req) != nil {
			return
		}
		resp, err := q.Match(context.Background(), &req)
		if err != nil {
			return
		}
		for j, s := range resp.Slot {
			if int(s/8) >= len(req.Slots) || req.Slots[s/8]&(1<<(s%8)) == 0 || (j > 0 && s <= resp.Slot[j-1]) || int(resp.Run[j]) > len(req.Hashes) {
				t.Fatalf("answer %v to %v", resp, req.Slots)
			}
		}
	})
}

// BenchmarkIndexQuery is one proxy's query of a 256-block prompt against an index of 1,024
// workers (each holding 1,024 blocks of its own; half of them the prompt's first 192 blocks
// too), asking about all 1,024: match is the control plane's work alone, grpc the round trip
// over loopback (a real server and client, the proxy's side included), with the bytes each
// way and the CPU of both sides.
func BenchmarkIndexQuery(b *testing.B) {
	const workers, own, shared, prompt = 1024, 1024, 192, 256
	x := kvindex.New()
	toks := make([]uint32, 16*prompt)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	mine := make([]uint32, 16*own)
	for w := range workers {
		id := "w" + strconv.Itoa(w)
		if w%2 == 0 {
			ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: 16, TokenIDs: toks[:16*shared]}
			for i := range shared {
				ev.BlockHashes = append(ev.BlockHashes, kvevents.HashU64(uint64(w)<<32|uint64(i)))
			}
			x.Apply(id, &kvevents.Batch{Events: []kvevents.Event{ev}}, nil)
		}
		for i := range mine {
			mine[i] = uint32(w*1_000_003 + i)
		}
		ev := kvevents.Event{Kind: kvevents.BlockStored, BlockSize: 16, TokenIDs: mine}
		for i := range own {
			ev.BlockHashes = append(ev.BlockHashes, kvevents.HashU64(uint64(w)<<32|uint64(1<<20+i)))
		}
		x.Apply(id, &kvevents.Batch{Events: []kvevents.Event{ev}}, nil)
	}
	ready := make(chan struct{})
	close(ready)
	q := newIndexQuery(x, ready)
	slots := make([]byte, workers/8)
	for i := range slots {
		slots[i] = 0xff
	}
	req := &xdsv1.IndexMatchRequest{NodeId: "proxy-0", Hashes: blockhash.Seq(toks, 16, nil), Slots: slots}
	check := func(resp *xdsv1.IndexMatchResponse) {
		if len(resp.Slot) != workers/2 || resp.Run[0] != shared {
			b.Fatalf("%d slots answered, the first with a run of %d", len(resp.Slot), resp.Run[0])
		}
	}
	b.Run("match", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			resp, err := q.Match(context.Background(), req)
			if err != nil {
				b.Fatal(err)
			}
			check(resp)
		}
	})
	b.Run("grpc", func(b *testing.B) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		srv := grpc.NewServer()
		xdsv1.RegisterIndexQueryServer(srv, q)
		go func() { _ = srv.Serve(lis) }()
		defer srv.Stop()
		conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		client := xdsv1.NewIndexQueryClient(conn)
		var respBytes int
		b.ReportAllocs()
		cpu0 := cputime.Self()
		for b.Loop() {
			resp, err := client.Match(context.Background(), req)
			if err != nil {
				b.Fatal(err)
			}
			check(resp)
			respBytes = proto.Size(resp)
		}
		b.ReportMetric(float64(cputime.Self()-cpu0)/1e3/float64(b.N), "cpu_us/op")
		b.ReportMetric(float64(proto.Size(req)), "req_bytes")
		b.ReportMetric(float64(respBytes), "resp_bytes")
	})
}
