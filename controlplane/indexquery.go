package controlplane

import (
	"context"
	"math/bits"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrelay/kvrelay/controlplane/kvindex"
	xdsv1 "github.com/kvrelay/kvrelay/xds/api/v1"
	"github.com/kvrelay/kvrelay/xds/blockset"
	"github.com/kvrelay/kvrelay/xds/journal"
)

// MaxQueryBlocks bounds the prompt blocks an index query may name (1M tokens of 16-token
// blocks); longer prompts are refused, not matched in part.
const MaxQueryBlocks = 1 << 16

// indexQuery serves IndexQuery from the index: the proxies that keep no replica ask it about
// each request's prompt.
type indexQuery struct {
	xdsv1.UnimplementedIndexQueryServer
	x       *kvindex.Index
	ready   <-chan struct{}
	scratch sync.Pool // *queryScratch
	answers *prometheus.CounterVec
	// answered, refused and unavailable are answers' series, resolved once.
	answered, refused, unavailable prometheus.Counter
}

type queryScratch struct {
	overlap []float64
	lower   []blockset.Lower
}

// unweighted counts every tier's block as one: the answer gives each run's length and its
// blocks below GPU memory, and the proxy weighs them with its routing policy's weights.
var unweighted = kvindex.Weights{1, 1, 1, 1}

func newIndexQuery(x *kvindex.Index, ready <-chan struct{}) *indexQuery {
	q := &indexQuery{x: x, ready: ready, answers: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvrelay_controlplane_index_queries_total",
		Help: "Index queries of proxies that keep no replica, by result: answered; refused (malformed); unavailable (before ingestion caught up).",
	}, []string{"result"})}
	q.answered, q.refused, q.unavailable = q.answers.WithLabelValues("answered"), q.answers.WithLabelValues("refused"), q.answers.WithLabelValues("unavailable")
	q.scratch.New = func() any { return &queryScratch{} }
	return q
}

// Match answers how long a run of the prompt each slot asked about holds.
func (q *indexQuery) Match(_ context.Context, req *xdsv1.IndexMatchRequest) (*xdsv1.IndexMatchResponse, error) {
	if len(req.Hashes) > MaxQueryBlocks {
		q.refused.Inc()
		return nil, status.Errorf(codes.InvalidArgument, "index query: %d blocks, more than %d", len(req.Hashes), MaxQueryBlocks)
	}
	if len(req.Slots) > journal.MaxSlots/8 {
		q.refused.Inc()
		return nil, status.Errorf(codes.InvalidArgument, "index query: a slot bitmap of %d bytes, past the %d slots an index has", len(req.Slots), journal.MaxSlots)
	}
	select {
	case <-q.ready:
	default:
		q.unavailable.Inc()
		return nil, status.Error(codes.Unavailable, "index query: the control plane is still catching up with the engines' KV events")
	}
	q.answered.Inc()
	resp := &xdsv1.IndexMatchResponse{}
	n := 0 // one past the last slot asked about
	for i := len(req.Slots) - 1; i >= 0; i-- {
		if b := req.Slots[i]; b != 0 {
			n = 8*i + bits.Len8(b)
			break
		}
	}
	// Slots past the index's hold nothing: the scratch is the index's size at most, not the
	// bitmap's.
	if n = min(n, q.x.Slots()); n == 0 || len(req.Hashes) == 0 {
		return resp, nil
	}
	sc := q.scratch.Get().(*queryScratch)
	defer q.scratch.Put(sc)
	if cap(sc.overlap) < n {
		sc.overlap, sc.lower = make([]float64, n), make([]blockset.Lower, n)
	}
	overlap, lower := sc.overlap[:n], sc.lower[:n]
	if q.x.MatchTiers(req.Hashes, overlap, lower, unweighted) == 0 {
		return resp, nil
	}
	asked := func(i int) bool { return overlap[i] != 0 && req.Slots[i/8]&(1<<(i%8)) != 0 }
	k := 0
	for i := range overlap {
		if asked(i) {
			k++
		}
	}
	resp.Slot, resp.Run = make([]uint32, 0, k), make([]uint32, 0, k)
	resp.Host, resp.Disk, resp.Shared = make([]uint32, 0, k), make([]uint32, 0, k), make([]uint32, 0, k)
	for i, o := range overlap {
		if !asked(i) {
			continue
		}
		resp.Slot = append(resp.Slot, uint32(i))
		resp.Run = append(resp.Run, uint32(o))
		resp.Host = append(resp.Host, uint32(lower[i].Host))
		resp.Disk = append(resp.Disk, uint32(lower[i].Disk))
		resp.Shared = append(resp.Shared, uint32(lower[i].Shared))
	}
	return resp, nil
}
