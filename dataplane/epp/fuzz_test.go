package epp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/kvrelay/kvrelay/dataplane/epp"
	"github.com/kvrelay/kvrelay/dataplane/proxy"
)

// memStream is an ext_proc server stream in memory: the messages a gateway sends, and what
// the picker answers.
type memStream struct {
	grpc.ServerStream
	ctx  context.Context
	in   []*extproc.ProcessingRequest
	out  []*extproc.ProcessingResponse
	next int
}

func (m *memStream) Context() context.Context { return m.ctx }
func (m *memStream) Send(r *extproc.ProcessingResponse) error {
	m.out = append(m.out, r)
	return nil
}
func (m *memStream) Recv() (*extproc.ProcessingRequest, error) {
	if m.next == len(m.in) {
		return nil, io.EOF
	}
	m.next++
	return m.in[m.next-1], nil
}
func (m *memStream) SetHeader(metadata.MD) error  { return nil }
func (m *memStream) SendHeader(metadata.MD) error { return nil }
func (m *memStream) SetTrailer(metadata.MD)       {}

// FuzzBodyReassembly: a request body split anywhere, in either body mode, reaches the pick
// whole: a well-formed chat request is routed and passed on byte for byte (its answer
// passing through in order), and anything else is refused with an immediate response; the
// picker never fails the stream, and no request's load is left behind.
func FuzzBodyReassembly(f *testing.F) {
	f.Add("hello", []byte{5, 3, 200}, false, true)
	f.Add("", []byte{}, false, false)
	f.Add("{\"model\":", []byte{1, 1, 1, 1}, true, true)
	f.Add(string(make([]byte, 3000)), []byte{255, 0, 7}, false, true)
	core := fuzzCore(f)
	svc := epp.New(core, epp.Options{MaxBodyBytes: 1 << 20})
	f.Fuzz(func(t *testing.T, content string, splits []byte, rawBody, duplex bool) {
		body := []byte(content)
		if !rawBody {
			body = chatBody("system", content, 4, true)
		}
		mode := filterv3.ProcessingMode_BUFFERED
		if duplex {
			mode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		st := &memStream{ctx: ctx}
		st.in = append(st.in, &extproc.ProcessingRequest{
			Request:        &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{Headers: headerMap("/v1/chat/completions", nil, len(body)), EndOfStream: len(body) == 0}},
			ProtocolConfig: &extproc.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode},
		})
		if len(body) > 0 {
			if duplex {
				off := 0
				for i := 0; off < len(body); i++ {
					n := len(body) - off
					if i < len(splits) {
						n = min(n, int(splits[i]))
					}
					st.in = append(st.in, &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: body[off : off+n], EndOfStream: off+n == len(body)}}})
					off += n
				}
			} else {
				st.in = append(st.in, &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true}}})
			}
		}
		answer := sse(2, 10, 0)
		st.in = append(st.in, &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extproc.HttpHeaders{Headers: headerMap("/", nil, 0)}}})
		for i, c := range answer {
			st.in = append(st.in, &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseBody{ResponseBody: &extproc.HttpBody{Body: c, EndOfStream: i == len(answer)-1}}})
		}
		if err := svc.Process(st); err != nil {
			t.Fatalf("the stream failed: %v", err)
		}
		defer func() {
			for _, w := range core.Workers() {
				if w.Load() != 0 {
					t.Fatalf("load %d left on %s", w.Load(), w.ID)
				}
			}
		}()
		if len(st.out) == 0 {
			t.Fatal("no answer")
		}
		if ir := st.out[len(st.out)-1].GetImmediateResponse(); ir != nil {
			var oe struct {
				Error struct{ Message string } `json:"error"`
			}
			if err := json.Unmarshal(ir.GetBody(), &oe); err != nil || oe.Error.Message == "" {
				t.Fatalf("immediate %d with body %q", ir.GetStatus().GetCode(), ir.GetBody())
			}
			if !rawBody && len(body) < 1<<20 {
				t.Fatalf("a well-formed request was refused: %d %s", ir.GetStatus().GetCode(), ir.GetBody())
			}
			return
		}
		var passed, answered []byte
		dest := ""
		for _, r := range st.out {
			for _, o := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
				if o.GetHeader().GetKey() == epp.DestinationKey {
					dest = string(o.GetHeader().GetRawValue())
				}
			}
			for _, o := range r.GetRequestBody().GetResponse().GetHeaderMutation().GetSetHeaders() {
				if o.GetHeader().GetKey() == epp.DestinationKey {
					dest = string(o.GetHeader().GetRawValue())
				}
			}
			passed = append(passed, r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()...)
			answered = append(answered, r.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()...)
		}
		if dest == "" {
			t.Fatalf("no destination in %d answers", len(st.out))
		}
		if duplex && len(body) > 0 {
			if !bytes.Equal(passed, body) {
				t.Fatalf("the body passed on differs: %q against %q", passed, body)
			}
			if !bytes.Equal(answered, bytes.Join(answer, nil)) {
				t.Fatalf("the answer passed on differs: %q", answered)
			}
		}
	})
}

// fuzzCore is a routing core over engines that are never dialled (a pick only routes).
func fuzzCore(t testing.TB) *proxy.Server {
	cfg := proxy.DefaultConfig()
	cfg.PickOnly, cfg.Listen = true, ""
	for _, u := range []string{"http://127.0.0.1:1", "http://127.0.0.1:2"} {
		cfg.Upstreams = append(cfg.Upstreams, proxy.Upstream{URL: u, Model: model})
	}
	core, err := proxy.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := core.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = core.Close() })
	return core
}
