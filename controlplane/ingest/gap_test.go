package ingest

import (
	"context"
	"encoding/binary"
	"io"
	"log"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// gapPublisher is an engine's KV event publisher on real ZMQ sockets (PUB plus a ROUTER
// replay socket, vLLM's protocol) that loses batches on the PUB socket, and whose replay
// buffer holds only what keep says.
type gapPublisher struct {
	pub, router  zmq4.Socket
	mu           sync.Mutex
	buffered     map[uint64][]byte // seq → payload the replay socket can still serve
	pubEP, repEP string
}

func newGapPublisher(t *testing.T) *gapPublisher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	g := &gapPublisher{pub: zmq4.NewPub(ctx, quiet), router: zmq4.NewRouter(ctx, quiet), buffered: map[uint64][]byte{}}
	g.pubEP, g.repEP = "tcp://"+freePort(t), "tcp://"+freePort(t)
	if err := g.pub.Listen(g.pubEP); err != nil {
		t.Fatal(err)
	}
	if err := g.router.Listen(g.repEP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); g.pub.Close(); g.router.Close() })
	go func() {
		for {
			msg, err := g.router.Recv()
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				continue
			}
			fr := msg.Frames
			if len(fr) != 3 || len(fr[2]) != 8 {
				continue
			}
			from := binary.BigEndian.Uint64(fr[2])
			g.mu.Lock()
			var seqs []uint64
			for s := range g.buffered {
				if s >= from {
					seqs = append(seqs, s)
				}
			}
			for i := range seqs { // sort, small
				for j := i + 1; j < len(seqs); j++ {
					if seqs[j] < seqs[i] {
						seqs[i], seqs[j] = seqs[j], seqs[i]
					}
				}
			}
			for _, s := range seqs {
				var b [8]byte
				binary.BigEndian.PutUint64(b[:], s)
				_ = g.router.Send(zmq4.NewMsgFrom(fr[0], []byte{}, b[:], g.buffered[s]))
			}
			g.mu.Unlock()
			_ = g.router.Send(zmq4.NewMsgFrom(fr[0], []byte{}, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, []byte{}))
		}
	}()
	return g
}

// send publishes batch seq (a one-block BlockStored of its own); lost keeps it off the PUB
// socket, buffered keeps it in the replay buffer.
func (g *gapPublisher) send(t *testing.T, seq uint64, lost, buffered bool) {
	ev, _ := stored(uint32(1000*seq), 1, 0, false, 100+seq)
	payload := kvevents.AppendBatch(nil, &kvevents.Batch{TS: 1, Events: []kvevents.Event{ev}}, kvevents.FormatMap)
	if buffered {
		g.mu.Lock()
		g.buffered[seq] = payload
		g.mu.Unlock()
	}
	if lost {
		return
	}
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	if err := g.pub.SendMulti(zmq4.NewMsgFrom([]byte("kv"), b[:], payload)); err != nil {
		t.Fatal(err)
	}
}

// A batch range lost in flight is replayed when the engine still buffers all of it, and the
// worker's index is rebuilt (stale) when the buffer misses any of it, even when it holds the
// first one: a replay is complete or it is not applied.
func TestMidStreamGapReplay(t *testing.T) {
	for _, tc := range []struct {
		name      string
		hole      bool // the replay buffer misses batch 6 of the lost 5-7
		wantStale uint64
		wantBlock int // the worker's GPU blocks at the end
	}{
		{"buffer holds the whole gap", false, 0, 10},
		{"buffer misses one batch of it", true, 1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newGapPublisher(t)
			idx := kvindex.New()
			m := NewManager(idx, journal.NewLog(1<<12), nil)
			defer m.Close()
			m.Sync([]Endpoint{{WorkerID: "w", Address: g.pubEP, Replay: g.repEP}})
			// The PUB socket drops messages until the subscription arrives: resend batch 0
			// until it lands, and until the subscriber has asked for the replay it makes at
			// its start (which must not find batches 1-9 already buffered). Batch 0 is
			// never buffered, so it lands through the subscription alone: once it has,
			// the PUB socket delivers what follows. A copy still in flight when it lands
			// reads as an engine restart, which clears the one block and sets it again.
			deadline := time.Now().Add(10 * time.Second)
			for idx.Blocks("w")[kvindex.GPU] == 0 || !m.Stats("w").CaughtUp.Load() {
				if time.Now().After(deadline) {
					t.Fatalf("no batch reached the index: %s", m.Stats("w"))
				}
				if idx.Blocks("w")[kvindex.GPU] == 0 {
					g.send(t, 0, false, false)
				}
				time.Sleep(50 * time.Millisecond)
			}
			for seq := uint64(1); seq < 10; seq++ {
				lost := seq >= 5 && seq <= 7
				g.send(t, seq, lost, !(tc.hole && seq == 6))
			}
			// Wait for the end state itself: the stale count rises before the worker's
			// blocks are cleared and batches 8 and 9 applied, so a stale count with the
			// blocks of batches 0-4 still there is a moment on the way, not the end. Once
			// the gap (and the stale rebuild it brings) is counted, the blocks reach
			// wantBlock only when batch 9 is applied.
			deadline = time.Now().Add(10 * time.Second)
			for st := m.Stats("w"); st.Gaps.Load() == 0 || st.Stale.Load() < tc.wantStale || idx.Blocks("w")[kvindex.GPU] != tc.wantBlock; {
				if time.Now().After(deadline) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			st := m.Stats("w")
			if st.Gaps.Load() != 1 || st.Stale.Load() != tc.wantStale || idx.Blocks("w")[kvindex.GPU] != tc.wantBlock {
				t.Fatalf("%s; blocks %v, want %d (stale %d)", st, idx.Blocks("w"), tc.wantBlock, tc.wantStale)
			}
		})
	}
}
