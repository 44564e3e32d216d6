//go:build ignore

// runqlat: run-queue latency (wakeup -> on CPU) of the threads of watched processes.
//
// tp_btf/sched_wakeup and sched_wakeup_new stamp a thread of a watched process (by tgid) when
// it becomes runnable; tp_btf/sched_switch stamps one preempted while still runnable and,
// when a stamped thread gets the CPU, records the wait in the histogram of its process.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "kvrelay.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// pids: the processes (tgids) to watch, written by user space.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} pids SEC(".maps");

// queued: thread id -> when it became runnable.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u64);
} queued SEC(".maps");

// hists: tgid -> run-queue latency histogram.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct hist);
} hists SEC(".maps");

static __always_inline void enqueue(struct task_struct *p)
{
	__u32 tgid = BPF_CORE_READ(p, tgid);
	if (!bpf_map_lookup_elem(&pids, &tgid))
		return;
	__u32 pid = BPF_CORE_READ(p, pid);
	__u64 now = bpf_ktime_get_ns();
	bpf_map_update_elem(&queued, &pid, &now, BPF_ANY);
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(kvrelay_wakeup, struct task_struct *p)
{
	enqueue(p);
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(kvrelay_wakeup_new, struct task_struct *p)
{
	enqueue(p);
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(kvrelay_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	if (BPF_CORE_READ(prev, __state) == TASK_RUNNING)
		enqueue(prev);

	__u32 pid = BPF_CORE_READ(next, pid);
	__u64 *ts = bpf_map_lookup_elem(&queued, &pid);
	if (!ts)
		return 0;
	__u64 delta = bpf_ktime_get_ns() - *ts;
	bpf_map_delete_elem(&queued, &pid);
	__u32 tgid = BPF_CORE_READ(next, tgid);
	hist_add(&hists, &tgid, delta);
	return 0;
}
