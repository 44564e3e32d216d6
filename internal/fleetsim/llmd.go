package fleetsim

import (
	"container/heap"
	"container/list"
	"math"
	"time"
)

// alone is f's TTFT from now had it been submitted to e now and no request arrived anywhere
// after it, without the engine's noise: the part of its TTFT that the engine's state at the
// decision sets. Requests waiting ahead of f start in order, each storing its prompt's
// blocks; nothing is evicted meanwhile.
func (e *llmdEngine) alone(f *flight) time.Duration {
	type slot struct {
		at   int64
		left int
	}
	now := e.fl.vt
	run := make([]slot, 0, e.cfg.MaxNumSeqs+1)
	for _, r := range e.running {
		run = append(run, slot{r.at, r.left})
	}
	queue := make([]*flight, 0, len(e.waiting)+1)
	for _, r := range e.waiting {
		queue = append(queue, r.f)
	}
	queue = append(queue, f)
	stored := map[uint64]bool{}
	t := now
	for {
		for len(run) < e.cfg.MaxNumSeqs && len(queue) > 0 {
			q := queue[0]
			queue = queue[1:]
			n := 0
			for _, h := range q.hashes {
				if _, ok := e.blocks[h]; !ok && !stored[h] {
					break
				}
				n++
			}
			run = append(run, slot{left: max(q.req.MaxTokens, 1)})
			fac := e.factor(len(run))
			uncached := max(len(q.tokens)-n*e.fl.cfg.BlockSize, 0)
			at := t + int64(float64(e.cfg.PrefillOverhead)*fac) + int64(float64(e.cfg.PrefillPerToken)*fac)*int64(uncached)
			if q == f {
				return time.Duration(at - now)
			}
			run[len(run)-1].at = at
			for _, h := range q.hashes {
				stored[h] = true
			}
		}
		if len(run) == 0 {
			return 0 // not reached: f starts once a slot is free
		}
		i := 0
		for j := range run {
			if run[j].at < run[i].at {
				i = j
			}
		}
		t = run[i].at
		if run[i].left--; run[i].left > 0 {
			run[i].at += int64(float64(e.cfg.InterToken) * e.factor(len(run)))
		} else {
			run = append(run[:i], run[i+1:]...)
		}
	}
}

// LLMDConfig models llm-d-inference-sim's per-token latency calculator, as hack/bench-llmd
// runs it: MaxNumSeqs requests run at once and the rest wait in arrival order; a request that
// starts with r requests running (itself included) takes (PrefillOverhead + PrefillPerToken ·
// uncached prompt tokens) · f(r) to its first token, and each later token InterToken · f(r)
// at the r of that moment, with f(r) = 1 + (LoadFactor − 1)·(r − 1)/(MaxNumSeqs − 1); both
// with normal noise of their StdDev. Its prefix cache holds CacheBlocks blocks, the running
// requests' pinned, the rest evicted least recently used first.
type LLMDConfig struct {
	MaxNumSeqs                   int
	PrefillOverhead              time.Duration
	PrefillPerToken              time.Duration
	PrefillStdDev                time.Duration
	InterToken, InterTokenStdDev time.Duration
	LoadFactor                   float64
	CacheBlocks                  int
}

// BenchLLMD is the engine hack/bench-llmd runs: 4 slots, 25 ms + 60 µs per uncached token,
// 15 ms between tokens, both up to ×2 as the slots fill, a 1024-block cache.
func BenchLLMD() LLMDConfig {
	return LLMDConfig{MaxNumSeqs: 4, PrefillOverhead: 25 * time.Millisecond, PrefillPerToken: 60 * time.Microsecond,
		PrefillStdDev: 2 * time.Millisecond, InterToken: 15 * time.Millisecond, InterTokenStdDev: time.Millisecond,
		LoadFactor: 2, CacheBlocks: 1024}
}

type llmdEngine struct {
	fl      *fleet
	idx     int
	cfg     LLMDConfig
	running []*llmdReq
	waiting []*llmdReq
	ev      llmdHeap
	// The prefix cache: an LRU list of blocks; a block's refs are the running requests
	// holding it (pinned).
	lru    *list.List
	blocks map[uint64]*list.Element
	refs   map[uint64]int
}

type llmdReq struct {
	f      *flight
	at     int64 // next event: its first token, then each next token
	left   int   // tokens still to come
	cached int
	// submitted is when it reached the engine.
	submitted int64
	out       []uint32
	heapIdx   int
}

func newLLMDEngine(fl *fleet, idx int, cfg LLMDConfig) (*llmdEngine, error) {
	if cfg.MaxNumSeqs <= 0 {
		cfg.MaxNumSeqs = 4
	}
	if cfg.LoadFactor <= 0 {
		cfg.LoadFactor = 1
	}
	return &llmdEngine{fl: fl, idx: idx, cfg: cfg, lru: list.New(), blocks: map[uint64]*list.Element{}, refs: map[uint64]int{}}, nil
}

func (e *llmdEngine) factor(r int) float64 {
	if e.cfg.MaxNumSeqs <= 1 {
		return 1
	}
	return 1 + (e.cfg.LoadFactor-1)*float64(r-1)/float64(e.cfg.MaxNumSeqs-1)
}

