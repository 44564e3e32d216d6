package sim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvrelay/kvrelay/engines/kvevents"
	"github.com/kvrelay/kvrelay/nixl"
)

// WorkerConfig describes one simulated worker process-in-a-goroutine: its engine, its HTTP
// listener and its KV event publisher.
type WorkerConfig struct {
	Engine Config
	// Listen is the HTTP API's address, e.g. "127.0.0.1:8001" or "127.0.0.1:0".
	Listen string
	// Events configures the KV event publisher; an empty Endpoint turns events off.
	Events kvevents.PublisherConfig
	// Codec renders and tokenizes prompts; required.
	Codec Codec
	// ShutdownTimeout bounds how long Run waits for open responses after its context ends.
	ShutdownTimeout time.Duration

	// KV transfer (Engine.Role prefill or decode).

	// KVTransferListen is the nixl agent's TCP address (metadata, transfers and
	// notifications), advertised in kv_transfer_params as remote_host and remote_port.
	// Default "127.0.0.1:0".
	KVTransferListen string
	// KVTransferAdvertiseHost is the remote_host to advertise instead of the bound host;
	// required when KVTransferListen is a wildcard address.
	KVTransferAdvertiseHost string
	// EngineID names the engine in kv_transfer_params (remote_engine_id) and its nixl
	// agent. Default: a random UUID, as vLLM's.
	EngineID string
	// KVTransferBackends are the nixl backends in order of preference. Default: nixl's
	// (shared memory with same-host peers, then TCP).
	KVTransferBackends []nixl.BackendKind
}

// Worker is one simulated engine serving the OpenAI API over HTTP and publishing KV events
// over ZMQ. Lifecycle: NewWorker (no side effects) → Start (binds sockets) → Run (serves until
// its context ends) → Close (releases what Start took; safe after a failed Start).
type Worker struct {
	cfg     WorkerConfig
	eng     *Engine
	metrics *Metrics
	srv     *Server
	adapter *eventAdapter
	kv      *kvConnector // nil in role both

	ln   net.Listener
	http *http.Server
	pub  *kvevents.Publisher
}

// NewWorker builds a worker from cfg without binding anything.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	if cfg.Codec == nil {
		return nil, fmt.Errorf("%w: no codec", ErrInvalidConfig)
	}
	if cfg.ShutdownTimeout <= 0 {
		cfg.ShutdownTimeout = 5 * time.Second
	}
	ids, text, err := fillerTokens(cfg.Codec)
	if err != nil {
		return nil, fmt.Errorf("building worker: %w", err)
	}
	w := &Worker{cfg: cfg, metrics: NewMetrics(cfg.Engine)}
	var sink EventSink
	if cfg.Events.Endpoint != "" {
		if err := cfg.Events.Validate(); err != nil {
			return nil, fmt.Errorf("building worker: %w", err)
		}
		w.adapter = &eventAdapter{blockSize: cfg.Engine.BlockSize, asBytes: cfg.Engine.EngineHashBytes, placeholders: cfg.Engine.OffloadPlaceholders}
		sink = w.adapter
	}
	if w.eng, err = NewEngine(cfg.Engine, ids, sink, w.metrics); err != nil {
		return nil, fmt.Errorf("building worker: %w", err)
	}
	if r := cfg.Engine.Role; r == RolePrefill || r == RoleDecode || cfg.Engine.PeerFetch {
		if cfg.EngineID == "" {
			cfg.EngineID = newEngineID()
			w.cfg.EngineID = cfg.EngineID
		}
		w.kv = newKVConnector(cfg.Engine, cfg.EngineID, cfg.KVTransferListen, cfg.KVTransferAdvertiseHost, w.metrics)
		w.kv.backends = cfg.KVTransferBackends
		w.eng.kv = w.kv
	}
	w.srv = NewServer(w.eng, cfg.Codec, w.metrics, text)
	return w, nil
}

// Engine returns the worker's engine.
func (w *Worker) Engine() *Engine { return w.eng }

// Start binds the HTTP listener and the KV event sockets, and in roles prefill and decode
// starts the nixl agent and registers the KV transfer region.
func (w *Worker) Start(ctx context.Context) error {
	if w.kv != nil {
		if err := w.kv.start(); err != nil {
			return err
		}
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", w.cfg.Listen)
	if err != nil {
		return fmt.Errorf("listening for the OpenAI API on %s: %w", w.cfg.Listen, err)
	}
	w.ln = ln
	if w.adapter != nil {
		pub, err := kvevents.NewPublisher(w.cfg.Events)
		if err != nil {
			return fmt.Errorf("creating kv event publisher: %w", err)
		}
		if err := pub.Start(ctx); err != nil {
			_ = pub.Close()
			return fmt.Errorf("starting kv event publisher on %s: %w", w.cfg.Events.Endpoint, err)
		}
		w.pub = pub
		w.adapter.pub = pub
	}
	w.http = &http.Server{
		Handler:           w.srv.Handler(),
		ReadHeaderTimeout: 30 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
	return nil
}

// URL is the base URL of the worker's OpenAI API (without /v1). Valid after Start.
func (w *Worker) URL() string { return "http://" + w.ln.Addr().String() }

// EngineID is the engine's id in kv_transfer_params ("" in role both).
func (w *Worker) EngineID() string {
	if w.kv == nil {
		return ""
	}
	return w.cfg.EngineID
}

// KVTransferAddr is the nixl agent's address (remote_host:remote_port as bound), "" in role
// both. Valid after Start.
func (w *Worker) KVTransferAddr() string {
	if w.kv == nil {
		return ""
	}
	return w.kv.Addr()
}

// EventsEndpoint is the ZMQ endpoint subscribers connect to, "" when events are off.
func (w *Worker) EventsEndpoint() string {
	if w.pub == nil {
		return ""
	}
	return w.pub.Endpoint()
}

// ReplayEndpoint is the ZMQ ROUTER endpoint that replays buffered events, "" when off.
func (w *Worker) ReplayEndpoint() string {
	if w.pub == nil {
		return ""
	}
	return w.pub.ReplayEndpoint()
}

// Run serves until ctx ends, then stops the engine (finishing what is in flight as aborted)
// and waits up to the shutdown timeout for open responses to end.
func (w *Worker) Run(ctx context.Context) error {
	if w.http == nil {
		return errors.New("running worker: not started")
	}
	g, gctx := errgroup.WithContext(ctx)
	if w.kv != nil {
		w.kv.ctx = gctx // before the engine starts pulls
		g.Go(func() error { return w.kv.run(gctx, w.eng.releaseHeld) })
		defer w.kv.wait()
	}
	g.Go(func() error { return w.eng.Run(gctx) })
	g.Go(func() error {
		if err := w.http.Serve(w.ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("serving the OpenAI API: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		<-gctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), w.cfg.ShutdownTimeout)
		defer cancel()
		if err := w.http.Shutdown(sctx); err != nil {
			_ = w.http.Close()
		}
		return nil
	})
	return g.Wait()
}

// Close releases the sockets Start bound. It is safe to call after a failed Start and more
// than once.
func (w *Worker) Close() error {
	var errs []error
	if w.http != nil {
		errs = append(errs, w.http.Close())
	} else if w.ln != nil {
		errs = append(errs, w.ln.Close())
	}
	if w.pub != nil {
		errs = append(errs, w.pub.Close())
	}
	if w.kv != nil {
		errs = append(errs, w.kv.close())
	}
	if err := errors.Join(errs...); err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("closing worker: %w", err)
	}
	return nil
}
