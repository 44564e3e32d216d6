package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Errors returned by Publisher.
var (
	// ErrQueueFull: Publish found the send queue full and dropped the batch (counted in
	// PublisherStats.Dropped).
	ErrQueueFull = errors.New("kv event queue full")
	// ErrClosed: the publisher was closed.
	ErrClosed = errors.New("kv event publisher closed")
	// ErrStarted: Start was called twice.
	ErrStarted = errors.New("kv event publisher already started")
)

// endSeq is the sequence number that ends a replay answer: -1 as a signed 64-bit big-endian
// integer, as vLLM sends it.
var endSeq = [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Defaults of PublisherConfig, the same as vLLM's KVEventsConfig where it has one.
const (
	DefaultEndpoint    = "tcp://*:5557"
	DefaultBufferSteps = 10_000
	DefaultQueueSize   = 10_000
	DefaultHWM         = 100_000
)

// PublisherConfig configures a Publisher. The zero value of every field means its default.
type PublisherConfig struct {
	// Endpoint is the ZMQ endpoint of the PUB socket, e.g. "tcp://*:5557" (the default) or
	// "tcp://127.0.0.1:0" for a free port (read it back with Publisher.Endpoint).
	Endpoint string
	// Connect makes the PUB socket dial Endpoint, for subscribers that bind, instead of
	// binding it (the default, and what vLLM does with its default wildcard endpoint).
	// The dial is retried in the background until it succeeds or the publisher closes, and
	// redone when the connection drops.
	Connect bool
	// ReplayEndpoint, when set, is bound to a ROUTER socket that answers replay requests
	// (see Replay). vLLM's conventional value is "tcp://*:5558".
	ReplayEndpoint string
	// Topic is the first frame of every message; subscribers filter on its prefix. vLLM's
	// default is "" (its example subscriber uses "kv-events").
	Topic string
	// Format selects how events are encoded (FormatMap, the default, or FormatArray).
	Format Format
	// BufferSteps is how many of the most recent batches the replay socket can resend
	// (vLLM's buffer_steps). Default DefaultBufferSteps.
	BufferSteps int
	// QueueSize bounds the batches waiting between Publish and the sender goroutine; a
	// Publish that finds it full drops the batch. Default DefaultQueueSize.
	QueueSize int
	// HWM bounds the messages the ZMQ PUB socket itself queues for its subscribers (vLLM's
	// hwm). Messages beyond it are dropped by the socket without being counted. Default
	// DefaultHWM.
	HWM int
	// DataParallelRank is stamped on batches that carry no rank (vLLM stamps its own rank).
	DataParallelRank int
	// Logger receives the ZMQ library's own diagnostics; nil discards them.
	Logger *log.Logger
}

func (c *PublisherConfig) setDefaults() {
	if c.Endpoint == "" {
		c.Endpoint = DefaultEndpoint
	}
	if c.BufferSteps == 0 {
		c.BufferSteps = DefaultBufferSteps
	}
	if c.QueueSize == 0 {
		c.QueueSize = DefaultQueueSize
	}
	if c.HWM == 0 {
		c.HWM = DefaultHWM
	}
}

// Validate reports the first problem with c after defaults are applied.
func (c PublisherConfig) Validate() error {
	c.setDefaults()
	if err := validEndpoint(c.Endpoint); err != nil {
		return fmt.Errorf("validating kv event endpoint: %w", err)
	}
	if c.ReplayEndpoint != "" {
		if err := validEndpoint(c.ReplayEndpoint); err != nil {
			return fmt.Errorf("validating kv event replay endpoint: %w", err)
		}
	}
	if c.Format != FormatMap && c.Format != FormatArray {
		return fmt.Errorf("validating kv event format: unknown format %d", c.Format)
	}
	if c.BufferSteps < 0 || c.QueueSize < 0 || c.HWM < 0 {
		return errors.New("validating kv event publisher: sizes must not be negative")
	}
	return nil
}

func validEndpoint(ep string) error {
	scheme, rest, ok := strings.Cut(ep, "://")
	if !ok || rest == "" {
		return fmt.Errorf("endpoint %q is not transport://address", ep)
	}
	switch scheme {
	case "tcp", "ipc", "inproc":
		return nil
	}
	return fmt.Errorf("endpoint %q: unsupported transport %q", ep, scheme)
}

// PublisherStats are a Publisher's counters since it was created.
type PublisherStats struct {
	// Published counts batches accepted by Publish.
	Published uint64
	// Dropped counts batches Publish dropped because the queue was full.
	Dropped uint64
	// Sent counts batches handed to the PUB socket; the last one has sequence Sent-1.
	Sent uint64
	// SendErrors counts batches the PUB socket refused (they still got a sequence number
	// and are kept for replay).
	SendErrors uint64
	// Bytes counts encoded payload bytes accepted by Publish.
	Bytes uint64
	// Replays counts replay requests answered; ReplayedBatches the batches resent;
	// BadReplayRequests the requests that were not an 8-byte start sequence.
	Replays           uint64
	ReplayedBatches   uint64
	BadReplayRequests uint64
}

// Publisher publishes KV event batches over ZMQ the way vLLM's ZmqEventPublisher does: a PUB
// socket sending [topic, seq (8 bytes big-endian), msgpack(batch)] with seq counting from 0
// without gaps, and an optional ROUTER socket that resends the most recent batches on request.
//
// Lifecycle: NewPublisher has no side effects; Start binds (or starts dialling) and starts
// the goroutines; Close stops them and closes the sockets, and is safe to call at any time,
// also after a failed Start or without Start, and more than once.
//
// Publish, Stats, Endpoint, ReplayEndpoint and HasSubscribers are safe for concurrent use.
// The engine's scheduler calls Publish on its own goroutine once per step; Publish encodes
// the batch and enqueues it without waiting for the network. One sender goroutine numbers and
// sends the batches; one replay goroutine (when configured) answers replay requests; one
// dial goroutine (in Connect mode) connects. All three are owned by the Publisher and end in
// Close.
type Publisher struct {
	cfg   PublisherConfig
	topic []byte

	mu      sync.Mutex // guards scratch, tmp, closed, and sends on queue
	scratch []byte
	tmp     Batch
	closed  bool
	queue   chan []byte // 8 bytes reserved for seq, then the payload

	// life guards the lifecycle fields below; Start and Close hold it throughout.
	life     sync.RWMutex
	state    lifeState
	ctx      context.Context
	cancel   context.CancelFunc
	pub      zmq4.Socket
	router   zmq4.Socket
	sending  bool          // the sender goroutine was started
	sendDone chan struct{} // closed by the sender once the closed queue is drained
	endpoint atomic.Pointer[string]
	replayEP atomic.Pointer[string]
	wg       sync.WaitGroup // sender, replay server, dialler

	ringMu sync.Mutex
	ring   []ringEntry
	ringAt int    // index of the oldest entry when full
	nextSq uint64 // the next batch's sequence number (under mu)

	published, dropped, sent, sendErrors, bytes atomic.Uint64
	replays, replayed, badReplays               atomic.Uint64
}

type lifeState uint8

const (
	stateNew lifeState = iota
	stateStarted
	stateFailed
	stateClosed
)

type ringEntry struct {
	seq uint64
	buf []byte // seq frame then payload, immutable once sent
}

// NewPublisher validates cfg, fills in defaults and returns a Publisher that is not started.
// It opens no socket and starts no goroutine.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	p := &Publisher{
		cfg:   cfg,
		topic: []byte(cfg.Topic),
		queue: make(chan []byte, cfg.QueueSize),
	}
	ep := cfg.Endpoint
	p.endpoint.Store(&ep)
	rep := cfg.ReplayEndpoint
	p.replayEP.Store(&rep)
	return p, nil
}

