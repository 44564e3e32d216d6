package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// waitFor polls cond until it holds or the test's deadline passes.
func waitFor(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// recorder collects what a Subscriber emits; emit copies, since the batch is reused.
type recorder struct {
	mu      sync.Mutex
	seqs    []uint64
	batches []any
	t       *testing.T
}

func (r *recorder) emit(seq uint64, b *Batch) {
	c := canonical(r.t, b)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seqs = append(r.seqs, seq)
	r.batches = append(r.batches, c)
}

func (r *recorder) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.seqs)
}

// runSubscriber starts s.Run on its own goroutine and returns a stop function that cancels
// it and waits for Run to return.
func runSubscriber(t *testing.T, ctx context.Context, s *Subscriber, rec *recorder) (stop func()) {
	t.Helper()
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Run(sctx, rec.emit) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Subscriber.Run: %v", err)
		}
	}
}

func testBatch(i int) *Batch {
	h := HashU64(1<<63 + uint64(i))
	return &Batch{TS: float64(1000 + i), Events: []Event{
		{Kind: BlockStored, BlockHashes: []Hash{h}, TokenIDs: []uint32{uint32(i), 2, 3, 4},
			BlockSize: 4, Medium: "GPU", HasParent: i > 0, Parent: HashU64(uint64(i))},
		{Kind: BlockRemoved, BlockHashes: []Hash{HashU64(uint64(i))}, Medium: "GPU"},
	}}
}

func TestPubSub(t *testing.T) {
	tests := []struct {
		name    string
		format  Format
		topic   string
		connect bool // the publisher dials a subscriber that binds
	}{
		{"map, publisher binds", FormatMap, "", false},
		{"array, topic, publisher binds", FormatArray, "kv-events", false},
		{"map, topic, subscriber binds", FormatMap, "kv-events", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			rec := &recorder{t: t}
			var pub *Publisher
			var stop func()
			if tc.connect {
				sub, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, Topic: tc.topic})
				if err != nil {
					t.Fatal(err)
				}
				stop = runSubscriber(t, ctx, sub, rec)
				<-sub.Ready()
				pub = startPublisher(t, ctx, PublisherConfig{Endpoint: sub.Endpoint(), Connect: true,
					Topic: tc.topic, Format: tc.format})
			} else {
				pub = startPublisher(t, ctx, PublisherConfig{Endpoint: "tcp://127.0.0.1:0",
					Topic: tc.topic, Format: tc.format})
				sub, err := NewSubscriber(SubscriberConfig{Endpoint: pub.Endpoint(), Topic: tc.topic})
				if err != nil {
					t.Fatal(err)
				}
				stop = runSubscriber(t, ctx, sub, rec)
			}
			defer stop()
			// The slow joiner: a PUB drops what it sends before the subscription arrives.
			waitFor(t, ctx, "the subscription", pub.HasSubscribers)

			const n = 20
			var want []any
			for i := range n {
				b := testBatch(i)
				if err := pub.Publish(b); err != nil {
					t.Fatal(err)
				}
				b.HasDPRank = true
				want = append(want, canonical(t, b))
			}
			waitFor(t, ctx, fmt.Sprintf("%d batches", n), func() bool { return rec.len() >= n })
			rec.mu.Lock()
			defer rec.mu.Unlock()
			for i, seq := range rec.seqs {
				if seq != uint64(i) {
					t.Fatalf("seqs %v are not 0..%d", rec.seqs, n-1)
				}
			}
			if !reflect.DeepEqual(rec.batches, want) {
				t.Fatalf("received\n%v\nwant\n%v", rec.batches, want)
			}
		})
	}
}

func startPublisher(t *testing.T, ctx context.Context, cfg PublisherConfig) *Publisher {
	t.Helper()
	pub, err := NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pub.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return pub
}

