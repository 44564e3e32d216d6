// Package sim is kvrelay's simulated engine: a stand-in for a vLLM server that needs no GPU.
// A Worker serves vLLM's OpenAI API over HTTP, keeps a paged KV cache with prefix caching,
// schedules with continuous batching and chunked prefill on a modelled step time, publishes
// vLLM's KV events over ZMQ and exports vLLM's Prometheus metrics.
//
// # Roles
//
// A worker in role both (the default) serves whole requests and ignores kv_transfer_params,
// as vLLM does without a KV connector. A worker in role prefill or decode holds a KV
// connector, the counterpart of vLLM's NixlConnector: a nixl agent (package nixl) named after
// the engine id, and a registered host-memory region with one slot per KV block. It speaks
// the NixlConnector protocol on either leg of a disaggregated request:
//
//   - prefill leg, kv_transfer_params {"do_remote_decode": true}: the prompt is prefilled
//     (with prefix caching), the request finishes at max_tokens (1), its prompt blocks'
//     slots are filled with content derived from the block hashes, and the response carries
//     {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids", ...,
//     "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size": 1}.
//     The blocks stay referenced until the decode worker's READ notification
//     ("<remote_request_id>:1") or Config.KVTransferTimeout frees them.
//   - decode leg, kv_transfer_params {"do_remote_prefill": true, ...}: blocks are allocated
//     for the prompt, the ones the local prefix cache lacks are READ from the prefill worker
//     into this worker's slots and checked, the READ notifies the prefill worker, and the
//     request waits at least the modelled transfer time (Config.ModelledTransfer) before its
//     last prompt token is recomputed and decoding starts. A pull that fails ends the request
//     with an OpenAI error: 503 when the prefill worker is gone or slow (retry elsewhere), 400
//     for an unresolvable remote_host, 500 for a checksum mismatch; the response of a decode
//     leg carries kv_transfer_params: null.
//
// # KV blocks
//
// One block manager owns the engine's KV blocks, as vLLM's KVCacheManager does: the GPU pool
// (package internal/blockpool), the host and disk tiers below it, and the staging slots
// through which a peer reads blocks of those tiers. The scheduler and the KV connector ask it
// for blocks, give them back through it, and never touch the pool or a block table.
//
// See README.md for the flags, the slot layout and the metrics.
package sim
