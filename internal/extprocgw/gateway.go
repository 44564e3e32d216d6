// Package extprocgw is a minimal stand-in for Envoy's ext_proc filter in front of an endpoint
// picker (EPP): an HTTP gateway that asks the picker where each request goes, as a Gateway
// API Inference Extension gateway does, and carries the request there. kvrelay's endpoint
// picker tests and hack/bench-llmd (against llm-d's picker) use it; it needs neither Envoy
// nor Kubernetes.
//
// For each HTTP request it opens an ext_proc stream (envoy.service.ext_proc.v3) and behaves
// as Envoy's filter does with request_header_mode SEND and the configured body modes:
//
//   - FULL_DUPLEX_STREAMED (the default; llm-d's): the request headers (with :method,
//     :path, :authority, :scheme and an x-request-id), then the body in chunks of
//     Options.ChunkBytes, the last with end_of_stream, without waiting; the picker's header
//     mutation and streamed body are applied.
//   - BUFFERED: the headers, then, once they are answered, the body whole in one message;
//     the body's answer carries the destination (and possibly a new body).
//
// The request goes to the endpoint the picker named (the x-gateway-destination-endpoint
// header, or the envoy.lb dynamic metadata key of that name; a comma-separated list is tried
// in order while connecting fails), as Envoy's ORIGINAL_DST cluster does. The answer's
// headers (with envoy.lb → x-gateway-destination-endpoint-served in the metadata) and body go
// to the picker as they arrive (response body mode FULL_DUPLEX_STREAMED or BUFFERED;
// Options.SkipResponse sends nothing and closes the stream) and what it sends back is written to the client,
// flushed chunk by chunk so that server-sent events stream through. An ImmediateResponse is
// answered with its status, headers and body. The client response carries x-kvrelay-worker:
// <ip:port>, the endpoint that served it.
package extprocgw

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

const (
	destHeader  = "x-gateway-destination-endpoint"
	servedKey   = "x-gateway-destination-endpoint-served"
	lbNamespace = "envoy.lb"
	subsetNS    = "envoy.lb.subset_hint"
	subsetKey   = "x-gateway-destination-endpoint-subset"
	// WorkerHeader carries the endpoint that served, on the client's response.
	WorkerHeader = "x-kvrelay-worker"
	defaultChunk = 64 << 10
)

// hopHeaders are connection-level headers a proxy does not forward.
var hopHeaders = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true, "te": true,
	"trailer": true, "transfer-encoding": true, "upgrade": true, "content-length": true,
}

// Options configures a Gateway.
type Options struct {
	// Pickers are the picker's clients; streams are spread over them.
	Pickers []extproc.ExternalProcessorClient
	// RequestBodyMode and ResponseBodyMode are the filter's body modes (the zero value:
	// FULL_DUPLEX_STREAMED; either may be BUFFERED).
	RequestBodyMode, ResponseBodyMode filterv3.ProcessingMode_BodySendMode
	// SkipResponse sends the picker nothing of the answer (response processing off): the
	// stream closes once the request is routed.
	SkipResponse bool
	// ChunkBytes is the largest request body chunk sent in one message in
	// FULL_DUPLEX_STREAMED mode (default 64 KiB).
	ChunkBytes int
	// Subset, when set, gives the subset hint to send with a request (ok false: none).
	Subset func(r *http.Request) (endpoints []string, ok bool)
	// OnPick, when set, hears each request's pick time: from opening the stream (the
	// client's body already read) to the picker's routing answer (the answer to the last
	// request-phase message, or its ImmediateResponse).
	OnPick func(time.Duration)
	// Upstream carries requests to the endpoints (default: a keep-alive client).
	Upstream *http.Client
	// Verbose logs every request's routing.
	Verbose bool
}

// Gateway is the HTTP handler.
type Gateway struct {
	opts  Options
	next  atomic.Uint64
	reqID atomic.Uint64
	up    *http.Client
}

