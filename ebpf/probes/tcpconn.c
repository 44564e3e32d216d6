//go:build ignore

// tcpconn: RTT and lifecycle of connections to watched engine endpoints.
//
// sock_ops (attached to a cgroup v2): on an active connection to a watched endpoint it turns
// on the RTT and retransmit callbacks, then records the smoothed RTT (one sample per
// connection per second: iter/tcp re-arms the RTT callback, which disarms itself) and
// counts retransmits. tp_btf/inet_sock_set_state: connect latency (SYN_SENT -> ESTABLISHED) and
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

// SOL_TCP for bpf_setsockopt.
#define SOL_TCP 6

// rearm: set by user space once the iterator that re-arms the RTT callback runs; until then
// (a kernel where it cannot) the callback stays on and one sample in eight is recorded.
volatile __u32 rearm;
#define RTT_SAMPLE_MASK 7

// The RTT callback is armed for one sample at a time: the kernel would call the program on
// every ACK that yields an RTT sample (one per request and answer on a keep-alive connection
// to an engine), and srtt is already smoothed, so the program disarms it after recording one
// and the iterator below, run once a second, arms it again (one srtt sample per connection
// per second, whatever the request rate).
SEC("sockops")
int kvrelay_sockops(struct bpf_sock_ops *skops)
{
	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
	case BPF_SOCK_OPS_RETRANS_CB:
		break;
	case BPF_SOCK_OPS_RTT_CB:
		if (!rearm && (bpf_get_prandom_u32() & RTT_SAMPLE_MASK))
			return 1;
		break;
	default:
		// Callbacks another program of the cgroup turned on leave before the target lookup.
		return 1;
	}
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
		if (rearm)
			bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_RTT_CB_FLAG);
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

// iter/tcp, run by user space once a second (TCPConn.Arm): arms the RTT callback again on each
// established connection that the sock_ops program followed (its retransmit callback is on:
// connections to watched endpoints opened in the cgroup since it attached) and that has
// recorded its last sample. Other sockets' callbacks are left alone.
SEC("iter/tcp")
int kvrelay_rtt_arm(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc || skc->skc_family != AF_INET || skc->skc_state != TCP_ESTABLISHED)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0;
	int flags = tp->bpf_sock_ops_cb_flags;
	if (!(flags & BPF_SOCK_OPS_RETRANS_CB_FLAG) || (flags & BPF_SOCK_OPS_RTT_CB_FLAG))
		return 0;
	struct endpoint ep = {
		.addr = skc->skc_daddr,
		.port = bpf_ntohs(skc->skc_dport),
	};
	if (!bpf_map_lookup_elem(&targets, &ep))
		return 0;
	flags |= BPF_SOCK_OPS_RTT_CB_FLAG;
	bpf_setsockopt(tp, SOL_TCP, TCP_BPF_SOCK_OPS_CB_FLAGS, &flags, sizeof(flags));
	return 0;
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
