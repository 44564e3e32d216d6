package planner_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/planner"
	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// fakeSimEnv makes the test binary act as `kvrelay sim` for the local actuator's tests:
// "serve" answers /health and an idle /metrics on --listen until SIGTERM; "exit" exits at
// once, a worker that fails to start.
const fakeSimEnv = "KVRELAY_PLANNER_TEST_FAKE_SIM"

// fakeSimBusyEnv names a file: while it exists, the fake sims report a request running.
const fakeSimBusyEnv = "KVRELAY_PLANNER_TEST_FAKE_SIM_BUSY"

func TestMain(m *testing.M) {
	switch os.Getenv(fakeSimEnv) {
	case "serve":
		fakeSim()
		return
	case "exit":
		os.Exit(3)
	}
	os.Exit(m.Run())
}

func fakeSim() {
	args := os.Args[1:]
	i := slices.Index(args, "--listen")
	if len(args) == 0 || args[0] != "sim" || i < 0 || i+1 >= len(args) {
		fmt.Fprintln(os.Stderr, "fake sim: want sim --listen ADDR, got", args)
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", args[i+1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake sim:", err)
		os.Exit(2)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		running := 0
		if f := os.Getenv(fakeSimBusyEnv); f != "" {
			if _, err := os.Stat(f); err == nil {
				running = 1
			}
		}
		fmt.Fprintf(w, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running %d\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n", running)
	})
	go func() { _ = http.Serve(ln, mux) }()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	<-sig
}

// fakeRegistry records what the local actuator does to the control plane's registry.
type fakeRegistry struct {
	mu       sync.Mutex
	workers  map[string]registry.Worker
	draining map[string]bool
	log      []string
}

func (r *fakeRegistry) Upsert(w registry.Worker) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.workers == nil {
		r.workers, r.draining = map[string]registry.Worker{}, map[string]bool{}
	}
	r.workers[w.ID] = w
	r.log = append(r.log, "upsert "+w.ID)
	return nil
}

func (r *fakeRegistry) Remove(id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.workers[id]; !ok {
		return registry.ErrNotFound
	}
	delete(r.workers, id)
	r.log = append(r.log, "remove "+id)
	return nil
}

func (r *fakeRegistry) SetDraining(id string, v bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.workers[id]; !ok {
		return registry.ErrNotFound
	}
	r.draining[id] = v
	r.log = append(r.log, fmt.Sprintf("drain %s %v", id, v))
	return nil
}

func (r *fakeRegistry) snapshot() (map[string]registry.Worker, []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := map[string]registry.Worker{}
	for k, v := range r.workers {
		m[k] = v
	}
	return m, slices.Clone(r.log)
}

func localActuator(t *testing.T, mode string) (*planner.LocalActuator, *fakeRegistry) {
	t.Helper()
	if runtime.GOOS == "windows" {
		t.Skip("the local actuator's workers are Unix processes")
	}
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(fakeSimEnv, mode)
	reg := &fakeRegistry{}
	l := &planner.LocalActuator{
		Registry: reg, Binary: bin, Model: "m", BlockSize: 16, IDPrefix: "t",
		Fixed:        map[planner.Pool]int{planner.PoolBoth: 1},
		StartTimeout: 10 * time.Second, DrainGrace: time.Millisecond, DrainTimeout: 5 * time.Second,
		Logger: quiet(),
	}
	t.Cleanup(func() { _ = l.Close() })
	return l, reg
}

// TestLocalActuatorStartsDrainsAndStops scales a pool with one fixed worker up by two
// (started side by side, registered once healthy) and back down (each drained, deregistered
// and stopped, newest first), and checks Close stops what is left.
func TestLocalActuatorStartsDrainsAndStops(t *testing.T) {
	l, reg := localActuator(t, "serve")
	ctx := context.Background()
	if err := l.Scale(ctx, planner.PoolBoth, 3); err != nil {
		t.Fatal(err)
	}
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 3 {
		t.Errorf("Replicas after scaling to 3: %v", got)
	}
	ws, _ := reg.snapshot()
	if len(ws) != 2 {
		t.Fatalf("registered %v, want 2 workers", ws)
	}
	client := &http.Client{Timeout: time.Second}
	for id, w := range ws {
		if !strings.HasPrefix(id, "tb") || w.Role != "both" || w.Model != "m" || w.BlockSize != 16 || w.Engine != "sim" || !strings.HasPrefix(w.KVEvents, "tcp://") {
			t.Errorf("registered worker %+v", w)
		}
		resp, err := client.Get(w.URL + "/health")
		if err != nil {
			t.Fatalf("worker %s not serving: %v", id, err)
		}
		resp.Body.Close()
	}

	if err := l.Scale(ctx, planner.PoolBoth, 1); err != nil {
		t.Fatal(err)
	}
	// The two stop counting at once and are drained, deregistered and stopped in the
	// background.
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 1 {
		t.Errorf("Replicas right after scaling to 1: %v", got)
	}
	left, log := waitRegistered(t, reg, 0)
	if len(left) != 0 {
		t.Errorf("after scaling to 1, still registered: %v", left)
	}
	// Each worker is drained before it is removed, the last registered first.
	var ups []string
	for _, l := range log {
		if id, ok := strings.CutPrefix(l, "upsert "); ok {
			ups = append(ups, id)
		}
	}
	if want := []string{"drain " + ups[1] + " true", "drain " + ups[0] + " true"}; len(log) != 6 || !slices.Equal(log[2:4], want) ||
		!slices.Contains(log[4:], "remove "+ups[0]) || !slices.Contains(log[4:], "remove "+ups[1]) {
		t.Errorf("registry calls %q, want drains of %s then %s, then both removed", log, ups[1], ups[0])
	}
	for _, w := range ws {
		waitStopped(t, client, w)
	}

	// Below the fixed workers is an error; Close stops what the actuator started.
	if err := l.Scale(ctx, planner.PoolBoth, 0); err == nil || !strings.Contains(err.Error(), "fixed") {
		t.Errorf("Scale below the fixed workers: %v", err)
	}
	if err := l.Scale(ctx, planner.PoolBoth, 2); err != nil {
		t.Fatal(err)
	}
	closeDeregistered(t, l, reg)
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 1 {
		t.Errorf("Replicas after Close: %v, want the fixed 1", got)
	}
}