// New returns a gateway.
func New(opts Options) *Gateway {
	if opts.RequestBodyMode == filterv3.ProcessingMode_NONE {
		opts.RequestBodyMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if opts.ResponseBodyMode == filterv3.ProcessingMode_NONE {
		opts.ResponseBodyMode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	if opts.ChunkBytes <= 0 {
		opts.ChunkBytes = defaultChunk
	}
	g := &Gateway{opts: opts, up: opts.Upstream}
	if g.up == nil {
		g.up = &http.Client{Transport: &http.Transport{
			Proxy:               nil,
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:        4096,
			MaxIdleConnsPerHost: 1024,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true,
		}}
	}
	return g
}

func (g *Gateway) upstream() *http.Client { return g.up }

func (g *Gateway) client() extproc.ExternalProcessorClient {
	return g.opts.Pickers[g.next.Add(1)%uint64(len(g.opts.Pickers))]
}

func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	if err := g.serve(ctx, w, r); err != nil && g.opts.Verbose {
		log.Printf("%s %s: %v", r.Method, r.URL.Path, err)
	}
}

func (g *Gateway) onPick(t0 time.Time) {
	if g.opts.OnPick != nil {
		g.opts.OnPick(time.Since(t0))
	}
}

// serve runs one request through the picker and the picked endpoint. Errors before the
// client response has started are answered with a 5xx, as Envoy with failure_mode_allow
// false does.
func (g *Gateway) serve(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "read body: "+err.Error(), http.StatusBadRequest)
		return err
	}
	pickStart := time.Now()
	stream, err := g.client().Process(ctx)
	if err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return err
	}
	if r.Header.Get("x-request-id") == "" {
		r.Header.Set("x-request-id", fmt.Sprintf("gw-%d-%d", time.Now().UnixNano(), g.reqID.Add(1)))
	}
	var meta *corev3.Metadata
	if g.opts.Subset != nil {
		if eps, ok := g.opts.Subset(r); ok {
			meta = subsetMetadata(eps)
		}
	}
	buffered := g.opts.RequestBodyMode == filterv3.ProcessingMode_BUFFERED
	respMode := g.opts.ResponseBodyMode
	if g.opts.SkipResponse {
		respMode = filterv3.ProcessingMode_NONE
	}
	if err := stream.Send(&extproc.ProcessingRequest{
		Request: &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{
			Headers: requestHeaderMap(r, len(body)), EndOfStream: len(body) == 0,
		}},
		MetadataContext: meta,
		ProtocolConfig: &extproc.ProtocolConfiguration{
			RequestBodyMode:  g.opts.RequestBodyMode,
			ResponseBodyMode: respMode,
		},
	}); err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return err
	}
	outHeaders := r.Header.Clone()
	var dest string
	var newBody []byte
	replaced := false
	// recv takes one request-phase answer: false when it was an ImmediateResponse (written).
	recv := func() (*extproc.ProcessingResponse, bool, error) {
		resp, err := stream.Recv()
		if err != nil {
			http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
			return nil, false, fmt.Errorf("request phase: %w", err)
		}
		if d := metadataDest(resp.GetDynamicMetadata()); d != "" && dest == "" {
			dest = d
		}
		if ir, ok := resp.Response.(*extproc.ProcessingResponse_ImmediateResponse); ok {
			g.onPick(pickStart)
			writeImmediate(w, ir.ImmediateResponse)
			return nil, false, nil
		}
		return resp, true, nil
	}
	if buffered && len(body) > 0 {
		// The headers' answer first, then the whole body and its answer.
		resp, ok, err := recv()
		if !ok {
			return err
		}
		hr, isHeaders := resp.Response.(*extproc.ProcessingResponse_RequestHeaders)
		if !isHeaders {
			return fmt.Errorf("unexpected answer %T to the request headers", resp.Response)
		}
		applyMutation(outHeaders, hr.RequestHeaders.GetResponse().GetHeaderMutation())
		if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
			RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true},
		}, MetadataContext: meta}); err != nil {
			http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
			return err
		}
		if resp, ok, err = recv(); !ok {
			return err
		}
		br, isBody := resp.Response.(*extproc.ProcessingResponse_RequestBody)
		if !isBody {
			return fmt.Errorf("unexpected answer %T to the request body", resp.Response)
		}
		cr := br.RequestBody.GetResponse()
		applyMutation(outHeaders, cr.GetHeaderMutation())
		if bm := cr.GetBodyMutation(); bm != nil {
			var done bool
			newBody, replaced = mutateBody(nil, bm, &done)
		}
	} else {
		sent := 0
		for off := 0; off < len(body); off += g.opts.ChunkBytes {
			end := min(off+g.opts.ChunkBytes, len(body))
			if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
				RequestBody: &extproc.HttpBody{Body: body[off:end], EndOfStream: end == len(body)},
			}, MetadataContext: meta}); err != nil {
				http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
				return err
			}
			sent++
		}
		gotHeaders, bodyDone := false, sent == 0
		for !gotHeaders || !bodyDone {
			resp, ok, err := recv()
			if !ok {
				return err
			}
			switch v := resp.Response.(type) {
			case *extproc.ProcessingResponse_RequestHeaders:
				gotHeaders = true
				cr := v.RequestHeaders.GetResponse()
				applyMutation(outHeaders, cr.GetHeaderMutation())
				if bm := cr.GetBodyMutation(); bm != nil {
					newBody, replaced = mutateBody(newBody, bm, &bodyDone)
				}
			case *extproc.ProcessingResponse_RequestBody:
				cr := v.RequestBody.GetResponse()
				applyMutation(outHeaders, cr.GetHeaderMutation())
				if bm := cr.GetBodyMutation(); bm != nil {
					var rep bool
					newBody, rep = mutateBody(newBody, bm, &bodyDone)
					replaced = replaced || rep
				} else {
					sent-- // CONTINUE without a mutation: this chunk goes as it was
					bodyDone = bodyDone || sent <= 0
				}
			default:
				return fmt.Errorf("unexpected request-phase response %T", v)
			}
		}
	}
	g.onPick(pickStart)
	if replaced {
		body = newBody
	}
	if h := outHeaders.Get(destHeader); h != "" {
		dest = h
	}
	if dest == "" {
		http.Error(w, "the endpoint picker picked no endpoint", http.StatusServiceUnavailable)
		return errors.New("no destination endpoint from the endpoint picker")
	}

	// Upstream, trying each endpoint of a fallback list while connecting fails.
	var up *http.Response
	var worker string
	for _, ep := range strings.Split(dest, ",") {
		ep = strings.TrimSpace(ep)
		if ep == "" {
			continue
		}
		up, err = g.roundTrip(ctx, r, ep, outHeaders, body)
		if err == nil {
			worker = ep
			break
		}
		if !isDialError(err) {
			break
		}
	}
	if up == nil {
		http.Error(w, "upstream "+dest+": "+err.Error(), http.StatusServiceUnavailable)
		return err
	}
	defer up.Body.Close()
	if g.opts.Verbose {
		log.Printf("%s %s -> %s (%d)", r.Method, r.URL.Path, worker, up.StatusCode)
	}
	if g.opts.SkipResponse {
		_ = stream.CloseSend()
		return passthrough(w, up, worker)
	}
	return g.respond(ctx, w, stream, up, worker, respMode)
}

