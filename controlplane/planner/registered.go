package planner

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/kvrelay/kvrelay/controlplane/registry"
)

// ErrReadOnly is returned by Registered.Scale.
var ErrReadOnly = errors.New("this actuator only reads the fleet")

// Registered is a read-only Actuator over the control plane's registry: a pool's size is
// its registered workers that are not draining. It suits a dry run (Config.DryRun) where
// nothing can be scaled but the decisions should start from the fleet as it is.
type Registered struct {
	Workers WorkerLister
}

// Replicas counts registered, undrained workers by role (no role: PoolBoth).
func (r Registered) Replicas(context.Context) (map[Pool]int, error) {
	out := map[Pool]int{}
	for _, w := range r.Workers.Workers() {
		if w.Draining {
			continue
		}
		pool := Pool(w.Role)
		if pool == "" {
			pool = PoolBoth
		}
		out[pool]++
	}
	return out, nil
}

// Scale fails: Registered cannot change the fleet.
func (Registered) Scale(_ context.Context, pool Pool, n int) error {
	return fmt.Errorf("scaling pool %s to %d: %w", pool, n, ErrReadOnly)
}

// Inflight returns a function that reads a registered worker's requests in flight
// (running + waiting) from its metrics, for KubeActuator.Inflight. A worker no longer
// registered has none.
func Inflight(workers WorkerLister, client *http.Client) func(ctx context.Context, id string) (int, error) {
	if client == nil {
		client = &http.Client{Timeout: 2 * time.Second}
	}
	return func(ctx context.Context, id string) (int, error) {
		for _, w := range workers.Workers() {
			if w.ID == id {
				c, err := scrapeWorker(ctx, client, w)
				return c.running + c.waiting, err
			}
		}
		return 0, nil
	}
}

var (
	_ Actuator     = Registered{}
	_ WorkerLister = (*registry.Registry)(nil)
)
