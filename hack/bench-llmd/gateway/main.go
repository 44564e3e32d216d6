// Command gateway is a minimal stand-in for Envoy in front of llm-d's endpoint picker (EPP),
// for benchmarking kvrelay against llm-d without Kubernetes or an Envoy binary.
//
// For each HTTP request it opens an ext_proc stream (envoy.service.ext_proc.v3) to the EPP and
// behaves as Envoy's ext_proc filter does with request_header_mode SEND and request/response
// body mode FULL_DUPLEX_STREAMED: it sends the request headers (with the :method, :path,
// :authority and :scheme pseudo-headers and an x-request-id), then the body chunks, the last one
// with end_of_stream; it applies the header mutations and the streamed body the EPP returns, and
// proxies the request to the endpoint the EPP picked (the x-gateway-destination-endpoint header,
// or the envoy.lb dynamic metadata key of that name; a comma-separated list is tried in order
// while connecting fails), as Envoy's ORIGINAL_DST cluster does. The upstream response headers
// and body chunks go to the EPP as they arrive, and what the EPP sends back is written to the
// client chunk by chunk, flushed, so server-sent events stream through. An ImmediateResponse is
// answered with its status, headers and body. The client response carries x-kvrelay-worker:
// <ip:port>, the endpoint that served it.
//
// With --admin-listen it serves GET /picks: every request's pick time so far as JSON, in
// nanoseconds from opening the ext_proc stream (the client's request body already read) to the
// routing decision (the EPP's answer to the last request-body chunk, or its ImmediateResponse):
// what the EPP took to parse, tokenize, score and pick, plus the ext_proc hop, as Envoy would see it.
//
// With --render-listen it also serves vLLM's /v1/chat/completions/render and
// /v1/completions/render (what the EPP's token-producer calls) by asking an engine's /tokenize,
// for engines that tokenize but do not render, such as kvrelay's simulated engine.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

const (
	destHeader   = "x-gateway-destination-endpoint"
	servedKey    = "x-gateway-destination-endpoint-served"
	lbNamespace  = "envoy.lb"
	workerHeader = "x-kvrelay-worker"
	chunkLimit   = 64 << 10 // largest body chunk sent to the EPP in one message
)

// hopHeaders are connection-level headers a proxy does not forward.
var hopHeaders = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true, "te": true,
	"trailer": true, "transfer-encoding": true, "upgrade": true, "content-length": true,
}

type gateway struct {
	conns    []extproc.ExternalProcessorClient
	next     atomic.Uint64
	upstream *http.Client
	reqID    atomic.Uint64
	verbose  bool

	mu    sync.Mutex
	picks []time.Duration // each request's ext_proc request phase: stream opened to decision
}

func (g *gateway) recordPick(d time.Duration) {
	g.mu.Lock()
	g.picks = append(g.picks, d)
	g.mu.Unlock()
}

// servePicks answers GET /picks with {"pick_ns": [...]}, in the order the decisions came.
func (g *gateway) servePicks(w http.ResponseWriter, _ *http.Request) {
	g.mu.Lock()
	ns := make([]int64, len(g.picks))
	for i, d := range g.picks {
		ns[i] = d.Nanoseconds()
	}
	g.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string][]int64{"pick_ns": ns})
}

func main() {
	listen := flag.String("listen", "127.0.0.1:21080", "HTTP listen address")
	epp := flag.String("epp", "127.0.0.1:21090", "EPP ext_proc gRPC address (plaintext)")
	nconns := flag.Int("epp-conns", 1, "gRPC connections to the EPP (streams are spread over them)")
	verbose := flag.Bool("v", false, "log every request's routing")
	renderListen := flag.String("render-listen", "", "also serve /v1/{chat/,}completions/render here (empty: off)")
	renderFrom := flag.String("render-tokenize-url", "http://127.0.0.1:21001", "engine whose POST /tokenize answers the render calls")
	adminListen := flag.String("admin-listen", "", "serve GET /picks (every request's EPP pick time) here (empty: off)")
	flag.Parse()

	if *renderListen != "" {
		go func() {
			log.Printf("render shim on %s, tokenizing with %s/tokenize", *renderListen, *renderFrom)
			log.Fatal(http.ListenAndServe(*renderListen, renderShim(*renderFrom)))
		}()
	}

	g := &gateway{verbose: *verbose}
	if *adminListen != "" {
		go func() {
			mux := http.NewServeMux()
			mux.HandleFunc("GET /picks", g.servePicks)
			log.Printf("admin on %s (GET /picks)", *adminListen)
			log.Fatal(http.ListenAndServe(*adminListen, mux))
		}()
	}
	for i := 0; i < max(*nconns, 1); i++ {
		cc, err := grpc.NewClient(*epp,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
		if err != nil {
			log.Fatalf("epp %s: %v", *epp, err)
		}
		g.conns = append(g.conns, extproc.NewExternalProcessorClient(cc))
	}
	g.upstream = &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 1024,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}}
	srv := &http.Server{Addr: *listen, Handler: g, ReadHeaderTimeout: 30 * time.Second}
	log.Printf("gateway listening on %s, EPP ext_proc at %s", *listen, *epp)
	log.Fatal(srv.ListenAndServe())
}