// respond runs the response phase: headers to the picker, then the body as it arrives
// (FULL_DUPLEX_STREAMED) or whole (BUFFERED), and what the picker sends back to the client.
func (g *Gateway) respond(ctx context.Context, w http.ResponseWriter, stream extproc.ExternalProcessor_ProcessClient, up *http.Response, worker string, mode filterv3.ProcessingMode_BodySendMode) error {
	recv := make(chan *extproc.ProcessingResponse, 16)
	var recvErr error
	go func() {
		defer close(recv)
		for {
			resp, err := stream.Recv()
			if err != nil {
				recvErr = err
				return
			}
			select {
			case recv <- resp:
			case <-ctx.Done():
				recvErr = ctx.Err()
				return
			}
		}
	}()
	if err := stream.Send(&extproc.ProcessingRequest{
		Request: &extproc.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extproc.HttpHeaders{
			Headers: responseHeaderMap(up),
		}},
		MetadataContext: servedMetadata(worker),
	}); err != nil {
		return passthrough(w, up, worker) // the picker closed the stream: no response processing
	}
	clientHeaders := up.Header.Clone()
	resp, ok := <-recv
	if !ok {
		if errors.Is(recvErr, io.EOF) {
			return passthrough(w, up, worker)
		}
		http.Error(w, "ext_proc: "+recvErr.Error(), http.StatusInternalServerError)
		return recvErr
	}
	switch v := resp.Response.(type) {
	case *extproc.ProcessingResponse_ImmediateResponse:
		writeImmediate(w, v.ImmediateResponse)
		return nil
	case *extproc.ProcessingResponse_ResponseHeaders:
		applyMutation(clientHeaders, v.ResponseHeaders.GetResponse().GetHeaderMutation())
	default:
		return fmt.Errorf("unexpected response-phase response %T", v)
	}
	for k, vs := range clientHeaders {
		if hopHeaders[strings.ToLower(k)] {
			continue
		}
		w.Header()[k] = vs
	}
	w.Header().Set(WorkerHeader, worker)
	w.WriteHeader(up.StatusCode)
	fl, _ := w.(http.Flusher)
	if fl != nil {
		fl.Flush()
	}

	if mode == filterv3.ProcessingMode_BUFFERED {
		whole, err := io.ReadAll(up.Body)
		if err != nil {
			return fmt.Errorf("upstream body: %w", err)
		}
		if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
			ResponseBody: &extproc.HttpBody{Body: whole, EndOfStream: true},
		}}); err != nil {
			return err
		}
		resp, ok := <-recv
		if !ok {
			return fmt.Errorf("ext_proc ended before the response body's answer: %v", recvErr)
		}
		br, isBody := resp.Response.(*extproc.ProcessingResponse_ResponseBody)
		if !isBody {
			return fmt.Errorf("unexpected response-body response %T", resp.Response)
		}
		if bm := br.ResponseBody.GetResponse().GetBodyMutation(); bm != nil {
			var done bool
			if nb, rep := mutateBody(nil, bm, &done); rep {
				whole = nb
			}
		}
		_, err = w.Write(whole)
		_ = stream.CloseSend()
		return err
	}

	pumpErr := make(chan error, 1)
	go func() { pumpErr <- pumpBody(stream, up.Body) }()
	for resp := range recv {
		var cr *extproc.CommonResponse
		switch v := resp.Response.(type) {
		case *extproc.ProcessingResponse_ResponseBody:
			cr = v.ResponseBody.GetResponse()
		case *extproc.ProcessingResponse_ResponseTrailers:
			continue
		case *extproc.ProcessingResponse_ImmediateResponse:
			return errors.New("ImmediateResponse after the response started; response cut")
		default:
			return fmt.Errorf("unexpected response-body response %T", v)
		}
		sr := cr.GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return errors.New("the picker sent a response body response without a streamed body")
		}
		if len(sr.Body) > 0 {
			if _, err := w.Write(sr.Body); err != nil {
				return err
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if sr.EndOfStream {
			return <-pumpErr
		}
	}
	if err := <-pumpErr; err != nil {
		return err
	}
	return fmt.Errorf("ext_proc ended before the response did: %v", recvErr)
}

