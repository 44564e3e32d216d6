package planner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// Registrar is the part of the control plane's registry the local actuator uses
// (registry.Registry satisfies it).
type Registrar interface {
	Upsert(w registry.Worker) error
	Remove(id string) error
	SetDraining(id string, draining bool) error
}

// LocalActuator is a supervisor of simulated workers on one machine: it scales a pool by
// starting `kvrelay sim` processes (Binary, os.Executable() by default) on free loopback
// ports and registering them with the control plane's registry once healthy, and by
// draining a worker (no new requests), waiting for its requests to finish, removing it from
// the registry and stopping its process (SIGTERM, then SIGKILL). A drain runs in the
// background: the worker stops counting at once, Scale returns, and the planner can act
// again while the worker's last requests finish; a scale-up while a worker of the pool is
// still draining takes that worker back instead of starting a process. Fixed workers
// (started by someone else, such as `kvrelay up`'s own) count towards a pool's size but are
// never stopped. Close stops every process it started, draining or not.
type LocalActuator struct {
	Registry Registrar
	// Binary is the kvrelay executable (default os.Executable()).
	Binary string
	// Host the workers listen on (default 127.0.0.1).
	Host string
	// Model, BlockSize: what the workers serve, for the registry.
	Model     string
	BlockSize int
	// Args are extra `kvrelay sim` flags for every worker (--speedup-ratio, --model, …).
	Args []string
	// Fixed counts the workers of each pool the supervisor does not own.
	Fixed map[Pool]int
	// IDPrefix names the workers: IDPrefix + pool's initial + a counter ("s-b3").
	IDPrefix string
	// StartTimeout bounds a worker's start (default 30 s); DrainGrace and DrainTimeout its
	// drain (default 500 ms and 60 s).
	StartTimeout, DrainGrace, DrainTimeout time.Duration
	Logger                                 *slog.Logger

	mu       sync.Mutex
	workers  map[Pool][]*localWorker // serving, by start order
	draining map[Pool][]*localWorker // being drained in the background, by drain order
	drains   sync.WaitGroup
	next     int
}

type localWorker struct {
	id, url string
	cmd     *exec.Cmd
	done    chan struct{}
	// While draining (under the actuator's mu): cancel stops the drain; reclaimed says a
	// scale-up took the worker back, stopping that Close is stopping it.
	cancel              context.CancelFunc
	reclaimed, stopping bool
}

func (l *LocalActuator) log() *slog.Logger {
	if l.Logger == nil {
		return slog.Default()
	}
	return l.Logger
}

// Replicas counts each pool's fixed and running workers.
func (l *LocalActuator) Replicas(context.Context) (map[Pool]int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[Pool]int{}
	for pool, n := range l.Fixed {
		out[pool] = n
	}
	for pool, ws := range l.workers {
		out[pool] += len(ws)
	}
	return out, nil
}

