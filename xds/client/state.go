package client

import (
	"errors"
	"fmt"
	"maps"
	"slices"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// state is the proxy's copy of the control plane's resources, with the version of each as
// the control plane named it (what the proxy sends back as initial_resource_versions). It
// is owned by one goroutine (Client.Run); resources in it are never modified.
type state struct {
	validateWorker func(*xdsv1.Worker) error
	validatePolicy func(*xdsv1.RoutingPolicy) error
	validateKeys   func(*xdsv1.TenantKeys) error

	workers map[string]versioned[*xdsv1.Worker]
	loads   map[string]versioned[loadsShard]
	policy  *versioned[*xdsv1.RoutingPolicy]
	keys    *versioned[*xdsv1.TenantKeys]
	// sorted is the workers sorted by id as snapshot last gave them, nil once a worker
	// changed: an update of loads alone gives the same slice again, without sorting.
	sorted []*xdsv1.Worker
}

type versioned[T any] struct {
	version string
	value   T
}

// loadsShard is a Loads resource as xds.DecodeLoads gave it.
type loadsShard struct {
	n     uint32
	shard xds.Shard
}

func newState(vw func(*xdsv1.Worker) error, vp func(*xdsv1.RoutingPolicy) error) *state {
	return &state{
		validateWorker: vw,
		validatePolicy: vp,
		workers:        make(map[string]versioned[*xdsv1.Worker]),
		loads:          make(map[string]versioned[loadsShard]),
	}
}

// versions returns the versions held for typeURL, for a resubscription.
func (s *state) versions(typeURL string) map[string]string {
	switch typeURL {
	case xds.WorkerType:
		out := make(map[string]string, len(s.workers))
		for name, w := range s.workers {
			out[name] = w.version
		}
		return out
	case xds.LoadsType:
		out := make(map[string]string, len(s.loads))
		for name, l := range s.loads {
			out[name] = l.version
		}
		return out
	case xds.PolicyType:
		if s.policy != nil {
			return map[string]string{xds.PolicyName: s.policy.version}
		}
	case xds.KeysType:
		if s.keys != nil {
			return map[string]string{xds.KeysName: s.keys.version}
		}
	}
	return nil
}

// apply applies a delta response: each resource that decodes and validates replaces its
// previous version, each removal drops its resource, and a resource that fails keeps its
// previous version (or stays absent). It reports whether anything changed, and an error
// naming every resource it refused (the NACK's detail), or the response's unknown type.
func (s *state) apply(resp *discovery.DeltaDiscoveryResponse) (changed bool, err error) {
	var errs []error
	switch resp.GetTypeUrl() {
	case xds.WorkerType:
		for _, r := range resp.GetResources() {
			w, err := xds.DecodeWorker(r.GetName(), r.GetResource())
			if err == nil && s.validateWorker != nil {
				err = s.validateWorker(w)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("refusing worker %q version %q: %w", r.GetName(), r.GetVersion(), err))
				continue
			}
			if old, ok := s.workers[w.GetId()]; ok && old.version == r.GetVersion() && r.GetVersion() != "" {
				continue
			}
			s.workers[w.GetId()] = versioned[*xdsv1.Worker]{version: r.GetVersion(), value: w}
			changed, s.sorted = true, nil
		}
		for _, name := range resp.GetRemovedResources() {
			if _, ok := s.workers[name]; ok {
				delete(s.workers, name)
				changed, s.sorted = true, nil
			}
		}
	case xds.LoadsType:
		for _, r := range resp.GetResources() {
			n, shard, err := xds.DecodeLoads(r.GetName(), r.GetResource())
			if err != nil {
				errs = append(errs, fmt.Errorf("refusing loads %q version %q: %w", r.GetName(), r.GetVersion(), err))
				continue
			}
			if old, ok := s.loads[r.GetName()]; ok && old.version == r.GetVersion() && r.GetVersion() != "" {
				continue
			}
			s.loads[r.GetName()] = versioned[loadsShard]{version: r.GetVersion(), value: loadsShard{n, shard}}
			changed = true
		}
		for _, name := range resp.GetRemovedResources() {
			if _, ok := s.loads[name]; ok {
				delete(s.loads, name)
				changed = true
			}
		}
	case xds.PolicyType:
		for _, r := range resp.GetResources() {
			p, err := xds.DecodePolicy(r.GetName(), r.GetResource())
			if err == nil && s.validatePolicy != nil {
				err = s.validatePolicy(p)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("refusing routing policy %q version %q: %w", r.GetName(), r.GetVersion(), err))
				continue
			}
			if s.policy != nil && s.policy.version == r.GetVersion() && r.GetVersion() != "" {
				continue
			}
			s.policy = &versioned[*xdsv1.RoutingPolicy]{version: r.GetVersion(), value: p}
			changed = true
		}
		for _, name := range resp.GetRemovedResources() {
			if name == xds.PolicyName && s.policy != nil {
				s.policy = nil
				changed = true
			}
		}
	case xds.KeysType:
		for _, r := range resp.GetResources() {
			k, err := xds.DecodeKeys(r.GetName(), r.GetResource())
			if err == nil && s.validateKeys != nil {
				err = s.validateKeys(k)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("refusing API keys %q version %q: %w", r.GetName(), r.GetVersion(), err))
				continue
			}
			if s.keys != nil && s.keys.version == r.GetVersion() && r.GetVersion() != "" {
				continue
			}
			s.keys = &versioned[*xdsv1.TenantKeys]{version: r.GetVersion(), value: k}
			changed = true
		}
		for _, name := range resp.GetRemovedResources() {
			if name == xds.KeysName && s.keys != nil {
				s.keys = nil
				changed = true
			}
		}
	default:
		return false, fmt.Errorf("applying delta response: unknown type %q", resp.GetTypeUrl())
	}
	return changed, errors.Join(errs...)
}

// keysText is the API keys' text ("" when none).
func (s *state) keysText() string {
	if s.keys == nil {
		return ""
	}
	return s.keys.value.GetKeys()
}

// dropLoads forgets the Loads shards not in keep; it reports whether any went.
func (s *state) dropLoads(keep map[string]bool) bool {
	dropped := false
	for n := range s.loads {
		if !keep[n] {
			delete(s.loads, n)
			dropped = true
		}
	}
	return dropped
}

// snapshot returns the current workers sorted by id, the policy (nil when none) and the
// pushed loads.
func (s *state) snapshot() ([]*xdsv1.Worker, *xdsv1.RoutingPolicy, xds.PushedLoads) {
	ws := s.sorted
	if ws == nil {
		ws = make([]*xdsv1.Worker, 0, len(s.workers))
		for _, id := range slices.Sorted(maps.Keys(s.workers)) {
			ws = append(ws, s.workers[id].value)
		}
		s.sorted = ws
	}
	var p *xdsv1.RoutingPolicy
	if s.policy != nil {
		p = s.policy.value
	}
	shards := make(map[uint32]xds.Shard, len(s.loads))
	for _, l := range s.loads {
		shards[l.value.n] = l.value.shard
	}
	return ws, p, xds.NewPushedLoads(shards)
}
