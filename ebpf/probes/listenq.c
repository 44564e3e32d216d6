//go:build ignore

// listenq: accept-queue depth of TCP listeners, through a bpf_iter/tcp program that user space
// runs on every sample: one record per listening socket (IPv4 or IPv6) with its local port,
// its accept queue length and the queue's limit.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kvrelay.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct kvrelay_listener {
	__u32 addr; // IPv4 address in network byte order; 0 for IPv6 listeners
	__u16 port; // host byte order
	__u16 family;
	__u32 backlog;
	__u32 max_backlog;
};

SEC("iter/tcp")
int kvrelay_listenq(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	if (!skc)
		return 0;
	if (skc->skc_state != TCP_LISTEN)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(skc);
	if (!tp)
		return 0;
	struct kvrelay_listener l = {
		.port = skc->skc_num,
		.family = skc->skc_family,
		.backlog = tp->inet_conn.icsk_inet.sk.sk_ack_backlog,
		.max_backlog = tp->inet_conn.icsk_inet.sk.sk_max_ack_backlog,
	};
	if (l.family == AF_INET)
		l.addr = skc->skc_rcv_saddr;
	bpf_seq_write(ctx->meta->seq, &l, sizeof(l));
	return 0;
}
