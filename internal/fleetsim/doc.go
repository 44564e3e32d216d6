// Package fleetsim replays a kvrelay bench workload against a fleet of modelled engines
// behind kvrelay's router, in virtual time: no sockets, no sleeps, the same result for the
// same seed. It is how routing policies are compared and regression-tested where a real
// side-by-side run (hack/bench-llmd, hack/bench-suite) would take minutes and depend on the
// host's load.
//
// The engines are kvrelay's own simulated engine (engines/sim, driven step by step through
// Engine.StepAt) and a model of llm-d-inference-sim's latency calculator (per-token prefill
// with a load factor, a fixed number of request slots, an LRU prefix cache). The router is
// package dataplane/route, called as the proxy calls it: each request is routed on its
// prompt's block hashes, its load is accounted with route.Usage (which teaches the latency
// model its first token and its decode), and, in the exact mode, the engines' running and
// waiting counts and KV usage are reported every ReportEvery as a control plane pushes them,
// while the index is the engines' caches themselves (what KV events carry, without their lag).
//
// # Threading
//
// Run is single-threaded and replaces route.Clock with the virtual clock and route.Rand
// with a source seeded by Config.Seed while it runs:
// callers must not route with package route concurrently (tests that call Run must not be
// parallel with other tests of the same process that route).
package fleetsim
