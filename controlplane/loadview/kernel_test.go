package loadview

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrelay/kvrelay/engines"
)

// TestKernelWaiting: requests the kernel sees waiting (the eBPF accept-queue signal) add to
// the engine's own waiting count.
func TestKernelWaiting(t *testing.T) {
	const sglangBody = `sglang:num_running_reqs{model_name="m",tp_rank="0"} 7
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2
`
	sg := newFakeEngine(t, body(sglangBody))
	var backlog atomic.Int64
	opts := testOptions()
	opts.KernelWaiting = func(id string) (int, bool) {
		if id != "sg" {
			return 0, false
		}
		return int(backlog.Load()), true
	}
	v := newView(t, opts)
	v.Sync([]Target{{ID: "sg", URL: sg.URL, Engine: engines.KindSGLang}})
	eventually(t, 5*time.Second, "engine's own count", func() bool {
		s, _ := v.Get("sg")
		return s.Healthy && s.Load.Waiting == 2
	})
	backlog.Store(5)
	eventually(t, 5*time.Second, "kernel backlog added", func() bool {
		s, _ := v.Get("sg")
		return s.Load.Waiting == 7 && s.Load.Running == 7
	})
}

// TestKernelLatencyWaiting: the waiting that a worker's kernel-side first-byte latency implies
// raises the engine's own count (it does not add to it: an engine's reported queue is what
// makes its first byte late); the accept-queue backlog adds on top.
func TestKernelLatencyWaiting(t *testing.T) {
	const sglangBody = `sglang:num_running_reqs{model_name="m",tp_rank="0"} 7
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2
`
	sg := newFakeEngine(t, body(sglangBody))
	var implied, backlog atomic.Int64
	opts := testOptions()
	opts.KernelLatencyWaiting = func(id string) (int, bool) { return int(implied.Load()), id == "sg" }
	opts.KernelWaiting = func(id string) (int, bool) { return int(backlog.Load()), id == "sg" }
	v := newView(t, opts)
	v.Sync([]Target{{ID: "sg", URL: sg.URL, Engine: engines.KindSGLang}})
	for _, tc := range []struct {
		name             string
		implied, backlog int64
		want             int
	}{
		{"no signal", 0, 0, 2},
		{"implied under the engine's own", 1, 0, 2},
		{"implied over it", 6, 0, 6},
		{"and a backlog", 6, 3, 9},
	} {
		implied.Store(tc.implied)
		backlog.Store(tc.backlog)
		eventually(t, 5*time.Second, tc.name, func() bool {
			s, _ := v.Get("sg")
			return s.Healthy && s.Load.Waiting == tc.want && s.Load.Running == 7
		})
	}
}
