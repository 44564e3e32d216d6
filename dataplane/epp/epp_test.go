package epp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrelay/kvrelay/dataplane/epp"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
	"github.com/kvrelay/kvrelay/engines/sim"
	"github.com/kvrelay/kvrelay/engines/sim/simtest"
	"github.com/kvrelay/kvrelay/internal/extprocgw"
)

const model = "gpt-oss-120b"

// startWorker runs one simulated engine for the test's lifetime.
func startWorker(t testing.TB, mut func(*sim.WorkerConfig)) *sim.Worker {
	t.Helper()
	return simtest.Worker(t, model, mut)
}

// env is an endpoint picker over simulated engines: the routing core in PickOnly mode, the
// ext_proc service on loopback, a raw client and, for end-to-end tests, a gateway (the role
// Envoy plays) in front of it.
type env struct {
	workers []*sim.Worker
	core    *proxy.Server
	addr    string // ext_proc
	client  extproc.ExternalProcessorClient
	conn    *grpc.ClientConn
	health  *health.Server
	cancel  context.CancelFunc
}

type envOpts struct {
	workers int
	roles   []string // per worker ("": both)
	core    func(*proxy.Config)
	epp     func(*epp.Options)
	sim     func(i int, c *sim.WorkerConfig)
}

func newEnv(t testing.TB, o envOpts) *env {
	t.Helper()
	e := &env{}
	cfg := proxy.DefaultConfig()
	cfg.PickOnly = true
	cfg.Listen = ""
	// No exploration: the tests assert where requests go, and one latency decision in 64
	// would try a worker never chosen instead.
	cfg.Explore = 0
	for i := range max(o.workers, 1) {
		w := startWorker(t, func(c *sim.WorkerConfig) {
			if i < len(o.roles) {
				switch o.roles[i] {
				case "prefill":
					c.Engine.Role = sim.RolePrefill
				case "decode":
					c.Engine.Role = sim.RoleDecode
				}
			}
			if o.sim != nil {
				o.sim(i, c)
			}
		})
		e.workers = append(e.workers, w)
		u := proxy.Upstream{ID: "w" + strconv.Itoa(i), URL: w.URL(), Model: model}
		if i < len(o.roles) {
			u.Role = o.roles[i]
		}
		cfg.Upstreams = append(cfg.Upstreams, u)
	}
	if o.core != nil {
		o.core(&cfg)
	}
	core, err := proxy.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := core.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = core.Close() })
	e.core = core
	opts := epp.Options{Registerer: core.Registerer()}
	if o.epp != nil {
		o.epp(&opts)
	}
	svc := epp.New(core, opts)
	g := grpc.NewServer()
	svc.Register(g)
	e.health = health.NewServer()
	healthpb.RegisterHealthServer(g, e.health)
	ctx, cancel := context.WithCancel(context.Background())
	e.cancel = cancel
	go svc.RunHealth(ctx, e.health, 20*time.Millisecond)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(func() { cancel(); g.Stop() })
	e.addr = ln.Addr().String()
	e.conn, err = grpc.NewClient(e.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.conn.Close() })
	e.client = extproc.NewExternalProcessorClient(e.conn)
	return e
}

// gateway starts the Envoy stand-in in front of the picker.
func (e *env) gateway(t testing.TB, mut func(*extprocgw.Options)) string {
	t.Helper()
	o := extprocgw.Options{Pickers: []extproc.ExternalProcessorClient{e.client}}
	if mut != nil {
		mut(&o)
	}
	s := httptest.NewServer(extprocgw.New(o))
	t.Cleanup(s.Close)
	return s.URL
}

func (e *env) addrs() []string {
	var out []string
	for _, w := range e.core.Workers() {
		out = append(out, w.Addr)
	}
	return out
}

func chatBody(system, user string, maxTokens int, stream bool) []byte {
	b, _ := json.Marshal(map[string]any{
		"model": model, "max_tokens": maxTokens, "stream": stream,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}},
	})
	return b
}

