package main

import (
	"context"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
	"github.com/kvrelay/kvrelay/engines/kvevents"
)

// synthWorker is a fake engine: an HTTP server that serves the simulated engine's metrics
// with a load that moves on every scrape (metrics.go) and answers every other path with an
// empty 200 (the control plane's health probe), and a real KV event publisher (ZMQ
// PUB, vLLM's map-encoded msgpack) emitting BlockStored events for fresh blocks, each 16
// random tokens chained on the previous block of one of its prompts, and BlockRemoved events
// for whole old prompts once it holds more than its share of -max-blocks.
//
// Because the control plane recomputes kvrelay's sequence hash from each event's token ids
// (kvindex: local = XXH3(tokens), seq = Chain(parent seq, local), a first block's seq is its
// local hash), the publisher computes the same hash and knows which index entry each event
// will produce: it records the publish time of the sampled ones (seq & mask == 0).
type synthWorker struct {
	id  string
	pub *kvevents.Publisher
	srv *http.Server
	url string

	rng     *rand.Rand
	hasher  blockhash.Hasher
	salt    uint64
	counter uint64
	active  []*chain
	retired []*chain
	next    int // round robin over active chains
	live    int
	cap     int
	mask    uint64

	recs             []pubRec
	stored, removed  uint64 // block events published
	messages, failed uint64 // messages published, messages the publisher dropped
	tokens           []uint32
	hashes           []kvevents.Hash
	events           []kvevents.Event
}

// chain is one prompt being stored block by block.
type chain struct {
	engine  []uint64 // the engine hashes of its blocks
	lastSeq uint64
}

// pubRec is the publish time of one sampled block.
type pubRec struct {
	seq uint64
	at  int64 // unix nanos
}

const (
	synthBlockSize = 16
	chainBlocks    = 64 // blocks per prompt (1024 tokens)
	activeChains   = 16 // prompts being extended at once per worker
)

func newSynthWorker(i int, model string, capBlocks int, mask uint64) (*synthWorker, error) {
	page, err := expositionFor(model, capBlocks)
	if err != nil {
		return nil, err
	}
	w := &synthWorker{
		id:   "w" + strconv.Itoa(i),
		rng:  rand.New(rand.NewPCG(uint64(i)+1, 0x5eed)),
		salt: uint64(i+1) << 48,
		cap:  capBlocks,
		mask: mask,
	}
	pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://" + engineHost(i) + ":0"})
	if err != nil {
		return nil, err
	}
	if err := pub.Start(context.Background()); err != nil {
		return nil, err
	}
	w.pub = pub
	ln, err := net.Listen("tcp", engineHost(i)+":0")
	if err != nil {
		pub.Close()
		return nil, err
	}
	load := &engineLoad{rng: rand.New(rand.NewPCG(uint64(i)+1, 0x10ad)), maxRunning: 16}
	w.srv = &http.Server{Handler: metricsHandler(page, load)}
	go func() { _ = w.srv.Serve(ln) }()
	w.url = "http://" + ln.Addr().String()
	for range activeChains {
		w.active = append(w.active, &chain{})
	}
	return w, nil
}

func (w *synthWorker) close() {
	_ = w.pub.Close()
	_ = w.srv.Close()
}

// engineHost is the loopback address engine i listens on: one of 127.0.2.0/24 and on, 1,000
// engines to each, so that the engines' two listeners apiece do not take the ports of
// 127.0.0.1, where the replicas' APIs and xDS listen (10,000 engines would take 20,000 of the
// 28,000 ephemeral ports there).
func engineHost(i int) string {
	return net.IPv4(127, 0, byte(2+i/1000/250), byte(1+i/1000%250)).String()
}

// engineHash returns a fresh engine block hash, unique across workers.
func (w *synthWorker) engineHash() uint64 {
	w.counter++
	x := w.salt ^ w.counter
	// splitmix64, so that the hashes look like vLLM's (often above 2^63).
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// publish sends one message of n BlockStored events (plus any BlockRemoved events needed
// to stay under the cap) and records the sampled blocks' publish time.
func (w *synthWorker) publish(n int) {
	w.events = w.events[:0]
	if cap(w.tokens) < n*synthBlockSize {
		w.tokens = make([]uint32, n*synthBlockSize)
		w.hashes = make([]kvevents.Hash, n)
	}
	firstRec := len(w.recs)
	for i := range n {
		c := w.active[w.next]
		w.next = (w.next + 1) % len(w.active)
		toks := w.tokens[i*synthBlockSize : (i+1)*synthBlockSize]
		for j := range toks {
			toks[j] = uint32(w.rng.IntN(200000))
		}
		local := w.hasher.Local(toks, nil)
		seq := local
		ev := kvevents.Event{Kind: kvevents.BlockStored, TokenIDs: toks, BlockSize: synthBlockSize, Medium: "GPU"}
		if len(c.engine) > 0 {
			seq = blockhash.Chain(c.lastSeq, local)
			ev.Parent, ev.HasParent = kvevents.HashU64(c.engine[len(c.engine)-1]), true
		}
		h := w.engineHash()
		w.hashes[i] = kvevents.HashU64(h)
		ev.BlockHashes = w.hashes[i : i+1]
		w.events = append(w.events, ev)
		c.engine = append(c.engine, h)
		c.lastSeq = seq
		w.live++
		if seq&w.mask == 0 {
			w.recs = append(w.recs, pubRec{seq: seq})
		}
		if len(c.engine) == chainBlocks {
			w.retired = append(w.retired, c)
			for k, a := range w.active {
				if a == c {
					w.active[k] = &chain{}
				}
			}
		}
	}
	removed := 0
	for w.live > w.cap && len(w.retired) > 0 {
		old := w.retired[0]
		w.retired = w.retired[1:]
		hs := make([]kvevents.Hash, len(old.engine))
		for k, h := range old.engine {
			hs[k] = kvevents.HashU64(h)
		}
		w.events = append(w.events, kvevents.Event{Kind: kvevents.BlockRemoved, BlockHashes: hs, Medium: "GPU"})
		w.live -= len(old.engine)
		removed += len(old.engine)
	}
	now := time.Now().UnixNano()
	for k := firstRec; k < len(w.recs); k++ {
		w.recs[k].at = now
	}
	if err := w.pub.Publish(&kvevents.Batch{TS: float64(now) / 1e9, Events: w.events}); err != nil {
		w.failed++
		w.recs = w.recs[:firstRec] // never sent: not counted as lost downstream
		return
	}
	w.messages++
	w.stored += uint64(n)
	w.removed += uint64(removed)
}

// run publishes perSecond BlockStored events a second until ctx ends, in messages of
// batch events each.
func (w *synthWorker) run(ctx context.Context, perSecond float64, batch int) {
	start := time.Now()
	emitted := 0
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		// Whole messages of batch events, like an engine step's events.
		due := int(time.Since(start).Seconds() * perSecond)
		for emitted+batch <= due {
			w.publish(batch)
			emitted += batch
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// runSynth runs every worker's publisher for d.
func runSynth(ws []*synthWorker, rate float64, batch int, d time.Duration) time.Duration {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var wg sync.WaitGroup
	t0 := time.Now()
	for _, w := range ws {
		wg.Add(1)
		go func() { defer wg.Done(); w.run(ctx, rate/float64(len(ws)), batch) }()
	}
	wg.Wait()
	return time.Since(t0)
}
