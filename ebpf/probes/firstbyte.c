//go:build ignore

// firstbyte: request-to-first-byte per upstream connection, seen from the proxy's side.
//
// cgroup_skb/egress stamps every packet carrying payload of an HTTP POST to a watched endpoint
// into a map keyed by the connection's 4-tuple (the last one wins: the request's last byte
// sent; GET and HEAD requests, such as metrics scrapes, are not timed);
// cgroup_skb/ingress takes the first packet carrying payload back from that endpoint on the
// same connection, records the gap and clears the stamp. A kernel-side TTFT that needs no
// cooperation from the proxy. IPv4 only.
//
// Cost: both programs run on every packet of every socket in the cgroup. A packet of a port
// not watched leaves after one inlined array lookup; a connection's stamp is created once
// (the map update of an LRU hash allocates) and afterwards written and cleared in place
// through the pointer a lookup returns, so a request costs lookups and stores, no map update
// or delete; the watched-endpoint check runs only on a request's first packet.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kvrelay.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// flow: a connection from the client's side, local = the proxy, remote = the engine.
struct flow {
	__u32 laddr;
	__u32 raddr;
	__u16 lport;
	__u16 rport;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct endpoint);
	__type(value, __u8);
} targets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct hist_key);
	__type(value, struct hist);
} hists SEC(".maps");

// sent: connection -> when its last request byte went out; 0 once answered (or after a GET or
// HEAD). Entries stay for the connection's life and leave by LRU eviction.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct flow);
	__type(value, __u64);
} sent SEC(".maps");

// ports: the watched endpoints' ports as a bitmap, so that a packet of any other connection
// leaves after one inlined array lookup (both programs run on every packet of the cgroup).
struct portset {
	__u64 bits[1024];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct portset);
} ports SEC(".maps");

struct pkt {
	__u32 saddr, daddr;
	__u16 sport, dport;
	__u32 payload;
	__u32 off; // where the payload starts
};

// parse reads a TCP/IPv4 packet with payload whose remote port (the destination on egress,
// the source on ingress) is watched; it reads the headers in place (skb->data is the IP
// header in cgroup_skb programs).
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p, int egress)
{
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return 0;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *iph = data;
	if ((void *)(iph + 1) > end)
		return 0;
	if (iph->protocol != IPPROTO_TCP)
		return 0;
	__u32 ihl = iph->ihl * 4;
	if (ihl < sizeof(*iph))
		return 0;
	struct tcphdr *th = data + ihl;
	if ((void *)(th + 1) > end)
		return 0;
	__u16 port = bpf_ntohs(egress ? th->dest : th->source);
	__u32 zero = 0;
	struct portset *ps = bpf_map_lookup_elem(&ports, &zero);
	if (!ps || !((ps->bits[(port >> 6) & 1023] >> (port & 63)) & 1))
		return 0;
	__u32 hdrs = ihl + th->doff * 4;
	__u32 total = bpf_ntohs(iph->tot_len);
	if (total <= hdrs)
		return 0;
	p->saddr = iph->saddr;
	p->daddr = iph->daddr;
	p->sport = bpf_ntohs(th->source);
	p->dport = bpf_ntohs(th->dest);
	p->payload = total - hdrs;
	p->off = hdrs;
	return 1;
}

SEC("cgroup_skb/egress")
int kvrelay_fb_egress(struct __sk_buff *skb)
{
	struct pkt p = {};
	if (!parse(skb, &p, 1))
		return 1;
	struct flow f = { .laddr = p.saddr, .raddr = p.daddr, .lport = p.sport, .rport = p.dport };
	__u64 *ts = bpf_map_lookup_elem(&sent, &f);
	// Only requests with a body (POST: inference) are timed. A payload starting with "GET "
	// or "HEAD" (a metrics scrape or health check of the same engine) clears the stamp; any
	// other payload moves the stamp of a request in flight (the rest of its body).
	char m[4] = {};
	if (p.payload >= 4 && bpf_skb_load_bytes(skb, p.off, m, 4) == 0) {
		if (m[0] == 'P' && m[1] == 'O' && m[2] == 'S' && m[3] == 'T') {
			__u64 now = bpf_ktime_get_ns();
			if (ts) {
				*ts = now;
				return 1;
			}
			struct endpoint ep = { .addr = p.daddr, .port = p.dport };
			if (bpf_map_lookup_elem(&targets, &ep))
				bpf_map_update_elem(&sent, &f, &now, BPF_ANY);
			return 1;
		}
		if ((m[0] == 'G' && m[1] == 'E' && m[2] == 'T' && m[3] == ' ') ||
		    (m[0] == 'H' && m[1] == 'E' && m[2] == 'A' && m[3] == 'D')) {
			if (ts)
				*ts = 0;
			return 1;
		}
	}
	if (ts && *ts)
		*ts = bpf_ktime_get_ns();
	return 1;
}

// The stamp exists only for connections to watched endpoints (egress checked), so ingress
// needs no check of its own.
SEC("cgroup_skb/ingress")
int kvrelay_fb_ingress(struct __sk_buff *skb)
{
	struct pkt p = {};
	if (!parse(skb, &p, 0))
		return 1;
	struct flow f = { .laddr = p.daddr, .raddr = p.saddr, .lport = p.dport, .rport = p.sport };
	__u64 *ts = bpf_map_lookup_elem(&sent, &f);
	if (!ts)
		return 1;
	__u64 then = *ts;
	if (!then)
		return 1;
	*ts = 0;
	__u64 delta = bpf_ktime_get_ns() - then;
	struct hist_key k = { .ep = { .addr = p.saddr, .port = p.sport }, .kind = KIND_FIRST_BYTE };
	hist_add(&hists, &k, delta);
	return 1;
}
