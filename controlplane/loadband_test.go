package controlplane

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// TestLoadBand: a worker's load that moves by less than its band is held as last published
// until the refresh passes; a move past the band, a queue forming (waiting 0 → 1) or the
// refresh passing publishes the current load, timed by the engine's first reading of it.
func TestLoadBand(t *testing.T) {
	const refresh = int64(time.Second)
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) int64 { return t0.Add(d).UnixNano() }
	prev := observedLoad{running: 40, waiting: 0, kv: 0.50, inflight: 30, prefill: 9000, decode: 1200, epoch: 7, at: at(0), sent: at(0)}
	cases := []struct {
		name string
		cur  observedLoad
		held bool
	}{
		{"running 40→42, kv +0.01, sums a little", observedLoad{running: 42, kv: 0.51, inflight: 31, prefill: 9400, decode: 1250, epoch: 9, sent: at(500 * time.Millisecond)}, true},
		{"the same, past the refresh", observedLoad{running: 42, kv: 0.51, inflight: 31, prefill: 9400, decode: 1250, epoch: 9, sent: at(time.Second)}, false},
		{"running 40→46", observedLoad{running: 46, kv: 0.50, inflight: 30, prefill: 9000, decode: 1200, epoch: 7, sent: at(100 * time.Millisecond)}, false},
		{"a queue forms", observedLoad{running: 40, waiting: 1, kv: 0.50, inflight: 30, prefill: 9000, decode: 1200, epoch: 7, sent: at(100 * time.Millisecond)}, false},
		{"kv +1/64", observedLoad{running: 40, kv: 0.50 + 1.0/64, inflight: 30, prefill: 9000, decode: 1200, epoch: 7, sent: at(100 * time.Millisecond)}, false},
	}
	for _, c := range cases {
		got := banded(prev, true, c.cur, t0.Add(50*time.Millisecond), refresh)
		if held := got == prev; held != c.held {
			t.Errorf("%s: held %v, want %v (got %+v)", c.name, held, c.held, got)
		}
		if !c.held && (got.running != c.cur.running || got.epoch != c.cur.epoch || got.at != at(50*time.Millisecond)) {
			t.Errorf("%s: published %+v, want the current load read at +50ms", c.name, got)
		}
	}
	// The engine's reading unchanged, the sums moved past the band: the reading keeps its
	// first time.
	cur := observedLoad{running: 40, kv: 0.50, inflight: 60, prefill: 9000, decode: 1200, epoch: 8, sent: at(100 * time.Millisecond)}
	if got := banded(prev, true, cur, t0.Add(90*time.Millisecond), refresh); got.at != prev.at || got.inflight != 60 {
		t.Errorf("sums moved, reading unchanged: %+v, want in-flight 60 at the reading's first time", got)
	}
	if got := banded(observedLoad{}, false, cur, time.Time{}, refresh); got != cur {
		t.Errorf("first publication: %+v, want %+v", got, cur)
	}
}

