package api

import (
	"net/http"
	"strings"

	"google.golang.org/grpc"
)

// Mux serves gRPC and JSON over HTTP on one listener: HTTP/2 requests whose content type is
// application/grpc (application/grpc+proto, …) go to grpcSrv, everything else to h. The
// http.Server serving it needs Protocols() so that gRPC clients, which speak HTTP/2 without
// TLS from the first byte, are understood on a plain listener.
//
// grpcSrv serves through its ServeHTTP here, not Serve: its own listener options
// (keepalive enforcement, connection limits) do not apply; interceptors and service
// registrations do.
func Mux(grpcSrv *grpc.Server, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 && strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") {
			grpcSrv.ServeHTTP(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// Protocols returns what an http.Server serving Mux must speak: HTTP/1.1, HTTP/2 over TLS
// and unencrypted HTTP/2 (h2c with prior knowledge, which is how gRPC clients connect
// without TLS).
func Protocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return p
}
