// Package client is a proxy's side of kvrelay's xDS: a delta ADS Client that keeps the
// proxy's copy of the control plane's Worker, Loads and RoutingPolicy resources, and a
// Reporter that streams the proxy's in-flight load per worker back to the control plane.
//
// The proxy owns both and runs each on a goroutine of its own:
//
//	conn, _ := client.Dial("127.0.0.1:18000")
//	c, _ := client.New(conn, client.Options{NodeID: id, OnUpdate: swapRoutingSnapshot})
//	r, _ := client.NewReporter(conn, client.ReporterOptions{NodeID: id, Snapshot: inflight})
//	g.Go(func() error { return c.Run(ctx) })
//	g.Go(func() error { return r.Run(ctx) })
//	... after g.Wait(): conn.Close()
//
// The Client subscribes (wildcard) to every type in xds.TypeURLs. For each response it
// decodes and validates every resource (xds.ValidateWorker / ValidatePolicy / DecodeLoads
// plus the proxy's own checks), applies those that pass, keeps the previous version of
// those that fail, calls OnUpdate with the full state if anything changed (the workers, the
// policy, and the loads, which xds.PushedLoads.LoadOf gives per worker), then ACKs, or
// NACKs with the refusals as error detail. When the stream breaks it waits a jittered
// exponential backoff and resubscribes with the versions it holds
// (initial_resource_versions); meanwhile State still returns the last state, so the proxy
// keeps routing while the control plane is away.
package client