// BenchmarkLoadBand measures what the workers' load costs a proxy each second on a busy
// fleet: 1,000 workers whose engines' readings move on every scrape (10 a second: running
// 38–42, KV usage drifting by up to ±0.005, the proxies' in-flight sums ±5 % under a new
// merge each time; no queue, or a standing queue of 1–4). band=off sends every change;
// band=on holds a load within its band for up to a second. push=workers sends each worker
// whose published load changed whole, its load in its Worker resource; push=loads sends,
// as the control plane does, each shard of xds.LoadsShard loads of which any changed as one
// Loads resource, and no Worker. Each resource is counted with its delta ADS framing (name,
// the SHA-256 version, the type URL). The metrics are bytes, workers whose load changed,
// and resources a second, per proxy.
func BenchmarkLoadBand(b *testing.B) {
	const workers, scrapes, seconds = 1000, 10, 10
	for _, queue := range []int{0, 4} {
		for _, band := range []bool{false, true} {
			for _, push := range []string{"workers", "loads"} {
				b.Run(fmt.Sprintf("queue=%d/band=%s/push=%s", queue, map[bool]string{false: "off", true: "on"}[band], push), func(b *testing.B) {
					var bytes, sent, resources int
					for range b.N {
						bytes, sent, resources = 0, 0, 0
						rng := rand.New(rand.NewPCG(1, 2))
						cur := make([]observedLoad, workers)
						for i := range cur {
							cur[i] = observedLoad{running: 40, kv: 0.5, inflight: 30, prefill: 9000, decode: 1200}
						}
						last := make([]observedLoad, workers)
						has := make([]bool, workers)
						t0 := time.Unix(1000, 0)
						for step := range scrapes * seconds {
							now := t0.Add(time.Duration(step) * time.Second / scrapes)
							dirty := map[uint32]bool{}
							for i := range cur {
								c := &cur[i]
								c.running = uint32(38 + rng.IntN(5))
								if queue > 0 {
									c.waiting = uint32(1 + rng.IntN(queue))
								}
								c.kv = min(max(c.kv+(rng.Float64()-0.5)/100, 0), 1)
								wobble := func(n uint64) uint64 { return n * uint64(95+rng.IntN(11)) / 100 }
								c.inflight, c.prefill, c.decode = 30, wobble(9000), wobble(1200)
								c.epoch = uint64(step + 1)
								c.sent = now.UnixNano()
								refresh := int64(time.Second)
								if !band {
									refresh = 0
								}
								o := banded(last[i], has[i], *c, now, refresh)
								// Sent when what it publishes changed (all but sent, the control
								// plane's own record of when).
								q := o
								q.sent = last[i].sent
								if !has[i] || q != last[i] {
									sent++
									if push == "workers" {
										w := workerResource(i, o)
										bytes += deltaSize(b, w.GetId(), w)
										resources++
									} else {
										dirty[uint32(i/xds.LoadsShard)] = true
									}
								}
								last[i], has[i] = o, true
							}
							for shard := range dirty {
								var ls []xds.IndexedLoad
								for i := int(shard) * xds.LoadsShard; i < min(int(shard+1)*xds.LoadsShard, workers); i++ {
									ls = append(ls, xds.IndexedLoad{Index: uint32(i), ID: workerResource(i, last[i]).GetId(), Load: workerResource(i, last[i]).GetLoad()})
								}
								l, err := xds.PackLoads(shard, ls)
								if err != nil {
									b.Fatal(err)
								}
								bytes += deltaSize(b, xds.LoadsName(shard), l)
								resources++
							}
						}
					}
					b.ReportMetric(float64(bytes)/seconds, "bytes/s/proxy")
					b.ReportMetric(float64(sent)/seconds, "workers/s/proxy")
					b.ReportMetric(float64(resources)/seconds, "resources/s/proxy")
				})
			}
		}
	}
}

// deltaSize is the bytes resource m named name takes in a delta ADS response: its encoding
// in an Any, its name and its version (the hex SHA-256 go-control-plane's LinearCache gives).
func deltaSize(b *testing.B, name string, m proto.Message) int {
	a, err := anypb.New(m)
	if err != nil {
		b.Fatal(err)
	}
	return proto.Size(&discovery.Resource{Name: name, Version: strings.Repeat("0", 64), Resource: a})
}

// workerResource is worker i's resource as the control plane publishes it, with load o.
func workerResource(i int, o observedLoad) *xdsv1.Worker {
	return &xdsv1.Worker{Id: "vllm-decode-" + strconv.Itoa(i), Url: fmt.Sprintf("http://10.1.%d.%d:8000", i/256, i%256), Model: "openai/gpt-oss-120b",
		Role: xdsv1.Role_ROLE_DECODE, BlockSize: 16, CapacityBlocks: 65536, Engine: "vllm", Slot: uint32(i), Healthy: true,
		MaxNumSeqs: 256, MaxNumBatchedTokens: 8192,
		Load: &xdsv1.Load{Running: o.running, Waiting: o.waiting, KvUsage: o.kv, Inflight: o.inflight, PrefillTokens: o.prefill,
			DecodeBlocks: o.decode, ObservedUnixNano: o.at, Epoch: o.epoch}}
}
