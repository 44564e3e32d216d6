// Package proxy is kvrelay's edge proxy: an OpenAI-compatible HTTP/1.1 server on gnet event
// loops that carries each request to the engine worker its routing core chose (package
// decide: the worker holding most of its prompt in KV cache without overloading anyone) and
// streams the answer back.
//
// The proxy carries; package decide decides. Here are the connections and their framing,
// the exchange with engines and its failures (retries, ejection timeouts, migration of a
// broken stream), the pools of upstream connections, the event loops, the prefill legs of
// disaggregated requests, speculative prefill, Responses API stickiness, the xDS client that
// keeps the routing core's workers and policies current, and the admin endpoints. A
// request's input, tokenization, routing, admission, tally, decision record and rollout arm
// are the routing core's, which the endpoint picker (package epp) shares.
//
// # Threading
//
// Each gnet event loop owns its client connections and, registered on the same loop through
// EventLoop.Enroll, a pool of keep-alive connections to every worker. A request is framed
// (package http1), decided (package decide: parsed by package oai, rendered and tokenized with
// the model's own chat template and tokenizer, hashed into a block chain, routed by package
// route over the prefix index of package prefix) and written to an upstream connection, all
// on the loop goroutine; the engine's response arrives on the same loop and is written to
// the client directly, chunk by chunk, with no goroutine hand-off and no buffering of whole
// responses. Dialling a new upstream connection runs on its own goroutine, which enrolls the
// connection on the loop when it is up; so do a large body's parse, a large prompt's
// tokenization and a remote tokenizer's round trip, which resume the request on its loop.
//
// # Failure handling
//
// A connect failure, a reset before the response head or a 5xx before any byte reached the
// client counts against the worker (EjectAfter in a row eject it for EjectFor) and the
// request tries the next-best worker, up to Retries times. A client that disconnects closes
// its engine connection at once, which makes vLLM-style engines abort the request and free its
// KV blocks. An engine that dies mid-stream ends the client's stream with an error event and
// [DONE]. A client that reads slower than the engine writes pauses forwarding above a high-
// water mark (bytes then wait in the engine connection's buffer) and is cut off past
// MaxBufferedResponse. When every worker is past its busy thresholds requests wait in a
// bounded priority queue (429 with Retry-After when full, 503 past QueueTimeout).
//
// # Lifecycle
//
// New (no side effects) → Start (discover models, bind, start loops) → Run (serve until the
// context ends, then Drain: new requests get 503, streams in flight finish) → Close.
package proxy