// waitRegistered waits up to 10 s for n workers to be registered and returns the registry.
func waitRegistered(t *testing.T, reg *fakeRegistry, n int) (map[string]registry.Worker, []string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ws, log := reg.snapshot()
		if len(ws) == n || time.Now().After(deadline) {
			return ws, log
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitStopped waits up to 10 s for w to stop answering.
func waitStopped(t *testing.T, client *http.Client, w registry.Worker) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		resp, err := client.Get(w.URL + "/health")
		if err != nil {
			return
		}
		resp.Body.Close()
	}
	t.Errorf("worker %s still serves after it was stopped", w.ID)
}

// A scale-down returns while the worker's requests finish; a scale-up meanwhile takes the
// draining worker back rather than starting a process, and Close stops a worker mid-drain.
func TestLocalActuatorTakesBackADrainingWorker(t *testing.T) {
	busy := t.TempDir() + "/busy"
	if err := os.WriteFile(busy, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(fakeSimBusyEnv, busy)
	l, reg := localActuator(t, "serve")
	ctx := context.Background()
	if err := l.Scale(ctx, planner.PoolBoth, 2); err != nil {
		t.Fatal(err)
	}
	ws, _ := reg.snapshot()
	if len(ws) != 1 {
		t.Fatalf("registered %v, want 1 worker", ws)
	}
	start := time.Now()
	if err := l.Scale(ctx, planner.PoolBoth, 1); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Scale down took %s with the worker busy: it waited for the drain", d)
	}
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 1 {
		t.Errorf("Replicas while draining: %v, want 1", got)
	}
	time.Sleep(300 * time.Millisecond) // still busy: still registered, draining
	if now, _ := reg.snapshot(); len(now) != 1 {
		t.Fatalf("a busy draining worker was removed: %v", now)
	}
	if err := l.Scale(ctx, planner.PoolBoth, 2); err != nil {
		t.Fatal(err)
	}
	now, log := reg.snapshot()
	var id string
	for k := range ws {
		id = k
	}
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 2 || len(now) != 1 || now[id].URL != ws[id].URL {
		t.Errorf("after scaling back to 2: replicas %v, registered %v (want %s again)", got, now, id)
	}
	if want := []string{"upsert " + id, "drain " + id + " true", "drain " + id + " false"}; !slices.Equal(log, want) {
		t.Errorf("registry calls %q, want %q: the draining worker taken back, nothing started", log, want)
	}
	// Draining again, then closed mid-drain: stopped and deregistered all the same.
	if err := l.Scale(ctx, planner.PoolBoth, 1); err != nil {
		t.Fatal(err)
	}
	closeDeregistered(t, l, reg)
	waitStopped(t, &http.Client{Timeout: time.Second}, ws[id])
}

