package epp

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrelay/kvrelay/dataplane/decide"
)

// chunkBytes bounds the body a StreamedBodyResponse carries (as llm-d's picker does: under
// Envoy's default gRPC message limits with room for the envelope).
const chunkBytes = 62000

// stream is one request's ext_proc stream: its phase, what it gathered and its pick.
type stream struct {
	s   *Server
	srv extproc.ExternalProcessor_ProcessServer
	ctx context.Context

	reqMode, respMode filterv3.ProcessingMode_BodySendMode
	configured        bool // the first message came (it carries the protocol configuration)

	header    map[string]string // the request's headers by lower-case name
	body      []byte
	subset    []string
	hasSubset bool
	bodyStart time.Time // when the first body chunk came

	decided  bool // the request phase has been answered with a destination
	pick     *decide.Pick
	headDone bool // the response's headers were answered
}

// handle answers one message of the stream; done reports that the stream has nothing more
// to do (an immediate response was sent).
func (st *stream) handle(req *extproc.ProcessingRequest) (done bool, err error) {
	if !st.configured {
		st.configured = true
		st.reqMode, st.respMode = filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED
		if pc := req.GetProtocolConfig(); pc != nil {
			st.reqMode, st.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
		}
	}
	switch v := req.GetRequest().(type) {
	case *extproc.ProcessingRequest_RequestHeaders:
		st.noteSubset(req)
		return st.requestHeaders(v.RequestHeaders)
	case *extproc.ProcessingRequest_RequestBody:
		st.noteSubset(req)
		return st.requestBody(v.RequestBody)
	case *extproc.ProcessingRequest_RequestTrailers:
		st.noteSubset(req)
		if !st.decided {
			// A body that ended without end_of_stream (trailers follow): route it now.
			if done, err := st.decide(); done || err != nil {
				return done, err
			}
		}
		return false, st.send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_RequestTrailers{RequestTrailers: &extproc.TrailersResponse{}}})
	case *extproc.ProcessingRequest_ResponseHeaders:
		return false, st.responseHeaders(req, v.ResponseHeaders)
	case *extproc.ProcessingRequest_ResponseBody:
		return false, st.responseBody(v.ResponseBody)
	case *extproc.ProcessingRequest_ResponseTrailers:
		st.finish()
		return false, st.send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extproc.TrailersResponse{}}})
	default:
		return false, errors.New("a processing request without a request")
	}
}

func (st *stream) send(r *extproc.ProcessingResponse) error { return st.srv.Send(r) }

// requestHeaders takes the request's headers. A request without a body is routed at once;
// in BUFFERED mode the headers are answered at once (the gateway waits for that before it
// sends the body); in FULL_DUPLEX_STREAMED mode their answer waits for the pick.
func (st *stream) requestHeaders(h *extproc.HttpHeaders) (bool, error) {
	st.header = make(map[string]string, len(h.GetHeaders().GetHeaders()))
	for _, hv := range h.GetHeaders().GetHeaders() {
		st.header[strings.ToLower(hv.GetKey())] = headerValue(hv)
	}
	st.s.m.modes.WithLabelValues(st.reqMode.String()).Inc()
	if h.GetEndOfStream() || st.reqMode == filterv3.ProcessingMode_NONE {
		return st.bodiless()
	}
	switch st.reqMode {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return false, nil
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		return false, st.send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_RequestHeaders{RequestHeaders: &extproc.HeadersResponse{}}})
	default:
		// STREAMED (and GRPC) send headers upstream before the body could be routed on.
		return true, st.immediate(&decide.Refusal{Status: 500, Code: "unsupported_body_mode",
			Message: "the endpoint picker needs the request body before the headers go upstream: configure request_body_mode BUFFERED or FULL_DUPLEX_STREAMED, not " + st.reqMode.String()})
	}
}

