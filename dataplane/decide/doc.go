// Package decide decides where each request goes, in one place, whoever carries it: the
// proxy's gnet connections (package proxy) and the endpoint picker's ext_proc streams
// (package epp, through Pick) both decide through a Core, and differ only in how they move
// bytes.
//
// A Request is one request's decision and its accounting: the routing hints of its head,
// its parsed OpenAI body (package oai), its prompt rendered and tokenized with the model's
// own template and tokenizer (engines/tokenizer; or by an engine's /tokenize, or estimated)
// and hashed into a block chain (engines/blockhash), the routing call (package route, over
// the Core's routers: by prompt for completions, by load for the rest) with a rollout's
// candidate policy for its share of the requests and a shadow pick beside the stable one,
// what is left of its TTFT target, the disaggregation test (a decode worker by load, a
// prefill worker KV-aware, prefilling on the decode worker when the uncached part is short
// or the prefill pool saturated), its wait in the admission queue while every worker is
// busy, the sampled decision record with every candidate's prediction, and its tally on the
// worker (load, the latency model's lessons, the prefix index record at its first token,
// its metrics at its end).
//
// # Threading
//
// The API does not block: nothing in a Request waits for I/O, a lock held elsewhere or
// another goroutine, except Work, which its carrier runs where it may block. Prepare says
// when a request needs work off its carrier's loop (ErrRemote: an engine's /tokenize round
// trip; ErrLarge: a prompt long enough that tokenizing it would stall an event loop;
// ErrIndex: a query of the control plane's index, for a proxy that keeps no replica); the
// carrier runs Work there and Resume back on its own goroutine, until Resume answers
// neither. A request that finds every
// worker busy waits through a Waiter, which the queue wakes from any goroutine: the proxy's
// connection resumes on its event loop, a Pick on its stream's goroutine, which it blocks.
//
// A Request is used by one goroutine at a time. A Core is shared by every carrier: what
// requests read of it (pools, policies, a candidate, codecs, worker states) is an immutable
// snapshot behind an atomic pointer, or a router, index or queue safe for concurrent use. Its
// owner (the proxy's Server, static or fed by a control plane) updates it from one goroutine
// at a time.
//
// # Lifecycle
//
// NewCore (no side effects) → Build (routers, tokenizers) → SetWorkers, SetPool,
// SetPolicy, ApplyCandidate as the workers and policies change → Drain (new requests are
// refused; those in flight, counted with Enter and Leave, go on).
package decide
