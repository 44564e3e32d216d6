// Package planner sizes the prefill and decode pools (or the aggregated pool) of a kvrelay
// fleet to meet TTFT and ITL targets with the fewest replicas, in the manner of NVIDIA
// Dynamo's SLA planner.
//
// Its pieces, each usable alone:
//
//   - Profile: a worker's measured performance (TTFT and prefill throughput against input
//     length and concurrency; ITL and decode throughput against concurrency and context),
//     a JSON file written by `kvrelay profile` (Measure) and interpolated between points.
//   - Predictor: forecasts of the request rate and the input and output lengths — Constant,
//     HoltWinters (additive seasonal) and Kalman (local linear trend) — and Evaluate, which
//     scores one on held-back history.
//   - Planner: every Config.Interval, throughput mode turns the forecast (or the rate just
//     observed, when larger) into replicas per pool (ceil(tokens/s ÷ per-replica throughput
//     at the target × (1+Headroom))), corrected by observed against profiled latency;
//     every Config.LoadInterval, load mode grows a pool that cannot serve the window's
//     arrivals straight to what they need, adds a replica when every worker of a pool
//     misses its target and removes one when all are well below it, never under the
//     throughput floor. Demand counts arrivals (finished requests plus the growth of those
//     in flight), not only completions. Constraints: per-pool minimum and maximum, a total
//     GPU budget, and for scale-downs a cool-down, hysteresis and a stabilisation window
//     (the largest size wanted within it). Every decision is kept with its inputs and
//     reason (Decisions, Handler: GET /v1/planner/decisions) and counted in metrics named
//     kvrelay_planner_*. README.md has the whole story.
//   - Actuator: what changes the fleet. KubeActuator scales Deployments through their scale
//     subresource (draining the pods that go first); LocalActuator starts and stops
//     `kvrelay sim` processes and registers them with the control plane's registry;
//     Registered only reads the registry. With Config.DryRun the planner only decides.
//
// Lifecycle: New builds a Planner without side effects; Run owns its only goroutine and
// returns when its context ends. Observers and actuators are called from that goroutine only.
package planner