// requestBody gathers the body; once it is whole the request is routed.
func (st *stream) requestBody(b *extproc.HttpBody) (bool, error) {
	if st.decided {
		return false, errors.New("a request body chunk after the request was routed")
	}
	if st.bodyStart.IsZero() {
		st.bodyStart = time.Now()
	}
	if len(st.body)+len(b.GetBody()) > st.s.opts.MaxBodyBytes {
		return true, st.immediate(&decide.Refusal{Status: 413, Code: "request_too_large",
			Message: "the request body is larger than the endpoint picker takes (" + strconv.Itoa(st.s.opts.MaxBodyBytes) + " bytes)"})
	}
	st.body = append(st.body, b.GetBody()...)
	if !b.GetEndOfStream() && st.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return false, nil
	}
	// BUFFERED sends the body whole in one message (end_of_stream false only when trailers
	// follow, which wait for this answer).
	return st.decide()
}

// decide routes the whole request and answers the request phase with the destination.
func (st *stream) decide() (bool, error) {
	s := st.s
	st.decided = true
	t0 := st.bodyStart
	if t0.IsZero() {
		t0 = time.Now()
	}
	r := &decide.PickRequest{Path: st.header[":path"], Header: st.header, Body: st.body, Subset: st.subset, HasSubset: st.hasSubset,
		StreamedResponse: st.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED || st.respMode == filterv3.ProcessingMode_STREAMED}
	if obj := firstOf(st.header, ObjectiveHeader, ObjectiveHeaderOld); obj != "" {
		if p, ok := s.objectivePriority(obj); ok {
			r.Priority, r.HasPriority = p, true
			s.m.objective.WithLabelValues("mapped").Inc()
		} else {
			s.m.objective.WithLabelValues("unknown").Inc()
		}
	}
	selected := false
	if sel := st.header[ConformanceSelectHeader]; s.opts.Conformance && sel != "" && !st.hasSubset {
		for _, e := range strings.Split(sel, ",") {
			if e = strings.TrimSpace(e); e != "" {
				r.Subset = append(r.Subset, e)
			}
		}
		r.HasSubset, selected = true, true
	}
	p, err := s.picker.Pick(st.ctx, r)
	var pe *decide.Refusal
	if selected && errors.As(err, &pe) && pe.Status == 503 {
		// The conformance header named no known endpoint: every one is a candidate.
		r.Subset, r.HasSubset = nil, false
		p, err = s.picker.Pick(st.ctx, r)
	}
	s.m.pickTime.Observe(pickSeconds(t0))
	if err != nil {
		if !errors.As(err, &pe) {
			pe = &decide.Refusal{Status: 500, Message: err.Error()}
		}
		if st.hasSubset && pe.Status == 503 {
			s.m.subset.WithLabelValues("empty").Inc()
		}
		return true, st.immediate(pe)
	}
	st.pick = p
	s.m.picks.WithLabelValues("picked").Inc()
	if st.hasSubset {
		s.m.subset.WithLabelValues("used").Inc()
	} else {
		s.m.subset.WithLabelValues("none").Inc()
	}
	dest := p.Endpoint()
	if n := s.opts.Fallbacks; n > 0 {
		dest = strings.Join(p.Fallbacks([]string{dest}, n), ",")
	}
	set := []*corev3.HeaderValueOption{
		headerOption(DestinationKey, dest),
	}
	if pf := p.Prefiller(); pf != "" {
		set = append(set, headerOption(PrefillerHeader, pf))
	}
	body := p.Body()
	if p.Mutated() {
		set = append(set, headerOption("content-length", strconv.Itoa(len(body))))
	}
	common := &extproc.CommonResponse{ClearRouteCache: true, HeaderMutation: &extproc.HeaderMutation{SetHeaders: set}}
	meta := st.destinationMetadata(dest, p)
	if st.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		if err := st.send(&extproc.ProcessingResponse{
			Response:        &extproc.ProcessingResponse_RequestHeaders{RequestHeaders: &extproc.HeadersResponse{Response: common}},
			DynamicMetadata: meta,
		}); err != nil {
			return false, err
		}
		return false, st.streamBody(body, true, func(c *extproc.CommonResponse) *extproc.ProcessingResponse {
			return &extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_RequestBody{RequestBody: &extproc.BodyResponse{Response: c}}}
		})
	}
	// BUFFERED: the body's answer carries the destination; the body changes only when the
	// pick changed it.
	if p.Mutated() {
		common.BodyMutation = &extproc.BodyMutation{Mutation: &extproc.BodyMutation_Body{Body: body}}
	}
	return false, st.send(&extproc.ProcessingResponse{
		Response:        &extproc.ProcessingResponse_RequestBody{RequestBody: &extproc.BodyResponse{Response: common}},
		DynamicMetadata: meta,
	})
}

