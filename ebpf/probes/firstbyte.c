//go:build ignore

// firstbyte: request-to-first-byte per upstream connection, seen from the proxy's side.
//
// cgroup_skb/egress stamps every packet carrying payload of an HTTP POST to a watched endpoint
// into the connection's socket-local storage (the last one wins: the request's last byte
// sent; GET and HEAD requests, such as metrics scrapes, are not timed);
// cgroup_skb/ingress takes the first packet carrying payload back from that endpoint on the
// same connection, records the gap and clears the stamp. A kernel-side TTFT that needs no
// cooperation from the proxy. IPv4 only.
//
// Cost: both programs run on every packet of every socket in the cgroup. A packet of a port
// not watched leaves after one inlined array lookup; a connection's stamp lives in its socket's
// local storage (BPF_MAP_TYPE_SK_STORAGE), created by its first request and written and
// cleared in place afterwards, together with its endpoint's slot, an index into array maps:
// a request costs two pointer walks from the socket, five inlined array lookups (the port
// check on either side, the slot's generation on either side, the histogram) and a few stores
// and atomic adds; no hashing, no map update or delete. The watched-endpoint check (a hash
// lookup) runs only on a connection's first request, and again if its slot has gone to
// another endpoint since.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "kvrelay.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// targets: watched endpoint -> its slot, written by user space.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SLOTS);
	__type(key, struct endpoint);
	__type(value, struct slot);
} targets SEC(".maps");

// gens: slot -> its current generation (0: never used); a stamp of another generation is not
// timed.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
} gens SEC(".maps");

// hists: slot -> first-byte histogram of the endpoint that holds the slot.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SLOTS);
	__type(key, __u32);
	__type(value, struct hist);
} hists SEC(".maps");

// stamp: socket-local storage of a connection to a watched endpoint: when its last request
// byte went out (0 once answered, or after a GET or HEAD) and the endpoint's slot.
struct stamp {
	__u64 ts;
	struct slot slot;
};

// sent: the stamps. Created by a connection's first request, it lives and goes with the
// socket; reaching it from a packet is a pointer walk from the socket (no key hashing).
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct stamp);
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
	__u32 daddr;
	__u16 dport;
	__u32 payload;
	__u32 off; // where the payload starts
};

// parse reads a TCP/IPv4 packet with payload, in place (skb->data is the IP header in
// cgroup_skb programs).
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
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
	__u32 hdrs = ihl + th->doff * 4;
	__u32 total = bpf_ntohs(iph->tot_len);
	if (total <= hdrs)
		return 0;
	p->daddr = iph->daddr;
	p->dport = bpf_ntohs(th->dest);
	p->payload = total - hdrs;
	p->off = hdrs;
	return 1;
}

// port_watched says whether port is one of the watched endpoints' (one inlined array lookup).
static __always_inline int port_watched(__u16 port)
{
	__u32 zero = 0;
	struct portset *ps = bpf_map_lookup_elem(&ports, &zero);
	return ps && ((ps->bits[(port >> 6) & 1023] >> (port & 63)) & 1);
}

// slot_current says whether a remembered slot still belongs to the endpoint it was given for:
// its generation is the slot's current one.
static __always_inline int slot_current(const struct slot *s)
{
	__u32 idx = s->idx;
	__u32 *gen = bpf_map_lookup_elem(&gens, &idx);
	return gen && *gen == s->gen;
}

// sent_at is when an outgoing TCP packet leaves: the departure time TCP gave it (its clock
// is bpf_ktime_get_ns's, read when the stack began transmitting), so egress reads no clock
// of its own; the clock only when the packet has none.
static __always_inline __u64 sent_at(struct __sk_buff *skb)
{
	__u64 t = skb->tstamp;
	return t ? t : bpf_ktime_get_ns();
}

static __always_inline struct bpf_sock *full_sk(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 0;
	return bpf_sk_fullsock(sk);
}

// Egress: a packet leaves at the port check (the socket's remote port, read through the
// context) unless its destination port is watched; then the socket's stamp is looked up, and
// created on a POST to a watched endpoint.
SEC("cgroup_skb/egress")
int kvrelay_fb_egress(struct __sk_buff *skb)
{
	if (!port_watched(bpf_ntohl(skb->remote_port)))
		return 1;
	struct bpf_sock *sk = full_sk(skb);
	if (!sk)
		return 1;
	struct stamp *st = bpf_sk_storage_get(&sent, sk, 0, 0);
	struct pkt p = {};
	if (!parse(skb, &p))
		return 1;
	// Only requests with a body (POST: inference) are timed. A payload starting with "GET "
	// or "HEAD" (a metrics scrape or health check of the same engine) clears the stamp; any
	// other payload moves the stamp of a request in flight (the rest of its body).
	char m[4] = {};
	if (p.payload >= 4 && bpf_skb_load_bytes(skb, p.off, m, 4) == 0) {
		if (m[0] == 'P' && m[1] == 'O' && m[2] == 'S' && m[3] == 'T') {
			if (!st || !slot_current(&st->slot)) {
				// First request of the connection, or its endpoint's slot went to another
				// endpoint since (and the endpoint may be watched again, in another slot).
				struct endpoint ep = { .addr = p.daddr, .port = p.dport };
				struct slot *s = bpf_map_lookup_elem(&targets, &ep);
				if (!s)
					return 1;
				struct slot at = *s;
				if (!st)
					st = bpf_sk_storage_get(&sent, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
				if (!st)
					return 1;
				st->slot = at;
			}
			st->ts = sent_at(skb);
			return 1;
		}
		if ((m[0] == 'G' && m[1] == 'E' && m[2] == 'T' && m[3] == ' ') ||
		    (m[0] == 'H' && m[1] == 'E' && m[2] == 'A' && m[3] == 'D')) {
			if (st)
				st->ts = 0;
			return 1;
		}
	}
	if (st && st->ts)
		st->ts = sent_at(skb);
	return 1;
}

// Ingress: a packet leaves at the port check unless its source port is watched, then unless
// its socket holds a stamp (created by egress, for watched endpoints only) of a request in
// flight; the payload check comes last, and the slot's generation before recording.
SEC("cgroup_skb/ingress")
int kvrelay_fb_ingress(struct __sk_buff *skb)
{
	if (!port_watched(bpf_ntohl(skb->remote_port)))
		return 1;
	struct bpf_sock *sk = full_sk(skb);
	if (!sk)
		return 1;
	struct stamp *st = bpf_sk_storage_get(&sent, sk, 0, 0);
	if (!st)
		return 1;
	__u64 then = st->ts;
	if (!then)
		return 1;
	struct pkt p = {};
	if (!parse(skb, &p)) // no payload: an ACK of the request, not its answer
		return 1;
	st->ts = 0;
	__u64 now = bpf_ktime_get_ns();
	// (A departure time TCP set ahead, when it paces, may still lie ahead of the answer.)
	__u64 delta = now > then ? now - then : 0;
	if (!slot_current(&st->slot))
		return 1;
	__u32 idx = st->slot.idx;
	struct hist *h = bpf_map_lookup_elem(&hists, &idx);
	if (h)
		hist_observe(h, delta);
	return 1;
}
