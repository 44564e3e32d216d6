// Package policy holds the names and defaults of kvrelay's routing policies: the one home of
// these constants, below both planes. The data plane's router (dataplane/route) implements
// the policies; the control plane's registry stores and validates them; the xDS
// RoutingPolicy resource carries them. None of those restates a default.
package policy

import "time"

// Policy names, as operators write them (--policy, ctl policy set --policy, the
// RoutingPolicy resource's policy field).
const (
	// KV is the first-wave cost: uncached prompt blocks, prefill backlog and decode blocks.
	KV = "kv"
	// Latency picks the worker with the lowest predicted time to first token: queue wait
	// from the worker's requests against its concurrency and token budget, plus prefill of
	// the tokens it does not cache, corrected online from what the engine did.
	Latency     = "latency"
	RoundRobin  = "round-robin"
	LeastLoaded = "least-loaded"
	Random      = "random"
	PowerOfTwo  = "power-of-two"
	Session     = "session"
)

// Default is the policy a proxy without a control plane, and a control plane that no
// operator has given a policy, route with.
const Default = Latency

// Names lists every policy name. The returned slice is new on each call.
func Names() []string {
	return []string{KV, Latency, RoundRobin, LeastLoaded, Random, PowerOfTwo, Session}
}

// Defaults of the kv policy's weights (cost per KV block), of the spread rule's cache
// threshold, and of sessions. docs/routing-cost.md says what each weighs and which were
// measured (the weights) and which are assumptions (the threshold, the session TTL).
const (
	DefaultOverlapWeight  = 64
	DefaultQueueWeight    = 8
	DefaultDecodeWeight   = 1
	DefaultCacheThreshold = 0.1
	DefaultSessionTTL     = 30 * time.Minute
)

// DefaultTierWeights weigh a cached block by the tier it sits in: GPU, host memory, the
// worker's own disk, storage shared by several workers (docs/routing-cost.md). The returned
// slice is new on each call.
func DefaultTierWeights() []float64 { return []float64{1, 0.75, 0.25, 0.2} }
