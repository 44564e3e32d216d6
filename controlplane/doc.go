// Package controlplane is kvrelay's control plane: a Server that runs the worker registry
// and policy store (registry), one KV event subscriber per worker feeding the global prefix
// index and its journal (ingest, kvindex), the fleet's load view (loadview), the rollout
// controller that steps a candidate routing policy through package rollout, the operator
// API (api) with its console (ui) and the planner's routes (planner runs beside it, attached
// with SetPlanner), and the xDS server that pushes workers, the policy and the index to
// proxies (package xds). Several replicas may run: every one ingests every engine's events
// and serves proxies, and the one that package leader elects makes the changes.
//
// A worker's load (its engine's running and waiting requests and KV usage, the proxies'
// in-flight sums) is published again when it moves past a band (a count by more than one
// and an eighth, or between zero and not; KV usage by 1/64) or, moving within it, once
// Options.LoadRefresh has passed, and it travels apart from the worker, in the Loads
// resource of its shard of 32 workers (package xds/server). Where engines' readings jitter
// on every scrape, 1,000 workers push each proxy 144 KB a second, 223 KB where every engine
// holds a queue of 1 to 4 that moves on every scrape, and 219 KB without the band; sent as
// whole Worker resources, the same loads took 263 KB, 979 KB and 2.5 MB (BenchmarkLoadBand,
// delta framing counted). Where the proxies' own in-flight sums churn (bench-xds scale), a
// worker leaves its band within a few reports and the band saves nothing; the shards then
// bound what it costs, and Options.LoadPushBudget, when set, the bytes a second they take on
// each proxy's stream: a push's loads delay the next by what they cost of the budget.
// Proxies keep a pushed load as long as the control plane answers their load reports.
//
// It never imports the data plane: what both planes share sits below them in package xds.
package controlplane