func family(g int) string {
	var b strings.Builder
	for i := range 400 {
		fmt.Fprintf(&b, "family%d rule%d. ", g, i)
	}
	return b.String()
}

// raw is one ext_proc stream driven by hand, as a gateway drives it.
type raw struct {
	t      testing.TB
	st     extproc.ExternalProcessor_ProcessClient
	mode   filterv3.ProcessingMode_BodySendMode
	cancel context.CancelFunc
}

func (e *env) open(t testing.TB, mode filterv3.ProcessingMode_BodySendMode) *raw {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	st, err := e.client.Process(ctx)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(cancel)
	return &raw{t: t, st: st, mode: mode, cancel: cancel}
}

func headerMap(path string, extra map[string]string, bodyLen int) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	add := func(k, v string) { hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)}) }
	add(":method", "POST")
	add(":path", path)
	add(":authority", "gateway")
	add(":scheme", "http")
	add("content-type", "application/json")
	if bodyLen > 0 {
		add("content-length", strconv.Itoa(bodyLen))
	}
	for k, v := range extra {
		add(k, v)
	}
	return hm
}

func subsetMeta(eps ...string) *corev3.Metadata {
	vals := make([]*structpb.Value, len(eps))
	for i, e := range eps {
		vals[i] = structpb.NewStringValue(e)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		epp.SubsetNamespace: {Fields: map[string]*structpb.Value{epp.SubsetKey: structpb.NewListValue(&structpb.ListValue{Values: vals})}},
	}}
}

// decision is the picker's answer to a request phase.
type decision struct {
	dest, metaDest string
	headers        map[string]string // set by the header mutation
	body           []byte            // the body the picker sent on (FULL_DUPLEX_STREAMED) or set (BUFFERED)
	bodyMutated    bool
	immediate      *extproc.ImmediateResponse
	meta           *structpb.Struct
}

// request sends the request phase: headers (with meta), then body split at the given chunk
// sizes (the rest in a last chunk), and reads the picker's answer.
func (r *raw) request(path string, hdr map[string]string, body []byte, chunk int, meta *corev3.Metadata) decision {
	t := r.t
	t.Helper()
	// send reports false when the picker has already ended the stream (an immediate
	// response to what came before: gRPC's Send then returns io.EOF and Recv has the answer).
	send := func(m *extproc.ProcessingRequest) bool {
		t.Helper()
		err := r.st.Send(m)
		if err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("send: %v", err)
		}
		return err == nil
	}
	send(&extproc.ProcessingRequest{
		Request:         &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{Headers: headerMap(path, hdr, len(body)), EndOfStream: len(body) == 0}},
		MetadataContext: meta,
		ProtocolConfig:  &extproc.ProtocolConfiguration{RequestBodyMode: r.mode, ResponseBodyMode: r.mode},
	})
	var d decision
	recv := func() *extproc.ProcessingResponse {
		t.Helper()
		m, err := r.st.Recv()
		if err != nil {
			t.Fatalf("recv: %v", err)
		}
		if ir := m.GetImmediateResponse(); ir != nil {
			d.immediate = ir
		}
		if md := m.GetDynamicMetadata(); md != nil {
			d.meta = md
			d.metaDest = md.GetFields()[epp.DestinationNamespace].GetStructValue().GetFields()[epp.DestinationKey].GetStringValue()
		}
		return m
	}
	apply := func(cr *extproc.CommonResponse) {
		for _, o := range cr.GetHeaderMutation().GetSetHeaders() {
			if d.headers == nil {
				d.headers = map[string]string{}
			}
			d.headers[o.GetHeader().GetKey()] = string(o.GetHeader().GetRawValue())
		}
	}
	if len(body) == 0 {
		m := recv()
		if d.immediate == nil {
			apply(m.GetRequestHeaders().GetResponse())
			d.dest = d.headers[epp.DestinationKey]
		}
		return d
	}
	if r.mode == filterv3.ProcessingMode_BUFFERED {
		m := recv()
		if d.immediate != nil {
			return d
		}
		if m.GetRequestHeaders() == nil {
			t.Fatalf("BUFFERED: the headers were answered with %T", m.GetResponse())
		}
		send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}, MetadataContext: meta})
		m = recv()
		if d.immediate != nil {
			return d
		}
		cr := m.GetRequestBody().GetResponse()
		apply(cr)
		if b := cr.GetBodyMutation().GetBody(); b != nil {
			d.body, d.bodyMutated = b, true
		} else {
			d.body = body
		}
		d.dest = d.headers[epp.DestinationKey]
		return d
	}
	for off := 0; off < len(body); {
		end := min(off+chunk, len(body))
		if chunk <= 0 {
			end = len(body)
		}
		if !send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: body[off:end], EndOfStream: end == len(body)}}, MetadataContext: meta}) {
			break
		}
		off = end
	}
	m := recv()
	if d.immediate != nil {
		return d
	}
	if m.GetRequestHeaders() == nil {
		t.Fatalf("FULL_DUPLEX_STREAMED: the first answer is %T, want the headers'", m.GetResponse())
	}
	apply(m.GetRequestHeaders().GetResponse())
	d.dest = d.headers[epp.DestinationKey]
	for {
		m := recv()
		sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			t.Fatalf("FULL_DUPLEX_STREAMED: a body answer without a streamed body: %v", m)
		}
		d.body = append(d.body, sr.GetBody()...)
		if sr.GetEndOfStream() {
			return d
		}
	}
}

