package server

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrelay/kvrelay/xds"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
)

// BenchmarkLoadPush measures what one push of the workers' load sends each proxy, for a
// fleet of 1,000 workers and 100 proxies whose every report changes a share of their
// per-worker loads: with each worker's load naming every proxy's report (reports, as
// before epochs) and with the merge's epoch (epochs: the proxies hear which of their
// reports a merge includes on their load streams, counted here too), and with the merge's
// epoch and the loads in shards (loads: each xds.LoadsShard workers' loads as one Loads
// resource, sent when any of them changed, as the server publishes them). Workers equal to
// what was last published are not sent (the xDS server's delta). The metric is bytes per
// push per proxy, without the delta's framing of each resource.
func BenchmarkLoadPush(b *testing.B) {
	const workers, proxies = 1000, 100
	for _, churn := range []float64{0.01, 0.1, 1} {
		for _, mode := range []string{"reports", "epochs", "loads"} {
			b.Run(fmt.Sprintf("churn=%g/%s", churn, mode), func(b *testing.B) {
				l := newLoadStore(time.Minute, time.Now)
				known := map[string]struct{}{}
				ids := make([]string, workers)
				for i := range ids {
					ids[i] = "vllm-decode-" + strconv.Itoa(i)
					known[ids[i]] = struct{}{}
				}
				l.known.Store(&known)
				rng := rand.New(rand.NewPCG(1, 2))
				shares := make([][]uint32, proxies)
				for p := range shares {
					shares[p] = make([]uint32, workers)
					for w := range shares[p] {
						shares[p][w] = uint32(rng.IntN(3))
					}
					l.subscribe(uint64(p + 1))
				}
				seq := uint64(0)
				report := func() {
					seq++
					for p := range proxies {
						r := &xdsv1.LoadReport{NodeId: "proxy-" + strconv.Itoa(p), Seq: seq}
						for w, n := range shares[p] {
							if rng.Float64() < churn {
								n = uint32(rng.IntN(3))
								shares[p][w] = n
							}
							if n > 0 {
								r.Workers = append(r.Workers, &xdsv1.WorkerLoad{WorkerId: ids[w], Inflight: n, PrefillTokens: uint64(n) * 512, DecodeBlocks: uint64(n) * 40})
							}
						}
						l.put(r.NodeId, uint64(p+1), r)
					}
				}
				published := map[string]*xdsv1.Worker{}
				push := func() (bytes int) {
					var sums map[string]WorkerLoad
					var epochs map[string]uint64
					var reports []*xdsv1.ReportSeq
					if mode != "reports" {
						sums, epochs = l.mergedEpochs()
						bytes += proto.Size(&xdsv1.LoadReportAck{IntervalMs: 100, Epoch: 1 << 50, IncludedSeq: seq}) // each proxy hears of its own report
					} else {
						sums, reports = l.mergedReports()
					}
					dirty := map[uint32]bool{}
					for i, id := range ids {
						s := sums[id]
						res := &xdsv1.Worker{Id: id, Url: "http://10.1.2.3:8000", Model: "openai/gpt-oss-120b", Role: xdsv1.Role_ROLE_DECODE, BlockSize: 16,
							CapacityBlocks: 65536, Engine: "vllm", Slot: 7, Healthy: true, MaxNumSeqs: 256, MaxNumBatchedTokens: 8192,
							Load: &xdsv1.Load{Running: 40, Waiting: 2, KvUsage: 0.5, Inflight: s.Inflight, PrefillTokens: s.PrefillTokens,
								DecodeBlocks: s.DecodeBlocks, ObservedUnixNano: 1, Reports: reports, Epoch: epochs[id]}}
						if proto.Equal(published[id], res) {
							continue
						}
						published[id] = res
						if mode == "loads" {
							dirty[uint32(i/xds.LoadsShard)] = true
							continue
						}
						bytes += proto.Size(res)
					}
					for shard := range dirty {
						var ls []xds.IndexedLoad
						for i := int(shard) * xds.LoadsShard; i < min(int(shard+1)*xds.LoadsShard, workers); i++ {
							ls = append(ls, xds.IndexedLoad{Index: uint32(i), ID: ids[i], Load: published[ids[i]].GetLoad()})
						}
						packed, err := xds.PackLoads(shard, ls)
						if err != nil {
							b.Fatal(err)
						}
						bytes += proto.Size(packed)
					}
					return bytes
				}
				report()
				push()
				total := 0
				b.ResetTimer()
				for b.Loop() {
					report()
					total += push()
				}
				b.ReportMetric(float64(total)/float64(b.N), "bytes/push/proxy")
			})
		}
	}
}
