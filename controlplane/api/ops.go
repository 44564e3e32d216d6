package api

import (
	"context"
	"slices"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

// ops are the operations both transports serve, after authentication: the checks this
// package makes before the Backend, and nil results replaced by empty messages so that
// both transports can always marshal what they return. Errors are returned unmapped.
type ops struct{ b Backend }

func (o ops) listWorkers(ctx context.Context) (*operatorv1.ListWorkersResponse, error) {
	ws, err := o.b.ListWorkers(ctx)
	if err != nil {
		return nil, err
	}
	return &operatorv1.ListWorkersResponse{Workers: dropNil(ws)}, nil
}

func (o ops) getWorker(ctx context.Context, id string) (*operatorv1.Worker, error) {
	if id == "" {
		return nil, invalidf("missing worker id")
	}
	return orEmpty(o.b.GetWorker(ctx, id))
}

func (o ops) upsertWorker(ctx context.Context, spec *operatorv1.WorkerSpec) (*operatorv1.Worker, error) {
	if spec == nil {
		return nil, invalidf("missing worker spec")
	}
	if spec.GetId() == "" {
		return nil, invalidf("worker spec: missing id")
	}
	spec.Source = ""
	return orEmpty(o.b.UpsertWorker(ctx, spec))
}

func (o ops) removeWorker(ctx context.Context, id string) (*operatorv1.RemoveWorkerResponse, error) {
	if id == "" {
		return nil, invalidf("missing worker id")
	}
	if err := o.b.RemoveWorker(ctx, id); err != nil {
		return nil, err
	}
	return &operatorv1.RemoveWorkerResponse{}, nil
}

func (o ops) setDraining(ctx context.Context, id string, draining bool) (*operatorv1.Worker, error) {
	if id == "" {
		return nil, invalidf("missing worker id")
	}
	return orEmpty(o.b.SetDraining(ctx, id, draining))
}

func (o ops) getPolicy(ctx context.Context) (*operatorv1.Policy, error) {
	return orEmpty(o.b.GetPolicy(ctx))
}

func (o ops) setPolicy(ctx context.Context, p *operatorv1.Policy) (*operatorv1.Policy, error) {
	if p == nil {
		return nil, invalidf("missing policy")
	}
	p.Version = 0
	return orEmpty(o.b.SetPolicy(ctx, p))
}

func (o ops) getIndex(ctx context.Context) (*operatorv1.Index, error) {
	return orEmpty(o.b.GetIndex(ctx))
}

func (o ops) listProxies(ctx context.Context) (*operatorv1.ListProxiesResponse, error) {
	ps, err := o.b.ListProxies(ctx)
	if err != nil {
		return nil, err
	}
	return &operatorv1.ListProxiesResponse{Proxies: dropNil(ps)}, nil
}

func (o ops) listTenants(ctx context.Context) (*operatorv1.ListTenantsResponse, error) {
	ts, err := o.b.ListTenants(ctx)
	if err != nil {
		return nil, err
	}
	return &operatorv1.ListTenantsResponse{Tenants: dropNil(ts)}, nil
}

func (o ops) listAPIKeys(ctx context.Context) (*operatorv1.ListApiKeysResponse, error) {
	ks, err := o.b.ListAPIKeys(ctx)
	if err != nil {
		return nil, err
	}
	return &operatorv1.ListApiKeysResponse{Keys: dropNil(ks)}, nil
}

func (o ops) putAPIKey(ctx context.Context, k *operatorv1.ApiKey) (*operatorv1.ApiKey, error) {
	if k == nil || k.GetId() == "" {
		return nil, invalidf("missing API key id")
	}
	if k.GetKey() == "" && k.GetSha256() == "" {
		return nil, invalidf("API key %q: give the key or its sha256", k.GetId())
	}
	return orEmpty(o.b.PutAPIKey(ctx, k))
}

func (o ops) deleteAPIKey(ctx context.Context, id string) (*operatorv1.DeleteApiKeyResponse, error) {
	if id == "" {
		return nil, invalidf("missing API key id")
	}
	if err := o.b.DeleteAPIKey(ctx, id); err != nil {
		return nil, err
	}
	return &operatorv1.DeleteApiKeyResponse{}, nil
}

func (o ops) startRollout(ctx context.Context, req *operatorv1.StartRolloutRequest) (*operatorv1.Rollout, error) {
	c := req.GetCandidate()
	if c == nil {
		return nil, invalidf("missing candidate policy")
	}
	if c.GetCandidate() != nil || c.GetCandidateShare() != 0 || c.GetShadow() {
		return nil, invalidf("the candidate has a candidate, share or shadow of its own")
	}
	c.Version = 0
	spec := req.GetSpec()
	if spec == nil {
		spec = &operatorv1.RolloutSpec{}
	}
	return orEmpty(o.b.StartRollout(ctx, c, spec))
}

func (o ops) getRollout(ctx context.Context) (*operatorv1.Rollout, error) {
	return orEmpty(o.b.GetRollout(ctx))
}

func (o ops) controlRollout(ctx context.Context, action string) (*operatorv1.Rollout, error) {
	if !slices.Contains(RolloutActions, action) {
		return nil, invalidf("rollout action %q: want one of %v", action, RolloutActions)
	}
	return orEmpty(o.b.ControlRollout(ctx, action))
}

func (o ops) policyHistory(ctx context.Context, limit uint32) (*operatorv1.PolicyHistoryResponse, error) {
	n := int(min(limit, MaxHistoryLimit))
	if n == 0 {
		n = DefaultHistoryLimit
	}
	cs, err := o.b.PolicyHistory(ctx, n)
	if err != nil {
		return nil, err
	}
	return &operatorv1.PolicyHistoryResponse{Changes: dropNil(cs)}, nil
}

// orEmpty passes a Backend's result on, a new T in place of a nil one.
func orEmpty[T any, P interface{ *T }](m P, err error) (P, error) {
	if err != nil {
		return nil, err
	}
	if m == nil {
		m = new(T)
	}
	return m, nil
}

// dropNil returns s without its nil entries, which neither transport can marshal. It does
// not modify s.
func dropNil[P interface{ comparable }](s []P) []P {
	var zero P
	if !slices.Contains(s, zero) {
		return s
	}
	out := make([]P, 0, len(s))
	for _, m := range s {
		if m != zero {
			out = append(out, m)
		}
	}
	return out
}