// respond sends the answer's headers (status, served endpoint) and body chunks, and reads
// what the picker passes on.
func (r *raw) respond(status int, served string, chunks ...[]byte) []byte {
	t := r.t
	t.Helper()
	var meta *corev3.Metadata
	if served != "" {
		meta = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			epp.DestinationNamespace: {Fields: map[string]*structpb.Value{epp.ServedKey: structpb.NewStringValue(served)}},
		}}
	}
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(status))}, {Key: "content-type", RawValue: []byte("text/event-stream")}}}
	if err := r.st.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extproc.HttpHeaders{Headers: hm}}, MetadataContext: meta}); err != nil {
		t.Fatal(err)
	}
	if m, err := r.st.Recv(); err != nil || m.GetResponseHeaders() == nil {
		t.Fatalf("response headers answered with %v, %v", m, err)
	}
	var out []byte
	if r.mode == filterv3.ProcessingMode_BUFFERED {
		// The answer whole in one message; the picker answers CONTINUE (the gateway sends
		// what it holds).
		whole := bytes.Join(chunks, nil)
		if err := r.st.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{ResponseBody: &extproc.HttpBody{Body: whole, EndOfStream: true}}}); err != nil {
			t.Fatal(err)
		}
		m, err := r.st.Recv()
		if err != nil || m.GetResponseBody() == nil || m.GetResponseBody().GetResponse().GetBodyMutation() != nil {
			t.Fatalf("a BUFFERED answer's body was answered with %v, %v", m, err)
		}
		return whole
	}
	for i, c := range chunks {
		if err := r.st.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{ResponseBody: &extproc.HttpBody{Body: c, EndOfStream: i == len(chunks)-1}}}); err != nil {
			t.Fatal(err)
		}
		m, err := r.st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()...)
	}
	return out
}

func (r *raw) close() { _ = r.st.CloseSend(); r.cancel() }

// sse is a streamed chat answer in the engines' format: n content chunks and a usage chunk.
func sse(n, prompt, cached int) [][]byte {
	var out [][]byte
	for i := range n {
		out = append(out, []byte(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"t`+strconv.Itoa(i)+`"}}]}`+"\n\n"))
	}
	out = append(out, []byte(`data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":`+strconv.Itoa(prompt)+`,"completion_tokens":`+strconv.Itoa(n)+`,"prompt_tokens_details":{"cached_tokens":`+strconv.Itoa(cached)+`}}}`+"\n\ndata: [DONE]\n\n"))
	return out
}

