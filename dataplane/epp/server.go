package epp

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/dataplane/decide"
)

// The protocol's names (Gateway API Inference Extension, endpoint picker protocol v1).
const (
	// DestinationKey is the header, and the key in DestinationNamespace of the dynamic
	// metadata, that carries the picked endpoints.
	DestinationKey = "x-gateway-destination-endpoint"
	// DestinationNamespace is the dynamic metadata namespace of the pick, and the filter
	// metadata namespace where the gateway reports the endpoint that served (ServedKey).
	DestinationNamespace = "envoy.lb"
	// ServedKey names the endpoint that served the request, in the response's metadata.
	ServedKey = "x-gateway-destination-endpoint-served"
	// SubsetNamespace and SubsetKey hold the candidate subset hint in the request's filter
	// metadata.
	SubsetNamespace = "envoy.lb.subset_hint"
	SubsetKey       = "x-gateway-destination-endpoint-subset"
	// ScoresKey is the optional per-endpoint scores entry beside DestinationKey.
	ScoresKey = "x-gateway-destination-endpoint-scores"
	// PrefillerHeader names the prefill worker of a disaggregated request (llm-d's routing
	// sidecar convention).
	PrefillerHeader = "x-prefiller-host-port"
	// ObjectiveHeader and ObjectiveHeaderOld name the request's inference objective.
	ObjectiveHeader    = "x-llm-d-inference-objective"
	ObjectiveHeaderOld = "x-gateway-inference-objective"
	// ConformanceSelectHeader and ConformanceServedHeader are the conformance suite's
	// (Options.Conformance).
	ConformanceSelectHeader = "test-epp-endpoint-selection"
	ConformanceServedHeader = "x-conformance-test-served-endpoint"
	// WorkerHeader and DecisionHeader go on the response with Options.ExposeDecision: the
	// picked worker's id, and every candidate's prediction.
	WorkerHeader   = "x-kvrelay-worker"
	DecisionHeader = "x-kvrelay-decision"
)

// Picker routes requests: the routing core (decide.Core.Pick) under its owner's lifecycle,
// a *proxy.Server in PickOnly mode. Called from every stream's goroutine at once.
type Picker interface {
	Pick(ctx context.Context, r *decide.PickRequest) (*decide.Pick, error)
	// PickAny picks the least loaded healthy worker for a request without a body (none to
	// route on), among subset when hasSubset.
	PickAny(subset []string, hasSubset bool) (string, error)
	// Ready reports whether there are workers to pick from (and, under a control plane,
	// its state has arrived).
	Ready() bool
	Draining() bool
}

