package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	operatorv1 "github.com/kvrelay/kvrelay/controlplane/api/v1"
)

// Handler returns the operator API as JSON over HTTP (see the package documentation for the
// routes), on b, authenticated as opts say. It is safe for concurrent use.
func Handler(b Backend, opts Options) http.Handler {
	h := &httpHandler{ops: ops{b}, auth: newAuthorizer(opts)}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", h.methods(map[string]route{
		http.MethodGet: {read: true, open: true, fn: func(context.Context, *http.Request) (proto.Message, error) {
			return nil, nil
		}},
	}))
	mux.HandleFunc("/v1/workers", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, _ *http.Request) (proto.Message, error) {
			return h.ops.listWorkers(ctx)
		}},
	}))
	mux.HandleFunc("/v1/workers/{id}", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			return h.ops.getWorker(ctx, r.PathValue("id"))
		}},
		http.MethodPut: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			spec := new(operatorv1.WorkerSpec)
			if err := decodeBody(r, spec); err != nil {
				return nil, err
			}
			id := r.PathValue("id")
			switch spec.Id {
			case "":
				spec.Id = id
			case id:
			default:
				return nil, invalidf("the body's id %q is not the path's %q", spec.Id, id)
			}
			return h.ops.upsertWorker(ctx, spec)
		}},
		http.MethodDelete: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			return h.ops.removeWorker(ctx, r.PathValue("id"))
		}},
	}))
	mux.HandleFunc("/v1/workers/{id}/drain", h.methods(map[string]route{
		http.MethodPost: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			return h.ops.setDraining(ctx, r.PathValue("id"), true)
		}},
	}))
	mux.HandleFunc("/v1/workers/{id}/undrain", h.methods(map[string]route{
		http.MethodPost: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			return h.ops.setDraining(ctx, r.PathValue("id"), false)
		}},
	}))
	mux.HandleFunc("/v1/policy", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, _ *http.Request) (proto.Message, error) {
			return h.ops.getPolicy(ctx)
		}},
		http.MethodPut: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			p := new(operatorv1.Policy)
			if err := decodeBody(r, p); err != nil {
				return nil, err
			}
			return h.ops.setPolicy(ctx, p)
		}},
	}))
	mux.HandleFunc("/v1/policy/history", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			var limit uint64
			if v := r.URL.Query().Get("limit"); v != "" {
				var err error
				if limit, err = strconv.ParseUint(v, 10, 32); err != nil {
					return nil, invalidf("limit %q: want a non-negative integer", v)
				}
			}
			return h.ops.policyHistory(ctx, uint32(limit))
		}},
	}))
	mux.HandleFunc("/v1/rollout", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, _ *http.Request) (proto.Message, error) {
			return h.ops.getRollout(ctx)
		}},
		http.MethodPost: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			req := new(operatorv1.StartRolloutRequest)
			if err := decodeBody(r, req); err != nil {
				return nil, err
			}
			return h.ops.startRollout(ctx, req)
		}},
	}))
	mux.HandleFunc("/v1/rollout/{action}", h.methods(map[string]route{
		http.MethodPost: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			return h.ops.controlRollout(ctx, r.PathValue("action"))
		}},
	}))
	mux.HandleFunc("/v1/index", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, _ *http.Request) (proto.Message, error) {
			return h.ops.getIndex(ctx)
		}},
	}))
	mux.HandleFunc("/v1/proxies", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, _ *http.Request) (proto.Message, error) {
			return h.ops.listProxies(ctx)
		}},
	}))
	mux.HandleFunc("/v1/tenants", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, _ *http.Request) (proto.Message, error) {
			return h.ops.listTenants(ctx)
		}},
	}))
	mux.HandleFunc("/v1/keys", h.methods(map[string]route{
		http.MethodGet: {read: true, fn: func(ctx context.Context, _ *http.Request) (proto.Message, error) {
			return h.ops.listAPIKeys(ctx)
		}},
	}))
	mux.HandleFunc("/v1/keys/{id}", h.methods(map[string]route{
		http.MethodPut: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			k := new(operatorv1.ApiKey)
			if err := decodeBody(r, k); err != nil {
				return nil, err
			}
			id := r.PathValue("id")
			switch k.Id {
			case "":
				k.Id = id
			case id:
			default:
				return nil, invalidf("the body's id %q is not the path's %q", k.Id, id)
			}
			return h.ops.putAPIKey(ctx, k)
		}},
		http.MethodDelete: {fn: func(ctx context.Context, r *http.Request) (proto.Message, error) {
			return h.ops.deleteAPIKey(ctx, r.PathValue("id"))
		}},
	}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &Error{Code: codes.NotFound, Message: fmt.Sprintf("no operator API route %s", r.URL.Path)})
	})
	return mux
}

type httpHandler struct {
	ops  ops
	auth authorizer
}

