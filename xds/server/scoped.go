package server

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// A proxy that routes a few of the fleet's models (node metadata xds.NodeModelsKey) is sent
// the Worker resources of their workers only, not the fleet's: at 10,000 workers every
// proxy's connect would otherwise carry about 2 MB of workers it never routes to. The worker
// cache is therefore one LinearCache of every worker, which proxies that name no model
// watch, and beside it one LinearCache per scope (a set of models) that some proxy named,
// holding the workers in it. The proxies of one scope share its cache, as they share the
// full one, so a publish costs one update per scope, not per proxy. Resources keep the
// versions the LinearCache gives them (the hash of their encoding), so a proxy resumes the
// same on any cache that holds them.
//
// A scope's cache is made when its first watch comes, filled from the current workers, and
// dropped once no watch has used it for scopeIdle. At most maxScopes exist; a proxy of a
// further scope watches the full cache (its client keeps the workers it routes, as before
// scopes).

const (
	// maxScopes bounds the scopes' caches; each costs a map of its workers and an update
	// per publish.
	maxScopes = 64
	// scopeIdle is how long a scope's cache outlives its last watch: a proxy between a
	// response and its acknowledgement holds its watch, so this only covers reconnects.
	scopeIdle = time.Minute
)

// scopedWorkers is the worker cache: cache.Cache for xds.WorkerType.
type scopedWorkers struct {
	all *cache.LinearCache
	now func() time.Time

	mu      sync.Mutex
	current map[string]*xdsv1.Worker // every published worker, as the caches hold them
	scopes  map[string]*workerScope  // by key: the models, sorted, joined by NUL
	overcap uint64                   // watches sent to the full cache for want of a scope
}

// workerScope is the cache of one set of models.
type workerScope struct {
	models  []string
	cache   *cache.LinearCache
	members map[string]bool // ids of the workers in the cache
	watches int
	idle    time.Time // when watches last fell to 0
}

var _ cache.Cache = (*scopedWorkers)(nil)

func newScopedWorkers() *scopedWorkers {
	return &scopedWorkers{
		all:     cache.NewLinearCache(xds.WorkerType),
		now:     time.Now,
		current: make(map[string]*xdsv1.Worker),
		scopes:  make(map[string]*workerScope),
	}
}

// update publishes changed workers (their resources, by id) and removes gone ones, in the
// full cache and in every scope's: a worker that left a scope (its model or adapters
// changed) is removed there. Each cache is given its new state even when notifying one of
// its watches fails. Calls are serialized by the caller (the server's publish lock); the
// caches are updated outside c.mu, so that a watch being opened never waits on a cache
// notifying its watches. A scope made meanwhile, from the new state, is given the same
// changes again, which changes nothing.
func (c *scopedWorkers) update(changed map[string]types.Resource, gone []string) error {
	type scopeChange struct {
		sc  *workerScope
		upd map[string]types.Resource
		del []string
	}
	var todo []scopeChange
	c.mu.Lock()
	for id, r := range changed {
		c.current[id] = r.(*xdsv1.Worker)
	}
	for _, id := range gone {
		delete(c.current, id)
	}
	now := c.now()
	for key, sc := range c.scopes {
		if sc.watches == 0 && now.Sub(sc.idle) >= scopeIdle {
			delete(c.scopes, key)
			continue
		}
		ch := scopeChange{sc: sc, upd: make(map[string]types.Resource)}
		for id, r := range changed {
			switch {
			case xds.ServesAny(r.(*xdsv1.Worker), sc.models):
				ch.upd[id] = r
				sc.members[id] = true
			case sc.members[id]:
				ch.del = append(ch.del, id)
				delete(sc.members, id)
			}
		}
		for _, id := range gone {
			if sc.members[id] {
				ch.del = append(ch.del, id)
				delete(sc.members, id)
			}
		}
		if len(ch.upd) > 0 || len(ch.del) > 0 {
			todo = append(todo, ch)
		}
	}
	c.mu.Unlock()

	var errs []error
	if err := c.all.UpdateResources(changed, gone); err != nil {
		errs = append(errs, err)
	}
	for _, ch := range todo {
		if err := ch.sc.cache.UpdateResources(ch.upd, ch.del); err != nil {
			errs = append(errs, fmt.Errorf("scope %s: %w", strings.Join(ch.sc.models, ","), err))
		}
	}
	return errors.Join(errs...)
}

// CreateDeltaWatch opens the watch on the cache of the proxy's scope: the full cache when
// its node names no model, or when maxScopes are in use. A node whose models are malformed
// is refused.
func (c *scopedWorkers) CreateDeltaWatch(req *cache.DeltaRequest, sub cache.Subscription, value chan cache.DeltaResponse) (func(), error) {
	models, err := xds.NodeModels(req.GetNode())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if len(models) == 0 {
		return c.all.CreateDeltaWatch(req, sub, value)
	}
	sc := c.acquire(models)
	if sc == nil {
		return c.all.CreateDeltaWatch(req, sub, value)
	}
	cancel, err := sc.cache.CreateDeltaWatch(req, sub, value)
	if err != nil {
		c.release(sc)
		return nil, err
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			if cancel != nil {
				cancel()
			}
			c.release(sc)
		})
	}, nil
}

// acquire returns the cache of models (sorted), made and filled when it is not held, with
// one more watch on it; nil when maxScopes others are in use.
func (c *scopedWorkers) acquire(models []string) *workerScope {
	key := strings.Join(models, "\x00")
	c.mu.Lock()
	defer c.mu.Unlock()
	sc, ok := c.scopes[key]
	if !ok {
		if len(c.scopes) >= maxScopes {
			now := c.now()
			for k, o := range c.scopes {
				if o.watches == 0 && now.Sub(o.idle) >= scopeIdle {
					delete(c.scopes, k)
				}
			}
		}
		if len(c.scopes) >= maxScopes {
			c.overcap++
			return nil
		}
		sc = &workerScope{models: models, cache: cache.NewLinearCache(xds.WorkerType), members: make(map[string]bool)}
		in := make(map[string]types.Resource)
		for id, w := range c.current {
			if xds.ServesAny(w, models) {
				in[id] = w
				sc.members[id] = true
			}
		}
		sc.cache.SetResources(in)
		c.scopes[key] = sc
	}
	sc.watches++
	return sc
}

func (c *scopedWorkers) release(sc *workerScope) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if sc.watches--; sc.watches == 0 {
		sc.idle = c.now()
	}
}

// stats returns the scopes' caches held and the watches sent to the full cache for want of
// a scope.
func (c *scopedWorkers) stats() (scopes int, overcap uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.scopes), c.overcap
}

// CreateWatch serves state-of-the-world requests, which the server refuses before they get
// here (it cannot tell a proxy that a worker was removed), from the full cache.
func (c *scopedWorkers) CreateWatch(req *cache.Request, sub cache.Subscription, value chan cache.Response) (func(), error) {
	return c.all.CreateWatch(req, sub, value)
}

// Fetch is the full cache's.
func (c *scopedWorkers) Fetch(ctx context.Context, req *cache.Request) (cache.Response, error) {
	return c.all.Fetch(ctx, req)
}
