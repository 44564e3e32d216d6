// Package nixl will hold a NIXL-style KV block transfer library for disaggregated prefill
// and decode: agents, registered memory, descriptor lists, one-sided READ and WRITE transfers
// with notifications, and pluggable backends (TCP, shared memory).
package nixl