// route is one method of one path. A read is authenticated as a read (open when
// Options.OpenReads); open routes are never authenticated. fn returns the response, nil for
// the health check.
type route struct {
	read, open bool
	fn         func(context.Context, *http.Request) (proto.Message, error)
}

// methods dispatches on the request's method: 405 with an Allow header for the others.
func (h *httpHandler) methods(routes map[string]route) http.HandlerFunc {
	allow := make([]string, 0, len(routes))
	for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodPost, http.MethodDelete} {
		if _, ok := routes[m]; ok {
			allow = append(allow, m)
		}
	}
	allowed := strings.Join(allow, ", ")
	return func(w http.ResponseWriter, r *http.Request) {
		rt, ok := routes[r.Method]
		if !ok {
			w.Header().Set("Allow", allowed)
			writeError(w, &Error{Code: codes.Unimplemented, Message: fmt.Sprintf("method %s not allowed on %s (allowed: %s)", r.Method, r.URL.Path, allowed)})
			return
		}
		if !rt.open {
			if e := h.auth.check(r.Header.Get("Authorization"), !rt.read); e != nil {
				if e.Code == codes.Unauthenticated {
					w.Header().Set("WWW-Authenticate", `Bearer realm="kvrelay"`)
				}
				if f := h.auth.opts.OnReject; f != nil {
					f(rejectReason(e), r)
				}
				writeError(w, e)
				return
			}
		}
		r.Body = http.MaxBytesReader(w, r.Body, MaxBodyBytes)
		resp, err := rt.fn(r.Context(), r)
		if err != nil {
			writeError(w, toError(err))
			return
		}
		if resp == nil {
			writeJSON(w, http.StatusOK, []byte(`{"status":"ok"}`))
			return
		}
		body, err := marshalOptions.Marshal(resp)
		if err != nil {
			writeError(w, &Error{Code: codes.Internal, Message: fmt.Sprintf("encoding the response: %v", err)})
			return
		}
		writeJSON(w, http.StatusOK, body)
	}
}

var (
	// marshalOptions write responses: proto field names, every field, indented for people
	// reading curl's output.
	marshalOptions = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true, Multiline: true, Indent: "  "}
	// unmarshalOptions read request bodies, refusing unknown fields: a misspelt field in a
	// PUT would otherwise reset it silently.
	unmarshalOptions = protojson.UnmarshalOptions{}
)

// decodeBody reads a request body (limited to MaxBodyBytes by methods) into m. Errors are *Error:
// ResourceExhausted for a body too large, InvalidArgument for anything else.
func decodeBody(r *http.Request, m proto.Message) error {
	data, err := io.ReadAll(r.Body)
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return &Error{Code: codes.ResourceExhausted, Message: fmt.Sprintf("request body larger than %d bytes", MaxBodyBytes)}
		}
		return &Error{Code: codes.InvalidArgument, Message: fmt.Sprintf("reading the request body: %v", err)}
	}
	return decodeJSON(data, m)
}

// decodeJSON unmarshals a request body into m; errors are InvalidArgument *Errors.
func decodeJSON(data []byte, m proto.Message) error {
	if len(strings.TrimSpace(string(data))) == 0 {
		return &Error{Code: codes.InvalidArgument, Message: "empty request body: send a JSON object"}
	}
	if err := unmarshalOptions.Unmarshal(data, m); err != nil {
		return &Error{Code: codes.InvalidArgument, Message: fmt.Sprintf("malformed JSON body: %v", err)}
	}
	return nil
}

// errorBody is the JSON error every failed HTTP call returns.
type errorBody struct {
	Error struct {
		Message string `json:"message"`
		Code    string `json:"code"`
	} `json:"error"`
}

func writeError(w http.ResponseWriter, e *Error) {
	var b errorBody
	b.Error.Message = e.Message
	b.Error.Code = CodeName(e.Code)
	data, _ := json.Marshal(b) // cannot fail on strings
	writeJSON(w, e.HTTPStatus(), data)
}

func writeJSON(w http.ResponseWriter, status int, body []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(body)
	_, _ = w.Write([]byte("\n"))
}

// ReadOnly serves h's GET routes (a read-only JSON extension of the operator API, such as
// the planner's /v1/planner/) authenticated as reads like the API's own; other methods get
// 405.
func ReadOnly(h http.Handler, opts Options) http.Handler {
	auth := newAuthorizer(opts)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			w.Header().Set("Allow", http.MethodGet)
			writeError(w, &Error{Code: codes.Unimplemented, Message: fmt.Sprintf("method %s not allowed on %s (allowed: GET)", r.Method, r.URL.Path)})
			return
		}
		if e := auth.check(r.Header.Get("Authorization"), false); e != nil {
			if e.Code == codes.Unauthenticated {
				w.Header().Set("WWW-Authenticate", `Bearer realm="kvrelay"`)
			}
			writeError(w, e)
			return
		}
		h.ServeHTTP(w, r)
	})
}
