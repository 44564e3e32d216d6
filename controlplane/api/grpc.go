package api

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

// NewGRPC returns the Operator gRPC service on b. It checks the bearer token in each call's
// "authorization" metadata as opts say, and returns errors as gRPC statuses (ErrNotFound:
// NotFound, ErrInvalid: InvalidArgument, ErrConflict: FailedPrecondition, a missing or wrong
// token: Unauthenticated, no token configured: PermissionDenied).
func NewGRPC(b Backend, opts Options) operatorv1.OperatorServer {
	return &grpcServer{ops: ops{b}, auth: newAuthorizer(opts)}
}

// Register registers NewGRPC(b, opts) on s.
func Register(s grpc.ServiceRegistrar, b Backend, opts Options) {
	operatorv1.RegisterOperatorServer(s, NewGRPC(b, opts))
}

type grpcServer struct {
	operatorv1.UnimplementedOperatorServer
	ops  ops
	auth authorizer
}

// authorize checks the call's token; mutating calls always need it.
func (s *grpcServer) authorize(ctx context.Context, mutating bool) error {
	var authz string
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get("authorization"); len(v) > 0 {
			authz = v[0]
		}
	}
	if e := s.auth.check(authz, mutating); e != nil {
		return e
	}
	return nil
}

// call authorizes, runs op and maps its error to a gRPC status.
func call[T any](s *grpcServer, ctx context.Context, mutating bool, op func() (T, error)) (T, error) {
	var zero T
	if err := s.authorize(ctx, mutating); err != nil {
		return zero, err
	}
	r, err := op()
	if err != nil {
		return zero, toError(err)
	}
	return r, nil
}

func (s *grpcServer) ListWorkers(ctx context.Context, _ *operatorv1.ListWorkersRequest) (*operatorv1.ListWorkersResponse, error) {
	return call(s, ctx, false, func() (*operatorv1.ListWorkersResponse, error) { return s.ops.listWorkers(ctx) })
}

func (s *grpcServer) GetWorker(ctx context.Context, req *operatorv1.GetWorkerRequest) (*operatorv1.Worker, error) {
	return call(s, ctx, false, func() (*operatorv1.Worker, error) { return s.ops.getWorker(ctx, req.GetId()) })
}

func (s *grpcServer) UpsertWorker(ctx context.Context, req *operatorv1.UpsertWorkerRequest) (*operatorv1.Worker, error) {
	return call(s, ctx, true, func() (*operatorv1.Worker, error) { return s.ops.upsertWorker(ctx, req.GetSpec()) })
}

func (s *grpcServer) RemoveWorker(ctx context.Context, req *operatorv1.RemoveWorkerRequest) (*operatorv1.RemoveWorkerResponse, error) {
	return call(s, ctx, true, func() (*operatorv1.RemoveWorkerResponse, error) { return s.ops.removeWorker(ctx, req.GetId()) })
}

func (s *grpcServer) Drain(ctx context.Context, req *operatorv1.DrainRequest) (*operatorv1.Worker, error) {
	return call(s, ctx, true, func() (*operatorv1.Worker, error) { return s.ops.setDraining(ctx, req.GetId(), true) })
}

func (s *grpcServer) Undrain(ctx context.Context, req *operatorv1.UndrainRequest) (*operatorv1.Worker, error) {
	return call(s, ctx, true, func() (*operatorv1.Worker, error) { return s.ops.setDraining(ctx, req.GetId(), false) })
}

func (s *grpcServer) GetPolicy(ctx context.Context, _ *operatorv1.GetPolicyRequest) (*operatorv1.Policy, error) {
	return call(s, ctx, false, func() (*operatorv1.Policy, error) { return s.ops.getPolicy(ctx) })
}

func (s *grpcServer) SetPolicy(ctx context.Context, req *operatorv1.SetPolicyRequest) (*operatorv1.Policy, error) {
	return call(s, ctx, true, func() (*operatorv1.Policy, error) { return s.ops.setPolicy(ctx, req.GetPolicy()) })
}

func (s *grpcServer) GetIndex(ctx context.Context, _ *operatorv1.GetIndexRequest) (*operatorv1.Index, error) {
	return call(s, ctx, false, func() (*operatorv1.Index, error) { return s.ops.getIndex(ctx) })
}

func (s *grpcServer) ListProxies(ctx context.Context, _ *operatorv1.ListProxiesRequest) (*operatorv1.ListProxiesResponse, error) {
	return call(s, ctx, false, func() (*operatorv1.ListProxiesResponse, error) { return s.ops.listProxies(ctx) })
}

func (s *grpcServer) ListTenants(ctx context.Context, _ *operatorv1.ListTenantsRequest) (*operatorv1.ListTenantsResponse, error) {
	return call(s, ctx, false, func() (*operatorv1.ListTenantsResponse, error) { return s.ops.listTenants(ctx) })
}

func (s *grpcServer) ListApiKeys(ctx context.Context, _ *operatorv1.ListApiKeysRequest) (*operatorv1.ListApiKeysResponse, error) {
	return call(s, ctx, false, func() (*operatorv1.ListApiKeysResponse, error) { return s.ops.listAPIKeys(ctx) })
}

func (s *grpcServer) PutApiKey(ctx context.Context, req *operatorv1.PutApiKeyRequest) (*operatorv1.ApiKey, error) {
	return call(s, ctx, true, func() (*operatorv1.ApiKey, error) { return s.ops.putAPIKey(ctx, req.GetKey()) })
}

func (s *grpcServer) DeleteApiKey(ctx context.Context, req *operatorv1.DeleteApiKeyRequest) (*operatorv1.DeleteApiKeyResponse, error) {
	return call(s, ctx, true, func() (*operatorv1.DeleteApiKeyResponse, error) { return s.ops.deleteAPIKey(ctx, req.GetId()) })
}

func (s *grpcServer) StartRollout(ctx context.Context, req *operatorv1.StartRolloutRequest) (*operatorv1.Rollout, error) {
	return call(s, ctx, true, func() (*operatorv1.Rollout, error) { return s.ops.startRollout(ctx, req) })
}

func (s *grpcServer) GetRollout(ctx context.Context, _ *operatorv1.GetRolloutRequest) (*operatorv1.Rollout, error) {
	return call(s, ctx, false, func() (*operatorv1.Rollout, error) { return s.ops.getRollout(ctx) })
}

func (s *grpcServer) ControlRollout(ctx context.Context, req *operatorv1.ControlRolloutRequest) (*operatorv1.Rollout, error) {
	return call(s, ctx, true, func() (*operatorv1.Rollout, error) { return s.ops.controlRollout(ctx, req.GetAction()) })
}

func (s *grpcServer) PolicyHistory(ctx context.Context, req *operatorv1.PolicyHistoryRequest) (*operatorv1.PolicyHistoryResponse, error) {
	return call(s, ctx, false, func() (*operatorv1.PolicyHistoryResponse, error) { return s.ops.policyHistory(ctx, req.GetLimit()) })
}

var _ operatorv1.OperatorServer = (*grpcServer)(nil)
