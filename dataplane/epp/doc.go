// Package epp is kvrelay as a Gateway API endpoint picker: an Envoy external processor
// (envoy.service.ext_proc.v3.ExternalProcessor) speaking the Gateway API Inference
// Extension's endpoint picker protocol, so that Envoy-based gateways (Envoy Gateway, Istio,
// kgateway, Envoy AI Gateway, GKE's Inference Gateway) route each request with kvrelay's
// routing core: the same index replica, load view, latency models, policies and rollouts as
// kvrelay's proxy, fed by the same control plane.
//
// # Protocol
//
// For each HTTP request the gateway opens a stream and sends the request's headers, then its
// body (BUFFERED: whole, in one message, after the headers' answer; FULL_DUPLEX_STREAMED: in
// chunks of any split, without waiting). Once the body is whole the picker asks the
// routing core for a pick (dataplane/decide, Core.Pick: parse, tokenize, match, score, pick,
// waiting in the admission queue while every worker is busy, as for a request the proxy
// carries) and answers with
// the header x-gateway-destination-endpoint and the dynamic metadata envoy.lb →
// x-gateway-destination-endpoint carrying the same value: the picked endpoint (ip:port),
// followed, with Options.Fallbacks, by the next best ones. The candidates may be restricted
// by the gateway's subset hint (filter metadata envoy.lb.subset_hint →
// x-gateway-destination-endpoint-subset: an empty or wholly ineligible list gets 503). A
// request that cannot be routed gets an ImmediateResponse with the status and OpenAI-shaped
// error the proxy would answer with (503 no endpoint, 429 shed or queue full, 400 a bad
// body, 413 too large). In FULL_DUPLEX_STREAMED mode the picker sends the body on itself
// (StreamedBodyResponse), and in both modes it may change it (kvrelay's peer-fetch
// parameters; the engine's priority field).
//
// The answer passes through the picker when the gateway sends it (response body mode
// BUFFERED or FULL_DUPLEX_STREAMED): the endpoint that served it (filter metadata envoy.lb →
// x-gateway-destination-endpoint-served) takes the request's load if it is not the one
// picked, and its first token, usage and end teach the routing core what the proxy learns
// from the answers it carries (TTFT for the latency models, cached_tokens for the
// approximate index, in-flight load).
//
// A disaggregated pool (prefill and decode workers) gets a decode worker as the
// destination and, when the prompt is worth prefilling elsewhere, the prefill worker in
// x-prefiller-host-port, which llm-d's routing sidecar beside the decode worker reads to run
// the prefill leg (vLLM NixlConnector).
//
// # Threading
//
// gRPC runs each stream's Process on a goroutine of its own; a stream's state belongs to it.
// Picks are safe for concurrent use across streams (the routing core is shared by every
// stream as it is by the proxy's event loops).
package epp
