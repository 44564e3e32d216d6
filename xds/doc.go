// Package xds is the protocol between kvrelay's control plane and its proxies: the type URLs
// of its resources (Worker, RoutingPolicy, carried as protobuf from xds/api/v1, generated
// code committed), their builders, decoders and validation (the limits a proxy enforces before
// it ACKs), and the control plane's default policy. Its subpackages are the server wiring on
// go-control-plane's delta ADS (server), the proxies' client and load reporter (client), the
// journal that streams the KV index's changes (journal), the set structure behind the index
// on both sides (blockset), the policies' names and defaults (policy) and the transport's
// authentication (auth).
//
// Both planes import it; it imports neither.
package xds