// A worker still busy when its drain times out is stopped anyway; a draining worker the
// registry refuses to take back is stopped too, and a new one starts in its place.
func TestLocalActuatorDrainTimeoutAndFailedTakeBack(t *testing.T) {
	busy := t.TempDir() + "/busy"
	if err := os.WriteFile(busy, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(fakeSimBusyEnv, busy)
	l, reg := localActuator(t, "serve")
	l.DrainTimeout = 300 * time.Millisecond
	ctx := context.Background()
	client := &http.Client{Timeout: time.Second}
	if err := l.Scale(ctx, planner.PoolBoth, 2); err != nil {
		t.Fatal(err)
	}
	first, _ := reg.snapshot()
	if err := l.Scale(ctx, planner.PoolBoth, 1); err != nil {
		t.Fatal(err)
	}
	if left, _ := waitRegistered(t, reg, 0); len(left) != 0 {
		t.Errorf("a worker busy past its drain timeout is still registered: %v", left)
	}
	for _, w := range first {
		waitStopped(t, client, w)
	}

	l.DrainTimeout = time.Minute
	if err := l.Scale(ctx, planner.PoolBoth, 2); err != nil {
		t.Fatal(err)
	}
	second, _ := reg.snapshot()
	if err := l.Scale(ctx, planner.PoolBoth, 1); err != nil {
		t.Fatal(err)
	}
	reg.mu.Lock()
	reg.workers = map[string]registry.Worker{} // undraining now fails: not found
	reg.mu.Unlock()
	if err := l.Scale(ctx, planner.PoolBoth, 2); err == nil || !strings.Contains(err.Error(), "taking back") {
		t.Errorf("Scale up with the registry refusing the take-back: %v", err)
	}
	now, _ := reg.snapshot()
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 2 || len(now) != 1 {
		t.Errorf("after a refused take-back: replicas %v, registered %v; want a new worker in its place", got, now)
	}
	for id, w := range second {
		if _, ok := now[id]; ok {
			t.Errorf("the worker that could not be taken back is registered again: %s", id)
		}
		waitStopped(t, client, w)
	}
}

// A scale-down the registry refuses to drain is reported, and the worker keeps serving and
// counting.
func TestLocalActuatorReportsFailedDrain(t *testing.T) {
	l, reg := localActuator(t, "serve")
	ctx := context.Background()
	if err := l.Scale(ctx, planner.PoolBoth, 2); err != nil {
		t.Fatal(err)
	}
	ws, _ := reg.snapshot()
	reg.mu.Lock()
	reg.workers = map[string]registry.Worker{} // SetDraining now fails: not found
	reg.mu.Unlock()
	if err := l.Scale(ctx, planner.PoolBoth, 1); err == nil || !strings.Contains(err.Error(), "draining worker") {
		t.Errorf("Scale down with the registry refusing the drain: %v", err)
	}
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 2 {
		t.Errorf("Replicas after a refused drain: %v, want 2", got)
	}
	client := &http.Client{Timeout: time.Second}
	for _, w := range ws {
		resp, err := client.Get(w.URL + "/health")
		if err != nil {
			t.Fatalf("worker %s stopped after a refused drain: %v", w.ID, err)
		}
		resp.Body.Close()
	}
}

// A worker whose process exits before it is healthy is reported, never registered, and
// not counted.
func TestLocalActuatorReportsFailedStart(t *testing.T) {
	l, reg := localActuator(t, "exit")
	err := l.Scale(context.Background(), planner.PoolBoth, 2)
	if err == nil || !strings.Contains(err.Error(), "exited") {
		t.Errorf("Scale with a worker that exits: %v", err)
	}
	if got, _ := l.Replicas(context.Background()); got[planner.PoolBoth] != 1 {
		t.Errorf("Replicas %v, want only the fixed 1", got)
	}
	if ws, _ := reg.snapshot(); len(ws) != 0 {
		t.Errorf("registered %v", ws)
	}
}

// The planner retries a failed local scale-up at its next step and reports the failure in
// the decision meanwhile.
func TestLocalActuatorFailureRetriedByPlanner(t *testing.T) {
	l, _ := localActuator(t, "exit")
	cfg := planner.DefaultConfig()
	cfg.Pools = map[planner.Pool]planner.PoolLimits{planner.PoolBoth: {Min: 1, Max: 4}}
	cfg.Profiles = map[planner.Pool]*planner.Profile{planner.PoolBoth: knownProfile()}
	cfg.TTFT, cfg.ITL = 200*time.Millisecond, 40*time.Millisecond
	cfg.Interval, cfg.LoadInterval = time.Minute, time.Minute
	cfg.ScaleAttempts, cfg.ScaleBackoff = 1, time.Millisecond
	cfg.Logger = quiet()
	p, err := planner.New(cfg, nil, l)
	if err != nil {
		t.Fatal(err)
	}
	at := time.Unix(1000, 0)
	ds := p.Step(context.Background(), obs(at, 10, 1000, 100)) // needs 2.67: 3
	if len(ds) != 1 || ds[0].To != 3 || ds[0].Applied || ds[0].Error == "" {
		t.Fatalf("decisions %+v: want a failed scale to 3, reported", ds)
	}
	t.Setenv(fakeSimEnv, "serve")
	ds = p.Step(context.Background(), planner.Observation{At: at.Add(5 * time.Second), Window: 5 * time.Second})
	if len(ds) != 1 || ds[0].Mode != "retry" || !ds[0].Applied {
		t.Fatalf("decisions %+v: want the retry applied", ds)
	}
	if got, _ := l.Replicas(context.Background()); got[planner.PoolBoth] != 3 {
		t.Errorf("Replicas %v, want 3 after the retry", got)
	}
}

// closeDeregistered closes l and checks that it left no worker registered.
func closeDeregistered(t *testing.T, l interface{ Close() error }, reg *fakeRegistry) {
	t.Helper()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if left, _ := reg.snapshot(); len(left) != 0 {
		t.Errorf("after Close, still registered: %v", left)
	}
}
