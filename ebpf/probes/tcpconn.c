//go:build ignore

// tcpconn: RTT and lifecycle of connections to watched engine endpoints.
//
// sock_ops (attached to a cgroup v2): on an active connection to a watched endpoint it turns
// on the RTT and retransmit callbacks, then records the smoothed RTT (one callback in eight,
// at random) and counts retransmits. tp_btf/inet_sock_set_state: connect latency (SYN_SENT -> ESTABLISHED) and
// aborts (ESTABLISHED, CLOSE_WAIT or SYN_SENT straight to CLOSE: a reset sent or received).
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "kvrelay.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct conn_counters {
	__u64 retransmits;
	__u64 resets;
	__u64 connects;
};

// targets: the engine endpoints to watch, written by user space.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct endpoint);
	__type(value, __u8);
} targets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct hist_key);
	__type(value, struct hist);
} hists SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct endpoint);
	__type(value, struct conn_counters);
} counters SEC(".maps");

// connecting: socket -> time its SYN went out.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u64);
} connecting SEC(".maps");

static __always_inline struct conn_counters *counters_of(const struct endpoint *ep)
{
	struct conn_counters *c = bpf_map_lookup_elem(&counters, ep);
	if (c)
		return c;
	struct conn_counters zero = {};
	bpf_map_update_elem(&counters, ep, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&counters, ep);
}

// RTT_SAMPLE_MASK: one RTT callback in RTT_SAMPLE_MASK+1 is recorded (the kernel calls the
// program on every ACK that yields an RTT sample; srtt is already smoothed, so a random eighth
// keeps its distribution at an eighth of the cost).
#define RTT_SAMPLE_MASK 7

SEC("sockops")
int kvrelay_sockops(struct bpf_sock_ops *skops)
{
	if (skops->op == BPF_SOCK_OPS_RTT_CB && (bpf_get_prandom_u32() & RTT_SAMPLE_MASK))
		return 1;
	if (skops->family != AF_INET)
		return 1;
	struct endpoint ep = {
		.addr = skops->remote_ip4,
		.port = bpf_ntohl(skops->remote_port),
	};
	if (!bpf_map_lookup_elem(&targets, &ep))
		return 1;

	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags |
			BPF_SOCK_OPS_RTT_CB_FLAG | BPF_SOCK_OPS_RETRANS_CB_FLAG);
		break;
	case BPF_SOCK_OPS_RTT_CB: {
		struct hist_key k = { .ep = ep, .kind = KIND_SRTT };
		hist_add(&hists, &k, (__u64)(skops->srtt_us >> 3) * 1000);
		break;
	}
	case BPF_SOCK_OPS_RETRANS_CB: {
		struct conn_counters *c = counters_of(&ep);
		if (c)
			__sync_fetch_and_add(&c->retransmits, 1);
		break;
	}
	}
	return 1;
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(kvrelay_set_state, const struct sock *sk, const int oldstate, const int newstate)
{
	if (sk->__sk_common.skc_family != AF_INET)
		return 0;
	struct endpoint ep = {
		.addr = sk->__sk_common.skc_daddr,
		.port = bpf_ntohs(sk->__sk_common.skc_dport),
	};
	if (!bpf_map_lookup_elem(&targets, &ep))
		return 0;
	__u64 key = (__u64)sk;

	if (newstate == TCP_SYN_SENT) {
		__u64 now = bpf_ktime_get_ns();
		bpf_map_update_elem(&connecting, &key, &now, BPF_ANY);
		return 0;
	}
	if (oldstate == TCP_SYN_SENT) {
		__u64 *ts = bpf_map_lookup_elem(&connecting, &key);
		if (ts && newstate == TCP_ESTABLISHED) {
			struct hist_key k = { .ep = ep, .kind = KIND_CONNECT };
			hist_add(&hists, &k, bpf_ktime_get_ns() - *ts);
			struct conn_counters *c = counters_of(&ep);
			if (c)
				__sync_fetch_and_add(&c->connects, 1);
		}
		bpf_map_delete_elem(&connecting, &key);
	}
	if (newstate == TCP_CLOSE &&
	    (oldstate == TCP_ESTABLISHED || oldstate == TCP_CLOSE_WAIT || oldstate == TCP_SYN_SENT)) {
		struct conn_counters *c = counters_of(&ep);
		if (c)
			__sync_fetch_and_add(&c->resets, 1);
	}
	return 0;
}
