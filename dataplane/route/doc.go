// Package route chooses the worker for each request: a chain of filters (which workers may
// serve it at all), scorers (what each remaining worker would cost) and a picker (which one
// wins), run by a Router over an immutable snapshot of the pool. Before any policy's filters
// the Router keeps only the workers that are healthy (not draining, not ejected) and that
// the request does not exclude (tried already, or outside a gateway's endpoint subset), and
// it hands the plugins its own copy of them, never the pool's slice.
//
// The plugins are small values behind three interfaces, Filter, Scorer and Picker. A Policy
// is a composition of them: the preset of a built-in name (Preset; NewPolicy builds it) or
// an operator's profile (policy.Profile), resolved through a Registry of named plugins
// (RegisterBuiltins registers kvrelay's own; Builtins returns the registry holding just those).
// docs/routing-cost.md is the design of both cost models and says where each default comes
// from.
//
// The default policy, latency (PolicyDefault), scores each worker by its predicted time to
// first token for the request (PredictedTTFT, over package latency's model: the wait for a
// sequence slot, the prefill backlog, the request's own uncached prefill, learned online
// per model and worker) plus weighted externalities (the request's own compute, the decode
// slowdown it causes, a background request's harm to interactive ones), and picks the
// lowest (LatencyPick). Requests with latency targets go to the worker predicted to meet
// them with the most headroom, or get ErrSLO.
//
// The kv policy scores a cost in KV blocks: for each worker w
//
//	cost(w) = overlap_weight · uncached prompt blocks on w
//	        + queue_weight · prefill blocks in flight on w
//	        + decode blocks in flight on w
//
// with cached blocks counted at their tier's weight and the lowest cost winning (temperature
// > 0 samples a softmax over normalised costs).
//
// Both spread new prefixes: when no worker holds cache_threshold of the prompt's blocks more
// than the worker that holds least (so a system prompt cached everywhere does not count), the
// kv policy picks by the load that delays a new prompt's first token (LeastPrefill: the least
// prefill in flight, then the fewest requests, then the least KV in use), and the latency
// policy predicts every worker as caching as little as the least, so that load decides.
//
// Routing runs on the proxy's event loops, so the Router never allocates per request: the
// caller owns a Request whose scratch slices grow once, and the pool is swapped whole behind
// an atomic pointer.
package route
