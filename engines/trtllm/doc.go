// Package trtllm is the control plane's adapter (engines.Engine) for NVIDIA TensorRT-LLM,
// served by trtllm-serve or by Triton's TensorRT-LLM backend. ParseLoad reads whichever of
// the two expositions it is given.
//
// trtllm-serve, at /prometheus/metrics (MetricsPath; its /metrics is JSON iteration stats):
//
//	trtllm_num_requests_running       gauge → Load.Running
//	trtllm_num_requests_waiting       gauge → Load.Waiting
//	trtllm_kv_cache_utilization       gauge → Load.KVUsage (fallback: used_blocks / max_blocks)
//	trtllm_kv_cache_tokens_per_block  gauge → Load.BlockSize
//	trtllm_kv_cache_max_blocks        gauge → Load.CapacityBlocks
//
// Triton's TensorRT-LLM backend, on Triton's metrics port (8002 by default: set the worker's
// metrics URL), as labelled gauges:
//
//	nv_trt_llm_request_metrics{request_type="scheduled"}             → Load.Running
//	nv_trt_llm_request_metrics{request_type="waiting"}               → Load.Waiting (fallback: active − scheduled)
//	nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"} → Load.KVUsage (fallback: used / max)
//	nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"} → Load.BlockSize
//	nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"}     → Load.CapacityBlocks
//
// The same mapping is what the Gateway API inference extension and llm-d use for these
// servers. TensorRT-LLM does not publish KV events in vLLM's ZMQ format, so KVEvents reports
// them unsupported.
package trtllm
