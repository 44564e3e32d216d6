// Package route chooses the worker for each request: a chain of filters (which workers may
// serve it at all), scorers (what each remaining worker would cost) and a picker (which one
// wins), run by a Router over an immutable snapshot of the pool. Before any policy's filters
// the Router keeps only the workers that are healthy (not draining, not ejected) and that
// the request does not exclude (tried already, or outside a gateway's endpoint subset), and
// it hands the plugins its own copy of them, never the pool's slice.
//
// The plugins are small values behind three interfaces, Filter, Scorer and Picker; a policy
// is a named composition of them, built in Policies. The default policy, kv, is
// ARCHITECTURE.md's cost: for each worker w
//
//	cost(w) = overlap_weight · uncached prompt blocks on w
//	        + queue_weight · prefill blocks in flight on w
//	        + decode blocks in flight on w
//
// with the lowest cost winning (temperature > 0 samples a softmax over normalised costs), and
// new prefixes spread: when no worker holds cache_threshold of the prompt's blocks more than
// the worker that holds least (so a system prompt cached everywhere does not count), the pick
// goes by load, the load that delays a new prompt's first token: the least prefill
// in flight (uncached prompt tokens not yet past their first token), then the fewest
// requests, then the least KV in use.
//
// The latency policy scores each worker by its predicted time to first token for the request
// (PredictedTTFT, over package latency's model: the wait for a sequence slot, the prefill
// backlog, the request's own uncached prefill, learned online per model and worker) plus
// weighted externalities (the request's own compute, a background request's harm to
// interactive ones), and picks the lowest (LatencyPick). Requests with latency targets go to
// the worker predicted to meet them with the most headroom, or get ErrSLO.
//
// Routing runs on the proxy's event loops, so the Router never allocates per request: the
// caller owns a Request whose scratch slices grow once, and the pool is swapped whole behind
// an atomic pointer.
package route
