// Package loadview is the control plane's view of each worker's load and health.
//
// A View runs one poller goroutine per worker (Target). Every Interval the poller scrapes the
// worker's Prometheus metrics and reads them with the engine kind's adapter (engines.Engine:
// vLLM and the simulated engine, SGLang, TensorRT-LLM), so that running and waiting requests,
// KV cache usage, block size and KV capacity come from the engine's own numbers. A scrape that
// succeeds is the health probe; when the metrics endpoint fails the poller asks the engine's
// liveness endpoint (URL + /health) instead. A worker turns unhealthy after FailAfter
// consecutive polls in which both failed, and healthy again after one poll in which either
// succeeded. Its model comes from /v1/models once it is healthy, retried with backoff while
// that fails, and asked again after the worker has been down (it may come back serving
// another model).
//
// Lifecycle: New builds a View without side effects; Sync starts, restarts and stops pollers
// to match the registry's targets; Close stops them all. Readers take copies (Snapshot, Get)
// and wait on Changed, a coalescing signal raised when a worker's state changed in a way that
// routing cares about (health, running or waiting counts, KV usage by more than a percentage
// point, model or cache geometry discovered). Stats and the prometheus.Collector methods
// expose the pollers' own counters.
//
// With several control plane replicas, Options.Delegated names the workers another replica
// polls: their pollers take that replica's readings (PutRemote, State.From naming it) while
// fresh ones come, and poll on their own again once none has come for RemoteMaxAge. Polled
// lists what the view polled itself, for sharing. Health is then the polling replica's: a
// worker it cannot reach is unhealthy for the replicas that take its readings too.
//
// Every method of View is safe for concurrent use. The load view only reads the engines;
// merging in proxies' in-flight reports is left to the code that pushes it to them.
package loadview