// Scale starts or stops workers until pool has n (never fewer than its fixed ones). A
// scale-up first takes back workers of the pool still draining (newest first), then starts
// the rest concurrently, each registered as soon as it answers /health; a worker that fails
// to start is reported, those that started stay. A scale-down marks the newest workers
// draining and returns: each is deregistered and stopped in the background once its
// requests have finished (or after DrainTimeout).
func (l *LocalActuator) Scale(ctx context.Context, pool Pool, n int) error {
	l.mu.Lock()
	own := n - l.Fixed[pool]
	have := len(l.workers[pool])
	l.mu.Unlock()
	if own < 0 {
		return fmt.Errorf("scaling pool %s to %d: it has %d fixed workers the supervisor cannot stop", pool, n, l.Fixed[pool])
	}
	// New workers start side by side: a scale-up by k costs one worker's start-up time, not
	// k of them.
	var errs []error
	for have < own {
		ok, err := l.reclaim(pool)
		if !ok {
			break
		}
		if err != nil {
			errs = append(errs, err) // that one is stopped: try the next, or start one
			continue
		}
		have++
	}
	starts := make([]error, max(own-have, 0))
	var wg sync.WaitGroup
	for i := range starts {
		wg.Go(func() { starts[i] = l.start(ctx, pool) })
	}
	wg.Wait()
	errs = append(errs, starts...)
	for i := have; i > own; i-- {
		if err := l.stopNewest(ctx, pool); err != nil {
			errs = append(errs, err)
			break
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("scaling pool %s to %d: %w", pool, n, err)
	}
	return nil
}

func freePort(host string) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func (l *LocalActuator) start(ctx context.Context, pool Pool) error {
	bin := l.Binary
	if bin == "" {
		var err error
		if bin, err = os.Executable(); err != nil {
			return fmt.Errorf("starting a worker: finding kvrelay: %w", err)
		}
	}
	host := l.Host
	if host == "" {
		host = "127.0.0.1"
	}
	var ports [3]int
	for i := range ports {
		p, err := freePort(host)
		if err != nil {
			return fmt.Errorf("starting a worker: %w", err)
		}
		ports[i] = p
	}
	role := string(pool)
	l.mu.Lock()
	id := fmt.Sprintf("%s%c%d", l.IDPrefix, role[0], l.next)
	l.next++
	l.mu.Unlock()
	hp := func(p int) string { return net.JoinHostPort(host, strconv.Itoa(p)) }
	w := &localWorker{id: id, url: "http://" + hp(ports[0]), done: make(chan struct{})}
	args := append([]string{"sim", "--listen", hp(ports[0]), "--role", role,
		"--kv-events-endpoint", "tcp://" + hp(ports[1]), "--kv-events-replay-endpoint", "tcp://" + hp(ports[2])}, l.Args...)
	w.cmd = exec.Command(bin, args...)
	w.cmd.Stdout, w.cmd.Stderr = nil, nil
	setDeathSignal(w.cmd)
	if err := w.cmd.Start(); err != nil {
		return fmt.Errorf("starting worker %s: %w", id, err)
	}
	go func() { _ = w.cmd.Wait(); close(w.done) }()
	timeout := l.StartTimeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	if err := waitHealthy(ctx, w, timeout); err != nil {
		l.kill(w)
		return fmt.Errorf("starting worker %s: %w", id, err)
	}
	err := l.Registry.Upsert(registry.Worker{
		ID: id, URL: w.url, Model: l.Model, Role: role, BlockSize: l.BlockSize,
		KVEvents: "tcp://" + hp(ports[1]), KVEventsReplay: "tcp://" + hp(ports[2]), Engine: "sim",
	})
	if err != nil {
		l.kill(w)
		return fmt.Errorf("registering worker %s: %w", id, err)
	}
	l.mu.Lock()
	if l.workers == nil {
		l.workers = map[Pool][]*localWorker{}
	}
	l.workers[pool] = append(l.workers[pool], w)
	l.mu.Unlock()
	l.log().Info("local actuator: worker started", "id", id, "pool", pool, "url", w.url, "pid", w.cmd.Process.Pid)
	return nil
}

func waitHealthy(ctx context.Context, w *localWorker, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	client := &http.Client{Timeout: time.Second}
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, w.url+"/health", nil)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-w.done:
			return fmt.Errorf("the process exited: %v", w.cmd.ProcessState)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not healthy after %s", timeout)
		}
	}
}

// stopNewest marks the pool's newest worker draining, stops counting it and leaves the rest
// of its drain to drainAndStop, in the background.
func (l *LocalActuator) stopNewest(ctx context.Context, pool Pool) error {
	l.mu.Lock()
	ws := l.workers[pool]
	if len(ws) == 0 {
		l.mu.Unlock()
		return nil
	}
	w := ws[len(ws)-1]
	// The worker moves to the draining list in one step, so that Close always finds it in
	// one list or the other.
	dctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	w.cancel, w.reclaimed, w.stopping = cancel, false, false
	l.workers[pool] = ws[:len(ws)-1]
	if l.draining == nil {
		l.draining = map[Pool][]*localWorker{}
	}
	l.draining[pool] = append(l.draining[pool], w)
	l.mu.Unlock()
	if err := l.Registry.SetDraining(w.id, true); err != nil {
		cancel()
		l.mu.Lock()
		// Back to serving, unless a scale-up or Close took it meanwhile.
		if !w.reclaimed && !w.stopping {
			l.draining[pool] = slices.DeleteFunc(l.draining[pool], func(x *localWorker) bool { return x == w })
			l.workers[pool] = append(l.workers[pool], w)
		}
		l.mu.Unlock()
		return fmt.Errorf("draining worker %s: %w", w.id, err)
	}
	l.log().Info("local actuator: worker draining", "id", w.id, "pool", pool)
	l.drains.Go(func() { l.drainAndStop(dctx, pool, w) })
	return nil
}

