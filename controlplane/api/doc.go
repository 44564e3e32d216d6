// Package api serves the control plane's operator API (controlplane/api/v1, service
// Operator) twice over: as gRPC and as JSON over HTTP, both on top of one Backend that the
// control plane implements. `kvrelay ctl` is its HTTP client.
//
// # HTTP
//
// Bodies and responses are protojson with the proto field names (block_size, kv_usage);
// 64-bit integers are JSON strings, as protojson writes them.
//
//	GET    /v1/workers               ListWorkersResponse
//	GET    /v1/workers/{id}          Worker
//	PUT    /v1/workers/{id}          body WorkerSpec → Worker (its id may be left out)
//	DELETE /v1/workers/{id}          {}
//	POST   /v1/workers/{id}/drain    Worker
//	POST   /v1/workers/{id}/undrain  Worker
//	GET    /v1/policy                Policy
//	PUT    /v1/policy                body Policy → Policy with its new version
//	GET    /v1/policy/history        PolicyHistoryResponse, the latest first (?limit=N)
//	POST   /v1/rollout               body StartRolloutRequest → Rollout
//	GET    /v1/rollout               Rollout, the running or latest one
//	POST   /v1/rollout/{action}      Rollout; action pause, resume, promote or abort
//	GET    /v1/index                 Index
//	GET    /v1/proxies               ListProxiesResponse
//	GET    /v1/tenants               ListTenantsResponse
//	GET    /v1/keys                  ListApiKeysResponse: ids, SHA-256s, tenants, never keys
//	PUT    /v1/keys/{id}             body ApiKey (the key or its sha256) → ApiKey as stored
//	DELETE /v1/keys/{id}             DeleteApiKeyResponse
//	GET    /healthz                  {"status":"ok"}, never authenticated
//
// Errors are {"error": {"message": "...", "code": "not_found"}} with the status 400
// (invalid_argument), 401 (unauthenticated), 403 (permission_denied), 404 (not_found),
// 405 (method_not_allowed), 409 (failed_precondition), 413 (request_too_large) or 500
// (internal). Request bodies are limited to MaxBodyBytes; unknown fields are refused.
//
//	curl -s localhost:18080/v1/workers
//	curl -s -X PUT -H "Authorization: Bearer $(cat token)" localhost:18080/v1/workers/w5 \
//	  -d '{"url": "http://127.0.0.1:8005", "engine": "sim"}'
//
// # Authentication
//
// Calls that change state need "Authorization: Bearer <Options.Token>" (gRPC: the
// "authorization" metadata), compared in constant time; reads need it too unless
// Options.OpenReads. Without a token configured, the API refuses what would need one unless
// Options.AllowUnauthenticated.
//
// # Serving
//
// One listener can carry both: Mux sends HTTP/2 requests with an application/grpc content
// type to the gRPC server and everything else to the JSON handler, and Protocols enables the
// unencrypted HTTP/2 that gRPC clients speak:
//
//	g := grpc.NewServer()
//	api.Register(g, backend, opts)
//	srv := &http.Server{Handler: api.Mux(g, api.Handler(backend, opts)), Protocols: api.Protocols()}
//	srv.Serve(listener)
package api