// Start binds the PUB socket (or starts dialling it in Connect mode) and the replay socket,
// and starts the sender. Batches published before Start are sent once it runs. ctx bounds
// Start only; the publisher runs until Close. On error every socket opened so far is closed
// and the publisher can only be closed.
func (p *Publisher) Start(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("starting kv event publisher: %w", err)
	}
	p.life.Lock()
	defer p.life.Unlock()
	switch p.state {
	case stateClosed:
		return ErrClosed
	case stateStarted, stateFailed:
		return ErrStarted
	}
	if err := p.open(); err != nil {
		p.state = stateFailed
		p.closeSockets()
		return err
	}
	p.state = stateStarted
	p.sending = true
	p.sendDone = make(chan struct{})
	p.wg.Add(1)
	go p.send()
	return nil
}

// open creates and binds the sockets and starts the replay server and dialler. Called with
// life held; on error the caller closes whatever was opened.
func (p *Publisher) open() error {
	logger := p.cfg.Logger
	if logger == nil {
		logger = log.New(io.Discard, "", 0)
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.pub = zmq4.NewPub(p.ctx, zmq4.WithLogger(logger),
		zmq4.WithAutomaticReconnect(p.cfg.Connect),
		zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(200*time.Millisecond))
	if err := p.pub.SetOption(zmq4.OptionHWM, p.cfg.HWM); err != nil {
		return fmt.Errorf("setting kv event pub hwm: %w", err)
	}
	if p.cfg.Connect {
		p.wg.Add(1)
		go p.dial()
	} else {
		if err := p.pub.Listen(p.cfg.Endpoint); err != nil {
			return fmt.Errorf("binding kv event pub %s: %w", p.cfg.Endpoint, err)
		}
		ep := resolvedEndpoint(p.cfg.Endpoint, p.pub)
		p.endpoint.Store(&ep)
	}
	if p.cfg.ReplayEndpoint != "" {
		p.router = zmq4.NewRouter(p.ctx, zmq4.WithLogger(logger))
		if err := p.router.Listen(p.cfg.ReplayEndpoint); err != nil {
			return fmt.Errorf("binding kv event replay %s: %w", p.cfg.ReplayEndpoint, err)
		}
		ep := resolvedEndpoint(p.cfg.ReplayEndpoint, p.router)
		p.replayEP.Store(&ep)
		p.wg.Add(1)
		go p.serveReplay()
	}
	return nil
}

// dial connects the PUB socket in Connect mode. zmq4 retries until the publisher's context
// ends, and redials on its own when the connection drops (WithAutomaticReconnect).
func (p *Publisher) dial() {
	defer p.wg.Done()
	_ = p.pub.Dial(p.cfg.Endpoint) // fails only once Close cancelled the context
}

// resolvedEndpoint replaces a wildcard or zero port by the address the socket is bound to,
// so that "tcp://127.0.0.1:0" reads back as the port the kernel chose.
func resolvedEndpoint(ep string, s zmq4.Socket) string {
	scheme, _, _ := strings.Cut(ep, "://")
	if scheme != "tcp" || s.Addr() == nil {
		return ep
	}
	return "tcp://" + s.Addr().String()
}

// Publish encodes b and queues it for sending. It never blocks on the network: when the
// queue is full the batch is dropped, counted, and ErrQueueFull returned. A batch without a
// data-parallel rank is sent with the configured one, and a zero TS is replaced by the current
// time; b itself is not modified or retained, so the caller may reuse it at once. Publish
// allocates one buffer per batch (the encoded bytes, which the replay ring keeps).
func (p *Publisher) Publish(b *Batch) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	p.tmp = *b
	if !p.tmp.HasDPRank {
		p.tmp.DPRank, p.tmp.HasDPRank = p.cfg.DataParallelRank, true
	}
	if p.tmp.TS == 0 {
		p.tmp.TS = float64(time.Now().UnixNano()) / 1e9
	}
	p.scratch = AppendBatch(p.scratch[:0], &p.tmp, p.cfg.Format)
	p.tmp = Batch{}
	buf := make([]byte, 8+len(p.scratch))
	copy(buf[8:], p.scratch)
	// Numbered here, as the batch is produced (vLLM numbers its batches so too): a batch
	// dropped for a full queue leaves a gap subscribers see, and replay cannot fill.
	binary.BigEndian.PutUint64(buf[:8], p.nextSq)
	p.nextSq++
	select {
	case p.queue <- buf:
		p.published.Add(1)
		p.bytes.Add(uint64(len(p.scratch)))
		return nil
	default:
		p.dropped.Add(1)
		return ErrQueueFull
	}
}

