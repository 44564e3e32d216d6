// Package kvevents speaks vLLM's KV cache event protocol (docs/kv-events.md): the
// msgpack encoding of event batches, a ZMQ publisher like vLLM's ZmqEventPublisher (used by
// the simulated engine, engines/sim), and a ZMQ subscriber with a replay client (used by the
// control plane to follow vLLM, SGLang and simulated engines).
//
// # Wire format
//
// Every message has three ZMQ frames:
//
//	topic | seq (uint64, 8 bytes big-endian, from 0, no gaps) | msgpack(batch)
//
// A batch is the array [ts, [event, ...], data_parallel_rank]; trailing fields may be absent
// (so [ts, events] is valid) and extra trailing elements are ignored. A batch encoded as a map
// {"ts", "events", "data_parallel_rank"} is accepted too. An event is either a map with its
// tag under "type" (current vLLM):
//
//	{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h|nil,
//	 "token_ids": [...], "block_size": n, "lora_id": n|nil, "medium": "GPU"|nil,
//	 "lora_name": s|nil, "extra_keys": [entry|nil, ...], "group_idx": n,
//	 "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": n}
//	{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": n}
//	{"type": "AllBlocksCleared"}
//
// or a tagged positional array with the same fields in that order (older vLLM, SGLang,
// simulators): ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
// lora_id, medium, ...], ["BlockRemoved", block_hashes, medium, group_idx],
// ["AllBlocksCleared"]. Block hashes are msgpack integers (unsigned, often above 2^63, or
// signed: both map to the same uint64 bit pattern) or bytes (bin or str); see Hash.
// SGLang with EAGLE speculative decoding sends token_ids as bigram pairs, which DecodeBatch
// unrolls (Event.BigramTokens).
//
// The replay socket is a ROUTER. A request is [identity, "", start seq] (a REQ, or a DEALER
// sending an empty delimiter first); the answer is one message [identity, "", seq, payload]
// per buffered batch with seq >= start, then [identity, "", -1, ""].
//
// # Concurrency
//
// AppendBatch and DecodeBatch are pure functions, safe for concurrent use. A Publisher is
// safe for concurrent use and owns its goroutines (see Publisher). A Subscriber runs on the
// goroutine that calls Run and emits batches there.
//
// # go-zeromq
//
// The sockets come from github.com/go-zeromq/zmq4, a pure-Go ZMTP 3.0 implementation that
// interoperates with libzmq (tested against libzmq 4.3 through python3-zmq). Its behaviour
// differs from libzmq in ways this package works around; README.md lists them.
package kvevents
