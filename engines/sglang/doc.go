// Package sglang is the control plane's adapter (engines.Engine) for SGLang.
//
// Load comes from SGLang's Prometheus metrics at /metrics (the server needs --enable-metrics):
//
//	sglang:num_running_reqs      gauge  running requests                    → Load.Running
//	sglang:num_queue_reqs        gauge  queued requests                     → Load.Waiting
//	sglang:token_usage           gauge  fraction of KV pool tokens in use   → Load.KVUsage
//	sglang:page_size             gauge  KV page size in tokens (0.5.11+)    → Load.BlockSize
//	sglang:num_pages             gauge  KV pool size in pages (0.5.11+)     → Load.CapacityBlocks
//	sglang:cache_config_info     info   labels page_size, num_pages (before 0.5.11)
//	sglang:max_total_num_tokens  gauge  KV pool size in tokens              → Load.CapacityTokens
//
// Names are those of python/sglang/srt/metrics/collector.py. Samples carry model_name,
// engine_type, tp_rank, pp_rank (and dp_rank with data parallelism): only tensor- and
// pipeline-parallel rank 0 is read, counts add up over data-parallel ranks and usage is their
// mean. SGLang's page size is 1 unless --page-size says otherwise; when the exposition does
// not carry it, the block size stays unknown (set block-size on the worker).
//
// KV events: SGLang publishes vLLM's wire format (--kv-events-config, endpoint tcp://*:5557
// by default), with events as tagged arrays.
package sglang
