package route

// PrefillCost is the prefill term of the KV cost: the prompt blocks worker w would have to
// compute (blocks it does not cache) times Weight (the policy's overlap_weight), plus the
// blocks of its prefill backlog (Worker.PrefillBacklog) times QueueWeight (queue_weight).
type PrefillCost struct{ Weight, QueueWeight float64 }

func (PrefillCost) Name() string { return "prefill" }

func (s PrefillCost) Score(req *Request, ws []*Worker, costs []float64) {
	now := req.clock()
	for i, w := range ws {
		bs := max(w.BlockSize, 1)
		uncached := float64(req.PromptBlocks(bs)) - req.Overlap(w)
		active := float64(w.PrefillBacklog(now)) / float64(bs)
		costs[i] += s.Weight*max(uncached, 0) + s.QueueWeight*active
	}
}

// DecodeCost is the decode term of the KV cost: the KV blocks in flight on the worker, times
// Weight.
type DecodeCost struct{ Weight float64 }

func (DecodeCost) Name() string { return "decode" }

func (s DecodeCost) Score(_ *Request, ws []*Worker, costs []float64) {
	for i, w := range ws {
		costs[i] += s.Weight * float64(w.DecodeBlocks())
	}
}

// LoadCost is the number of requests on the worker, times Weight.
type LoadCost struct{ Weight float64 }

func (LoadCost) Name() string { return "load" }

func (s LoadCost) Score(_ *Request, ws []*Worker, costs []float64) {
	for i, w := range ws {
		costs[i] += s.Weight * float64(w.Load())
	}
}

var (
	_ Scorer = PrefillCost{}
	_ Scorer = DecodeCost{}
	_ Scorer = LoadCost{}
)
