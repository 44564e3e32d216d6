package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// ErrRunning is returned by Subscriber.Run when the subscriber is already running.
var ErrRunning = errors.New("kv event subscriber already running")

// DefaultRetryInterval is how long a Subscriber waits between attempts to dial its publisher.
const DefaultRetryInterval = 200 * time.Millisecond

// SubscriberConfig configures a Subscriber.
type SubscriberConfig struct {
	// Endpoint is the publisher's ZMQ endpoint, e.g. "tcp://10.0.0.7:5557"; with Bind, the
	// local endpoint to bind, e.g. "tcp://127.0.0.1:0".
	Endpoint string
	// Bind makes the subscriber bind Endpoint and wait for publishers that connect out
	// (engines configured with a non-wildcard endpoint, some simulators), instead of dialling
	// a publisher that binds (vLLM's default). Many publishers may connect to one bound
	// endpoint: sequence numbers are tracked per topic, and RunTopics hands each batch's
	// topic to the caller to tell them apart (llm-d's convention is kv@<host:port>@<model>).
	Bind bool
	// Topic is the subscription prefix; "" (the default) receives every topic.
	Topic string
	// RetryInterval is the wait between dial attempts, initially and after the connection
	// drops. Default DefaultRetryInterval.
	RetryInterval time.Duration
	// Logger receives the ZMQ library's own diagnostics; nil discards them.
	Logger *log.Logger
}

// SubscriberStats are a Subscriber's counters since it was created.
type SubscriberStats struct {
	// Batches counts batches handed to emit.
	Batches uint64
	// Events counts the events in them; SkippedEvents the events with unknown type tags
	// that were left out.
	Events        uint64
	SkippedEvents uint64
	// Malformed counts messages dropped because they were not [topic, 8-byte seq, batch] or
	// the batch did not decode.
	Malformed uint64
	// Gaps counts jumps forward in a topic's seq, and Missed the sequence numbers skipped by
	// them: batches the publisher sent that never arrived (replay them, or treat the
	// worker's index as stale).
	Gaps   uint64
	Missed uint64
	// Restarts counts a topic's seq going backwards or repeating, which means the publisher
	// restarted (its blocks are gone).
	Restarts uint64
	// Topics counts the distinct topics seen (sequence numbers are tracked for the first
	// maxTopics of them).
	Topics uint64
	// Disconnects counts connections to publishers that ended.
	Disconnects uint64
}

// Subscriber receives KV event batches from a publisher over a ZMQ SUB socket. It is a
// Source in kvrelay's sense: Run owns the socket and one goroutine (the caller's) for as long
// as ctx lives. Stats, Endpoint and Ready are safe to call from any goroutine at any time.
type Subscriber struct {
	cfg SubscriberConfig

	running  atomic.Bool
	ready    chan struct{}
	readyOne sync.Once
	endpoint atomic.Pointer[string]

	batches, events, skipped, malformed atomic.Uint64
	gaps, missed, restarts, disconnects atomic.Uint64
	topics                              atomic.Uint64

	// Owned by Run's goroutine.
	seqs    map[string]uint64 // last seq per topic
	decoded Batch             // reused for every message
}

// maxTopics bounds the topics whose sequence numbers a Subscriber tracks, so that a peer
// inventing topics cannot grow its memory without end.
const maxTopics = 4096

// NewSubscriber validates cfg and returns a Subscriber. It opens no socket.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	if err := validEndpoint(cfg.Endpoint); err != nil {
		return nil, fmt.Errorf("validating kv event subscriber endpoint: %w", err)
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	s := &Subscriber{cfg: cfg, ready: make(chan struct{}), seqs: map[string]uint64{}}
	ep := cfg.Endpoint
	s.endpoint.Store(&ep)
	return s, nil
}