// bodiless routes a request without a body (nothing to route on): the least loaded healthy
// worker.
func (st *stream) bodiless() (bool, error) {
	s := st.s
	st.decided = true
	ep, err := s.picker.PickAny(st.subset, st.hasSubset)
	if err != nil {
		var pe *decide.Refusal
		if !errors.As(err, &pe) {
			pe = &decide.Refusal{Status: 503, Message: err.Error(), Code: "no_worker"}
		}
		return true, st.immediate(pe)
	}
	s.m.picks.WithLabelValues("bodiless").Inc()
	return false, st.send(&extproc.ProcessingResponse{
		Response: &extproc.ProcessingResponse_RequestHeaders{RequestHeaders: &extproc.HeadersResponse{Response: &extproc.CommonResponse{
			ClearRouteCache: true,
			HeaderMutation:  &extproc.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{headerOption(DestinationKey, ep)}},
		}}},
		DynamicMetadata: st.destinationMetadata(ep, nil),
	})
}

// destinationMetadata is envoy.lb → x-gateway-destination-endpoint: dest, with the
// candidates' scores when asked for.
func (st *stream) destinationMetadata(dest string, p *decide.Pick) *structpb.Struct {
	fields := map[string]*structpb.Value{DestinationKey: structpb.NewStringValue(dest)}
	if st.s.opts.EmitScores && p != nil {
		scores := map[string]*structpb.Value{}
		p.Scores(func(ep string, ttftMs float64) { scores[ep] = structpb.NewNumberValue(ttftMs) })
		if len(scores) > 0 {
			fields[ScoresKey] = structpb.NewStructValue(&structpb.Struct{Fields: scores})
		}
	}
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		DestinationNamespace: structpb.NewStructValue(&structpb.Struct{Fields: fields}),
	}}
}

// streamBody sends body as streamed body responses of at most chunkBytes each, the last
// with end_of_stream when eos (an empty body is one empty response).
func (st *stream) streamBody(body []byte, eos bool, wrap func(*extproc.CommonResponse) *extproc.ProcessingResponse) error {
	for off := 0; ; {
		end := min(off+chunkBytes, len(body))
		last := end == len(body)
		if err := st.send(wrap(&extproc.CommonResponse{BodyMutation: &extproc.BodyMutation{Mutation: &extproc.BodyMutation_StreamedResponse{
			StreamedResponse: &extproc.StreamedBodyResponse{Body: body[off:end], EndOfStream: eos && last},
		}}})); err != nil {
			return err
		}
		if last {
			return nil
		}
		off = end
	}
}

// immediate answers the request with an error of its own instead of an endpoint.
func (st *stream) immediate(pe *decide.Refusal) error {
	st.s.m.picks.WithLabelValues(strconv.Itoa(pe.Status)).Inc()
	set := []*corev3.HeaderValueOption{headerOption("content-type", "application/json")}
	if pe.RetryAfter > 0 {
		set = append(set, headerOption("retry-after", strconv.Itoa(pe.RetryAfter)))
	}
	code := typev3.StatusCode(pe.Status)
	if pe.Status == 499 {
		code = typev3.StatusCode_ServiceUnavailable // the client is gone; any answer will do
	}
	return st.send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extproc.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: code},
		Headers: &extproc.HeaderMutation{SetHeaders: set},
		Body:    pe.Body(),
		Details: "kvrelay_epp_" + pe.Code,
	}}})
}

