// Package xds will hold the protocol between kvrelay's control plane and its proxies: the
// protobuf resource types (xds/api/v1, generated code committed), their type URLs and
// builders, the delta ADS server wiring on go-control-plane, and the client proxies use.
package xds
