// Package apitest holds an in-memory api.Backend for tests of the operator API and its
// clients (kvrelay ctl).
package apitest

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/controlplane/api"
	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
	"github.com/kvrelay/kvrelay/xds/policy"
)

// Backend is an in-memory api.Backend. Workers upserted through it get Source "api"; only
// those can be removed (others: api.ErrConflict), as in the control plane. Specs need an
// http:// URL, and policies a known name (custom with a profile, and only then) and
// non-negative weights (api.ErrInvalid). It is safe for concurrent use; what it returns are
// copies.
type Backend struct {
	mu      sync.Mutex
	workers map[string]*operatorv1.Worker
	policy  *operatorv1.Policy
	index   *operatorv1.Index
	proxies []*operatorv1.Proxy
	tenants []*operatorv1.Tenant
	keys    []*operatorv1.ApiKey
	calls   []string
	rollout *operatorv1.Rollout
	history []*operatorv1.PolicyChange
}

// New returns a Backend holding copies of workers and the default policy (version 1).
func New(workers ...*operatorv1.Worker) *Backend {
	b := &Backend{
		workers: map[string]*operatorv1.Worker{},
		policy: &operatorv1.Policy{Version: 1, Policy: policy.KV, OverlapWeight: policy.DefaultOverlapWeight, QueueWeight: policy.DefaultQueueWeight,
			CacheThreshold: policy.DefaultCacheThreshold, TierWeights: policy.DefaultTierWeights(), BusyKvFraction: 0.95},
		index: &operatorv1.Index{},
	}
	for _, w := range workers {
		b.workers[w.GetSpec().GetId()] = proto.CloneOf(w)
	}
	return b
}

// SetIndex sets what GetIndex returns.
func (b *Backend) SetIndex(x *operatorv1.Index) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.index = proto.CloneOf(x)
}

// SetProxies sets what ListProxies returns.
func (b *Backend) SetProxies(ps ...*operatorv1.Proxy) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.proxies = clones(ps)
}

// Calls lists the Backend methods called so far ("SetDraining w1 true", …).
func (b *Backend) Calls() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.calls)
}

func (b *Backend) called(format string, args ...any) {
	b.calls = append(b.calls, fmt.Sprintf(format, args...))
}