// responseHeaders takes the answer's headers: which endpoint served it and its status.
func (st *stream) responseHeaders(req *extproc.ProcessingRequest, h *extproc.HttpHeaders) error {
	st.headDone = true
	var set []*corev3.HeaderValueOption
	served := servedEndpoint(req)
	if st.s.opts.Conformance && served != "" {
		set = append(set, headerOption(ConformanceServedHeader, served))
	}
	if p := st.pick; p != nil {
		p.Served(served)
		code := 0
		for _, hv := range h.GetHeaders().GetHeaders() {
			if hv.GetKey() == ":status" {
				code, _ = strconv.Atoi(headerValue(hv))
			}
		}
		p.Response(code)
		if st.s.opts.ExposeDecision {
			set = append(set, headerOption(WorkerHeader, p.WorkerID()))
			if d := p.Explain(nil); len(d) > 0 {
				set = append(set, headerOption(DecisionHeader, string(d)))
			}
		}
	}
	r := &extproc.HeadersResponse{}
	if len(set) > 0 {
		r.Response = &extproc.CommonResponse{HeaderMutation: &extproc.HeaderMutation{SetHeaders: set}}
	}
	if err := st.send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseHeaders{ResponseHeaders: r}}); err != nil {
		return err
	}
	if h.GetEndOfStream() {
		st.finish()
	}
	return nil
}

// responseBody feeds the answer to the pick and passes it on.
func (st *stream) responseBody(b *extproc.HttpBody) error {
	if p := st.pick; p != nil {
		p.ResponseBody(b.GetBody())
	}
	var err error
	if st.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		err = st.send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseBody{ResponseBody: &extproc.BodyResponse{Response: &extproc.CommonResponse{
			BodyMutation: &extproc.BodyMutation{Mutation: &extproc.BodyMutation_StreamedResponse{StreamedResponse: &extproc.StreamedBodyResponse{Body: b.GetBody(), EndOfStream: b.GetEndOfStream()}}},
		}}}})
	} else {
		err = st.send(&extproc.ProcessingResponse{Response: &extproc.ProcessingResponse_ResponseBody{ResponseBody: &extproc.BodyResponse{}}})
	}
	if b.GetEndOfStream() || st.respMode == filterv3.ProcessingMode_BUFFERED {
		st.finish()
	}
	return err
}

// finish ends the pick: the answer is over.
func (st *stream) finish() {
	if st.pick != nil {
		st.pick.Finish()
		st.pick = nil
	}
}

// end runs when the stream ends, however it ends.
func (st *stream) end() { st.finish() }

// noteSubset reads the gateway's subset hint from a request-phase message's filter metadata.
func (st *stream) noteSubset(req *extproc.ProcessingRequest) {
	ns := req.GetMetadataContext().GetFilterMetadata()[SubsetNamespace]
	if ns == nil {
		return
	}
	v, ok := ns.GetFields()[SubsetKey]
	if !ok {
		return
	}
	st.hasSubset, st.subset = true, st.subset[:0]
	for _, e := range v.GetListValue().GetValues() {
		if s := e.GetStringValue(); s != "" {
			st.subset = append(st.subset, s)
		}
	}
	if sv := v.GetStringValue(); sv != "" {
		// A gateway that sends one comma-separated string.
		for _, e := range strings.Split(sv, ",") {
			if e = strings.TrimSpace(e); e != "" {
				st.subset = append(st.subset, e)
			}
		}
	}
}

// servedEndpoint is envoy.lb → x-gateway-destination-endpoint-served of a response-phase
// message, "" when the gateway did not say.
func servedEndpoint(req *extproc.ProcessingRequest) string {
	ns := req.GetMetadataContext().GetFilterMetadata()[DestinationNamespace]
	return strings.TrimSpace(ns.GetFields()[ServedKey].GetStringValue())
}

func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

func headerOption(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}}
}

func firstOf(h map[string]string, keys ...string) string {
	for _, k := range keys {
		if v := h[k]; v != "" {
			return v
		}
	}
	return ""
}