// Run connects (or binds) and calls emit for every batch received, in order, on the calling
// goroutine, until ctx is done; it then closes the socket and returns nil. It returns an error
// only when it cannot bind, or when called while already running. Malformed messages are
// counted and dropped. emit receives the batch's sequence number and a Batch that Run reuses
// for the next message: emit must not retain b or anything in it after returning (copy what
// it keeps). A slow emit delays reading; ZMQ then drops messages at the publisher's HWM, which
// shows up as a gap in seq.
//
// In dial mode Run retries the dial every RetryInterval until it succeeds and redials when the
// connection drops; messages published meanwhile are lost (they show as a gap).
func (s *Subscriber) Run(ctx context.Context, emit func(seq uint64, b *Batch)) error {
	if emit == nil {
		return errors.New("running kv event subscriber: nil emit")
	}
	return s.RunTopics(ctx, func(_ []byte, seq uint64, b *Batch) { emit(seq, b) })
}

// RunTopics is Run with each batch's topic handed to emit, for a bound endpoint that many
// publishers share. topic, like b, is only valid until emit returns.
func (s *Subscriber) RunTopics(ctx context.Context, emit func(topic []byte, seq uint64, b *Batch)) error {
	if emit == nil {
		return errors.New("running kv event subscriber: nil emit")
	}
	if !s.running.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer s.running.Store(false)

	logger := s.cfg.Logger
	if logger == nil {
		logger = log.New(io.Discard, "", 0)
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Each message's frames are read into pooled memory, given back once handled (handle
	// keeps nothing of them, and emit may not): a control plane following a fleet reads
	// thousands of small messages a second.
	sock := zmq4.NewSub(sctx, zmq4.WithLogger(logger), zmq4.WithRecvArenas(),
		zmq4.WithAutomaticReconnect(!s.cfg.Bind),
		zmq4.WithDialerMaxRetries(-1), zmq4.WithDialerRetry(s.cfg.RetryInterval))
	defer func() {
		cancel()
		_ = sock.Close()
		// zmq4's per-connection readers block forever handing a message to a full receive
		// queue that nobody reads any more. Once the socket is cancelled, Recv picks at
		// random between the cancellation and a queued message, so a bounded number of
		// calls empties the queue (ten messages deep) and lets them exit.
		for range 64 {
			_, _ = sock.Recv()
		}
	}()
	// Subscribe before connecting: zmq4 sends the stored subscriptions on every new
	// connection.
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		return fmt.Errorf("subscribing to kv events %q: %w", s.cfg.Topic, err)
	}
	if s.cfg.Bind {
		if err := sock.Listen(zmqEndpoint(s.cfg.Endpoint)); err != nil {
			return fmt.Errorf("binding kv event subscriber %s: %w", s.cfg.Endpoint, err)
		}
		ep := resolvedEndpoint(s.cfg.Endpoint, sock)
		s.endpoint.Store(&ep)
	} else if err := sock.Dial(zmqEndpoint(s.cfg.Endpoint)); err != nil {
		// zmq4 retries forever; Dial fails only once ctx is done.
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("dialling kv event publisher %s: %w", s.cfg.Endpoint, err)
	}
	s.readyOne.Do(func() { close(s.ready) })

	for {
		msg, err := sock.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// zmq4 reports the end of one connection as a receive error; in dial mode it
			// is already redialling. Back off briefly so a flapping peer cannot spin us.
			s.disconnects.Add(1)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		s.handle(msg.Frames, emit)
		msg.Release()
	}
}

func (s *Subscriber) handle(frames [][]byte, emit func([]byte, uint64, *Batch)) {
	if len(frames) != 3 || len(frames[1]) != 8 {
		s.malformed.Add(1)
		return
	}
	seq := binary.BigEndian.Uint64(frames[1])
	if err := DecodeBatchInto(&s.decoded, frames[2]); err != nil {
		s.malformed.Add(1)
		return
	}
	topic := frames[0]
	if last, ok := s.seqs[string(topic)]; ok {
		switch {
		case seq > last+1:
			s.gaps.Add(1)
			s.missed.Add(seq - last - 1)
		case seq <= last:
			s.restarts.Add(1)
		}
		s.seqs[string(topic)] = seq
	} else if len(s.seqs) < maxTopics {
		s.seqs[string(topic)] = seq
		s.topics.Add(1)
	}
	s.batches.Add(1)
	s.events.Add(uint64(len(s.decoded.Events)))
	s.skipped.Add(uint64(s.decoded.Skipped))
	emit(topic, seq, &s.decoded)
}

