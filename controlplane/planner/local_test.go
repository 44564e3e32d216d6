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
		fmt.Fprint(w, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n")
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
	left, log := reg.snapshot()
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 1 || len(left) != 0 {
		t.Errorf("after scaling to 1: replicas %v, registered %v", got, left)
	}
	// Each worker is drained before it is removed, the last registered first.
	var ups []string
	for _, l := range log {
		if id, ok := strings.CutPrefix(l, "upsert "); ok {
			ups = append(ups, id)
		}
	}
	want := []string{"drain " + ups[1] + " true", "remove " + ups[1], "drain " + ups[0] + " true", "remove " + ups[0]}
	if !slices.Equal(log[2:], want) {
		t.Errorf("registry calls %q, want them to end with %q", log, want)
	}
	for _, w := range ws {
		if resp, err := client.Get(w.URL + "/health"); err == nil {
			resp.Body.Close()
			t.Errorf("worker %s still serves after it was stopped", w.ID)
		}
	}

	// Below the fixed workers is an error; Close stops what the actuator started.
	if err := l.Scale(ctx, planner.PoolBoth, 0); err == nil || !strings.Contains(err.Error(), "fixed") {
		t.Errorf("Scale below the fixed workers: %v", err)
	}
	if err := l.Scale(ctx, planner.PoolBoth, 2); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if left, _ := reg.snapshot(); len(left) != 0 {
		t.Errorf("after Close, still registered: %v", left)
	}
	if got, _ := l.Replicas(ctx); got[planner.PoolBoth] != 1 {
		t.Errorf("Replicas after Close: %v, want the fixed 1", got)
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
