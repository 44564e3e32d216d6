// Package vllm is the control plane's adapter (engines.Engine) for vLLM and for kvrelay's
// simulated engine (engines/sim), which serves vLLM's API and metric names.
//
// Load comes from vLLM's Prometheus metrics at /metrics:
//
//	vllm:num_requests_running   gauge  requests in the running batch    → Load.Running
//	vllm:num_requests_waiting   gauge  requests queued                  → Load.Waiting
//	vllm:kv_cache_usage_perc    gauge  fraction of KV blocks in use     → Load.KVUsage
//	vllm:gpu_cache_usage_perc   gauge  the same before vLLM V1 (fallback)
//	vllm:cache_config_info      info   labels block_size, num_gpu_blocks → BlockSize, CapacityBlocks
//
// With data parallelism one API server exposes a sample per engine (label engine="0", "1",
// ...): counts and capacities are summed, usage is averaged. The model comes from
// /v1/models. KV events: vLLM binds its ZMQ PUB socket on tcp://*:5557 by default, so the
// control plane dials it.
//
// testdata/ holds real expositions (see testdata/README.md); `go test -update` rewrites the
// expected loads next to them.
package vllm