func subsetMetadata(eps []string) *corev3.Metadata {
	vals := make([]*structpb.Value, len(eps))
	for i, e := range eps {
		vals[i] = structpb.NewStringValue(e)
	}
	s := &structpb.Struct{Fields: map[string]*structpb.Value{subsetKey: structpb.NewListValue(&structpb.ListValue{Values: vals})}}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{subsetNS: s}}
}

// pumpBody sends the upstream body to the EPP chunk by chunk as it arrives, then an empty
// end_of_stream chunk, as Envoy does for a chunked HTTP/1.1 upstream response.
func pumpBody(stream extproc.ExternalProcessor_ProcessClient, body io.Reader) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := body.Read(buf)
		if n > 0 {
			chunk := append([]byte(nil), buf[:n]...)
			if serr := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
				ResponseBody: &extproc.HttpBody{Body: chunk},
			}}); serr != nil {
				return serr
			}
		}
		if err == io.EOF {
			if serr := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{
				ResponseBody: &extproc.HttpBody{EndOfStream: true},
			}}); serr != nil {
				return serr
			}
			return stream.CloseSend()
		}
		if err != nil {
			return fmt.Errorf("upstream body: %w", err)
		}
	}
}

func (g *Gateway) roundTrip(ctx context.Context, r *http.Request, ep string, h http.Header, body []byte) (*http.Response, error) {
	u := "http://" + ep + r.URL.RequestURI()
	req, err := http.NewRequestWithContext(ctx, r.Method, u, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	for k, vs := range h {
		if hopHeaders[strings.ToLower(k)] || strings.HasPrefix(k, ":") {
			continue
		}
		req.Header[k] = vs
	}
	req.Host = r.Host
	req.ContentLength = int64(len(body))
	return g.upstream().Do(req)
}

// passthrough copies the upstream response to the client unprocessed, for a request whose
// ext_proc stream the EPP closed after routing it.
func passthrough(w http.ResponseWriter, up *http.Response, worker string) error {
	for k, vs := range up.Header {
		if !hopHeaders[strings.ToLower(k)] {
			w.Header()[k] = vs
		}
	}
	w.Header().Set(WorkerHeader, worker)
	w.WriteHeader(up.StatusCode)
	fl, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, err := up.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func requestHeaderMap(r *http.Request, bodyLen int) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	add := func(k, v string) {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)})
	}
	add(":authority", r.Host)
	add(":path", r.URL.RequestURI())
	add(":method", r.Method)
	add(":scheme", "http")
	for k, vs := range r.Header {
		lk := strings.ToLower(k)
		if hopHeaders[lk] {
			continue
		}
		add(lk, strings.Join(vs, ","))
	}
	if bodyLen > 0 {
		add("content-length", strconv.Itoa(bodyLen))
	}
	return hm
}