func TestReplay(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pub := startPublisher(t, ctx, PublisherConfig{Endpoint: "tcp://127.0.0.1:0",
		ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 5})
	const n = 8
	want := map[uint64]any{}
	for i := range n {
		b := testBatch(i)
		if err := pub.Publish(b); err != nil {
			t.Fatal(err)
		}
		b.HasDPRank = true
		want[uint64(i)] = canonical(t, b)
	}
	waitFor(t, ctx, "the sender", func() bool { return pub.Stats().Sent == n })

	tests := []struct {
		name string
		from uint64
		want []uint64
	}{
		{"tail from inside the buffer", 6, []uint64{6, 7}},
		{"from before the buffer returns what is kept", 0, []uint64{3, 4, 5, 6, 7}},
		{"from the last", 7, []uint64{7}},
		{"from the future", 100, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Replay(ctx, pub.ReplayEndpoint(), tc.from)
			if err != nil {
				t.Fatal(err)
			}
			var seqs []uint64
			for _, r := range got {
				seqs = append(seqs, r.Seq)
				if c := canonical(t, &r.Batch); !reflect.DeepEqual(c, want[r.Seq]) {
					t.Fatalf("batch %d\n got %v\nwant %v", r.Seq, c, want[r.Seq])
				}
			}
			if !reflect.DeepEqual(seqs, tc.want) {
				t.Fatalf("seqs %v, want %v", seqs, tc.want)
			}
		})
	}
	if st := pub.Stats(); st.Replays != uint64(len(tests)) || st.ReplayedBatches != 8 {
		t.Fatalf("stats %+v", st)
	}
}

func TestPublisherLifecycle(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"close without start", func(t *testing.T) {
			p, _ := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if err := p.Start(ctx); !errors.Is(err, ErrClosed) {
				t.Fatalf("Start after Close: %v", err)
			}
			if err := p.Publish(testBatch(0)); !errors.Is(err, ErrClosed) {
				t.Fatalf("Publish after Close: %v", err)
			}
		}},
		{"close twice after start", func(t *testing.T) {
			p, _ := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
			if err := p.Start(ctx); err != nil {
				t.Fatal(err)
			}
			if err := p.Start(ctx); !errors.Is(err, ErrStarted) {
				t.Fatalf("second Start: %v", err)
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
		}},
		{"close after a failed start", func(t *testing.T) {
			taken := startPublisher(t, ctx, PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
			p, _ := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: taken.Endpoint()})
			if err := p.Start(ctx); err == nil {
				t.Fatal("Start on a taken port succeeded")
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
		}},
		{"full queue drops and counts", func(t *testing.T) {
			p, _ := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0", QueueSize: 4})
			defer p.Close()
			for i := range 4 {
				if err := p.Publish(testBatch(i)); err != nil {
					t.Fatal(err)
				}
			}
			if err := p.Publish(testBatch(4)); !errors.Is(err, ErrQueueFull) {
				t.Fatalf("fifth Publish: %v", err)
			}
			if st := p.Stats(); st.Published != 4 || st.Dropped != 1 {
				t.Fatalf("stats %+v", st)
			}
		}},
		{"start with a cancelled context", func(t *testing.T) {
			p, _ := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
			defer p.Close()
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			if err := p.Start(cctx); !errors.Is(err, context.Canceled) {
				t.Fatalf("Start: %v", err)
			}
		}},
		{"invalid configs", func(t *testing.T) {
			for _, cfg := range []PublisherConfig{
				{Endpoint: "127.0.0.1:5557"},
				{Endpoint: "udp://127.0.0.1:5557"},
				{ReplayEndpoint: "nope"},
				{Format: 7},
				{QueueSize: -1},
			} {
				if _, err := NewPublisher(cfg); err == nil {
					t.Errorf("NewPublisher(%+v) accepted", cfg)
				}
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, tc.run)
	}
}

// TestSubscriberCounts feeds a Subscriber hand-made frames from a bare zmq4 PUB.
func TestSubscriberCounts(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://" + pub.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{t: t}
	stop := runSubscriber(t, ctx, sub, rec)
	defer stop()
	waitFor(t, ctx, "the subscription", func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 })

	seq := func(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }
	good := AppendBatch(nil, testBatch(1), FormatMap)
	frames := [][][]byte{
		{[]byte(""), seq(0), good},
		{[]byte(""), good},                  // two frames
		{[]byte(""), seq(1)[:7], good},      // short seq
		{[]byte(""), seq(1), []byte{0xc1}},  // payload is not msgpack
		{[]byte(""), seq(1), good, good},    // four frames
		{[]byte(""), seq(3), good},          // gap: 1 and 2 missing
		{[]byte(""), seq(0), good},          // restart
		{[]byte("other"), seq(1), []byte{}}, // still delivered: subscribed to ""
		// A second publisher's topic interleaved: its own sequence, neither a gap nor a
		// restart of the first.
		{[]byte("kv@b"), seq(7), good},
		{[]byte(""), seq(1), good},
		{[]byte("kv@b"), seq(8), good},
	}
	for _, f := range frames {
		if err := pub.SendMulti(zmq4.NewMsgFrom(f...)); err != nil {
			t.Fatal(err)
		}
	}
	want := SubscriberStats{Batches: 6, Events: 12, Malformed: 5, Gaps: 1, Missed: 2, Restarts: 1, Topics: 2}
	waitFor(t, ctx, "all frames", func() bool {
		st := sub.Stats()
		return st.Batches+st.Malformed == want.Batches+want.Malformed
	})
	if st := sub.Stats(); st != want {
		t.Fatalf("stats %v, want %v", st, want)
	}
}

