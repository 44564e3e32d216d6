package controlplane

import (
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	"github.com/kvrelay/kvrelay/controlplane/api"
)

// SetPlanner serves a planner on the operator API: h under /v1/planner/ (read-only, GET,
// authenticated as the API's reads; see planner.Planner.Handler) and c's metrics on
// /metrics. Call it once, before or after Start.
func (s *Server) SetPlanner(h http.Handler, c prometheus.Collector) error {
	if c != nil {
		if err := s.metrics.Register(c); err != nil {
			return fmt.Errorf("registering the planner's metrics: %w", err)
		}
	}
	s.planner.Store(&h)
	return nil
}

// plannerRoute serves /v1/planner/ through the planner set, 404 until one is.
func (s *Server) plannerRoute(opts api.Options) http.Handler {
	return api.ReadOnly(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := s.planner.Load()
		if h == nil {
			e := &api.Error{Code: codes.NotFound, Message: "no planner runs in this control plane (kvrelay up --planner)"}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(e.HTTPStatus())
			fmt.Fprintf(w, "{\"error\":{\"message\":%q,\"code\":%q}}\n", e.Message, api.CodeName(e.Code))
			return
		}
		(*h).ServeHTTP(w, r)
	}), opts)
}