func (g *gateway) client() extproc.ExternalProcessorClient {
	return g.conns[g.next.Add(1)%uint64(len(g.conns))]
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	if err := g.serve(ctx, w, r); err != nil {
		log.Printf("%s %s: %v", r.Method, r.URL.Path, err)
	}
}

// serve runs one request through the EPP and the picked endpoint. Errors before the client
// response has started are answered with a 5xx, like Envoy with failure_mode_allow false.
func (g *gateway) serve(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
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

	// Request phase: headers, then the body in chunks, the last with end_of_stream.
	if r.Header.Get("x-request-id") == "" {
		r.Header.Set("x-request-id", fmt.Sprintf("gw-%d-%d", time.Now().UnixNano(), g.reqID.Add(1)))
	}
	reqHeaders := requestHeaderMap(r, len(body))
	if err := stream.Send(&extproc.ProcessingRequest{
		Request: &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{
			Headers: reqHeaders, EndOfStream: len(body) == 0,
		}},
		ProtocolConfig: &extproc.ProtocolConfiguration{
			RequestBodyMode:  filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	}); err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return err
	}
	sent := 0
	for off := 0; off < len(body); off += chunkLimit {
		end := min(off+chunkLimit, len(body))
		if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
			RequestBody: &extproc.HttpBody{Body: body[off:end], EndOfStream: end == len(body)},
		}}); err != nil {
			http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
			return err
		}
		sent++
	}

	outHeaders := r.Header.Clone()
	var dest string
	var newBody []byte
	gotHeaders, bodyDone, replaced := false, sent == 0, false
	for !gotHeaders || !bodyDone {
		resp, err := stream.Recv()
		if err != nil {
			http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
			return fmt.Errorf("request phase: %w", err)
		}
		if d := metadataDest(resp.GetDynamicMetadata()); d != "" && dest == "" {
			dest = d
		}
		switch v := resp.Response.(type) {
		case *extproc.ProcessingResponse_ImmediateResponse:
			g.recordPick(time.Since(pickStart))
			writeImmediate(w, v.ImmediateResponse)
			return nil
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
	g.recordPick(time.Since(pickStart))
	if replaced {
		body = newBody
	}
	if h := outHeaders.Get(destHeader); h != "" {
		dest = h
	}
	if dest == "" {
		http.Error(w, "EPP picked no endpoint", http.StatusServiceUnavailable)
		return errors.New("no destination endpoint from EPP")
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
	if g.verbose {
		log.Printf("%s %s -> %s (%d)", r.Method, r.URL.Path, worker, up.StatusCode)
	}

	// Response phase: headers to the EPP, then body chunks as they arrive.
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
		return passthrough(w, up, worker) // the EPP closed the stream: no response processing
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
	w.Header().Set(workerHeader, worker)
	w.WriteHeader(up.StatusCode)
	fl, _ := w.(http.Flusher)
	if fl != nil {
		fl.Flush()
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
			return errors.New("EPP sent a response body response without a streamed body")
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

func (g *gateway) roundTrip(ctx context.Context, r *http.Request, ep string, h http.Header, body []byte) (*http.Response, error) {
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
	return g.upstream.Do(req)
}

// passthrough copies the upstream response to the client unprocessed, for a request whose
// ext_proc stream the EPP closed after routing it.
func passthrough(w http.ResponseWriter, up *http.Response, worker string) error {
	for k, vs := range up.Header {
		if !hopHeaders[strings.ToLower(k)] {
			w.Header()[k] = vs
		}
	}
	w.Header().Set(workerHeader, worker)
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

// renderShim answers vLLM's render endpoints from an engine's /tokenize, which takes the same
// body (messages for chat, prompt for completions) and applies the same chat template.
func renderShim(base string) http.Handler {
	c := &http.Client{Timeout: 30 * time.Second}
	render := func(w http.ResponseWriter, r *http.Request, list bool) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		resp, err := c.Post(base+"/tokenize", "application/json", bytes.NewReader(body))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			w.WriteHeader(resp.StatusCode)
			_, _ = w.Write(out)
			return
		}
		var tok struct {
			Tokens []uint32 `json:"tokens"`
		}
		if err := json.Unmarshal(out, &tok); err != nil {
			http.Error(w, "tokenize: "+err.Error(), http.StatusBadGateway)
			return
		}
		type rendered struct {
			TokenIDs []uint32 `json:"token_ids"`
		}
		var v any = rendered{TokenIDs: tok.Tokens}
		if list {
			v = []rendered{{TokenIDs: tok.Tokens}}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(v)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions/render", func(w http.ResponseWriter, r *http.Request) { render(w, r, false) })
	mux.HandleFunc("POST /v1/completions/render", func(w http.ResponseWriter, r *http.Request) { render(w, r, true) })
	return mux
}