// TestSubscriberRedials restarts the publisher on the same port: the subscriber reconnects and
// reports the restart through seq going back to 0.
func TestSubscriberRedials(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first, err := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Start(ctx); err != nil {
		t.Fatal(err)
	}
	ep := first.Endpoint()
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: ep, RetryInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{t: t}
	stop := runSubscriber(t, ctx, sub, rec)
	defer stop()
	waitFor(t, ctx, "the first subscription", first.HasSubscribers)
	for i := range 3 {
		if err := first.Publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, ctx, "3 batches", func() bool { return rec.len() == 3 })
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}

	second := startPublisher(t, ctx, PublisherConfig{Endpoint: ep})
	waitFor(t, ctx, "the subscriber to redial", second.HasSubscribers)
	if err := second.Publish(testBatch(9)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ctx, "the fourth batch", func() bool { return rec.len() == 4 })
	if st := sub.Stats(); st.Restarts != 1 || st.Disconnects == 0 {
		t.Fatalf("stats %v", st)
	}
}

func TestSubscriberRunTwice(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sub, err := NewSubscriber(SubscriberConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{t: t}
	stop := runSubscriber(t, ctx, sub, rec)
	<-sub.Ready()
	if err := sub.Run(ctx, rec.emit); !errors.Is(err, ErrRunning) {
		t.Fatalf("second Run: %v", err)
	}
	stop()
	if _, err := NewSubscriber(SubscriberConfig{Endpoint: "localhost"}); err == nil {
		t.Fatal("NewSubscriber accepted an endpoint without transport")
	}
}

func TestReplayUnreachable(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	// Port 1 on loopback refuses connections.
	if _, err := Replay(ctx, "tcp://127.0.0.1:1", 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Replay: %v", err)
	}
}

// TestSubscriberLeavesNoReaders stops subscribers while messages are in flight: zmq4's
// connection readers must not stay blocked on the receive queue (Run drains it).
func TestSubscriberLeavesNoReaders(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pub := startPublisher(t, ctx, PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
	for range 3 {
		sub, err := NewSubscriber(SubscriberConfig{Endpoint: pub.Endpoint()})
		if err != nil {
			t.Fatal(err)
		}
		sctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- sub.Run(sctx, func(uint64, *Batch) { time.Sleep(time.Millisecond) }) }()
		waitFor(t, ctx, "the subscription", pub.HasSubscribers)
		for i := range 200 {
			_ = pub.Publish(testBatch(i))
		}
		waitFor(t, ctx, "the first batches", func() bool { return sub.Stats().Batches > 5 })
		stop()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		waitFor(t, ctx, "the subscription to go", func() bool { return !pub.HasSubscribers() })
	}
	waitFor(t, ctx, "zmq4's readers to exit", func() bool {
		buf := make([]byte, 1<<20)
		return !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "zmq4.(*qreader).listen")
	})
}
