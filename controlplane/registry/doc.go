// Package registry is the control plane's worker registry and policy store: it knows which
// engine workers exist, which of them are drained, and the routing policy every proxy applies.
//
// # Sources
//
// Workers come from four sources, recorded in Worker.Source:
//
//   - "flag": `--worker` values, parsed by ParseWorker and given to New. Fixed for the life of
//     the process.
//   - "file": a YAML workers file (LoadFile, ParseWorkers), loaded by ReloadFile and kept up to
//     date by WatchFile, which polls it and replaces the file's workers when its content
//     changes. A file that no longer parses, or that disappears, leaves the previous set in
//     place; the failure is logged and counted in Stats.
//   - "api": workers the operator API adds with Upsert and deletes with Remove. They are
//     persisted in the Store and come back after a restart.
//   - "k8s": one worker per ready endpoint of the EndpointSlices that WatchEndpointSlices
//     follows with a client-go informer.
//
// # Precedence
//
// Each source keeps its own workers; a worker id present in several sources resolves, in
// Workers and Get, to the one from the source earliest in this order:
//
//	api > file > flag > k8s
//
// The operator API wins so that an operator can always correct a worker at run time; the
// workers file beats the flags because it can be edited without a restart; discovered
// workers come last. A shadowed worker is not lost: it reappears when the one hiding it goes
// away (an API worker removed, a line deleted from the file). Every new shadowing is logged
// at warning level, so no source silently overrides another. The precedence is fixed, not
// "first come", so the result never depends on which source happened to load first.
//
// Remove deletes only API workers; removing a worker from another source is an error
// (ErrNotRemovable) that names the source to remove it from.
//
// # Draining
//
// SetDraining records an explicit drain (or undrain) per worker id, for workers of any
// source, and persists it. An explicit setting overrides the worker's own Draining field
// (from the file, say); ids without one keep their source's value. The setting outlives the
// worker so that a pod that comes back under the same name stays drained; it is forgotten
// when an API worker is removed and no other source has the id.
//
// # Persistence
//
// A Store is a bbolt database, kvrelay.db, in the control plane's data directory. It holds
// the API workers (JSON by id), the explicit drain settings and the current routing policy.
// Flag, file and Kubernetes workers are not stored: their sources are read again at start.
// A policy's Version grows by one on every SetPolicy, is stored with it and so survives
// restarts; proxies can compare versions to know which policy they run. A Registry may run
// without a Store (New with nil), keeping the same state in memory only.
//
// # Concurrency
//
// All Registry methods are safe for concurrent use. WatchFile and WatchEndpointSlices block
// until their context ends and are meant to run on goroutines owned by the caller (an
// errgroup in cmd/). Changes delivers a coalesced notification after every change; a
// consumer reads Workers and Policy afresh on each.
package registry