func responseHeaderMap(up *http.Response) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(up.StatusCode))}}}
	for k, vs := range up.Header {
		lk := strings.ToLower(k)
		if hopHeaders[lk] && lk != "content-length" {
			continue
		}
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: lk, RawValue: []byte(strings.Join(vs, ","))})
	}
	return hm
}

func servedMetadata(worker string) *corev3.Metadata {
	s, _ := structpb.NewStruct(map[string]any{servedKey: worker})
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{lbNamespace: s}}
}

func metadataDest(md *structpb.Struct) string {
	lb := md.GetFields()[lbNamespace].GetStructValue()
	if lb == nil {
		return ""
	}
	v := lb.GetFields()[destHeader]
	if s := v.GetStringValue(); s != "" {
		return s
	}
	if l := v.GetListValue(); l != nil {
		var eps []string
		for _, e := range l.GetValues() {
			if s := e.GetStringValue(); s != "" {
				eps = append(eps, s)
			}
		}
		return strings.Join(eps, ",")
	}
	return ""
}

func headerValue(h *corev3.HeaderValue) string {
	if len(h.RawValue) > 0 {
		return string(h.RawValue)
	}
	return h.Value
}

// applyMutation applies an ext_proc header mutation; pseudo-headers and content-length are
// left alone (the gateway frames the body itself).
func applyMutation(h http.Header, m *extproc.HeaderMutation) {
	if m == nil {
		return
	}
	for _, k := range m.RemoveHeaders {
		h.Del(k)
	}
	for _, o := range m.SetHeaders {
		hv := o.GetHeader()
		if hv == nil || strings.HasPrefix(hv.Key, ":") || strings.EqualFold(hv.Key, "content-length") {
			continue
		}
		v := headerValue(hv)
		switch o.AppendAction {
		case corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD:
			if o.GetAppend().GetValue() {
				h.Add(hv.Key, v)
				continue
			}
			h.Set(hv.Key, v)
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if h.Get(hv.Key) == "" {
				h.Set(hv.Key, v)
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if h.Get(hv.Key) != "" {
				h.Set(hv.Key, v)
			}
		default:
			h.Set(hv.Key, v)
		}
	}
}

// mutateBody folds a request-body mutation into the replacement body; it reports whether the
// body is replaced and sets *done when the mutation ends the body.
func mutateBody(acc []byte, bm *extproc.BodyMutation, done *bool) ([]byte, bool) {
	switch m := bm.Mutation.(type) {
	case *extproc.BodyMutation_StreamedResponse:
		if m.StreamedResponse.EndOfStream {
			*done = true
		}
		return append(acc, m.StreamedResponse.Body...), true
	case *extproc.BodyMutation_Body:
		*done = true
		return m.Body, true
	case *extproc.BodyMutation_ClearBody:
		*done = true
		return nil, m.ClearBody
	}
	return acc, false
}

func writeImmediate(w http.ResponseWriter, ir *extproc.ImmediateResponse) {
	h := http.Header{}
	applyMutation(h, ir.GetHeaders())
	for k, vs := range h {
		w.Header()[k] = vs
	}
	code := int(ir.GetStatus().GetCode())
	if code < 100 {
		code = http.StatusInternalServerError
	}
	w.WriteHeader(code)
	_, _ = w.Write(ir.GetBody())
}

func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}
