// Shared definitions of kvrelay's probes: watched endpoints and log2 histograms aggregated in
// kernel maps. User space (ebpf/probes/*.go) mirrors these layouts.
#ifndef KVRELAY_H
#define KVRELAY_H

#define AF_INET 2
#define AF_INET6 10
#define ETH_P_IP 0x0800
#define TASK_RUNNING 0

// HIST_SLOTS log2 buckets of nanoseconds: slot i counts values in [2^i, 2^(i+1)), slot 0
// also counts 0; the last slot counts everything above.
#define HIST_SLOTS 48

// An IPv4 endpoint: addr in network byte order, port in host byte order.
struct endpoint {
	__u32 addr;
	__u16 port;
	__u16 pad;
};

// Histogram kinds keyed by endpoint.
enum hist_kind {
	KIND_SRTT = 0,       // smoothed RTT samples (sock_ops RTT callback)
	KIND_CONNECT = 1,    // SYN_SENT -> ESTABLISHED
	KIND_FIRST_BYTE = 2, // last request byte sent -> first response byte received
};

struct hist_key {
	struct endpoint ep;
	__u32 kind;
};

struct hist {
	__u64 count;
	__u64 sum_ns;
	__u64 slots[HIST_SLOTS];
};

static __always_inline __u32 log2_u32(__u32 v)
{
	__u32 r, shift;

	r = (v > 0xFFFF) << 4; v >>= r;
	shift = (v > 0xFF) << 3; v >>= shift; r |= shift;
	shift = (v > 0xF) << 2; v >>= shift; r |= shift;
	shift = (v > 0x3) << 1; v >>= shift; r |= shift;
	r |= (v >> 1);
	return r;
}

static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 hi = v >> 32;
	if (hi)
		return log2_u32(hi) + 32;
	return log2_u32(v);
}

// MAX_SLOTS is how many endpoints a probe with slot-indexed histograms can tell apart: user
// space gives each watched endpoint a slot (an index into an array map), stable while it is
// watched and reused for another endpoint only when every slot has been taken.
#define MAX_SLOTS 1024

// A watched endpoint's slot and the generation it was given in. User space bumps a slot's
// generation (in the probe's gens array) whenever the slot stops meaning this endpoint, so a
// connection that remembers an older one is no longer timed.
struct slot {
	__u32 idx;
	__u32 gen;
};

// hist_observe adds one observation of ns nanoseconds to h, an element of an array map (no
// hashing, no creation: the lookup that found it is inlined by the verifier).
static __always_inline void hist_observe(struct hist *h, __u64 ns)
{
	__u32 slot = log2_u64(ns);
	if (slot >= HIST_SLOTS)
		slot = HIST_SLOTS - 1;
	__sync_fetch_and_add(&h->count, 1);
	__sync_fetch_and_add(&h->sum_ns, ns);
	__sync_fetch_and_add(&h->slots[slot], 1);
}

// hist_add adds one observation of ns nanoseconds to the histogram at key in map, creating
// it when missing.
static __always_inline void hist_add(void *map, const void *key, __u64 ns)
{
	struct hist *h = bpf_map_lookup_elem(map, key);
	if (!h) {
		struct hist zero = {};
		bpf_map_update_elem(map, key, &zero, BPF_NOEXIST);
		h = bpf_map_lookup_elem(map, key);
		if (!h)
			return;
	}
	hist_observe(h, ns);
}

#endif
