package benchharness

import "strings"

// Engine kinds.
const (
	EngineLLMD    = "llmd"
	EngineKVRelay = "kvrelay"
)

// AllEngines lists the engine kinds in the order runs go through them.
var AllEngines = []string{EngineLLMD, EngineKVRelay}

// Routers, in the order every round goes through them.
const (
	RouterEPPPrecise    = "epp-precise"
	RouterEPPApprox     = "epp-approx"
	RouterRoundRobin    = "round-robin"
	RouterLeastRequest  = "least-request"
	RouterKVExact       = "kv-exact"
	RouterKVApprox      = "kv-approx"
	RouterLatencyExact  = "latency-exact"
	RouterLatencyApprox = "latency-approx"
	// The latency policy on the control plane's index asked per request (kvrelay proxy
	// --index-query) instead of a replica of it.
	RouterLatencyQuery = "latency-query-exact"
	// kvrelay's endpoint picker (kvrelay epp, the latency policy) behind the same gateway
	// as llm-d's.
	RouterKEPPExact  = "kvrelay-epp-exact"
	RouterKEPPApprox = "kvrelay-epp-approx"
)

// AllRouters lists every router the harness can run, in run order.
var AllRouters = []string{RouterEPPPrecise, RouterEPPApprox, RouterRoundRobin, RouterLeastRequest,
	RouterKVExact, RouterKVApprox, RouterLatencyExact, RouterLatencyApprox, RouterLatencyQuery, RouterKEPPExact, RouterKEPPApprox}

// IsEPP reports whether router is llm-d's endpoint picker.
func IsEPP(router string) bool { return strings.HasPrefix(router, "epp-") }

// IsKEPP reports whether router is kvrelay's endpoint picker.
func IsKEPP(router string) bool { return strings.HasPrefix(router, "kvrelay-epp-") }

// BehindGateway reports whether router is an endpoint picker behind the Envoy stand-in.
func BehindGateway(router string) bool { return IsEPP(router) || IsKEPP(router) }

// IsExact reports whether router routes on the control plane's index of the engines' KV
// events (kvrelay) rather than on its own record of what it routed where.
func IsExact(router string) bool { return strings.HasSuffix(router, "-exact") }

// KVRelayPolicy is the kvrelay routing policy a router runs ("" for llm-d's).
func KVRelayPolicy(router string) string {
	switch router {
	case RouterRoundRobin:
		return "round-robin"
	case RouterLeastRequest:
		// Least request over two random choices: dataplane/route's PowerOfTwo compares the
		// two workers' requests in flight (Envoy's LEAST_REQUEST with choice_count 2).
		return "power-of-two"
	case RouterKVExact, RouterKVApprox:
		return "kv"
	case RouterLatencyExact, RouterLatencyApprox, RouterLatencyQuery, RouterKEPPExact, RouterKEPPApprox:
		return "latency"
	}
	return ""
}

// RouterHop is the hop a router adds between the client and the engine, beside the one
// every router has (client → router → engine over HTTP).
func RouterHop(router string) string {
	if BehindGateway(router) {
		return "gateway + ext_proc gRPC to the picker (request and every response chunk)"
	}
	if router == RouterLatencyQuery {
		return "a gRPC round trip to the control plane's index before the pick"
	}
	return "none (the proxy decides in process)"
}

// PickPoint says where a router's pick time is measured: the client side of the routing
// hop in every case.
func PickPoint(router string) string {
	if BehindGateway(router) {
		return "gateway clock: ext_proc stream open (request body read) to the routing decision"
	}
	return `proxy clock: kvrelay_proxy_decision_seconds{stage="total"} (1 in 8 requests)`
}