func waitIdle(t testing.TB, core *proxy.Server) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		busy := false
		for _, w := range core.Workers() {
			if w.Load() != 0 {
				busy = true
			}
		}
		if !busy {
			return
		}
		if time.Now().After(deadline) {
			var s []string
			for _, w := range core.Workers() {
				s = append(s, w.ID+"="+strconv.FormatInt(w.Load(), 10))
			}
			t.Fatalf("load left on workers after every stream ended: %v", s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Every body mode and split reaches the same pick: the destination as header and as
// envoy.lb metadata with one value, an endpoint of the pool, the body passed on unchanged,
// and the pick's load released when the answer ends.
func TestBodyModesAndSplits(t *testing.T) {
	e := newEnv(t, envOpts{workers: 3})
	body := chatBody(family(1), "hello", 8, true)
	large := chatBody(strings.Repeat(family(2), 60), "a large prompt, tokenized off nothing", 8, true) // > 256 KiB
	for _, tc := range []struct {
		name  string
		mode  filterv3.ProcessingMode_BodySendMode
		body  []byte
		chunk int
	}{
		{"buffered", filterv3.ProcessingMode_BUFFERED, body, 0},
		{"duplex-whole", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, body, 0},
		{"duplex-7-bytes", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, body, 7},
		{"duplex-1000-bytes", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, body, 1000},
		{"duplex-large", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, large, 64 << 10},
		{"buffered-large", filterv3.ProcessingMode_BUFFERED, large, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.open(t, tc.mode)
			d := r.request("/v1/chat/completions", nil, tc.body, tc.chunk, nil)
			if d.immediate != nil {
				t.Fatalf("immediate response %d: %s", d.immediate.GetStatus().GetCode(), d.immediate.GetBody())
			}
			if d.dest == "" || d.dest != d.metaDest || !slices.Contains(e.addrs(), d.dest) {
				t.Fatalf("destination header %q, metadata %q, workers %v", d.dest, d.metaDest, e.addrs())
			}
			if !bytes.Equal(d.body, tc.body) {
				t.Fatalf("the body passed on differs: %d bytes against %d", len(d.body), len(tc.body))
			}
			if got := r.respond(200, d.dest, sse(3, 100, 0)...); !bytes.Contains(got, []byte("[DONE]")) {
				t.Fatalf("the answer passed on: %q", got)
			}
			r.close()
			waitIdle(t, e.core)
		})
	}
}

// A body that ends with trailers (end_of_stream on the trailers, not the body) is routed at
// the trailers.
func TestBodyEndingWithTrailers(t *testing.T) {
	e := newEnv(t, envOpts{workers: 2})
	r := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	body := chatBody("system", "trailers follow", 4, false)
	if err := r.st.Send(&extproc.ProcessingRequest{
		Request:        &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{Headers: headerMap("/v1/chat/completions", nil, len(body))}},
		ProtocolConfig: &extproc.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}); err != nil {
		t.Fatal(err)
	}
	for _, m := range []*extproc.ProcessingRequest{
		{Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: body}}},
		{Request: &extproc.ProcessingRequest_RequestTrailers{RequestTrailers: &extproc.HttpTrailers{}}},
	} {
		if err := r.st.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	var kinds []string
	for len(kinds) < 3 {
		m, err := r.st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case m.GetRequestHeaders() != nil:
			kinds = append(kinds, "headers")
		case m.GetRequestBody() != nil:
			kinds = append(kinds, "body")
		case m.GetRequestTrailers() != nil:
			kinds = append(kinds, "trailers")
		default:
			kinds = append(kinds, fmt.Sprintf("%T", m.GetResponse()))
		}
	}
	if want := []string{"headers", "body", "trailers"}; !slices.Equal(kinds, want) {
		t.Fatalf("answers %v, want %v", kinds, want)
	}
	r.close()
	waitIdle(t, e.core)
}

