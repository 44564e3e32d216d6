// Package controlplane will hold kvrelay's control plane: the worker registry and discovery,
// KV event ingestion into the global prefix index, the fleet's load view, the policy store,
// the planner, canary rollout, the operator API and persistence. It pushes routing state to
// proxies through package xds and never imports the data plane.
package controlplane
