// Package bench is kvrelay's benchmark tool (`kvrelay bench run` and `kvrelay bench
// compare`): it replays a workload (package workload: Mooncake traces, prefix groups,
// multi-turn chat, agentic sessions) against an OpenAI endpoint, measures what clients feel
// (TTFT, inter-token latency, end-to-end latency, throughput, goodput under SLOs, errors)
// and what the fleet does (the prefix hit rate engines report against the ideal of an
// unbounded cache, each worker's share of requests over time), and writes results.json, a
// Markdown table and plots.
//
// Compare starts a fresh local cluster (simulated workers behind a kvrelay proxy) for each
// routing policy, or each cluster Setup (aggregated workers, prefill and decode pools with
// every prompt prefilled remotely, or conditionally), in turn and replays the identical
// request stream against each, so that policies and setups are compared in one run on the
// same machine.
package bench