// The gateway's subset hint restricts the pick; an empty list, or one naming no eligible
// endpoint, gets 503.
func TestSubsetHint(t *testing.T) {
	e := newEnv(t, envOpts{workers: 3})
	addrs := e.addrs()
	for i := range 6 {
		want := addrs[i%3]
		r := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
		d := r.request("/v1/chat/completions", nil, chatBody(family(i), "subset", 4, true), 0, subsetMeta(want))
		if d.dest != want {
			t.Fatalf("subset [%s]: picked %q", want, d.dest)
		}
		r.respond(200, d.dest, sse(1, 10, 0)...)
		r.close()
	}
	host, _, _ := net.SplitHostPort(addrs[0])
	r := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	if d := r.request("/v1/chat/completions", nil, chatBody("s", "by host", 4, true), 0, subsetMeta(host)); !slices.Contains(addrs, d.dest) {
		t.Fatalf("subset [%s] (a host): picked %q", host, d.dest)
	}
	r.close()
	for name, meta := range map[string]*corev3.Metadata{
		"empty":      subsetMeta(),
		"ineligible": subsetMeta("10.255.0.1:8000", "10.255.0.2:8000"),
	} {
		r := e.open(t, filterv3.ProcessingMode_BUFFERED)
		d := r.request("/v1/chat/completions", nil, chatBody("s", name, 4, true), 0, meta)
		if d.immediate == nil || d.immediate.GetStatus().GetCode() != 503 {
			t.Fatalf("%s subset: %+v, want an immediate 503", name, d)
		}
		var oe struct {
			Error struct{ Message, Type, Code string } `json:"error"`
		}
		if err := json.Unmarshal(d.immediate.GetBody(), &oe); err != nil || oe.Error.Code != "no_worker" || !strings.Contains(oe.Error.Message, "subset") {
			t.Fatalf("%s subset: body %s (%v)", name, d.immediate.GetBody(), err)
		}
		r.close()
	}
	waitIdle(t, e.core)
}

// Requests the proxy would refuse get the same answer as an immediate response, with an
// OpenAI-shaped error; a request without a body goes to a worker by load.
func TestImmediateResponses(t *testing.T) {
	e := newEnv(t, envOpts{workers: 2, epp: func(o *epp.Options) { o.MaxBodyBytes = 4096 }})
	for _, tc := range []struct {
		name   string
		path   string
		body   []byte
		mode   filterv3.ProcessingMode_BodySendMode
		status int
		code   string
	}{
		{"not json", "/v1/chat/completions", []byte("{not json"), filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, 400, ""},
		{"no model", "/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"x"}]}`), filterv3.ProcessingMode_BUFFERED, 400, ""},
		{"unknown model", "/v1/chat/completions", []byte(`{"model":"nope","messages":[{"role":"user","content":"x"}]}`), filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, 404, "model_not_found"},
		{"unknown path", "/v2/nothing", []byte(`{}`), filterv3.ProcessingMode_BUFFERED, 404, ""},
		{"too large", "/v1/chat/completions", chatBody(strings.Repeat("x", 8000), "big", 4, false), filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, 413, "request_too_large"},
		{"kv_transfer_params", "/v1/chat/completions", []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"do_remote_prefill":true}}`), filterv3.ProcessingMode_BUFFERED, 400, ""},
		{"streamed mode", "/v1/chat/completions", chatBody("s", "u", 4, false), filterv3.ProcessingMode_STREAMED, 500, "unsupported_body_mode"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := e.open(t, tc.mode)
			var d decision
			if tc.mode == filterv3.ProcessingMode_STREAMED {
				if err := r.st.Send(&extproc.ProcessingRequest{
					Request:        &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{Headers: headerMap(tc.path, nil, len(tc.body))}},
					ProtocolConfig: &extproc.ProtocolConfiguration{RequestBodyMode: tc.mode},
				}); err != nil {
					t.Fatal(err)
				}
				m, err := r.st.Recv()
				if err != nil {
					t.Fatal(err)
				}
				d.immediate = m.GetImmediateResponse()
			} else {
				d = r.request(tc.path, nil, tc.body, 1024, nil)
			}
			ir := d.immediate
			if ir == nil || int(ir.GetStatus().GetCode()) != tc.status {
				t.Fatalf("got %+v, want an immediate %d", d, tc.status)
			}
			var oe struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Code    *string `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(ir.GetBody(), &oe); err != nil || oe.Error.Message == "" || oe.Error.Type == "" {
				t.Fatalf("error body %s: %v", ir.GetBody(), err)
			}
			if tc.code != "" && (oe.Error.Code == nil || *oe.Error.Code != tc.code) {
				t.Fatalf("error code %v, want %s", oe.Error.Code, tc.code)
			}
			r.close()
		})
	}
	// No body: a worker by load.
	r := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	if d := r.request("/v1/models", nil, nil, 0, nil); !slices.Contains(e.addrs(), d.dest) || d.dest != d.metaDest {
		t.Fatalf("a request without a body: %+v", d)
	}
	r.close()
	waitIdle(t, e.core)
}