// drainAndStop waits until w has no requests in flight (at least DrainGrace, at most
// DrainTimeout), then deregisters and stops it, unless a scale-up took it back or Close is
// stopping it first.
func (l *LocalActuator) drainAndStop(ctx context.Context, pool Pool, w *localWorker) {
	grace, timeout := l.DrainGrace, l.DrainTimeout
	if grace <= 0 {
		grace = 500 * time.Millisecond
	}
	if timeout <= 0 {
		timeout = time.Minute
	}
	client := &http.Client{Timeout: time.Second}
	inflight := func(ctx context.Context, _ string) (int, error) {
		c, err := scrapeWorker(ctx, client, registry.Worker{ID: w.id, URL: w.url})
		return c.running + c.waiting, err
	}
	err := waitIdle(ctx, []string{w.id}, inflight, grace, timeout, l.log())
	l.mu.Lock()
	if w.reclaimed || w.stopping {
		l.mu.Unlock()
		return
	}
	w.stopping = true
	l.draining[pool] = slices.DeleteFunc(l.draining[pool], func(x *localWorker) bool { return x == w })
	l.mu.Unlock()
	if err != nil {
		l.log().Warn("local actuator: worker still busy after its drain timeout; stopping it", "id", w.id, "pool", pool, "err", err)
	}
	if err := l.Registry.Remove(w.id); err != nil && !errors.Is(err, registry.ErrNotFound) {
		l.log().Error("local actuator: deregistering a stopped worker", "id", w.id, "pool", pool, "err", err)
	}
	l.kill(w)
	l.log().Info("local actuator: worker stopped", "id", w.id, "pool", pool)
}

// reclaim takes back the pool's newest worker still draining: it serves again, and counts.
// It reports whether there was one to take.
func (l *LocalActuator) reclaim(pool Pool) (bool, error) {
	l.mu.Lock()
	ds := l.draining[pool]
	var w *localWorker
	for i := len(ds) - 1; i >= 0; i-- {
		if !ds[i].stopping && !ds[i].reclaimed {
			w = ds[i]
			break
		}
	}
	if w == nil {
		l.mu.Unlock()
		return false, nil
	}
	w.reclaimed = true
	w.cancel()
	l.draining[pool] = slices.DeleteFunc(ds, func(x *localWorker) bool { return x == w })
	l.mu.Unlock()
	if err := l.Registry.SetDraining(w.id, false); err != nil {
		// It cannot serve again: finish stopping it, and let the caller start another.
		l.mu.Lock()
		w.stopping = true
		l.mu.Unlock()
		_ = l.Registry.Remove(w.id)
		l.kill(w)
		return true, fmt.Errorf("taking back draining worker %s: %w", w.id, err)
	}
	l.mu.Lock()
	if l.workers == nil {
		l.workers = map[Pool][]*localWorker{}
	}
	l.workers[pool] = append(l.workers[pool], w)
	l.mu.Unlock()
	l.log().Info("local actuator: draining worker taken back", "id", w.id, "pool", pool)
	return true, nil
}

// kill stops a process: SIGTERM, SIGKILL after 5 s.
func (l *LocalActuator) kill(w *localWorker) {
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.done:
	case <-time.After(5 * time.Second):
		_ = w.cmd.Process.Kill()
		<-w.done
	}
}

// Close stops every worker it started, serving or draining, deregistering them; safe to
// call more than once.
func (l *LocalActuator) Close() error {
	l.mu.Lock()
	var all []*localWorker
	for _, ws := range l.workers {
		all = append(all, ws...)
	}
	for _, ws := range l.draining {
		for _, w := range ws {
			if !w.stopping && !w.reclaimed {
				w.stopping = true
				w.cancel()
				all = append(all, w)
			}
		}
	}
	l.workers, l.draining = nil, nil
	l.mu.Unlock()
	var wg sync.WaitGroup
	for _, w := range all {
		wg.Go(func() {
			_ = l.Registry.Remove(w.id)
			l.kill(w)
		})
	}
	wg.Wait()
	l.drains.Wait()
	return nil
}

var _ Actuator = (*LocalActuator)(nil)
