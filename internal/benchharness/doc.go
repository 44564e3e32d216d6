// Package benchharness runs kvrelay's routers and llm-d's endpoint picker on simulated
// engines on loopback and measures them: the machinery behind hack/bench-llmd and
// hack/bench-suite.
//
// One run (RunOne) starts a fresh fleet of engines (llm-d-inference-sim or `kvrelay sim`,
// described by a Fleet) and a fresh router (Routers), replays a `kvrelay bench` workload
// against the router in process, reads the router's pick times and counters, and stops
// everything; a RunResult is what it measured. Every process runs in its own process group,
// stopped at the end of the run, on a failure and when the harness dies (StopAll, Pdeathsig).
// Prepare resolves the peer binaries and builds kvrelay and the gateway once; Lock takes the
// benchmark lock that kvrelay's benchmark scripts share.
//
// The harness gives every router the same facts about the engines: their addresses, the
// model, the KV cache block size and size in blocks (which llm-d's EPP reads from the
// engines' vllm:cache_config_info). Scheduler limits (max-num-seqs, the step's token budget)
// are left for each router to discover.
//
// Not safe for concurrent runs: one run at a time per process (the process supervisor is
// package state), and one harness per port range.
package benchharness