// send is the sender goroutine: it hands queued batches to the PUB socket and keeps them for
// replay, until Close closes the queue and it is drained.
func (p *Publisher) send() {
	defer p.wg.Done()
	defer close(p.sendDone)
	for buf := range p.queue {
		seq := binary.BigEndian.Uint64(buf[:8])
		// zmq4 queues the message and writes it later from its own goroutine, so the
		// frames must stay untouched: buf is never written again.
		msg := zmq4.NewMsgFrom(p.topic, buf[:8:8], buf[8:])
		if err := p.pub.SendMulti(msg); err != nil {
			p.sendErrors.Add(1)
		}
		p.sent.Add(1)
		if p.cfg.BufferSteps > 0 {
			p.ringMu.Lock()
			if len(p.ring) < p.cfg.BufferSteps {
				p.ring = append(p.ring, ringEntry{seq: seq, buf: buf})
			} else {
				p.ring[p.ringAt] = ringEntry{seq: seq, buf: buf}
				p.ringAt = (p.ringAt + 1) % len(p.ring)
			}
			p.ringMu.Unlock()
		}
	}
}

// tail returns the buffered batches with seq >= from, oldest first.
func (p *Publisher) tail(from uint64) []ringEntry {
	p.ringMu.Lock()
	defer p.ringMu.Unlock()
	var out []ringEntry
	n := len(p.ring)
	for i := range n {
		e := p.ring[(p.ringAt+i)%n]
		if e.seq >= from {
			out = append(out, e)
		}
	}
	return out
}