// When the gateway served the request from another endpoint than the picked one (a fallback
// down the list), the request's load moves there, and leaves when the answer ends.
func TestServedElsewhereMovesTheLoad(t *testing.T) {
	e := newEnv(t, envOpts{workers: 2, epp: func(o *epp.Options) { o.Fallbacks = 1 }})
	r := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	d := r.request("/v1/chat/completions", nil, chatBody(family(3), "fallback", 4, true), 0, nil)
	eps := strings.Split(d.dest, ",")
	if len(eps) != 2 || eps[0] == eps[1] || d.metaDest != d.dest {
		t.Fatalf("destination %q with one fallback (metadata %q)", d.dest, d.metaDest)
	}
	load := func(addr string) int64 {
		for _, w := range e.core.Workers() {
			if w.Addr == addr {
				return w.Load()
			}
		}
		return -1
	}
	if load(eps[0]) != 1 || load(eps[1]) != 0 {
		t.Fatalf("after the pick: load %d on the pick, %d on the fallback", load(eps[0]), load(eps[1]))
	}
	// The gateway says the fallback served.
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}}
	served := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{epp.DestinationNamespace: {Fields: map[string]*structpb.Value{epp.ServedKey: structpb.NewStringValue(eps[1])}}}}
	if err := r.st.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extproc.HttpHeaders{Headers: hm}}, MetadataContext: served}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.st.Recv(); err != nil {
		t.Fatal(err)
	}
	if load(eps[0]) != 0 || load(eps[1]) != 1 {
		t.Fatalf("after the served endpoint came: load %d on the pick, %d on the one that served", load(eps[0]), load(eps[1]))
	}
	r.close()
	waitIdle(t, e.core)
}

// A request the gateway ends before its answer (the client left) releases its load.
func TestStreamEndReleasesThePick(t *testing.T) {
	e := newEnv(t, envOpts{workers: 2})
	r := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	d := r.request("/v1/chat/completions", nil, chatBody("s", "gone", 4, true), 0, nil)
	if d.dest == "" {
		t.Fatalf("%+v", d)
	}
	r.close()
	waitIdle(t, e.core)
}