// Ready is closed once Run has bound its endpoint (Bind) or connected to its publisher.
func (s *Subscriber) Ready() <-chan struct{} { return s.ready }

// Endpoint returns the endpoint; in Bind mode, once Ready, a zero port or wildcard address
// is replaced by the address actually bound.
func (s *Subscriber) Endpoint() string { return *s.endpoint.Load() }

// Stats returns the subscriber's counters.
func (s *Subscriber) Stats() SubscriberStats {
	return SubscriberStats{
		Batches:       s.batches.Load(),
		Events:        s.events.Load(),
		SkippedEvents: s.skipped.Load(),
		Malformed:     s.malformed.Load(),
		Gaps:          s.gaps.Load(),
		Missed:        s.missed.Load(),
		Restarts:      s.restarts.Load(),
		Disconnects:   s.disconnects.Load(),
		Topics:        s.topics.Load(),
	}
}

// Replayed is one batch returned by Replay, with the publisher's topic when it sent one.
type Replayed struct {
	Seq   uint64
	Topic string
	Batch Batch
}

// Replay asks the publisher's replay (ROUTER) socket at endpoint for every buffered batch
// with seq >= from and returns them in order. It speaks vLLM's protocol from a DEALER socket:
// it sends ["", from as 8 bytes big-endian] and reads ["", topic, seq, payload] messages (vLLM
// since mid-2026) or ["", seq, payload] (earlier vLLM, SGLang) until the one whose seq is -1. The publisher keeps only its most recent batches, so the first
// returned seq may be above from; the caller compares and treats the difference as lost.
//
// Replay dials with a short retry and gives up when ctx ends; give ctx a deadline. A payload
// that does not decode ends the replay with an error wrapping ErrMalformed, returning the
// batches before it. Replay is safe for concurrent use.
func Replay(ctx context.Context, endpoint string, from uint64) ([]Replayed, error) {
	if err := validEndpoint(endpoint); err != nil {
		return nil, fmt.Errorf("replaying kv events: %w", err)
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sock := zmq4.NewDealer(rctx, zmq4.WithLogger(log.New(io.Discard, "", 0)),
		zmq4.WithDialerRetry(100*time.Millisecond), zmq4.WithDialerMaxRetries(-1))
	defer sock.Close()
	if err := sock.Dial(zmqEndpoint(endpoint)); err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("dialling kv event replay %s: %w", endpoint, ctx.Err())
		}
		return nil, fmt.Errorf("dialling kv event replay %s: %w", endpoint, err)
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], from)
	if err := sock.SendMulti(zmq4.NewMsgFrom([]byte{}, start[:])); err != nil {
		return nil, fmt.Errorf("requesting kv event replay from %d: %w", from, err)
	}
	var out []Replayed
	for {
		msg, err := sock.Recv()
		if err != nil {
			if ctx.Err() != nil {
				err = ctx.Err()
			}
			return out, fmt.Errorf("receiving kv event replay: %w", err)
		}
		fr := msg.Frames
		if len(fr) > 0 && len(fr[0]) == 0 {
			fr = fr[1:] // the empty delimiter
		}
		var topic []byte
		if len(fr) == 3 {
			topic, fr = fr[0], fr[1:]
		}
		if len(fr) != 2 || len(fr[0]) != 8 {
			return out, fmt.Errorf("receiving kv event replay: %w: %d frames", ErrMalformed, len(msg.Frames))
		}
		if [8]byte(fr[0]) == endSeq {
			return out, nil
		}
		seq := binary.BigEndian.Uint64(fr[0])
		var b Batch
		if err := DecodeBatchInto(&b, fr[1]); err != nil {
			return out, fmt.Errorf("decoding replayed kv event batch %d: %w", seq, err)
		}
		out = append(out, Replayed{Seq: seq, Topic: string(topic), Batch: b})
	}
}

// String formats the stats for logs.
func (st SubscriberStats) String() string {
	return fmt.Sprintf("batches=%d events=%d skipped=%d malformed=%d gaps=%d missed=%d restarts=%d disconnects=%d topics=%d",
		st.Batches, st.Events, st.SkippedEvents, st.Malformed, st.Gaps, st.Missed, st.Restarts, st.Disconnects, st.Topics)
}
