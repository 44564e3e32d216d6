// Package controlplane is kvrelay's control plane: a Server that runs the worker registry
// and policy store (registry), one KV event subscriber per worker feeding the global prefix
// index and its journal (ingest, kvindex), the fleet's load view (loadview), the rollout
// controller that steps a candidate routing policy through package rollout, the operator
// API (api) with its console (ui) and the planner's routes (planner runs beside it, attached
// with SetPlanner), and the xDS server that pushes workers, the policy and the index to
// proxies (package xds). Several replicas may run: every one ingests every engine's events
// and serves proxies, and the one that package leader elects makes the changes.
//
// It never imports the data plane: what both planes share sits below them in package xds.
package controlplane
