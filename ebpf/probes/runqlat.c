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

// watched_tgids: the processes to watch, one per slot (0: a free slot); a process keeps its
// slot while it is watched, and the slot indexes its histogram. An array compared inline
// rather than a map lookup: sched_switch runs on every context switch of the machine, and
// most of them are of other processes, which leave after nslots compares (user space keeps
// nslots at the highest slot in use plus one: one under kvrelay up).
#define MAX_PIDS 16
volatile __u32 watched_tgids[MAX_PIDS];
volatile __u32 nslots;

// since: when user space last attached the programs (bpf_ktime_get_ns's clock); a stamp older
// than that was left by a thread while they were detached, and is not a wait.
volatile __u64 since;

// slot_of returns the slot of a watched process plus one, 0 for any other.
static __always_inline __u32 slot_of(__u32 tgid)
{
	if (!tgid)
		return 0;
#pragma unroll
	for (int i = 0; i < MAX_PIDS; i++) {
		if (i >= nslots)
			return 0;
		if (watched_tgids[i] == tgid)
			return i + 1;
	}
	return 0;
}

// queued: task-local storage of a thread of a watched process: when it became runnable; 0
// while it runs. Created at the thread's first wakeup, written and cleared in place
// afterwards, freed with the thread; reaching it is a pointer walk from the task (no key
// hashing, no map update or delete per context switch).
struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} queued SEC(".maps");

// hists: slot -> run-queue latency histogram of the process in that slot (user space zeroes
// it before giving the slot to another process).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_PIDS);
	__type(key, __u32);
	__type(value, struct hist);
} hists SEC(".maps");

// The task pointers of tp_btf programs are BTF pointers: fields are read directly (CO-RE
// relocated through vmlinux.h's preserve_access_index), without probe-read helper calls.
// Every program compares the task's tgid with the watched ones first and leaves at once for
// the other processes' threads (most of the machine's context switches).
static __always_inline void enqueue(struct task_struct *p)
{
	if (!slot_of(p->tgid))
		return;
	__u64 *ts = bpf_task_storage_get(&queued, p, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (ts)
		*ts = bpf_ktime_get_ns();
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
	// A thread preempted while runnable waits again from now on.
	if (prev->__state == TASK_RUNNING)
		enqueue(prev);

	__u32 slot = slot_of(next->tgid);
	if (!slot)
		return 0;
	__u64 *ts = bpf_task_storage_get(&queued, next, 0, 0);
	if (!ts)
		return 0;
	__u64 then = *ts;
	if (!then)
		return 0;
	*ts = 0;
	if (then < since)
		return 0;
	slot--;
	struct hist *h = bpf_map_lookup_elem(&hists, &slot);
	if (h)
		hist_observe(h, bpf_ktime_get_ns() - then);
	return 0;
}