// serveReplay answers replay requests on the ROUTER socket until Close. A request is
// [identity, "", start seq (8 bytes big-endian)] from a REQ or DEALER that frames like REQ
// (vLLM's protocol), or [identity, start seq] from a bare DEALER. The answer is one message
// per buffered batch with seq >= start, [identity, "", topic, seq, payload], then
// [identity, "", "", -1, ""], as vLLM answers since mid-2026; to a bare DEALER it is
// [identity, seq, payload] and [identity, -1, ""], with neither delimiter nor topic.
func (p *Publisher) serveReplay() {
	defer p.wg.Done()
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			// A client connection ended; zmq4 reports it as a receive error.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		fr := msg.Frames
		var id, start []byte
		delim := false
		switch {
		case len(fr) == 3 && len(fr[1]) == 0 && len(fr[2]) == 8:
			id, start, delim = fr[0], fr[2], true
		case len(fr) == 2 && len(fr[1]) == 8:
			id, start = fr[0], fr[1]
		default:
			p.badReplays.Add(1)
			continue
		}
		p.replays.Add(1)
		for _, e := range p.tail(binary.BigEndian.Uint64(start)) {
			if err := p.router.Send(replyMsg(id, delim, p.topic, e.buf[:8:8], e.buf[8:])); err != nil {
				break
			}
			p.replayed.Add(1)
		}
		_ = p.router.Send(replyMsg(id, delim, []byte{}, endSeq[:], []byte{}))
	}
}

func replyMsg(id []byte, delim bool, topic, seq, payload []byte) zmq4.Msg {
	if delim {
		return zmq4.NewMsgFrom(id, []byte{}, topic, seq, payload)
	}
	return zmq4.NewMsgFrom(id, seq, payload)
}

// Stats returns the publisher's counters.
func (p *Publisher) Stats() PublisherStats {
	return PublisherStats{
		Published:         p.published.Load(),
		Dropped:           p.dropped.Load(),
		Sent:              p.sent.Load(),
		SendErrors:        p.sendErrors.Load(),
		Bytes:             p.bytes.Load(),
		Replays:           p.replays.Load(),
		ReplayedBatches:   p.replayed.Load(),
		BadReplayRequests: p.badReplays.Load(),
	}
}

// Endpoint returns the PUB endpoint; after a successful Start in bind mode a zero port or
// wildcard address is replaced by the address actually bound.
func (p *Publisher) Endpoint() string { return *p.endpoint.Load() }

// ReplayEndpoint returns the replay endpoint ("" when none), resolved like Endpoint.
func (p *Publisher) ReplayEndpoint() string { return *p.replayEP.Load() }

// HasSubscribers reports whether at least one connected subscriber has subscribed to a prefix
// of the topic. PUB sockets drop messages for which no subscription has arrived yet (the "slow
// joiner"), so a caller that must not lose the first batches waits for this first.
func (p *Publisher) HasSubscribers() bool {
	p.life.RLock()
	defer p.life.RUnlock()
	if p.state != stateStarted {
		return false
	}
	t, ok := p.pub.(zmq4.Topics)
	if !ok {
		return false
	}
	for _, s := range t.Topics() {
		if strings.HasPrefix(p.cfg.Topic, s) {
			return true
		}
	}
	return false
}

// Close stops accepting batches, hands every queued batch to the PUB socket, then closes the
// sockets and waits for the publisher's goroutines. Like vLLM (linger 0) it does not wait for
// messages still in the socket's own queue to reach subscribers. Close is safe to call more
// than once, without Start, and after a failed Start.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.queue)
	}
	p.mu.Unlock()

	p.life.Lock()
	defer p.life.Unlock()
	if p.state == stateClosed {
		return nil
	}
	wasStarted := p.state == stateStarted
	p.state = stateClosed
	if !wasStarted {
		return nil // never started, or Start failed and closed its sockets
	}
	if p.sending {
		// Let the sender drain the queue into the still-open PUB socket. SendMulti only
		// queues inside zmq4, so this does not wait for the network.
		<-p.sendDone
	}
	p.closeSockets()
	p.wg.Wait()
	return nil
}

func (p *Publisher) closeSockets() {
	if p.cancel != nil {
		p.cancel()
	}
	if p.pub != nil {
		_ = p.pub.Close()
	}
	if p.router != nil {
		_ = p.router.Close()
	}
}

var _ io.Closer = (*Publisher)(nil)