// While every worker is busy, a sheddable request (its objective's priority below zero)
// gets 429 at once and another waits in the admission queue until the busy one's prefill
// ends.
func TestShedAndQueue(t *testing.T) {
	e := newEnv(t, envOpts{workers: 1,
		core: func(c *proxy.Config) { c.BusyPrefillTokens = 1; c.QueueTimeout = 10 * time.Second },
		epp:  func(o *epp.Options) { o.Objectives = map[string]int{"batch": -1, "chat": 2} },
	})
	busy := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	d := busy.request("/v1/chat/completions", nil, chatBody(family(4), "long", 4, true), 0, nil)
	if d.dest == "" {
		t.Fatalf("first pick: %+v", d)
	}
	shed := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	sd := shed.request("/v1/chat/completions", map[string]string{epp.ObjectiveHeader: "batch"}, chatBody(family(5), "background", 4, true), 0, nil)
	if sd.immediate == nil || sd.immediate.GetStatus().GetCode() != 429 {
		t.Fatalf("a sheddable request while every worker is busy: %+v", sd)
	}
	shed.close()
	queued := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	got := make(chan decision, 1)
	go func() {
		got <- queued.request("/v1/chat/completions", map[string]string{epp.ObjectiveHeader: "chat"}, chatBody(family(6), "interactive", 4, true), 0, nil)
	}()
	select {
	case qd := <-got:
		t.Fatalf("the queued request was answered while the worker was busy: %+v", qd)
	case <-time.After(300 * time.Millisecond):
	}
	busy.respond(200, d.dest, sse(2, 100, 0)...) // its first token ends its prefill
	select {
	case qd := <-got:
		if qd.dest != d.dest {
			t.Fatalf("the queued request: %+v", qd)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the queued request was not released when the busy one's prefill ended")
	}
	busy.close()
	queued.close()
	waitIdle(t, e.core)
}

// In a pool of prefill and decode workers, the destination is a decode worker and a prompt
// worth prefilling elsewhere names the prefill worker in x-prefiller-host-port.
func TestDisaggregatedPoolNamesThePrefiller(t *testing.T) {
	e := newEnv(t, envOpts{workers: 2, roles: []string{"prefill", "decode"}})
	prefill, decode := e.core.Workers()[0].Addr, e.core.Workers()[1].Addr
	r := e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	d := r.request("/v1/chat/completions", nil, chatBody(family(7), "a long prompt", 4, true), 0, nil)
	if d.dest != decode || d.headers[epp.PrefillerHeader] != prefill {
		t.Fatalf("destination %q, prefiller %q; want decode %s and prefill %s", d.dest, d.headers[epp.PrefillerHeader], decode, prefill)
	}
	r.respond(200, d.dest, sse(2, 3000, 0)...)
	r.close()
	// A short prompt is prefilled by the decode worker itself: no prefiller.
	r = e.open(t, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	d = r.request("/v1/chat/completions", nil, chatBody("s", "hi", 4, true), 0, nil)
	if d.dest != decode || d.headers[epp.PrefillerHeader] != "" {
		t.Fatalf("short prompt: destination %q, prefiller %q", d.dest, d.headers[epp.PrefillerHeader])
	}
	r.close()
	waitIdle(t, e.core)
}

// The health services of the protocol: liveness at once, readiness and the ext_proc service
// once workers are known, NOT_SERVING while the picker drains.
func TestHealth(t *testing.T) {
	e := newEnv(t, envOpts{workers: 1})
	hc := healthpb.NewHealthClient(e.conn)
	check := func(svc string) healthpb.HealthCheckResponse_ServingStatus {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatalf("health %q: %v", svc, err)
		}
		return r.GetStatus()
	}
	deadline := time.Now().Add(3 * time.Second)
	for check(epp.HealthReadiness) != healthpb.HealthCheckResponse_SERVING {
		if time.Now().After(deadline) {
			t.Fatal("never ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, svc := range []string{epp.HealthLiveness, epp.HealthReadiness, epp.HealthExtProc} {
		if s := check(svc); s != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("%s: %v", svc, s)
		}
	}
	go e.core.Drain(time.Second)
	for check(epp.HealthExtProc) != healthpb.HealthCheckResponse_NOT_SERVING {
		if time.Now().After(deadline.Add(3 * time.Second)) {
			t.Fatal("still serving while draining")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if s := check(epp.HealthLiveness); s != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("liveness while draining: %v", s)
	}
	r := e.open(t, filterv3.ProcessingMode_BUFFERED)
	if d := r.request("/v1/chat/completions", nil, chatBody("s", "late", 4, false), 0, nil); d.immediate == nil || d.immediate.GetStatus().GetCode() != 503 {
		t.Fatalf("a pick while draining: %+v", d)
	}
}

// Through a gateway (the Envoy stand-in) with real engines: the official OpenAI SDK streams
// an answer, requests sharing a prompt go where it is cached (the picker learned it from
// the answers passing through, with no control plane), and the latency model learns each
// worker's TTFT from them when the gateway streams the answers through, and nothing when it
// buffers them (their arrival is not their first token).
func TestThroughGateway(t *testing.T) {
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, envOpts{workers: 3, core: func(c *proxy.Config) { c.Policy = "latency" }, epp: func(o *epp.Options) { o.ExposeDecision = true }})
			base := e.gateway(t, func(o *extprocgw.Options) { o.RequestBodyMode, o.ResponseBodyMode = mode, mode })
			cl := openai.NewClient(option.WithBaseURL(base+"/v1"), option.WithAPIKey("none"), option.WithMaxRetries(0))
			st := cl.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
				Model:     model,
				Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(family(8)), openai.UserMessage("hello")},
				MaxTokens: openai.Int(8),
			})
			var text strings.Builder
			for st.Next() {
				for _, c := range st.Current().Choices {
					text.WriteString(c.Delta.Content)
				}
			}
			if err := st.Err(); err != nil || text.Len() == 0 {
				t.Fatalf("streamed through the gateway: %q, %v", text.String(), err)
			}
			// The same prompt again, by plain HTTP: it goes where it is cached.
			workers := map[string]int{}
			for i := range 4 {
				// The gateway ends the picker's stream of the previous request after its client
				// has the answer: until then the picker counts it on its worker, and under load
				// may send this one elsewhere to avoid a queue that is not there.
				waitIdle(t, e.core)
				resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(chatBody(family(9), "again "+strconv.Itoa(i), 4, false)))
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, b)
				}
				workers[resp.Header.Get(epp.WorkerHeader)]++
				var out struct {
					Usage struct {
						PromptTokens        int `json:"prompt_tokens"`
						PromptTokensDetails struct {
							CachedTokens int `json:"cached_tokens"`
						} `json:"prompt_tokens_details"`
					} `json:"usage"`
				}
				_ = json.Unmarshal(b, &out)
				if i > 0 && out.Usage.PromptTokensDetails.CachedTokens < out.Usage.PromptTokens/2 {
					t.Fatalf("request %d of a shared prompt: %d of %d tokens cached (workers %v; decision %s)", i, out.Usage.PromptTokensDetails.CachedTokens, out.Usage.PromptTokens, workers, resp.Header.Get(epp.DecisionHeader))
				}
			}
			if len(workers) != 1 {
				t.Fatalf("a shared prompt went to %v", workers)
			}
			waitIdle(t, e.core)
			learned := metricSum(t, e.core, "kvrelay_proxy_ttft_prediction_error_seconds_count")
			ttfts := metricSum(t, e.core, "kvrelay_proxy_time_to_first_token_seconds_count")
			var models int64
			for _, w := range e.core.Workers() {
				models += w.Latency().Stats().ModelObservations
			}
			if mode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
				if learned == 0 || ttfts == 0 || models == 0 {
					t.Fatalf("streamed answers taught %v predictions, recorded %v TTFTs, %d model observations: want each above 0", learned, ttfts, models)
				}
				return
			}
			// A buffered answer reaches the picker whole: its arrival is not its first token,
			// and nothing may be learned or recorded of its timing.
			if learned != 0 || ttfts != 0 || models != 0 {
				t.Fatalf("buffered answers taught %v predictions, recorded %v TTFTs, %d model observations: want none", learned, ttfts, models)
			}
		})
	}
}

// metricSum adds up every series of name in the routing core's metrics.
func metricSum(t testing.TB, core *proxy.Server, name string) float64 {
	t.Helper()
	rec := httptest.NewRecorder()
	core.DecisionsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	sum := 0.0
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if !strings.HasPrefix(line, name) || (len(line) > len(name) && line[len(name)] != '{' && line[len(name)] != ' ') {
			continue
		}
		f := strings.Fields(line)
		v, _ := strconv.ParseFloat(f[len(f)-1], 64)
		sum += v
	}
	return sum
}
