package decide

import (
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrelay/kvrelay/dataplane/latency"
	"github.com/kvrelay/kvrelay/dataplane/oai"
	"github.com/kvrelay/kvrelay/dataplane/route"
)

// testConfig is the routing core's configuration under kvrelay proxy's defaults.
func testConfig() Config {
	return Config{
		BlockSize: 16, TokenCacheTokens: 8 << 20, RemoteTimeout: 8 * time.Second,
		IndexBlocks: 1 << 20, IndexTTL: 120 * time.Second,
		QueueSize: 1024, QueueTimeout: 60 * time.Second,
		Disagg: DisaggAuto, DisaggThreshold: 512, DisaggMaxQueue: 16384,
		EjectAfter: 3, EjectFor: 10 * time.Second,
	}
}

// testRouteConfig is kvrelay proxy's default routing configuration under policy ("": the
// default policy).
func testRouteConfig(policy string) route.Config {
	if policy == "" {
		policy = route.PolicyDefault
	}
	return route.Config{
		Explicit: true, Policy: policy,
		OverlapWeight: route.DefaultOverlapWeight, QueueWeight: route.DefaultQueueWeight, CacheThreshold: route.DefaultCacheThreshold,
		ComputeWeight: route.DefaultComputeWeight, BackgroundWeight: route.DefaultBackgroundWeight,
		BatchWeight: route.DefaultBatchWeight, WaitWeight: route.DefaultWaitWeight,
		TailWeight: route.DefaultTailWeight, BalanceWeight: route.DefaultBalanceWeight, SessionTTL: 30 * time.Minute,
	}
}

// testWorkers are n workers of gpt-oss-120b, w0 … w(n-1), on loopback ports from 20000.
func testWorkers(n int) []*route.Worker {
	ws := make([]*route.Worker, n)
	for i := range ws {
		host := "127.0.0.1:" + strconv.Itoa(20000+i)
		ws[i] = &route.Worker{ID: "w" + strconv.Itoa(i), URL: "http://" + host, Addr: host, Model: "gpt-oss-120b", BlockSize: 16,
			Engine: latency.Engine{MaxNumSeqs: 8}}
	}
	return ws
}

// newTestCore is a routing core over workers with cfg and route config rc, built as a static
// proxy builds its own.
func newTestCore(tb testing.TB, cfg Config, rc route.Config, workers []*route.Worker) *Core {
	tb.Helper()
	c := NewCore(cfg, prometheus.NewRegistry(), nil)
	pool := route.NewPool(workers)
	if err := c.Build(pool, c.Index(), rc, "local"); err != nil {
		tb.Fatal(err)
	}
	states := make([]*WorkerState, len(workers))
	for i, w := range workers {
		states[i] = c.NewWorkerState(w)
	}
	c.SetWorkers(states)
	return c
}

// decisionCore is a routing core over n workers under policy ("": the default).
func decisionCore(tb testing.TB, n int, policy ...string) *Core {
	p := ""
	if len(policy) > 0 {
		p = policy[0]
	}
	return newTestCore(tb, testConfig(), testRouteConfig(p), testWorkers(n))
}

// newChat is a chat completion's Request on c, as a carrier holds one.
func newChat(c *Core) *Request {
	r := &Request{}
	r.Init(c, new(route.Request), true)
	r.Start(oai.ChatCompletions, nanotime(), false)
	return r
}

// prepared is a chat completion of body (with session, "" for none) parsed and turned into
// routing input, as a carrier's request path does before it decides.
func prepared(tb testing.TB, c *Core, body []byte, session string) *Request {
	tb.Helper()
	r := newChat(c)
	r.SetHints([]byte(session), nil, nil, nil, nil)
	if err := r.Parse(body); err != nil {
		tb.Fatal(err)
	}
	if err := r.Prepare(); err != nil {
		tb.Fatal(err)
	}
	return r
}
