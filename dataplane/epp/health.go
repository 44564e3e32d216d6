package epp

import (
	"context"
	"time"

	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// The gRPC health services the endpoint picker protocol names.
const (
	// HealthLiveness answers SERVING while the process answers at all.
	HealthLiveness = "liveness"
	// HealthReadiness answers SERVING once the picker can pick (workers known; under a
	// control plane, its state arrived) and until it drains.
	HealthReadiness = "readiness"
)

// HealthExtProc is the ext_proc service's own health name, as readiness.
var HealthExtProc = extproc.ExternalProcessor_ServiceDesc.ServiceName

// RunHealth keeps h's statuses current until ctx ends (when every service turns
// NOT_SERVING): liveness at once, readiness and the ext_proc service as the picker's
// Ready says, checked every interval.
func (s *Server) RunHealth(ctx context.Context, h *health.Server, interval time.Duration) {
	h.SetServingStatus(HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	set := func(ready bool) {
		st := healthpb.HealthCheckResponse_NOT_SERVING
		if ready {
			st = healthpb.HealthCheckResponse_SERVING
		}
		h.SetServingStatus(HealthReadiness, st)
		h.SetServingStatus(HealthExtProc, st)
		h.SetServingStatus("", st)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		set(s.picker.Ready() && !s.picker.Draining())
		select {
		case <-ctx.Done():
			h.Shutdown()
			return
		case <-t.C:
		}
	}
}