func (e *llmdEngine) noisy(d time.Duration, sd time.Duration) int64 {
	v := float64(d)
	if sd > 0 {
		v += e.fl.rng.NormFloat64() * float64(sd)
	}
	return int64(max(v, 0))
}

func (e *llmdEngine) submit(f *flight) error {
	r := &llmdReq{f: f, left: max(f.req.MaxTokens, 1), submitted: e.fl.vt}
	if len(e.running) < e.cfg.MaxNumSeqs {
		e.start(r, e.fl.vt)
	} else {
		e.waiting = append(e.waiting, r)
	}
	return nil
}

// start runs r from t: it looks up its prompt in the cache, holds its blocks, and schedules
// its first token.
func (e *llmdEngine) start(r *llmdReq, t int64) {
	e.running = append(e.running, r)
	e.fl.recs[r.f.rec].Waited = time.Duration(t - r.submitted)
	hashes := r.f.hashes
	n := 0
	for _, h := range hashes {
		if _, ok := e.blocks[h]; !ok {
			break
		}
		n++
	}
	r.cached = n * e.fl.cfg.BlockSize
	e.hold(hashes)
	f := e.factor(len(e.running))
	uncached := max(len(r.f.tokens)-r.cached, 0)
	d := time.Duration(float64(e.cfg.PrefillOverhead)*f) + time.Duration(float64(e.cfg.PrefillPerToken)*f)*time.Duration(uncached)
	r.at = t + e.noisy(d, e.cfg.PrefillStdDev)
	heap.Push(&e.ev, r)
}

// hold stores the prompt's blocks (most recently used) and pins them.
func (e *llmdEngine) hold(hashes []uint64) {
	var stored []uint64
	for _, h := range hashes {
		if el, ok := e.blocks[h]; ok {
			e.lru.MoveToFront(el)
		} else {
			e.blocks[h] = e.lru.PushFront(h)
			stored = append(stored, h)
		}
		e.refs[h]++
	}
	if x, ok := e.fl.index.(*exactIndex); ok && len(stored) > 0 {
		x.store(e.idx, stored)
	}
	e.evict()
}

func (e *llmdEngine) release(hashes []uint64) {
	for _, h := range hashes {
		if e.refs[h]--; e.refs[h] <= 0 {
			delete(e.refs, h)
		}
	}
	e.evict()
}

// evict drops the least recently used unpinned blocks past the capacity.
func (e *llmdEngine) evict() {
	if e.cfg.CacheBlocks <= 0 {
		return
	}
	var removed []uint64
	for el := e.lru.Back(); el != nil && e.lru.Len() > e.cfg.CacheBlocks; {
		prev := el.Prev()
		h := el.Value.(uint64)
		if e.refs[h] == 0 {
			e.lru.Remove(el)
			delete(e.blocks, h)
			removed = append(removed, h)
		}
		el = prev
	}
	if x, ok := e.fl.index.(*exactIndex); ok && len(removed) > 0 {
		x.remove(e.idx, removed)
	}
}

func (e *llmdEngine) next() int64 {
	if len(e.ev) == 0 {
		return math.MaxInt64
	}
	return e.ev[0].at
}

func (e *llmdEngine) advance(t int64) {
	for len(e.ev) > 0 && e.ev[0].at <= t {
		r := heap.Pop(&e.ev).(*llmdReq)
		saved := e.fl.vt
		e.fl.vt = r.at
		r.out = append(r.out, e.fl.filler[len(r.out)%len(e.fl.filler)])
		r.left--
		if len(r.out) == 1 {
			r.f.out = r.out
			r.f.firstToken()
		}
		if r.left > 0 {
			r.at += e.noisy(time.Duration(float64(e.cfg.InterToken)*e.factor(len(e.running))), e.cfg.InterTokenStdDev)
			heap.Push(&e.ev, r)
		} else {
			e.finish(r)
		}
		e.fl.vt = max(saved, e.fl.vt)
	}
}

func (e *llmdEngine) finish(r *llmdReq) {
	for i, o := range e.running {
		if o == r {
			e.running = append(e.running[:i], e.running[i+1:]...)
			break
		}
	}
	e.release(r.f.hashes)
	if len(e.waiting) > 0 && len(e.running) < e.cfg.MaxNumSeqs {
		w := e.waiting[0]
		e.waiting = e.waiting[1:]
		e.start(w, e.fl.vt)
	}
	r.f.out = r.out
	r.f.done(r.out, r.cached)
}

func (e *llmdEngine) load() (int, int, float64) {
	kv := 0.0
	if e.cfg.CacheBlocks > 0 {
		kv = float64(len(e.refs)) / float64(e.cfg.CacheBlocks)
	}
	return len(e.running), len(e.waiting), kv
}

type llmdHeap []*llmdReq

func (h llmdHeap) Len() int           { return len(h) }
func (h llmdHeap) Less(i, j int) bool { return h[i].at < h[j].at }
func (h llmdHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx, h[j].heapIdx = i, j
}
func (h *llmdHeap) Push(x any) {
	r := x.(*llmdReq)
	r.heapIdx = len(*h)
	*h = append(*h, r)
}
func (h *llmdHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