func (b *Backend) ListWorkers(context.Context) ([]*operatorv1.Worker, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("ListWorkers")
	ids := make([]string, 0, len(b.workers))
	for id := range b.workers {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	out := make([]*operatorv1.Worker, 0, len(ids))
	for _, id := range ids {
		out = append(out, proto.CloneOf(b.workers[id]))
	}
	return out, nil
}

func (b *Backend) GetWorker(_ context.Context, id string) (*operatorv1.Worker, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("GetWorker %s", id)
	w, ok := b.workers[id]
	if !ok {
		return nil, fmt.Errorf("%w: worker %q", api.ErrNotFound, id)
	}
	return proto.CloneOf(w), nil
}

func (b *Backend) UpsertWorker(_ context.Context, spec *operatorv1.WorkerSpec) (*operatorv1.Worker, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("UpsertWorker %s", spec.GetId())
	if !strings.HasPrefix(spec.GetUrl(), "http://") {
		return nil, fmt.Errorf("%w: worker %q: url %q is not http://host:port", api.ErrInvalid, spec.GetId(), spec.GetUrl())
	}
	spec = proto.CloneOf(spec)
	spec.Source = "api"
	if spec.Engine == "" {
		spec.Engine = "vllm"
	}
	if spec.Role == "" {
		spec.Role = "both"
	}
	w, ok := b.workers[spec.Id]
	if !ok {
		w = &operatorv1.Worker{Status: &operatorv1.WorkerStatus{Slot: uint32(len(b.workers))}}
		b.workers[spec.Id] = w
	}
	w.Spec = spec
	return proto.CloneOf(w), nil
}

func (b *Backend) RemoveWorker(_ context.Context, id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("RemoveWorker %s", id)
	w, ok := b.workers[id]
	if !ok {
		return fmt.Errorf("%w: worker %q", api.ErrNotFound, id)
	}
	if src := w.GetSpec().GetSource(); src != "api" {
		return fmt.Errorf("%w: worker %q comes from the %s; remove it there", api.ErrConflict, id, src)
	}
	delete(b.workers, id)
	return nil
}

func (b *Backend) SetDraining(_ context.Context, id string, draining bool) (*operatorv1.Worker, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("SetDraining %s %t", id, draining)
	w, ok := b.workers[id]
	if !ok {
		return nil, fmt.Errorf("%w: worker %q", api.ErrNotFound, id)
	}
	if w.Status == nil {
		w.Status = &operatorv1.WorkerStatus{}
	}
	w.Status.Draining = draining
	return proto.CloneOf(w), nil
}

func (b *Backend) GetPolicy(context.Context) (*operatorv1.Policy, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("GetPolicy")
	return proto.CloneOf(b.policy), nil
}

func (b *Backend) SetPolicy(_ context.Context, p *operatorv1.Policy) (*operatorv1.Policy, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("SetPolicy %s", p.GetPolicy())
	if custom := p.GetPolicy() == policy.Custom; custom != (p.GetProfile() != nil) || !custom && !slices.Contains(policy.Names(), p.GetPolicy()) {
		return nil, fmt.Errorf("%w: unknown policy %q", api.ErrInvalid, p.GetPolicy())
	}
	if p.GetOverlapWeight() < 0 || p.GetTemperature() < 0 {
		return nil, fmt.Errorf("%w: negative weight", api.ErrInvalid)
	}
	p = proto.CloneOf(p)
	p.Version = b.policy.Version + 1
	b.policy = p
	b.history = append(b.history, &operatorv1.PolicyChange{Policy: proto.CloneOf(p), UnixMs: int64(len(b.history) + 1), Cause: "api"})
	return proto.CloneOf(p), nil
}

// StartRollout records a rollout of the candidate in its first state (shadow with a shadow
// step, else canary at the first step); it is judged by nothing and moves only by
// ControlRollout.
func (b *Backend) StartRollout(_ context.Context, c *operatorv1.Policy, spec *operatorv1.RolloutSpec) (*operatorv1.Rollout, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("StartRollout %s", c.GetPolicy())
	if r := b.rollout; r != nil && (r.State == "shadow" || r.State == "canary" || r.State == "paused") {
		return nil, fmt.Errorf("%w: rollout %d is %s", api.ErrConflict, r.Id, r.State)
	}
	r := &operatorv1.Rollout{Id: b.rollout.GetId() + 1, State: "canary", StableVersion: b.policy.Version,
		CandidateVersion: b.policy.Version + 1, Candidate: proto.CloneOf(c), Spec: proto.CloneOf(spec)}
	r.Candidate.Version = r.CandidateVersion
	if spec.GetShadowMs() > 0 {
		r.State, r.Step, r.Shadow = "shadow", -1, true
	} else if len(spec.GetSteps()) > 0 {
		r.Share = spec.GetSteps()[0]
	}
	b.rollout = r
	return proto.CloneOf(r), nil
}

func (b *Backend) GetRollout(context.Context) (*operatorv1.Rollout, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("GetRollout")
	if b.rollout == nil {
		return nil, fmt.Errorf("%w: no rollout has run", api.ErrNotFound)
	}
	return proto.CloneOf(b.rollout), nil
}

// ControlRollout moves the rollout: pause, resume (to canary), promote, abort.
func (b *Backend) ControlRollout(_ context.Context, action string) (*operatorv1.Rollout, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("ControlRollout %s", action)
	r := b.rollout
	if r == nil {
		return nil, fmt.Errorf("%w: no rollout has run", api.ErrNotFound)
	}
	next := map[string]string{"pause": "paused", "resume": "canary", "promote": "promoted", "abort": "aborted"}[action]
	if r.State == "promoted" || r.State == "aborted" || r.State == "rolled_back" {
		return nil, fmt.Errorf("%w: rollout %d already %s", api.ErrConflict, r.Id, r.State)
	}
	r.State = next
	return proto.CloneOf(r), nil
}

// PolicyHistory lists the policies SetPolicy stored, the latest first.
func (b *Backend) PolicyHistory(_ context.Context, limit int) ([]*operatorv1.PolicyChange, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("PolicyHistory %d", limit)
	var out []*operatorv1.PolicyChange
	for i := len(b.history) - 1; i >= 0 && len(out) < limit; i-- {
		out = append(out, proto.CloneOf(b.history[i]))
	}
	return out, nil
}

func (b *Backend) GetIndex(context.Context) (*operatorv1.Index, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("GetIndex")
	return proto.CloneOf(b.index), nil
}

func (b *Backend) ListAPIKeys(context.Context) ([]*operatorv1.ApiKey, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("ListAPIKeys")
	return clones(b.keys), nil
}

func (b *Backend) PutAPIKey(_ context.Context, k *operatorv1.ApiKey) (*operatorv1.ApiKey, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("PutAPIKey")
	k = proto.CloneOf(k)
	k.Key = ""
	b.keys = slices.DeleteFunc(b.keys, func(o *operatorv1.ApiKey) bool { return o.GetId() == k.GetId() })
	b.keys = append(b.keys, k)
	return proto.CloneOf(k), nil
}

func (b *Backend) DeleteAPIKey(_ context.Context, id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("DeleteAPIKey")
	n := len(b.keys)
	b.keys = slices.DeleteFunc(b.keys, func(o *operatorv1.ApiKey) bool { return o.GetId() == id })
	if len(b.keys) == n {
		return fmt.Errorf("%w: API key %q", api.ErrNotFound, id)
	}
	return nil
}

// SetTenants sets what ListTenants returns.
func (b *Backend) SetTenants(ts ...*operatorv1.Tenant) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tenants = clones(ts)
}

func (b *Backend) ListTenants(context.Context) ([]*operatorv1.Tenant, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("ListTenants")
	return clones(b.tenants), nil
}

func (b *Backend) ListProxies(context.Context) ([]*operatorv1.Proxy, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.called("ListProxies")
	return clones(b.proxies), nil
}

func clones[M proto.Message](ms []M) []M {
	out := make([]M, len(ms))
	for i, m := range ms {
		out[i] = proto.CloneOf(m)
	}
	return out
}

var _ api.Backend = (*Backend)(nil)