// Options configures a Server.
type Options struct {
	// Fallbacks is how many endpoints beyond the picked one the destination lists, each the
	// best pick with the ones before it left out, for a gateway that retries down the list.
	Fallbacks int
	// EmitScores adds x-gateway-destination-endpoint-scores to the dynamic metadata: each
	// candidate's predicted TTFT in milliseconds (lower is better), under a policy that
	// predicts.
	EmitScores bool
	// ExposeDecision adds x-kvrelay-worker and x-kvrelay-decision (every candidate's
	// predicted TTFT, queue, prefill and cached blocks) to responses that pass through.
	ExposeDecision bool
	// Objectives maps inference objective names (x-llm-d-inference-objective) to
	// priorities (higher is more urgent; below zero is sheddable). An objective not listed
	// that reads as an integer is that priority; any other counts as unknown and routes at
	// the request's own priority.
	Objectives map[string]int
	// Conformance turns on what the Gateway API Inference Extension's conformance suite
	// asks of a picker beside the protocol (as its reference lightweight picker does): the
	// request header test-epp-endpoint-selection (comma-separated IPs or ip:port) restricts
	// the candidates, all of them when it names none, and the response header
	// x-conformance-test-served-endpoint repeats the endpoint the gateway reports as having
	// served. For test environments only.
	Conformance bool
	// MaxBodyBytes bounds a request body the picker reassembles (default 64 MiB); a larger
	// one gets 413.
	MaxBodyBytes int
	// Registerer receives the picker's metrics (nil: none).
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Server is the ext_proc service. Construct it with New and register it on a gRPC server
// with Register.
type Server struct {
	extproc.UnimplementedExternalProcessorServer
	picker Picker
	opts   Options
	log    *slog.Logger
	m      *metrics
}

// New returns a picker service over p.
func New(p Picker, opts Options) *Server {
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = 64 << 20
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Server{picker: p, opts: opts, log: opts.Logger, m: newMetrics(opts.Registerer)}
}

// Register adds the service to g.
func (s *Server) Register(g *grpc.Server) { extproc.RegisterExternalProcessorServer(g, s) }

// Process serves one request's stream.
func (s *Server) Process(srv extproc.ExternalProcessor_ProcessServer) error {
	st := &stream{s: s, srv: srv, ctx: srv.Context()}
	s.m.streams.Inc()
	defer s.m.streams.Dec()
	defer st.end()
	for {
		req, err := srv.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled || st.ctx.Err() != nil {
				return nil
			}
			return status.Errorf(codes.Unknown, "receiving: %v", err)
		}
		done, err := st.handle(req)
		if err != nil {
			if st.ctx.Err() != nil {
				return nil // the gateway went away
			}
			s.log.Debug("ext_proc stream failed", "err", err)
			return status.Errorf(codes.Unknown, "%v", err)
		}
		if done {
			return nil
		}
	}
}

// objectivePriority maps an inference objective to a priority (ok false: unknown).
func (s *Server) objectivePriority(name string) (int, bool) {
	name = strings.TrimSpace(name)
	if p, ok := s.opts.Objectives[name]; ok {
		return p, true
	}
	if p, err := strconv.Atoi(name); err == nil {
		return p, true
	}
	return 0, false
}

type metrics struct {
	picks     *prometheus.CounterVec // result
	pickTime  prometheus.Histogram
	streams   prometheus.Gauge
	subset    *prometheus.CounterVec // outcome: none, used, empty
	objective *prometheus.CounterVec // outcome: mapped, unknown
	modes     *prometheus.CounterVec // request body mode
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		picks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_epp_picks_total",
			Help: "Requests the endpoint picker answered, by result: picked, bodiless (no body to route on: the least loaded worker), or the status of the immediate response it gave instead (400, 404, 413, 429, 499, 503).",
		}, []string{"result"}),
		pickTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrelay_epp_pick_seconds",
			Help:    "Time from a request's whole body at the endpoint picker to its pick's answer: parse, tokenize (an engine's /tokenize round trip included), match, score and pick, plus any wait in the admission queue.",
			Buckets: []float64{50e-6, 100e-6, 200e-6, 350e-6, 500e-6, 750e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1, 5},
		}),
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvrelay_epp_streams", Help: "ext_proc streams open: requests between their headers and the end of their answer.",
		}),
		subset: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_epp_subset_hints_total", Help: "Picks by the gateway's subset hint: none, used (the pick was among its endpoints), empty (no endpoint allowed: 503).",
		}, []string{"outcome"}),
		objective: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_epp_objectives_total", Help: "Requests naming an inference objective, by outcome: mapped to a priority, or unknown (routed at the request's own priority).",
		}, []string{"outcome"}),
		modes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrelay_epp_body_modes_total", Help: "Requests by the gateway's request body mode (BUFFERED, FULL_DUPLEX_STREAMED, NONE or other).",
		}, []string{"mode"}),
	}
	if reg != nil {
		reg.MustRegister(m.picks, m.pickTime, m.streams, m.subset, m.objective, m.modes)
	}
	return m
}

// pickSeconds is the time since t0 in seconds.
func pickSeconds(t0 time.Time) float64 { return time.Since(t0).Seconds() }
