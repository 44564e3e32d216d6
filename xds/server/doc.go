// Package server is the control plane's side of kvrelay's xDS: it publishes Worker, Loads
// and RoutingPolicy resources to proxies over delta ADS and gathers the proxies' in-flight
// load.
//
// Resources ride go-control-plane as custom type URLs: one cache.LinearCache per type URL
// (xds.WorkerType, xds.LoadsType, xds.PolicyType, xds.KeysType) behind a cache.MuxCache
// that classifies requests by type URL, served by go-control-plane's delta server
// (pkg/server/delta/v3) registered as the AggregatedDiscoveryService. The snapshot cache
// cannot be used (it maps type URLs to a fixed enum of Envoy types and rejects others), and
// state-of-the-world is refused because it cannot tell a proxy that a worker was removed.
// In delta mode the LinearCache versions each resource by the SHA-256 of its deterministic
// encoding, so versions survive a control plane restart and a proxy that resubscribes with
// initial_resource_versions is sent only what changed. A Worker resource carries its load
// index, which each process gives in the order it first publishes the workers (the control
// plane's, by id) and then to each new one: after a restart or on another replica, the
// workers that came and went in the meantime may hold other indexes, and are sent again
// with their shards.
//
// The caller (the control plane) owns the Server:
//
//	srv := server.New(server.Options{})
//	xdsv1.RegisterIndexJournalServer(srv.GRPC(), journal) // more services on the same port
//	srv.SetWorkers(workers)                               // the initial state, before Serve
//	srv.SetPolicy(policy)
//	go srv.Serve(ctx, lis)                                // until ctx is done
//	for range srv.LoadChanged() { merged := srv.Merged(); ... srv.SetWorkers(withLoad) }
//
// A proxy that names the models it routes (node metadata xds.NodeModelsKey, xds/client's
// Options.Models) watches a worker cache of its scope: the workers that serve one of them,
// as base model or adapter, and those whose model is not known (scoped.go). Proxies of one
// scope share its cache; at most 64 scopes are held, each until a minute after its last
// watch, and a proxy of one more is served the full cache.
//
// SetWorkers takes workers with their loads and diffs against what was published
// (proto.Equal). Each worker gets a load index, stable while it is published with the same
// model, in a shard of its model's (a proxy that routes some models subscribes to their
// shards by name: xds/client's Options.Serves); its Worker
// resource goes without its load (and with the index) to the worker cache when more than
// its load changed, and the loads go to the loads cache as one Loads resource per shard of
// xds.LoadsShard indexes, resent whole when any load in it changed, each entry with a check
// of its worker's id (so that a proxy holding workers and loads of different publications
// never takes another worker's load for one's own): about 18 bytes a worker instead of a
// few hundred, and, per proxy, a shard per 32 workers for the cache to compare on every
// publish instead of every worker. So a push costs what changed. The LoadReporting service
// keeps each node's latest report until its stream ends or it goes stale, and Merged sums
// them per worker. MergedEpochs numbers each merge: a worker's Load.epoch is the merge in
// which any proxy's share of it last changed, and each proxy hears on its load stream which
// of its reports a merge includes, so that it takes exactly its own share out of the sums.
// A worker's load thus costs the same whatever the number of proxies, and one whose shares
// stay put is not sent again: for 1,000 workers and 100 proxies, a push is 19 KB a proxy
// with the loads in shards, against 58 KB when each report changes 1 % of its shares and
// 119 KB when every worker changes with each load in its Worker resource, and 1.5 MB when
// every worker named every proxy's report (BenchmarkLoadPush).
//
// What a client can make the server hold is bounded: a peer address holds at most
// MaxConnsPerPeer connections and MaxStreamsPerPeer streams, every peer together at most
// MaxConns and MaxStreams, and one connection twice MaxStreamsPerPeer streams (the transport
// refuses more);
// the receive windows are static (256 KiB a stream, 1 MiB a connection), so a stream whose
// handler has stopped reading parks no more; an ADS stream whose proxy takes no response for
// SendTimeout is ended (go-control-plane queues at most one response per type, the next
// only after an ACK); load reports name only published workers. The index journal bounds
// its own streams (xds/journal: SendTimeout, MaxUnacked, AckTimeout, shared snapshots).
package server
